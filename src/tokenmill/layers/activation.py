"""Gated MLP activations over a fused gate/up projection: SwiGLU (llama), GeGLU with tanh GELU (Gemma) and gpt-oss's
clamped SwiGLU."""

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


# gpt-oss's constants (transformers' swiglu_alpha and swiglu_limit defaults; llama.cpp fixes the same numbers)
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0


def swiglu_oai(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * I] (gate then up) -> [..., I]: gpt-oss's SwiGLU, the gate clamped from above and the up projection
    on both sides at 7, the gate's sigmoid sharpened by 1.702, and 1 added to the up projection (as transformers'
    GptOssExperts, in its order of operations)."""
    half = gate_up.shape[-1] // 2
    gate = gate_up[..., :half].clamp(max=SWIGLU_OAI_LIMIT)
    up = gate_up[..., half:].clamp(min=-SWIGLU_OAI_LIMIT, max=SWIGLU_OAI_LIMIT)
    glu = gate * torch.sigmoid(gate * SWIGLU_OAI_ALPHA)
    return (up + 1) * glu


ACTIVATIONS = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul, "swiglu_oai": swiglu_oai}
