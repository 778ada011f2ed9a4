"""tokenmill's native kernels: 4-bit and 8-bit products, and the whole decode step against the torch path."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.gguf_builder import TinyLlama, write_tiny_llama
from tests.test_quantized import q4_1_grid_weight
from tokenmill import native
from tokenmill.layers.quantized_linear import Q4Linear, Q8Head
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.runner.model_runner import ModelRunner, StepChunk

lib = native.load()  # built by `make install` (a C compiler with OpenMP is a test requirement)


def test_native_kernels_are_built() -> None:
    assert lib is not None, "tokenmill's native kernels did not build: see the log of `python -m tokenmill.native`"


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
def test_q4_matmul_matches_float(rows: int) -> None:
    w = q4_1_grid_weight(96, 160, seed=rows)
    x = torch.randn(rows, 160)
    out = Q4Linear(w, lib)(x)
    assert torch.allclose(out, F.linear(x, w), rtol=1e-4, atol=1e-4)


def test_q8_head_is_exact_for_q8_0_weights() -> None:
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (64, 4, 32), generator=g).float()
    codes[..., 0] = 127  # Q8_0 blocks reach +-127 by construction
    d = (torch.rand(64, 4, 1, generator=g) * 0.02).half().float()
    w = (codes * d).reshape(64, 128)
    head = Q8Head(w, lib)
    assert torch.equal(head.qs.float().reshape(64, 4, 32), codes)
    x = torch.randn(2, 128)
    assert torch.allclose(head(x), F.linear(x, w), rtol=1e-4, atol=1e-4)


def test_native_decode_step_matches_the_torch_path(tmp_path: Path) -> None:
    model = TinyLlama(seed=11, tie_embeddings=True)
    path = write_tiny_llama(tmp_path / "tiny.gguf", model)
    runner = ModelRunner(GGUFFile(path), torch.float32, torch.device("cpu"), 4, quantization="int4")
    runner.allocate_kv_cache(64)
    assert runner.native_decoder is not None
    rng = np.random.default_rng(0)
    tables = [[3, 9, 12, 20, 30, 31], [40, 41, 42, 43, 44, 45], [50, 51, 52, 53, 54, 55]]
    prompts = [rng.integers(0, model.vocab_size, size=n).tolist() for n in (9, 14, 5)]
    runner.execute([StepChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    step = [StepChunk([int(rng.integers(0, 96))], len(p), t) for p, t in zip(prompts, tables, strict=True)]
    native_logits = runner.execute(step).last_logits
    decoder, runner.native_decoder = runner.native_decoder, None
    torch_logits = runner.execute(step).last_logits  # rewrites the same cache slots with the same values
    runner.native_decoder = decoder
    assert torch.allclose(native_logits, torch_logits, rtol=1e-4, atol=1e-4)


def test_without_native_kernels_torch_kernels_take_over() -> None:
    code = (
        "from tokenmill import LLM, SamplingParams, native\n"
        "assert native.load() is None\n"
        "llm = LLM(quantization='int4')\n"
        "assert llm.engine.runner.native_decoder is None\n"
        "print(len(llm.generate('Hi', SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "TOKENMILL_NATIVE": "0"}
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"
