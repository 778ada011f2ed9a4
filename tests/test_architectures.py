"""Real architectures from GGUF: tiny random-weight models of Llama 3.x (its rope scaling as a rope_freqs tensor), a
Mistral-style llama (GQA, a head size that is not hidden / heads, untied head), Qwen 2.5 (Q/K/V biases), Qwen 3
(QK-norm; and with YaRN) and Gemma 3 shaped as the 1B and the 4B (sliding windows with their own rope base; the
4B's linear rope scaling on the global layers), written as llama.cpp's converter writes them
(tests/gguf_builder.py), must give HF transformers' float32 logits and greedy tokens with the same weights. The same
models saved by transformers (config.json's rope scaling) load too; rope frequencies at the real models' sizes match
transformers'; and what the decoder does not implement is refused by name."""

import json
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from tests.gguf_builder import TinyModel, llama3_rope_freqs, write_tiny_gguf
from tokenmill import LLM, SamplingParams
from tokenmill.errors import UnsupportedModelError
from tokenmill.layers.rotary import inverse_frequencies, llama3_frequency_factors
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.loader.hf_checkpoint import HFCheckpoint
from tokenmill.model.config_from_source import model_config_from_source
from tokenmill.model.hf_config import _rope_traits as rope_traits
from tokenmill.model.registry import build_model
from tokenmill.runner.model_runner import ModelRunner, StepChunk
from tokenmill.tokenizer.gguf_tokenizer import Tokenizer

LLAMA3_SCALING = {  # Llama 3.1's parameters, the original context shrunk so that a 16-frequency head has all kinds
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}
YARN_SCALING = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
CASES = {
    # Llama 3.2 1B-like: tied embeddings, GQA, base 500,000, frequencies kept / interpolated / divided by 8
    "llama3": TinyModel(
        hidden=128, heads=4, kv_heads=2, rope_theta=5e5, rope_scaling=LLAMA3_SCALING, tie_embeddings=True
    ),
    # Mistral Nemo-like: 4 query heads per KV head, heads of 16 over a hidden size of 64, untied head, base 1e6
    "mistral": TinyModel(heads=8, kv_heads=2, head_size=16, rope_theta=1e6, seed=1),
    # Qwen 2.5 0.5B-like: Q/K/V biases, tied embeddings
    "qwen2": TinyModel(arch="qwen2", rope_theta=1e6, eps=1e-6, tie_embeddings=True, seed=2),
    # Qwen 3 0.6B-like: QK-norm, heads of 32 over a hidden size of 64, tied embeddings
    "qwen3": TinyModel(arch="qwen3", head_size=32, rope_theta=1e6, eps=1e-6, tie_embeddings=True, seed=3),
    # Qwen 3 with YaRN as its model cards enable it (factor 4), the original context shrunk to 64 positions so that
    # a 16-frequency head has kept, ramped and interpolated frequencies; cos and sin scaled by 1 + 0.1 ln 4
    "qwen3-yarn": TinyModel(
        arch="qwen3",
        head_size=32,
        rope_theta=1e4,
        rope_scaling=YARN_SCALING,
        eps=1e-6,
        tie_embeddings=True,
        seed=7,
    ),
    # Gemma 3 1B-like: one KV head, heads of 32, 7 layers (the sixth global), an 8-token window
    "gemma3-1b": TinyModel(
        arch="gemma3",
        heads=4,
        kv_heads=1,
        head_size=32,
        intermediate=192,
        layers=7,
        sliding_window=8,
        rope_theta=1e6,
        eps=1e-6,
        tie_embeddings=True,
        seed=4,
    ),
    # Gemma 3 4B-like: 8 heads over 4 KV heads, and linear rope scaling (factor 8) on the global layers
    "gemma3-4b": TinyModel(
        arch="gemma3",
        heads=8,
        kv_heads=4,
        head_size=16,
        layers=7,
        sliding_window=8,
        rope_theta=1e6,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        eps=1e-6,
        tie_embeddings=True,
        seed=5,
    ),
    # Gemma 3 27B-like: its 62 layers, where llama.cpp takes the attention scale from hidden / heads, not the head size
    "gemma3-27b": TinyModel(
        arch="gemma3",
        hidden=32,
        intermediate=64,
        heads=2,
        kv_heads=1,
        head_size=32,
        layers=62,
        sliding_window=8,
        rope_theta=1e6,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        eps=1e-6,
        tie_embeddings=True,
        seed=6,
    ),
}
MATRIX_TYPES = {"qwen3": "F16", "gemma3-4b": "F16"}  # the others' matrices are F32
PROMPT = [int(t) for t in np.random.default_rng(9).integers(3, 96, size=40)]  # 5 of Gemma's 8-token windows
GREEDY_TOKENS = 16


def hf_config(model: TinyModel) -> transformers.PretrainedConfig:
    """The transformers config of the same model: the rope parameters of the global layers, and Gemma's local
    ones; query_pre_attn_scalar as a GGUF file implies it (llama.cpp): the head size (Gemma 3 270M to 12B), but
    hidden / heads for 62 layers (the 27B)."""
    common = model.hf_shape()
    rope = {"rope_type": "default", "rope_theta": model.rope_theta, **(model.rope_scaling or {})}
    if model.arch == "gemma3":
        local = {"rope_type": "default", "rope_theta": model.local_rope_theta}
        return transformers.Gemma3TextConfig(
            **common,
            sliding_window=model.sliding_window,
            query_pre_attn_scalar=model.hidden // model.heads if model.layers == 62 else model.head_dim,
            rope_parameters={"full_attention": rope, "sliding_attention": local},
        )
    config_class = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}[model.arch]
    return getattr(transformers, config_class)(**common, rope_parameters=rope)


def hf_model(model: TinyModel, matrix_type: str) -> torch.nn.Module:
    """HF transformers' model holding the GGUF's weights (rounded to `matrix_type` as the file stores them)."""
    config = hf_config(model)
    config.architectures = [transformers.AutoModelForCausalLM._model_mapping[type(config)].__name__]
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    qtype = gguf.GGMLQuantizationType[matrix_type]
    state = {}
    for name, w in model.weights.items():
        if w.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
        state[name] = torch.from_numpy(np.ascontiguousarray(w))
    if model.tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf.load_state_dict(state, strict=True)  # every weight the builder made, and no other
    return hf


def hf_reference(hf: torch.nn.Module) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """HF's logits at every prompt position [T, V], its greedy continuation, and the log-probabilities at every
    position of prompt and continuation [T + n, V]."""
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0]
        out = hf.generate(
            torch.tensor([PROMPT]), max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS, do_sample=False
        )
        logprobs = torch.log_softmax(hf(out).logits[0], dim=-1)
    return logits, out[0, len(PROMPT) :].tolist(), logprobs


def fresh(name: str) -> TinyModel:
    """A copy of a case's model, its weights not yet made (CASES stay unchanged)."""
    return replace(CASES[name], weights={})


SLOW_CASES = {"gemma3-27b"}  # 62 layers: about 15 s for its four tests


@pytest.fixture(
    scope="module", params=[pytest.param(n, marks=[pytest.mark.slow] if n in SLOW_CASES else []) for n in sorted(CASES)]
)
def case(request, tmp_path_factory) -> dict:
    """A case's model, its GGUF file, HF's model of it and HF's outputs, made once per architecture."""
    name = request.param
    model, matrix_type = fresh(name), MATRIX_TYPES.get(name, "F32")
    path = write_tiny_gguf(tmp_path_factory.mktemp(name) / f"{name}.gguf", model, matrix_type)
    hf = hf_model(model, matrix_type)
    logits, greedy, logprobs = hf_reference(hf)
    return {"name": name, "model": model, "path": path, "hf": hf, "logits": logits, "greedy": greedy, "lp": logprobs}


def save_checkpoint(hf: torch.nn.Module, gguf_path: Path, folder: Path) -> HFCheckpoint:
    """HF's model saved by transformers, with the GGUF's tokenizer as tokenizer.json."""
    hf.save_pretrained(folder)
    Tokenizer.from_gguf(GGUFFile(gguf_path)).backend.save(str(folder / "tokenizer.json"))
    return HFCheckpoint(folder)


def prompt_logits(source: "GGUFFile | HFCheckpoint") -> torch.Tensor:
    """tokenmill's float32 logits at every prompt position [T, V], the prompt in one chunk."""
    runner = ModelRunner(source, torch.float32, torch.device("cpu"), 4)
    runner.allocate_kv_cache(16)
    return runner.execute([StepChunk(PROMPT, 0, list(range(10)), want_all_logits=True)]).all_logits[0]


def test_config_reads_the_architecture(case: dict) -> None:
    model, c = case["model"], model_config_from_source(GGUFFile(case["path"]))
    assert (c.architecture, c.head_dim, c.num_kv_heads) == (model.arch, model.head_dim, model.kv_heads)
    assert c.rope_rows_permuted == (model.arch == "llama")  # llama.cpp permutes Q/K rows for llama files only
    assert c.attention_bias == (model.arch == "qwen2") and c.qk_norm == (model.arch in ("qwen3", "gemma3"))
    assert c.rope_scale == (8.0 if case["name"] in ("gemma3-4b", "gemma3-27b") else 1.0)
    assert (c.rope_freq_factors is not None) == (case["name"] in ("llama3", "qwen3-yarn"))
    assert c.rope_attention_factor == pytest.approx(1 + 0.1 * np.log(4.0) if case["name"] == "qwen3-yarn" else 1.0)
    if model.arch == "gemma3":
        assert c.local_layers == tuple((i + 1) % 6 != 0 for i in range(model.layers)) and c.local_rope_theta == 1e4
        scalar = model.hidden // model.heads if model.layers == 62 else model.head_dim
        assert c.softmax_scale == pytest.approx(scalar**-0.5, rel=1e-12)


def test_prompt_logits_match_hf(case: dict) -> None:
    ours, expected = prompt_logits(GGUFFile(case["path"])), case["logits"]
    assert torch.allclose(ours, expected, atol=1e-4, rtol=0), (ours - expected).abs().max()


def test_greedy_tokens_match_hf(case: dict) -> None:
    """Through the engine: the prompt in 16-token chunks (windows crossing chunk edges), then decodes, each with
    HF's log-probabilities (a random model's greedy tokens soon repeat whatever the rope does; these do not)."""
    llm = LLM(str(case["path"]), max_num_batched_tokens=16, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True, logprobs=5)
    out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == case["greedy"]
    for i, top in enumerate(out.logprobs):  # generated token i was predicted at position len(PROMPT) - 1 + i
        expected = case["lp"][len(PROMPT) - 1 + i]
        assert max(abs(lp.logprob - expected[token].item()) for token, lp in top.items()) < 1e-4, i


def test_checkpoint_saved_by_transformers_matches_hf(case: dict, tmp_path: Path) -> None:
    """The same model as an HF directory: config.json's rope parameters (llama3, linear, yarn) give the
    frequencies of the GGUF's metadata and rope_freqs tensor, and HF's logits."""
    checkpoint = save_checkpoint(case["hf"], case["path"], tmp_path)
    from_hf, from_gguf = model_config_from_source(checkpoint), model_config_from_source(GGUFFile(case["path"]))
    assert from_hf.rope_scale == from_gguf.rope_scale and from_hf.local_rope_theta == from_gguf.local_rope_theta
    assert from_hf.max_position == from_gguf.max_position
    assert from_hf.rope_attention_factor == pytest.approx(from_gguf.rope_attention_factor, rel=1e-12)
    if from_gguf.rope_freq_factors is not None:
        assert np.allclose(from_hf.rope_freq_factors, from_gguf.rope_freq_factors, rtol=1e-6)
    ours, expected = prompt_logits(checkpoint), case["logits"]
    assert torch.allclose(ours, expected, atol=1e-4, rtol=0), (ours - expected).abs().max()


@pytest.mark.parametrize(
    "name, legacy",
    [
        ("llama3", {"rope_theta": 5e5, "rope_scaling": {**LLAMA3_SCALING, "rope_type": "llama3"}}),
        ("llama3", {"rope_theta": 5e5, "rope_scaling": {**LLAMA3_SCALING, "rope_type": None, "type": "llama3"}}),
        ("gemma3-4b", {"rope_theta": 1e6, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
    ],
)
def test_older_config_json_rope_keys(name: str, legacy: dict, tmp_path: Path) -> None:
    """Configs from before transformers 5 (`rope_theta` + `rope_scaling`, whose type may be under "type"; Gemma's
    local base in `rope_local_base_freq`, 10,000 when absent) read as transformers 5's `rope_parameters`."""
    model = fresh(name)
    path = write_tiny_gguf(tmp_path / "model.gguf", model)
    current = model_config_from_source(save_checkpoint(hf_model(model, "F32"), path, tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    del config["rope_parameters"]
    scaling = {k: v for k, v in legacy["rope_scaling"].items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps({**config, **legacy, "rope_scaling": scaling}))
    assert model_config_from_source(HFCheckpoint(tmp_path)) == current
    assert current.rope_scale != 1.0 or current.rope_freq_factors is not None


@pytest.mark.parametrize("name", ["llama3", "gemma3-4b", "qwen3-yarn"])
def test_native_decoder_reads_the_scaled_rope_tables(name: str, tmp_path: Path) -> None:
    """Under int4 the native decoder computes generated tokens from the model's rope tables: with rope scaling (and
    Gemma's unscaled local tables beside the scaled global ones) its decode logits are the torch path's on the same
    4-bit weights, after a prompt long enough for the scaling to matter."""
    path = write_tiny_gguf(tmp_path / f"{name}.gguf", fresh(name))
    runner = ModelRunner(GGUFFile(path), torch.float32, torch.device("cpu"), 4, quantization="int4")
    runner.allocate_kv_cache(16)
    assert runner.decode_backend is not None
    table = list(range(12))
    runner.execute([StepChunk(PROMPT, 0, table, prompt_len=len(PROMPT))])
    step = [StepChunk([7], len(PROMPT), table, prompt_len=len(PROMPT))]
    native_logits = runner.execute(step).last_logits
    runner.decode_backend = None
    torch_logits = runner.execute(step).last_logits  # rewrites the same cache slots with the same values
    # the same kernels for the projections; attention and norms sum in other orders (tests/test_native.py)
    assert torch.allclose(native_logits, torch_logits, rtol=1e-3, atol=1e-3), (native_logits - torch_logits).abs().max()


# ---- rope frequencies at the real models' sizes ---------------------------------------------------------------------


def llama31_scaling(factor: float) -> dict:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


REAL_ROPE = {  # (head size, base, HF rope parameters) of the real models
    "Llama 3.1 8B": (128, 5e5, llama31_scaling(8.0)),
    "Llama 3.2 1B": (64, 5e5, llama31_scaling(32.0)),
    "Gemma 3 4B (global layers)": (256, 1e6, {"rope_type": "linear", "factor": 8.0}),
    "Qwen3 8B (YaRN, as its card enables it)": (
        128,
        1e6,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    ),
    # DeepSeek-style mscale terms, and a YaRN without truncated ramp ends
    "YaRN with mscale": (
        64,
        1e4,
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "truncate": False,
            "beta_fast": 24,
        },
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", sorted(REAL_ROPE))
def test_rope_frequencies_at_real_sizes_match_transformers(name: str) -> None:
    """tokenmill's frequencies from config.json's parameters, and from the rope_freqs tensor llama.cpp's converter
    writes for them, are transformers' to float32 rounding."""
    head_dim, base, params = REAL_ROPE[name]
    rope = {"rope_theta": base, **params}
    config = transformers.LlamaConfig(hidden_size=head_dim * 8, num_attention_heads=8, rope_parameters=rope)
    expected, attention = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    if params["rope_type"] == "linear":
        ours = [inverse_frequencies(head_dim, base, scale=params["factor"])]
    elif params["rope_type"] == "yarn":
        traits = rope_traits(config.to_dict(), "llama", head_dim, "config.json", UnsupportedModelError)
        ours = [inverse_frequencies(head_dim, base, freq_factors=traits["rope_freq_factors"])]
        assert traits["rope_attention_factor"] == pytest.approx(attention, rel=1e-12) and attention != 1.0
    else:
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        from_config = llama3_frequency_factors(head_dim, base, *(params[k] for k in keys))
        model = TinyModel(hidden=head_dim, heads=1, rope_theta=base, rope_scaling=params)
        ours = [inverse_frequencies(head_dim, base, freq_factors=f) for f in (from_config, llama3_rope_freqs(model))]
    assert not torch.allclose(inverse_frequencies(head_dim, base), expected)  # the scaling changes frequencies
    for inv_freq in ours:
        assert torch.allclose(inv_freq, expected, rtol=1e-6, atol=0), (inv_freq / expected - 1).abs().max()


# ---- what the decoder does not implement ----------------------------------------------------------------------------


def test_longrope_scaling_is_refused(tmp_path: Path) -> None:
    model = TinyModel(rope_scaling={"rope_type": "longrope"})
    path = write_tiny_gguf(tmp_path / "longrope.gguf", model)
    match = r"longrope.gguf: rope scaling 'longrope' \(llama.rope.scaling.type\)"
    with pytest.raises(UnsupportedModelError, match=match):
        model_config_from_source(GGUFFile(path))


def test_tensors_the_decoder_would_not_read_are_refused(tmp_path: Path) -> None:
    """A llama file with a bias on the attention's output (which llama.cpp's llama reads) is not computed without
    it: refused, naming the tensor, before any weight is read."""
    model = TinyModel()
    model.make_weights()
    model.weights["model.layers.0.self_attn.o_proj.bias"] = np.zeros(model.hidden, np.float32)
    path = write_tiny_gguf(tmp_path / "bias.gguf", model)
    with pytest.raises(UnsupportedModelError, match=r"bias.gguf: holds 1 tensors .* \(blk.0.attn_output.bias\)"):
        build_model(GGUFFile(path), torch.float32, torch.device("cpu"))


def test_logit_soft_capping_is_refused(tmp_path: Path) -> None:
    model = TinyModel(arch="gemma3", sliding_window=8, final_logit_softcapping=30.0)
    path = write_tiny_gguf(tmp_path / "softcap.gguf", model)
    with pytest.raises(UnsupportedModelError, match=r"softcap.gguf: gemma3.final_logit_softcapping \(logit soft"):
        model_config_from_source(GGUFFile(path))


@pytest.mark.parametrize("matrix_type", ["Q8_0", "Q4_0"])
def test_an_untied_table_of_the_heads_type_gives_its_own_rows(matrix_type: str, tmp_path: Path) -> None:
    """Under the quantized modes a tied table's rows are looked up from the head's blocks; an untied table of the
    head's type (every matrix of a Q8_0 file: Llama 3.1 8B's, Qwen 2.5 7B's) is another tensor, whose rows are its
    own (until 2026-12-03 they were the head's: every prompt embedded wrong)."""
    model = TinyModel(hidden=256, seed=8)
    path = write_tiny_gguf(tmp_path / "untied.gguf", model, matrix_type)
    dense, _ = build_model(GGUFFile(path), torch.float32, torch.device("cpu"))
    quantized, _ = build_model(GGUFFile(path), torch.float32, torch.device("cpu"), "auto")
    ids = torch.arange(model.vocab_size)
    assert torch.equal(quantized.embed(ids), dense.embed(ids))
