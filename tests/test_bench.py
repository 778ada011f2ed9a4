"""The benchmark workload is the canonical one (tests/data/workload.py, a copy of the definition the peers' figures
were measured with), and the bench commands run and print JSON."""

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.conftest import DATA, REPO_ROOT
from tokenmill.entrypoints.bench.workload import make_workload, parse_range


def load_module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_workload_is_drawn_as_the_canonical_definition() -> None:
    canonical = load_module(DATA / "workload.py", "canonical_workload")
    assert make_workload() == canonical.make_workload(**canonical.DEFAULT)
    assert make_workload(8, (10, 20), (3, 5), 7) == canonical.make_workload(8, (10, 20), (3, 5), 7)
    ours = make_workload()
    assert sum(len(p) for p, _ in ours) == 4803 and sum(m for _, m in ours) == 2277
    peers = load_module(REPO_ROOT / "benchmarks" / "workload.py", "peer_workload")
    assert peers.make_workload() == ours


def test_parse_range() -> None:
    assert parse_range("32:256") == (32, 256) and parse_range("128") == (128, 128)


def run_bench(*args: str) -> dict:
    """`tokenmill bench ... --json` in a subprocess -> its JSON line."""
    command = [sys.executable, "-m", "tokenmill.entrypoints.cli", "bench", *args, "--json"]
    return json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)


@pytest.mark.slow
def test_bench_commands_print_json() -> None:
    result = run_bench("offline", "--num-prompts", "3", "--output-len", "2:4", "--quantization", "auto")
    assert result["bench"] == "offline" and result["output_tokens"] == sum(
        m for _, m in make_workload(3, (32, 256), (2, 4))
    )
    assert result["seconds"] > 0 and result["output_tok_s"] > 0 and result["load_seconds"] > 0
    result = run_bench("latency", "--input-len", "16", "--output-len", "4", "--runs", "1")
    assert result["ttft_ms"] > 0 and result["decode_tok_s"] > 0 and result["prefill_tok_s"] > 0
