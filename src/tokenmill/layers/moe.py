"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss): a router scores every expert for each
token, the top k experts' gated MLPs run on it, and their outputs are summed, weighted by the router.

Tokens are grouped by expert: the step's (token, expert) pairs sorted by expert, then one product per chosen
expert over all of its tokens (a prompt chunk's products are matrix products, not per-token gathers; a decode
step's sequences that pick the same expert share one pass over its weights), scattered back weighted. Each token's
sum runs over its experts in expert order, and the router's product (in float64, MixtureOfExperts.router_logits)
and the native products compute each row on their own, so a token's result is the same bits whatever other
tokens share its step (the rule of the dense MLP's native products).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def route(
    logits: torch.Tensor, k: int, normalize: bool, scale: float = 1.0, softmax_after_topk: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits float32 [T, E] -> (weights float32 [T, k], expert ids int64 [T, k]): a softmax over all
    experts, the k largest kept (ties to the lower id, as torch.topk), renormalized to sum 1 if `normalize`, times
    `scale`. `softmax_after_topk` (gpt-oss): the k largest logits first, then a softmax over those k."""
    if softmax_after_topk:
        top, ids = torch.topk(logits, k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    else:
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
        if normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights * scale if scale != 1.0 else weights), ids


class MixtureOfExperts(nn.Module):
    """`num_experts` gated MLPs over `hidden`, `experts_per_token` of them a token; with `shared`, Qwen2-MoE's
    shared expert, which every token takes, weighted by sigmoid(x . shared_gate); with `biases` (gpt-oss), a bias on
    the router and on every expert's gate/up and down products. Built empty (placeholders without memory); `load`
    gives it its weights."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        experts_per_token: int,
        normalize: bool,
        activation: Callable[[torch.Tensor], torch.Tensor],
        scale: float = 1.0,
        shared: bool = False,
        biases: bool = False,
        softmax_after_topk: bool = False,
    ):
        super().__init__()
        if not 0 < experts_per_token <= num_experts:
            raise ValueError(f"{experts_per_token} experts a token out of {num_experts}")
        # float32 [E, hidden] (routers come in float32, bfloat16 or float16: exact), multiplied in float64
        self.router = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32, device="meta"), False)
        self.gate_up = nn.ModuleList()  # E projections hidden -> 2 x width (gate, then up)
        self.down = nn.ModuleList()  # E projections width -> hidden
        self.k, self.normalize, self.scale = experts_per_token, normalize, scale
        self.softmax_after_topk = softmax_after_topk
        self.biases = biases
        # buffers (they move with the model), set by load where `biases`
        self.register_buffer("router_bias", None, persistent=False)  # float64 [E]
        self.register_buffer("gate_up_bias", None, persistent=False)  # float32 [E, 2 x width] (gate, then up)
        self.register_buffer("down_bias", None, persistent=False)  # float32 [E, hidden]
        self.activation = activation
        self.shared_gate_up: nn.Module | None = None
        self.shared_down: nn.Module | None = None
        self.shared_gate = nn.Parameter(torch.empty(hidden, device="meta"), False) if shared else None  # [hidden]

    @property
    def num_experts(self) -> int:
        return self.router.shape[0]

    def load(
        self,
        router: torch.Tensor,
        experts: list[tuple[nn.Module, nn.Module]],
        shared: tuple[nn.Module, nn.Module] | None = None,
        shared_gate: torch.Tensor | None = None,
        biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """The weights: `router` [E, hidden]; each expert's (gate_up, down) projections, in any of the linear
        kernels (layers/linear.py, layers/quantized_linear.py); the shared expert's pair and its gate [hidden];
        with `biases` (router [E], gate_up [E, 2 x width], down [E, hidden])."""
        if tuple(router.shape) != tuple(self.router.shape) or len(experts) != self.num_experts:
            raise ValueError(f"a router {tuple(router.shape)} and {len(experts)} experts for {self.num_experts}")
        if (shared is None) != (self.shared_gate is None):
            raise ValueError("the shared expert and its gate come together")
        if (biases is None) == self.biases:
            raise ValueError(f"this mixture {'has' if self.biases else 'has no'} biases")
        self.router = nn.Parameter(router.float().contiguous(), False)
        if biases is not None:
            router_bias, gate_up_bias, down_bias = biases
            self.router_bias = router_bias.double().reshape(self.num_experts).contiguous()
            self.gate_up_bias = gate_up_bias.float().reshape(self.num_experts, -1).contiguous()
            self.down_bias = down_bias.float().reshape(self.num_experts, -1).contiguous()
        self.gate_up = nn.ModuleList(gate_up for gate_up, _ in experts)
        self.down = nn.ModuleList(down for _, down in experts)
        if shared is not None:
            self.shared_gate_up, self.shared_down = shared
            self.shared_gate = nn.Parameter(shared_gate.float().contiguous(), False)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> float32 [T, E]. The product runs in float64, rounded to float32: MKL's float32 product
        gives a row other bits at other row counts (a token's experts and weights would depend on its step),
        while float64's differences are below float32's rounding (a router of 2,048 x 128 at 512 rows: 4 ms
        against float32's 2 ms, on 2 cores)."""
        # the float64 copy of the weights is made per call (2 MB a layer), not kept: 96 MiB for Qwen3-30B-A3B
        return F.linear(x.double(), self.router.double(), self.router_bias).float()

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """One expert's gated MLP over its tokens x [n, hidden] -> [n, hidden] (its biases added where it has them)."""
        gate_up = self.gate_up[expert].forward(x)  # [n, 2 x width]
        if self.gate_up_bias is not None:
            gate_up = gate_up + self.gate_up_bias[expert]
        y = self.down[expert].forward(self.activation(gate_up))
        return y if self.down_bias is None else y + self.down_bias[expert]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden] in x's dtype (the experts' sums in float32)."""
        tokens = x.shape[0]
        weights, ids = route(self.router_logits(x), self.k, self.normalize, self.scale, self.softmax_after_topk)
        flat = ids.reshape(-1)  # [T * k] expert of each (token, choice), token-major
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, each group in token order
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // self.k  # [T * k] the token of each sorted pair
        weight_of = weights.reshape(-1)[order].unsqueeze(1)  # [T * k, 1]
        out = torch.zeros(tokens, x.shape[1], dtype=torch.float32, device=x.device)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = token_of[start : start + count]
            y = self._expert(expert, x[rows])  # [count, hidden]
            out.index_add_(0, rows, y.float() * weight_of[start : start + count])
            start += count
        if self.shared_gate_up is not None:
            shared = self.shared_down.forward(self.activation(self.shared_gate_up.forward(x))).float()
            out += shared * torch.sigmoid(x.float() @ self.shared_gate).unsqueeze(1)
        return out.to(x.dtype)
