"""tokenmill beside llama.cpp on GGUFs of real models' shapes (random weights, quantized by llama.cpp's own
quantizer: benchmarks/synth_model.py, a copy of the workplace's ../shared/bench/synth_model.py), in one run,
alternating, as side_by_side.py does for the bundled model.

    .venv/bin/python benchmarks/real_size.py --peers-python .venv-peers/bin/python [--shapes smollm2-1.7b]
        [--quant Q4_K_M] [--reps 3] [--offline-reps 1] [--no-offline]

A missing file is written first into ~/.cache/tokenmill/synth (with the peers' Python: numpy, gguf, llama-cpp-python;
the 1.7B shape takes about two minutes, the 8B one about fifteen and 16 GB of disk for a while). Per repetition:
a 512-token prompt (time to first token), one sequence decoding 64 tokens after a 128-token prompt, each engine in
its own process, whose peak resident memory (ru_maxrss) and load time are recorded; once or --offline-reps times,
the offline workload (offline-32). Decode's achieved bandwidth is the weight bytes read per token (every tensor of
the file but the embedding table, which a decoded token reads one row of; a tied table is the LM head, read
whole) times tokens/s, against the machine's streaming read bandwidth (torch, 2 threads, the best of 5 sums of a
2 GiB tensor). Prints JSON lines, then a markdown table for benchmarks/README.md.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from moe_shapes import SHAPES as MOE_SHAPES  # noqa: E402

BIN = Path(sys.executable).parent
SYNTH_DIR = Path.home() / ".cache" / "tokenmill" / "synth"
KV_BLOCKS = 64  # tokenmill's KV cache for the single-request runs: 1,024 tokens (llama.cpp sizes its own to fit)


def synth_file(peers_python: str, shape: str, quant: str) -> Path:
    if shape in MOE_SHAPES:  # benchmarks/moe_shapes.py writes these in the model's own mix: `quant` does not apply
        path = SYNTH_DIR / f"synth-{shape}-{MOE_SHAPES[shape].mix}.gguf"
        if not path.exists():
            subprocess.run([sys.executable, str(ROOT / "benchmarks" / "moe_shapes.py"), "--shape", shape], check=True)
        return path
    path = SYNTH_DIR / f"synth-{shape}-{quant}.gguf"
    if not path.exists():
        from tokenmill.loader.model_path import bundled_model_path

        command = [peers_python, str(ROOT / "benchmarks" / "synth_model.py"), "--shape", shape, "--quantize", quant]
        command += ["--out", str(SYNTH_DIR), "--tokenizer-gguf", str(bundled_model_path())]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return path


def measured(command: list[str]) -> dict:
    """Run `command` (it prints a JSON line last) -> that JSON with the process's peak RSS and wall time added."""
    start = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(command)} failed")
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_rss_mib"] = round(usage.ru_maxrss / 1024, 1)
    result["wall_s"] = round(time.monotonic() - start, 2)
    print(json.dumps(result), flush=True)
    return result


def weight_bytes_per_token(path: Path) -> int:
    """Bytes of weights a decoded token reads: all tensors but an untied embedding table's (one row), and of a
    mixture's expert tensors the chosen experts' share (experts used / experts)."""
    from tokenmill.loader.gguf_file import GGUFFile

    gguf = GGUFFile(path)
    tied = "output.weight" not in gguf.tensors
    arch = gguf.metadata["general.architecture"]
    experts = gguf.metadata.get(f"{arch}.expert_count", 0)
    share = gguf.metadata[f"{arch}.expert_used_count"] / experts if experts else 1.0
    total = 0.0
    for name, t in gguf.tensors.items():
        if tied or name != "token_embd.weight":
            total += t.data.nbytes * (share if "_exps." in name else 1.0)
    return int(total)


STREAMING = """
import time, torch
torch.set_num_threads(2)
x = torch.ones(2**29, dtype=torch.float32)  # 2 GiB
best = 0.0
for _ in range(5):
    start = time.perf_counter()
    x.sum()
    best = max(best, x.numel() * 4 / (time.perf_counter() - start) / 1e9)
print(best)
"""


def streaming_gb_s() -> float:
    """In a process of its own: a child's peak RSS (ru_maxrss) starts from its parent's when it is forked, so
    the engines' figures would all read at least this 2 GiB tensor's size if the parent held it."""
    out = subprocess.run([sys.executable, "-c", STREAMING], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers-python", default=str(ROOT / ".venv-peers" / "bin" / "python"))
    parser.add_argument(
        "--shapes", default="smollm2-1.7b", help="comma-separated synth_model.py or moe_shapes.py shapes"
    )
    parser.add_argument("--quant", default="Q4_K_M")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--offline-reps", type=int, default=1)
    parser.add_argument("--no-offline", action="store_true")
    args = parser.parse_args()
    bandwidth = streaming_gb_s()
    print(json.dumps({"bench": "streaming read", "gb_s": round(bandwidth, 1)}), flush=True)
    rows = []
    for shape in args.shapes.split(","):
        path = synth_file(args.peers_python, shape, args.quant)
        tm = [str(BIN / "tokenmill"), "bench", "latency", "--model", str(path), "--json"]
        tm += ["--quantization", "auto", "--num-kv-blocks", str(KV_BLOCKS), "--runs", "3"]
        peer = [args.peers_python, str(ROOT / "benchmarks" / "peers" / "llamacpp_peer.py"), "--model", str(path)]
        runs: dict[str, list[dict]] = {}
        for _ in range(args.reps):
            for name, command in (
                ("prefill tokenmill", [*tm, "--input-len", "512", "--output-len", "1"]),
                ("prefill llama.cpp", [*peer, "latency", "--input-len", "512", "--output-len", "1", "--runs", "3"]),
                ("decode tokenmill", [*tm, "--input-len", "128", "--output-len", "64"]),
                ("decode llama.cpp", [*peer, "latency", "--input-len", "128", "--output-len", "64", "--runs", "3"]),
            ):
                runs.setdefault(name, []).append(measured(command))
        if not args.no_offline:
            for _ in range(args.offline_reps):
                offline = [str(BIN / "tokenmill"), "bench", "offline", "--model", str(path), "--json"]
                runs.setdefault("offline tokenmill", []).append(measured([*offline, "--quantization", "auto"]))
                runs.setdefault("offline llama.cpp", []).append(measured([*peer, "offline"]))
        rows.append(table(shape, path, runs, weight_bytes_per_token(path), bandwidth))
    print("| shape | measure | tokenmill (auto) | llama.cpp 0.3.36 | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print("\n".join(row))


def table(shape: str, path: Path, runs: dict[str, list[dict]], per_token: int, bandwidth: float) -> list[str]:
    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    def paired(ours: str, theirs: str, key: str, higher: bool = True) -> str:
        ratios = [a[key] / b[key] if higher else b[key] / a[key] for a, b in zip(runs[ours], runs[theirs], strict=True)]
        return f"{statistics.median(ratios):.2f}x (paired: {', '.join(f'{r:.2f}' for r in ratios)})"

    file_mib = path.stat().st_size / 2**20
    lines = [
        f"| {shape} ({file_mib:,.0f} MiB) | peak RSS, MiB (512-token prompt run) | "
        f"{med('prefill tokenmill', 'peak_rss_mib'):,.0f} | {med('prefill llama.cpp', 'peak_rss_mib'):,.0f} | "
        f"file + {med('prefill tokenmill', 'peak_rss_mib') - file_mib:,.0f} / + "
        f"{med('prefill llama.cpp', 'peak_rss_mib') - file_mib:,.0f} MiB |"
    ]
    lines.append(
        f"| | load, s | {med('prefill tokenmill', 'load_seconds'):.2f} | "
        f"{med('prefill llama.cpp', 'load_seconds'):.2f} | |"
    )
    lines.append(
        f"| | 512-token prefill, tok/s | {med('prefill tokenmill', 'prefill_tok_s'):.1f} | "
        f"{med('prefill llama.cpp', 'prefill_tok_s'):.1f} | "
        f"{paired('prefill tokenmill', 'prefill llama.cpp', 'prefill_tok_s')} |"
    )
    ours, theirs = med("decode tokenmill", "decode_tok_s"), med("decode llama.cpp", "decode_tok_s")
    gb = per_token / 1e9
    lines.append(
        f"| | decode tok/s, one sequence ({gb:.2f} GB of weights a token; {bandwidth:.1f} GB/s streaming) | "
        f"{ours:.2f} ({ours * gb / bandwidth:.0%} of it) | {theirs:.2f} ({theirs * gb / bandwidth:.0%}) | "
        f"{paired('decode tokenmill', 'decode llama.cpp', 'decode_tok_s')} |"
    )
    if "offline tokenmill" in runs:
        lines.append(
            f"| | offline-32, s | {med('offline tokenmill', 'seconds'):.1f} | "
            f"{med('offline llama.cpp', 'seconds'):.1f} | "
            f"{paired('offline tokenmill', 'offline llama.cpp', 'seconds', higher=False)} |"
        )
    return lines


if __name__ == "__main__":
    main()
