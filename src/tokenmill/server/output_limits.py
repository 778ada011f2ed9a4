"""The one place the server decides a request's max_tokens, for every API (tests/test_output_limits.py holds the
others to it): what the request asked (OutputLength), else --max-tokens-default, else the model's max_new_tokens,
else the API's own default; 400 above --max-tokens-limit, which also caps a default; Ollama's num_ctx cuts the
output so that prompt and output fit it. What is left unset (None) is the rest of the context, which the engine's
one rule (engine/input_processor.fit_output) settles per prompt and refuses when asked beyond it."""

from dataclasses import dataclass

from tokenmill.errors import PromptTooLongError
from tokenmill.server.errors import APIError
from tokenmill.server.neutral_request import OutputLength


@dataclass(frozen=True)
class OutputLimits:
    """The server's rules for output lengths, as the served model and the server's options set them."""

    default: int | None = None  # --max-tokens-default
    limit: int | None = None  # --max-tokens-limit
    model_default: int | None = None  # the generation config's max_new_tokens
    max_model_len: int | None = None  # the engine's context (None: not loaded yet)

    def settle(self, output: OutputLength, prompt_len: int | None = None) -> int | None:
        """The max_tokens a request runs with (None: the rest of the context). `prompt_len`: its longest prompt's
        tokens, needed only where the request sets a context limit (num_ctx)."""
        if output.prompt_only:
            return 1  # the prompt's computation needs one step, whose token is not shown
        asked = output.asked
        if self.limit is not None and asked is not None and asked > self.limit:
            raise APIError(400, f"max_tokens {asked} is above this server's limit of {self.limit}", param="max_tokens")
        chosen = next((v for v in (asked, self.default, self.model_default) if v is not None), output.api_default)
        if self.limit is not None and (chosen is None or chosen > self.limit):
            chosen = self.limit
        if output.context_limit is None:
            return chosen
        return self._within(output.context_limit, chosen, prompt_len)

    def _within(self, context_limit: int, chosen: int | None, prompt_len: int | None) -> int:
        """`chosen` cut so that the prompt and the output fit `context_limit` tokens (Ollama's num_ctx, at most the
        engine's context); 400 naming num_ctx when the prompt alone does not."""
        if self.max_model_len is not None and context_limit > self.max_model_len:
            raise APIError(
                400,
                f"num_ctx {context_limit} is more than this server's context ({self.max_model_len} tokens)",
                param="num_ctx",
            )
        if prompt_len is None:
            raise ValueError("a context limit is settled against the prompt: pass its length")
        room = context_limit - prompt_len
        if room < 1:
            raise PromptTooLongError(
                f"the prompt has {prompt_len} tokens; num_ctx {context_limit} leaves no room for the output", "num_ctx"
            )
        return min(chosen or room, room)
