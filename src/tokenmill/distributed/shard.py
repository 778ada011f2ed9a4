"""Which part of a model one tensor-parallel rank holds, and a GGUF view that reads only that part.

Attention is split by KV-head groups (a rank's query heads all read its own KV heads): as evenly as the groups
allow when there are at least as many KV heads as ranks (SmolLM2-135M's 9 heads over 3 KV heads: 3 + 3 + 3 at
TP 3, 6 + 3 at TP 2), and with each KV head replicated on several ranks when there are fewer. The MLP's
intermediate dimension and the vocabulary are split evenly, the MLP on 32-weight block edges, so that every rank
runs the quantized kernels on whole blocks of its own shard. Column-parallel weights (Q/K/V, gate/up, the
embedding and LM head) are cut by rows, row-parallel ones (attention output, down) by columns.

A mixture of experts is split the same way inside every expert: each rank holds a slice of every expert's width
(and of a shared expert's), the router whole. Whole experts per rank (expert parallelism) would leave a rank idle
whenever the router picks the other's experts (one sequence's 8 of Qwen3-30B-A3B's 128 rarely split evenly), and
would need a second exchange of every token's rows; slices keep both ranks busy on every chosen expert and need
only the sum after down that the dense MLP already takes.

Biases follow their weights' rows (Q/K/V's, each expert's gate/up), and gpt-oss's sinks its query heads. A
row-parallel projection's bias belongs to the sum, once: the attention output's is whole on every rank and added
after the sum (model/llama.py), and the experts' down biases, weighted inside the mixture's sum, are rank 0's (the
other ranks read zeros).
"""

import re
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from tokenmill.config.model_shape import ModelConfig
from tokenmill.errors import InvalidParameterError
from tokenmill.loader.experts import ExpertStack, expert_tensor
from tokenmill.loader.gguf_file import GGUFFile, GGUFTensor, quant_block_shape
from tokenmill.loader.hf_checkpoint import HFCheckpoint

# biases inside a sum over ranks (the experts' downs, weighted by the router): rank 0 holds them, the others zeros
ROW_PARALLEL_BIASES = ("ffn_down_exps.bias",)
BLOCK_EDGE = 32  # weights per quantization block: shard boundaries of cut dimensions fall on multiples of this


class ShardingError(InvalidParameterError):
    """The model's sizes cannot be split over this many ranks."""

    def __init__(self, message: str):
        super().__init__(message, "tensor_parallel_size")


def _even_split(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` when `total` items go to `parts` parts, the first ones one more."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `world_size`: the ranges of the full model it holds ([start, end) each)."""

    config: ModelConfig  # the whole model's
    rank: int
    world_size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    expert_intermediate: tuple[int, int] = (0, 0)
    shared_intermediate: tuple[int, int] = (0, 0)

    @classmethod
    def for_rank(cls, config: ModelConfig, rank: int, world_size: int) -> "ShardPlan":
        """Raises ShardingError, naming the sizes, when the model cannot be split over world_size ranks."""
        c, n = config, world_size
        group = c.num_heads // c.num_kv_heads  # query heads per KV head
        if n <= c.num_kv_heads:
            kv = _even_split(c.num_kv_heads, n, rank)
            q = (kv[0] * group, kv[1] * group)
        else:
            if n % c.num_kv_heads or c.num_heads % n:
                raise ShardingError(
                    f"tensor_parallel_size {n} cannot split {c.num_heads} attention heads over {c.num_kv_heads} KV "
                    f"heads: with more ranks than KV heads, the ranks must be a multiple of the KV heads and divide "
                    f"the attention heads (use at most {c.num_kv_heads} ranks, or a multiple of {c.num_kv_heads} "
                    f"that divides {c.num_heads})"
                )
            q = _even_split(c.num_heads, n, rank)
            kv = (q[0] // group, q[0] // group + 1)
        widths = [("intermediate_size", c.intermediate_size)] if not all(map(c.is_moe, range(c.num_layers))) else []
        if c.num_experts:
            widths.append(("the experts' intermediate size", c.expert_intermediate_size))
            if c.shared_expert_intermediate_size:
                widths.append(("the shared expert's intermediate size", c.shared_expert_intermediate_size))
        for what, width in widths:
            if width % (n * BLOCK_EDGE):
                raise ShardingError(
                    f"tensor_parallel_size {n} cannot split the MLP: {what} {width} is not a multiple of {n} x "
                    f"{BLOCK_EDGE} (each rank takes whole {BLOCK_EDGE}-weight blocks)"
                )
        if c.qk_norm_whole and n > 1:
            raise ShardingError(
                f"tensor_parallel_size {n}: {c.architecture}'s QK-norm spans every head at once, which one rank's "
                "heads cannot compute (use tensor_parallel_size 1)"
            )
        if c.vocab_size % n:
            raise ShardingError(f"tensor_parallel_size {n} does not divide the vocabulary size {c.vocab_size}")
        if (q[0] * c.head_dim) % BLOCK_EDGE or (q[1] * c.head_dim) % BLOCK_EDGE:
            raise ShardingError(
                f"tensor_parallel_size {n}: rank {rank}'s attention heads {q[0]}..{q[1] - 1} of head_dim "
                f"{c.head_dim} do not start and end on {BLOCK_EDGE}-weight block edges"
            )
        return cls(
            c,
            rank,
            n,
            q,
            kv,
            _even_split(c.intermediate_size, n, rank),
            _even_split(c.vocab_size, n, rank),
            _even_split(c.expert_intermediate_size, n, rank),
            _even_split(c.shared_expert_intermediate_size, n, rank),
        )

    @property
    def local_config(self) -> ModelConfig:
        """The config of this rank's part: the model classes build and load it as they would a whole model."""
        return replace(
            self.config,
            num_heads=self.q_heads[1] - self.q_heads[0],
            num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.intermediate[1] - self.intermediate[0],
            vocab_size=self.vocab[1] - self.vocab[0],
            expert_intermediate_size=self.expert_intermediate[1] - self.expert_intermediate[0],
            shared_expert_intermediate_size=self.shared_intermediate[1] - self.shared_intermediate[0],
        )

    def cut(self, name: str) -> tuple[int, int, int] | None:
        """How tensor `name` is cut for this rank: (axis 0 rows or 1 columns, start, end), or None (whole). An
        expert tensor's axes are each expert's (rows, columns); the experts' biases [E, rows] are cut in columns."""
        d = self.config.head_dim
        if name in ("token_embd.weight", "output.weight"):
            return 0, *self.vocab
        match = re.fullmatch(r"blk\.\d+\.(\w+)\.(weight|bias)", name)  # a bias is cut as its weight's rows
        kind = match.group(1) if match else None
        if match and match.group(2) == "bias":
            if kind in ("ffn_gate_exps", "ffn_up_exps"):
                return 1, *self.expert_intermediate
            if kind in ("attn_output", "ffn_down_exps", "ffn_gate_inp"):  # row-parallel (ROW_PARALLEL_BIASES), router
                return None
        if kind == "attn_sinks":
            return 0, *self.q_heads
        if kind == "attn_q":
            return 0, self.q_heads[0] * d, self.q_heads[1] * d
        if kind in ("attn_k", "attn_v"):
            return 0, self.kv_heads[0] * d, self.kv_heads[1] * d
        if kind == "attn_output":
            return 1, self.q_heads[0] * d, self.q_heads[1] * d
        if kind in ("ffn_gate", "ffn_up"):
            return 0, *self.intermediate
        if kind == "ffn_down":
            return 1, *self.intermediate
        if kind in ("ffn_gate_exps", "ffn_up_exps"):
            return 0, *self.expert_intermediate
        if kind == "ffn_down_exps":
            return 1, *self.expert_intermediate
        if kind in ("ffn_gate_shexp", "ffn_up_shexp"):
            return 0, *self.shared_intermediate
        if kind == "ffn_down_shexp":
            return 1, *self.shared_intermediate
        return None


class ShardedGGUF:
    """A GGUF file seen by one rank: `tensor(name)` is this rank's part of the tensor (rows sliced from the
    file's memory map, columns copied block by block), so a rank reads and holds only its share."""

    def __init__(self, gguf: "GGUFFile | HFCheckpoint", plan: ShardPlan):
        self.gguf = gguf
        self.plan = plan
        self.path = gguf.path
        self.files = getattr(gguf, "files", None)
        self.tensors = gguf.tensors
        self.metadata = gguf.metadata

    @property
    def architecture(self) -> str:
        return self.gguf.architecture

    def get(self, key: str, default: Any = None) -> Any:
        return self.gguf.get(key, default)

    def require(self, key: str) -> Any:
        return self.gguf.require(key)

    def release(self, tensor: GGUFTensor) -> None:
        """This rank built a weight from its part of tensor `tensor.name`: the file's pages under it can go."""
        self.gguf.release(self.gguf.tensor(tensor.name))

    def tensor(self, name: str) -> GGUFTensor:
        tensor = self.gguf.tensor(name)
        if self.plan.rank > 0 and name.endswith(ROW_PARALLEL_BIASES):  # rank 0 adds it to the sum
            return GGUFTensor(name, tensor.ggml_type, tensor.shape, np.zeros_like(np.asarray(tensor.data)))
        cut = self.plan.cut(name)
        if cut is None:
            return tensor
        axis, start, end = cut
        if len(tensor.shape) == 3:  # experts: the same cut of each
            parts = [self._cut(expert_tensor(tensor, e), axis, start, end) for e in range(tensor.shape[0])]
            return GGUFTensor(
                name, tensor.ggml_type, (len(parts), *parts[0].shape), ExpertStack([p.data for p in parts])
            )
        return self._cut(tensor, axis, start, end)

    @staticmethod
    def _cut(tensor: GGUFTensor, axis: int, start: int, end: int) -> GGUFTensor:
        name = tensor.name
        if axis == 0:
            return GGUFTensor(name, tensor.ggml_type, (end - start, *tensor.shape[1:]), tensor.data[start:end])
        rows, cols = tensor.shape
        return GGUFTensor(name, tensor.ggml_type, (rows, end - start), _columns(tensor, start, end))


def _columns(tensor: GGUFTensor, start: int, end: int) -> np.ndarray:
    """Columns [start, end) of every row, contiguous: whole blocks of a quantized tensor's rows."""
    if tensor.ggml_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.ascontiguousarray(tensor.data[:, start:end])
    values_per_block, bytes_per_block = quant_block_shape(tensor.ggml_type)
    if start % values_per_block or end % values_per_block:
        raise ShardingError(
            f"{tensor.name}: columns {start}..{end - 1} do not fall on the {values_per_block}-weight blocks of its "
            f"{tensor.ggml_type.name} data"
        )
    first, last = start // values_per_block * bytes_per_block, end // values_per_block * bytes_per_block
    return np.ascontiguousarray(tensor.data[:, first:last])
