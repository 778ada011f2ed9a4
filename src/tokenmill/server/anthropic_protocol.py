"""Request bodies of Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), translated into the
chat call every chat API makes: messages as the chat template sees OpenAI's (tool_use blocks as tool_calls,
tool_result blocks as tool messages), tools and tool_choice as OpenAI's, sampling fields as SamplingParams."""

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from tokenmill.errors import InvalidParameterError
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.neutral_request import OutputLength
from tokenmill.server.protocol import STRICT, APIRequest, NonEmptyText
from tokenmill.server.sampling_defaults import over_defaults
from tokenmill.structured.params import StructuredOutputsParams


class TextBlock(BaseModel):
    model_config = ConfigDict(**STRICT, extra="allow")  # cache_control, citations: nothing to do here

    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(**STRICT, extra="allow")

    type: Literal["tool_use"]
    id: NonEmptyText
    name: NonEmptyText
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(**STRICT, extra="allow")

    type: Literal["tool_result"]
    tool_use_id: NonEmptyText
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {body}" if self.is_error else body


class ThinkingBlock(BaseModel):
    """An earlier turn's thinking, sent back as Anthropic's clients keep it (the chat template may show it)."""

    model_config = ConfigDict(**STRICT, extra="allow")  # signature: this server signs nothing

    type: Literal["thinking"]
    thinking: str


class RedactedThinkingBlock(BaseModel):
    model_config = ConfigDict(**STRICT, extra="allow")

    type: Literal["redacted_thinking"]  # never made here; a conversation from elsewhere may hold one (dropped)
    data: str = ""


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock, Field(discriminator="type")
]


class Message(BaseModel):
    model_config = ConfigDict(**STRICT, extra="forbid")

    role: Literal["user", "assistant"]
    content: str | list[Block]

    @model_validator(mode="before")
    @classmethod
    def _known_blocks(cls, data: Any) -> Any:
        """Images and documents are named in the error (the union's own error would list the kinds it knows)."""
        blocks = data.get("content") if isinstance(data, dict) else None
        for block in blocks if isinstance(blocks, list) else []:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in ("text", "tool_use", "tool_result", "thinking", "redacted_thinking"):
                raise PydanticCustomError(
                    "unsupported_field",
                    "content blocks of type {kind} are not supported: this server's models read text",
                    {"param": "messages", "kind": repr(kind)},
                )
        return data


class Tool(BaseModel):
    model_config = ConfigDict(**STRICT, extra="allow")  # cache_control

    name: NonEmptyText
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search, ...) run on Anthropic's side

    def as_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoice(BaseModel):
    model_config = ConfigDict(**STRICT, extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False  # a reply holds one call or several either way

    def as_openai(self) -> str | dict[str, Any]:
        if self.type == "tool":
            if not self.name:
                raise InvalidParameterError("tool_choice of type 'tool' needs the tool's name", "tool_choice")
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class Thinking(BaseModel):
    model_config = ConfigDict(**STRICT, extra="allow")

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]  # adaptive: the model's template decides
    budget_tokens: Annotated[int, Field(ge=1)] | None = None


class OutputFormat(BaseModel):
    model_config = ConfigDict(**STRICT, extra="forbid")

    type: Literal["json_schema"]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]


class OutputConfig(BaseModel):
    model_config = ConfigDict(**STRICT, extra="forbid")

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # how long a thinking model thinks
    format: OutputFormat | None = None  # the reply is JSON that validates against the schema


class CountTokensRequest(APIRequest):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as OpenAI messages, as the chat template sees them."""
        out: list[dict[str, Any]] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            out.append({"role": "system", "content": system})
        for m in self.messages:
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
                continue
            text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
            calls = [
                {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                for b in m.content
                if isinstance(b, ToolUseBlock)
            ]
            results = [b for b in m.content if isinstance(b, ToolResultBlock)]
            if m.role == "user" and calls:
                raise InvalidParameterError("tool_use blocks belong to assistant messages", "messages")
            if m.role == "assistant" and results:
                raise InvalidParameterError("tool_result blocks belong to user messages", "messages")
            out += [{"role": "tool", "tool_call_id": r.tool_use_id, "content": r.text()} for r in results]
            thinking = "".join(b.thinking for b in m.content if isinstance(b, ThinkingBlock))
            if text or calls or not results:
                message: dict[str, Any] = {"role": m.role, "content": text}
                if calls:
                    message["tool_calls"] = calls
                if thinking and m.role == "assistant":
                    message["reasoning_content"] = thinking
                out.append(message)
        return out

    def openai_tools(self) -> list[dict[str, Any]] | None:
        return [t.as_openai() for t in self.tools] if self.tools else None

    def openai_tool_choice(self) -> str | dict[str, Any] | None:
        return self.tool_choice.as_openai() if self.tool_choice is not None else None


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[NonEmptyText] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    metadata: dict[str, Any] | None = None  # user_id: nothing to do with it here
    thinking: Thinking | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here: both ask for it
    output_config: OutputConfig | None = None
    vllm_xargs: dict[str, Any] | None = None  # vLLM's: arguments for the server's --logits-processors

    def template_kwargs(self) -> dict[str, Any]:
        """thinking and effort as the chat templates read them: enabled or disabled is enable_thinking (Qwen3's,
        R1's), effort gpt-oss's reasoning_effort (xhigh and max are its high)."""
        kwargs: dict[str, Any] = {}
        if self.thinking is not None and self.thinking.type != "adaptive":
            kwargs["enable_thinking"] = self.thinking.type != "disabled"
        effort = (self.output_config or OutputConfig()).effort
        if effort is not None:
            kwargs["reasoning_effort"] = {"xhigh": "high", "max": "high"}.get(effort, effort)
        return kwargs

    @property
    def shows_thinking(self) -> bool:
        """Whether the reply's thinking goes out as thinking blocks (not when the request disabled it)."""
        return self.thinking is None or self.thinking.type != "disabled"

    def output_length(self) -> OutputLength:
        return OutputLength(self.max_tokens)

    def sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        """temperature, top_p and top_k: older clients send them (today's Messages API has none of them).
        max_tokens is left unset: Generation settles it from output_length() (output_limits.py)."""
        config = self.output_config or OutputConfig()
        structured = None
        if config.format is not None:
            structured = StructuredOutputsParams(json=config.format.schema_, source="output_config.format")
        optional = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        return SamplingParams(
            max_tokens=None,
            stop=self.stop_sequences,
            structured_outputs=structured,
            extra_args=self.vllm_xargs,
            **over_defaults(defaults, optional),
        )
