"""Request bodies of the OpenAI API (and the extras vLLM users send), validated by pydantic.

Unknown fields of OpenAI's completions, chat and embeddings are refused with a 400 naming them, but those clients
send that ask for nothing here (ACCEPTED_UNUSED: metadata, service_tier...); the other APIs' bodies ignore theirs.
The ranges here are SamplingParams' own (so the OpenAPI schema states what the server accepts); values are
checked again when SamplingParams is built, with the parameter named in the error. Every text in a body must be
valid Unicode: JSON can carry a lone surrogate ("\\ud800", or its bytes in CESU-8), which no tokenizer can take.
"""

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator
from pydantic_core import PydanticCustomError

from tokenmill.errors import InvalidParameterError
from tokenmill.sampling_params import (
    MAX_LENGTH_PENALTY,
    MAX_LOGIT_BIAS,
    MAX_LOGPROB_TOKEN_IDS,
    MAX_N,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    SEED_RANGE,
    SamplingParams,
)
from tokenmill.server.json_body import normalize_json
from tokenmill.server.neutral_request import OutputLength
from tokenmill.server.prompt_shapes import MAX_PROMPTS_PER_REQUEST, prompt_problem
from tokenmill.server.sampling_defaults import over_defaults
from tokenmill.structured.params import StructuredOutputsParams

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on inputs in one embeddings call, held on every API's

TokenId = Annotated[int, Field(ge=0)]
# a 64-bit seed, signed or not (as vLLM's int64 and llama.cpp's uint32/64 seeds); beyond it 400, as theirs
Seed = Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])]
NonEmptyText = Annotated[str, Field(min_length=1)]


STRICT = ConfigDict(strict=True, allow_inf_nan=False)  # JSON's types as the schema states them: "1" is no integer

# Fields vLLM's or llama.cpp's servers take that this one does not implement, with the values that ask for nothing
# (sent by clients that always send them): any other value is refused with a 400 naming the field, never ignored.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,),  # OpenAI's completions and chat declare it (beam search); the other APIs refuse it
}
# Where a request refuses unknown fields (OpenAI's completions, chat and embeddings: the README promises nothing is
# ignored), the fields clients send that ask it for nothing, with the values that do so (None: any value). Any other
# field that is not declared is refused with a 400 naming it (vLLM's kv_transfer_params, OpenAI's audio, ...).
ACCEPTED_UNUSED: dict[str, tuple[Any, ...] | None] = {
    # OpenAI's: hints for OpenAI's own platform (abuse monitoring, routing, billing), no part of the answer
    "metadata": None,
    "safety_identifier": None,
    "prompt_cache_key": None,
    "service_tier": ("auto", "default"),
    "store": (False,),
    "modalities": (["text"],),
    # vLLM's and llama.cpp's, at the values that ask for what this server does anyway
    "priority": (0,),
    "spaces_between_special_tokens": (True,),
    "cache_prompt": (True, False),  # llama.cpp's prompt cache: the prefix cache's hits change no output
    "id_slot": None,  # llama.cpp's slot: every request here runs in one batch, its output the same in any
    "timings_per_token": (False,),
    "return_progress": (False,),
    "verbose": (False,),
    # SGLang's, which its model gateway (sglang-router) writes into every request it forwards
    "no_stop_trim": (False,),
    "return_hidden_states": (False,),
    "separate_reasoning": (True,),
    "stream_reasoning": (True,),
}


def _one_of(value: Any, values: tuple[Any, ...] | None) -> bool:
    """Whether `value` is one of `values` (None: any), JSON's types apart (0 is no false)."""
    return values is None or any(type(value) is type(v) and value == v for v in values)


def unsupported_field_error(name: str, why: str = "is not supported by this server") -> PydanticCustomError:
    return PydanticCustomError("unsupported_field", "{param} " + why, {"param": name})


def field_error(name: str, message: str) -> PydanticCustomError:
    """A validation error whose message is said as is (no pydantic location prefix), naming the field."""
    return PydanticCustomError("field_error", message, {"param": name})


class APIRequest(BaseModel):
    """A request body: values have the types the schema states (no "1" for 1, no 0 for false, but 3.0 for 3, as
    JSON has it); numbers are finite; texts are valid Unicode; UNSUPPORTED_FIELDS ask for nothing. Unknown fields
    are kept and ignored, unless `refuses_unknown_fields` (then a 400 names the first that asks for something)."""

    model_config = ConfigDict(**STRICT, extra="allow")
    refuses_unknown_fields: ClassVar[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _normalized(cls, data: Any) -> Any:
        where = normalize_json(data)
        if where is not None:
            raise PydanticCustomError(
                "invalid_unicode",
                "{where} is not valid Unicode text (it holds a lone surrogate, e.g. \\ud800)",
                {"where": where, "param": where.split(".")[0]},
            )
        if isinstance(data, dict):
            declared = {f.alias or name for name, f in cls.model_fields.items()}
            for name, value in data.items():
                if name in declared or value is None:  # null asks for nothing, whatever the field
                    continue
                if name in UNSUPPORTED_FIELDS:
                    if not _one_of(value, UNSUPPORTED_FIELDS[name]):
                        raise unsupported_field_error(name)
                elif cls.refuses_unknown_fields and not (
                    name in ACCEPTED_UNUSED and _one_of(value, ACCEPTED_UNUSED[name])
                ):
                    raise unsupported_field_error(name)
        return data


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far (its prompt's tokens, its choice's output)
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(**STRICT, extra="forbid")

    name: NonEmptyText | None = None  # OpenAI requires it; vLLM and llama.cpp do not
    schema_: Annotated[dict[str, Any], Field(alias="schema")] = {}
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: "text", "json_object" (any JSON object) or "json_schema" (one that validates)."""

    model_config = ConfigDict(**STRICT, extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    # llama.cpp's form: {"type": "json_object", "schema": {...}}, a JSON object matching the schema
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None


class StructuredOutputsBody(BaseModel):
    """vLLM's `structured_outputs` extra: exactly one of these."""

    model_config = ConfigDict(**STRICT, extra="forbid")

    json_: Annotated[dict[str, Any] | str | None, Field(alias="json")] = None
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(APIRequest):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    refuses_unknown_fields = True

    model: str | None = None
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: NonEmptyText | list[NonEmptyText] | None = None
    seed: Seed | None = None
    presence_penalty: Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] | None = None
    logit_bias: (
        dict[Annotated[str, Field(pattern=r"^[0-9]+$")], Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]]
        | None
    ) = None
    user: str | None = None
    # extras (vLLM names)
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=MAX_REPETITION_PENALTY)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False  # vLLM's extension: token ids of the prompt and of every choice
    # what the output must match: OpenAI's response_format, or vLLM's structured_outputs (and its older guided_*)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    # llama.cpp's: a GBNF grammar, or a JSON schema, the output must match
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    # vLLM's: arguments for the server's custom logits processors (--logits-processors)
    vllm_xargs: dict[str, Any] | None = None
    # llama.cpp's name for max_tokens (-1: no limit), which its server takes on these endpoints too
    n_predict: Annotated[int, Field(ge=-1)] | None = None
    # vLLM's beam search: n beams ranked by cumulative log-probability / length ** length_penalty
    # (server/beam_search_fields.py)
    use_beam_search: bool = False
    length_penalty: Annotated[float, Field(ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY)] = 1.0
    # vLLM's: each prompt token's log-probability and the top this many at its position (-1: the whole vocabulary;
    # the engine's --max-logprobs bounds it), returned as `prompt_logprobs` (the first token's null); not streamed
    prompt_logprobs: Annotated[int, Field(ge=-1)] | None = None
    # vLLM's: the log-probabilities of these tokens at each generated position, listed with the sampled one's in
    # place of the top ones (needs logprobs)
    logprob_token_ids: Annotated[list[TokenId], Field(max_length=MAX_LOGPROB_TOKEN_IDS)] | None = None
    # vLLM's: only these tokens may be sampled
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    # vLLM's: the log-probabilities' tokens written "token_id:N" (the bytes stay the token's own)
    return_tokens_as_token_ids: bool = False
    # vLLM's: the prompt cut to this many tokens (-1: to the context), its start ("left", the default) or its end
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's: false opts out of the server's --watermark-config
    watermarking: bool | None = None

    @model_validator(mode="after")
    def _stream_options_with_stream(self) -> "SamplingFields":
        if self.stream_options is not None and not self.stream:
            raise unsupported_field_error("stream_options", "is only allowed with stream: true")
        return self

    @model_validator(mode="after")
    def _length_penalty_with_beams(self) -> "SamplingFields":
        if self.length_penalty != 1.0 and not self.use_beam_search:
            raise unsupported_field_error("length_penalty", "applies only with use_beam_search: true")
        return self

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> "SamplingFields":
        if self.prompt_logprobs is None:
            return self
        if self.stream:
            raise field_error("prompt_logprobs", "prompt_logprobs are not available when stream is true")
        return self

    @model_validator(mode="after")
    def _n_predict_is_max_tokens(self) -> "SamplingFields":
        """n_predict stands for max_tokens where the request does not name that."""
        if self.n_predict is not None and "max_tokens" not in self.model_fields_set:
            self.max_tokens = None if self.n_predict < 0 else self.n_predict  # type: ignore[attr-defined]
        return self

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one constraint the request names (400 when it names several)."""
        given: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given.append(("response_format", {"json": fmt.schema_} if fmt.schema_ else {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise InvalidParameterError("response_format json_schema needs its json_schema", "response_format")
            given.append(("response_format", {"json": fmt.json_schema.schema_}))
        if self.structured_outputs is not None:
            fields = self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            given.append(("structured_outputs", fields))
        guided = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice}
        guided["grammar"] = self.guided_grammar
        given += [(f"guided_{k}", {k: v}) for k, v in guided.items() if v is not None]
        if self.grammar is not None:
            given.append(("grammar", {"grammar": self.grammar}))
        if self.json_schema is not None:
            given.append(("json_schema", {"json": self.json_schema}))
        if not given:
            return None
        if len(given) > 1:
            raise InvalidParameterError(
                f"name one constraint on the output, not {len(given)} ({', '.join(name for name, _ in given)})",
                given[1][0],
            )
        name, fields = given[0]
        return StructuredOutputsParams(**fields, source=name)

    def sampled_logprobs(self) -> int | None:
        """The log-probabilities asked at each generated position (completions' logprobs, chat's top_logprobs)."""
        return None

    def echoed_prompt_logprobs(self) -> int | None:
        """The prompt's log-probabilities an echo shows (unless prompt_logprobs names another number)."""
        return None

    def output_length(self) -> OutputLength:
        """What the request asks of its output's length (neutral_request.py)."""
        raise NotImplementedError

    def sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """`defaults`: the model's recommended settings (GenerationDefaults), for the fields the request leaves
        unset. max_tokens is left unset: Generation settles it from output_length() (output_limits.py)."""
        logprobs = self.sampled_logprobs()
        echoed = self.echoed_prompt_logprobs()
        optional = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        return SamplingParams(
            n=self.n,
            max_tokens=None,
            seed=self.seed,
            stop=self.stop,
            logit_bias=self.logit_bias,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            # with logprob_token_ids, each position lists the sampled token and those, not the top ones (vLLM's)
            logprobs=None if self.logprob_token_ids else logprobs,
            prompt_logprobs=self.prompt_logprobs if self.prompt_logprobs is not None else echoed,
            logprob_token_ids=self.logprob_token_ids or None,
            allowed_token_ids=self.allowed_token_ids,
            watermarking=self.watermarking,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            **({"truncation_side": self.truncation_side} if self.truncation_side is not None else {}),
            structured_outputs=self.structured_outputs_params(),
            extra_args=self.vllm_xargs,
            **over_defaults(defaults, optional),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk: vLLM's continuous_usage_stats, which counts only with include_usage."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingFields):
    # max_tokens 0 only with echo (the prompt's log-probabilities)
    model_config = ConfigDict(
        json_schema_extra={
            "if": {"properties": {"max_tokens": {"const": 0}}, "required": ["max_tokens"]},
            "then": {"properties": {"echo": {"const": True}}, "required": ["echo"]},
        }
    )

    prompt: (
        NonEmptyText
        | Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_PROMPTS_PER_REQUEST)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[
            list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS_PER_REQUEST)
        ]
    )
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    logprobs: Annotated[int, Field(ge=-1)] | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None  # must equal n
    suffix: Annotated[str | None, WithJsonSchema({"type": "null", "description": "not supported"})] = None

    def sampled_logprobs(self) -> int | None:
        return self.logprobs

    def echoed_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    def output_length(self) -> OutputLength:
        """max_tokens not named: OpenAI's default, 16; null: up to the context; 0 (echo only): the prompt only."""
        named = "max_tokens" in self.model_fields_set
        return OutputLength(self.max_tokens if named else None, None if named else 16, self.max_tokens == 0)

    @model_validator(mode="after")
    def _logprob_token_ids_need_logprobs(self) -> "CompletionRequest":
        if self.logprob_token_ids:
            if self.logprobs is None:
                raise field_error(
                    "logprob_token_ids", "logprob_token_ids needs logprobs (any number: they replace the top ones)"
                )
            if self.echo and self.max_tokens == 0:
                raise field_error(
                    "logprob_token_ids", "logprob_token_ids needs generated tokens: not with echo and max_tokens 0"
                )
        return self

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        """What is wrong with a malformed prompt, said plainly: the union's own errors all read "Input should be a
        valid string" (its first member's), whatever the shape (129 prompts never said "at most 128")."""
        problem = prompt_problem(value)
        if problem is not None:
            raise PydanticCustomError("prompt_shape", problem)
        return value


class TextPart(BaseModel):
    model_config = ConfigDict(**STRICT, extra="allow")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; fields beyond role and content (name, tool_call_id, ...) reach the chat template as sent. The
    role is any string (system, user, assistant, tool, developer, Llama 3.1's ipython, ...): the chat template
    decides, and one that raises for a message is a 400 with its reason."""

    model_config = ConfigDict(**STRICT, extra="allow")

    role: str
    content: str | list[TextPart] | None = None


def check_continue_final_message(continue_final_message: bool, add_generation_prompt: bool) -> None:
    if continue_final_message and add_generation_prompt:
        raise field_error(
            "continue_final_message",
            "continue_final_message and add_generation_prompt cannot both be true (add_generation_prompt defaults to "
            "true): the final message is continued, no new turn started; send add_generation_prompt: false",
        )


class ChatCompletionRequest(SamplingFields):
    # top_logprobs only with logprobs: true, as OpenAI's API has it
    model_config = ConfigDict(
        json_schema_extra={
            "if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
            "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
        }
    )

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=-1)] | None = None
    tools: list[dict[str, Any]] | None = None  # checked by tokenmill.structured.tools.check_tools
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # accepted; a reply may hold several calls either way
    add_generation_prompt: bool = True
    # vLLM's: the final message left open for the reply to go on with (needs add_generation_prompt false)
    continue_final_message: bool = False
    # vLLM's: the reply's content starts with the final message's when that is the reply's role (assistant, or
    # any with add_generation_prompt false): with continue_final_message, the whole message
    echo: bool = False
    # reasoning models: gpt-oss's effort (its system message says it), vLLM's template variables (Qwen3's
    # enable_thinking) and whether the reply's thinking is returned (vLLM's include_reasoning)
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    # vLLM's: at most this many tokens of thinking (<think> models), then the sampler closes the block; -1: no limit
    thinking_token_budget: Annotated[int, Field(ge=-1)] | None = None

    @model_validator(mode="after")
    def _chat_checks(self) -> "ChatCompletionRequest":
        check_continue_final_message(self.continue_final_message, self.add_generation_prompt)
        if self.logprob_token_ids and not self.logprobs:
            raise field_error("logprob_token_ids", "logprob_token_ids needs logprobs: true")
        return self

    def sampled_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def output_length(self) -> OutputLength:
        return OutputLength(self.max_completion_tokens or self.max_tokens)

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_unset=True) for m in self.messages]

    def echoed(self) -> str:
        """What `echo` puts before the reply: the final message's text, where it has the reply's role (vLLM's)."""
        last = self.messages[-1]
        if not self.echo or (self.add_generation_prompt and last.role != "assistant"):
            return ""
        content = last.content
        if isinstance(content, list):
            return "\n".join(part.text for part in content)
        return content or ""

    def thinking_budget(self) -> int | None:
        """thinking_token_budget with vLLM's -1 (unlimited) as no budget."""
        budget = self.thinking_token_budget
        return None if budget is None or budget < 0 else budget

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's variables beyond the conversation: chat_template_kwargs, and reasoning_effort
        under the name gpt-oss's template reads (unless chat_template_kwargs names it too)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return kwargs
