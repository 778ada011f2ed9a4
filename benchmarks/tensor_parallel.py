"""The cost of tensor parallelism on this machine: offline-32 and single-request decode at TP 1, 2 and 3.

    .venv/bin/python benchmarks/tensor_parallel.py [--quantization auto none] [--sizes 1 2 3]

Each figure comes from its own `tokenmill bench offline|latency --tensor-parallel-size N --json` process (the
ranks split the machine's cores between them), run one after the other; prints one JSON line per run and a
table of seconds, decode tokens/s and rank 0's time in collectives per step.
"""

import argparse
import json
import subprocess
import sys


def bench(kind: str, size: int, quantization: str) -> dict:
    command = [sys.executable, "-m", "tokenmill", "bench", kind, "--json", "-tp", str(size)]
    command += ["--quantization", quantization]
    if kind == "latency":
        command += ["--input-len", "128", "--output-len", "128", "--runs", "3"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quantization", nargs="+", default=["auto", "none"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 2, 3])
    args = parser.parse_args()
    rows = []
    for quantization in args.quantization:
        for size in args.sizes:
            offline, latency = bench("offline", size, quantization), bench("latency", size, quantization)
            print(json.dumps(offline), json.dumps(latency), sep="\n", flush=True)
            rows.append((quantization, size, offline, latency))
    print(
        "| quantization | TP | offline-32 s | offline collective ms/step | decode tok/s | decode collective ms/step |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for quantization, size, offline, latency in rows:
        print(
            f"| {quantization} | {size} | {offline['seconds']:.2f} | {offline['collective_ms_per_step']:.2f} | "
            f"{latency['decode_tok_s']:.1f} | {latency['collective_ms_per_step']:.2f} |"
        )


if __name__ == "__main__":
    main()
