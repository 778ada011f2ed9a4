"""The decode step cost of LoRA adapters (issue 40): a batch of 8 sequences, each with its own adapter (8 different
adapters, every projection: q/k/v/o/gate/up/down), against the same batch with none, on the bundled SmolLM2-135M.

Random adapters of rank 8 and 16 are written as PEFT directories (adapter_config.json, adapter_model.safetensors)
and served by one engine; each measurement runs the 8 sequences' prompts (32 tokens each), then times `--steps`
decode steps one by one (the median is reported), alternating the batch without and with adapters `--rounds`
times so a busy machine's drift falls on both (`best_ms`: each batch's fastest round, for a machine whose load
comes in bursts). Under `auto` (the server's default on the CPU) a row without an
adapter takes the native decoder and a row with one the model's forward (runner/model_runner.py), so its figure is
what a user sees; under float32 both take the forward and the difference is the adapters' products alone. A third
figure splits the two under `auto`: the batch with 8 minimal adapters (rank 1 on one layer's q_proj), which
takes the forward's route at almost none of the products' cost.

    .venv/bin/python benchmarks/lora_batch.py --json     # one JSON object per (quantization, rank)
"""

import argparse
import json
import platform
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from tokenmill import LLM, SamplingParams

BATCH = 8
PROMPT_TOKENS = 32
PROJECTIONS = {  # PEFT module -> (its input width, its output width) from the config's sizes
    "self_attn.q_proj": ("hidden", "q"),
    "self_attn.k_proj": ("hidden", "kv"),
    "self_attn.v_proj": ("hidden", "kv"),
    "self_attn.o_proj": ("q", "hidden"),
    "mlp.gate_proj": ("hidden", "intermediate"),
    "mlp.up_proj": ("hidden", "intermediate"),
    "mlp.down_proj": ("intermediate", "hidden"),
}


def write_adapter(
    folder: Path,
    widths: dict[str, int],
    layers: int,
    rank: int,
    seed: int,
    modules: tuple[str, ...] = tuple(PROJECTIONS),
) -> Path:
    """Random A and B ([r, in], [out, r]) on `modules` of the first `layers` layers, saved as PEFT saves them."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(layers):
        for module in modules:
            fan_in, fan_out = PROJECTIONS[module]
            name = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{name}.lora_A.weight"] = (rng.standard_normal((rank, widths[fan_in])) * 0.02).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = (rng.standard_normal((widths[fan_out], rank)) * 0.02).astype(np.float32)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    targets = sorted({m.split(".")[1] for m in modules})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets, "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def decode_step_ms(llm: LLM, adapters: list[str | None], steps: int, seed: int) -> float:
    """The median time of a decode step of len(adapters) sequences, the i-th with adapters[i]."""
    engine = llm.engine
    rng = np.random.default_rng(seed)
    for name in adapters:
        prompt = rng.integers(100, 10000, size=PROMPT_TOKENS).tolist()
        params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True, lora_name=name)
        engine.add_request(None, {"prompt_token_ids": prompt}, params)
    for _ in range(2):  # the prompts (one step of 256 tokens) and a first decode step
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1000)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the batch without and with adapters")
    parser.add_argument("--ranks", default="8,16")
    parser.add_argument("--quantizations", default="none,auto")
    parser.add_argument("--json", action="store_true", help="JSON lines only")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for quantization in args.quantizations.split(","):
            q = None if quantization == "none" else quantization
            probe = LLM(quantization=q, num_kv_blocks=64)
            c = probe.engine.model_config
            widths = {
                "hidden": c.hidden_size,
                "q": c.num_heads * c.head_dim,
                "kv": c.num_kv_heads * c.head_dim,
                "intermediate": c.intermediate_size,
            }
            probe.close()
            for rank in map(int, args.ranks.split(",")):
                folders = {
                    f"r{rank}-{i}": write_adapter(
                        Path(tmp) / f"{quantization}-r{rank}-{i}", widths, c.num_layers, rank, i
                    )
                    for i in range(BATCH)
                }
                minimal = {  # rank 1 on layer 0's q_proj only: the forward's route, almost none of the products
                    f"min{rank}-{i}": write_adapter(
                        Path(tmp) / f"{quantization}-min{rank}-{i}", widths, 1, 1, i, ("self_attn.q_proj",)
                    )
                    for i in range(BATCH)
                }
                llm = LLM(quantization=q, lora_modules={n: str(p) for n, p in {**folders, **minimal}.items()})
                base_ms, lora_ms, route_ms = [], [], []
                for r in range(args.rounds):
                    base_ms.append(decode_step_ms(llm, [None] * BATCH, args.steps, r))
                    lora_ms.append(decode_step_ms(llm, list(folders), args.steps, r))
                    route_ms.append(decode_step_ms(llm, list(minimal), args.steps, r))
                adapter_mib = sum(llm.engine.loras.loaded[n].nbytes for n in folders) / 2**20
                llm.close()
                row = {
                    "benchmark": "lora_batch",
                    "date": date.today().isoformat(),
                    "machine": f"{platform.processor() or platform.machine()}, {platform.node()}",
                    "model": "SmolLM2-135M-Instruct (bundled)",
                    "quantization": quantization,
                    "rank": rank,
                    "batch": BATCH,
                    "adapters": BATCH,
                    "adapter_weights_mib": round(adapter_mib, 1),
                    "decode_step_ms_no_adapter": round(statistics.median(base_ms), 2),
                    "decode_step_ms_8_adapters": round(statistics.median(lora_ms), 2),
                    "ratio": round(statistics.median(lora_ms) / statistics.median(base_ms), 3),
                    "decode_step_ms_8_minimal_adapters": round(statistics.median(route_ms), 2),
                    # the fastest round of each: what a busy machine's bursts leave untouched
                    "best_ms": [round(min(x), 2) for x in (base_ms, lora_ms, route_ms)],
                    "rounds_no_adapter_ms": [round(x, 2) for x in base_ms],
                    "rounds_8_adapters_ms": [round(x, 2) for x in lora_ms],
                    "rounds_8_minimal_adapters_ms": [round(x, 2) for x in route_ms],
                }
                results.append(row)
                print(json.dumps(row), flush=True)
    if not args.json:
        for r in results:
            print(
                f"{r['quantization']:>5} rank {r['rank']:>2}: {r['decode_step_ms_no_adapter']:.1f} ms without, "
                f"{r['decode_step_ms_8_adapters']:.1f} ms with 8 adapters ({r['ratio']:.2f}x), "
                f"{r['decode_step_ms_8_minimal_adapters']:.1f} ms with 8 minimal ones"
            )


if __name__ == "__main__":
    main()
