"""tokenmill beside llama.cpp on the same GGUF, in one run, alternating, so both see the same machine state.

    .venv/bin/python benchmarks/side_by_side.py --peers-python .venv-peers/bin/python [--reps 3] [--with-hf]
        [--no-gemma]

Each repetition runs, in turn: the offline workload (tokenmill auto, tokenmill float32, llama.cpp), one request
of 128 + 128 tokens, one 512-token prefill, and, for tokenmill, `serve` from start to ready plus a streaming load
(`tokenmill bench serve`, 16 clients) with the server's peak resident memory; then, on Gemma 3 270M's GGUF
(Q4_K_M), the offline workload and one request of 128 + 128 tokens, tokenmill auto beside llama.cpp. It prints
every result as a JSON line, then the medians and the ratios as a markdown table for benchmarks/README.md: the
ratio of the two medians, and the median of the ratios of each repetition ("paired"), the steadier one on a
drifting machine.
"""

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from local_server import free_port, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def model_path() -> str:
    from tokenmill.loader.model_path import bundled_model_path

    return str(bundled_model_path())


def gemma_path() -> str:
    from tokenmill.loader.model_path import gemma3_270m_path

    return str(gemma3_270m_path())


def run_json(cmd: list[str]) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(result), flush=True)
    return result


def serve_run(quantization: str) -> dict:
    """Start `tokenmill serve`, time it to ready, put the streaming load on it, read its peak memory."""
    port = free_port()
    start = time.monotonic()
    proc = subprocess.Popen(
        [str(BIN / "tokenmill"), "serve", "--port", str(port), "--quantization", quantization],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url)
    try:
        ready_s = time.monotonic() - start
        load = run_json([str(BIN / "tokenmill"), "bench", "serve", "--url", url, "--concurrency", "16", "--json"])
        peak_kib = 0
        for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                peak_kib = int(line.split()[1])
    finally:  # never leave a server behind, even when the load generator fails
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    result = {
        "bench": "serve-start",
        "engine": f"tokenmill {quantization}",
        "ready_s": round(ready_s, 3),
        "peak_rss_mib": round(peak_kib / 1024, 1),
        "serve": load,
    }
    print(json.dumps(result), flush=True)
    return result


def median(results: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in results)


def paired(ours: list[dict], theirs: list[dict], key: str, higher_is_better: bool = True) -> str:
    """Median over repetitions of tokenmill's figure over the peer's from the same repetition (the two ran back to
    back): steadier than the ratio of the two medians on a machine whose speed drifts between repetitions."""
    ratios = [(a[key] / b[key]) if higher_is_better else (b[key] / a[key]) for a, b in zip(ours, theirs, strict=True)]
    return f"paired {statistics.median(ratios):.2f}x ({', '.join(f'{r:.2f}' for r in ratios)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--peers-python", default=str(ROOT / ".venv-peers" / "bin" / "python"))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--with-hf", action="store_true", help="also HF transformers, one request at a time")
    parser.add_argument("--no-gemma", action="store_true", help="only the bundled model")
    args = parser.parse_args()
    model = model_path()
    tm = [str(BIN / "tokenmill"), "bench"]
    peer = [args.peers_python, str(ROOT / "benchmarks" / "peers" / "llamacpp_peer.py"), "--model", model]
    gemma = None if args.no_gemma else gemma_path()
    gemma_peer = [args.peers_python, str(ROOT / "benchmarks" / "peers" / "llamacpp_peer.py"), "--model", str(gemma)]
    runs: dict[str, list[dict]] = {}

    def add(name: str, result: dict) -> None:
        runs.setdefault(name, []).append(result)

    for _ in range(args.reps):
        add("offline auto", run_json([*tm, "offline", "--quantization", "auto", "--json"]))
        add("offline llama.cpp", run_json([*peer, "offline"]))
        add("offline float32", run_json([*tm, "offline", "--quantization", "none", "--json"]))
        add("latency auto", run_json([*tm, "latency", "--quantization", "auto", "--json"]))
        add("latency llama.cpp", run_json([*peer, "latency"]))
        add(
            "prefill auto",
            run_json([*tm, "latency", "--quantization", "auto", "--input-len", "512", "--output-len", "1", "--json"]),
        )
        add(
            "prefill float32",
            run_json([*tm, "latency", "--quantization", "none", "--input-len", "512", "--output-len", "1", "--json"]),
        )
        add("prefill llama.cpp", run_json([*peer, "latency", "--input-len", "512", "--output-len", "1"]))
        add("serve auto", serve_run("auto"))
        if gemma is not None:
            add("gemma offline auto", run_json([*tm, "offline", "--model", gemma, "--quantization", "auto", "--json"]))
            add("gemma offline llama.cpp", run_json([*gemma_peer, "offline"]))
            add("gemma latency auto", run_json([*tm, "latency", "--model", gemma, "--quantization", "auto", "--json"]))
            add("gemma latency llama.cpp", run_json([*gemma_peer, "latency"]))
    if args.with_hf:
        hf = [args.peers_python, str(ROOT / "benchmarks" / "peers" / "hf_peer.py"), "--model", model]
        add("latency hf", run_json(hf))

    def versus(name: str, ours: str, theirs: str, key: str, lower_is_better: bool = False) -> tuple:
        """One table row: tokenmill's median, llama.cpp's, the ratio of the two and, where the two ran in the same
        repetitions, the paired ratios."""
        a, b = median(runs[ours], key), median(runs[theirs], key)
        ratio = f"{b / a:.2f}x faster" if lower_is_better else f"{a / b:.2f}x"
        if ours.endswith("auto"):
            ratio += "; " + paired(runs[ours], runs[theirs], key, higher_is_better=not lower_is_better)
        return name, a, b, ratio

    rows = [
        versus("offline-32 seconds (auto)", "offline auto", "offline llama.cpp", "seconds", lower_is_better=True),
        versus(
            "offline-32 seconds (float32, exact)",
            "offline float32",
            "offline llama.cpp",
            "seconds",
            lower_is_better=True,
        ),
        versus("decode tok/s, 1 request, 128+128 (auto)", "latency auto", "latency llama.cpp", "decode_tok_s"),
        versus("prefill tok/s, 512-token prompt (auto)", "prefill auto", "prefill llama.cpp", "prefill_tok_s"),
        versus("prefill tok/s, 512-token prompt (float32)", "prefill float32", "prefill llama.cpp", "prefill_tok_s"),
        (
            "serve: start to ready, s (auto)",
            median(runs["serve auto"], "ready_s"),
            median(runs["offline llama.cpp"], "load_seconds"),
            "llama.cpp: model load only",
        ),
        ("serve: peak resident memory, MiB (auto)", median(runs["serve auto"], "peak_rss_mib"), None, ""),
    ]
    if gemma is not None:
        rows += [
            versus(
                "Gemma 3 270M offline-32 seconds (auto)",
                "gemma offline auto",
                "gemma offline llama.cpp",
                "seconds",
                lower_is_better=True,
            ),
            versus(
                "Gemma 3 270M decode tok/s, 1 request, 128+128 (auto)",
                "gemma latency auto",
                "gemma latency llama.cpp",
                "decode_tok_s",
            ),
        ]
    print()
    print(
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; {date.today()}; "
        f"{args.reps} repetitions, medians"
    )
    print("| measure | tokenmill | llama.cpp | ratio |")
    print("| --- | --- | --- | --- |")
    for name, ours, theirs, ratio in rows:
        print(f"| {name} | {ours} | {'' if theirs is None else theirs} | {ratio} |")


if __name__ == "__main__":
    main()
