"""Request bodies of /tokenize and /detokenize: vLLM's shapes (prompt, or messages rendered as chat renders them)
and llama.cpp's (content)."""

from typing import Annotated, Any

from pydantic import ConfigDict, Field, model_validator

from tokenmill.server.protocol import APIRequest, ChatMessage, TokenId, check_continue_final_message


class TokenizeRequest(APIRequest):
    """Exactly one of prompt (text), messages (rendered with the chat template first) and content (llama.cpp's)."""

    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
                {"required": ["content"], "properties": {"content": {"type": ["string", "array"]}}},
            ]
        }
    )

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's, as on chat: the final message left open
    tools: list[dict[str, Any]] | None = None  # with messages: shown to the model as chat shows them
    return_token_strs: bool = False  # the vocabulary pieces (vLLM's field)
    return_token_texts: bool = False  # each token decoded on its own (what the request explorer shows)
    # llama.cpp's shape: content (text, or ids and texts mixed) -> {"tokens": ids, or [{"id", "piece"}]}
    content: str | list[int | str] | None = None
    add_special: bool = False  # llama.cpp's: BOS as the model wants (its default: none)
    with_pieces: bool = False

    @model_validator(mode="after")
    def _continue_without_generation_prompt(self) -> "TokenizeRequest":
        if self.messages is not None:
            check_continue_final_message(self.continue_final_message, self.add_generation_prompt)
        return self


class DetokenizeRequest(APIRequest):
    model: str | None = None
    tokens: list[TokenId] = Field(default_factory=list)
