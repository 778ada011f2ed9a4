"""Response bodies, for the OpenAPI schema (/openapi.json): what each endpoint answers, per status code.

The handlers build plain dicts (no validation on the way out); tests/test_fuzz.py checks with schemathesis that
every answer conforms to what is declared here.
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

FinishReason = Literal["stop", "length", "abort"]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int  # 1: the most likely token there
    decoded_token: str | None


# vLLM's prompt_logprobs: per prompt token, null for the first, else {token id: its log-probability} for the token
# there and the top ones
PromptLogprobs = list[dict[str, PromptLogprob] | None] | None


class CompletionChoice(BaseModel):
    model_config = ConfigDict(extra="allow")  # token_ids, prompt_token_ids with return_token_ids

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    prompt_logprobs: PromptLogprobs = None  # null unless asked (prompt_logprobs, or echo with logprobs)


class CompletionResponse(BaseModel):
    """A whole completion; with "stream": true, server-sent events of chunks of this shape instead."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None = None  # the backend's configuration, hashed (changes with it)
    choices: list[CompletionChoice]
    usage: Usage | None = None


class Version(BaseModel):
    version: str  # tokenmill's


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32 (encoding_format "base64")


class EmbeddingResponse(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(BaseModel):
    model_config = ConfigDict(extra="allow")  # token_ids with return_token_ids

    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionResponse(BaseModel):
    """A whole chat completion; with "stream": true, server-sent events of chat.completion.chunk objects."""

    model_config = ConfigDict(extra="allow")  # prompt_token_ids with return_token_ids

    id: str
    object: Literal["chat.completion"]
    system_fingerprint: str | None = None  # the backend's configuration, hashed (changes with it)
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs = None  # null unless asked


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int
    aliases: list[str]
    tags: list[str]
    parent: str | None = None  # a LoRA adapter's base model (vLLM's card); None for the model itself


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None
    token_texts: list[str] | None = None


class LlamaTokenizeResponse(BaseModel):
    """llama.cpp's /tokenize answer (a request with `content`): ids, or {id, piece} objects under with_pieces."""

    tokens: list[int | dict[str, Any]]


class DetokenizeResponse(BaseModel):
    prompt: str
    content: str  # the same text, under llama.cpp's name


class TokenizerInfo(BaseModel):
    tokenizer_class: str
    model: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    vocab_size: int
    model_max_length: int
    chat_template: str | None


class HealthStatus(BaseModel):
    status: str  # "ok", or why not: "loading", "shutting down", "engine failed: ..."


class ExplorerInfo(BaseModel):
    model: str
    quantization: str
    device: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    kv_element_bytes: int
    kv_scale_bytes: int  # beside each head of each token: an int8 cache's float32 scale (0 for float types)
    block_size: int
    kv_blocks_total: int
    kv_bytes_per_block: int
    max_model_len: int
    prefix_caching: bool
    max_num_batched_tokens: int
    tensor_parallel_size: int  # ranks (processes) that compute every step of every request
    chat_template: bool
    base_model_note: str | None  # the model's file has no chat template: what that means for chat (else null)
    # what a request leaves unset gets (the model's recommended settings), and where they come from
    sampling_defaults: dict[str, Any]
    sampling_defaults_source: str
    engine: dict[str, Any]  # its stats now, and "last_step": the last step's size and time (null before the first)


class OllamaError(BaseModel):
    """Ollama's error shape (under /api/)."""

    error: str


class AnthropicErrorDetail(BaseModel):
    type: str  # invalid_request_error, authentication_error, not_found_error, overloaded_error, ...
    message: str


class AnthropicError(BaseModel):
    """Anthropic's error shape (under /v1/messages)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


def error_responses(*statuses: int, model: type[BaseModel] | None = None) -> dict[int | str, dict[str, Any]]:
    """The `responses` entry of a route for the error statuses it can answer (`model`: the error's shape, when it
    is another API's than OpenAI's)."""
    what = {
        400: "invalid parameters, a schema error, JSON that does not parse, or a prompt that does not fit",
        401: "the API key is missing or wrong (when the server has one)",
        403: "a feature this server was started without (llama.cpp's /tools: --tools, /cors-proxy: --ui-mcp-proxy)",
        404: "a model this server does not serve",
        413: "a body over --max-request-bytes",
        501: "an endpoint or action this server was started without (llama.cpp's API: --no-slots)",
        502: "the target of /cors-proxy could not be reached",
        503: "loading, shutting down, a failed engine, or more than --max-queue requests waiting",
    }
    return {status: {"model": model or ErrorResponse, "description": what[status]} for status in statuses}


# one server-sent event: its data is a JSON object (a chunk, or an error) or the final [DONE]
SSE_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}


ANY_OBJECT = {"type": "object"}


ANY_LIST = {"type": "array", "items": ANY_OBJECT}
ANY_OBJECT_OR_LIST = {"anyOf": [ANY_OBJECT, ANY_LIST]}


def answers(
    description: str, stream: str | None = None, schema: dict[str, Any] = ANY_OBJECT
) -> dict[int | str, dict[str, Any]]:
    """200 of an endpoint whose JSON answer is another API's shape (Ollama's, Anthropic's, OpenAI's Responses):
    an object (or `schema`: ANY_LIST, or either); `stream`: the media type it streams as when asked to
    ("text/event-stream", "application/x-ndjson")."""
    content: dict[str, Any] = {"application/json": {"schema": schema}}
    if stream is not None:  # an event stream's schema is one event's
        content[stream] = {"schema": SSE_EVENT if stream == "text/event-stream" else {"type": "string"}}
    return {200: {"content": content, "description": description}}


def streaming_ok(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """200 of a generation endpoint: JSON, or server-sent events when the request asks to stream."""
    return {
        200: {
            "model": model,
            "content": {"text/event-stream": {"schema": SSE_EVENT}},
            "description": "the result as JSON; with stream: true, server-sent events ending with data: [DONE]",
        }
    }
