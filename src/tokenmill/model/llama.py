"""The shared decoder: the llama architecture (SmolLM2, Llama 2/3, Mistral-style dense models: RMSNorm, rope,
GQA, SwiGLU) and what other architectures declare as differences in ModelConfig (Gemma 3: GeGLU, QK-norm,
sandwich norms, scaled embeddings, sliding-window local layers with their own rope base; Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE and gpt-oss: a mixture of experts for the MLP, layers/moe.py; gpt-oss: attention sinks, biases
on every attention projection, sliding-window layers between full ones).

The model takes the flattened new tokens of a whole step ([T] ids and positions) plus AttentionMetadata; it never
sees a padded batch. Q/K/V and gate/up projections are fused into one matmul each.
"""

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config.model_shape import ModelConfig
from tokenmill.layers.activation import ACTIVATIONS
from tokenmill.layers.attention import AttentionMetadata, paged_attention, windowed
from tokenmill.layers.linear import Linear
from tokenmill.layers.lora import LoRABatch
from tokenmill.layers.moe import MixtureOfExperts
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RopeTables, RotaryEmbedding
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.loader.weight_cache import IN_MEMORY, InMemoryWeights
from tokenmill.model.weights import WeightLoader

if TYPE_CHECKING:
    from tokenmill.distributed.group import ParallelGroup

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k, v), each [num_slots, num_kv_heads, head_dim]


class StepContext(NamedTuple):
    """What every layer of one forward shares: the rotary embedding and the step's tables, the metadata, and
    under tensor parallelism the sum over ranks that follows each row-parallel projection. Layers with a sliding
    window (Gemma's local layers) use the `local_` ones: their own rope base and the step's windowed metadata."""

    rotary: RotaryEmbedding
    rope: RopeTables
    meta: AttentionMetadata
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    local_rotary: RotaryEmbedding | None = None
    local_rope: RopeTables | None = None
    local_meta: AttentionMetadata | None = None
    lora: LoRABatch | None = None  # the rows that use LoRA adapters, and which (layers/lora.py)


def rms_norm(config: ModelConfig, size: int) -> RMSNorm:
    return RMSNorm(size, config.rms_norm_eps, config.norm_scale_in_float32)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, local: bool = False, layer: int = 0):
        super().__init__()
        self.layer = layer  # its index: where LoRA adapters find their products for it
        self.local = local  # attends to its sliding window only, with the local rope base
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qk_heads = config.num_heads + config.num_kv_heads
        self.scale = config.softmax_scale
        # placeholders without memory: the loader builds each projection in its kernel (model/weights.py)
        self.qkv_proj: nn.Module = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, dtype, "meta")
        self.o_proj: nn.Module = Linear(self.q_size, config.hidden_size, dtype, "meta")
        # Qwen2's Q, K and V biases, in qkv_proj's row order: [(H + 2 KVH) * D]
        self.qkv_bias = nn.Parameter(torch.zeros(self.q_size + 2 * self.kv_size, dtype=dtype), False)
        if not config.attention_bias:
            self.qkv_bias = None
        # gpt-oss: the output projection's bias [hidden], and each head's sink logit [H] (layers/attention.py)
        self.o_bias = nn.Parameter(torch.zeros(config.hidden_size, dtype=dtype), False)
        if not config.attention_output_bias:
            self.o_bias = None
        self.sinks = nn.Parameter(torch.zeros(config.num_heads), False) if config.attention_sinks else None
        # each head's query and key normed (Qwen3, Gemma 3), or the whole Q and K projections (OLMoE)
        self.qk_norm_whole = config.qk_norm_whole
        q_width, k_width = (self.q_size, self.kv_size) if config.qk_norm_whole else (self.head_dim, self.head_dim)
        self.q_norm = rms_norm(config, q_width) if config.qk_norm else None
        self.k_norm = rms_norm(config, k_width) if config.qk_norm else None

    def forward(self, step: StepContext, x: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        # submodules are called through .forward: the nn.Module call machinery costs ~1 ms per decoded token
        tokens = x.shape[0]
        qkv = self.qkv_proj.forward(x)  # [T, (H + 2 KVH) * D]
        if step.lora is not None:
            qkv = step.lora.apply(qkv, x, self.layer, "qkv_proj")
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        if self.qk_norm_whole:  # before rope, over all heads at once
            q, k = qkv[:, : self.q_size + self.kv_size].split([self.q_size, self.kv_size], dim=1)
            qk = torch.cat([self.q_norm.forward(q), self.k_norm.forward(k)], dim=1).view(tokens, self.qk_heads, -1)
        else:
            qk = qkv[:, : self.q_size + self.kv_size].view(tokens, self.qk_heads, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_whole:  # each head normalized on its own, before rope
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm.forward(q), self.k_norm.forward(k)], dim=1)
        rotary, rope, meta = (step.local_rotary, step.local_rope, step.local_meta) if self.local else step[:3]
        q, k = rotary.forward(rope, qk).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.sinks)  # [T, H, D]
        out = out.reshape(tokens, self.q_size)
        o = self.o_proj.forward(out)  # o_bias: the layer's, after the ranks' sum
        return o if step.lora is None else step.lora.apply(o, out, self.layer, "o_proj")


# A prompt chunk's MLP runs over this many tokens at a time. Its intermediates are the step's largest tensors
# ([T, 2 * I] and [T, I] float32: 64 MiB at 512 tokens of SmolLM2-1.7B); in pieces they take a quarter of that,
# and glibc's heap holds correspondingly less after them (peak RSS of a 512-token prefill at 1.7B: file + 649 MiB
# against + 700-730, at the same speed). The native products compute each row on its own: the same bits.
MLP_ROWS = 128


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer: int = 0):
        super().__init__()
        self.layer = layer  # its index: where LoRA adapters find their products for it
        self.gate_up_proj: nn.Module = Linear(config.hidden_size, 2 * config.intermediate_size, dtype, "meta")
        self.down_proj: nn.Module = Linear(config.intermediate_size, config.hidden_size, dtype, "meta")
        self.activation = ACTIVATIONS[config.activation]

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; on the CPU in pieces of MLP_ROWS tokens (a GPU wants all rows at once).
        `lora`: the rows' adapters (layers/lora.py)."""
        pieces = x.split(MLP_ROWS) if x.device.type == "cpu" else (x,)
        if lora is None:
            outs = [self.down_proj.forward(self.activation(self.gate_up_proj.forward(piece))) for piece in pieces]
        else:
            outs, start = [], 0
            for piece in pieces:
                rows = lora if len(pieces) == 1 else lora.piece(start, start + piece.shape[0])
                start += piece.shape[0]
                gate_up = rows.apply(self.gate_up_proj.forward(piece), piece, self.layer, "gate_up_proj")
                inner = self.activation(gate_up)  # [t, I]
                outs.append(rows.apply(self.down_proj.forward(inner), inner, self.layer, "down_proj"))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def mixture_of_experts(config: ModelConfig) -> MixtureOfExperts:
    """A layer's mixture of experts, its weights not yet loaded."""
    c = config
    return MixtureOfExperts(
        c.hidden_size,
        c.num_experts,
        c.experts_per_token,
        c.expert_weights_normalized,
        ACTIVATIONS[c.activation],
        c.expert_weights_scale,
        shared=c.shared_expert_intermediate_size > 0,
        biases=c.expert_biases,
        softmax_after_topk=c.expert_softmax_after_topk,
    )


def load_experts(moe: MixtureOfExperts, weights: WeightLoader, prefix: str) -> None:
    """A mixture's weights from GGUF's tensors of the layer `prefix` ("blk.3."): the router (`ffn_gate_inp`), every
    expert's gate and up rows fused into one projection and its down projection (`ffn_{gate,up,down}_exps`, 3-D),
    a shared expert with its gate (`ffn_*_shexp`, `ffn_gate_inp_shexp`) where the layer has one, and gpt-oss's
    biases (`ffn_gate_inp.bias` [E], `ffn_{gate,up,down}_exps.bias` [E, rows])."""
    p = prefix
    router = weights.float_tensor(p + "ffn_gate_inp.weight", torch.float32)
    gate_ups = weights.experts([p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight"])
    downs = weights.experts([p + "ffn_down_exps.weight"])
    shared = shared_gate = None
    if moe.shared_gate is not None:
        shared = (
            weights.linear([(p + "ffn_gate_shexp.weight", None), (p + "ffn_up_shexp.weight", None)]),
            weights.linear([(p + "ffn_down_shexp.weight", None)]),
        )
        shared_gate = weights.float_tensor(p + "ffn_gate_inp_shexp.weight", torch.float32).reshape(-1)
    biases = None
    if moe.biases:
        bias = lambda name: weights.float_tensor(p + name + ".bias", torch.float32)  # noqa: E731
        gate_up_bias = torch.cat([bias("ffn_gate_exps"), bias("ffn_up_exps")], dim=1)  # [E, 2 x width]
        biases = (bias("ffn_gate_inp"), gate_up_bias, bias("ffn_down_exps"))
    moe.load(router, list(zip(gate_ups, downs, strict=True)), shared, shared_gate, biases)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks (the MLP dense, or a mixture of experts: layers/moe.py); with sandwich
    norms (Gemma) each block's output is normed as well, before the residual addition (the attention's by
    post_attention_norm; the MLP's input by post_attention_layernorm, as llama names its second norm, and its
    output by post_mlp_norm)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, local: bool = False, moe: bool = False, layer: int = 0):
        super().__init__()
        self.input_layernorm = rms_norm(config, config.hidden_size)
        self.self_attn = LlamaAttention(config, dtype, local, layer)
        self.post_attention_layernorm = rms_norm(config, config.hidden_size)
        self.mlp: LlamaMLP | MixtureOfExperts = (
            LlamaMLP(config, dtype, layer) if not moe else mixture_of_experts(config)
        )
        sandwich = config.sandwich_norms
        self.post_attention_norm = rms_norm(config, config.hidden_size) if sandwich else None
        self.post_mlp_norm = rms_norm(config, config.hidden_size) if sandwich else None

    def forward(self, step: StepContext, hidden: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        attn = self.self_attn.forward(step, self.input_layernorm.forward(hidden), kv_cache)
        attn = attn if step.reduce is None else step.reduce(attn)
        if self.self_attn.o_bias is not None:  # once, after the sum over ranks (gpt-oss)
            attn = attn + self.self_attn.o_bias
        hidden = hidden + (attn if self.post_attention_norm is None else self.post_attention_norm.forward(attn))
        normed = self.post_attention_layernorm.forward(hidden)
        dense = isinstance(self.mlp, LlamaMLP)  # adapters change dense MLPs only (model/lora_weights.py)
        mlp = self.mlp.forward(normed, step.lora) if dense else self.mlp.forward(normed)
        mlp = mlp if step.reduce is None else step.reduce(mlp)
        return hidden + (mlp if self.post_mlp_norm is None else self.post_mlp_norm.forward(mlp))


class LlamaForCausalLM(nn.Module):
    """`config` is the part this process holds: the whole model, or one tensor-parallel rank's shard
    (distributed/shard.py), with `parallel` set to the ranks' group and `vocab_start` to its first token id."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.parallel: ParallelGroup | None = None
        self.vocab_start = 0
        # the float table (quantization None), else empty: the quantized modes look rows up through token_rows
        self.embed_tokens = nn.Parameter(torch.empty(0, config.hidden_size, dtype=dtype), False)
        self.rotary, self.local_rotary = rotary_embeddings(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, dtype, config.is_local(i), config.is_moe(i), i) for i in range(config.num_layers)
        )
        self.norm = rms_norm(config, config.hidden_size)
        # built by load_weights; with tied embeddings and no quantization, its weight is the embedding table itself
        self.lm_head: nn.Module = Linear(config.hidden_size, config.vocab_size, dtype, "meta")
        # the quantized modes' embedding lookup, from the file's blocks: [T] ids -> float32 [T, hidden]
        self.token_rows: Callable[[torch.Tensor], torch.Tensor] | None = None

    def keep_positions(self, count: int) -> None:
        """Rope tables for the first `count` positions only (they are built for the whole trained context)."""
        for rotary in {self.rotary, self.local_rotary}:
            rotary.keep_positions(count)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        local_meta: AttentionMetadata | None = None,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (normed). `local_meta`: the step through
        the sliding-window layers' own block tables, when their K/V have a pool of their own (else `meta`);
        `lora`: which rows use which LoRA adapter (None: none does)."""
        hidden = self.embed(input_ids)
        reduce = self.parallel.all_reduce if self.parallel is not None else None
        rope = self.rotary.tables(positions)
        step = StepContext(self.rotary, rope, meta, reduce, lora=lora)
        if (window := self.config.sliding_window) is not None:
            local_rope = rope if self.local_rotary is self.rotary else self.local_rotary.tables(positions)
            step = step._replace(
                local_rotary=self.local_rotary,
                local_rope=local_rope,
                local_meta=windowed(meta if local_meta is None else local_meta, window),
            )
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer.forward(step, hidden, kv_cache)
        return self.norm.forward(hidden)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden] embeddings. Vocabulary-parallel: each rank looks up the ids in its part of
        the table, zeros for the others, and the sum over ranks is every row (exact: one term is not zero)."""
        if self.parallel is None:
            return self._embedding_rows(input_ids)
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.config.vocab_size)  # [T]
        rows = self._embedding_rows(torch.where(inside, local, 0))
        return self.parallel.all_reduce(rows.masked_fill_(~inside.unsqueeze(1), 0.0).contiguous())

    def _embedding_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.token_rows is not None:
            rows = self.token_rows(input_ids).to(self.dtype)
        else:
            rows = F.embedding(input_ids, self.embed_tokens)
        if self.config.embedding_scale is not None:  # as HF: the scale rounded to the compute dtype first
            rows = rows * torch.tensor(self.config.embedding_scale, dtype=self.dtype)
        return rows

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> float32 logits [N, vocab]. Vocabulary-parallel: each rank computes its columns, which
        rank 0 gathers; the other ranks get None."""
        logits = self.lm_head(hidden).float()
        return logits if self.parallel is None else self.parallel.gather_columns(logits)

    # ---- weights -------------------------------------------------------------------------------------------------

    def _projections(
        self, i: int, layer: "LlamaDecoderLayer"
    ) -> list[tuple[nn.Module, str, list[tuple[str, int | None]]]]:
        """Layer i's fused projections: (parent module, attribute, the GGUF tensors stacked into it in order, each
        with its number of rope heads when its rows are stored permuted for ggml's rope, else None)."""
        c, p = self.config, f"blk.{i}."
        permuted = c.rope_rows_permuted
        return [
            (
                layer.self_attn,
                "qkv_proj",
                [
                    (p + "attn_q.weight", c.num_heads if permuted else None),
                    (p + "attn_k.weight", c.num_kv_heads if permuted else None),
                    (p + "attn_v.weight", None),
                ],
            ),
            (layer.self_attn, "o_proj", [(p + "attn_output.weight", None)]),
        ] + (
            []
            if isinstance(layer.mlp, MixtureOfExperts)
            else [
                (layer.mlp, "gate_up_proj", [(p + "ffn_gate.weight", None), (p + "ffn_up.weight", None)]),
                (layer.mlp, "down_proj", [(p + "ffn_down.weight", None)]),
            ]
        )

    def load_weights(
        self, source: GGUFFile, quantization: str | None = None, store: InMemoryWeights = IN_MEMORY
    ) -> None:
        """Build every weight from `source` in the kernels of `quantization` (None: dequantized to the compute
        dtype; "auto", "int4", "int8": model/weights.py), one tensor at a time. Under the quantized modes no float
        copy of a projection, the LM head or the embedding table is made: they go from the file's blocks to the
        native kernels' as the file has them (`auto`: every GGUF block type; `int4`: Q4_0/Q4_1/Q4_K/MXFP4 kept, the
        rest re-coded to Q4_1). `store` gives the native kernels' buffers (loader/weight_cache.py)."""
        c = self.config
        weights = WeightLoader(source, quantization, self.dtype, store)
        head_name = "token_embd.weight" if c.tie_word_embeddings else "output.weight"
        self.lm_head = weights.head(head_name)
        # a tied head is the table itself: its rows can be looked up from the head's blocks (an untied head of the
        # same type as the table is another tensor)
        table = weights.embedding("token_embd.weight", self.lm_head if c.tie_word_embeddings else None)
        if isinstance(table, torch.Tensor):  # float: the table, which a tied dense head shares
            self.embed_tokens = nn.Parameter(table, False)
            if c.tie_word_embeddings:
                self.lm_head = Linear.of(table)
        else:
            self.token_rows = table
        self.norm.weight.data = weights.float_tensor("output_norm.weight", torch.float32)
        for i, layer in enumerate(self.layers):
            p = f"blk.{i}."
            for parent, name, sources in self._projections(i, layer):
                setattr(parent, name, weights.linear(sources))
            if isinstance(layer.mlp, MixtureOfExperts):
                load_experts(layer.mlp, weights, p)
            attn = layer.self_attn
            if c.attention_bias:
                names = [(n.replace(".weight", ".bias"), heads) for n, heads in self._projections(i, layer)[0][2]]
                biases = [weights.float_rows(n, heads) for n, heads in names]
                attn.qkv_bias = nn.Parameter(torch.cat(biases), False)
            if c.attention_output_bias:
                attn.o_bias = nn.Parameter(weights.float_tensor(p + "attn_output.bias"), False)
            if c.attention_sinks:
                attn.sinks = nn.Parameter(weights.float_tensor(p + "attn_sinks.weight", torch.float32), False)
            norms = [(layer.input_layernorm, "attn_norm"), (layer.post_attention_layernorm, c.ffn_norm_name)]
            if c.qk_norm:
                norms += [(layer.self_attn.q_norm, "attn_q_norm"), (layer.self_attn.k_norm, "attn_k_norm")]
            if c.sandwich_norms:
                norms += [(layer.post_attention_norm, "post_attention_norm"), (layer.post_mlp_norm, "post_ffw_norm")]
            for norm, name in norms:
                norm.weight.data = weights.float_tensor(f"{p}{name}.weight", torch.float32)


def rotary_embeddings(config: ModelConfig) -> tuple[RotaryEmbedding, RotaryEmbedding]:
    """(the global layers' rotary embedding, the local layers'): one object when they are the same frequencies (the
    native decoder reads the local tables only when they are another object). Rope scaling is the global layers'
    only where the local layers have a base of their own: Gemma 3's keep theirs, unscaled, as in HF transformers and
    llama.cpp; gpt-oss's local layers share the global rope, YaRN included."""
    c = config
    rotary = RotaryEmbedding(
        c.head_dim,
        c.rotary_dim,
        c.max_position,
        c.rope_theta,
        c.rope_scale,
        c.rope_freq_factors,
        c.rope_attention_factor,
    )
    if c.local_rope_theta is None:  # the local layers' rope is the global one, scaling included (gpt-oss)
        return rotary, rotary
    local_theta = c.local_rope_theta
    scaled = c.rope_scale != 1.0 or c.rope_freq_factors is not None or c.rope_attention_factor != 1.0
    if c.sliding_window is None or (local_theta == c.rope_theta and not scaled):
        return rotary, rotary
    return rotary, RotaryEmbedding(c.head_dim, c.rotary_dim, c.max_position, local_theta)
