"""Draft-model proposals: a smaller model with the target's tokenizer runs K greedy steps ahead of each speculating
sequence, and the target verifies the K tokens in one pass (spec_decode/speculator.py, verify).

The draft's K/V live in a cache of its own, indexed by the target's block tables: the block manager that gives a
sequence its blocks gives them for both models (a block's memory is sized for both), and its copy-on-write copies
are made in both caches. The draft runs after the scheduler has allocated the step's 1 + K slots, and writes
positions below the last one. A ledger keeps, per sequence, how far the draft's K/V are right: the real tokens it
has computed and the proposals the target then accepted; the rest (the first time, after a preemption freed the
blocks, or tokens decoded while the batch was too large to speculate) it computes in its next pass.
"""

from dataclasses import dataclass

import torch

from tokenmill.config import SpeculativeConfig
from tokenmill.config.quantization import parse_quantization, quantization_on
from tokenmill.errors import InvalidParameterError
from tokenmill.loader.model_path import resolve_model_path
from tokenmill.loader.model_source import ModelSource, open_model_source
from tokenmill.model.config_from_source import model_config_from_source
from tokenmill.runner.model_runner import ModelRunner, StepChunk
from tokenmill.runner.sampler import argmax_rows
from tokenmill.scheduler.sequence import Sequence
from tokenmill.tokenizer.from_source import load_tokenizer
from tokenmill.tokenizer.gguf_tokenizer import Tokenizer


@dataclass
class _Entry:
    num_real: int  # K/V of token_ids[:num_real], the sequence's real tokens when the draft last ran
    written: list[int]  # then of these proposals, fed back after them: right as far as the target accepted them
    num_preemptions: int  # the sequence's, then (a preemption frees its blocks, and the draft's K/V with them)


class DraftCacheLedger:
    """Per sequence, how far the draft model's cache holds the right K/V. No torch here."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}

    def valid_prefix(self, seq: Sequence) -> int:
        """Leading tokens of seq whose K/V in the draft's cache are right, short of its last token (fed back or
        not, the draft computes it again to propose what follows)."""
        entry = self._entries.get(seq.seq_id)
        if entry is None or entry.num_preemptions != seq.num_preemptions:
            return 0
        valid = entry.num_real
        for token in entry.written:
            if valid >= seq.num_tokens or seq.token_ids[valid] != token:
                break
            valid += 1
        return min(valid, seq.num_tokens - 1)

    def record(self, seq: Sequence, fed_back: list[int]) -> None:
        """The draft computed all of seq's tokens, then fed back these proposals."""
        self._entries[seq.seq_id] = _Entry(seq.num_tokens, fed_back, seq.num_preemptions)

    def release(self, seq_id: int) -> None:
        self._entries.pop(seq_id, None)


def open_draft_model(spec: SpeculativeConfig, target: ModelSource, target_tokenizer: Tokenizer) -> ModelSource:
    """The draft model's file, checked against the target's before either model's weights are read: the same
    vocabulary. Sliding-window layers are welcome on either side: the draft reads the target's full-attention
    block tables (every position's blocks, kept as long as the sequence), its own window layers masking what lies
    outside their window there, while the target's window layers keep their own pool."""
    assert spec.model is not None
    source = open_model_source(resolve_model_path(spec.model))
    # the same file (another format of one model, e.g. its 4-bit copy): the same tokenizer
    tokenizer = target_tokenizer if source.path == target.path else load_tokenizer(source)
    vocab, target_vocab = tokenizer.backend, target_tokenizer.backend
    if tokenizer.vocab_size != target_tokenizer.vocab_size or vocab.get_vocab(True) != target_vocab.get_vocab(True):
        raise InvalidParameterError(
            f"speculative_config: the draft model {spec.model!r} has another tokenizer than the target model; "
            "a draft must share the target's vocabulary",
            "speculative_config",
        )
    config, target_config = model_config_from_source(source), model_config_from_source(target)
    if config.vocab_size != target_config.vocab_size:
        raise InvalidParameterError(
            f"speculative_config: the draft model's vocabulary has {config.vocab_size} rows, the target's "
            f"{target_config.vocab_size}",
            "speculative_config",
        )
    return source


class DraftModelProposer:
    def __init__(
        self,
        source: ModelSource,
        spec: SpeculativeConfig,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        kv_cache_dtype: str = "auto",
    ):
        """`source`: from open_draft_model; `kv_cache_dtype`: the engine's (EngineConfig)."""
        quantization = quantization_on(parse_quantization(spec.quantization), device.type)  # as for the target
        self.runner = ModelRunner(source, dtype, device, block_size, quantization, kv_cache_dtype=kv_cache_dtype)
        self.name = source.path.name
        self.quantization = quantization
        self.ledger = DraftCacheLedger()

    def kv_bytes_per_block(self) -> int:
        return self.runner.kv_bytes_per_block()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """The target's copy-on-write copies, done in the draft's cache too (same block ids)."""
        if copies:
            self.runner.copy_blocks(copies)

    def release(self, seq_id: int) -> None:
        self.ledger.release(seq_id)

    @torch.inference_mode()
    def propose(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        """For each (sequence, k): k greedy draft tokens after its last one. The first pass computes what the draft
        has not seen of each sequence, then one pass per further token; a sequence's k slots must be allocated."""
        proposals: list[list[int]] = [[] for _ in wanted]
        chunks = []
        for seq, _ in wanted:
            start = self.ledger.valid_prefix(seq)
            chunks.append(StepChunk(seq.token_ids[start:], start, seq.block_table, prompt_len=seq.num_prompt_tokens))
        active = list(range(len(wanted)))
        while True:
            logits = self.runner.execute(chunks).last_logits  # [len(active), vocab]
            for i, token in zip(active, argmax_rows(logits).tolist(), strict=True):
                proposals[i].append(token)
            active = [i for i in active if len(proposals[i]) < wanted[i][1]]
            if not active:
                break
            chunks = []
            for i in active:
                seq, last = wanted[i][0], proposals[i][-1]
                position = seq.num_tokens + len(proposals[i]) - 1
                chunks.append(StepChunk([last], position, seq.block_table, prompt_len=seq.num_prompt_tokens))
        for (seq, _), tokens in zip(wanted, proposals, strict=True):
            self.ledger.record(seq, tokens[:-1])  # the last proposal was never fed back
        return proposals
