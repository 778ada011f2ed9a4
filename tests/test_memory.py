"""Memory at real sizes' proportions: loading a quantized GGUF holds about one copy of its weights. No float copy of
a projection, the LM head or the embedding table is ever made under the quantized modes, and the file's pages a
weight was built from are handed back, so the process's peak resident memory grows by about the file's size (plus
the KV cache), never by the several times that a dense float32 copy costs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gguf_builder import TinyLlama, write_tiny_llama

# the growth of peak RSS allowed beyond the file's size: the KV cache asked for below (4 MiB), the tokenizer,
# one layer's transient buffers and the allocator's slack
SLACK_MIB = 96

PROBE = """
import json, sys
from tokenmill import LLM, SamplingParams

def rss_mib(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) / 1024

import torch  # noqa: F401 - imported before the baseline: its own memory is not the model's
before = rss_mib("VmRSS:")
llm = LLM(sys.argv[1], quantization=sys.argv[2], num_kv_blocks=16)
loaded = rss_mib("VmHWM:")
llm.generate({"prompt_token_ids": list(range(3, 200))}, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
print(json.dumps({"before": before, "loaded_peak": loaded, "served_peak": rss_mib("VmHWM:")}))
"""


@pytest.fixture(scope="module")
def mid_size_gguf(tmp_path_factory) -> Path:
    """A llama of 60 MB as Q4_0 (100 M weights; 25x the bundled model's 4-bit projections per layer)."""
    model = TinyLlama(vocab_size=4096, hidden=1024, intermediate=2816, layers=8, heads=16, kv_heads=4, seed=3)
    return write_tiny_llama(tmp_path_factory.mktemp("mid") / "mid-q4_0.gguf", model, "Q4_0")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["auto", "int4"])
def test_loading_holds_one_copy_of_the_weights(mid_size_gguf: Path, mode: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(mid_size_gguf), mode], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    file_mib = mid_size_gguf.stat().st_size / 2**20
    for peak in ("loaded_peak", "served_peak"):
        grown = figures[peak] - figures["before"]
        assert grown <= file_mib + SLACK_MIB, f"{peak}: RSS grew {grown:.0f} MiB for a {file_mib:.0f} MiB file"
