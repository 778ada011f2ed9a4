"""The synchronous engine: add_request / step / abort over the scheduler and the model runner.

One step: the scheduler picks tokens, the runner computes them in one forward pass, the sampler draws one token
for every sequence whose tokens are all computed, then each new token is detokenized and checked against the
stop conditions. Finished sequences free their blocks at once; their slots go to waiting requests next step.
"""

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.config import EngineConfig, SpeculativeConfig
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.request import Request, SampleState
from tokenmill.errors import EngineClosedError, InvalidParameterError, PromptTooLongError
from tokenmill.executor.launcher import RankSpec
from tokenmill.executor.runner import TensorParallelRunner, start_tensor_parallel
from tokenmill.loader.model_path import BUNDLED_NAME, resolve_model_path
from tokenmill.loader.model_source import load_tokenizer, open_model_source
from tokenmill.loader.prefetch import ModelPrefetch
from tokenmill.model.generation_defaults import read_generation_defaults
from tokenmill.outputs import Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from tokenmill.runner.device import parse_dtype, select_device
from tokenmill.runner.kv_cache import num_kv_blocks_for
from tokenmill.runner.memory import bound_onednn_cache, release_free_memory
from tokenmill.runner.model_runner import ModelRunner, StepChunk
from tokenmill.runner.sampler import SampledToken, Sampler, SamplingRow, is_plain_greedy, prompt_logprobs
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.block_manager import BlockManager, WindowBlockManager
from tokenmill.scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tokenmill.scheduler.sequence import Sequence, SequenceStatus
from tokenmill.spec_decode.acceptance import AcceptanceTracker
from tokenmill.spec_decode.draft_model import DraftModelProposer, open_draft_model
from tokenmill.spec_decode.ngram import propose_ngram
from tokenmill.spec_decode.stats import SpecDecodeStats
from tokenmill.tokenizer import ChatTemplate
from tokenmill.tokenizer.chat_template import BUILTIN_TEMPLATES, base_model_note

if TYPE_CHECKING:
    from tokenmill.structured.grammars import GrammarCompiler

logger = logging.getLogger(__name__)

PromptInput = str | dict[str, Any] | list[int]
QUANTIZATION_MODES = (None, "int8", "int4", "auto")


class LLMEngine:
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
        self._grammars: GrammarCompiler | None = None  # made at first use (grammars)
        bound_onednn_cache()  # before the first matrix product
        self.config = config or EngineConfig()
        if quantization == "none":
            quantization = None
        if quantization not in QUANTIZATION_MODES:
            raise InvalidParameterError(
                f"quantization {quantization!r} is not supported (use None to dequantize, 'int8', 'int4' or 'auto')",
                "quantization",
            )
        self.quantization = quantization
        path = resolve_model_path(model)
        self.model_path = path
        self.model_name = BUNDLED_NAME if model is None else path.stem
        if prefetched is not None and prefetched.path == path:
            gguf, self.tokenizer = prefetched.take()  # parsed while the caller was starting up
        else:
            gguf = open_model_source(path)
            self.tokenizer = load_tokenizer(gguf)
        own_template = gguf.get("tokenizer.chat_template")
        template = own_template or BUILTIN_TEMPLATES.get(gguf.architecture)
        self.chat_template = ChatTemplate(template, self.tokenizer.bos_token, self.tokenizer.eos_token)
        # a file without a chat template is most likely a base model's: said wherever chat is asked of it
        self.base_model_note = None if own_template else base_model_note(self.model_name, template is not None)
        self.generation_defaults = read_generation_defaults(gguf, self.config.generation_config)
        self.device = select_device(self.config.device)
        if quantization == "auto" and self.device.type != "cpu":
            quantization = self.quantization = None  # the quantized kernels are CPU kernels: dense weights there
        if quantization is not None and self.device.type != "cpu":
            raise InvalidParameterError(
                f"quantization {quantization!r} uses CPU kernels; on {self.device.type} use quantization=None",
                "quantization",
            )
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
            # what loading freed goes back first (glibc keeps it, about 140 MiB at 1.7B): else the cache's pages
            # come on top of it, and that is the peak of the whole start-up
            release_free_memory()
            self.runner.allocate_kv_cache(num_blocks, num_local_blocks)
            if self.drafter is not None:
                self.drafter.allocate_kv_cache(num_blocks)  # indexed by the same block tables
        except BaseException:
            self.close()  # no worker rank outlives an engine that could not be built
            raise
        self.block_manager = BlockManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.window_manager: WindowBlockManager | None = None
        if num_local_blocks:
            self.window_manager = WindowBlockManager(
                num_local_blocks,
                self.config.block_size,
                self.model_config.sliding_window,  # type: ignore[arg-type]
                self.config.enable_prefix_caching,
            )
        self.scheduler = Scheduler(
            SchedulerConfig(self.config.max_num_seqs, self.config.max_num_batched_tokens, self.max_model_len),
            self.block_manager,
            self.window_manager,
        )
        self.sampler = Sampler(self.device)
        self.requests: dict[str, Request] = {}
        self._grammars_lock = threading.Lock()
        self._mask_pool: ThreadPoolExecutor | None = None  # computes constrained rows' masks during the forward
        self.record_steps = False  # when set, each step leaves a description in last_step (for the explorer)
        self.last_step: dict[str, Any] | None = None
        # with record_steps: called with the step's description once it is scheduled, before its forward pass
        self.on_step_start: Callable[[dict[str, Any]], None] | None = None
        # the last step's size and time, recorded whatever record_steps says (the explorer shows it at page load)
        self.last_step_summary: dict[str, Any] | None = None
        self.num_steps = 0
        self.prompt_tokens_total = 0  # prompt tokens computed (prefix-cache hits are not), for the throughput log
        self.generation_tokens_total = 0  # tokens sampled
        self.spec_decode = SpecDecodeStats()  # proposals made and accepted (speculative decoding)
        self._ngram_proposals: dict[int, list[int]] = {}  # this step's, by seq_id (n-gram speculation)
        # how many proposals pay, per sequence and step
        self.acceptance = AcceptanceTracker(spec.verify_row_cost if spec is not None else 0.0)
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
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
        """(blocks of the full-attention layers' pool, blocks of the sliding-window layers' own pool or 0).

        The memory is what one pool for every layer would take (runner/kv_cache.py). With sliding-window layers,
        their pool holds what max_num_seqs sequences read in their windows plus a step's new tokens (at least
        one sequence's), since their blocks go back once they leave the window; the rest of the memory goes to
        the full-attention layers, whose blocks every position keeps."""
        layers, local = self.model_config.num_layers, self.runner.num_local_layers
        bytes_per_block = self.runner.kv_bytes_per_block()
        if self.drafter is not None:  # a block holds the draft model's K/V of its tokens too
            bytes_per_block += self.drafter.kv_bytes_per_block()
        num_blocks = num_kv_blocks_for(self.config, bytes_per_block, self.device)
        if not local:
            return num_blocks, 0
        bs, window = self.config.block_size, self.model_config.sliding_window
        assert window is not None  # local layers have a window
        step_blocks = -(-self.config.max_num_batched_tokens // bs)  # a step's new tokens, all in one sequence
        one = -(-window // bs) + 2 + step_blocks  # what one sequence may hold during a step
        want = self.config.max_num_seqs * (-(-window // bs) + 1) + step_blocks
        num_local = max(one, min(num_blocks, want))
        return max(1, (num_blocks * layers - num_local * local) // (layers - local)), num_local

    def _kv_cache_bytes(self, num_blocks: int, num_local_blocks: int) -> int:
        layers, local = self.model_config.num_layers, (self.runner.num_local_layers if num_local_blocks else 0)
        per_layer = self.runner.kv_bytes_per_block() // layers
        draft = self.drafter.kv_bytes_per_block() * num_blocks if self.drafter is not None else 0
        return per_layer * (num_blocks * (layers - local) + num_local_blocks * local) + draft

    def _rank_spec(self, path: Path, dtype: str | torch.dtype) -> RankSpec:
        dtype_name = str(parse_dtype(dtype)).removeprefix("torch.")
        return RankSpec.for_engine(str(path), dtype_name, self.quantization, self.config)

    @property
    def tensor_parallel(self) -> TensorParallelRunner | None:
        return self.runner if isinstance(self.runner, TensorParallelRunner) else None

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
        if self._grammars is not None:
            self._grammars.close()

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

    def tokenize_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.encode_prompt(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            text = prompt.get("prompt")
        elif isinstance(prompt, list):
            ids, text = prompt, None
        else:
            raise InvalidParameterError("a prompt is a string or {'prompt_token_ids': [...]}", "prompt")
        if not isinstance(ids, list):
            raise InvalidParameterError("prompt_token_ids must be a list of integers", "prompt")
        self._check_prompt_length(len(ids))  # before looking at each id of a list that may be huge
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidParameterError("prompt_token_ids must be a list of integers", "prompt")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidParameterError(f"prompt token id {bad[0]} is outside the vocabulary 0..{vocab - 1}", "prompt")
        return text, list(ids)

    def encode_prompt(self, text: str) -> list[int]:
        """A text prompt -> token ids (BOS added as the model wants). A text too long for max_model_len by its
        length alone is refused before it is tokenized. Safe to call from any thread."""
        self._check_text_length(text)
        return self.tokenizer.encode(text, add_special_tokens=True)

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        """Render the chat template and tokenize it (special tokens in the template are parsed as special); the
        rendered text is checked against max_model_len as encode_prompt checks a prompt. `tools` (OpenAI's
        `tools` list) reach a template that takes them. Safe from any thread."""
        extra = {"tools": tools} if tools else {}
        text = self.chat_template.render(messages, add_generation_prompt, **extra)
        self._check_text_length(text)
        # a real template writes its own BOS; the plain fallback gets it the usual way
        return self.tokenizer.encode(text, add_special_tokens=self.chat_template.is_fallback)

    def _check_text_length(self, text: str) -> None:
        at_least = self.tokenizer.min_tokens(text)
        if at_least >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(text):,} characters, so at least {at_least:,} tokens; this engine allows at "
                f"most {self.max_model_len - 1} prompt tokens (max_model_len {self.max_model_len})",
                "prompt",
            )

    def _check_prompt_length(self, prompt_len: int) -> None:
        limit = self.max_model_len
        if prompt_len >= limit:
            raise PromptTooLongError(
                f"the prompt has {prompt_len} tokens; this engine allows at most {limit - 1} prompt tokens "
                f"(max_model_len {limit}, which also counts the output)",
                "prompt",
            )

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validate and queue a request; raises InvalidParameterError / PromptTooLongError when it cannot run."""
        if self.closed:
            raise EngineClosedError("this engine was closed (close()); it takes no more requests: make a new one")
        params = params or SamplingParams()
        self.check_params(params)
        request_id = request_id if request_id is not None else self.new_request_id()
        if request_id in self.requests:
            raise InvalidParameterError(f"request id {request_id!r} is already in use", "request_id")
        text, ids = self.tokenize_prompt(prompt)
        if not ids:
            raise InvalidParameterError("the prompt is empty", "prompt")
        max_tokens = self._check_fits(len(ids), params)
        metrics = RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.monotonic())
        request = Request(request_id, text, ids, params, metrics)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        seq = Sequence(next(self._seq_ids), request_id, ids, params, 0, max_tokens)
        state = self._sample_state(seq, request)
        if params.structured_outputs is not None:
            state.grammar = self.grammars.matcher(self.grammars.compile(params.structured_outputs))
        request.samples.append(state)
        self.requests[request_id] = request
        self.scheduler.add(seq)
        return request_id

    def check_params(self, params: SamplingParams) -> None:
        """What a request's parameters must satisfy on this engine, whatever its prompt. Safe from any thread."""
        if not isinstance(params, SamplingParams):
            raise InvalidParameterError("sampling_params must be a SamplingParams", "sampling_params")
        if params.n > self.config.max_num_seqs:
            # the n samples of a request run together: more than fit in a step could never be scheduled
            raise InvalidParameterError(
                f"n={params.n} samples run together, but this engine runs at most {self.config.max_num_seqs} "
                f"sequences at a time (max_num_seqs); ask for at most {self.config.max_num_seqs}",
                "n",
            )
        params.validate_token_ids(self.model_config.vocab_size)
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)  # a constraint that cannot compile: 400 now

    @property
    def grammars(self) -> "GrammarCompiler":
        """The structured-output compiler, made at first use (llguidance's tokenizer costs about 0.3 s)."""
        with self._grammars_lock:
            if self._grammars is None:
                from tokenmill.structured.grammars import GrammarCompiler

                self._grammars = GrammarCompiler(
                    self.tokenizer,
                    self.model_config.vocab_size,
                    self.config.max_constraint_bytes,
                    self.config.max_constraint_compile_seconds,
                )
            return self._grammars

    def _check_fits(self, prompt_len: int, params: SamplingParams) -> int:
        limit = self.max_model_len
        self._check_prompt_length(prompt_len)
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - prompt_len
        if prompt_len + max_tokens > limit:
            raise PromptTooLongError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {prompt_len + max_tokens} is more "
                f"than max_model_len {limit}; lower max_tokens to at most {limit - prompt_len}",
                "max_tokens",
            )
        blocks = self.block_manager.blocks_needed(prompt_len + max_tokens)
        if blocks > self.block_manager.num_blocks:
            raise PromptTooLongError(
                f"prompt + max_tokens needs {blocks} KV blocks, "
                f"more than the whole cache ({self.block_manager.num_blocks})",
                "max_tokens",
            )
        return max_tokens

    def _sample_state(self, seq: Sequence, request: Request) -> SampleState:
        p = request.params
        detok = IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            p.skip_special_tokens,
            p.stop_strings,
            p.include_stop_str_in_output,
        )
        return SampleState(seq, detok, [] if p.logprobs is not None else None)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now: its sequences leave the queue or the batch and free their blocks."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        request.aborted = True
        for sample in request.samples:
            if not sample.seq.is_finished:
                sample.seq.finish_reason = "abort"
                self.scheduler.finish(sample.seq)
                self.sampler.release(sample.seq.seq_id)
                self._release_speculation(sample.seq.seq_id)
        request.metrics.finished_time = time.monotonic()
        output = request.make_output()
        output.finished = True
        return output

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step -----------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        spec = self.config.speculative_config
        if spec is not None:
            self._plan_speculation(spec)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        now = time.monotonic()
        self.runner.copy_blocks(sched.block_copies, sched.local_block_copies)
        if spec is not None:
            self._fill_drafts(sched)
        chunks = []
        for s in sched.scheduled:
            request = self.requests[s.seq.request_id]
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
            if s.start < s.seq.num_prompt_tokens and s.seq.sample_index == 0:  # its samples share one prefill
                request.metrics.num_prefill_chunks += 1
            drafts = s.draft_token_ids
            chunks.append(
                StepChunk(
                    token_ids=s.seq.token_ids[s.start : s.start + s.num_new_tokens - len(drafts)] + drafts,
                    start_position=s.start,
                    block_table=s.seq.block_table,
                    local_block_table=s.seq.local_block_table if self.window_manager is not None else None,
                    want_last_logits=s.completes_sequence and not drafts,
                    # with proposals: the logits after each of its tokens, to verify them one by one
                    want_all_logits=bool(drafts) or self._collects_prompt_logprobs(request, s.seq, s.start),
                    prompt_len=s.seq.num_prompt_tokens,
                )
            )
        if self.record_steps and self.on_step_start is not None:  # the explorer shows a step while it runs
            self.on_step_start(self._describe_step(sched, self._step_header(sched)))
        masks = self._start_grammar_masks(sched)  # computed while the forward runs
        result = self.runner.execute(chunks)
        self.num_steps += 1
        for s in sched.scheduled:
            prompt_len = s.seq.num_prompt_tokens
            self.prompt_tokens_total += max(0, min(s.start + s.num_new_tokens, prompt_len) - s.start)
        self.scheduler.update_after_step(sched)
        self.last_step_summary = self._summarize_step(sched, now)
        step = self._describe_step(sched, self.last_step_summary) if self.record_steps else None
        touched: dict[str, Request] = {}
        for s, logits in zip(sched.scheduled, result.all_logits, strict=True):
            if logits is not None and not s.draft_token_ids:
                self._add_prompt_logprobs(self.requests[s.seq.request_id], s.start, logits)
        self._sample_and_append(sched, result.last_logits, touched, masks)
        accepted = self._verify_drafts(sched, result.all_logits, touched)
        if step is not None:  # with what each constrained row's mask allowed, known once sampled
            for entry, s in zip(step["batch"], sched.scheduled, strict=True):
                if s.completes_sequence and s.seq.params.structured_outputs is not None:
                    entry["allowed_tokens"] = self._sample_of(s.seq).allowed_tokens
                if s.draft_token_ids:
                    entry["accepted"] = accepted[s.seq.seq_id]
            self.last_step = step
        outputs = []
        for request in touched.values():
            if request.finished:
                request.metrics.finished_time = time.monotonic()
                del self.requests[request.request_id]
            outputs.append(request.make_output())
        return outputs

    def _step_header(self, sched: SchedulerOutput) -> dict[str, Any]:
        """The number and size of the step being run (num_steps counts those done)."""
        return {
            "step": self.num_steps + 1,
            "num_tokens": sched.num_batched_tokens,
            "batch_size": len(sched.scheduled),
            "ranks": self.config.tensor_parallel_size,  # processes that compute this step
        }

    def _summarize_step(self, sched: SchedulerOutput, start: float) -> dict[str, Any]:
        """The step just done (counted in num_steps): its number, size, and time."""
        return {
            **self._step_header(sched),
            "step": self.num_steps,
            "duration_ms": round((time.monotonic() - start) * 1000, 3),
            "collective_ms": round(tp.last_step_collective_s * 1000, 3) if (tp := self.tensor_parallel) else 0.0,
        }

    def _describe_step(self, sched: SchedulerOutput, summary: dict[str, Any]) -> dict[str, Any]:
        """What this step did, per sequence, in plain data (the explorer streams it to browsers)."""
        batch = []
        for s in sched.scheduled:
            seq = s.seq
            prefill = s.start < seq.num_prompt_tokens
            metrics = self.requests[seq.request_id].metrics
            batch.append(
                {
                    "request_id": seq.request_id,
                    "sample": seq.sample_index,
                    "kind": "prefill" if prefill else "decode",
                    "start": s.start,
                    "tokens": s.num_new_tokens,
                    "prompt_tokens": seq.num_prompt_tokens,
                    "cached_tokens": seq.num_cached_tokens,
                    # the request's prefill chunks so far, this one included (the engine's own count)
                    "prefill_chunk": metrics.num_prefill_chunks if prefill else None,
                    # speculative decoding: tokens proposed after the last one, and (once verified) how many held
                    "proposed": len(s.draft_token_ids),
                    "accepted": None,
                    "blocks": len(seq.block_table),
                    "allowed_tokens": None,  # a constrained sequence: how many tokens its mask allowed
                }
            )
        return {**summary, "batch": batch, "preempted": [seq.request_id for seq in sched.preempted]}

    def _collects_prompt_logprobs(self, request: Request, seq: Sequence, start: int) -> bool:
        if request.prompt_logprobs is None or seq.sample_index != 0:
            return False
        return start < seq.num_prompt_tokens - 1 and len(request.prompt_logprobs) < seq.num_prompt_tokens

    def _add_prompt_logprobs(self, request: Request, start: int, logits: torch.Tensor) -> None:
        """logits [chunk_len, V]: row j follows prompt token start + j and scores prompt token start + j + 1."""
        assert request.prompt_logprobs is not None
        ids = request.prompt_token_ids
        first_target = len(request.prompt_logprobs)  # next prompt position still missing
        rows = [j for j in range(logits.shape[0]) if first_target <= start + j + 1 < len(ids)]
        if not rows:
            return
        targets = [ids[start + j + 1] for j in rows]
        k = request.params.prompt_logprobs or 0
        for target, (lp, rank, top) in zip(
            targets, prompt_logprobs(logits[rows[0] : rows[-1] + 1], targets, k), strict=True
        ):
            request.prompt_logprobs.append(self._position_logprobs(target, lp, rank, top))

    def _position_logprobs(self, token: int, logprob: float, rank: int, top: list) -> PositionLogprobs:
        entry = {token: Logprob(logprob, rank, self.tokenizer.decode([token]))}
        for r, (tid, lp) in enumerate(top, start=1):
            if tid not in entry:
                entry[tid] = Logprob(lp, r, self.tokenizer.decode([tid]))
        return entry

    def _sample_of(self, seq: Sequence) -> SampleState:
        """The engine's state of a sequence of a request still in flight."""
        return next(x for x in self.requests[seq.request_id].samples if x.seq is seq)

    def _start_grammar_masks(self, sched: SchedulerOutput) -> "Future[dict[int, torch.Tensor]] | None":
        """The allowed tokens of every constrained sequence that samples this step (seq_id -> bool [vocab]),
        computed in a thread while the forward pass runs (llguidance releases the GIL), or None."""
        matchers = {
            s.seq.seq_id: self._sample_of(s.seq).grammar
            for s in sched.scheduled
            if s.completes_sequence and s.seq.params.structured_outputs is not None
        }
        if not matchers:
            return None
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-grammar")
        grammars = self.grammars

        def compute() -> dict[int, torch.Tensor]:
            allowed = grammars.allowed(list(matchers.values()))  # [C, vocab]
            return dict(zip(matchers, allowed, strict=True))

        return self._mask_pool.submit(compute)

    def _sample_and_append(
        self,
        sched: SchedulerOutput,
        logits: torch.Tensor,
        touched: dict[str, Request],
        masks: "Future[dict[int, torch.Tensor]] | None" = None,
    ) -> None:
        rows: list[SamplingRow] = []
        row_samples: list[tuple[Request, SampleState]] = []
        logits_row = 0
        for s in sched.scheduled:
            if not s.completes_sequence or s.draft_token_ids:  # proposals are verified by _verify_drafts
                continue
            request = self.requests[s.seq.request_id]
            samples = [self._sample_of(s.seq)]
            if request.params.n > 1 and not request.forked:
                samples += self._fork(request, s.seq)
            for sample in samples:
                rows.append(self._sampling_row(sample.seq, logits_row))
                row_samples.append((request, sample))
            logits_row += 1
        if not rows:
            return
        if masks is not None:
            allowed = masks.result()
            kept = []
            for row, (request, sample) in zip(rows, row_samples, strict=True):
                if sample.grammar is not None:
                    # a sample forked this step starts where its parent, the request's first, is: the parent's mask
                    mask = allowed.get(sample.seq.seq_id)
                    row.allowed = mask if mask is not None else allowed[request.samples[0].seq.seq_id]
                    sample.allowed_tokens = int(row.allowed.sum())
                    if sample.grammar.is_error() or not sample.allowed_tokens:  # nothing may be sampled
                        self._fail_constraint(request, sample)
                        touched[request.request_id] = request
                        continue
                kept.append((row, (request, sample)))
            rows, row_samples = [r for r, _ in kept], [rs for _, rs in kept]
            if not rows:
                return
        sampled = self.sampler.sample(logits, rows)
        self.generation_tokens_total += len(sampled)
        now = time.monotonic()
        for (request, sample), token in zip(row_samples, sampled, strict=True):
            self._append_token(request, sample, token, now)
            touched[request.request_id] = request

    def _plan_speculation(self, spec: SpeculativeConfig) -> None:
        """How many tokens each decoding sequence proposes this step: as many as pay for their rows (by its recent
        acceptance rate and the batch's size: spec_decode/acceptance.py), none while more than
        spec.disable_by_batch_size sequences run, none for constrained ones (their grammar would have to follow
        every proposal) or past max_tokens and max_model_len. n-gram proposals are looked up now (their number is
        what matched); a draft model's are made once the scheduler has given them slots (_fill_drafts)."""
        running = self.scheduler.running
        speculate = self.spec_decode.active = len(running) <= spec.disable_by_batch_size
        self._ngram_proposals.clear()
        for seq in running:
            seq.num_lookahead_tokens = 0
            if not speculate or seq.num_computed_tokens != seq.num_tokens - 1 or seq.num_output_tokens == 0:
                continue  # not decoding (prefill left, or the prompt's last token)
            if seq.params.structured_outputs is not None:
                continue
            room = min(
                spec.num_speculative_tokens,
                seq.max_tokens - seq.num_output_tokens - 1,  # the step emits one token more than it accepts
                self.max_model_len - seq.num_tokens,
            )
            # as many as pay for their rows, by the sequence's recent acceptance rate and the batch's size
            room = self.acceptance.proposal_length(seq.seq_id, room, len(running)) if room > 0 else 0
            if room > 0 and self.drafter is None:
                proposals = propose_ngram(seq.token_ids, spec.prompt_lookup_max, spec.prompt_lookup_min, room)
                self._ngram_proposals[seq.seq_id] = proposals
                room = len(proposals)
            if room == 0:
                self.acceptance.idle(seq.seq_id)
            seq.num_lookahead_tokens = room

    def _fill_drafts(self, sched: SchedulerOutput) -> None:
        """The proposals of the sequences the scheduler gave proposal slots (as many as it gave)."""
        wanted = [s for s in sched.scheduled if s.num_draft_tokens]
        if self.drafter is None:
            for s in wanted:
                s.draft_token_ids = self._ngram_proposals[s.seq.seq_id][: s.num_draft_tokens]
            return
        self.drafter.copy_blocks(sched.block_copies)  # the target's copy-on-write, in the draft's cache too
        if wanted:
            proposals = self.drafter.propose([(s.seq, s.num_draft_tokens) for s in wanted])
            for s, tokens in zip(wanted, proposals, strict=True):
                s.draft_token_ids = tokens

    def _verify_drafts(self, sched: SchedulerOutput, all_logits: list, touched: dict[str, Request]) -> dict[int, int]:
        """Sample each proposing sequence's rows in order, as plain decoding would sample its next tokens, and
        keep going while the sampled token is the proposed one. A proposal is a single token, so accepting it
        exactly when the target's own sample equals it is exact rejection sampling: the output has the target's
        distribution, and with the same seed the same tokens (one draw per emitted token, as without proposals).
        Rows of all proposing sequences are sampled together, one position at a time; plain greedy rows, whose
        token does not depend on the tokens before it, all at once. Returns seq_id -> proposals accepted."""
        verifying = [(s, logits) for s, logits in zip(sched.scheduled, all_logits, strict=True) if s.draft_token_ids]
        if not verifying:
            return {}
        upfront = self._sample_independent_rows(verifying)
        accepted = [0] * len(verifying)
        active = list(range(len(verifying)))
        position = 0
        while active:
            drawn: dict[int, SampledToken] = {k: upfront[k][position] for k in active if k in upfront}
            needed = [k for k in active if k not in upfront]
            if needed:
                rows = [self._sampling_row(verifying[k][0].seq, row) for row, k in enumerate(needed)]
                logits = torch.stack([verifying[k][1][position] for k in needed])  # [needed, vocab]
                drawn.update(zip(needed, self.sampler.sample(logits, rows), strict=True))
            self.generation_tokens_total += len(active)
            now = time.monotonic()
            still = []
            for k in active:
                s, token = verifying[k][0], drawn[k]
                request = self.requests[s.seq.request_id]
                self._append_token(request, self._sample_of(s.seq), token, now)
                touched[request.request_id] = request
                drafts = s.draft_token_ids
                if not s.seq.is_finished and position < len(drafts) and token.token_id == drafts[position]:
                    accepted[k] += 1
                    still.append(k)
            active = still
            position += 1
        for (s, _), num_accepted in zip(verifying, accepted, strict=True):
            self.spec_decode.record(len(s.draft_token_ids), num_accepted)
            self.acceptance.observe(s.seq.seq_id, len(s.draft_token_ids), num_accepted)
            if not s.seq.is_finished:
                self.scheduler.commit_accepted(s.seq, num_accepted)
        return {s.seq.seq_id: n for (s, _), n in zip(verifying, accepted, strict=True)}

    def _sample_independent_rows(self, verifying: list) -> dict[int, list[SampledToken]]:
        """The tokens of every row of the verifying sequences (index into `verifying` -> one per row) whose rows are
        plain greedy (no penalty, bias or ban: min_tokens reached), in one sampler call: such a row's token is its
        argmax whatever came before it, so the verification needs no round per position."""
        independent = [k for k, (s, _) in enumerate(verifying) if is_plain_greedy(self._sampling_row(s.seq, 0))]
        if not independent:
            return {}
        rows: list[SamplingRow] = []
        for k in independent:
            seq, first = verifying[k][0].seq, len(rows)
            rows += [self._sampling_row(seq, first + j) for j in range(verifying[k][1].shape[0])]
        sampled = self.sampler.sample(torch.cat([verifying[k][1] for k in independent]), rows)  # [sum(K + 1), vocab]
        upfront, first = {}, 0
        for k in independent:
            count = verifying[k][1].shape[0]
            upfront[k], first = sampled[first : first + count], first + count
        return upfront

    def _fork(self, request: Request, parent: Sequence) -> list[SampleState]:
        """After the prompt is computed, the other n - 1 samples share its KV blocks."""
        request.forked = True
        children = []
        for index in range(1, request.params.n):
            child = Sequence(
                next(self._seq_ids), request.request_id, parent.token_ids, request.params, index, parent.max_tokens
            )
            child.num_prompt_tokens = parent.num_prompt_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.ever_scheduled = True
            self.block_manager.fork(parent, child)
            if self.window_manager is not None:
                self.window_manager.fork(parent, child)
            self.scheduler.add_running(child)
            state = self._sample_state(child, request)
            parent_state = self._sample_of(parent)
            if parent_state.grammar is not None:  # at the start of the output, as the parent's
                state.grammar = parent_state.grammar.deep_copy()
            request.samples.append(state)
            children.append(state)
        return children

    def _sampling_row(self, seq: Sequence, logits_row: int) -> SamplingRow:
        p = seq.params
        banned: list[int] = []
        if seq.num_output_tokens < p.min_tokens:
            banned = list(p.stop_token_ids or [])
            if not p.ignore_eos:
                banned += sorted(self.tokenizer.stop_token_ids)
        seed = None
        if p.seed is not None:
            seed = p.seed if seq.sample_index == 0 else (p.seed * 1_000_003 + seq.sample_index) % 2**64
        return SamplingRow(seq.seq_id, logits_row, p, seq.prompt_token_ids, seq.output_token_ids, banned, seed)

    def _append_token(self, request: Request, sample: SampleState, token: SampledToken, now: float) -> None:
        seq = sample.seq
        p = seq.params
        seq.append_token(token.token_id)
        seq.cumulative_logprob += token.logprob
        if sample.logprobs is not None:
            sample.logprobs.append(
                self._position_logprobs(token.token_id, token.logprob, token.rank, token.top_logprobs or [])
            )
        metrics = request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        if seq.sample_index == 0:
            metrics.token_times.append(now)
            metrics.last_token_time = now
        # stop conditions, in vLLM's order: stop tokens, stop strings, then length; a constraint that is complete
        # (nothing more may follow) ends the output too
        n_out = seq.num_output_tokens
        can_stop = n_out >= p.min_tokens
        grammar_done = False
        if sample.grammar is not None:
            accepted = sample.grammar.consume_token(token.token_id)
            if sample.grammar.is_error():  # a limit hit mid-way: the output cannot be finished as constrained
                sample.detokenizer.add_token(token.token_id, check_stop=False)  # the mask allowed it
                self._fail_constraint(request, sample)
                return
            grammar_done = not accepted or sample.grammar.is_stopped()
        if grammar_done and token.token_id in self.tokenizer.stop_token_ids:
            self._finish(seq, "stop", None)
        elif can_stop and not p.ignore_eos and token.token_id in self.tokenizer.stop_token_ids:
            self._finish(seq, "stop", None)
        elif can_stop and p.stop_token_ids and token.token_id in p.stop_token_ids:
            self._finish(seq, "stop", token.token_id)
        else:
            stop = sample.detokenizer.add_token(token.token_id, check_stop=can_stop)
            if stop is not None:
                self._finish(seq, "stop", stop)
            elif grammar_done:
                sample.detokenizer.flush()
                self._finish(seq, "stop", None)
            elif n_out >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
                sample.detokenizer.flush()
                self._finish(seq, "length", None)

    def _fail_constraint(self, request: Request, sample: SampleState) -> None:
        """End a constrained sequence whose matcher failed (llguidance's limits, met mid-way): finish_reason
        "error" with the matcher's reason, never "stop" (its text so far does not satisfy the constraint)."""
        from tokenmill.structured.grammars import clean_reason

        error = sample.grammar.get_error() if sample.grammar.is_error() else "it allows no token here"
        sample.error = f"the structured-output constraint cannot be followed further: {clean_reason(error)}"
        seq = sample.seq
        logger.error(
            "request %s (sample %d) ends with an error after %d tokens: %s",
            request.request_id,
            seq.sample_index,
            seq.num_output_tokens,
            sample.error,
        )
        sample.detokenizer.flush()
        self._finish(seq, "error", None)

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.scheduler.finish(seq)
        self.sampler.release(seq.seq_id)
        self._release_speculation(seq.seq_id)

    def _release_speculation(self, seq_id: int) -> None:
        self.acceptance.release(seq_id)
        if self.drafter is not None:
            self.drafter.release(seq_id)

    # ---- introspection ------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        usage = self.block_manager.usage()
        local = self.window_manager.usage() if self.window_manager is not None else None
        running = self.scheduler.running
        tp = self.tensor_parallel
        return {
            "kv_blocks_total": usage.total,
            "kv_blocks_free": usage.free,
            "kv_blocks_cached": usage.cached,
            "kv_blocks_in_use": usage.in_use,
            "kv_cache_usage": usage.in_use / usage.total,
            # the sliding-window layers' own pool (0 when they have none)
            "kv_local_blocks_total": local.total if local is not None else 0,
            "kv_local_blocks_in_use": local.in_use if local is not None else 0,
            "prefix_cache_query_tokens": self.block_manager.prefix_query_tokens,
            "prefix_cache_hit_tokens": self.block_manager.prefix_hit_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_running": len(running),
            "num_waiting": len(self.scheduler.waiting),
            "num_requests": len(self.requests),
            "block_size": self.config.block_size,
            "max_model_len": self.max_model_len,
            "num_steps": self.num_steps,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            **self.spec_decode.as_stats(),
            "spec_decode_active": int(self.spec_decode.active),
            "tensor_parallel_size": self.config.tensor_parallel_size,
            # time rank 0 spent in collectives (step broadcasts, all-reduces, the logits' gather): all steps, last
            "collective_seconds_total": tp.group.collective_seconds if tp is not None else 0.0,
            "last_step_collective_ms": tp.last_step_collective_s * 1e3 if tp is not None else 0.0,
        }

    def check_integrity(self) -> None:
        """free + cached + in-use blocks == total; when idle, nothing is in use."""
        for manager in (self.block_manager, self.window_manager):
            if manager is None:
                continue
            manager.check_integrity()
            if not self.requests and manager.usage().in_use:
                raise AssertionError(f"idle engine still holds blocks: {manager.usage()}")
        for seq in self.scheduler.running:
            if seq.status != SequenceStatus.RUNNING:
                raise AssertionError(f"{seq} is in the running list")
