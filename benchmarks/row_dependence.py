"""How torch's CPU operations give a row other last bits depending on the rows beside it (issue 38's sixth session,
benchmarks/README.md): the three that made LoRA rows batch-variant, and what replaced them.

    .venv/bin/python benchmarks/row_dependence.py

JSON lines: "gemm" (torch float32 F.linear: row 0 computed with r rows against alone, 576 x 1536 and 128 x 64),
"sdpa" (a decode row's attention padded by 50 more masked keys against unpadded), "logsumexp" (40 rows of a
49,152-token vocabulary against each row alone, and log_softmax's figure), "lowrank" (native/lowrank.c against
torch's (x @ A^T) @ B^T, ms a call, at the fused projections' shapes).
"""

import json
import time

import torch
import torch.nn.functional as F

from tokenmill.layers.lora import LoRAProjection


def timed_ms(fn, reps: int = 20) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    g = torch.Generator().manual_seed(0)
    for out_f, in_f in [(128, 64), (576, 1536)]:
        w, x = torch.randn(out_f, in_f, generator=g), torch.randn(256, in_f, generator=g)
        alone = F.linear(x[:1], w)[0]
        moved = {r: (F.linear(x[:r], w)[0] - alone).abs().max().item() for r in (2, 3, 5, 8, 16, 64, 128, 256)}
        print(json.dumps({"bench": "gemm", "shape": [out_f, in_f], "row0_vs_alone": moved}))
    q, k, v = (
        torch.randn(1, 32, 1, 64, generator=g),
        torch.randn(1, 8, 300, 64, generator=g),
        torch.randn(1, 8, 300, 64, generator=g),
    )
    plain = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    mask = F.pad(torch.ones(1, 1, 1, 300, dtype=torch.bool), (0, 50))
    padded = F.scaled_dot_product_attention(q, F.pad(k, (0, 0, 0, 50)), F.pad(v, (0, 0, 0, 50)), attn_mask=mask,
                                            enable_gqa=True)  # fmt: skip
    print(json.dumps({"bench": "sdpa", "padded_by_50_vs_unpadded": (padded - plain).abs().max().item()}))
    logits = torch.randn(40, 49152, generator=g) * 4
    lse = (torch.logsumexp(logits, -1) - torch.cat([torch.logsumexp(r[None], -1) for r in logits])).abs().max()
    lsm = (logits.log_softmax(-1) - torch.cat([r[None].log_softmax(-1) for r in logits])).abs().max()
    print(json.dumps({"bench": "logsumexp", "batch_vs_alone": lse.item(), "log_softmax_batch_vs_alone": lsm.item()}))
    for n in (1, 8, 512):
        for inputs, rank, outputs in ((2048, 48, 6144), (2048, 32, 16384), (8192, 16, 2048), (576, 24, 1728)):
            x = torch.randn(n, inputs, generator=g)
            lora = LoRAProjection.of(torch.randn(rank, inputs, generator=g), torch.randn(outputs, rank, generator=g))
            bt = torch.randn(rank, outputs, generator=g)
            line = {"bench": "lowrank", "rows": n, "shape": [inputs, rank, outputs]}
            line |= {"native_ms": round(timed_ms(lambda x=x, lora=lora: lora.product(x)), 4)}
            line |= {"torch_ms": round(timed_ms(lambda x=x, lora=lora, bt=bt: (x @ lora.a.T) @ bt), 4)}
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
