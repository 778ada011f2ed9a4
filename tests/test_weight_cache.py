"""The weight cache (--weight-cache, loader/weight_cache.py): the native kernels' buffers written beside tokenmill's
cache on a model's first load and mapped from there by the next, giving the same tokens; a changed model file or
a cache that does not match its build is never used."""

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmill.errors import InvalidParameterError
from tokenmill.loader import weight_cache
from tokenmill.loader.weight_cache import CachedWeights, WritingWeights, open_weight_cache

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The cache directory's weights under tmp_path (the compiled kernels stay where they are)."""
    monkeypatch.setattr(weight_cache, "cache_dir", lambda: tmp_path)
    return tmp_path / "weights"


def _load(path: Path, cache: bool = True):
    from tokenmill import LLM

    return LLM(str(path), quantization="auto", num_kv_blocks=32, weight_cache=cache)


def _greedy(llm) -> list[list[int]]:
    from tokenmill import SamplingParams

    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _store(llm):
    return llm.engine.runner.model.weight_store


def _mapped_files() -> set[str]:
    with open("/proc/self/maps") as maps:
        return {line.split()[-1] for line in maps if line.rstrip().endswith(".bin")}


def test_a_model_loaded_twice_reads_its_weights_from_the_cache(folder: Path, bundled_path: Path) -> None:
    plain = _greedy(_load(bundled_path, cache=False))
    first = _load(bundled_path)
    assert _store(first).state == "written"
    _store(first).wait()
    (index,) = folder.glob("*.json")
    data = index.with_suffix(".bin")
    assert data.stat().st_size == json.loads(index.read_text())["bytes"] > 50_000_000
    assert _greedy(first) == plain

    second = _load(bundled_path)
    assert _store(second).state == "read"
    assert str(data) in _mapped_files()  # the weights are the cache file's pages, not a copy
    assert _greedy(second) == plain


def test_a_changed_model_file_is_cached_again_and_its_old_cache_removed(folder: Path, bundled_path: Path, tmp_path):
    model = tmp_path / "model.gguf"
    shutil.copyfile(bundled_path, model)
    first = _load(model)
    _store(first).wait()
    (old,) = folder.glob("*.json")
    os.utime(model, ns=(model.stat().st_atime_ns, model.stat().st_mtime_ns + 10**9))  # "edited"
    second = _load(model)
    assert _store(second).state == "written"
    _store(second).wait()
    (new,) = folder.glob("*.json")
    assert new != old and not old.with_suffix(".bin").exists()


def test_a_cache_that_does_not_match_its_build_is_not_used(folder: Path, bundled_path: Path) -> None:
    plain = _greedy(_load(bundled_path, cache=False))
    _store(_load(bundled_path)).wait()
    (index,) = folder.glob("*.json")
    meta = json.loads(index.read_text())
    meta["entries"][0][1] += 16  # another row count than the build's first buffer
    index.write_text(json.dumps(meta))
    llm = _load(bundled_path)
    assert _greedy(llm) == plain
    assert not index.exists()  # written again by the next load
    _store(_load(bundled_path)).wait()
    assert index.exists()


def _filler(values: torch.Tensor):
    return lambda address: ctypes.memmove(address, values.data_ptr(), values.numel())


def test_buffers_come_back_byte_for_byte(tmp_path: Path) -> None:
    """Without a model: three buffers written (one over the writer's chunk, one not a whole page), then read."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    sizes = [5000, WritingWeights.CHUNK + 12345, 4096]
    made = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]

    writer = open_weight_cache(model, {"rank": 0}, "kernels-x.so", tmp_path / "w")
    assert isinstance(writer, WritingWeights)
    for i, values in enumerate(made):
        assert torch.equal(writer.buffer(8, 16 * (i + 1), 32, values.numel(), _filler(values)), values)
    writer.finish()
    writer.wait()
    reader = open_weight_cache(model, {"rank": 0}, "kernels-x.so", tmp_path / "w")
    assert isinstance(reader, CachedWeights)
    never = lambda address: pytest.fail("a cached buffer was made again")  # noqa: E731
    for i, values in enumerate(made):
        assert torch.equal(reader.buffer(8, 16 * (i + 1), 32, values.numel(), never), values)
    # another rank's (or another build's) cache is another file
    other = open_weight_cache(model, {"rank": 1}, "kernels-x.so", tmp_path / "w")
    assert isinstance(other, WritingWeights)
    other.abandon()


def test_a_writer_never_finished_does_not_hold_the_process_at_exit(tmp_path: Path) -> None:
    """A build that neither finishes nor abandons its writer (a bug, or an exception nobody caught) must not keep the
    interpreter from exiting: the whole CI run once hung after pytest's summary on such a writer."""
    code = (
        "import sys; from pathlib import Path; from tokenmill.loader.weight_cache import open_weight_cache\n"
        "folder = Path(sys.argv[1]); model = folder / 'm.gguf'; model.write_bytes(b'GGUF')\n"
        "writer = open_weight_cache(model, {}, 'kernels-x.so', folder / 'w')\n"
        "writer.buffer(8, 16, 32, 100, lambda address: None)\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=60)
    assert list((tmp_path / "w").iterdir()) == []  # and the half-written file is gone


def test_a_load_that_fails_leaves_no_cache(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    writer = open_weight_cache(model, {}, "kernels-x.so", tmp_path / "w")
    writer.buffer(8, 16, 32, 100, lambda address: None)
    writer.abandon()
    assert list((tmp_path / "w").iterdir()) == []


def test_the_option_takes_only_true_or_false() -> None:
    from tokenmill.config import EngineConfig

    with pytest.raises(InvalidParameterError, match="weight_cache"):
        EngineConfig(weight_cache="yes")
