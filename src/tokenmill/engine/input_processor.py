"""Requests in: a prompt's validation and tokenization and a request's parameter checks, against this engine's
vocabulary, max_model_len and KV cache. Every check raises a typed error that names the parameter (the server's
400). Safe from any thread: it reads the engine's fixed settings only."""

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tokenmill.errors import InvalidParameterError, PromptTooLongError
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams, truncation_limit
from tokenmill.scheduler.kv_cache_manager import KVCacheManager
from tokenmill.tokenizer import ChatTemplate
from tokenmill.tokenizer.gguf_tokenizer import Tokenizer

if TYPE_CHECKING:
    from tokenmill.structured.grammars import GrammarCompiler

PromptInput = str | dict[str, Any] | list[int]


# what a request's chat_template_kwargs may not set: the conversation and the server's own variables
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "add_generation_prompt", "continue_final_message", "tools", "bos_token", "eos_token"}
)


class InputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate,
        vocab_size: int,
        hidden_size: int,
        max_num_seqs: int,
        max_model_len: int,
        kv: KVCacheManager,
        grammars: Callable[[], "GrammarCompiler"],
        max_logprobs: int,
    ):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size  # an embedding's length
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.kv = kv  # for how many blocks a request may take (read only)
        self._grammars = grammars  # the engine's compiler, made at first use
        # the most log-probabilities a request may ask for at a position (-1: the whole vocabulary)
        self.max_logprobs = vocab_size if max_logprobs < 0 else max_logprobs

    def tokenize_prompt(
        self, prompt: PromptInput, params: SamplingParams | PoolingParams | None = None
    ) -> tuple[str | None, list[int]]:
        """A prompt's text (None when it came as token ids, or was truncated) and its token ids, checked against the
        vocabulary and max_model_len, after the truncation its `params` ask for (truncate_prompt_tokens)."""
        keep = self.truncation(params)
        if isinstance(prompt, str):
            text, ids = prompt, self.encode_prompt(prompt, params)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            text = prompt.get("prompt")
        elif isinstance(prompt, list):
            ids, text = prompt, None
        else:
            raise InvalidParameterError("a prompt is a string or {'prompt_token_ids': [...]}", "prompt")
        if not isinstance(ids, list):
            raise InvalidParameterError("prompt_token_ids must be a list of integers", "prompt")
        if keep is not None and len(ids) > keep:
            ids = ids[-keep:] if params.truncation_side == "left" else ids[:keep]  # type: ignore[union-attr]
            text = None  # the text no longer says what runs
        self.check_prompt_length(len(ids))  # before looking at each id of a list that may be huge
        vocab = self.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidParameterError("prompt_token_ids must be a list of integers", "prompt")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidParameterError(f"prompt token id {bad[0]} is out of vocabulary (ids 0..{vocab - 1})", "prompt")
        return text, list(ids)

    def truncation(self, params: SamplingParams | PoolingParams | None) -> int | None:
        """How many prompt tokens a request's truncate_prompt_tokens keeps (None: no truncation); 400 above
        max_model_len."""
        return truncation_limit(getattr(params, "truncate_prompt_tokens", None), self.max_model_len)

    def encode_prompt(self, text: str, params: SamplingParams | PoolingParams | None = None) -> list[int]:
        """A text prompt -> token ids (BOS added as the model wants). A text too long for max_model_len by its
        length alone is refused before it is tokenized; unless the request truncates its prompt: then only the
        characters that can hold the tokens kept are tokenized (as vLLM trims), the end of the text for
        truncation_side "left", its start for "right" (tokenize_prompt cuts the tokens)."""
        keep = self.truncation(params)
        if keep is None:
            self.check_text_length(text)
        elif self.tokenizer.max_token_chars:
            # more characters than keep + 1024 tokens can hold: the cut is by tokens, far from where the text is cut
            room = (keep + 1024) * self.tokenizer.max_token_chars
            if len(text) > room:
                text = text[-room:] if params.truncation_side == "left" else text[:room]  # type: ignore[union-attr]
        return self.tokenizer.encode(text, add_special_tokens=True)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Render the chat template and tokenize it (special tokens in the template are parsed as special); the
        rendered text is checked against max_model_len as encode_prompt checks a prompt. `tools` (OpenAI's
        `tools` list) reach a template that takes them; `template_kwargs` (vLLM's chat_template_kwargs, such as
        Qwen3's enable_thinking or gpt-oss's reasoning_effort) are the template's other variables;
        `continue_final_message`: the final message left open (render_chat)."""
        text = self.render_chat(messages, add_generation_prompt, tools, template_kwargs, continue_final_message)
        return self.encode_rendered_chat(text)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        truncated: bool = False,
    ) -> str:
        """The chat template's text for the conversation, checked against max_model_len (see encode_chat) unless
        the request will truncate it (`truncated`: its tokens are cut by tokenize_prompt). `continue_final_message`:
        the text ends inside the final message, for the model to go on with it (ChatTemplate.render)."""
        extra = {k: v for k, v in (template_kwargs or {}).items() if k not in RESERVED_TEMPLATE_VARIABLES}
        if tools:
            extra["tools"] = tools
        text = self.chat_template.render(messages, add_generation_prompt, continue_final_message, **extra)
        if not truncated:
            self.check_text_length(text)
        return text

    def encode_rendered_chat(self, text: str) -> list[int]:
        # a real template writes its own BOS; the plain fallback gets it the usual way
        return self.tokenizer.encode(text, add_special_tokens=self.chat_template.is_fallback)

    def check_text_length(self, text: str) -> None:
        at_least = self.tokenizer.min_tokens(text)
        if at_least >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(text):,} characters, so at least {at_least:,} tokens; this engine allows at "
                f"most {self.max_model_len - 1} prompt tokens (max_model_len {self.max_model_len})",
                "prompt",
            )

    def check_prompt_length(self, prompt_len: int) -> None:
        limit = self.max_model_len
        if prompt_len >= limit:
            raise PromptTooLongError(
                f"the prompt has {prompt_len} tokens; this engine allows at most {limit - 1} prompt tokens "
                f"(max_model_len {limit}, which also counts the output)",
                "prompt",
            )

    def check_params(self, params: SamplingParams | PoolingParams) -> None:
        """What a request's parameters must satisfy on this engine, whatever its prompt."""
        if isinstance(params, PoolingParams):
            if params.dimensions is not None and params.dimensions > self.hidden_size:
                raise InvalidParameterError(
                    f"dimensions ({params.dimensions}) must be at most the model's {self.hidden_size}", "dimensions"
                )
            return
        if not isinstance(params, SamplingParams):
            raise InvalidParameterError("sampling_params must be a SamplingParams or PoolingParams", "sampling_params")
        if params.n > self.max_num_seqs:
            # the n samples of a request run together: more than fit in a step could never be scheduled
            raise InvalidParameterError(
                f"n={params.n} samples run together, but this engine runs at most {self.max_num_seqs} "
                f"sequences at a time (max_num_seqs); ask for at most {self.max_num_seqs}",
                "n",
            )
        params.validate_token_ids(self.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and self.logprobs_count(asked) > self.max_logprobs:
                whole = " (-1: the whole vocabulary)" if asked < 0 else ""
                raise InvalidParameterError(
                    f"{name} {asked}{whole} asks for {self.logprobs_count(asked)} log-probabilities a position; this "
                    f"engine returns at most {self.max_logprobs} (--max-logprobs)",
                    name,
                )
        if params.structured_outputs is not None:
            self._grammars().compile(params.structured_outputs)  # a constraint that cannot compile: 400 now

    def logprobs_count(self, asked: int) -> int:
        """How many log-probabilities a request's logprobs or prompt_logprobs asks for (-1: the vocabulary)."""
        return self.vocab_size if asked < 0 else asked

    def whole_vocabulary_resolved(self, params: SamplingParams) -> SamplingParams:
        """`params` with a -1 in logprobs or prompt_logprobs (the whole vocabulary) as the vocabulary's size."""
        if (params.logprobs or 0) >= 0 and (params.prompt_logprobs or 0) >= 0:
            return params
        return dataclasses.replace(
            params,
            logprobs=None if params.logprobs is None else self.logprobs_count(params.logprobs),
            prompt_logprobs=None if params.prompt_logprobs is None else self.logprobs_count(params.prompt_logprobs),
        )

    def check_fits(self, prompt_len: int, params: SamplingParams) -> int:
        """The request's max_tokens (fit_output), once its prompt and output also fit the whole KV cache."""
        self.check_prompt_length(prompt_len)
        max_tokens = fit_output(prompt_len, params.max_tokens, self.max_model_len)
        blocks = self.kv.blocks_needed(prompt_len + max_tokens)
        if blocks > self.kv.num_blocks:
            raise PromptTooLongError(
                f"prompt + max_tokens needs {blocks} KV blocks, more than the whole cache ({self.kv.num_blocks})",
                "max_tokens",
            )
        return max_tokens


def fit_output(prompt_len: int, max_tokens: int | None, max_model_len: int) -> int:
    """The one rule for a request's output against the context: None is what is left of it after the prompt; more
    than that (or a prompt that leaves none) is a PromptTooLongError naming max_tokens. Every path that runs a
    request uses it (add_request, beam search), and so does every API of the server (through the engine)."""
    room = max_model_len - prompt_len
    settled = max_tokens if max_tokens is not None else room
    if settled > room or settled < 1:
        raise PromptTooLongError(
            f"prompt ({prompt_len} tokens) + max_tokens ({settled}) = {prompt_len + settled} is more than "
            f"max_model_len {max_model_len}; lower max_tokens to at most {room}",
            "max_tokens",
        )
    return settled
