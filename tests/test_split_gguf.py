"""A model split into several GGUF files (llama.cpp's gguf-split; the Hub's big repos): opened from any shard, read
from all of them, refused with the missing shard's name when one is not there."""

import math
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.gguf_builder import finish
from tokenmill import LLM, SamplingParams
from tokenmill.errors import ModelFileError
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.loader.weight_cache import weight_cache_key

# the writer's own fields (GGUFWriter writes them again for each shard)
WRITER_KEYS = ("GGUF.", "general.architecture", "split.")


def write_split(source: Path, folder: Path, shards: int) -> list[Path]:
    """`source`'s metadata and tensors as `shards` files, written by gguf-py's GGUFWriter with split_max_tensors (the
    writer llama.cpp's converter splits with: the metadata in the first shard, `split.no`/`split.count`/
    `split.tensors.count` in each, names NAME-0000i-of-0000N.gguf)."""
    reader = gguf.GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    per_shard = math.ceil(len(reader.tensors) / shards)
    writer = gguf.GGUFWriter(folder / "model.gguf", arch, split_max_tensors=per_shard)
    for name, field in reader.fields.items():
        if name.startswith(WRITER_KEYS):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    finish(writer)
    written = sorted(folder.glob("model-*-of-*.gguf"))
    assert len(written) == shards
    return written


@pytest.fixture(scope="module")
def split_bundled(bundled_path: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return write_split(bundled_path, tmp_path_factory.mktemp("split"), 3)


def test_every_shard_opens_the_whole_model(split_bundled: list[Path], bundled_path: Path) -> None:
    whole = GGUFFile(bundled_path)
    for shard in split_bundled:
        model = GGUFFile(shard)
        assert model.path == split_bundled[0] and model.files == split_bundled
        assert model.metadata["split.count"] == 3 and model.architecture == whole.architecture
        assert model.get("tokenizer.ggml.tokens") == whole.get("tokenizer.ggml.tokens")
        assert model.tensors.keys() == whole.tensors.keys()
        for name, tensor in whole.tensors.items():
            assert model.tensors[name].ggml_type == tensor.ggml_type and model.tensors[name].shape == tensor.shape
            assert np.array_equal(np.asarray(model.tensors[name].data), np.asarray(tensor.data)), name
    # each shard holds a third of the tensors: the model really is spread over the files
    held = [len(gguf.GGUFReader(shard).tensors) for shard in split_bundled]
    assert sum(held) == len(whole.tensors) and max(held) < len(whole.tensors)


def test_a_split_model_generates_as_the_single_file(split_bundled: list[Path], llm) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    expected = [out.outputs[0].token_ids for out in llm.generate(prompts, greedy, use_tqdm=False)]
    split = LLM(str(split_bundled[1]))  # any shard names the model
    try:
        assert [out.outputs[0].token_ids for out in split.generate(prompts, greedy, use_tqdm=False)] == expected
    finally:
        split.close()


def test_a_missing_or_misnamed_shard_is_named(split_bundled: list[Path], tmp_path: Path) -> None:
    for shard in split_bundled[:2]:
        (tmp_path / shard.name).symlink_to(shard)
    with pytest.raises(ModelFileError, match=r"shard\(s\) model-00003-of-00003.gguf of this 3-file split model"):
        GGUFFile(tmp_path / split_bundled[0].name)
    renamed = tmp_path / "renamed.gguf"
    renamed.symlink_to(split_bundled[0])
    with pytest.raises(ModelFileError, match=r"not named as llama.cpp names shards"):
        GGUFFile(renamed)


def test_the_weight_cache_key_covers_every_shard(split_bundled: list[Path]) -> None:
    model = GGUFFile(split_bundled[0])
    key = weight_cache_key(model.path, {}, "kernels.so", model.files)
    assert [f[0] for f in key["files"]] == [str(p.resolve()) for p in split_bundled]
