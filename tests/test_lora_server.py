"""LoRA adapters through the server: `--lora NAME=PATH`, `model: NAME` through the openai client (completions and
chat) and Ollama's API, /v1/models' cards with their parent, vLLM's load and unload endpoints, and the errors of an
unknown adapter or a bad path in OpenAI's shape."""

from pathlib import Path

import httpx
import openai
import pytest

from tests.lora_cases import ADAPTERS, PROMPT, merged_greedy, write_adapter, write_tiny_llama
from tests.server_utils import start_server
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.tokenizer.gguf_tokenizer import Tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.server]
N = 8


@pytest.fixture(scope="module")
def served(tmp_path_factory, bundled_path: Path):
    """A server of the tiny model in float32 with adapter all8 from the start; attn4 written for loading later."""
    root = tmp_path_factory.mktemp("lora-server")
    base = write_tiny_llama(root, bundled_path)
    adapters = {name: write_adapter(base, root / name, i, **ADAPTERS[name]) for i, name in enumerate(["all8", "attn4"])}
    lora = ("--lora", f"all8={adapters['all8']}", "--allow-runtime-lora-updating")
    proc = start_server("--model", str(base), "--quantization", "none", *lora)
    yield proc, base, adapters, Tokenizer.from_gguf(GGUFFile(bundled_path))
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[0].url}/v1", api_key="none")


def completion_ids(client: openai.OpenAI, model: str) -> str:
    reply = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=N, temperature=0, extra_body={"ignore_eos": True}
    )
    return reply.choices[0].text


def test_model_names_the_adapter_through_the_openai_client(served, client: openai.OpenAI) -> None:
    proc, base, adapters, tokenizer = served
    expected = tokenizer.decode(merged_greedy(base, adapters["all8"], PROMPT, N))
    assert completion_ids(client, "all8") == expected
    assert completion_ids(client, "base") == tokenizer.decode(merged_greedy(base, None, PROMPT, N))
    chat = client.chat.completions.create(
        model="all8", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.model == "all8" and chat.choices[0].message.content is not None
    cards = {m.id: m for m in client.models.list().data}
    assert cards["all8"].parent == "base" and cards["base"].parent is None
    assert client.models.retrieve("all8").parent == "base"


def test_ollama_chooses_the_adapter_by_name(served) -> None:
    proc, base, adapters, tokenizer = served
    body = {"model": "all8:latest", "prompt": "x", "raw": True, "stream": False, "options": {"temperature": 0}}
    body["options"]["num_predict"] = 4
    with_adapter = httpx.post(f"{proc.url}/api/generate", json=body, timeout=60)
    assert with_adapter.status_code == 200, with_adapter.text
    without = httpx.post(f"{proc.url}/api/generate", json={**body, "model": "base"}, timeout=60).json()
    assert with_adapter.json()["response"] != without["response"]  # (random adapters change every token)
    refused = httpx.post(f"{proc.url}/api/embed", json={"model": "all8", "input": "x"}, timeout=60)
    assert refused.status_code == 404  # embeddings are the base model's only


def test_load_and_unload_at_run_time(served, client: openai.OpenAI) -> None:
    proc, base, adapters, tokenizer = served
    load = httpx.post(
        f"{proc.url}/v1/load_lora_adapter", json={"lora_name": "attn4", "lora_path": str(adapters["attn4"])}
    )
    assert load.status_code == 200 and "attn4" in load.text
    assert completion_ids(client, "attn4") == tokenizer.decode(merged_greedy(base, adapters["attn4"], PROMPT, N))
    again = httpx.post(
        f"{proc.url}/v1/load_lora_adapter", json={"lora_name": "attn4", "lora_path": str(adapters["attn4"])}
    )
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    unload = httpx.post(f"{proc.url}/v1/unload_lora_adapter", json={"lora_name": "attn4"})
    assert unload.status_code == 200
    with pytest.raises(openai.NotFoundError) as caught:
        completion_ids(client, "attn4")
    assert caught.value.body["code"] == "model_not_found"
    assert "attn4" not in {m.id for m in client.models.list().data}
    missing = httpx.post(f"{proc.url}/v1/unload_lora_adapter", json={"lora_name": "attn4"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "lora_not_found"


def test_a_bad_path_is_a_400_in_openais_shape(served, tmp_path: Path) -> None:
    proc = served[0]
    for path in (tmp_path / "nothing", tmp_path):
        reply = httpx.post(f"{proc.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(path)})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert (
            error["type"] == "invalid_request_error" and error["param"] == "lora_path" and str(path) in error["message"]
        )
    no_path = httpx.post(f"{proc.url}/v1/load_lora_adapter", json={"lora_name": "x"})
    assert no_path.status_code == 400 and "error" in no_path.json()
    assert httpx.get(f"{proc.url}/health").status_code == 200  # nothing crashed


def test_without_the_option_the_runtime_endpoints_answer_403(monkeypatch) -> None:
    """vLLM keeps them behind VLLM_ALLOW_RUNTIME_LORA_UPDATING: a caller names a file for the server to read."""
    from fastapi.testclient import TestClient

    from tokenmill.server.app import create_app
    from tokenmill.server.state import ServerSettings, ServerState

    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    app = create_app(ServerState(ServerSettings()), load_in_background=False)
    with TestClient(app, base_url="http://127.0.0.1:8000") as c:
        for path, body in (("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc/passwd"}),
                           ("/v1/unload_lora_adapter", {"lora_name": "x"})):  # fmt: skip
            r = c.post(path, json=body)
            assert r.status_code == 403 and r.json()["error"]["type"] == "feature_disabled", r.text
            assert "--allow-runtime-lora-updating" in r.json()["error"]["message"]
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert ServerSettings().allow_runtime_lora_updating
