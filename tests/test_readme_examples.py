"""Every Python example of the README, run as a user would paste it (the OpenAI client's against a real server
started by the README's `make serve PORT=...`): each must finish, say something, and take under 30 s here."""

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO_ROOT
from tests.server_utils import free_port, start_command

pytestmark = [pytest.mark.slow, pytest.mark.server]
README_URL = "http://127.0.0.1:8000"
EXAMPLES = re.findall(r"```python\n(.*?)```", (REPO_ROOT / "README.md").read_text(), re.S)
LIMIT_S = 30.0


def test_the_readme_has_the_examples_this_test_runs() -> None:
    assert len(EXAMPLES) >= 3
    assert any("from openai import OpenAI" in e for e in EXAMPLES)
    assert any("tensor_parallel_size" in e for e in EXAMPLES)


@pytest.fixture(scope="module")
def server():
    """`make serve PORT=N`, as the README says: the bundled model, every default, on port N. (-o: the install
    step counts as done, so a checkout whose pyproject.toml changed after `make install` is not reinstalled here.)"""
    port = free_port()
    make = ["make", "--no-print-directory", "-o", ".venv/.installed", "serve", f"PORT={port}"]
    proc = start_command(make, port, group=True, cwd=REPO_ROOT)
    yield proc
    proc.stop()  # SIGTERM to make and the server alike


def test_make_serve_listens_on_the_port_it_is_given(server) -> None:
    assert server.port != 8000 and httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert f"listening on http://127.0.0.1:{server.port}" in server.output()


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
