"""Structured output: constraints on what a request may generate (JSON schema, regex, choice, grammar), enforced
while sampling by masking the tokens the constraint does not allow (tokenmill/structured/grammars.py)."""

from tokenmill.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
