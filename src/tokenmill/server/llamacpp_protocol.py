"""The request bodies of llama.cpp's own API (llama-server's /completion, /apply-template, /slots actions), as its
server reads them: names, defaults and the shapes a prompt may take."""

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tokenmill.sampling_params import MAX_TEMPERATURE
from tokenmill.server.neutral_request import OutputLength
from tokenmill.server.protocol import STRICT, APIRequest, ChatMessage, Seed

# a prompt: text, token ids, ids and text mixed in one list, {"prompt_string": text}, or a list of those (a batch)
LlamaPrompt = str | dict[str, Any] | list[Any]
# llama.cpp's logit_bias: [[token id or text, bias or false], ...] or {token id or text: bias or false}
LlamaLogitBias = list[list[Any]] | dict[str, float | bool]


class LlamaSampling(BaseModel):
    """The sampling fields llama-server's /completion, /infill and POST /props share, by its names (unset: None, the
    server's default)."""

    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repeat_penalty: Annotated[float, Field(gt=0)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Seed | None = None

    def sampling_given(self) -> dict[str, Any]:
        """The fields under SamplingParams' names (the seed apart: each endpoint has its rule for it)."""
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "repetition_penalty": self.repeat_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
        }


class LlamaCompletionRequest(APIRequest, LlamaSampling):
    """POST /completion (and /completions): llama-server's own completion, not OpenAI's."""

    model: str | None = None
    prompt: LlamaPrompt = ""
    n_predict: Annotated[int, Field(ge=-1)] | None = None  # -1: until a stop or the context's end
    max_tokens: Annotated[int, Field(ge=-1)] | None = None  # llama-server reads it when n_predict is absent
    stop: list[str] | None = None
    ignore_eos: bool = False
    logit_bias: LlamaLogitBias | None = None
    n_probs: Annotated[int, Field(ge=0, le=20)] = 0  # top tokens' log-probabilities with each token
    post_sampling_probs: bool = False
    stream: bool = False
    return_progress: bool = False  # streamed: prompt_progress events while the prompt is computed
    timings_per_token: bool = False  # streamed: timings in every event, not only the last
    cache_prompt: bool = True  # False: the prompt is computed anew, not read from the prefix cache
    id_slot: Annotated[int, Field(ge=-1)] = -1  # -1: any idle slot
    return_tokens: bool = False  # the generated token ids in the (final) answer
    response_fields: list[str] | None = None  # only these fields ("a/b" reaches into objects) in the answer

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    def output_length(self) -> OutputLength:
        """n_predict, else max_tokens: -1 or none is the server's default (--max-tokens-default, llama-server's
        --n-predict), else up to the context; 0 the prompt only (one token made, not shown)."""
        asked = self.n_predict if self.n_predict is not None else self.max_tokens
        return OutputLength(asked if asked is not None and asked > 0 else None, prompt_only=asked == 0)


class ApplyTemplateRequest(APIRequest):
    """POST /apply-template: the chat template over the messages, as llama-server renders it (no generation)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class SlotFileRequest(BaseModel):
    """The body of POST /slots/{id}?action=save|restore: a file name inside --slot-save-path."""

    model_config = ConfigDict(**STRICT, extra="allow")

    filename: str = ""


class PropsParams(LlamaSampling):
    """The /completion defaults POST /props may change."""

    model_config = ConfigDict(**STRICT, extra="forbid")

    n_predict: Annotated[int, Field(ge=-1)] | None = None


class PropsSettings(BaseModel):
    model_config = ConfigDict(**STRICT, extra="forbid")

    params: PropsParams


class PropsUpdate(BaseModel):
    """POST /props: {"default_generation_settings": {"params": {...}}}, as GET /props shows them."""

    model_config = ConfigDict(**STRICT, extra="forbid")

    default_generation_settings: PropsSettings

    def params(self) -> dict[str, Any]:
        return self.default_generation_settings.params.model_dump(exclude_none=True)
