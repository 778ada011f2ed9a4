"""What verifying speculative proposals costs against a plain decode step, on the bundled GGUF under
`--quantization auto`: the runner's execute() for one generated row against a chunk of 5 generated rows (the
last token and 4 proposals, with the logits after each, as LLMEngine.step builds it), alternating, broken down
into the native decoder, the LM head (compute_logits) and sampling (one greedy row, against the up to 5 rounds
of one row that Speculator.verify samples); then the native decoder and the products alone for 1 to 8
rows. With --baseline-ref, every measure alternates between the native library built from that git revision's
C sources and the working tree's (same flags, same process, same weights).

    .venv/bin/python benchmarks/verify_cost.py [--reps 60] [--baseline-ref HEAD]

Prints one JSON object (milliseconds, medians over the repetitions).
"""

import argparse
import ctypes
import json
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from tokenmill import LLM, native
from tokenmill.runner.model_runner import StepChunk
from tokenmill.runner.sampler import SamplingRow
from tokenmill.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
PROMPT_TOKENS = 128
DRAFT_ROWS = 5  # the last sampled token and 4 proposals


def baseline_library(ref: str, current: ctypes.CDLL) -> ctypes.CDLL:
    """The native library built from `ref`'s C sources with this tree's flags; the functions used here declared
    as the current library declares them."""
    tmp = Path(tempfile.mkdtemp(prefix="verify_cost_"))
    sources = []
    for source in native._SOURCES:
        relative = source.relative_to(ROOT).as_posix()
        text = subprocess.run(["git", "show", f"{ref}:{relative}"], cwd=ROOT, capture_output=True, check=True).stdout
        (tmp / source.name).write_bytes(text)
        sources.append(tmp / source.name)
    saved, native._SOURCES = native._SOURCES, sources
    try:
        lib = ctypes.CDLL(str(native._build()))
    finally:
        native._SOURCES = saved
    for name in ("tm_llama_decode", "tm_qmatmul", "tm_set_threads", "tm_vector_path"):
        if not hasattr(current, name) or not hasattr(lib, name):  # a library from before or after a rename
            continue
        getattr(lib, name).argtypes = getattr(current, name).argtypes
        getattr(lib, name).restype = getattr(current, name).restype
    lib.tm_set_threads(torch.get_num_threads())
    return lib


def clock(fn: Callable, *args) -> tuple[float, object]:
    """(milliseconds, result) of fn(*args)"""
    start = time.perf_counter()
    result = fn(*args)
    return (time.perf_counter() - start) * 1000, result


def median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--baseline-ref", default=None, help="a git revision whose native library to compare")
    args = parser.parse_args()
    llm = LLM(quantization="auto")
    engine, runner = llm.engine, llm.engine.runner
    decoder, model = runner.decode_backend, runner.model
    if decoder is None:
        raise SystemExit("the native kernels are not built here: nothing to measure")
    libs = {"new": decoder.lib}
    if args.baseline_ref:
        libs = {"old": baseline_library(args.baseline_ref, decoder.lib), "new": decoder.lib}

    def use(lib: ctypes.CDLL) -> None:
        decoder.lib = lib
        if hasattr(model.lm_head, "_lib"):
            model.lm_head._lib = lib

    # one sequence's 128 prompt tokens in the cache, in blocks of its own (the engine is idle: none is in use)
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 10000, size=PROMPT_TOKENS).tolist()
    bs = runner.block_size
    table = list(range(1, (PROMPT_TOKENS + DRAFT_ROWS) // bs + 2))
    runner.execute([StepChunk(prompt, 0, table)])
    tokens = rng.integers(100, 10000, size=DRAFT_ROWS).tolist()
    one = [StepChunk(tokens[:1], PROMPT_TOKENS, table, prompt_len=PROMPT_TOKENS)]
    five = [
        StepChunk(tokens, PROMPT_TOKENS, table, want_last_logits=False, want_all_logits=True, prompt_len=PROMPT_TOKENS)
    ]
    greedy = SamplingParams(temperature=0.0)
    sampler = engine.sampler

    def sample_one(logits: torch.Tensor) -> None:
        sampler.sample(logits, [SamplingRow(0, 0, greedy, prompt, [], [], None)])

    def sample_rounds(logits: torch.Tensor) -> None:  # as Speculator.verify: one position at a time
        for position in range(logits.shape[0]):
            sample_one(torch.stack([logits[position]]))

    # the step's parts, timed by wrapping the decoder's forward and the head
    parts: dict[str, list[float]] = {}

    def wrap(name: str, fn: Callable) -> Callable:
        def wrapper(*a, **kw):
            start = time.perf_counter()
            out = fn(*a, **kw)
            parts[name].append((time.perf_counter() - start) * 1000)
            return out

        return wrapper

    forward, compute_logits = decoder.forward, model.compute_logits
    decoder.forward = wrap("native", forward)
    model.compute_logits = wrap("head", compute_logits)
    step: dict[str, dict[str, list[float]]] = {}
    for lib_name in libs:
        for case in ("1 row", f"{DRAFT_ROWS} rows"):
            step[f"{lib_name} {case}"] = {k: [] for k in ("execute", "native", "head", "sampling", "total")}
    names = list(libs)
    for rep in range(args.reps + 2):  # two warm-up rounds
        for lib_name in names[rep % len(names) :] + names[: rep % len(names)]:  # each first in turn
            use(libs[lib_name])
            for case, chunks in (("1 row", one), (f"{DRAFT_ROWS} rows", five)):
                parts["native"], parts["head"] = [], []
                execute_ms, out = clock(runner.execute, chunks)
                if len(chunks[0].token_ids) == 1:
                    sampling_ms, _ = clock(sample_one, out.last_logits)
                else:
                    sampling_ms, _ = clock(sample_rounds, out.all_logits[0])
                if rep < 2:
                    continue
                record = step[f"{lib_name} {case}"]
                record["execute"].append(execute_ms)
                record["native"].append(sum(parts["native"]))
                record["head"].append(sum(parts["head"]))
                record["sampling"].append(sampling_ms)
                record["total"].append(execute_ms + sampling_ms)
    decoder.forward, model.compute_logits = forward, compute_logits

    # the native decoder and the products alone, by row count (the cache slots after the prompt, rewritten)
    kernels: dict[str, dict[str, list[float]]] = {}
    layer = model.layers[0]
    weights = {
        "qkv": layer.self_attn.qkv_proj,
        "gate_up": layer.mlp.gate_up_proj,
        "down": layer.mlp.down_proj,
        "head": model.lm_head,
    }
    rows = [1, 2, 3, 4, 5, 6, 8]
    inputs = {m: runner._prepare([StepChunk([tokens[0]], PROMPT_TOKENS + i, table) for i in range(m)]) for m in rows}
    for rep in range(args.reps + 2):
        for lib_name in names[rep % len(names) :] + names[: rep % len(names)]:
            lib = libs[lib_name]
            use(lib)
            for w in weights.values():
                if hasattr(w, "_lib"):
                    w._lib = lib
            for m in rows:
                timings = {"decoder": clock(decoder.forward, *inputs[m])[0]}
                for name, w in weights.items():
                    timings[name] = clock(w, torch.randn(m, w.in_features))[0]
                if rep < 2:
                    continue
                for name, ms in timings.items():
                    kernels.setdefault(f"{lib_name} {name}", {}).setdefault(str(m), []).append(ms)
    use(libs["new"])
    for w in weights.values():
        if hasattr(w, "_lib"):
            w._lib = libs["new"]

    result: dict = {
        "bench": "verify_cost",
        "vector_path": libs["new"].tm_vector_path().decode(),
        "threads": torch.get_num_threads(),
        "reps": args.reps,
        "baseline_ref": args.baseline_ref,
        "step_ms": {case: {k: median(v) for k, v in record.items()} for case, record in step.items()},
        "kernel_ms_by_rows": {name: {m: median(v) for m, v in by_m.items()} for name, by_m in kernels.items()},
    }
    for lib_name in libs:
        one_total = statistics.median(step[f"{lib_name} 1 row"]["total"])
        five_total = statistics.median(step[f"{lib_name} {DRAFT_ROWS} rows"]["total"])
        result[f"{lib_name} ratio_{DRAFT_ROWS}_rows_to_1"] = round(five_total / one_total, 2)
        # the fastest repetitions: less disturbed by other processes on a shared machine
        best = min(step[f"{lib_name} {DRAFT_ROWS} rows"]["total"]) / min(step[f"{lib_name} 1 row"]["total"])
        result[f"{lib_name} ratio_{DRAFT_ROWS}_rows_to_1_fastest"] = round(best, 2)
    print(json.dumps(result, indent=1), flush=True)


if __name__ == "__main__":
    main()
