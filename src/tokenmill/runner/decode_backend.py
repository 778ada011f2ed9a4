"""The seam for a step's generated tokens: which backend computes their decoder layers.

A backend takes the step's generated tokens (one query each, attending to their paged context) and returns their
final normed hidden states; the runner computes the logits from them as from the model's own forward. Behind it:

- None (torch eager): generated tokens ride with the prompt tokens through the model's forward, one pass for
  the whole step (float models, and wherever the native decoder cannot run);
- the native decoder (layers/native_decode.py): 4-bit projections on the CPU (`int4`, `auto`), every layer of
  the step in one C call that reads the model from one description and the rows from one step struct.

A CUDA graph or `torch.compile` backend would be a third: the same two methods, chosen here.
"""

from typing import Protocol

import torch

from tokenmill import native
from tokenmill.layers.attention import AttentionMetadata
from tokenmill.layers.native_decode import NativeLlamaDecoder
from tokenmill.model.llama import LlamaForCausalLM


class DecodeBackend(Protocol):
    name: str

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The KV cache exists (every layer's K and V tensors): record what the backend reads and writes."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        local_meta: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [M] -> final hidden states [M, hidden] (normed); `meta` holds only a decode batch
        (one query per row), `local_meta` the same in the sliding-window layers' pool when they have one."""
        ...


def choose_decode_backend(model: torch.nn.Module, quantization: str | None) -> DecodeBackend | None:
    """The native decoder where the projections are 4-bit ones it can run (a llama-family model in float32 with
    native weights); else None: the model's own forward (torch eager) computes generated tokens too."""
    lib = native.load()
    if lib is None or quantization not in ("int4", "auto") or not isinstance(model, LlamaForCausalLM):
        return None
    try:
        decoder = NativeLlamaDecoder(model, lib)
    except ValueError:
        return None
    return decoder if decoder.ok else None
