"""The engine core: `step` = schedule -> run -> sample -> update, with speculation (spec_decode/speculator.py)
and grammar masks (structured_output.py) as stages around it, outputs through the output processor (stop checks,
logprobs).

One step: the scheduler picks tokens, the runner computes them in one forward pass, the sampler draws one token
for every sequence whose tokens are all computed, then each new token is detokenized and checked against the
stop conditions. Finished sequences free their blocks at once; their slots go to waiting requests next step.
"""

import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.lora_registry import LoRARegistry
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.request import Request, SampleState
from tokenmill.engine.step_pacer import StepPacer
from tokenmill.engine.step_record import describe_step, step_header, step_time
from tokenmill.engine.structured_output import Masks, StructuredOutputManager
from tokenmill.executor.runner import TensorParallelRunner
from tokenmill.outputs import RequestMetrics, RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.runner.logits_processors import load_logits_processors
from tokenmill.runner.model_runner import ModelRunner, StepChunk
from tokenmill.runner.sampler import SampledToken, Sampler, SamplingRow
from tokenmill.runner.watermark import Watermarker
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.block_manager import BlockManager
from tokenmill.scheduler.kv_cache_manager import KVCacheManager
from tokenmill.scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tokenmill.scheduler.sequence import Sequence, SequenceStatus
from tokenmill.scheduler.window_block_manager import WindowBlockManager
from tokenmill.spec_decode.speculator import Speculator
from tokenmill.tokenizer.gguf_tokenizer import Tokenizer

if TYPE_CHECKING:
    from tokenmill.structured.grammars import GrammarCompiler


class EngineCore:
    """The step over the parts that run it. LLMEngine (llm_engine.py) loads the model and builds these parts, then
    queues requests its input processor has checked; the tests build them around a fake runner."""

    def __init__(
        self,
        runner: ModelRunner | TensorParallelRunner,
        config: EngineConfig,
        kv: KVCacheManager,
        max_model_len: int,
        tokenizer: Tokenizer,
        speculator: Speculator,
    ):
        self.runner = runner
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.speculator = speculator  # a stage of the step when config.speculative_config is set
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_model_len), kv
        )
        watermarker = Watermarker(config.watermark_config) if config.watermark_config is not None else None
        self.sampler = Sampler(runner.device, load_logits_processors(config.logits_processors), watermarker)
        self.outputs = OutputProcessor(tokenizer, max_model_len, self._finish)
        self.requests: dict[str, Request] = {}
        self.loras = LoRARegistry(runner)  # LoRA adapters by served name (engine/lora_registry.py)
        self.structured = StructuredOutputManager(  # a stage of the step for constrained requests
            tokenizer,
            runner.model_config.vocab_size,
            config.max_constraint_bytes,
            config.max_constraint_compile_seconds,
        )
        self.record_steps = False  # when set, each step leaves a description in last_step (for the explorer)
        self.last_step: dict[str, Any] | None = None
        # with record_steps: called with the step's description once it is scheduled, before its forward pass
        self.on_step_start: Callable[[dict[str, Any]], None] | None = None
        # the last step's size and time, recorded whatever record_steps says (the explorer shows it at page load)
        self.last_step_summary: dict[str, Any] | None = None
        self.num_steps = 0
        # how many prompt tokens a step may carry while more than one call has work (step_pacer.py)
        self.pacer = StepPacer(config.decode_step_ms, config.block_size, config.max_num_batched_tokens)
        self.prompt_tokens_total = 0  # prompt tokens computed (prefix-cache hits are not), for the throughput log
        self.generation_tokens_total = 0  # tokens sampled
        self._seq_ids = itertools.count()

    @property
    def block_manager(self) -> BlockManager:
        """The full-attention layers' pool of KV blocks (the manager's)."""
        return self.kv.pool

    @property
    def window_manager(self) -> WindowBlockManager | None:
        """The sliding-window layers' pool, when the model has such layers."""
        return self.kv.window_pool

    @property
    def tensor_parallel(self) -> TensorParallelRunner | None:
        return self.runner if isinstance(self.runner, TensorParallelRunner) else None

    @property
    def grammars(self) -> "GrammarCompiler":
        """The structured-output compiler, made at first use (llguidance's tokenizer costs about 0.3 s)."""
        return self.structured.compiler

    def queue(
        self,
        request_id: str,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        arrival_time: float | None = None,
        pooling: PoolingParams | None = None,
        group: str | None = None,
    ) -> None:
        """Queue a request already checked (the input processor's job): its first sequence waits to be scheduled.
        `pooling`: an embedding request (its `params` only schedule it: nothing is sampled). `group`: the requests
        of one API call share one; groups take turns at admission (default: the request is a group of its own)."""
        metrics = RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.monotonic())
        request = Request(request_id, text, ids, params, metrics, pooling=pooling)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        seq = Sequence(next(self._seq_ids), request_id, ids, params, 0, max_tokens, group)
        seq.pools = pooling is not None
        seq.lora_id = self.loras.id_of(params.lora_name) if params.lora_name is not None else 0
        state = self.outputs.sample_state(seq, request)
        if params.structured_outputs is not None:
            state.grammar = self.structured.matcher(params.structured_outputs)
        request.samples.append(state)
        self.requests[request_id] = request
        self.scheduler.add(seq)

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
                self.speculator.release(sample.seq.seq_id)
        request.metrics.finished_time = time.monotonic()
        output = request.make_output()
        output.finished = True
        return output

    def lora_ids_in_use(self) -> set[int]:
        """The LoRA adapters the requests in the engine use."""
        return {s.seq.lora_id for r in self.requests.values() for s in r.samples}

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step -----------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        spec = self.config.speculative_config
        if spec is not None:
            self.speculator.plan(self.scheduler.running)
        if self.loras.retiring:  # unloaded adapters' weights go once their last sequence has
            self.loras.retire_unused(self.lora_ids_in_use())
        self.scheduler.prompt_tokens_when_shared = self.pacer.prompt_tokens_when_shared()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        now = time.monotonic()
        self.runner.copy_blocks(sched.block_copies, sched.local_block_copies)
        if spec is not None:
            self.speculator.fill(sched)
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
                    local_block_table=s.seq.local_block_table if self.kv.window_pool is not None else None,
                    want_last_logits=s.completes_sequence and not drafts and not s.seq.pools,
                    # with proposals: the logits after each of its tokens, to verify them one by one
                    want_all_logits=bool(drafts) or self.outputs.collects_prompt_logprobs(request, s.seq, s.start),
                    prompt_len=s.seq.num_prompt_tokens,
                    want_hidden=s.seq.pools,
                    lora_id=s.seq.lora_id,
                )
            )
        if self.record_steps and self.on_step_start is not None:  # the explorer shows a step while it runs
            self.on_step_start(describe_step(sched, self._step_header(sched), self.requests))
        masks = self._start_grammar_masks(sched)  # computed while the forward runs
        result = self.runner.execute(chunks)
        self.pacer.observe(sched.num_batched_tokens, time.monotonic() - now)
        self.num_steps += 1
        for s in sched.scheduled:
            prompt_len = s.seq.num_prompt_tokens
            self.prompt_tokens_total += max(0, min(s.start + s.num_new_tokens, prompt_len) - s.start)
        self.last_step_summary = {**self._step_header(sched), **step_time(self.num_steps, now, self.tensor_parallel)}
        step = describe_step(sched, self.last_step_summary, self.requests) if self.record_steps else None
        touched: dict[str, Request] = {}
        for s, logits in zip(sched.scheduled, result.all_logits, strict=True):
            if logits is not None and not s.draft_token_ids:
                self.outputs.add_prompt_logprobs(self.requests[s.seq.request_id], s.start, logits)
        for s, hidden in zip(sched.scheduled, result.hidden or [None] * len(chunks), strict=True):
            if hidden is not None:  # an embedding's prompt rows
                request = self.requests[s.seq.request_id]
                self.outputs.add_hidden(request, s.seq, s.start, hidden, s.completes_sequence)
                touched[request.request_id] = request
        self._sample_and_append(sched, result.last_logits, touched, masks)

        def emit(seq: Sequence, token: SampledToken, now: float) -> None:
            request = self.requests[seq.request_id]
            self.outputs.append_token(request, self._sample_of(seq), token, now)
            touched[request.request_id] = request

        def mask_now(seq: Sequence) -> torch.Tensor | None:
            request = self.requests[seq.request_id]
            touched[request.request_id] = request
            return self._mask_now(request, self._sample_of(seq))

        accepted, emitted = self.speculator.verify(
            sched, result.all_logits, self.sampler, self._sampling_row, emit, mask_now
        )
        self.generation_tokens_total += emitted
        self.scheduler.update_from_output(sched, accepted)  # computed K/V into the cache; stopped ones leave
        for s in sched.scheduled:  # a prompt chunk computed, for the requests that follow their prompt's progress
            if (
                s.seq.params.report_prompt_progress
                and s.start < s.seq.num_prompt_tokens
                and s.seq.request_id in self.requests
            ):
                touched.setdefault(s.seq.request_id, self.requests[s.seq.request_id])
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
        return step_header(sched, self.num_steps, self.config.tensor_parallel_size)

    def _sample_of(self, seq: Sequence) -> SampleState:
        """The engine's state of a sequence of a request still in flight."""
        return next(x for x in self.requests[seq.request_id].samples if x.seq is seq)

    def _start_grammar_masks(self, sched: SchedulerOutput) -> Masks | None:
        """The masks of every constrained sequence that samples this step, computed while the forward pass runs;
        proposing ones are masked position by position as they are verified (_mask_now)."""
        return self.structured.start_masks(
            {
                s.seq.seq_id: self._sample_of(s.seq).grammar
                for s in sched.scheduled
                if s.completes_sequence and s.seq.params.structured_outputs is not None and not s.draft_token_ids
            }
        )

    def _mask_now(self, request: Request, sample: SampleState) -> torch.Tensor | None:
        """A constrained sample's allowed tokens where its grammar is now (bool [vocab]); with none allowed (or a
        limit hit) the sample ends with an error instead, and this is None."""
        mask = self.structured.mask_now(sample)
        if not self.structured.admits(sample, mask):
            self.outputs.fail_constraint(request, sample)
            return None
        return mask

    def _sample_and_append(
        self,
        sched: SchedulerOutput,
        logits: torch.Tensor,
        touched: dict[str, Request],
        masks: Masks | None = None,
    ) -> None:
        rows: list[SamplingRow] = []
        row_samples: list[tuple[Request, SampleState]] = []
        logits_row = 0
        for s in sched.scheduled:
            if not s.completes_sequence or s.draft_token_ids or s.seq.pools:  # proposals: the speculator's
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
                    if not self.structured.admits(sample, row.allowed):  # nothing may be sampled
                        self.outputs.fail_constraint(request, sample)
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
            self.outputs.append_token(request, sample, token, now)
            touched[request.request_id] = request

    def _fork(self, request: Request, parent: Sequence) -> list[SampleState]:
        """After the prompt is computed, the other n - 1 samples share its KV blocks."""
        request.forked = True
        children = []
        for index in range(1, request.params.n):
            child = Sequence(
                next(self._seq_ids),
                request.request_id,
                parent.token_ids,
                request.params,
                index,
                parent.max_tokens,
                parent.group,
            )
            child.num_prompt_tokens = parent.num_prompt_tokens
            child.lora_id = parent.lora_id
            child.num_cached_tokens = parent.num_cached_tokens
            child.ever_scheduled = True
            self.kv.fork(parent, child, parent.num_prompt_tokens)  # the step computed the whole prompt
            self.scheduler.add_running(child)
            state = self.outputs.sample_state(child, request)
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
        row = SamplingRow(seq.seq_id, logits_row, p, seq.prompt_token_ids, seq.output_token_ids, banned, seed)
        row.processors = [proc for proc in self.sampler.processors if proc.applies(p)]
        return row

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.scheduler.stop(seq)  # its blocks go once the step is settled (update_from_output)
        self.sampler.release(seq.seq_id)
        self.speculator.release(seq.seq_id)

    # ---- introspection ------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        usage, local = self.kv.usage()
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
            "prefix_cache_query_tokens": self.kv.prefix_query_tokens,
            "prefix_cache_hit_tokens": self.kv.prefix_hit_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_running": len(running),
            "num_waiting": len(self.scheduler.waiting),
            "num_requests": len(self.requests),
            "block_size": self.config.block_size,
            "max_model_len": self.max_model_len,
            "num_steps": self.num_steps,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            **self.speculator.stats.as_stats(),
            "spec_decode_active": int(self.speculator.stats.active),
            "tensor_parallel_size": self.config.tensor_parallel_size,
            # time rank 0 spent in collectives (step broadcasts, all-reduces, the logits' gather): all steps, last
            "collective_seconds_total": tp.group.collective_seconds if tp is not None else 0.0,
            "last_step_collective_ms": tp.last_step_collective_s * 1e3 if tp is not None else 0.0,
        }

    def check_integrity(self) -> None:
        """free + cached + in-use blocks == total; when idle, nothing is in use."""
        self.kv.check_integrity(idle=not self.requests)
        for seq in self.scheduler.running:
            if seq.status != SequenceStatus.RUNNING:
                raise AssertionError(f"{seq} is in the running list")
