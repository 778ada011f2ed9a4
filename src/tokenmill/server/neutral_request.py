"""The one shape every API module turns its body into before the engine runs it: the sampling, with the model's
recommended defaults merged (sampling_defaults.over_defaults), and what the request said about its output's length
in neutral terms (OutputLength), which output_limits.OutputLimits.settle turns into max_tokens, once, for every API.

Each API's protocol class says its own words once: `sampling_params(defaults)` and `output_length()`; the API module
wraps them in a NeutralRequest and hands it to Generation (the one engine call), which settles max_tokens and
answers the engine's 400s in the API's field names (`field_names`).
"""

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from tokenmill.errors import InvalidParameterError
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import BeamSearchParams, SamplingParams


@dataclass(frozen=True)
class OutputLength:
    """What a request asked of its output's length, before the server's limits and the context decide it."""

    asked: int | None = None  # the tokens it names (None: it names none)
    api_default: int | None = None  # the API's own default where it names none (OpenAI's completions: 16)
    prompt_only: bool = False  # no output shown (echo with max_tokens 0, n_predict 0): one token made, not shown
    context_limit: int | None = None  # prompt and output within this many tokens, the output cut to fit (num_ctx)


@dataclass(frozen=True)
class NeutralRequest:
    """A request as the engine will run it, whichever API it came through. `params.max_tokens` is left unset (None)
    by every builder: Generation replaces it with what OutputLimits.settle decides from `output`."""

    params: SamplingParams | BeamSearchParams | PoolingParams
    output: OutputLength = OutputLength()
    # the engine's parameter names -> the field the user sent (chat's top_logprobs is the engine's logprobs)
    field_names: Mapping[str, str] = field(default_factory=dict)
    lora_name: str | None = None  # the LoRA adapter the request's model names (ServerState.adapter_for)

    def engine_params(self) -> SamplingParams | BeamSearchParams | PoolingParams:
        """`params` with the request's LoRA adapter; an adapter with a beam search or an embedding is a 400."""
        if self.lora_name is None:
            return self.params
        if not isinstance(self.params, SamplingParams):
            raise InvalidParameterError("a LoRA adapter serves sampled generations only (not beam search)", "model")
        return dataclasses.replace(self.params, lora_name=self.lora_name)

    def with_params(self, params: SamplingParams | BeamSearchParams | PoolingParams) -> "NeutralRequest":
        return dataclasses.replace(self, params=params)

    def in_api_terms(self, exc: InvalidParameterError) -> InvalidParameterError:
        """`exc` naming the field the user sent instead of the engine's parameter (the same error where they agree)."""
        sent = self.field_names.get(exc.param or "")
        if sent is None:
            return exc
        message = str(exc)
        if message.startswith(f"{exc.param} "):
            message = sent + message[len(exc.param or "") :]
        return type(exc)(message, sent)
