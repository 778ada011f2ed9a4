"""Models from the Hugging Face Hub, against a local stand-in of the Hub (tests/hub_stand_in.py, HF_ENDPOINT): a
GGUF repo's one quant and a tiny safetensors checkpoint downloaded, loaded and served; a connection dropped mid-file
resumed with a Range request; the cache used offline; a bad name, a missing quant or file, a gated repo without a
token and offline with nothing cached each refused with what to do; a split GGUF downloaded whole and read from
every shard."""

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest

from tests.gguf_builder import finish
from tests.hub_stand_in import HubStandIn
from tests.server_utils import start_server
from tests.test_hf_checkpoints import tokenizer_files, write_tiny  # noqa: F401 - tokenizer_files is a fixture
from tokenmill import LLM, SamplingParams
from tokenmill.cache import cache_dir
from tokenmill.entrypoints.model_names import find_model
from tokenmill.errors import ModelFileError
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.loader.hub_files import pick_gguf, quant_of
from tokenmill.loader.hub_reference import HubReference, parse_hub_reference

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The stand-in Hub, with huggingface_hub pointed at it and at an empty cache of the test's own."""
    with HubStandIn() as stand_in:
        monkeypatch.setenv("HF_ENDPOINT", stand_in.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
        own_cache = tmp_path / "tokenmill-cache"
        own_cache.mkdir()
        for kernels in cache_dir().glob("kernels-*.so"):  # built by `make install`: not compiled again per process
            (own_cache / kernels.name).symlink_to(kernels)
        monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(own_cache))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield stand_in


def tokenmill(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "tokenmill", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def test_hub_names_and_which_gguf_file_a_quant_picks() -> None:
    assert parse_hub_reference("Org/Name-GGUF:q4_k_m") == HubReference("Org/Name-GGUF", "q4_k_m")
    assert parse_hub_reference("hf.co/Org/Name:Q8_0", "v1") == HubReference("Org/Name", "Q8_0", "v1")
    for not_hub in ("llama3", "models/tiny.gguf", "./org/name", "/abs/path", "a/b/c"):
        assert parse_hub_reference(not_hub) is None, not_hub
    files = ["README.md", "m-Q4_0.gguf", "m-Q4_0_4_4.gguf", "m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "mmproj-m-f16.gguf"]
    assert pick_gguf(HubReference("o/m", "q4_k_m"), files) == ["m-Q4_K_M.gguf"]  # case-insensitive
    assert pick_gguf(HubReference("o/m", "Q4_0"), files) == ["m-Q4_0.gguf"]  # the whole quant over a longer one
    assert pick_gguf(HubReference("o/m"), files) == ["m-Q4_K_M.gguf"]  # no tag: Q4_K_M, as llama.cpp picks
    with pytest.raises(ModelFileError, match="names 2 GGUF files"):
        pick_gguf(HubReference("o/m", "Q4_K"), files)
    with pytest.raises(ModelFileError, match=r"no GGUF file for 'Q8_0': its quants are Q4_0, Q4_0_4_4, Q4_K_M, Q4_K_S"):
        pick_gguf(HubReference("o/m", "Q8_0"), files)
    split = ["big-Q8_0-00002-of-00002.gguf", "big-Q8_0-00001-of-00002.gguf", "small-Q4_1.gguf"]
    assert pick_gguf(HubReference("o/m", "Q8_0"), split) == split[1::-1]  # every shard, the first first
    assert quant_of(split[0]) == "Q8_0" and quant_of("x.gguf") is None
    with pytest.raises(ModelFileError, match="has 1 of its 2 shards"):
        pick_gguf(HubReference("o/m", "Q8_0"), split[:1])


@pytest.mark.slow
def test_a_gguf_repos_quant_downloads_resumes_and_loads_offline(hub, monkeypatch, bundled_path, llm) -> None:
    """Only the quant asked for is downloaded; a connection dropped after 25 MB resumes where the file's last whole
    chunk ended (a Range request); the model gives the bundled model's tokens; offline, the cache serves it."""
    hub.add_repo("org/tiny-GGUF", {"tiny-Q4_1.gguf": bundled_path, "tiny-Q8_0.gguf": b"GGUF" * 8, "README.md": b""})
    hub.drop_after["tiny-Q4_1.gguf"] = 25_000_000
    hub_llm = LLM("org/tiny-GGUF:q4_1")
    ranges = hub.gets("tiny-Q4_1.gguf")
    assert ranges[0] is None and len(ranges) == 2 and ranges[1].startswith("bytes=") and ranges[1] != "bytes=0-"
    assert hub.gets("tiny-Q8_0.gguf") == []
    path = Path(hub_llm.engine.model_path)
    assert path.name == "tiny-Q4_1.gguf" and path.stat().st_size == bundled_path.stat().st_size
    prompt = {"prompt_token_ids": [1, 2, 3, 4]}
    expected = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert hub_llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
    hub_llm.close()

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    asked = len(hub.requests)
    assert find_model("org/tiny-GGUF:Q4_1") == str(path) and len(hub.requests) == asked  # no request made
    with pytest.raises(ModelFileError, match=r"HF_HUB_OFFLINE is set, and in the Hub cache .*its quants are Q4_1"):
        find_model("org/tiny-GGUF:Q8_0")
    with pytest.raises(ModelFileError, match=r"HF_HUB_OFFLINE is set and org/elsewhere is not in the Hub cache"):
        find_model("org/elsewhere")


@pytest.mark.server
def test_a_safetensors_repo_is_served_by_its_hub_name(hub, tmp_path, tokenizer_files) -> None:  # noqa: F811
    """`tokenmill serve ORG/NAME` downloads the checkpoint's files (not the repo's other weights), serves it as
    ORG/NAME, and answers as the same checkpoint loaded from its directory; --revision takes a commit."""
    folder = write_tiny("llama", tmp_path / "tiny-llama", tokenizer_files)
    files: dict[str, Path | bytes] = {f.name: f for f in folder.iterdir()}
    commit = hub.add_repo("org/tiny-llama", {**files, "pytorch_model.bin": b"not wanted", "onnx/model.onnx": b""})
    server = start_server("org/tiny-llama", "--revision", commit, "--quantization", "none")  # vLLM's spelling
    try:
        assert [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]] == ["org/tiny-llama"]
        body = {"model": "org/tiny-llama", "prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0}
        served = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    finally:
        server.stop()
    assert hub.gets("pytorch_model.bin") == [] and hub.gets("model.onnx") == []
    local = LLM(str(folder))
    local_text = local.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=6))
    assert served == local_text[0].outputs[0].text
    listed = {r["name"]: r for r in json.loads(tokenmill("models", "--json").stdout)}
    assert listed[f"org/tiny-llama --revision {commit}"]["architecture"] == "llama"


def test_bad_names_missing_files_and_gated_repos_say_what_to_do(hub, monkeypatch) -> None:
    hub.add_repo("org/quants-GGUF", {"q-Q4_K_M.gguf": b"GGUF", "q-Q8_0.gguf": b"GGUF"})
    hub.add_repo("org/gated-GGUF", {"g-Q4_1.gguf": b"GGUF gated"}, gated_token="hf_right")
    out = tokenmill("generate", "hi", "--model", "org/no-such-model")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"no model 'org/no-such-model' on the Hub ({hub.url}, 404)" in out.stderr and "HF_TOKEN" in out.stderr
    with pytest.raises(ModelFileError, match=r"no file 'q-Q5_K.gguf'; its GGUF quants: Q4_K_M, Q8_0"):
        find_model("org/quants-GGUF", hf_file="q-Q5_K.gguf")
    with pytest.raises(ModelFileError, match="no GGUF file for 'IQ2_XS': its quants are Q4_K_M, Q8_0"):
        find_model("org/quants-GGUF:IQ2_XS")
    with pytest.raises(ModelFileError, match="has no revision 'v9'"):
        find_model("org/quants-GGUF:Q8_0", revision="v9")
    with pytest.raises(ModelFileError, match=r"gated model \(401\): accept its conditions .* set HF_TOKEN"):
        find_model("org/gated-GGUF")
    monkeypatch.setenv("HF_TOKEN", "hf_right")
    assert Path(find_model("org/gated-GGUF")).read_bytes() == b"GGUF gated"
    pulled = tokenmill("pull", "org/quants-GGUF", "--hf-file", "q-Q8_0.gguf")
    assert pulled.returncode == 0 and Path(pulled.stdout.strip()).name == "q-Q8_0.gguf"
    assert "--model org/quants-GGUF --hf-file q-Q8_0.gguf" in pulled.stderr


def write_split_gguf(folder: Path, count: int) -> list[Path]:
    """A model split as llama.cpp's gguf-split writes it: each shard a GGUF file with split.no and split.count."""
    shards = []
    for no in range(count):
        path = folder / f"big-Q8_0-{no + 1:05d}-of-{count:05d}.gguf"
        writer = gguf.GGUFWriter(path, "llama")
        writer.add_uint16("split.no", no)
        writer.add_uint16("split.count", count)
        writer.add_tensor(f"blk.{no}.ffn_up.weight", np.zeros((4, 4), dtype=np.float32))
        finish(writer)
        shards.append(path)
    return shards


def test_a_split_gguf_is_downloaded_whole_and_read_from_every_shard(hub, tmp_path) -> None:
    shards = write_split_gguf(tmp_path, 3)
    hub.add_repo("org/big-GGUF", {p.name: p for p in shards})
    path = Path(find_model("org/big-GGUF:Q8_0"))
    assert path.name == shards[0].name and all(len(hub.gets(p.name)) == 1 for p in shards)
    assert sorted(p.name for p in path.parent.iterdir()) == [p.name for p in shards]
    model = GGUFFile(path)  # tests/test_split_gguf.py generates from a split model
    assert [f.name for f in model.files] == [p.name for p in shards]
    assert sorted(model.tensors) == [f"blk.{no}.ffn_up.weight" for no in range(3)]
