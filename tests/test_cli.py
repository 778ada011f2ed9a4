"""The `tokenmill` command as a user runs it."""

import subprocess
import sys
from pathlib import Path

import pytest

TOKENMILL = [sys.executable, "-m", "tokenmill.entrypoints.cli"]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*TOKENMILL, *args], capture_output=True, text=True, timeout=timeout)


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "tokenmill"
    assert script.exists()
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=True)
    assert "generate" in out.stdout


@pytest.mark.slow
def test_generate_streams_and_reports_timings(llm) -> None:
    out = run("generate", "How do GPUs work?", "--max-tokens", "12")
    assert out.returncode == 0, out.stderr
    expected = llm.chat([{"role": "user", "content": "How do GPUs work?"}], _greedy(12))[0].outputs[0].text
    assert out.stdout == expected + "\n"
    assert "time to first token" in out.stderr and "tokens/s" in out.stderr


@pytest.mark.slow
def test_generate_raw(llm) -> None:
    out = run("generate", "--raw", "Once upon a time", "--max-tokens", "8")
    assert out.returncode == 0, out.stderr
    assert out.stdout == llm.generate("Once upon a time", _greedy(8), use_tqdm=False)[0].outputs[0].text + "\n"


def test_generate_help_explains_itself() -> None:
    out = run("generate", "--help")
    assert out.returncode == 0
    for flag in ("--raw", "--model", "--max-tokens", "--temperature"):
        assert flag in out.stdout


def test_bad_model_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model at all")
    out = run("generate", "hi", "--model", str(bad))
    assert out.returncode == 2
    assert "bad.gguf: not a GGUF file" in out.stderr
    assert "Traceback" not in out.stderr


def _greedy(n: int):
    from tokenmill import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n)
