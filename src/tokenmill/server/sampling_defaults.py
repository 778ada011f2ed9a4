"""The one rule every API follows for sampling: what a request sets wins, what it leaves unset (None) takes the
model's recommended value (its generation config's, ServedModel.sampling_defaults), else SamplingParams' own."""

from typing import Any


def over_defaults(defaults: dict[str, Any] | None, given: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams' keyword arguments: `defaults` with the values `given` sets (None: left unset) over them."""
    return {**(defaults or {}), **{name: value for name, value in given.items() if value is not None}}
