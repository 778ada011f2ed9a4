"""Typed errors: every problem a user can cause or fix gets its own class and a message that says what to do."""


class TokenmillError(Exception):
    """Base class of every error tokenmill raises on purpose."""


class ModelFileError(TokenmillError):
    """The model file is missing, unreadable, truncated or not a GGUF file."""


class UnsupportedModelError(TokenmillError):
    """The file is valid GGUF, but uses an architecture, tensor type or setting tokenmill does not implement."""


class InvalidParameterError(TokenmillError, ValueError):
    """A request or sampling parameter is out of range or of the wrong type."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidParameterError):
    """The prompt (plus the tokens asked for) does not fit the model's context or the KV cache."""


class ConstraintError(InvalidParameterError):
    """A structured-output constraint cannot be compiled or followed: llguidance's reason, or the limit it is over
    (its size, its compile time, the matcher's limits)."""


class EngineClosedError(TokenmillError):
    """The engine (or the LLM holding it) was closed; it takes no more requests."""


class CollectiveError(TokenmillError):
    """A collective of a step failed: a tensor-parallel rank died or stopped answering."""
