"""Every Python example of the README, run as a user would paste it (the OpenAI client's against a real
`tokenmill serve` as `make serve` starts it): each must finish, say something, and take under 30 s here."""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.server_utils import start_server

pytestmark = pytest.mark.slow
README_URL = "http://127.0.0.1:8000"
EXAMPLES = re.findall(r"```python\n(.*?)```", (REPO_ROOT / "README.md").read_text(), re.S)
LIMIT_S = 30.0


def test_the_readme_has_the_examples_this_test_runs() -> None:
    assert len(EXAMPLES) >= 3
    assert any("from openai import OpenAI" in e for e in EXAMPLES)
    assert any("tensor_parallel_size" in e for e in EXAMPLES)


@pytest.fixture(scope="module")
def server():
    proc = start_server()  # `make serve`'s server: the bundled model, every default
    yield proc
    proc.stop()


@pytest.mark.parametrize("example", EXAMPLES, ids=[f"example{i}" for i in range(len(EXAMPLES))])
def test_readme_example_runs_quickly(example: str, server, tmp_path: Path) -> None:
    assert README_URL in example or "openai" not in example  # a client example must point where the README says
    code = example.replace(README_URL, server.url)
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip(), "the example prints its answer"
    assert took < LIMIT_S, f"took {took:.1f} s (limit {LIMIT_S:.0f} s)\n{out.stdout[-2000:]}"
