"""The served model as the server sees it: its facts, limits, recommended sampling, tokenizer and chat template,
and what the request explorer shows of its KV cache.

The one server module that reads the engine's insides (LLMEngine): every other one asks this front, so the engine
may change its rooms without the five APIs noticing (tests/test_layering.py holds the server to it). Requests run
through the engine's async front (AsyncEngine), which the server holds beside this one.
"""

from pathlib import Path
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.config.model_shape import ModelConfig
from tokenmill.engine.llm_engine import LLMEngine, PromptInput
from tokenmill.engine.lora_registry import LoadedLoRA
from tokenmill.loader.model_facts import ModelFacts
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured import StructuredOutputsParams
from tokenmill.tokenizer import Tokenizer
from tokenmill.tokenizer.fim import FimTokens

__all__ = ["PromptInput", "ServedModel", "build_engine"]


def build_engine(
    model: str | None, dtype: str, quantization: str | None, engine_options: dict[str, Any], prefetched: Any = None
) -> LLMEngine:
    """The engine for `tokenmill serve`'s settings (started by the entry point's prefetch where it built one)."""
    if prefetched is not None and prefetched.builds_engine:
        return prefetched.engine()
    return LLMEngine(model, dtype, quantization, EngineConfig.from_options(engine_options), prefetched)


class ServedModel:
    def __init__(self, engine: LLMEngine):
        self._engine = engine
        # the chat template's variables every conversation gets unless its request sets them (--reasoning's
        # enable_thinking)
        self.template_defaults: dict[str, Any] = {}

    # ---- facts --------------------------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The model's own name (the file's stem, or the bundled model's name)."""
        return self._engine.model_name

    def lora_adapters(self) -> list[LoadedLoRA]:
        """The LoRA adapters served beside the model (a copy: the engine's thread changes the registry)."""
        return list(self._engine.loras.loaded.values())

    @property
    def path(self) -> Path:
        return self._engine.model_path

    @property
    def load_seconds(self) -> float:
        """How long building the engine took."""
        return self._engine.load_seconds

    @property
    def facts(self) -> ModelFacts:
        """What model lists show of it (Ollama's /api/tags and /api/show): architecture, size, digest."""
        return self._engine.model_facts

    @property
    def shape(self) -> ModelConfig:
        """Its architecture's numbers: layers, heads, hidden size, vocabulary."""
        return self._engine.model_config

    @property
    def quantization(self) -> str | None:
        return self._engine.quantization

    @property
    def device(self) -> str:
        return str(self._engine.device)

    @property
    def on_gpu(self) -> bool:
        return self._engine.device.type != "cpu"

    @property
    def base_model_note(self) -> str | None:
        """A warning that the model has no chat template of its own (None where it has one)."""
        return self._engine.base_model_note

    @property
    def fim_tokens(self) -> FimTokens | None:
        """Its fill-in-the-middle tokens (None: the vocabulary has none)."""
        return self._engine.fim_tokens

    # ---- limits -------------------------------------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        """Prompt and output together, in tokens."""
        return self._engine.max_model_len

    @property
    def config(self) -> EngineConfig:
        """The engine's options (max_num_seqs, block_size, seed, ...): plain values, read only."""
        return self._engine.config

    @property
    def kv_blocks_total(self) -> int:
        return self._engine.kv.num_blocks

    def check_params(self, params: SamplingParams | PoolingParams) -> None:
        """400 (InvalidParameterError) for parameters this engine cannot run, whatever the prompt; compiles a
        constraint, so a worker thread's job."""
        self._engine.check_params(params)

    def check_prompt_length(self, prompt_len: int) -> None:
        """PromptTooLongError where a prompt of this many tokens leaves no room in the context."""
        self._engine.inputs.check_prompt_length(prompt_len)

    def compile_constraint(self, constraint: StructuredOutputsParams) -> None:
        """Compile a constraint (a 400 if it cannot be); cached for the request that will use it."""
        self._engine.grammars.compile(constraint)

    # ---- recommended sampling -----------------------------------------------------------------------------------

    def sampling_defaults(self) -> dict[str, Any]:
        """The model's recommended sampling (its generation config's), under SamplingParams' names."""
        return self._engine.generation_defaults.sampling_values()

    @property
    def sampling_defaults_source(self) -> str:
        return self._engine.generation_defaults.source

    @property
    def default_max_tokens(self) -> int | None:
        """The generation config's max_new_tokens (None: it names none)."""
        return self._engine.generation_defaults.max_tokens

    # ---- tokenizer and chat template ------------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        return self._engine.tokenizer

    def encode_prompt(self, text: str) -> list[int]:
        """A text prompt's token ids (checked against the context first). Safe from any thread."""
        return self._engine.encode_prompt(text)

    def tokenize_prompt(
        self, prompt: PromptInput, params: SamplingParams | PoolingParams | None = None
    ) -> dict[str, Any]:
        """A prompt as the engine takes it ({"prompt": its text or None, "prompt_token_ids"}): tokenized, checked
        as a request's are (ids in the vocabulary, the length) and truncated as `params` ask
        (truncate_prompt_tokens), as the engine's add_request does (which then has nothing more to cut). Safe from
        any thread."""
        text, ids = self._engine.tokenize_prompt(prompt, params)
        return {"prompt": text, "prompt_token_ids": ids}

    def detokenize(self, token_ids: list[int]) -> str:
        return self._engine.tokenizer.decode(token_ids)

    @property
    def chat_template_source(self) -> str:
        """The template's text (the plain fallback's where the model has none): what reply formats are read from."""
        return self._engine.chat_template.source

    @property
    def own_chat_template(self) -> str | None:
        """The model's own chat template, None where it has none (and the plain fallback renders chats)."""
        template = self._engine.chat_template
        return None if template.is_fallback else template.source

    @property
    def template_takes_tools(self) -> bool:
        return self._engine.chat_template.takes_tools

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        truncated: bool = False,
    ) -> str:
        """The chat template's text for the conversation, checked against the context unless the request
        truncates its prompt (`truncated`)."""
        kwargs = {**self.template_defaults, **(template_kwargs or {})}
        return self._engine.inputs.render_chat(
            messages, add_generation_prompt, tools, kwargs, continue_final_message, truncated
        )

    def encode_rendered_chat(self, text: str) -> list[int]:
        """A rendered chat's token ids (the template's special tokens read as special)."""
        return self._engine.inputs.encode_rendered_chat(text)

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, continue_final_message: bool = False
    ) -> list[int]:
        return self._engine.encode_chat(
            messages, add_generation_prompt, None, self.template_defaults, continue_final_message
        )

    def use_chat_template(self, source: str) -> None:
        """Render chats with this Jinja template instead of the model's (--chat-template-file)."""
        self._engine.use_chat_template(source)

    # ---- the KV cache and the step, for the request explorer ------------------------------------------------------

    def kv_layout(self) -> dict[str, Any]:
        """What turns block counts into bytes: the element type, its scales and a block's size."""
        runner = self._engine.runner
        return {
            "kv_dtype": str(runner.kv_dtype).removeprefix("torch."),
            "kv_element_bytes": runner.kv_dtype.itemsize,
            "kv_scale_bytes": runner.kv_scale_bytes,
            "kv_bytes_per_block": runner.kv_bytes_per_block(),
        }

    @property
    def last_step_summary(self) -> dict[str, Any] | None:
        """The engine's last step, its size and time (None before its first)."""
        return self._engine.last_step_summary

    def record_steps(self, on: bool) -> None:
        """Whether each step leaves a description for the explorer's step events (costs a little per step)."""
        self._engine.record_steps = on
