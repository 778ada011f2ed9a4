"""Gated MLP activations over a fused gate/up projection: SwiGLU (llama) and GeGLU with tanh GELU (Gemma)."""

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * I] (gate then up) -> [..., I]."""
    half = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :half]) * gate_up[..., half:]


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * I] (gate then up) -> [..., I]: GELU (tanh approximation) of the gate times the up projection."""
    half = gate_up.shape[-1] // 2
    return F.gelu(gate_up[..., :half], approximate="tanh") * gate_up[..., half:]


ACTIVATIONS = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}
