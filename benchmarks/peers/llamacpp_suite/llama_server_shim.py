"""Stands where llama.cpp's server tests expect the llama-server binary ($LLAMA_SERVER_BIN_PATH): takes
llama-server's arguments, as the tests' own ServerProcess.start() writes them, and runs `tokenmill serve` with
tokenmill's. Only the launch changes: the suite's ServerProcess still waits for /health, sends every request and
stops the process.

No network here, so every model the tests name (--hf-repo, --hf-file, --model-url, --model) is the model in
$TOKENMILL_SUITE_MODEL (the bundled SmolLM2-135M-Instruct), served under the test's --alias. llama-server's options
become tokenmill's where tokenmill has them (below); those that only steer llama.cpp's internals are dropped (each
with why); every other one is passed on as it is, so a feature tokenmill lacks fails its test visibly."""

import json
import os
import sys
import tempfile

# options whose value names the model file or where it comes from: the stand-in model is served instead
MODEL_SOURCES = {"--hf-repo", "--hf-file", "--model-url", "--model", "-m", "--model-draft"}
TRANSLATED = {  # llama-server's option -> tokenmill's (each takes one value)
    "--port": "--port",
    "--host": "--host",
    "--seed": "--seed",
    "--api-key": "--api-key",
    "--slot-save-path": "--slot-save-path",
    "--batch-size": "--max-num-batched-tokens",  # the tokens one step (llama_decode) takes
}
DROPPED_FLAGS = {
    "--offline": "no Hub downloads here either: the model is a local file",
    "--cont-batching": "tokenmill always batches continuously",
    "--embedding": "tokenmill serves embeddings from every model",
    "--kv-unified": "tokenmill's KV cache is always one pool shared by every sequence",
    "--swa-full": "llama.cpp's sliding-window cache size; tokenmill sizes its window pool itself",
    "--jinja": "tokenmill always renders the model's Jinja chat template",
    "--no-jinja": "llama.cpp's built-in template handling; tokenmill always renders the Jinja template",
    "--backend_sampling": "llama.cpp samples on its compute backend; tokenmill's sampler has one place",
}
DROPPED_VALUES = {
    "--ubatch-size": "llama.cpp's physical micro-batch inside a decode",
    "--threads": "llama.cpp's thread count; tokenmill's kernels use the machine's cores",
    "--n-gpu-layers": "layers offloaded to a GPU: the tests run on the CPU",
    "-fa": "llama.cpp's flash-attention switch",
}
KV_TYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}
LLAMACPP_SAMPLING = {"top_k": 40, "top_p": 0.95, "min_p": 0.05}  # llama-server's defaults beside --temp


def tokenmill_args(args: list[str]) -> list[str]:
    out = ["--model", os.environ["TOKENMILL_SUITE_MODEL"]]
    values: dict[str, str] = {}
    rest = list(args)
    while rest:
        arg = rest.pop(0)
        if arg in DROPPED_FLAGS:
            continue
        if arg in DROPPED_VALUES or arg in MODEL_SOURCES:
            rest.pop(0)
        elif arg in TRANSLATED:
            out += [TRANSLATED[arg], rest.pop(0)]
        elif arg in ("--temp", "--ctx-size", "--parallel", "--n-predict", "-ctk", "-ctv", "--cors-origins"):
            values[arg] = rest.pop(0)
        elif arg == "--alias":  # llama-server's names, comma-separated; its id is the first in sorted order
            out += ["--served-model-name", *sorted({n.strip() for n in rest.pop(0).split(",") if n.strip()})]
        elif arg == "--metrics":
            values[arg] = "on"
        elif arg == "--reasoning-format":  # none: thinking stays in the answer; the others read it apart (auto)
            if rest.pop(0) == "none":
                out += ["--reasoning-parser", "none"]
        elif arg == "--verbose":
            out += ["--log-level", "debug"]
        elif arg == "--no-ui":
            out.append("--no-explorer")
        else:
            out.append(arg)
    if "--metrics" not in values:  # llama-server serves /metrics only with --metrics; tokenmill by default
        out.append("--no-metrics")
    slots = int(values.get("--parallel", "1"))
    out += ["--max-num-seqs", str(slots)]
    if "--ctx-size" in values:  # llama-server splits its context between its slots (ctx / parallel each), but
        share = 1 if "--kv-unified" in args else slots  # with --kv-unified every slot may use all of it
        out += ["--max-model-len", str(int(values["--ctx-size"]) // share)]
    if int(values.get("--n-predict", "-1")) > 0:  # the n_predict of a request that names none (or -1)
        out += ["--max-tokens-default", values["--n-predict"]]
    if values.get("-ctk") == values.get("-ctv") and values.get("-ctk") in KV_TYPES:
        out += ["--kv-cache-dtype", KV_TYPES[values["-ctk"]]]
    elif "-ctk" in values or "-ctv" in values:
        out += ["-ctk", values.get("-ctk", ""), "-ctv", values.get("-ctv", "")]  # refused: fails visibly
    origins = [o for o in values.get("--cors-origins", "").split(",") if o and o != "localhost"]
    if origins:  # "localhost" is tokenmill's default (local pages, any port)
        out += ["--allowed-origins", ",".join(origins)]
    if "--temp" in values:  # llama-server's sampling defaults, its --temp among them
        config = {**LLAMACPP_SAMPLING, "temperature": float(values["--temp"])}
        with tempfile.NamedTemporaryFile("w", suffix="-generation_config.json", delete=False) as f:
            json.dump(config, f)
        out += ["--generation-config", f.name]
    return out


def main() -> None:
    command = [os.environ["TOKENMILL_BIN"], "serve", *tokenmill_args(sys.argv[1:])]
    print(f"llama-server shim: {' '.join(command)}", flush=True)
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
