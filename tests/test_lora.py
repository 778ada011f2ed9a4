"""LoRA adapters (issue 40): PEFT adapters on a tiny random Llama give transformers' merged-adapter greedy tokens
(float32); llama.cpp's GGUF LoRA gives llama.cpp's tokens on the same files; a batch mixing four adapters and the
base model decodes each row as it decodes alone; the prefix cache never shares K/V across adapters; bad adapters
are refused with errors that name them."""

import dataclasses
import json
from pathlib import Path

import pytest

from tests.lora_cases import ADAPTERS, PROMPT, merged_greedy, write_adapter, write_tiny_llama
from tests.lora_gguf import gguf_digests, write_gguf_lora
from tokenmill import LLM, SamplingParams
from tokenmill.engine.lora_registry import LoRAExistsError, LoRANotFoundError
from tokenmill.loader.lora_file import LoRAError, read_lora
from tokenmill.sampling_params import SamplingParams as Params
from tokenmill.scheduler.block_manager import BlockManager
from tokenmill.scheduler.sequence import Sequence

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, bundled_path: Path) -> tuple[Path, dict[str, Path]]:
    """(the tiny model's directory, its four PEFT adapters by name)."""
    root = tmp_path_factory.mktemp("lora")
    base = write_tiny_llama(root, bundled_path)
    adapters = {
        name: write_adapter(base, root / name, seed, **cfg) for seed, (name, cfg) in enumerate(ADAPTERS.items())
    }
    return base, adapters


def tokens(llm: LLM, prompt: list[int], lora: str | None = None, params: SamplingParams = GREEDY) -> list[int]:
    out = llm.generate({"prompt_token_ids": prompt}, dataclasses.replace(params, lora_name=lora), use_tqdm=False)
    return out[0].outputs[0].token_ids


@pytest.mark.slow
def test_peft_adapters_give_transformers_merged_tokens(tiny) -> None:
    base, adapters = tiny
    llm = LLM(str(base), lora_modules={name: str(path) for name, path in adapters.items()})
    base_tokens = tokens(llm, PROMPT)
    assert base_tokens == merged_greedy(base, None, PROMPT, 12)
    for name, path in adapters.items():
        expected = merged_greedy(base, path, PROMPT, 12)
        assert expected != base_tokens, f"{name} changes nothing: a weak test"
        assert tokens(llm, PROMPT, name) == expected, name


@pytest.mark.slow
@pytest.mark.parametrize("quantization", [None, "auto"])
def test_a_batch_of_four_adapters_and_the_base_decodes_each_row_as_alone(tiny, quantization: str | None) -> None:
    """10 requests (5 prompts of 3 to 40 tokens, each under the base and an adapter, in a mixed order) in one
    batch, against each alone in an engine without prefix caching (the suite's batch-invariance rule: the same
    greedy tokens). Under `auto` the base rows take the native decoder and the adapters' rows the model's forward:
    the route is the row's own, never its neighbours'; and every product there is native (the projections', the
    adapters' low-rank ones), so each token's log-probability is the same bits too (an adapter row's moved by up to
    0.01 when torch's float32 GEMM and padded decode attention depended on the batch). Under None the base
    projections are torch's float32 GEMM, whose last bits follow the row count: tokens only."""
    base, adapters = tiny
    modules = {name: str(path) for name, path in adapters.items()}
    prompts = [PROMPT[:n] for n in (3, 17, 40, 9, 33)]
    names = [None, *adapters]
    jobs = [(p, names[(i + k) % len(names)]) for i, p in enumerate(prompts) for k in (0, 2)]
    together = LLM(str(base), quantization=quantization, lora_modules=modules)
    params = [dataclasses.replace(GREEDY, lora_name=name) for _, name in jobs]
    outs = together.generate([{"prompt_token_ids": p} for p, _ in jobs], params, use_tqdm=False)
    alone_engine = LLM(str(base), quantization=quantization, lora_modules=modules, enable_prefix_caching=False)
    for (prompt, name), out in zip(jobs, outs, strict=True):
        alone = alone_engine.generate({"prompt_token_ids": prompt}, dataclasses.replace(GREEDY, lora_name=name),
                                      use_tqdm=False)[0].outputs[0]  # fmt: skip
        assert out.outputs[0].token_ids == alone.token_ids, (len(prompt), name)
        if quantization == "auto":
            assert out.outputs[0].cumulative_logprob == alone.cumulative_logprob, (len(prompt), name)
    together.engine.check_integrity()


@pytest.mark.slow
def test_the_prefix_cache_is_keyed_by_adapter(tiny) -> None:
    base, adapters = tiny
    modules = {name: str(adapters[name]) for name in ("all8", "attn4")}
    cached = LLM(str(base), lora_modules=modules)
    plain = LLM(str(base), lora_modules=modules, enable_prefix_caching=False)
    for name in ("all8", None, "attn4", "all8"):  # the same 40-token prompt under each: 2 full blocks to share
        assert tokens(cached, PROMPT, name) == tokens(plain, PROMPT, name), name
    stats = cached.stats()
    assert stats["prefix_cache_hit_tokens"] == 32, stats  # only all8's second request hit (its own blocks)


def test_block_hashes_are_keyed_by_adapter() -> None:
    blocks = BlockManager(16, 4)
    first = Sequence(0, "a", list(range(9)), Params())
    first.lora_id = 1
    blocks.allocate_slots(first, 9)
    first.num_computed_tokens = 9
    blocks.commit_computed(first)
    for lora_id, hit in ((1, 2), (0, 0), (2, 0)):
        seq = Sequence(1, "b", list(range(9)), Params())
        seq.lora_id = lora_id
        assert len(blocks.lookup_prefix(seq)) == hit, lora_id
        assert (blocks.block_hashes(seq, 8) == blocks.block_hashes(first, 8)) == (lora_id == 1)


@pytest.mark.slow
def test_adapters_load_and_unload_at_run_time(tiny) -> None:
    base, adapters = tiny
    llm = LLM(str(base))
    with pytest.raises(LoRANotFoundError, match="no LoRA adapter named 'all8'"):
        tokens(llm, PROMPT, "all8")
    llm.load_lora("all8", str(adapters["all8"]))
    with pytest.raises(LoRAExistsError):
        llm.load_lora("all8", str(adapters["attn4"]))
    first = tokens(llm, PROMPT, "all8")
    llm.unload_lora("all8")
    with pytest.raises(LoRANotFoundError):
        tokens(llm, PROMPT, "all8")
    llm.load_lora("all8", str(adapters["attn4"]))  # the name again, other weights: no stale prefix-cache hit
    assert tokens(llm, PROMPT, "all8") == merged_greedy(base, adapters["attn4"], PROMPT, 12) != first
    assert llm.engine.runner.adapters.keys() == {2}  # the first one's weights are gone


def test_bad_adapters_are_refused_with_what_is_wrong(tmp_path: Path, bundled_path: Path) -> None:
    with pytest.raises(LoRAError, match="no such LoRA adapter"):
        read_lora(tmp_path / "missing")
    with pytest.raises(LoRAError, match="not a PEFT adapter directory"):
        read_lora(tmp_path)
    with pytest.raises(LoRAError, match="not a LoRA adapter"):
        read_lora(bundled_path)  # a model, not an adapter
    (tmp_path / "x.gguf").write_bytes(b"nonsense")
    with pytest.raises(LoRAError, match="not a GGUF file"):
        read_lora(tmp_path / "x.gguf")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "use_dora": True}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(LoRAError, match="DoRA"):
        read_lora(tmp_path)


@pytest.mark.slow
def test_an_adapter_of_another_model_is_refused(tiny, bundled_path: Path) -> None:
    base, adapters = tiny
    with pytest.raises(LoRAError, match="do not fit its weight"):
        LLM(str(bundled_path), lora_modules={"x": str(adapters["all8"])})  # SmolLM2-135M: hidden 576, not 64


# ---- llama.cpp's GGUF LoRA ------------------------------------------------------------------------------------------

LLAMACPP = Path(__file__).parent / "data" / "lora_llamacpp.json"  # made by tests/data/make_lora_llamacpp.py


@pytest.mark.slow
def test_a_gguf_lora_gives_llama_cpps_tokens(tiny, tmp_path: Path) -> None:
    """Two of the PEFT adapters as llama.cpp's GGUF LoRA (tests/lora_gguf.py writes the bytes llama.cpp's converter
    wrote for them: checked by digest) give the greedy tokens llama.cpp gave with them (tests/data/
    lora_llamacpp.json; its maker also checks tokenmill on the converter's own base GGUF). The GGUF LoRA on the
    safetensors model also gives the PEFT adapter's merged tokens: its Q/K rows are put back in HF's order."""
    base, adapters = tiny
    record = json.loads(LLAMACPP.read_text())
    prompt = record["prompt"]
    assert record["tokens"] == GREEDY.max_tokens and record["adapters"].keys() == {"all8", "qv8rs"}
    files = {}
    for name, want in record["adapters"].items():
        files[name] = write_gguf_lora(adapters[name], base, tmp_path / f"{name}.gguf")
        assert gguf_digests(files[name]) == want["tensors"], (
            f"{name}: not the converter's bytes (tests/lora_gguf.py, or the adapter changed: make lora-reference)"
        )
    llm = LLM(str(base), lora_modules={name: str(path) for name, path in files.items()})
    try:
        assert tokens(llm, prompt) == record["base_tokens"]
        for name, want in record["adapters"].items():
            assert tokens(llm, prompt, name) == want["llamacpp_tokens"], name
        assert tokens(llm, prompt, "all8") == merged_greedy(base, adapters["all8"], prompt, GREEDY.max_tokens)
    finally:
        llm.close()


def test_lora_modules_option_forms() -> None:
    from tokenmill.config.engine import EngineConfig
    from tokenmill.errors import InvalidParameterError

    assert EngineConfig(lora_modules=["a=/x", "b = /y"]).lora_modules == {"a": "/x", "b": "/y"}
    assert EngineConfig(lora_modules={"a": "/x"}).lora_modules == {"a": "/x"}
    for bad in (["a"], ["a=/x", "a=/y"], ["=/x"]):
        with pytest.raises(InvalidParameterError):
            EngineConfig(lora_modules=bad)


def test_a_step_description_carries_each_chunks_adapter_and_loads_reach_the_ranks() -> None:
    from tokenmill.executor import step_message
    from tokenmill.executor.step_message import Kind, Message
    from tokenmill.runner.model_runner import StepChunk

    chunks = [StepChunk([5, 6], 0, [3], lora_id=7), StepChunk([8], 4, [1], lora_id=0)]
    decoded = step_message.decode(step_message.encode(Message(Kind.STEP, chunks=chunks)))
    assert decoded.chunks == chunks
    load = step_message.decode(step_message.encode(Message(Kind.LOAD_LORA, 3, text="/tmp/ä dapter")))
    assert (load.kind, load.argument, load.text) == (Kind.LOAD_LORA, 3, "/tmp/ä dapter")


@pytest.mark.slow
def test_two_ranks_shard_the_adapters_as_their_base_weights(tiny) -> None:
    """Tensor parallelism over 2 ranks: Q/K/V and gate/up adapters cut by B's rows, o and down by A's columns;
    one adapter from the start, one loaded at run time (every rank reads its part); mixed in one batch."""
    base, adapters = tiny
    llm = LLM(str(base), tensor_parallel_size=2, lora_modules={"all8": str(adapters["all8"])})
    try:
        llm.load_lora("mlp16", str(adapters["mlp16"]))
        names = [None, "all8", "mlp16"]
        params = [dataclasses.replace(GREEDY, lora_name=n) for n in names]
        outs = llm.generate([{"prompt_token_ids": PROMPT}] * 3, params, use_tqdm=False)
        for name, out in zip(names, outs, strict=True):
            expected = merged_greedy(base, adapters[name] if name else None, PROMPT, 12)
            assert out.outputs[0].token_ids == expected, name
        llm.unload_lora("mlp16")
    finally:
        llm.close()
