"""Request bodies of Ollama's API (/api/chat, /api/generate, /api/embed, /api/show), and its `options` mapped onto
SamplingParams. Every option is honoured or refused with a 400 that names it: the ones that set how Ollama loads a
model (num_gpu, num_thread, ...) are fixed when `tokenmill serve` starts."""

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tokenmill.errors import InvalidParameterError
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.neutral_request import OutputLength
from tokenmill.server.protocol import MAX_EMBEDDING_INPUTS, APIRequest, field_error
from tokenmill.structured.params import StructuredOutputsParams

# Ollama's option -> SamplingParams' field
SAMPLING_OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "stop": "stop",
}
# options whose values here ask for nothing tokenmill does not do (num_keep: tokenmill never drops context, so
# every token is kept; penalize_newline: Ollama itself no longer reads it)
NEUTRAL_OPTIONS: dict[str, tuple[Any, ...] | None] = {
    "mirostat": (0,),
    "typical_p": (1,),
    "tfs_z": (1,),
    "num_keep": None,
    "penalize_newline": None,
}
# how Ollama loads the model: tokenmill's server sets these once, at start
LOAD_OPTIONS = (
    "num_gpu", "main_gpu", "num_thread", "num_batch", "numa", "low_vram", "use_mmap", "use_mlock", "vocab_only",
    "embedding_only", "logits_all", "f16_kv",
)  # fmt: skip


class OllamaRequest(APIRequest):
    model: str
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None  # the model stays loaded for the server's life, whatever this says


class GenerationRequest(OllamaRequest):
    stream: bool = True  # Ollama streams unless told not to
    format: Literal["", "json"] | dict[str, Any] | None = None
    think: bool | str | None = None

    def num_predict(self) -> int:
        """Ollama's output limit: -1 none, -2 to the context's end, 0 nothing (the model is only loaded), or more."""
        value = (self.options or {}).get("num_predict", -1)
        if not isinstance(value, int) or isinstance(value, bool) or value < -2:
            raise InvalidParameterError(
                "num_predict must be -1 (no limit), -2 (to the context's end) or more", "num_predict"
            )
        return value

    def output_length(self) -> OutputLength:
        """num_predict (-1 or -2: none named) and num_ctx, which the output is cut to fit."""
        num_predict = self.num_predict()
        return OutputLength(num_predict if num_predict > 0 else None, context_limit=self.num_ctx())

    def sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        """The options over the model's defaults. max_tokens is left unset: Generation settles it from
        output_length() (output_limits.py)."""
        values = dict(defaults)
        options = dict(self.options or {})
        for name, value in options.items():
            if name in SAMPLING_OPTIONS:
                values[SAMPLING_OPTIONS[name]] = value
            elif name in NEUTRAL_OPTIONS:
                neutral = NEUTRAL_OPTIONS[name]
                if neutral is not None and value not in neutral:
                    raise InvalidParameterError(f"option {name}={value!r} is not supported by this server", name)
            elif name == "repeat_last_n":
                if value != -1 and options.get("repeat_penalty", 1) != 1:
                    raise InvalidParameterError(
                        "repeat_last_n: tokenmill's repeat_penalty covers the whole prompt and output (-1)", name
                    )
            elif name in LOAD_OPTIONS:
                raise InvalidParameterError(
                    f"option {name} sets how the model is loaded; tokenmill sets that when the server starts "
                    "(tokenmill serve --help)",
                    name,
                )
            elif name == "vllm_xargs":  # tokenmill's: arguments for the server's --logits-processors
                if not isinstance(value, dict):
                    raise InvalidParameterError("option vllm_xargs must be an object", name)
                values["extra_args"] = value
            elif name not in ("num_predict", "num_ctx"):
                raise InvalidParameterError(f"unknown option {name!r}", name)
        values["max_tokens"] = None
        return SamplingParams(**values, structured_outputs=self.structured_outputs())

    def template_kwargs(self) -> dict[str, Any]:
        """`think` as the chat templates read it: true or false is enable_thinking (Qwen3's, R1's), a level
        ("low", "medium", "high") is gpt-oss's reasoning_effort (and thinking on)."""
        if self.think is None:
            return {}
        if isinstance(self.think, bool):
            return {"enable_thinking": self.think}
        if self.think not in ("low", "medium", "high"):
            raise InvalidParameterError('think must be true, false, "low", "medium" or "high"', "think")
        return {"enable_thinking": True, "reasoning_effort": self.think}

    def num_ctx(self) -> int | None:
        value = (self.options or {}).get("num_ctx")
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InvalidParameterError("num_ctx must be a positive integer", "num_ctx")
        return value

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if self.format == "json":
            return StructuredOutputsParams(json_object=True, source="format")
        if isinstance(self.format, dict):
            return StructuredOutputsParams(json=self.format, source="format")
        return None


class OllamaToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    function: dict[str, Any]


class OllamaMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[Any] | None = None  # text-only models: refused when any is sent (refuse_unsupported)
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None
    thinking: str | None = None

    def as_chat_message(self) -> dict[str, Any]:
        """As the chat template sees an OpenAI message (a call's arguments as JSON text)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                {"type": "function", "function": {**c.function, "arguments": _json_text(c.function.get("arguments"))}}
                for c in self.tool_calls
            ]
        if self.tool_name is not None:
            message["name"] = self.tool_name
        return message


class ChatRequest(GenerationRequest):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None

    def refuse_unsupported(self) -> None:
        if any(m.images for m in self.messages):
            raise InvalidParameterError("images: this server's models read text only", "messages")


class GenerateRequest(GenerationRequest):
    prompt: str = ""
    suffix: str | None = None  # fill-in-the-middle: refused (llama.cpp's /infill serves it)
    system: str | None = None
    template: str | None = None  # refused: the model's own template renders the prompt
    context: list[Annotated[int, Field(ge=0)]] | None = None  # the tokens of the previous exchange, continued
    raw: bool = False
    images: list[Any] | None = None

    def refuse_unsupported(self) -> None:
        if self.images:
            raise InvalidParameterError("images: this server's models read text only", "images")
        if self.suffix:
            raise InvalidParameterError("suffix (fill-in-the-middle) is served by POST /infill", "suffix")
        if self.template:
            raise InvalidParameterError("template: the model's own chat template renders the prompt", "template")


class EmbedRequest(OllamaRequest):
    input: str | Annotated[list[str], Field(min_length=1)]
    truncate: bool = True  # Ollama's default: a too-long input is cut to the context (false: refused)
    dimensions: Annotated[int, Field(ge=1)] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _at_most_the_limit(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) > MAX_EMBEDDING_INPUTS:
            raise field_error(
                "input", f"{len(value):,} inputs in one call; at most {MAX_EMBEDDING_INPUTS:,} are allowed"
            )
        return value


class LegacyEmbeddingsRequest(OllamaRequest):
    prompt: str


class ShowRequest(APIRequest):
    model: str | None = None
    name: str | None = None  # older clients' name for model
    verbose: bool = False


def _json_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments if arguments is not None else {})
