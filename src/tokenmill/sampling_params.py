"""Per-request sampling parameters (vLLM's names and defaults), validated when made. No torch here."""

from dataclasses import dataclass, field
from typing import Any, Literal

from tokenmill.errors import InvalidParameterError
from tokenmill.structured.params import StructuredOutputsParams

# the ranges every parameter is checked against (the server's OpenAPI schema states the same ones)
MAX_N = 128
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit: the default of the engine's max_logprobs, and a beam search's
# each beam of a beam search asks for 2 * beam_width log-probabilities a round, at most MAX_LOGPROBS (as vLLM's
# max_logprobs bounds its beam width)
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY]
MAX_LOGIT_BIAS = 100.0  # biases lie in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]
SEED_RANGE = (-(2**63), 2**64 - 1)
MAX_LENGTH_PENALTY = 10.0  # a beam search's length_penalty lies in [-10, 10] (HF's usual values: 0.6 to 2)
MAX_LOGPROB_TOKEN_IDS = 128  # the most token ids `logprob_token_ids` may list (vLLM's bound)
TRUNCATION_SIDES = ("left", "right")


@dataclass(frozen=True)
class ThinkingBudget:
    """At most `tokens` tokens of thinking: then the sampler writes `end_ids` (the tag that closes the thinking).
    `start_ids`: the tag that opens it, when the reply opens its own block (None: the prompt opened it)."""

    tokens: int
    end_ids: list[int]
    start_ids: list[int] | None = None


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or output
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the model's length limit
    min_tokens: int = 0  # EOS and stop tokens are banned until this many tokens were generated
    # top-k log-probabilities per generated token (the sampled one always included); -1: the whole vocabulary. At
    # most the engine's max_logprobs (20 by default)
    logprobs: int | None = None
    # logprobs of the distribution the token is drawn from (after penalties, bias, temperature, top-k, top-p and
    # min-p; a greedy token's is 1; tokens it cannot draw are left out): vLLM's processed_logprobs, llama.cpp's
    # post_sampling_probs. False: the model's own distribution
    processed_logprobs: bool = False
    # an output after each step that computes part of the prompt, not only once tokens come (llama.cpp's
    # return_progress): RequestOutput.num_computed_prompt_tokens says how far the prompt is
    report_prompt_progress: bool = False
    prompt_logprobs: int | None = None  # the same for every prompt token
    # vLLM's: the log-probabilities of these tokens at every generated position (with the sampled one's, and the
    # top `logprobs` where that is set too), whatever their rank
    logprob_token_ids: list[int] | None = None
    # vLLM's: only these tokens can be sampled (every other one is masked, as a structured output masks)
    allowed_token_ids: list[int] | None = None
    # vLLM's: False opts this request out of the engine's watermark (watermark_config); None or True: watermarked
    # where the engine has one (greedy requests never are)
    watermarking: bool | None = None
    # vLLM's: the prompt cut to this many tokens before it runs (-1: as many as the context allows, max_model_len - 1),
    # keeping its end ("left": the start is cut, the default for generation) or its start ("right")
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] = "left"
    # compute the whole prompt, reading nothing from the prefix cache (llama.cpp's cache_prompt: false)
    skip_reading_prefix_cache: bool = False
    skip_special_tokens: bool = True
    # what the output must match (JSON schema, regex, choice, grammar): tokenmill.structured.StructuredOutputsParams
    # or a dict of its fields
    structured_outputs: "StructuredOutputsParams | dict[str, Any] | None" = None
    # vLLM's: arguments for the engine's custom logits processors (--logits-processors; the server's `vllm_xargs`)
    extra_args: dict[str, Any] | None = None
    thinking_budget: ThinkingBudget | None = None  # a reasoning model's thinking cut off at a number of tokens
    # the LoRA adapter to generate with, by its served name (vLLM's lora_request); None: the base model
    lora_name: str | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _int_range("n", self.n, 1, MAX_N)
        _float_range("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _float_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _int_range("top_k", self.top_k, -1, None)
        _float_range("min_p", self.min_p, 0.0, 1.0)
        _float_range("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, low_open=True)
        _float_range("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _float_range("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        if self.max_tokens is not None:
            _int_range("max_tokens", self.max_tokens, 1, None)
        _int_range("min_tokens", self.min_tokens, 0, None)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParameterError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})", "min_tokens"
            )
        if self.seed is not None:
            _int_range("seed", self.seed, *SEED_RANGE)
        for name in ("logprobs", "prompt_logprobs"):  # -1: the whole vocabulary; the engine's max_logprobs bounds both
            value = getattr(self, name)
            if value is not None:
                _int_range(name, value, -1, None)
        for name in ("logprob_token_ids", "allowed_token_ids"):
            ids = getattr(self, name)
            if ids is not None:
                setattr(self, name, _token_id_list(name, ids))
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise InvalidParameterError("allowed_token_ids must list at least one token id", "allowed_token_ids")
        if self.logprob_token_ids is not None and len(self.logprob_token_ids) > MAX_LOGPROB_TOKEN_IDS:
            raise InvalidParameterError(
                f"logprob_token_ids lists {len(self.logprob_token_ids)} tokens; at most {MAX_LOGPROB_TOKEN_IDS}",
                "logprob_token_ids",
            )
        check_truncation(self.truncate_prompt_tokens, self.truncation_side)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidParameterError("logit_bias must map token ids to biases", "logit_bias")
            bias = {}
            for key, value in self.logit_bias.items():
                try:
                    token = int(key)
                except (TypeError, ValueError) as exc:
                    raise InvalidParameterError(f"logit_bias key {key!r} is not a token id", "logit_bias") from exc
                _float_range("logit_bias", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
                bias[token] = float(value)
            self.logit_bias = bias
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        elif isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop):
            self.stop_strings = list(self.stop)
        else:
            raise InvalidParameterError("stop must be a string or a list of strings", "stop")
        if any(s == "" for s in self.stop_strings):
            raise InvalidParameterError("stop strings must not be empty", "stop")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) for t in self.stop_token_ids):
                raise InvalidParameterError("stop_token_ids must be a list of token ids", "stop_token_ids")
            negative = [t for t in self.stop_token_ids if t < 0]
            if negative:
                raise InvalidParameterError(
                    f"stop_token_ids must be token ids (0 or more), got {negative[0]}", "stop_token_ids"
                )
        if self.thinking_budget is not None:
            _int_range("thinking_budget", self.thinking_budget.tokens, 1, None)
            if not self.thinking_budget.end_ids:
                raise InvalidParameterError("a thinking budget needs the tokens that end the thinking", "thinking")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise InvalidParameterError("extra_args must be an object", "extra_args")
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:
                raise InvalidParameterError(f"structured_outputs: {exc}", "structured_outputs") from exc
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidParameterError("structured_outputs must be a StructuredOutputsParams", "structured_outputs")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate_token_ids(self, vocab_size: int) -> None:
        """Token ids named by the parameters must exist in the model's vocabulary."""
        named = (
            ("logit_bias", list(self.logit_bias or ())),
            ("stop_token_ids", self.stop_token_ids or []),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("logprob_token_ids", self.logprob_token_ids or []),
        )
        for name, ids in named:
            for token in ids:
                if not 0 <= token < vocab_size:
                    raise InvalidParameterError(
                        f"{name}: token id {token} is outside the vocabulary 0..{vocab_size - 1}", name
                    )


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters (`LLM.beam_search`, the server's `use_beam_search`): `beam_width` beams, each
    round extended by one token, for at most `max_tokens` rounds (None: up to the model's length limit); a beam
    ends at an end-of-sequence token unless `ignore_eos`. Finished and live beams are ranked by cumulative
    log-probability / (generated tokens, a final EOS counted) ** `length_penalty`: above 0 favours longer beams,
    below 0 shorter ones. `include_stop_str_in_output`: a final EOS stays in the server's token ids. `temperature`
    is taken, as vLLM's, and changes nothing here: beams are ranked by the model's own log-probabilities.
    `logprobs`: the top-k shown per token in the server's answers (beams always see 2 * beam_width)."""

    beam_width: int
    max_tokens: int | None
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None

    def __post_init__(self) -> None:
        _int_range("beam_width", self.beam_width, 1, MAX_BEAM_WIDTH)
        if self.max_tokens is not None:
            _int_range("max_tokens", self.max_tokens, 1, None)
        _float_range("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _float_range("length_penalty", self.length_penalty, -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY)
        if self.logprobs is not None:
            _int_range("logprobs", self.logprobs, 0, MAX_LOGPROBS)

    @property
    def n(self) -> int:
        """The outputs per prompt, as SamplingParams.n: the beam width."""
        return self.beam_width

    @property
    def structured_outputs(self) -> None:
        """Beam search follows no constraint (vLLM's offline grammar beams are not implemented)."""
        return None


def check_truncation(tokens: Any, side: Any) -> None:
    """truncate_prompt_tokens (None, -1 or at least 1) and truncation_side ("left" or "right"), as a request's
    parameters hold them (SamplingParams' and PoolingParams')."""
    if tokens is not None:
        _int_range("truncate_prompt_tokens", tokens, -1, None)
        if tokens == 0:
            raise InvalidParameterError(
                "truncate_prompt_tokens must be at least 1 (or -1: as many as the context allows), got 0",
                "truncate_prompt_tokens",
            )
    if side not in TRUNCATION_SIDES:
        raise InvalidParameterError(f"truncation_side must be 'left' or 'right', got {side!r}", "truncation_side")


def truncation_limit(tokens: int | None, max_model_len: int) -> int | None:
    """How many prompt tokens truncate_prompt_tokens keeps on an engine of this max_model_len (-1: all that leave
    room for one output token); None: no truncation. More than max_model_len: 400, as vLLM's."""
    if tokens is None:
        return None
    if tokens > max_model_len:
        raise InvalidParameterError(
            f"truncate_prompt_tokens ({tokens}) cannot be more than max_model_len ({max_model_len})",
            "truncate_prompt_tokens",
        )
    return max_model_len - 1 if tokens < 0 else tokens


def _token_id_list(name: str, ids: Any) -> list[int]:
    if not isinstance(ids, list | tuple) or not all(_is_int(t) for t in ids):
        raise InvalidParameterError(f"{name} must be a list of token ids", name)
    negative = [t for t in ids if t < 0]
    if negative:
        raise InvalidParameterError(f"{name} must be token ids (0 or more), got {negative[0]}", name)
    return list(ids)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_range(name: str, value: Any, low: int, high: int | None) -> None:
    if not _is_int(value):
        raise InvalidParameterError(f"{name} must be an integer, got {value!r}", name)
    if value < low or (high is not None and value > high):
        bound = f"at least {low}" if high is None else f"between {low} and {high}"
        raise InvalidParameterError(f"{name} must be {bound}, got {value}", name)


def _float_range(name: str, value: Any, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise InvalidParameterError(f"{name} must be a number, got {value!r}", name)
    if value < low or value > high or (low_open and value == low):
        left = "(" if low_open else "["
        raise InvalidParameterError(f"{name} must be in {left}{low}, {high}], got {value}", name)
