"""Generated tokens of the shared decoder's models through the native decoder (tokenmill/native/decoder.c):
llama's layers and what other architectures declare (QK-norm, sandwich norms, GeGLU, sliding-window layers
with their own rope base); Q/K/V biases take the torch path.

In a float32 model with 4-bit projections (`int4` and `auto`), the runner sends every generated token of a step
here, one row each (a row attends to its own context, so several rows of one sequence, as after a preemption,
are fine); prompt tokens take the torch path of the model. The native decoder computes what the torch path
computes, with the same 4-bit kernel for the projections, in one call per step: a table of every layer's
weights and KV-cache pointers is built once, here. Each row's result is the same bits whatever other rows the
step has.
"""

import ctypes

import torch

from tokenmill.distributed.shm import CollectiveError
from tokenmill.layers.attention import AttentionMetadata
from tokenmill.layers.quantized_linear import NATIVE_GROUP, Q4Linear, Q8Linear
from tokenmill.native import REDUCE_FN


class PackedWeight(ctypes.Structure):
    _fields_ = [
        ("qs", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("m", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("bits", ctypes.c_int64),
    ]


class LlamaLayer(ctypes.Structure):
    _fields_ = [
        ("norm1", ctypes.c_void_p),
        ("norm2", ctypes.c_void_p),
        ("qkv", PackedWeight),
        ("o", PackedWeight),
        ("gate_up", PackedWeight),
        ("down", PackedWeight),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("post_attn_norm", ctypes.c_void_p),
        ("post_mlp_norm", ctypes.c_void_p),
        ("window", ctypes.c_int64),
        ("local_rope", ctypes.c_int64),
    ]


ACTIVATION_CODES = {"silu": 0, "gelu_tanh": 1}  # decoder.c's TM_SILU, TM_GELU_TANH


def _pointer(norm: torch.nn.Module | None) -> int | None:
    return None if norm is None else norm.weight.data_ptr()


def _packed(layer: torch.nn.Module) -> PackedWeight:
    q = getattr(layer, "packed", layer)
    if q.__class__ not in (Q4Linear, Q8Linear):
        raise ValueError("the native decoder needs 4-bit or 8-bit (Q4Linear, Q8Linear) projections")
    if q.out_features % NATIVE_GROUP:
        raise ValueError(f"the native decoder needs output sizes in multiples of {NATIVE_GROUP}")
    if isinstance(q, Q8Linear):
        return PackedWeight(q.qs.data_ptr(), q.scale.data_ptr(), None, q.out_features, q.in_features, 8)
    return PackedWeight(q.qs.data_ptr(), q.scale.data_ptr(), q.low.data_ptr(), q.out_features, q.in_features, 4)


class NativeLlamaDecoder:
    def __init__(self, model: torch.nn.Module, lib: ctypes.CDLL):
        self.model = model
        self.lib = lib
        c = model.config
        self.projections = [
            [
                _packed(m)
                for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            ]
            for layer in model.layers
        ]
        self.table: ctypes.Array | None = None  # built when the KV cache exists (bind_kv_cache)
        self.eps = c.rms_norm_eps
        self.heads, self.kv_heads, self.dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.softmax_scale
        # every architecture of the shared decoder but one with Q/K/V biases (Qwen2: the torch path)
        self.ok = (
            not c.attention_bias
            and c.activation in ACTIVATION_CODES
            and c.rotary_dim == c.head_dim
            and c.head_dim <= 512
            and model.dtype == torch.float32
        )
        self.activation = ACTIVATION_CODES.get(c.activation, -1)
        # under tensor parallelism, the sum over ranks after each row-parallel projection, called from the native
        # loop; an exception there is kept and raised once the call returns (ctypes cannot carry it through C)
        parallel = getattr(model, "parallel", None)
        self._reduce_ctx: int | None = None
        if parallel is None:
            self._reduce = REDUCE_FN()  # NULL: one process holds the whole model
        elif parallel.shm is not None:  # the C sum over shared memory, called straight from the native loop
            self._reduce, self._reduce_ctx = parallel.shm.reduce_fn, parallel.shm.reduce_ctx
        else:
            self._reduce = REDUCE_FN(self._all_reduce)
        self._reduce_error: BaseException | None = None

    def _all_reduce(self, _ctx: int | None, pointer: int, n: int) -> int:
        try:
            values = torch.frombuffer((ctypes.c_float * n).from_address(pointer), dtype=torch.float32)  # [n]
            self.model.parallel.all_reduce(values)
            return 0
        except BaseException as exc:  # noqa: BLE001 - re-raised by forward
            self._reduce_error = exc
            return 1

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Record every layer's weights and cache tensors in the table the native code walks."""
        rows = []
        c = self.model.config
        for layer, (qkv, o, gate_up, down), (k, v) in zip(self.model.layers, self.projections, kv_caches, strict=True):
            attn = layer.self_attn
            rows.append(
                LlamaLayer(
                    layer.input_layernorm.weight.data_ptr(),
                    layer.post_attention_layernorm.weight.data_ptr(),
                    qkv,
                    o,
                    gate_up,
                    down,
                    k.data_ptr(),
                    v.data_ptr(),
                    _pointer(attn.q_norm),
                    _pointer(attn.k_norm),
                    _pointer(layer.post_attention_norm),
                    _pointer(layer.post_mlp_norm),
                    c.sliding_window if attn.local else 0,
                    int(attn.local and self.model.local_rotary is not self.model.rotary),
                )
            )
        self.table = (LlamaLayer * len(rows))(*rows)
        self._kv = kv_caches  # the table points into these tensors: keep them alive

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        local_meta: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [M] -> final hidden states [M, hidden] (normed), as the model's forward; `meta` has
        only a decode batch (one query per row); `local_meta` the same through the sliding-window layers' own
        pool, when they have one."""
        if self.table is None:
            raise RuntimeError("the native decoder has no KV cache yet (bind_kv_cache)")
        model = self.model
        d = meta.decode
        hidden = model.embed(input_ids).float().contiguous()  # [M, hidden], updated in place
        cos, sin = model.rotary.cos_full[positions], model.rotary.sin_signed[positions]  # [M, D], contiguous
        local_cos, local_sin = cos, sin
        if model.local_rotary is not model.rotary:  # local layers' own rope base (Gemma)
            local_cos, local_sin = model.local_rotary.cos_full[positions], model.local_rotary.sin_signed[positions]
        slots = meta.slot_mapping.contiguous()
        ctx_slots = d.kv_index.contiguous()  # [M * max_ctx]
        local_slots, local_ctx_slots = slots, ctx_slots
        if local_meta is not None:  # the same rows, contexts and lengths, in the other pool's slots
            local_slots, local_ctx_slots = local_meta.slot_mapping.contiguous(), local_meta.decode.kv_index.contiguous()
        ctx_lens = d.context_lens.contiguous()
        rc = self.lib.tm_llama_decode(
            ctypes.c_void_p(hidden.data_ptr()),
            ctypes.c_int64(hidden.shape[0]),
            ctypes.c_int64(hidden.shape[1]),
            self.table,
            ctypes.c_int64(len(self.table)),
            ctypes.c_float(self.eps),
            ctypes.c_void_p(cos.data_ptr()),
            ctypes.c_void_p(sin.data_ptr()),
            ctypes.c_void_p(local_cos.data_ptr()),
            ctypes.c_void_p(local_sin.data_ptr()),
            ctypes.c_void_p(slots.data_ptr()),
            ctypes.c_void_p(ctx_slots.data_ptr()),
            ctypes.c_void_p(local_slots.data_ptr()),
            ctypes.c_void_p(local_ctx_slots.data_ptr()),
            ctypes.c_void_p(ctx_lens.data_ptr()),
            ctypes.c_int64(d.max_context),
            ctypes.c_int64(self.heads),
            ctypes.c_int64(self.kv_heads),
            ctypes.c_int64(self.dim),
            ctypes.c_float(self.scale),
            ctypes.c_int64(self.activation),
            self._reduce,
            ctypes.c_void_p(self._reduce_ctx),
        )
        if rc != 0:
            if self._reduce_error is not None:
                error, self._reduce_error = self._reduce_error, None
                raise error
            if rc == -3:  # the shared-memory sum failed: its group knows which rank and why
                shm = self.model.parallel.shm
                raise shm.error() if shm is not None else CollectiveError("a tensor-parallel collective failed")
            raise RuntimeError(f"native decoder failed ({rc})")
        return model.norm.forward(hidden)
