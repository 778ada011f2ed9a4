"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): tiny random-weight models written as llama.cpp's
converter writes them (tests/gguf_builder.py: experts stacked into 3-D tensors) and saved by transformers (one
tensor per expert) give HF transformers' float32 logits and greedy tokens; the router's arithmetic; quantized
experts against a float reference of the same blocks; and the engine's features over a mixture."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType

from tests.gguf_builder import TinyModel, random_blocks, write_tiny_gguf
from tests.moe_cases import (
    CASES,
    GPT_OSS,
    GREEDY_TOKENS,
    LLAMACPP_CASES,
    LLAMACPP_VOCAB,
    PROMPT,
    hf_config,
    tensor_digests,
)
from tests.test_native import assert_decode_steps_match_the_torch_path
from tokenmill import LLM, SamplingParams
from tokenmill.layers.activation import ACTIVATIONS
from tokenmill.layers.moe import MixtureOfExperts, route
from tokenmill.layers.quantized_linear import NativeLinear, gguf_rows_from_float
from tokenmill.loader.gguf_file import GGUFFile, GGUFTensor
from tokenmill.loader.hf_checkpoint import HFCheckpoint
from tokenmill.model.config_from_source import model_config_from_source
from tokenmill.model.weights import WeightLoader
from tokenmill.runner.model_runner import ModelRunner, StepChunk
from tokenmill.tokenizer.gguf_tokenizer import Tokenizer


def hf_model(model: TinyModel) -> torch.nn.Module:
    """transformers' model of the architecture holding the builder's weights (every one, and no other)."""
    config = hf_config(model)
    config.architectures = [transformers.AutoModelForCausalLM._model_mapping[type(config)].__name__]
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = {name: torch.from_numpy(np.ascontiguousarray(w)) for name, w in model.weights.items()}
    # transformers 5 holds each layer's experts fused; its loader converts the Hub's per-expert names, which a
    # state dict bypasses, so the test fuses them as it does
    hf.load_state_dict(_fused_as_transformers(hf, state, model), strict=True)
    return hf


def _fused_as_transformers(hf: torch.nn.Module, state: dict, model: TinyModel) -> dict:
    expected = hf.state_dict()
    if all(name in expected for name in state):
        return state
    fused = {}
    block = "block_sparse_moe" if model.mixtral else "mlp"
    gate, up, down = ("w1", "w3", "w2") if model.mixtral else ("gate_proj", "up_proj", "down_proj")
    for name, value in state.items():
        if ".experts." not in name:
            fused[name] = value
    for i in range(model.layers):
        if not model.is_moe(i):
            continue
        p = f"model.layers.{i}.{block}.experts."
        stack = lambda kind, p=p: torch.stack([state[f"{p}{e}.{kind}.weight"] for e in range(model.experts)])  # noqa: E731
        q = next(n for n in expected if n.startswith(f"model.layers.{i}.") and n.endswith("experts.gate_up_proj"))
        fused[q] = torch.cat([stack(gate), stack(up)], dim=1)
        fused[q.replace("gate_up_proj", "down_proj")] = stack(down)
        router = f"model.layers.{i}.{block}.gate.weight"
        if router not in expected:
            fused[next(n for n in expected if n.startswith(f"model.layers.{i}.") and n.endswith("gate.weight"))] = (
                fused.pop(router)
            )
    missing = set(expected) - set(fused)
    if model.tie_embeddings:
        missing.discard("lm_head.weight")
    assert not missing, sorted(missing)[:4]
    return fused


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory) -> dict:
    """A case's GGUF file, HF's model of it, HF's logits, greedy continuation and log-probabilities."""
    name = request.param
    model = replace(CASES[name], weights={})
    path = write_tiny_gguf(tmp_path_factory.mktemp(name) / f"{name}.gguf", model)
    hf = hf_model(model)
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0]
        out = hf.generate(
            torch.tensor([PROMPT]), max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS, do_sample=False
        )
        logprobs = torch.log_softmax(hf(out).logits[0], dim=-1)
    greedy = out[0, len(PROMPT) :].tolist()
    return {"name": name, "model": model, "path": path, "hf": hf, "logits": logits, "greedy": greedy, "lp": logprobs}


def prompt_logits(source, quantization: str | None = None) -> torch.Tensor:
    runner = ModelRunner(source, torch.float32, torch.device("cpu"), 4, quantization=quantization)
    runner.allocate_kv_cache(16)
    return runner.execute([StepChunk(PROMPT, 0, list(range(10)), want_all_logits=True)]).all_logits[0]


def test_config_reads_the_mixture(case: dict) -> None:
    model, c = case["model"], model_config_from_source(GGUFFile(case["path"]))
    assert (c.num_experts, c.experts_per_token) == (model.experts, model.experts_used)
    assert c.expert_intermediate_size == model.expert_intermediate
    assert c.moe_layers == tuple(model.is_moe(i) for i in range(model.layers))
    assert c.expert_weights_normalized == (case["name"] in ("qwen3moe", "mixtral"))
    assert c.shared_expert_intermediate_size == model.shared_intermediate
    assert c.qk_norm_whole == (case["name"] == "olmoe")


def test_prompt_logits_match_hf(case: dict) -> None:
    ours, expected = prompt_logits(GGUFFile(case["path"])), case["logits"]
    assert torch.allclose(ours, expected, atol=1e-4, rtol=0), (ours - expected).abs().max()


def test_greedy_tokens_match_hf(case: dict) -> None:
    """Through the engine: the prompt in 16-token chunks, then decodes, each with HF's log-probabilities."""
    llm = LLM(str(case["path"]), max_num_batched_tokens=16, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True, logprobs=5)
    out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == case["greedy"]
    for i, top in enumerate(out.logprobs):
        expected = case["lp"][len(PROMPT) - 1 + i]
        assert max(abs(lp.logprob - expected[token].item()) for token, lp in top.items()) < 1e-4, i


def test_checkpoint_saved_by_transformers_matches_hf(case: dict, tmp_path: Path) -> None:
    """The same model as transformers saves it (one tensor per expert, the Hub's layout): the config of the GGUF
    and HF's logits."""
    case["hf"].save_pretrained(tmp_path)
    Tokenizer.from_gguf(GGUFFile(case["path"])).backend.save(str(tmp_path / "tokenizer.json"))
    checkpoint = HFCheckpoint(tmp_path)
    assert (
        model_config_from_source(checkpoint).moe_layers == model_config_from_source(GGUFFile(case["path"])).moe_layers
    )
    ours, expected = prompt_logits(checkpoint), case["logits"]
    assert torch.allclose(ours, expected, atol=1e-4, rtol=0), (ours - expected).abs().max()


def test_dense_layers_between_mixtures_from_a_checkpoint(tmp_path: Path) -> None:
    """Qwen-MoE's `mlp_only_layers` and `decoder_sparse_step` (dense MLPs in some layers; GGUF's qwen2moe and
    qwen3moe have no tensors for them): from transformers' checkpoint, HF's logits."""
    model = replace(CASES["qwen3moe"], layers=4, dense_layers=(1, 2), weights={})
    model.make_weights()
    hf = hf_model(model)
    hf.save_pretrained(tmp_path)
    path = write_tiny_gguf(tmp_path / "tokenizer-source.gguf", replace(CASES["mixtral"], weights={}))
    Tokenizer.from_gguf(GGUFFile(path)).backend.save(str(tmp_path / "tokenizer.json"))
    path.unlink()
    checkpoint = HFCheckpoint(tmp_path)
    assert model_config_from_source(checkpoint).moe_layers == (True, False, False, True)
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    ours = prompt_logits(checkpoint)
    assert torch.allclose(ours, expected, atol=1e-4, rtol=0), (ours - expected).abs().max()


LLAMACPP = Path(__file__).parent / "data" / "moe_llamacpp.json"  # made by tests/data/make_moe_llamacpp.py


@pytest.mark.parametrize("name", LLAMACPP_CASES)
def test_the_converters_file_gives_llama_cpps_greedy_tokens(name: str, tmp_path: Path) -> None:
    """With SmolLM2's 49,152-token vocabulary (which llama.cpp's converter needs): tests/gguf_builder.py writes the
    file llama.cpp's own convert_hf_to_gguf.py writes from the same HF directory (every tensor's name, type, shape
    and bytes), and tokenmill's greedy tokens on it are llama.cpp's, as recorded by make_moe_llamacpp.py."""
    recorded = json.loads(LLAMACPP.read_text())[name]
    path = write_tiny_gguf(tmp_path / f"{name}.gguf", replace(CASES[name], vocab_size=LLAMACPP_VOCAB, weights={}))
    assert tensor_digests(path) == recorded["tensors"]
    llm = LLM(str(path), max_num_batched_tokens=16, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    assert (
        llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0].token_ids == recorded["greedy"]
    )


# ---- the router and the experts' products ---------------------------------------------------------------------------


def test_route_softmax_top_k() -> None:
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.0, 3.0, 3.0, 1.0]])
    weights, ids = route(logits, 2, normalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[0, 2], [1, 2]]
    assert torch.allclose(weights, probs.gather(1, ids))
    normalized, _ = route(logits, 2, normalize=True, scale=2.5)
    assert torch.allclose(normalized.sum(-1), torch.full((2,), 2.5))


def test_a_tokens_result_does_not_depend_on_its_step() -> None:
    """Tokens are grouped by expert for the products: with the native products (each row computed on its own) a
    token's output is the same bits alone or among others, its experts shared with them or not; and it is the
    router-weighted sum of its experts' MLPs."""
    torch.manual_seed(0)
    hidden, width, experts = 64, 32, 6

    def native(weight: torch.Tensor) -> NativeLinear:  # Q8_0 blocks of a float weight [out, in]
        return NativeLinear(
            [(gguf_rows_from_float(weight, GGMLQuantizationType.Q8_0).numpy(), GGMLQuantizationType.Q8_0)],
            weight.shape[1],
        )

    silu_and_mul = ACTIVATIONS["silu"]
    moe = MixtureOfExperts(hidden, experts, 2, True, silu_and_mul)
    pairs = [
        (native(torch.randn(2 * width, hidden) * 0.2), native(torch.randn(hidden, width) * 0.2)) for _ in range(experts)
    ]
    moe.load(torch.randn(experts, hidden), pairs)
    x = torch.randn(37, hidden)
    together = moe(x)
    alone = torch.cat([moe(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(together, alone)
    weights, ids = route(moe.router_logits(x), 2, True)
    reference = torch.zeros_like(x)
    for t in range(len(x)):
        for w, e in zip(weights[t], ids[t], strict=True):
            gate_up, down = pairs[e]
            reference[t] += w * down(silu_and_mul(gate_up(x[t : t + 1])))[0]
    assert torch.allclose(together, reference, atol=1e-5)


class _ExpertFile:
    """A model source holding only 3-D expert tensors (what WeightLoader reads)."""

    def __init__(self, tensors: dict[str, GGUFTensor]):
        self.tensors, self.path = tensors, Path("experts.gguf")

    def tensor(self, name: str) -> GGUFTensor:
        return self.tensors[name]


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"])
def test_quantized_experts_match_their_float_blocks(type_name: str) -> None:
    """Experts stored as random blocks of a GGUF type run through the native products (`auto`: each expert its own
    projection over the file's blocks) and give what the same blocks dequantized give in float32, to the int8
    activations' error; the routing is the float model's. `int4` keeps the 4-bit types (Q4_0, Q4_K, MXFP4) as
    well, and re-codes the others to Q4_1."""
    rng = np.random.default_rng(3)
    experts, width, hidden = 4, 256, 256
    qtype = GGMLQuantizationType[type_name]
    shapes = {"gate": (width, hidden), "up": (width, hidden), "down": (hidden, width)}
    blocks = {
        n: np.stack([random_blocks(type_name, r, c, rng) for _ in range(experts)]) for n, (r, c) in shapes.items()
    }
    source = _ExpertFile({n: GGUFTensor(n, qtype, (experts, *shapes[n]), b) for n, b in blocks.items()})
    router, x = torch.randn(experts, hidden), torch.randn(24, hidden)
    outputs = []
    for mode in (None, "auto"):
        loader = WeightLoader(source, mode, torch.float32)
        moe = MixtureOfExperts(hidden, experts, 2, True, ACTIVATIONS["silu"])
        moe.load(router, list(zip(loader.experts(["gate", "up"]), loader.experts(["down"]), strict=True)))
        outputs.append(moe(x))
    exact, native = outputs
    assert all(isinstance(m, NativeLinear) and m.part_types == [qtype] for m in moe.gate_up)  # not re-coded
    assert (native - exact).abs().max() < 0.02 * exact.abs().max(), (native - exact).abs().max() / exact.abs().max()
    int4 = WeightLoader(source, "int4", torch.float32).experts(["down"])
    kept = qtype if type_name in ("Q4_0", "Q4_K", "MXFP4") else GGMLQuantizationType.Q4_1
    assert all(m.part_types == [kept] for m in int4)


# every architecture's mixture in the native decoder; Qwen2-MoE's shared expert 64 wide (int4's blocks of 32)
NATIVE_CASES = dict(CASES, qwen2moe=replace(CASES["qwen2moe"], shared_intermediate=64), gpt_oss=GPT_OSS)


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "int8"])
@pytest.mark.parametrize("name", sorted(NATIVE_CASES))
def test_the_native_decoder_computes_each_mixture(name: str, kv_cache_dtype: str, tmp_path: Path) -> None:
    """Generated tokens of every mixture run through the native decoder (router, the chosen experts' products in
    one job each for gate/up and down, gpt-oss's top-k-then-softmax, biases, clamped SwiGLU and sinks; Qwen2-MoE's
    shared expert; OLMoE's whole-projection QK-norm) and give the torch path's logits, each sequence's the same
    bits alone as beside the others (tests/test_native.py's check)."""
    model = replace(NATIVE_CASES[name], weights={})
    path = write_tiny_gguf(tmp_path / f"{name}.gguf", model, expert_type="MXFP4" if name == "gpt_oss" else None)
    runner = ModelRunner(
        GGUFFile(path), torch.float32, torch.device("cpu"), 4, quantization="int4", kv_cache_dtype=kv_cache_dtype
    )
    runner.allocate_kv_cache(64)
    assert runner.decode_backend is not None and any(m is not None for m in runner.decode_backend.mixtures)
    assert_decode_steps_match_the_torch_path(runner, runner.config.vocab_size)


@pytest.mark.slow
def test_two_ranks_give_one_ranks_tokens(tmp_path: Path) -> None:
    """Tensor parallelism over gloo: each rank holds a slice of every expert's width (64 = 2 ranks x 32-weight
    blocks), the router whole; in float32 the greedy tokens are one rank's."""
    path = write_tiny_gguf(tmp_path / "moe.gguf", replace(CASES["qwen3moe"], expert_intermediate=64, weights={}))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = {"prompt_token_ids": PROMPT}
    one = LLM(str(path)).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    two = LLM(str(path), tensor_parallel_size=2)
    try:
        assert two.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == one
    finally:
        two.close()
