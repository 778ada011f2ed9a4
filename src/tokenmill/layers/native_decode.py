"""Generated tokens of the shared decoder's models through the native decoder (tokenmill/native/decoder.c):
llama's layers and what other architectures declare (QK-norm per head or over the whole Q and K, sandwich norms,
GeGLU, sliding-window layers with their own rope base, Qwen2's Q/K/V biases, mixtures of experts with or without a
shared expert, and gpt-oss's sinks, output bias, expert biases and clamped SwiGLU).

In a float32 model with 4-bit projections (`int4` and `auto`), the runner sends every generated token of a step
here, one row each (a row attends to its own context, so several rows of one sequence, as after a preemption,
are fine); prompt tokens take the torch path of the model. The native decoder computes what the torch path
computes, with the same native products for the projections (NativeLinear's weights, any of its GGUF types
and parts; activations in as many int8 passes as those weights take: the same kernel for a token whether it is
a prompt's or a generated one, so a recomputed or verified token gets the same bits), in one call per step: a
table of every layer's weights and KV-cache pointers is built once, here. Each row's result is the same bits
whatever other rows the step has.
"""

import ctypes

import torch
from torch import nn

from tokenmill.errors import CollectiveError
from tokenmill.layers.attention import AttentionMetadata
from tokenmill.layers.moe import MixtureOfExperts
from tokenmill.layers.native_attention import KV_DTYPE_CODES
from tokenmill.layers.quantized_linear import NATIVE_GROUP, NativeLinear
from tokenmill.native import REDUCE_FN, Weight


class Moe(ctypes.Structure):
    """kernels.h's tm_moe: a layer's mixture of experts."""

    _fields_ = [
        ("n_experts", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("inter", ctypes.c_int64),
        ("normalize", ctypes.c_int64),
        ("softmax_after_topk", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("router", ctypes.c_void_p),
        ("router_bias", ctypes.c_void_p),
        ("gate_up", ctypes.c_void_p),
        ("down", ctypes.c_void_p),
        ("gate_up_bias", ctypes.c_void_p),
        ("down_bias", ctypes.c_void_p),
        ("shared_gate_up", Weight),
        ("shared_down", Weight),
        ("shared_gate", ctypes.c_void_p),
    ]


class LlamaLayer(ctypes.Structure):
    _fields_ = [
        ("norm1", ctypes.c_void_p),
        ("norm2", ctypes.c_void_p),
        ("qkv", Weight),
        ("o", Weight),
        ("gate_up", Weight),
        ("down", Weight),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("post_attn_norm", ctypes.c_void_p),
        ("post_mlp_norm", ctypes.c_void_p),
        ("window", ctypes.c_int64),
        ("local_rope", ctypes.c_int64),
        ("qkv_bias", ctypes.c_void_p),
        ("kv_dtype", ctypes.c_int64),
        ("moe", ctypes.c_void_p),
        ("qk_norm_whole", ctypes.c_int64),
        ("o_bias", ctypes.c_void_p),
        ("sinks", ctypes.c_void_p),
    ]


class LlamaModel(ctypes.Structure):
    """kernels.h's tm_llama_model: what the model is, built once with the KV cache."""

    _fields_ = [
        ("layers", ctypes.c_void_p),
        ("n_layers", ctypes.c_int64),
        ("h", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("dim", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("activation", ctypes.c_int64),
        ("passes", ctypes.c_int64),
        ("reduce", REDUCE_FN),
        ("reduce_ctx", ctypes.c_void_p),
    ]


class DecodeStep(ctypes.Structure):
    """kernels.h's tm_decode_step: one step's decode rows (tensors' data pointers)."""

    _fields_ = [
        ("hidden", ctypes.c_void_p),
        ("m", ctypes.c_int64),
        ("max_ctx", ctypes.c_int64),
        ("cos_full", ctypes.c_void_p),
        ("sin_signed", ctypes.c_void_p),
        ("local_cos_full", ctypes.c_void_p),
        ("local_sin_signed", ctypes.c_void_p),
        ("slot_mapping", ctypes.c_void_p),
        ("ctx_slots", ctypes.c_void_p),
        ("local_slot_mapping", ctypes.c_void_p),
        ("local_ctx_slots", ctypes.c_void_p),
        ("ctx_lens", ctypes.c_void_p),
    ]


ACTIVATION_CODES = {"silu": 0, "gelu_tanh": 1, "swiglu_oai": 2}  # decoder.c's TM_SILU, TM_GELU_TANH, TM_SWIGLU_OAI


def _pointer(norm: torch.nn.Module | None) -> int | None:
    return None if norm is None else norm.weight.data_ptr()


def _bias_pointer(bias: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> int | None:
    """A bias or sinks tensor (Qwen2's Q/K/V biases, gpt-oss's output bias, sinks and expert biases; a router's
    bias float64), of `dtype` and contiguous as the model keeps them (a float32 model)."""
    if bias is None:
        return None
    if bias.dtype != dtype or not bias.is_contiguous():
        raise ValueError(f"the native decoder needs {dtype} contiguous biases")
    return bias.data_ptr()


def _kv_dtype_code(k: torch.Tensor, v: torch.Tensor) -> int:
    """A layer's caches, contiguous and of one of the element types the native attention reads."""
    if k.dtype != v.dtype or k.dtype not in KV_DTYPE_CODES or not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError(f"the native decoder reads contiguous float32/float16/bfloat16/int8 caches, not {k.dtype}")
    return KV_DTYPE_CODES[k.dtype]


def _packed(q: torch.nn.Module) -> Weight:
    """The native weight of a projection (a NativeLinear)."""
    if not isinstance(q, NativeLinear):
        raise ValueError("the native decoder needs projections with native weights (NativeLinear)")
    if any(rows % NATIVE_GROUP for rows in q.part_rows):
        raise ValueError(f"the native decoder needs every weight part's rows in multiples of {NATIVE_GROUP}")
    return q.c_weight


class _NativeMixture:
    """A MixtureOfExperts as tm_moe (`description`), with the arrays of its experts' weights it points into."""

    def __init__(self, moe: MixtureOfExperts):
        self.gate_up = (Weight * moe.num_experts)(*(_packed(m) for m in moe.gate_up))
        self.down = (Weight * moe.num_experts)(*(_packed(m) for m in moe.down))
        shared = moe.shared_gate_up is not None
        self.router = moe.router.float().contiguous()  # [E, hidden]: the torch path's own float32 tensor
        self.description = Moe(
            moe.num_experts,
            moe.k,
            moe.gate_up[0].out_features // 2,
            int(moe.normalize),
            int(moe.softmax_after_topk),
            moe.scale,
            self.router.data_ptr(),
            _bias_pointer(moe.router_bias, torch.float64),
            ctypes.addressof(self.gate_up),
            ctypes.addressof(self.down),
            _bias_pointer(moe.gate_up_bias),
            _bias_pointer(moe.down_bias),
            _packed(moe.shared_gate_up) if shared else Weight(),
            _packed(moe.shared_down) if shared else Weight(),
            _bias_pointer(moe.shared_gate) if shared else None,
        )


def _mixture(mlp: nn.Module) -> _NativeMixture | None:
    return _NativeMixture(mlp) if isinstance(mlp, MixtureOfExperts) else None


class NativeLlamaDecoder:
    """The native decode backend (runner/decode_backend.py): every layer of a step's generated tokens in one C
    call, which reads the model from one description (LlamaModel, its layers' traits as data) and the step's rows
    from one struct (DecodeStep)."""

    name = "native"

    def __init__(self, model: torch.nn.Module, lib: ctypes.CDLL):
        self.model = model
        self.lib = lib
        c = model.config
        # each layer's projections (a mixture's in place of its MLP's: gate_up and down left empty); the table
        # points into the mixtures' descriptions
        self.mixtures = [_mixture(layer.mlp) for layer in model.layers]
        self.projections = [
            [_packed(layer.self_attn.qkv_proj), _packed(layer.self_attn.o_proj)]
            + ([Weight(), Weight()] if moe else [_packed(layer.mlp.gate_up_proj), _packed(layer.mlp.down_proj)])
            for layer, moe in zip(model.layers, self.mixtures, strict=True)
        ]
        self._first_projection = model.layers[0].self_attn.qkv_proj
        self.table: ctypes.Array | None = None  # built when the KV cache exists (bind_kv_cache)
        self.description: LlamaModel | None = None  # the same, with the model's sizes
        self.eps = c.rms_norm_eps
        self.heads, self.kv_heads, self.dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.softmax_scale
        self.ok = (
            c.activation in ACTIVATION_CODES
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

    @property
    def passes(self) -> int:
        """The int8 activation passes of the projections' products: the torch path's (NativeLinear.passes)."""
        return self._first_projection.passes

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Record every layer's weights and cache tensors in the table the native code walks."""
        rows = []
        c = self.model.config
        layers = zip(self.model.layers, self.projections, self.mixtures, kv_caches, strict=True)
        for layer, (qkv, o, gate_up, down), moe, (k, v) in layers:
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
                    _bias_pointer(attn.qkv_bias),
                    _kv_dtype_code(k, v),
                    None if moe is None else ctypes.addressof(moe.description),
                    int(attn.qk_norm_whole),
                    _bias_pointer(attn.o_bias),
                    _bias_pointer(attn.sinks),
                )
            )
        self.table = (LlamaLayer * len(rows))(*rows)
        self._kv = kv_caches  # the table points into these tensors: keep them alive
        self.description = LlamaModel(
            ctypes.addressof(self.table),
            len(rows),
            c.hidden_size,
            self.heads,
            self.kv_heads,
            self.dim,
            self.eps,
            self.scale,
            self.activation,
            self.passes,
            self._reduce,
            self._reduce_ctx,
        )
        if self.lib.tm_llama_check(ctypes.byref(self.description)) != 0:
            raise ValueError("the native decoder cannot compute this model (sizes or weights disagree)")

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
        if self.description is None:
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
        step = DecodeStep(
            hidden.data_ptr(),
            hidden.shape[0],
            d.max_context,
            cos.data_ptr(),
            sin.data_ptr(),
            local_cos.data_ptr(),
            local_sin.data_ptr(),
            slots.data_ptr(),
            ctx_slots.data_ptr(),
            local_slots.data_ptr(),
            local_ctx_slots.data_ptr(),
            ctx_lens.data_ptr(),
        )
        self.description.passes = self.passes  # a test or benchmark may switch the projections' passes
        rc = self.lib.tm_llama_decode(ctypes.byref(self.description), ctypes.byref(step))
        if rc != 0:
            if self._reduce_error is not None:
                error, self._reduce_error = self._reduce_error, None
                raise error
            if rc == -3:  # the shared-memory sum failed: its group knows which rank and why
                shm = self.model.parallel.shm
                raise shm.error() if shm is not None else CollectiveError("a tensor-parallel collective failed")
            raise RuntimeError(f"native decoder failed ({rc})")
        return model.norm.forward(hidden)
