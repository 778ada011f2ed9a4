"""A mixture's experts as the loader sees them: GGUF files store each kind of expert weight of a layer as one 3-D
tensor ([experts, rows, columns], e.g. `blk.0.ffn_up_exps.weight`); Hugging Face checkpoints store one 2-D tensor
per expert (`model.layers.0.mlp.experts.3.up_proj.weight`), which ExpertStack presents as that 3-D tensor without
copying any of them. `expert_tensor` is one expert's 2-D part of either, still a view of the file."""

from collections.abc import Callable, Sequence

import numpy as np

from tokenmill.loader.gguf_file import GGUFTensor
from tokenmill.loader.pages import release_pages


class ExpertStack:
    """Per-expert arrays (each a view of a mapped file, of one shape) seen as one [experts, ...] array: indexing
    by an expert gives its own array."""

    def __init__(self, arrays: Sequence[np.ndarray]):
        shapes = {a.shape for a in arrays}
        if len(shapes) != 1:
            raise ValueError(f"experts of different shapes: {sorted(shapes)}")
        self.arrays = list(arrays)
        self.shape = (len(self.arrays), *self.arrays[0].shape)

    def __len__(self) -> int:
        return len(self.arrays)

    def __getitem__(self, expert: int) -> np.ndarray:
        return self.arrays[expert]


class ExpertViews:
    """A 3-D expert tensor whose experts are made on demand, one at a time, from arrays of another layout (gpt-oss's
    fused, transposed and interleaved tensors; its MXFP4 blocks): `make(e)` gives expert e's stored rows. `arrays`
    are the file's views they come from (release_expert_pages hands their pages back)."""

    def __init__(self, shape: tuple[int, ...], make: Callable[[int], np.ndarray], arrays: Sequence[np.ndarray]):
        self.shape = shape
        self.make = make
        self.arrays = list(arrays)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, expert: int) -> np.ndarray:
        if not 0 <= expert < self.shape[0]:
            raise IndexError(f"expert {expert} of {self.shape[0]}")
        return self.make(expert)


def expert_tensor(tensor: GGUFTensor, expert: int) -> GGUFTensor:
    """Expert `expert`'s part of a 3-D expert tensor: (rows, columns), its data the stored rows (a view)."""
    if len(tensor.shape) != 3:
        raise ValueError(f"{tensor.name} is not an expert tensor (shape {tensor.shape})")
    return GGUFTensor(f"{tensor.name}[{expert}]", tensor.ggml_type, tensor.shape[1:], tensor.data[expert])


def release_expert_pages(data: "np.ndarray | ExpertStack | ExpertViews") -> None:
    """Hand back the mapped file's pages under an expert tensor's data (every expert's)."""
    for array in data.arrays if isinstance(data, ExpertStack | ExpertViews) else (data,):
        release_pages(array)
