"""Request bodies of OpenAI's Responses API (POST /v1/responses), translated into the chat call every chat API makes:
input items as chat messages (function_call items as an assistant's tool_calls, function_call_output items as
tool messages), `instructions` as the system message, flat function tools as chat tools, `text.format` as a
structured-output constraint. Fields for what this server does not do are refused, naming them."""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tokenmill.errors import InvalidParameterError
from tokenmill.sampling_params import MAX_LOGPROBS, MAX_TEMPERATURE, SamplingParams
from tokenmill.server.neutral_request import OutputLength
from tokenmill.server.protocol import STRICT, APIRequest, field_error, unsupported_field_error
from tokenmill.server.sampling_defaults import over_defaults
from tokenmill.structured.params import StructuredOutputsParams

ROLES = ("user", "system", "developer", "assistant")
OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the one `include` served
TEXT_PARTS = ("input_text", "output_text", "text")
# OpenAI's limits on a response's metadata: what a stored response may carry
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


class TextFormat(BaseModel):
    model_config = ConfigDict(**STRICT, extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(**STRICT, extra="allow")  # verbosity: one length here

    format: TextFormat | None = None


class Reasoning(BaseModel):
    model_config = ConfigDict(**STRICT, extra="forbid")

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(APIRequest):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True  # a reply holds one call or several either way
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True  # kept in this process for previous_response_id and GET /v1/responses/{id}
    metadata: dict[str, str] | None = None
    reasoning: Reasoning | None = None
    vllm_xargs: dict[str, Any] | None = None  # vLLM's: arguments for the server's --logits-processors
    truncation: Literal["disabled"] | None = None  # "auto" (dropping the conversation's start) is refused
    background: bool = False  # refused when true: a response is made while its request waits
    include: list[str] | None = None  # only message.output_text.logprobs is served
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None  # with that include: the top k as well
    watermarking: bool | None = None  # vLLM's: false opts out of the server's --watermark-config
    enable_response_messages: bool = False  # vLLM's: the raw prompt and output (text and token ids) in the response
    conversation: None = None  # the Conversations API is not served
    prompt: None = None  # nor stored prompt templates

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(v, dict) for v in value)):
            return value
        if isinstance(value, list) and not value:
            raise field_error("input", "input is an empty list: give a text or at least one input item")
        raise field_error("input", "input must be a text or a list of input items (objects)")

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata_limits(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        if len(value) > MAX_METADATA_PAIRS:
            raise field_error("metadata", f"metadata has {len(value)} pairs; at most {MAX_METADATA_PAIRS} are allowed")
        for key, item in value.items():
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise field_error(
                    "metadata", f"a metadata key has {len(key)} characters; at most {MAX_METADATA_KEY_CHARS}"
                )
            if isinstance(item, str) and len(item) > MAX_METADATA_VALUE_CHARS:
                raise field_error(
                    "metadata",
                    f"metadata[{key!r}] has {len(item)} characters; at most {MAX_METADATA_VALUE_CHARS} are allowed",
                )
        return value

    @field_validator("include")
    @classmethod
    def _served_includes(cls, value: list[str] | None) -> list[str] | None:
        other = [item for item in value or [] if item != OUTPUT_LOGPROBS]
        if other:
            raise unsupported_field_error("include", f"{other[0]!r} is not served (only {OUTPUT_LOGPROBS!r})")
        return value

    @field_validator("background")
    @classmethod
    def _not_in_the_background(cls, value: bool) -> bool:
        if value:
            raise unsupported_field_error("background", "is not supported by this server")
        return value

    def input_messages(self) -> list[dict[str, Any]]:
        """The input items as chat messages (a call's items become the assistant's tool_calls)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "message":
                role, text = _role(item, i), _text(item.get("content"), i)
                last = out[-1] if out else None
                if role == "assistant" and last is not None and "reasoning_content" in last and not last["content"]:
                    last["content"] = text  # the reply whose thinking came just before
                else:
                    out.append({"role": role, "content": text})
            elif kind == "function_call":
                call = {"id": _string(item, "call_id", i), "type": "function"}
                call["function"] = {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)}
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant" and not last["content"]:
                    last.setdefault("tool_calls", []).append(call)  # several calls of one reply
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "reasoning":  # an earlier reply's thinking: the next assistant message carries it
                parts = item.get("content") or []
                thinking = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
                out.append({"role": "assistant", "content": "", "reasoning_content": thinking})
            elif kind == "function_call_output":
                output = item.get("output")
                text = output if isinstance(output, str) else _text(output, i)
                out.append({"role": "tool", "tool_call_id": _string(item, "call_id", i), "content": text})
            else:
                raise InvalidParameterError(f"input[{i}]: items of type {kind!r} are not supported", "input")
        return out

    def template_kwargs(self) -> dict[str, Any]:
        """reasoning.effort as the chat templates read it: gpt-oss's reasoning_effort ("none": thinking off, as
        Qwen3's enable_thinking)."""
        effort = self.reasoning.effort if self.reasoning is not None else None
        if effort is None:
            return {}
        if effort == "none":
            return {"enable_thinking": False}
        return {"enable_thinking": True, "reasoning_effort": effort}

    def chat_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                raise InvalidParameterError(
                    f"tools[{i}]: tools of type {tool.get('type')!r} are not supported (only function tools)", "tools"
                )
            function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            out.append({"type": "function", "function": function})
        return out

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise InvalidParameterError(
                    "tool_choice must name a function: {'type': 'function', 'name': ...}", "tool_choice"
                )
            return {"type": "function", "function": {"name": choice["name"]}}
        return choice

    def logprobs_top(self) -> int | None:
        """The top tokens each output position shows when the request includes the text's log-probabilities (0:
        only the chosen one), else None."""
        return (self.top_logprobs or 0) if OUTPUT_LOGPROBS in (self.include or []) else None

    def output_length(self) -> OutputLength:
        return OutputLength(self.max_output_tokens)

    def sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        """max_tokens is left unset: Generation settles it from output_length() (output_limits.py)."""
        optional = {"temperature": self.temperature, "top_p": self.top_p}
        return SamplingParams(
            max_tokens=None,
            logprobs=self.logprobs_top(),
            watermarking=self.watermarking,
            structured_outputs=self.structured_outputs(),
            extra_args=self.vllm_xargs,
            **over_defaults(defaults, optional),
        )

    def structured_outputs(self) -> StructuredOutputsParams | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True, source="text.format")
        if fmt.schema_ is None:
            raise InvalidParameterError("text.format json_schema needs its schema", "text.format")
        return StructuredOutputsParams(json=fmt.schema_, source="text.format")

    def text_echo(self) -> dict[str, Any]:
        """`text` as the response states it."""
        fmt = self.text.format if self.text is not None and self.text.format is not None else None
        return {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}}


def _role(item: dict[str, Any], i: int) -> str:
    role = item.get("role")
    if role not in ROLES:
        raise InvalidParameterError(f"input[{i}].role must be one of {', '.join(ROLES)}", "input")
    return "system" if role == "developer" else role


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
                raise InvalidParameterError(
                    f"input[{i}]: content parts of type {kind!r} are not supported: this server's models read text",
                    "input",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidParameterError(f"input[{i}].content must be text or a list of text parts", "input")


def _string(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidParameterError(f"input[{i}].{key} must be a string", "input")
    return value
