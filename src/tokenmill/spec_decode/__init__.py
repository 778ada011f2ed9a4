"""Speculative decoding: cheap proposals for a sequence's next tokens, all verified in one forward pass of the
model (config/speculative.py: what the user asks for; ngram.py: proposals looked up in the sequence's own tokens;
draft_model.py: proposals of a smaller model with the same tokenizer, and its cache's ledger). The verification
itself is the engine's sampling, row by row (spec_decode/speculator.py, verify)."""

from tokenmill.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
