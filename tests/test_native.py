"""tokenmill's native kernels: 4-bit and 8-bit products, and the whole decode step against the torch path."""

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from tests.gguf_builder import TinyLlama, random_blocks, write_tiny_llama
from tests.test_hf_checkpoints import tokenizer_files, write_tiny  # noqa: F401 (tokenizer_files: a fixture)
from tests.test_quantized import q4_1_grid_weight
from tests.vector_paths import OTHER_PATHS, rerun_on_path
from tokenmill import native
from tokenmill.config import EngineConfig
from tokenmill.errors import InvalidParameterError
from tokenmill.layers import kv_quant
from tokenmill.layers.native_decode import NativeLlamaDecoder
from tokenmill.layers.quantized_linear import NativeLinear
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.loader.hf_checkpoint import HFCheckpoint
from tokenmill.native.threads import follow_contention, set_threads, usable_cpus
from tokenmill.runner.model_runner import ModelRunner, StepChunk

Q4_1, Q8_0 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
lib = native.load()  # built by `make install` (a C compiler with OpenMP is a test requirement)


def test_native_kernels_are_built() -> None:
    assert lib is not None, "tokenmill's native kernels did not build: see the log of `python -m tokenmill.native`"
    expected = os.environ.get("TOKENMILL_TEST_VECTOR_PATH")  # set by the test below for its builds
    if expected:
        assert lib.tm_vector_path().decode() == expected


@pytest.mark.slow
@pytest.mark.parametrize(("march", "path"), OTHER_PATHS)
def test_the_avx2_and_portable_paths_pass_these_tests(march: str, path: str) -> None:
    """This machine builds the AVX-512 path; older CPUs get the AVX2 or the plain C one: build those and run the
    kernel tests of this file against them."""
    out = rerun_on_path(__file__, march, path, "built or q4_ or q8_ or decode_step or native_decoder")
    assert "25 passed" in out, out[-500:]


def two_pass_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization, in torch: x [m, k] -> (the values it computes with [m, k], the
    bound on their error per block [m, k/32]): per block of 32, s = max|x| / 127, hi = round(x / s),
    lo = round((x / s - hi) * 254), x ~ s * (hi + lo / 254)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    v = blocks * torch.where(amax > 0, 127.0 / amax, 0.0)
    hi = v.round().clamp(-127, 127)
    lo = ((v - hi) * 254).round().clamp(-127, 127)
    values = (amax / 127) * (hi + lo / 254)
    return values.reshape(x.shape), amax.squeeze(-1) / (127 * 254 * 2)


def assert_two_pass_int8_product(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """out equals the float64 product of w with x's quantized values (up to float32 rounding), and is within the
    quantization's error bound of the exact product."""
    values, error = two_pass_int8(x)
    assert torch.allclose(out.double(), F.linear(values.double(), w.double()), rtol=1e-5, atol=1e-5)
    # |sum w (x - values)| <= sum over blocks of (max error in the block) * (sum |w| over the block)
    bound = error.double() @ w.double().abs().reshape(w.shape[0], -1, 32).sum(dim=-1).T
    assert ((out.double() - F.linear(x.double(), w.double())).abs() <= bound + 1e-5).all()


@pytest.mark.parametrize(("rows", "out_features"), [(1, 96), (3, 96), (4, 96), (5, 96), (9, 96), (2, 40)])
def test_q4_matmul_computes_with_two_pass_int8_activations(rows: int, out_features: int) -> None:
    """Equal to a float64 product of the weights with the quantized activations (up to float32 rounding), and
    within the quantization's error bound of the float32 product. 40 rows: a padded last group of 16."""
    w = q4_1_grid_weight(out_features, 160, seed=rows)
    x = torch.randn(rows, 160) * torch.linspace(0.1, 4.0, 160)  # blocks of different ranges
    out = NativeLinear.from_float(w, Q4_1, lib=lib)(x)
    assert out.shape == (rows, out_features)
    assert_two_pass_int8_product(out, x, w)
    assert not torch.allclose(out, F.linear(x, w), rtol=0, atol=1e-7)  # the activations were quantized


@pytest.mark.parametrize("bits", [4, 8])
def test_q4_and_q8_products_give_each_row_the_same_bits_at_any_row_count(bits: int) -> None:
    """Batch invariance of the products: each row's output is the same bits alone as among 2 to 17 rows (a pass of
    the kernel takes up to 8 rows on AVX-512, 4 on AVX2 and in plain C; with 1-2 rows it sums each pass in two
    integer chains, with more in one)."""
    w = q4_1_grid_weight(48, 160, seed=7)
    layer = NativeLinear.from_float(w, Q4_1 if bits == 4 else Q8_0, lib=lib)
    x = torch.randn(17, 160, generator=torch.Generator().manual_seed(bits)) * torch.linspace(0.1, 4.0, 160)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(17)])
    for m in range(2, 18):
        assert torch.equal(layer(x[:m]), alone[:m]), m
        assert torch.equal(layer(x[17 - m :]), alone[17 - m :]), m


def test_q4_linear_keeps_half_float_scales_and_minimums_exactly() -> None:
    """Q4_1 grid weights (bfloat16 d and m, representable in half floats) come back exactly."""
    w = q4_1_grid_weight(32, 64, seed=3)
    layer = NativeLinear.from_float(w, Q4_1, lib=lib)
    eye = torch.eye(64)  # each unit vector reads one column of the weight and quantizes without error
    assert torch.allclose(layer(eye).T, w, rtol=1e-6, atol=1e-7)  # float32 rounding of the scale products only


@pytest.mark.parametrize(("rows", "out_features"), [(1, 64), (2, 64), (5, 64), (3, 40)])
def test_q8_head_computes_with_two_pass_int8_activations(rows: int, out_features: int) -> None:
    """Q8_0 weights (codes -127..127, half-float scales) are kept exactly: the product equals the float64 one
    with the quantized activations, and is within the quantization's bound of the float32 product."""
    g = torch.Generator().manual_seed(rows)
    codes = torch.randint(-127, 128, (out_features, 4, 32), generator=g).float()
    codes[..., 0] = 127  # Q8_0 blocks reach +-127 by construction
    codes[..., 1] = -127
    d = (torch.rand(out_features, 4, 1, generator=g) * 0.02).half().float()
    w = (codes * d).reshape(out_features, 128)
    x = torch.randn(rows, 128, generator=g) * torch.linspace(0.1, 4.0, 128)
    out = NativeLinear.from_float(w, Q8_0, lib=lib)(x)
    assert out.shape == (rows, out_features)
    assert_two_pass_int8_product(out, x, w)


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16", "bfloat16", "int8"])
def test_native_decode_step_matches_the_torch_path(tmp_path: Path, kv_cache_dtype: str) -> None:
    """Also with 16-bit and int8 caches, which the native attention reads and the torch path gathers."""
    model = TinyLlama(seed=11, tie_embeddings=True)
    path = write_tiny_llama(tmp_path / "tiny.gguf", model)
    runner = ModelRunner(
        GGUFFile(path), torch.float32, torch.device("cpu"), 4, quantization="int4", kv_cache_dtype=kv_cache_dtype
    )
    runner.allocate_kv_cache(64)
    assert runner.decode_backend is not None
    assert runner.kv_caches[0][0].dtype == getattr(torch, kv_cache_dtype)
    assert_decode_steps_match_the_torch_path(runner, model.vocab_size)


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "int8"])
def test_decode_step_attends_a_long_context_in_pieces_as_the_torch_path(tmp_path: Path, kv_cache_dtype: str) -> None:
    """A context of more than 512 keys is attended in pieces of 512, each a job of the team, their partial softmaxes
    combined after (flash-decoding): contexts of 1,300 keys (three pieces) and 513 (two, the second of one key)
    beside one of 6 decode as the torch path computes them, and each sequence's logits are the same bits alone as
    beside the others (a row's pieces depend on its own context only)."""
    model = TinyLlama(seed=11, tie_embeddings=True, context=2048)
    path = write_tiny_llama(tmp_path / "tiny.gguf", model)
    runner = ModelRunner(
        GGUFFile(path), torch.float32, torch.device("cpu"), 4, quantization="int4", kv_cache_dtype=kv_cache_dtype
    )
    runner.allocate_kv_cache(512)
    assert runner.decode_backend is not None
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, model.vocab_size, size=n).tolist() for n in (1299, 512, 5)]
    tables = [list(range(0, 325)), list(range(330, 459)), [470, 471]]
    runner.execute([StepChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    step = [StepChunk([int(rng.integers(0, 96))], len(p), t) for p, t in zip(prompts, tables, strict=True)]
    native_logits = runner.execute(step).last_logits
    decoder, runner.decode_backend = runner.decode_backend, None
    torch_logits = runner.execute(step).last_logits
    runner.decode_backend = decoder
    tolerance = {torch.float32: 1e-3, torch.int8: 3e-2}[runner.kv_dtype]
    assert torch.allclose(native_logits, torch_logits, rtol=tolerance, atol=tolerance), (
        (native_logits - torch_logits).abs().max()
    )
    for i, chunk in enumerate(step):
        assert torch.equal(runner.execute([chunk]).last_logits[0], native_logits[i])


def test_a_16_bit_kv_cache_takes_half_the_bytes(tmp_path: Path) -> None:
    """The pool's bytes (its tensors' storage) per dtype: float16 and bfloat16 half of float32's, int8 a quarter
    plus its scales (4 bytes a head of 32 values here: 36/128), `auto` float16 under the native decoder and the
    model's float32 without it; an unknown dtype is refused by name."""
    model = TinyLlama(seed=11, tie_embeddings=True)
    path = write_tiny_llama(tmp_path / "tiny.gguf", model)
    pools = {}
    for quantization, kv_cache_dtype in [("int4", "float32"), ("int4", "float16"), ("int4", "bfloat16"),
                                         ("int4", "int8"), (None, "int8"), ("int4", "auto"),
                                         (None, "auto")]:  # fmt: skip
        runner = ModelRunner(
            GGUFFile(path), torch.float32, torch.device("cpu"), 4, quantization, kv_cache_dtype=kv_cache_dtype
        )
        runner.allocate_kv_cache(64)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for kv in runner.kv_caches for t in kv}
        assert sum(storages.values()) == 64 * runner.kv_bytes_per_block()
        c = runner.config  # the explorer's formula (server/app.py's /explorer/info)
        per_head = c.head_dim * runner.kv_dtype.itemsize + runner.kv_scale_bytes
        assert runner.kv_bytes_per_block() == 2 * c.num_layers * 4 * c.num_kv_heads * per_head
        pools[quantization, kv_cache_dtype] = (runner.kv_dtype, sum(storages.values()))
    full = pools["int4", "float32"][1]
    assert pools["int4", "float16"] == (torch.float16, full // 2)
    assert pools["int4", "bfloat16"] == (torch.bfloat16, full // 2)
    assert pools["int4", "auto"] == (torch.float16, full // 2)
    assert pools[None, "auto"] == (torch.float32, full)
    head = model.hidden // model.heads
    assert pools["int4", "int8"] == pools[None, "int8"] == (torch.int8, full * (head + 4) // (4 * head))
    with pytest.raises(InvalidParameterError, match="kv_cache_dtype must be one of auto, float32, float16") as e:
        EngineConfig(kv_cache_dtype="fp8")
    assert e.value.param == "kv_cache_dtype"


def test_loading_the_kernels_leaves_the_processs_floats_alone() -> None:
    """The library is compiled with -ffast-math but not linked with it: gcc's crtfastmath.o would turn on
    flush-to-zero for the whole process, and Python's own floats (a request's repetition_penalty of 5e-324)
    would read as 0.0."""
    assert lib is not None
    tiny = float("5e-324")
    assert tiny != 0.0 and tiny * 2 > 0 and torch.tensor([1e-40]).item() != 0.0


def test_the_pool_runs_its_jobs_alone_while_a_helper_is_off_the_cpu() -> None:
    """A helper whose pieces take 30 ms (as one that another process's slice keeps off its core): the caller,
    waiting for it past the stall bound, counts one stall and runs every piece of the later jobs itself, without
    waiting; then the pool stays solo a while, and torch's operations follow it onto one thread."""
    caller_pieces = np.zeros(4, dtype=np.int64)
    try:
        set_threads(2, lib)
        stalls = lib.tm_pool_stalls()
        lib.tm_pool_probe(4, 16, 100, 30_000, caller_pieces.ctypes.data)  # the caller's pieces 0.1 ms each
        assert caller_pieces[0] < 16  # the helper took some of the first job
        assert caller_pieces[1:].tolist() == [16] * 3
        assert lib.tm_pool_stalls() == stalls + 1
        assert lib.tm_pool_solo() == 1
        follow_contention(lib)
        assert torch.get_num_threads() == 1
    finally:
        set_threads(usable_cpus(), lib)


def test_the_pool_tries_its_team_again_within_a_body_once_the_while_alone_is_over() -> None:
    """One body of 400 jobs (a decode step is one body): after the first stall the caller runs the next jobs alone
    (about 0.1 ms each), and once its while alone (20 ms) is over it publishes jobs to the team again in the same
    body (before, the rest of the body ran alone: at 8B a whole step); the helper, still slow, stalls it again,
    each time after a longer while alone (doubled).

    Counted from the first job the helper takes a piece of, whichever that is: on a busy machine the helper may
    wake too late for the first job (the test failed so, 2 runs in 30 under load, when job 0 had to be shared). A
    job is 64 pieces, so the caller's own share of it (6 ms) leaves the helper time to join; alone, a job is one
    piece of the caller's (0.1 ms), so a while alone of 20 ms holds about 130 of them, far from the 20 asked."""
    jobs, pieces = 400, 64
    caller_pieces = np.zeros(jobs, dtype=np.int64)
    try:
        set_threads(2, lib)
        # an earlier while alone (a test's before, up to 2 s) is over and long past (200 ms: SOLO_AGAIN_NS), so
        # this body's first one is the shortest
        deadline = time.monotonic() + 5
        while lib.tm_pool_solo() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        stalls = lib.tm_pool_stalls()
        lib.tm_pool_probe(jobs, pieces, 100, 30_000, caller_pieces.ctypes.data)
        shared = [job for job, ran in enumerate(caller_pieces.tolist()) if ran < pieces]  # the helper had a piece
        assert len(shared) >= 2 and shared[1] - shared[0] > 20, shared  # alone for a while, then the team again
        if len(shared) > 2:  # the second while alone is the longer one
            assert shared[2] - shared[1] > shared[1] - shared[0], shared
        assert lib.tm_pool_stalls() == stalls + len(shared)  # each piece the helper held was a stall
    finally:
        set_threads(usable_cpus(), lib)


@pytest.mark.parametrize("kv_cache_dtype", [torch.float16, torch.bfloat16])
def test_decode_step_kv_elements_round_as_torch_does(kv_cache_dtype: torch.dtype) -> None:
    """The native decoder's K/V writes give torch's bits (round to nearest even): a prompt token's K/V (written by
    the torch path) and a generated one's (native) are the same numbers. Ties, subnormals, the largest half
    (65504) and what rounds past it, zeros and random values over a wide range; 1,003 values: the vector path's
    blocks and the scalar tail."""
    g = torch.Generator().manual_seed(0)
    values = torch.randn(1003, generator=g) * torch.logspace(-9, 6, 1003)
    edges = [0.0, -0.0, 65504.0, 65519.99, 65520.0, -70000.0, 1 + 2**-11, 1 + 3 * 2**-11, 2**-25, 3 * 2**-25, 2**-24]
    edges += [2**-14 - 2**-25, 1 + 2**-8, 1 + 3 * 2**-8, 3.0e38, -1.0e-40]
    values[: len(edges)] = torch.tensor(edges)
    out = torch.empty(values.shape, dtype=kv_cache_dtype)
    code = {torch.float16: 1, torch.bfloat16: 2}[kv_cache_dtype]
    assert lib.tm_kv_store(out.data_ptr(), values.data_ptr(), values.numel(), code) == 0
    assert torch.equal(out.view(torch.int16), values.to(kv_cache_dtype).view(torch.int16))


def test_decode_step_int8_kv_rows_are_torchs_bits() -> None:
    """An int8 head written by the native decoder (values over max |x| / 127, rounded to nearest even, then the
    float32 scale) is layers/kv_quant.py's encoding of it, byte for byte: ties at .5, values at the scale's edge, a
    head of zeros; heads of 64 and 128 values, and the scalar path's 40."""
    g = torch.Generator().manual_seed(0)
    for dim in (40, 64, 128):
        heads = torch.randn(6, dim, generator=g) * torch.logspace(-6, 4, 6).unsqueeze(1)
        heads[1] = 0.0
        heads[2, :4] = torch.tensor([127.0, 0.5, -1.5, 2.5])  # scale 1: ties round to even
        for head in heads:
            out = torch.empty(dim + 4, dtype=torch.int8)
            assert lib.tm_kv_store(out.data_ptr(), head.contiguous().data_ptr(), dim, 3) == 0
            expected = kv_quant.encode(head.unsqueeze(0))[0]
            assert torch.equal(out, expected), (dim, head[:4])
            back = kv_quant.decode(out.unsqueeze(0), torch.float32)[0]
            assert (back - head).abs().max() <= head.abs().max() / 254 * 1.0001  # half a step of the scale


def assert_decode_steps_match_the_torch_path(
    runner: ModelRunner, vocab_size: int
) -> tuple[torch.Tensor, list[StepChunk]]:
    """Three prompts prefilled, then one decode step through the native decoder and again through the torch path:
    close logits, and each sequence's the same bits alone as beside the others. Returns the native logits and the
    step."""
    rng = np.random.default_rng(0)
    # contexts of 10, 38 and 6 tokens: the native attention takes keys 16 at a time, and a partial group
    tables = [[3, 9, 12, 20, 30, 31], list(range(40, 52)), [56, 57, 58, 59, 60, 61]]
    prompts = [rng.integers(0, vocab_size, size=n).tolist() for n in (9, 37, 5)]
    runner.execute([StepChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    step = [StepChunk([int(rng.integers(0, 96))], len(p), t) for p, t in zip(prompts, tables, strict=True)]
    native_logits = runner.execute(step).last_logits
    decoder, runner.decode_backend = runner.decode_backend, None
    torch_logits = runner.execute(step).last_logits  # rewrites the same cache slots with the same values
    runner.decode_backend = decoder
    # the same kernels for the projections; attention and norms sum in other orders, and a last-bit difference
    # can move an activation across a rounding boundary of its int8 quantization (one step: 1/64,516 of the block)
    # or the step's own K/V across one of a 16-bit cache (a float16 step is 2^-11 of the value, bfloat16's 2^-8)
    tolerance = {torch.float32: 1e-3, torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.int8: 3e-2}[runner.kv_dtype]
    assert torch.allclose(native_logits, torch_logits, rtol=tolerance, atol=tolerance)
    # batch invariance: each sequence's logits are the same bits alone as beside the others (and in any order)
    for i, chunk in enumerate(step):
        assert torch.equal(runner.execute([chunk]).last_logits[0], native_logits[i])
    assert torch.equal(runner.execute(step[::-1]).last_logits, native_logits.flip(0))
    return native_logits, step


def test_the_native_decoder_adds_qwen2s_qkv_biases(tmp_path: Path, tokenizer_files: Path) -> None:  # noqa: F811
    """Qwen2 (Q/K/V biases) decodes natively, as its torch path computes; without the biases it would not."""
    folder = write_tiny("qwen2", tmp_path, tokenizer_files)
    runner = ModelRunner(HFCheckpoint(folder), torch.float32, torch.device("cpu"), 4, quantization="int4")
    assert runner.model.layers[0].self_attn.qkv_bias is not None
    runner.allocate_kv_cache(64)
    assert runner.decode_backend is not None
    with_biases, step = assert_decode_steps_match_the_torch_path(runner, runner.config.vocab_size)
    for layer in runner.decode_backend.table:
        layer.qkv_bias = None
    assert not torch.allclose(runner.execute(step).last_logits, with_biases, rtol=1e-3, atol=1e-3)


def test_the_native_decoder_takes_weights_of_several_types_and_parts(tmp_path: Path) -> None:
    """Projections made of GGUF blocks of mixed types (a fused QKV with Q/K in Q4_K and V in Q6_K, gate + up in
    Q4_0 and Q5_1, O in Q5_K, down in Q8_0): the native decoder computes what the torch path does with them."""
    model = TinyLlama(seed=3, hidden=256, intermediate=512, heads=4, kv_heads=2, tie_embeddings=True)
    path = write_tiny_llama(tmp_path / "tiny.gguf", model)
    runner = ModelRunner(GGUFFile(path), torch.float32, torch.device("cpu"), 4, quantization="int4")
    rng = np.random.default_rng(4)

    def native_weight(parts: list[tuple[str, int]], k: int) -> NativeLinear:
        raw = [(random_blocks(t, n, k, rng, scale=0.02), GGMLQuantizationType[t]) for t, n in parts]
        return NativeLinear.from_gguf(raw, k, passes=2)

    for layer in runner.model.layers:
        layer.self_attn.qkv_proj = native_weight([("Q4_K", 256), ("Q4_K", 128), ("Q6_K", 128)], 256)
        layer.self_attn.o_proj = native_weight([("Q5_K", 256)], 256)
        layer.mlp.gate_up_proj = native_weight([("Q4_0", 512), ("Q5_1", 512)], 256)
        layer.mlp.down_proj = native_weight([("Q8_0", 256)], 512)
    runner.decode_backend = NativeLlamaDecoder(runner.model, lib)
    runner.allocate_kv_cache(64)
    assert_decode_steps_match_the_torch_path(runner, model.vocab_size)


@pytest.mark.parametrize("quantization", ["int4", "auto"])
def test_a_tokens_path_depends_on_its_position_not_on_its_neighbours(tmp_path: Path, quantization: str) -> None:
    """Generated tokens go through the native decoder, prompt tokens through the torch path, whatever else the
    step holds: a decode gives the same bits beside a prefill chunk as alone, and so does the same token when a
    preemption recomputes it in one chunk with its prompt."""
    model = TinyLlama(seed=5, tie_embeddings=True)
    path = write_tiny_llama(tmp_path / "tiny.gguf", model)
    runner = ModelRunner(GGUFFile(path), torch.float32, torch.device("cpu"), 4, quantization=quantization)
    runner.allocate_kv_cache(64)
    assert runner.decode_backend is not None
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, model.vocab_size, size=6).tolist()
    table = [3, 4, 5]
    runner.execute([StepChunk(prompt, 0, table, prompt_len=6)])
    token = int(rng.integers(0, model.vocab_size))
    decode = StepChunk([token], 6, table, prompt_len=6)
    alone = runner.execute([decode]).last_logits[0]
    other = StepChunk(rng.integers(0, model.vocab_size, size=7).tolist(), 0, [10, 11], prompt_len=7)
    beside_a_prefill = runner.execute([other, decode]).last_logits[1]
    assert torch.equal(beside_a_prefill, alone)
    recomputed = runner.execute([StepChunk([*prompt, token], 0, table, prompt_len=6)]).last_logits[0]
    assert torch.equal(recomputed, alone)
    # without the position, a one-token chunk is taken for a generated token and a longer one for prompt
    assert StepChunk([token], 6, table).num_prompt_tokens() == 0
    assert StepChunk(prompt, 0, table).num_prompt_tokens() == 6


def test_without_native_kernels_torch_kernels_take_over() -> None:
    code = (
        "from tokenmill import LLM, SamplingParams, native\n"
        "assert native.load() is None\n"
        "llm = LLM(quantization='int4')\n"
        "assert llm.engine.runner.decode_backend is None\n"
        "print(len(llm.generate('Hi', SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "TOKENMILL_NATIVE": "0"}
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"


@pytest.mark.parametrize("source", [p for p in native._SOURCES if p.suffix == ".c"], ids=lambda p: p.name)
def test_each_source_compiles_where_an_undeclared_function_is_an_error(source: Path) -> None:
    """gcc 14 and later refuse a call to an undeclared function (gcc 12 warns), and one source that does not
    compile leaves the whole library unbuilt (every kernel falls back to torch): matrix_units.c called syscall(),
    which -std=c11 leaves undeclared without _GNU_SOURCE. Each source, with the build's flags and that error."""
    flags = [*native._FLAGS, "-Werror=implicit-function-declaration", "-fsyntax-only"]  # a front-end error: no code
    out = subprocess.run([native.compiler(), *flags, str(source)], capture_output=True)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
