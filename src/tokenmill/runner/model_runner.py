"""Owns the model, the KV cache tensors and the device; turns one scheduled step into a forward pass.

A step is a list of `StepChunk`s, one per sequence: the new tokens to compute (a whole prompt, a prefill chunk,
or the one token of a decode), where they start, and the sequence's block table. The runner flattens them
into [T] tensors, builds the attention metadata once for all layers, runs the model and returns the logits
the caller asked for.

With the native decoder (`int4` and `auto` on the CPU), a token's path depends only on its position, never on
its neighbours: prompt tokens go through the torch path, generated tokens (also when recomputed after a
preemption) through the native decoder, one row each. Both paths compute a row the same way whatever else the
step holds, so a request's greedy output does not depend on what else is running.

LoRA adapters (layers/lora.py): a chunk names its adapter by id (`lora_id`, 0 for none); its rows ride through the
model's forward with the step's other rows (the base products once), generated tokens too (the native decoder
applies no adapter), and each adapter's low-rank products are added to its rows only.
"""

import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from tokenmill import native
from tokenmill.config.model_shape import ModelConfig
from tokenmill.layers import kv_quant
from tokenmill.layers.attention import AttentionMetadata, DecodeBatch, PrefillChunk
from tokenmill.layers.lora import AdapterWeights, LoRABatch
from tokenmill.loader.lora_file import LoRAFile
from tokenmill.loader.model_source import ModelSource
from tokenmill.model.lora_weights import build_adapter
from tokenmill.model.registry import build_model
from tokenmill.native import matrix_units
from tokenmill.native.threads import follow_contention
from tokenmill.runner.decode_backend import choose_decode_backend
from tokenmill.runner.kv_cache import resolve_kv_cache_dtype

if TYPE_CHECKING:
    from tokenmill.distributed.group import ParallelGroup
    from tokenmill.distributed.shard import ShardPlan

logger = logging.getLogger(__name__)


@dataclass
class StepChunk:
    """One sequence's share of a step."""

    token_ids: list[int]  # tokens computed this step; their K/V are written to the cache
    start_position: int  # tokens of this sequence already in the cache (position of token_ids[0])
    block_table: list[int]  # physical KV blocks of the sequence, covering at least start_position + len(token_ids)
    # its blocks in the sliding-window layers' pool (NULL_BLOCK, -1, for released ones), when the model has one
    local_block_table: list[int] | None = None
    want_last_logits: bool = True  # logits after the last token (to sample the next one)
    want_all_logits: bool = False  # logits after every token of the chunk (prompt log-probabilities)
    want_hidden: bool = False  # the final norm's output after every token of the chunk (an embedding's)
    # the sequence's prompt length: tokens at positions from here on are generated ones. None: a one-token chunk
    # is a generated token, a longer one is prompt
    prompt_len: int | None = None
    lora_id: int = 0  # the LoRA adapter its rows use (ModelRunner.add_lora's id); 0: none

    def is_decode(self) -> bool:
        """One generated token: it attends as a decode row. A prompt's token alone in its chunk (the rest of its
        prompt in the prefix cache) attends as a prompt chunk, so that a position's numbers do not depend on how
        its prompt was cut."""
        return len(self.token_ids) == 1 and self.num_prompt_tokens() == 0

    def num_prompt_tokens(self) -> int:
        """How many of token_ids are prompt tokens (they come first)."""
        n = len(self.token_ids)
        prompt_len = self.prompt_len
        if prompt_len is None:
            prompt_len = self.start_position + (0 if n == 1 else n)
        return min(max(prompt_len - self.start_position, 0), n)


@dataclass
class StepOutput:
    """On the ranks other than 0 of a tensor-parallel model, the logits are None (only rank 0 gets them)."""

    last_logits: torch.Tensor  # [num chunks with want_last_logits, vocab] float32, in chunk order
    all_logits: list[torch.Tensor | None]  # per chunk: [len(token_ids), vocab] float32 when asked for, else None
    # per chunk: [len(token_ids), hidden] float32 (the final norm's output) when asked for (want_hidden), else None
    hidden: list[torch.Tensor | None] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        gguf: ModelSource,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        quantization: str | None = None,
        parallel: "tuple[ShardPlan, ParallelGroup] | None" = None,
        kv_cache_dtype: str = "auto",
        weight_cache: bool = False,
    ):
        """`parallel`: this process is one tensor-parallel rank and holds that shard of the model;
        `kv_cache_dtype`: EngineConfig's (resolved by runner/kv_cache.py); `weight_cache`: EngineConfig's (the
        native kernels' weights mapped from a cache file: model/registry.py)."""
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self._plan = parallel[0] if parallel is not None else None  # cuts LoRA adapters as the base weights
        self.adapters: dict[int, AdapterWeights] = {}  # LoRA adapters by id (StepChunk.lora_id)
        self.model, self._model_config = build_model(gguf, dtype, device, quantization, parallel, weight_cache)
        self.config = self.model.config  # the part held here: sizes the KV cache
        # what computes generated tokens (runner/decode_backend.py); None: the model's forward, with the prompts
        self.decode_backend = choose_decode_backend(self.model, quantization)
        native_decode = self.decode_backend is not None and self.decode_backend.name == "native"
        lib = native.load() if device.type == "cpu" else None
        if lib is not None:
            logger.info("%s", matrix_units.describe(lib))
        self.kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype, native_decode)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.num_local_blocks = 0  # > 0: the sliding-window layers have their own pool of this many blocks
        c = self.config
        self.local_layers = [i for i in range(c.num_layers) if c.is_local(i)]

    @property
    def model_config(self) -> ModelConfig:
        """The whole model's config (also under tensor parallelism)."""
        return self._model_config

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block of every layer's K and V (a block of each pool costs its layers' share)."""
        return self.config.num_layers * self.kv_bytes_per_layer_block()

    @property
    def kv_scale_bytes(self) -> int:
        """Bytes of scale beside each head of each token (an int8 cache's float32; 0 for the float types)."""
        return kv_quant.SCALE_BYTES if self.kv_dtype == torch.int8 else 0

    def kv_bytes_per_layer_block(self) -> int:
        c = self.config
        return (
            2
            * self.block_size
            * c.num_kv_heads
            * kv_quant.head_width(c.head_dim, self.kv_dtype)
            * self.kv_dtype.itemsize
        )

    @property
    def num_local_layers(self) -> int:
        """Sliding-window layers that can keep their K/V in a pool of their own (0: one pool for all layers)."""
        return len(self.local_layers) if len(self.local_layers) < self.config.num_layers else 0

    def allocate_kv_cache(self, num_blocks: int, num_local_blocks: int = 0) -> None:
        """Two tensors per layer, each [blocks * block_size, num_kv_heads, head_dim] (slot-major; int8 ones
        head_dim + 4, layers/kv_quant.py): num_blocks for
        the full-attention layers, and num_local_blocks for the sliding-window ones when they have their own
        pool (> 0; else num_blocks for every layer)."""
        c = self.config
        local = set(self.local_layers) if num_local_blocks else set()

        def pool(layers: int, blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
            shape = (layers, blocks * self.block_size, c.num_kv_heads, kv_quant.head_width(c.head_dim, self.kv_dtype))
            # Written once now (zeros), so the cache is resident memory from the start instead of growing block by
            # block under load (prefix caching cycles through every block). Masked-out padding reads slot 0: zeros,
            # never NaN (NaN * 0 is NaN).
            k = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            v = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            return [(k[i], v[i]) for i in range(layers)]

        full_caches = iter(pool(c.num_layers - len(local), num_blocks))
        local_caches = iter(pool(len(local), num_local_blocks)) if local else iter(())
        self.kv_caches = [next(local_caches) if i in local else next(full_caches) for i in range(c.num_layers)]
        self.num_blocks, self.num_local_blocks = num_blocks, num_local_blocks
        if self.decode_backend is not None:
            self.decode_backend.bind_kv_cache(self.kv_caches)

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]], local_copies: list[tuple[int, int]] = ()) -> None:
        """Copy whole KV blocks (src -> dst) in every layer of their pool (copy-on-write of a shared block)."""
        local = set(self.local_layers) if self.num_local_blocks else set()
        for pool_copies, in_pool in ((copies, lambda i: i not in local), (local_copies, lambda i: i in local)):
            if not pool_copies:
                continue
            bs = self.block_size
            offsets = torch.arange(bs)
            src = torch.cat([offsets + s * bs for s, _ in pool_copies]).to(self.device)
            dst = torch.cat([offsets + d * bs for _, d in pool_copies]).to(self.device)
            for i, (k, v) in enumerate(self.kv_caches):
                if in_pool(i):
                    k[dst] = k[src]
                    v[dst] = v[src]

    def _block_rows(self, block_ids: list[int]) -> torch.Tensor:
        """The cache rows (slots) of these blocks, in order."""
        bs = self.block_size
        if not block_ids:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        offsets = torch.arange(bs)
        return torch.cat([offsets + b * bs for b in block_ids]).to(self.device)

    def is_local_layer(self, layer: int) -> bool:
        """Whether the layer keeps its K/V in the sliding-window layers' own pool."""
        return self.num_local_blocks > 0 and layer in self.local_layers

    @torch.inference_mode()
    def read_kv_blocks(self, blocks: list[int], local_blocks: list[int]) -> dict[str, torch.Tensor]:
        """Copies of these blocks' K/V on the CPU (the sliding-window layers' own pool: local_blocks'), per layer
        L: {"k.L": [blocks * block_size, num_kv_heads, head width], "v.L": the same}, as stored (an int8 cache's
        scales included)."""
        rows, local_rows = self._block_rows(blocks), self._block_rows(local_blocks)
        out = {}
        for i, (k, v) in enumerate(self.kv_caches):
            r = local_rows if self.is_local_layer(i) else rows
            out[f"k.{i}"] = k[r].cpu().contiguous()
            out[f"v.{i}"] = v[r].cpu().contiguous()
        return out

    @torch.inference_mode()
    def write_kv_blocks(
        self, tensors: dict[str, torch.Tensor], blocks: list[tuple[int, int]], local_blocks: list[tuple[int, int]]
    ) -> None:
        """The reverse of read_kv_blocks, for some blocks: (cache block, its index among the tensors' blocks) for
        the full-attention layers (`blocks`) and the sliding-window layers' own pool (`local_blocks`)."""
        bs = self.block_size
        for i, (k, v) in enumerate(self.kv_caches):
            pairs = local_blocks if self.is_local_layer(i) else blocks
            if not pairs:
                continue
            dst = self._block_rows([b for b, _ in pairs])
            src = torch.cat([torch.arange(bs) + j * bs for _, j in pairs])
            k[dst] = tensors[f"k.{i}"][src].to(device=self.device, dtype=k.dtype)
            v[dst] = tensors[f"v.{i}"][src].to(device=self.device, dtype=v.dtype)

    def add_lora(self, lora_id: int, lora: LoRAFile) -> AdapterWeights:
        """Make adapter `lora` (read by loader/lora_file.py) applicable to chunks with this id (> 0), in the compute
        dtype beside the base weights; raises LoRAError when it does not fit the model."""
        if lora_id <= 0:
            raise ValueError(f"LoRA ids are positive, got {lora_id}")
        with torch.inference_mode():
            adapter = build_adapter(lora, self.model_config, self.dtype, self.device, self._plan)
        self.adapters[lora_id] = adapter
        return adapter

    def remove_lora(self, lora_id: int) -> None:
        self.adapters.pop(lora_id, None)

    @torch.inference_mode()
    def execute(self, chunks: list[StepChunk]) -> StepOutput:
        follow_contention(native.load())  # torch on one thread while the kernels' helpers are off the CPU
        prompt_parts: list[StepChunk] = []  # through the torch path (every token, without a decode backend)
        generated: list[StepChunk] = []  # through the decode backend: one token each
        routes: list[tuple[int, int, int]] = []  # per chunk: (its prompt part or -1, first generated row, count)
        for c in chunks:
            # a chunk with an adapter goes through the model's forward whole: the decode backend applies none
            backend = self.decode_backend is not None and not c.lora_id
            num_prompt = c.num_prompt_tokens() if backend else len(c.token_ids)
            part = -1
            if num_prompt:
                part = len(prompt_parts)
                whole = num_prompt == len(c.token_ids)
                prompt_parts.append(c if whole else replace(c, token_ids=c.token_ids[:num_prompt]))
            routes.append((part, len(generated), len(c.token_ids) - num_prompt))
            if num_prompt == 0 and len(c.token_ids) == 1:
                generated.append(c)
            else:
                for j in range(num_prompt, len(c.token_ids)):
                    generated.append(
                        StepChunk([c.token_ids[j]], c.start_position + j, c.block_table, c.local_block_table)
                    )

        # the prompt parts first: a sequence recomputed after a preemption reads their K/V in its generated rows
        hidden_parts, first_row = [], []
        if prompt_parts:
            hidden, first_row = self._torch_forward(prompt_parts)
            hidden_parts.append(hidden)
        num_prompt_rows = hidden_parts[0].shape[0] if hidden_parts else 0
        if generated:
            input_ids, positions, meta, local_meta = self._prepare(generated)
            hidden_parts.append(self.decode_backend.forward(input_ids, positions, meta, local_meta))  # [G, hidden]
        hidden = hidden_parts[0] if len(hidden_parts) == 1 else torch.cat(hidden_parts)  # [T, hidden]

        def rows(i: int) -> list[int]:
            """Rows of `hidden` that chunk i's tokens became, in token order."""
            part, first_generated, count = routes[i]
            start = num_prompt_rows + first_generated
            generated_rows = range(start, start + count)
            if part < 0:
                return list(generated_rows)
            return [*range(first_row[part], first_row[part] + len(prompt_parts[part].token_ids)), *generated_rows]

        last_rows = [rows(i)[-1] for i, c in enumerate(chunks) if c.want_last_logits]
        if last_rows:
            last_logits = self.model.compute_logits(hidden[torch.tensor(last_rows, device=self.device)])
        else:
            last_logits = torch.empty(0, self.model_config.vocab_size, device=self.device)
        all_logits: list[torch.Tensor | None] = []
        for i, c in enumerate(chunks):
            if c.want_all_logits:
                all_logits.append(self.model.compute_logits(hidden[torch.tensor(rows(i), device=self.device)]))
            else:
                all_logits.append(None)
        hidden_rows = [
            hidden[torch.tensor(rows(i), device=self.device)].float() if c.want_hidden else None
            for i, c in enumerate(chunks)
        ]
        return StepOutput(last_logits, all_logits, hidden_rows)

    def _torch_forward(self, chunks: list[StepChunk]) -> tuple[torch.Tensor, list[int]]:
        """The model's forward over the chunks -> (hidden [T, hidden], the first row of each chunk). Decodes (one
        query each: generated tokens, StepChunk.is_decode) go first in the flat layout, then prompt chunks."""
        order = sorted(range(len(chunks)), key=lambda i: not chunks[i].is_decode())
        input_ids, positions, meta, local_meta = self._prepare([chunks[i] for i in order])
        first_row = [0] * len(chunks)
        row = 0
        lora_rows: dict[int, list[int]] = {}  # adapter id -> its rows in the flat layout
        for i in order:
            first_row[i] = row
            n = len(chunks[i].token_ids)
            if chunks[i].lora_id:
                lora_rows.setdefault(chunks[i].lora_id, []).extend(range(row, row + n))
            row += n
        lora = None
        if lora_rows:
            groups = [(self._adapter(lora_id), rows) for lora_id, rows in lora_rows.items()]
            lora = LoRABatch.of(groups, self.device, row)
        hidden = self.model(input_ids, positions, meta, self.kv_caches, local_meta, lora)  # [T, hidden]
        return hidden, first_row

    def _adapter(self, lora_id: int) -> AdapterWeights:
        adapter = self.adapters.get(lora_id)
        if adapter is None:  # a bug: the engine removes an adapter only once no sequence uses it
            raise RuntimeError(f"a step uses LoRA adapter {lora_id}, which is not loaded")
        return adapter

    def _prepare(
        self, chunks: list[StepChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, AttentionMetadata | None]:
        """Flat step tensors and attention metadata: (input_ids [T], positions [T], the metadata of the
        full-attention layers, that of the sliding-window layers' pool or None when they have none); `chunks`
        come decodes first (see execute). Built from Python lists with one tensor per list: a decode step is a
        few small tensors, and each tensor operation costs microseconds that add up at one token per step."""
        dev = self.device
        token_ids: list[int] = []
        positions: list[int] = []
        for c in chunks:
            token_ids.extend(c.token_ids)
            positions.extend(range(c.start_position, c.start_position + len(c.token_ids)))
        meta = self._metadata(chunks, [c.block_table for c in chunks])
        local_meta = None
        if self.num_local_blocks:
            local_meta = self._metadata(chunks, [c.local_block_table for c in chunks])  # type: ignore[misc]
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=dev)
        return input_ids, torch.tensor(positions, dtype=torch.int64, device=dev), meta, local_meta

    def _metadata(self, chunks: list[StepChunk], tables: list[list[int]]) -> AttentionMetadata:
        """The attention metadata of the chunks through one pool's block tables (one per chunk)."""
        bs = self.block_size
        slots: list[int] = []  # cache slot of each new token, from its sequence's block table
        for c, table in zip(chunks, tables, strict=True):
            slots.extend(
                table[p // bs] * bs + p % bs for p in range(c.start_position, c.start_position + len(c.token_ids))
            )
        slot_mapping = torch.tensor(slots, dtype=torch.int64, device=self.device)  # [T]
        num_decodes = sum(1 for c in chunks if c.is_decode())  # they come first
        decode = self._decode_batch(chunks[:num_decodes], tables[:num_decodes]) if num_decodes else None
        prefills = []
        start = num_decodes
        for c, table in zip(chunks[num_decodes:], tables[num_decodes:], strict=True):
            end = start + len(c.token_ids)
            prefills.append(self._prefill_chunk(c, table, start, end))
            start = end
        return AttentionMetadata(slot_mapping, decode, prefills)

    def _context_slots(self, block_table: list[int], context_len: int) -> torch.Tensor:
        """[context_len] cache slots of positions 0 .. context_len - 1 (a released block's: slot 0's, which a
        sliding window's mask hides)."""
        bs = self.block_size
        blocks = torch.tensor(block_table[: (context_len + bs - 1) // bs], dtype=torch.int64).clamp_(min=0)
        return (blocks.unsqueeze(1) * bs + torch.arange(bs)).reshape(-1)[:context_len]

    def _decode_batch(self, chunks: list[StepChunk], block_tables: list[list[int]]) -> DecodeBatch:
        bs = self.block_size
        lens = [c.start_position + 1 for c in chunks]
        max_ctx = max(lens)
        max_blocks = (max_ctx + bs - 1) // bs
        # [S, max_blocks] block tables, a shorter one padded with block 0 (a released block: 0 too)
        tables = torch.tensor([(t[:max_blocks] + [0] * max_blocks)[:max_blocks] for t in block_tables]).clamp_(min=0)
        slots = (tables.unsqueeze(2) * bs + torch.arange(bs)).reshape(len(chunks), -1)[:, :max_ctx]  # [S, max_ctx]
        context_lens = torch.tensor(lens)  # [S]
        if min(lens) != max_ctx:
            valid = torch.arange(max_ctx).unsqueeze(0) < context_lens.unsqueeze(1)  # [S, max_ctx]
            slots = slots.masked_fill(~valid, 0)
        return DecodeBatch(
            token_start=0,
            num_seqs=len(chunks),
            max_context=max_ctx,
            kv_index=slots.reshape(-1).to(self.device),
            context_lens=context_lens.to(self.device),
            slots=slots,
            lens=lens,
        )

    def _prefill_chunk(self, c: StepChunk, block_table: list[int], start: int, end: int) -> PrefillChunk:
        if c.start_position == 0:
            return PrefillChunk(start, end, None, None)
        context_len = c.start_position + len(c.token_ids)
        query_pos = torch.arange(c.start_position, context_len)  # [q]
        mask = torch.arange(context_len).unsqueeze(0) <= query_pos.unsqueeze(1)  # [q, ctx]
        return PrefillChunk(
            start,
            end,
            self._context_slots(block_table, context_len).to(self.device),
            mask.view(1, 1, len(c.token_ids), context_len).to(self.device),
        )
