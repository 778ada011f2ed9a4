"""Write small GGUF files for tests: tiny random-weight models of llama (Llama 2/3, SmolLM2, Mistral-style), qwen2,
qwen3 and gemma3, written the way llama.cpp's convert_hf_to_gguf.py writes them: its metadata keys (gguf.Keys,
through GGUFWriter) and tensor names (gguf.TensorNameMap from the HF names), Q/K rows permuted for ggml's rope in
llama files only (qwen2, qwen3 and gemma3 use neox rope), Gemma's norm weights stored with their +1, and Llama 3's
rope scaling as a `rope_freqs` tensor. The weights are kept under their HF names, so a test can load the same ones
into HF transformers' model of the architecture and compare.
"""

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

# Qwen3's added tokens that are text, not control (user-defined in its GGUF, special: false in HF): single tokens
# the model writes in its replies
QWEN3_ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>")
# GGUF architecture name -> gguf's enum (for its tensor-name map)
_ARCHES = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}


@dataclass
class TinyModel:
    arch: str = "llama"  # GGUF's general.architecture; also which HF model the weights are laid out for
    vocab_size: int = 96
    hidden: int = 64
    intermediate: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_size: int | None = None  # None: hidden // heads, and the file names no key_length (as older converters)
    rope_theta: float = 10000.0
    # HF's rope parameters besides the base, e.g. {"rope_type": "llama3", "factor": 8.0, ...} or {"rope_type":
    # "linear", "factor": 8.0}: for Gemma 3, those of the global layers
    rope_scaling: dict[str, Any] | None = None
    eps: float = 1e-5
    context: int = 256
    tie_embeddings: bool = False
    sliding_window: int | None = None  # gemma3: the local layers' window (five local layers to one global)
    local_rope_theta: float = 10000.0  # gemma3: the local layers' rope base
    special_tokens: dict[int, str] = field(default_factory=dict)  # token id -> its text, a control token
    final_logit_softcapping: float | None = None  # gemma3: written when set, as the converter does
    seed: int = 0
    # a mixture of experts (arch qwen3moe, qwen2moe, olmoe; llama with experts is Mixtral): `experts` experts of
    # width `expert_intermediate`, `experts_used` a token, in every layer but `dense_layers`; Qwen2-MoE's shared
    # expert of width `shared_intermediate`
    experts: int = 0
    experts_used: int = 2
    expert_intermediate: int = 32
    shared_intermediate: int = 0
    dense_layers: tuple[int, ...] = ()
    weights: dict[str, np.ndarray] = field(default_factory=dict)  # HF names, float32

    def is_moe(self, layer: int) -> bool:
        return self.experts > 0 and layer not in self.dense_layers

    @property
    def gpt_oss(self) -> bool:
        return self.arch == "gpt-oss"

    @property
    def mixtral(self) -> bool:
        return self.arch == "llama" and self.experts > 0

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    def make_weights(self) -> None:
        """Random weights under HF names: llama's tensors in their order (the draws of older tests stay the same),
        then what the architecture adds per layer. Norm weights scale by about 1 (Gemma's: 1 + w, so w is small)."""
        rng = np.random.default_rng(self.seed)

        def w(*shape: int, scale: float = 0.08) -> np.ndarray:
            return (rng.standard_normal(shape) * scale).astype(np.float32)

        def norm(size: int) -> np.ndarray:
            return w(size, scale=0.3) if self.arch == "gemma3" else (1 + w(size)).astype(np.float32)

        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.weights["model.embed_tokens.weight"] = w(self.vocab_size, self.hidden, scale=0.5)
        self.weights["model.norm.weight"] = norm(self.hidden)
        if not self.tie_embeddings:
            self.weights["lm_head.weight"] = w(self.vocab_size, self.hidden)
        for i in range(self.layers):
            p = f"model.layers.{i}."
            self.weights[p + "self_attn.q_proj.weight"] = w(q, self.hidden)
            self.weights[p + "self_attn.k_proj.weight"] = w(kv, self.hidden)
            self.weights[p + "self_attn.v_proj.weight"] = w(kv, self.hidden)
            self.weights[p + "self_attn.o_proj.weight"] = w(self.hidden, q)
            self.weights[p + "mlp.gate_proj.weight"] = w(self.intermediate, self.hidden)
            self.weights[p + "mlp.up_proj.weight"] = w(self.intermediate, self.hidden)
            self.weights[p + "mlp.down_proj.weight"] = w(self.hidden, self.intermediate)
            self.weights[p + "input_layernorm.weight"] = norm(self.hidden)
            self.weights[p + "post_attention_layernorm.weight"] = norm(self.hidden)
            if self.arch == "qwen2":
                for name, size in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                    self.weights[p + f"self_attn.{name}.bias"] = w(size, scale=0.3)
            if self.arch in ("qwen2moe",):
                for name, size in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                    self.weights[p + f"self_attn.{name}.bias"] = w(size, scale=0.3)
            if self.arch in ("qwen3", "gemma3", "qwen3moe"):
                self.weights[p + "self_attn.q_norm.weight"] = norm(self.head_dim)
                self.weights[p + "self_attn.k_norm.weight"] = norm(self.head_dim)
            if self.arch == "olmoe":  # one norm over the whole Q, one over the whole K
                self.weights[p + "self_attn.q_norm.weight"] = norm(q)
                self.weights[p + "self_attn.k_norm.weight"] = norm(kv)
            if self.gpt_oss:
                self._make_gpt_oss(p, w)
            elif self.is_moe(i):
                self._make_experts(p, w)
            if self.arch == "gemma3":  # its post_attention_layernorm norms the attention's output
                self.weights[p + "pre_feedforward_layernorm.weight"] = norm(self.hidden)
                self.weights[p + "post_feedforward_layernorm.weight"] = norm(self.hidden)

    def _make_experts(self, p: str, w) -> None:
        """A mixture in place of layer `p`'s dense MLP, under the architecture's HF names. The router's scale makes
        the routing decisive (its top-k gaps wider than float rounding), so every reader picks the same experts."""
        for name in ("gate_proj", "up_proj", "down_proj"):
            del self.weights[p + f"mlp.{name}.weight"]
        block, names = (
            ("block_sparse_moe", ("w1", "w3", "w2")) if self.mixtral else ("mlp", ("gate_proj", "up_proj", "down_proj"))
        )
        self.weights[p + f"{block}.gate.weight"] = w(self.experts, self.hidden, scale=0.5)
        width = self.expert_intermediate
        for e in range(self.experts):
            gate, up, down = (p + f"{block}.experts.{e}.{n}.weight" for n in names)
            self.weights[gate] = w(width, self.hidden, scale=0.15)
            self.weights[up] = w(width, self.hidden, scale=0.15)
            self.weights[down] = w(self.hidden, width, scale=0.15)
        if self.shared_intermediate:
            s = self.shared_intermediate
            self.weights[p + "mlp.shared_expert.gate_proj.weight"] = w(s, self.hidden)
            self.weights[p + "mlp.shared_expert.up_proj.weight"] = w(s, self.hidden)
            self.weights[p + "mlp.shared_expert.down_proj.weight"] = w(self.hidden, s)
            self.weights[p + "mlp.shared_expert_gate.weight"] = w(1, self.hidden, scale=0.5)

    def _make_gpt_oss(self, p: str, w) -> None:
        """gpt-oss's layer under transformers' names: biases on every attention projection, a sink logit per head,
        a router with a bias, and the experts fused as transformers holds them (`gate_up_proj` [E, hidden, 2 x
        width], inputs by outputs, gate and up columns interleaved; `down_proj` [E, width, hidden]) with their
        biases. The experts' weights are values MXFP4 holds exactly (mxfp4_round), so its files and the float
        ones are the same model."""
        for name in ("gate_proj", "up_proj", "down_proj"):
            del self.weights[p + f"mlp.{name}.weight"]
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        e, width = self.experts, self.expert_intermediate
        for name, size in (("q_proj", q), ("k_proj", kv), ("v_proj", kv), ("o_proj", self.hidden)):
            self.weights[p + f"self_attn.{name}.bias"] = w(size, scale=0.3)
        self.weights[p + "self_attn.sinks"] = w(self.heads, scale=1.0)
        self.weights[p + "mlp.router.weight"] = w(e, self.hidden, scale=0.5)
        self.weights[p + "mlp.router.bias"] = w(e, scale=0.5)
        gate_up = mxfp4_round(w(e, 2 * width, self.hidden, scale=0.3))  # rows: outputs, quantized along inputs
        self.weights[p + "mlp.experts.gate_up_proj"] = np.ascontiguousarray(gate_up.transpose(0, 2, 1))
        self.weights[p + "mlp.experts.gate_up_proj_bias"] = w(e, 2 * width, scale=0.3)
        down = mxfp4_round(w(e, self.hidden, width, scale=0.3))
        self.weights[p + "mlp.experts.down_proj"] = np.ascontiguousarray(down.transpose(0, 2, 1))
        self.weights[p + "mlp.experts.down_proj_bias"] = w(e, self.hidden, scale=0.3)

    def hf_shape(self) -> dict[str, Any]:
        """The model's shape as transformers' config classes name it (the fields every architecture shares)."""
        shape = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=self.context,
            rms_norm_eps=self.eps,
            tie_word_embeddings=self.tie_embeddings,
        )
        if self.head_size is not None:
            shape["head_dim"] = self.head_size
        return shape


TinyLlama = TinyModel  # the llama defaults


def mxfp4_round(values: np.ndarray) -> np.ndarray:
    """float32 [..., k] -> the nearest values MXFP4 blocks of 32 along the last axis hold (gguf.quants' quantizer)."""
    qtype = gguf.GGMLQuantizationType.MXFP4
    return gguf.quants.dequantize(gguf.quants.quantize(values, qtype), qtype).reshape(values.shape)


def hf_mxfp4(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGUF MXFP4 rows uint8 [..., rows, k / 32 * 17] -> the Hub's (blocks [..., rows, k / 32, 16], scales [...,
    rows, k / 32]): each block's exponent, and its codes with value 2i in byte i's low nibble, 2i + 1 in its high."""
    blocks = raw.reshape(*raw.shape[:-1], -1, 17)
    scales, packed = blocks[..., 0], blocks[..., 1:]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # [..., 32] in value order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), np.ascontiguousarray(scales)


def permute_for_ggml(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (HF rope layout -> ggml rope layout)."""
    halves = weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
    return halves.swapaxes(1, 2).reshape(weight.shape)


def llama3_rope_freqs(model: TinyModel) -> np.ndarray:
    """float32 [head_dim / 2]: the converter's rope_freqs for HF's llama3 rope parameters (its float32 arithmetic)."""
    s, dim = model.rope_scaling or {}, model.head_dim
    freqs = (1.0 / (np.float32(model.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))).astype(np.float32)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_context = s["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = np.float32(2 * math.pi) / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = np.float32((old_context / wavelen - low) / (high - low))
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def gguf_tensors(model: TinyModel) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) of every tensor, as the converter makes them from the HF weights."""
    names = gguf.get_tensor_name_map(_ARCHES[model.arch], model.layers)
    for hf_name, value in _gpt_oss_split(model) if model.gpt_oss else _experts_stacked(model):
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name} in {model.arch}")
        if model.arch == "llama" and ".q_proj." in hf_name:
            value = permute_for_ggml(value, model.heads)
        elif model.arch == "llama" and ".k_proj." in hf_name:
            value = permute_for_ggml(value, model.kv_heads)
        elif model.arch == "gemma3" and hf_name.endswith("norm.weight"):
            value = value + np.float32(1.0)  # Gemma3RMSNorm scales by 1 + w
        yield name, value
    if (model.rope_scaling or {}).get("rope_type") == "llama3":
        yield "rope_freqs.weight", llama3_rope_freqs(model)


def _gpt_oss_split(model: TinyModel) -> Iterator[tuple[str, np.ndarray]]:
    """gpt-oss's HF weights as llama.cpp's converter (conversion/gpt_oss.py) renames and splits them before mapping:
    `sinks` + ".weight"; the fused experts transposed to [E, outputs, inputs] and gate_up split into its even
    (gate) and odd (up) outputs, their biases likewise."""
    for hf_name, value in model.weights.items():
        if hf_name.endswith("self_attn.sinks"):
            yield hf_name + ".weight", value
        elif hf_name.endswith("experts.gate_up_proj"):
            outputs = value.transpose(0, 2, 1)
            yield hf_name.replace("gate_up_proj", "gate_proj.weight"), np.ascontiguousarray(outputs[:, ::2])
            yield hf_name.replace("gate_up_proj", "up_proj.weight"), np.ascontiguousarray(outputs[:, 1::2])
        elif hf_name.endswith("experts.gate_up_proj_bias"):
            yield hf_name.replace("gate_up_proj_bias", "gate_proj.bias"), np.ascontiguousarray(value[..., ::2])
            yield hf_name.replace("gate_up_proj_bias", "up_proj.bias"), np.ascontiguousarray(value[..., 1::2])
        elif hf_name.endswith("experts.down_proj"):
            yield hf_name.replace("down_proj", "down_proj.weight"), np.ascontiguousarray(value.transpose(0, 2, 1))
        elif hf_name.endswith("experts.down_proj_bias"):
            yield hf_name.replace("down_proj_bias", "down_proj.bias"), value
        else:
            yield hf_name, value


def _experts_stacked(model: TinyModel) -> Iterator[tuple[str, np.ndarray]]:
    """The HF weights, each layer's experts of a kind stacked into one [experts, rows, columns] tensor named as the
    converter names it before mapping (`model.layers.0.mlp.experts.gate_proj`), in place of its first expert."""
    expert = re.compile(r"(.+\.experts)\.(\d+)\.(\w+)\.weight")
    for hf_name, value in model.weights.items():
        match = expert.fullmatch(hf_name)
        if match is None:
            yield hf_name, value
        elif match.group(2) == "0":
            stacked = [model.weights[f"{match.group(1)}.{e}.{match.group(3)}.weight"] for e in range(model.experts)]
            yield f"{match.group(1)}.{match.group(3)}.weight", np.stack(stacked)


def write_hparams(writer: gguf.GGUFWriter, model: TinyModel) -> None:
    """The model's shape, as convert_hf_to_gguf.py's TextModel and the architectures' classes write it."""
    writer.add_block_count(model.layers)
    writer.add_context_length(model.context)
    writer.add_embedding_length(model.hidden)
    writer.add_feed_forward_length(model.intermediate)
    writer.add_head_count(model.heads)
    writer.add_head_count_kv(model.kv_heads)
    scaling = model.rope_scaling or {}
    if scaling.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    elif scaling.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    elif scaling.get("rope_type") == "longrope":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    writer.add_rope_freq_base(model.rope_theta)
    writer.add_layer_norm_rms_eps(model.eps)
    if model.head_size is not None:
        writer.add_key_length(model.head_size)
        writer.add_value_length(model.head_size)
    if model.arch == "llama":
        writer.add_vocab_size(model.vocab_size)
        writer.add_rope_dimension_count(model.head_dim)
    if model.experts:
        writer.add_expert_count(model.experts)
        writer.add_expert_used_count(model.experts_used)
        if model.arch in ("qwen2moe", "qwen3moe", "gpt-oss"):  # the others' expert width is feed_forward_length
            writer.add_expert_feed_forward_length(model.expert_intermediate)
        if model.shared_intermediate:
            writer.add_expert_shared_feed_forward_length(model.shared_intermediate)
    if model.gpt_oss:
        writer.add_sliding_window(model.sliding_window)
    if model.arch == "gemma3":
        writer.add_rope_freq_base_swa(model.local_rope_theta)
        writer.add_sliding_window(model.sliding_window)
        if model.final_logit_softcapping:
            writer.add_final_logit_softcapping(model.final_logit_softcapping)


def write_tokenizer(writer: gguf.GGUFWriter, model: TinyModel) -> None:
    """Byte-level tokenizer metadata: a few tokens and one merge, the rest placeholders."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    tokens = ["a", "b", "ab"] + [f"<t{i}>" for i in range(3, model.vocab_size)]
    types = [1] * model.vocab_size
    for i, text in model.special_tokens.items():  # control tokens (FIM's, for instance) at these ids
        tokens[i], types[i] = text, 3
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)


def copy_tokenizer(
    writer: gguf.GGUFWriter,
    source: Path,
    model: TinyModel,
    chat_template: str | None = None,
    added_tokens: tuple[str, ...] = (),
) -> None:
    """The tokenizer of the GGUF at `source` (every tokenizer.* key), whose vocabulary and `added_tokens` (appended
    as user-defined tokens, as Qwen3's <think> is) must be the model's; `chat_template` replaces its template."""
    reader = gguf.GGUFReader(source)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    extra = {"tokenizer.ggml.tokens": list(added_tokens), "tokenizer.ggml.token_type": [4] * len(added_tokens)}
    for entry in reader.fields.values():
        if entry.name == "tokenizer.chat_template" and chat_template is not None:
            continue
        if entry.name.startswith("tokenizer."):
            value_type = entry.types[0]
            sub_type = entry.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            value = entry.contents()
            if entry.name in extra:
                value = [*value, *extra[entry.name]]
            writer.add_key_value(entry.name, value, value_type, sub_type=sub_type)
    if len(reader.fields["tokenizer.ggml.tokens"].contents()) + len(added_tokens) != model.vocab_size:
        raise ValueError(f"{source}'s vocabulary and the added tokens are not the model's {model.vocab_size} tokens")


def write_tiny_gguf(
    path: Path,
    model: TinyModel,
    matrix_type: str = "F32",
    arch: str | None = None,
    expert_type: str | None = None,
    tokenizer_from: Path | None = None,
    chat_template: str | None = None,
    added_tokens: tuple[str, ...] = (),
) -> Path:
    """The model as a GGUF file, its matrices stored as `matrix_type` (vectors, routers and biases, gpt-oss's 2-D
    expert ones too, stay F32, as the converter keeps them) and the experts' 3-D ones as `expert_type` where given
    (gpt-oss's MXFP4). `arch` writes another general.architecture over the same tensors (for tests of unsupported
    ones); `tokenizer_from`, a GGUF whose tokenizer the file takes (else a few placeholder tokens), with
    `chat_template` in place of its template where given and `added_tokens` after its vocabulary."""
    if not model.weights:
        model.make_weights()
    writer = gguf.GGUFWriter(str(path), arch or model.arch)
    write_hparams(writer, model)
    if tokenizer_from is None:
        write_tokenizer(writer, model)
    else:
        copy_tokenizer(writer, tokenizer_from, model, chat_template, added_tokens)
    qtype = gguf.GGMLQuantizationType[matrix_type]
    for name, value in gguf_tensors(model):
        router = name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"))  # the converter keeps F32
        if expert_type is not None and value.ndim == 3:
            expert_qtype = gguf.GGMLQuantizationType[expert_type]
            raw = gguf.quants.quantize(value, expert_qtype)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=expert_qtype)
        elif value.ndim >= 2 and qtype != gguf.GGMLQuantizationType.F32 and not router and name.endswith("weight"):
            raw = gguf.quants.quantize(value, qtype)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(name, value)
    finish(writer)
    return path


def write_tiny_llama(path: Path, model: TinyModel, matrix_type: str = "F32", arch: str = "llama") -> Path:
    """A llama GGUF (the older tests' entry point)."""
    return write_tiny_gguf(path, model, matrix_type, arch)


# byte offsets of the half floats in each block type (the rest of a block is codes, bits and integer scales, all
# of whose byte values are valid; MXFP4 has none: its byte 0 is an exponent, MXFP4_EXPONENTS)
BLOCK_HALVES = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "MXFP4": (),
}
# the exponent bytes random MXFP4 blocks get (block scales 2^-10 .. 2^2, as gpt-oss's experts have them)
MXFP4_EXPONENTS = (118, 131)


def random_blocks(type_name: str, rows: int, k: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """Raw GGUF rows (uint8 [rows, bytes per row]) of random blocks of a type: random bytes, with every half float
    a random value of either sign between 0.002 and 0.05, times `scale` (MXFP4: an exponent byte e in
    MXFP4_EXPONENTS, for d = 2^(e - 128), moved by log2(scale) rounded)."""
    qtype = gguf.GGMLQuantizationType[type_name]
    values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, k // values, block_bytes), dtype=np.uint8)
    size = (rows, k // values)
    for offset in BLOCK_HALVES[type_name]:
        half = (rng.uniform(0.002, 0.05, size=size) * scale * rng.choice([-1.0, 1.0], size=size)).astype(np.float16)
        blocks[..., offset : offset + 2] = half.view(np.uint8).reshape(rows, k // values, 2)
    if qtype == gguf.GGMLQuantizationType.MXFP4:
        blocks[..., 0] = rng.integers(*MXFP4_EXPONENTS, size=size) + round(np.log2(scale))
    return blocks.reshape(rows, -1)


def finish(writer: gguf.GGUFWriter) -> None:
    """Write what `writer` holds (header, metadata, tensors) and close its file(s)."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
