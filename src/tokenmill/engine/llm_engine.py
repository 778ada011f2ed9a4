"""The synchronous engine: add_request / step / abort. LLMEngine loads the model (its runner, the KV cache's
pools, a draft model) and builds the engine core (core.py: the step) around it; requests come in through the
input processor (input_processor.py) and leave through the output processor (output_processor.py)."""

import itertools
import logging
import time
from pathlib import Path
from typing import Any

import torch

from tokenmill.config import EngineConfig, ModelOptions
from tokenmill.config.quantization import quantization_on
from tokenmill.engine.core import EngineCore
from tokenmill.engine.input_processor import InputProcessor, PromptInput
from tokenmill.engine.lora_registry import LoadedLoRA
from tokenmill.engine.model_prefetch import ModelPrefetch
from tokenmill.errors import EngineClosedError, InvalidParameterError
from tokenmill.executor.launcher import RankSpec
from tokenmill.executor.runner import TensorParallelRunner, start_tensor_parallel
from tokenmill.loader.hub_cache import hub_repo_of
from tokenmill.loader.lora_file import LoRAFile, read_lora
from tokenmill.loader.model_facts import describe_model
from tokenmill.loader.model_path import BUNDLED_NAME, NAMED_MODELS, bundled_model_path, resolve_model_path
from tokenmill.loader.model_source import open_model_source
from tokenmill.model.generation_defaults import read_generation_defaults
from tokenmill.pooling_params import PoolingParams
from tokenmill.runner.device import parse_dtype, select_device
from tokenmill.runner.kv_cache import num_kv_blocks_for, split_kv_pools
from tokenmill.runner.memory import bound_onednn_cache, release_free_memory
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.block_manager import BlockManager
from tokenmill.scheduler.kv_cache_manager import KVCacheManager
from tokenmill.scheduler.window_block_manager import WindowBlockManager
from tokenmill.spec_decode.draft_model import DraftModelProposer, open_draft_model
from tokenmill.spec_decode.speculator import Speculator
from tokenmill.tokenizer import ChatTemplate
from tokenmill.tokenizer.chat_template import BUILTIN_TEMPLATES, base_model_note
from tokenmill.tokenizer.fim import find_fim_tokens
from tokenmill.tokenizer.from_source import load_tokenizer

logger = logging.getLogger(__name__)


ROPE_SPARE_POSITIONS = 64  # rope positions kept beyond max_model_len


class LLMEngine(EngineCore):
    """Loads a model and builds the engine core's parts around it; requests come in through its input
    processor (validation, tokenization) and are queued to the core."""

    def __init__(
        self,
        model: str | None = None,
        dtype: str | torch.dtype = "float32",
        quantization: str | None = None,
        config: EngineConfig | None = None,
        prefetched: ModelPrefetch | None = None,
    ):
        start = time.monotonic()
        self.closed = False
        bound_onednn_cache()  # before the first matrix product
        self.config = config or EngineConfig()
        # the model, dtype and quantization, validated once (config/model.py)
        options = self.model_options = ModelOptions(model, dtype, quantization)
        model, dtype, quantization = options.model, options.dtype, options.quantization
        self.quantization = quantization
        path = resolve_model_path(model)
        self.model_path = path
        # the bundled model has one name, given by default or by its name (not its file's "...Instruct.Q4_1"); a
        # checkpoint from the Hub's cache its repository's (not its snapshot directory's, a commit hash)
        bundled = model is None or NAMED_MODELS.get(model.lower()) is bundled_model_path
        self.model_name = BUNDLED_NAME if bundled else (hub_repo_of(path) or path.stem)
        if prefetched is not None and prefetched.path == path:
            gguf, self.tokenizer = prefetched.take()  # parsed while the caller was starting up
        else:
            gguf = open_model_source(path)
            self.tokenizer = load_tokenizer(gguf)
        self.model_facts = describe_model(gguf)  # for model lists (Ollama's /api/tags, /api/show)
        self.fim_tokens = find_fim_tokens(gguf.get, self.tokenizer.token_to_id)  # None: no fill-in-the-middle
        own_template = gguf.get("tokenizer.chat_template")
        template = own_template or BUILTIN_TEMPLATES.get(gguf.architecture)
        self.chat_template = ChatTemplate(template, self.tokenizer.bos_token, self.tokenizer.eos_token)
        # a file without a chat template is most likely a base model's: said wherever chat is asked of it
        self.base_model_note = None if own_template else base_model_note(self.model_name, template is not None)
        self.generation_defaults = read_generation_defaults(gguf, self.config.generation_config)
        self.device = select_device(self.config.device)
        quantization = self.quantization = quantization_on(quantization, self.device.type)
        spec = self.config.speculative_config
        draft_source = None
        if spec is not None and spec.method == "draft_model":
            draft_source = open_draft_model(spec, gguf, self.tokenizer)
        self.runner: ModelRunner | TensorParallelRunner
        if self.config.tensor_parallel_size > 1:
            del gguf  # each rank reads its own shard of the file
            self.runner = start_tensor_parallel(self._rank_spec(path, dtype))
            self.device = self.runner.device
        else:
            self.runner = ModelRunner(
                gguf,
                parse_dtype(dtype),
                self.device,
                self.config.block_size,
                quantization,
                kv_cache_dtype=self.config.kv_cache_dtype,
                weight_cache=self.config.weight_cache,
            )
        self.model_config = self.runner.model_config
        self.drafter: DraftModelProposer | None = None
        if draft_source is not None:
            try:
                self.drafter = DraftModelProposer(
                    draft_source,
                    spec,
                    parse_dtype(dtype),
                    self.device,
                    self.config.block_size,
                    self.config.kv_cache_dtype,
                )
            except BaseException:
                self.close()
                raise
        num_blocks, num_local_blocks = self._kv_pools()
        cache_tokens = num_blocks * self.config.block_size
        try:
            self.max_model_len = self._max_model_len(cache_tokens)
            # rope tables beyond the positions a sequence can reach (it and up to a speculation's drafts) go
            model = getattr(self.runner, "model", None)  # (tensor parallelism's ranks keep theirs whole)
            if model is not None:
                model.keep_positions(self.max_model_len + ROPE_SPARE_POSITIONS)
            # what loading freed goes back first (glibc keeps it, about 140 MiB at 1.7B): else the cache's pages
            # come on top of it, and that is the peak of the whole start-up
            release_free_memory()
            self.runner.allocate_kv_cache(num_blocks, num_local_blocks)
            if self.drafter is not None:
                self.drafter.allocate_kv_cache(num_blocks)  # indexed by the same block tables
        except BaseException:
            self.close()  # no worker rank outlives an engine that could not be built
            raise
        window_pool = None
        if num_local_blocks:
            window_pool = WindowBlockManager(
                num_local_blocks,
                self.config.block_size,
                self.model_config.sliding_window,  # type: ignore[arg-type]
                self.config.enable_prefix_caching,
            )
        kv = KVCacheManager(
            BlockManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching), window_pool
        )
        super().__init__(
            self.runner,
            self.config,
            kv,
            self.max_model_len,
            self.tokenizer,
            Speculator(spec, self.drafter, self.max_model_len),
        )
        self.inputs = InputProcessor(
            self.tokenizer,
            self.chat_template,
            self.model_config.vocab_size,
            self.model_config.hidden_size,
            self.config.max_num_seqs,
            self.max_model_len,
            kv,
            lambda: self.grammars,
            self.config.max_logprobs,
        )
        self._request_ids = itertools.count()
        try:
            for name, lora_path in (self.config.lora_modules or {}).items():  # --lora NAME=PATH
                self.load_lora(name, lora_path)
        except BaseException:
            self.close()
            raise
        release_free_memory()  # the float32 copies made while loading are gone: give their memory back
        self.load_seconds = time.monotonic() - start
        logger.info(
            "loaded %s on %s in %.2f s; KV cache: %d blocks of %d tokens%s (%.0f MiB), max_model_len %d, "
            "room for %.1f sequences of max_model_len",
            path.name,
            self.device,
            self.load_seconds,
            num_blocks,
            self.config.block_size,
            f", and {num_local_blocks} for the sliding-window layers" if num_local_blocks else "",
            self._kv_cache_bytes(num_blocks, num_local_blocks) / 2**20,
            self.max_model_len,
            cache_tokens / self.max_model_len,
        )
        logger.info("sampling defaults: %s", self.generation_defaults.describe())
        if spec is not None:
            proposer = f"n-gram prompt lookup ({spec.prompt_lookup_min}..{spec.prompt_lookup_max} tokens)"
            if self.drafter is not None:
                proposer = f"draft model {self.drafter.name} ({self.drafter.quantization or 'dense'})"
            logger.info(
                "speculative decoding: up to %d tokens proposed by %s, while at most %d sequences run",
                spec.num_speculative_tokens,
                proposer,
                spec.disable_by_batch_size,
            )

    def _kv_pools(self) -> tuple[int, int]:
        """(blocks of the full-attention layers' pool, blocks of the sliding-window layers' own pool or 0)."""
        layers, local = self.model_config.num_layers, self.runner.num_local_layers
        layer_bytes = self.runner.kv_bytes_per_block() // layers
        # a block of the full pool holds the draft model's K/V of its tokens too
        draft_bytes = self.drafter.kv_bytes_per_block() if self.drafter is not None else 0
        num_blocks = num_kv_blocks_for(self.config, layers * layer_bytes + draft_bytes, self.device)
        window = self.model_config.sliding_window
        return split_kv_pools(self.config, num_blocks, layers, local, window, layer_bytes, draft_bytes)

    def _kv_cache_bytes(self, num_blocks: int, num_local_blocks: int) -> int:
        layers, local = self.model_config.num_layers, (self.runner.num_local_layers if num_local_blocks else 0)
        per_layer = self.runner.kv_bytes_per_block() // layers
        draft = self.drafter.kv_bytes_per_block() * num_blocks if self.drafter is not None else 0
        return per_layer * (num_blocks * (layers - local) + num_local_blocks * local) + draft

    def _rank_spec(self, path: Path, dtype: str | torch.dtype) -> RankSpec:
        dtype_name = str(parse_dtype(dtype)).removeprefix("torch.")
        return RankSpec.for_engine(str(path), dtype_name, self.quantization, self.config)

    def check_ranks(self) -> None:
        """Under tensor parallelism, raise unless every rank still answers (the engine calls it when idle)."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.ping()

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel model and the constraint compiler's threads; the engine takes
        no more requests (EngineClosedError)."""
        self.closed = True
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()
        structured = getattr(self, "structured", None)  # None when loading failed before the core was built
        if structured is not None:
            structured.close()

    def _max_model_len(self, cache_tokens: int) -> int:
        trained = self.model_config.max_position
        if self.config.max_model_len is None:
            return min(trained, cache_tokens)
        if self.config.max_model_len > trained:
            raise InvalidParameterError(
                f"max_model_len {self.config.max_model_len} exceeds the model's context length {trained}",
                "max_model_len",
            )
        return self.config.max_model_len

    # ---- requests -----------------------------------------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"req-{next(self._request_ids)}"

    def tokenize_prompt(
        self, prompt: PromptInput, params: SamplingParams | PoolingParams | None = None
    ) -> tuple[str | None, list[int]]:
        """A prompt's text and token ids, checked and truncated as `params` ask (engine/input_processor.py). Safe
        to call from any thread."""
        return self.inputs.tokenize_prompt(prompt, params)

    def encode_prompt(self, text: str) -> list[int]:
        """A text prompt -> token ids (engine/input_processor.py). Safe to call from any thread."""
        return self.inputs.encode_prompt(text)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """The chat template rendered and tokenized (engine/input_processor.py). Safe from any thread."""
        return self.inputs.encode_chat(messages, add_generation_prompt, tools, template_kwargs, continue_final_message)

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptInput,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        group: str | None = None,
    ) -> str:
        """Validate and queue a request (PoolingParams: an embedding of the prompt); raises InvalidParameterError /
        PromptTooLongError when it cannot run. `group`: the requests of one call share one, and waiting groups
        take turns at admission (scheduler/waiting_queue.py); by default a request is a group of its own."""
        if self.closed:
            raise EngineClosedError("this engine was closed (close()); it takes no more requests: make a new one")
        params = params or SamplingParams()
        self.check_params(params)
        text, ids = self.tokenize_prompt(prompt, params)
        pooling = params if isinstance(params, PoolingParams) else None
        if pooling is not None:  # scheduled as a one-token request whose token is never sampled
            params = SamplingParams(max_tokens=1)
        else:
            params = self.inputs.whole_vocabulary_resolved(params)  # logprobs -1: the vocabulary's size
        request_id = request_id if request_id is not None else self.new_request_id()
        if request_id in self.requests:
            raise InvalidParameterError(f"request id {request_id!r} is already in use", "request_id")
        if not ids:
            raise InvalidParameterError("the prompt is empty", "prompt")
        max_tokens = self.inputs.check_fits(len(ids), params)
        self.queue(request_id, text, ids, params, max_tokens, arrival_time, pooling, group)
        return request_id

    def use_chat_template(self, source: str) -> None:
        """Render chats with this Jinja template instead of the model's (llama-server's --chat-template-file)."""
        self.chat_template = ChatTemplate(source, self.tokenizer.bos_token, self.tokenizer.eos_token)
        self.inputs.chat_template = self.chat_template
        self.base_model_note = None  # a template was given: chat is what the user means to do

    def check_params(self, params: SamplingParams | PoolingParams) -> None:
        """What a request's parameters must satisfy on this engine, whatever its prompt. Safe from any thread."""
        self.inputs.check_params(params)
        if isinstance(params, SamplingParams) and params.lora_name is not None:
            self.loras.id_of(params.lora_name)  # LoRANotFoundError

    # ---- LoRA adapters (engine/lora_registry.py) ------------------------------------------------------------------

    def load_lora(self, name: str, lora: "str | LoRAFile") -> LoadedLoRA:
        """Serve adapter `lora` (a path, or a file read by loader/lora_file.read_lora) under `name`; on the engine's
        thread. Raises LoRAError (a bad path or adapter) or LoRAExistsError."""
        return self.loras.load(name, read_lora(lora) if isinstance(lora, str) else lora)

    def unload_lora(self, name: str) -> LoadedLoRA:
        """Stop serving adapter `name` (LoRANotFoundError when it is not loaded); on the engine's thread."""
        return self.loras.unload(name, self.lora_ids_in_use())
