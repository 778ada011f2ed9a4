"""Makes tests/data/moe_llamacpp.json again: llama.cpp's own converter and llama.cpp on tests/test_moe.py's tiny
mixtures of experts, so that `make test` can check tokenmill against llama.cpp without either of them.

For each case (the test's models with the bundled SmolLM2 tokenizer's 49,152 ids, which the converter recognises):
the builder's weights (tests/gguf_builder.py, numpy's seeded generator: the same floats everywhere) are saved as
a Hugging Face directory (config.json from transformers' config class, one safetensors tensor per expert as the
Hub has them, gpt-oss's experts as MXFP4 blocks and scales, SmolLM2's tokenizer.json), `convert_hf_to_gguf.py
--outtype f32` (gpt-oss: `--outtype q8_0`, its experts kept MXFP4, as ggml-org's released file has it; the
converter from llama-cpp-python's source distribution, the llama.cpp that llama-cpp-python 0.3.36 builds) makes
the GGUF, and llama.cpp runs it greedily
from the test's prompt. Recorded per case: every tensor the converter wrote (name, type, shape, SHA-256 of its
bytes: the test checks that tests/gguf_builder.py writes the same file) and llama.cpp's greedy tokens.

Runs in the peers' environment, with tokenmill's source on the path (for the builder and the tokenizer):

    make moe-reference    # = .venv-peers/bin/python tests/data/make_moe_llamacpp.py --converter DIR --tokenizer GGUF
"""

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from llama_cpp import Llama
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from tests.moe_cases import (  # noqa: E402
    CASES,
    GPT_OSS,
    GREEDY_TOKENS,
    LLAMACPP_CASES,
    LLAMACPP_VOCAB,
    PROMPT,
    gpt_oss_hf_config,
    hf_config,
    tensor_digests,
    write_mxfp4_checkpoint,
)
from tokenmill.loader.gguf_file import GGUFFile  # noqa: E402
from tokenmill.tokenizer.gguf_tokenizer import Tokenizer  # noqa: E402


def write_tokenizer(folder: Path, tokenizer_gguf: Path) -> None:
    Tokenizer.from_gguf(GGUFFile(tokenizer_gguf)).backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
        )
    )


def write_gpt_oss_checkpoint(folder: Path, tokenizer_gguf: Path) -> None:
    """gpt-oss as the Hub ships it: its experts MXFP4 blocks and scales (which the converter keeps as GGUF MXFP4)."""
    model = replace(GPT_OSS, vocab_size=LLAMACPP_VOCAB, weights={})
    model.make_weights()
    config = gpt_oss_hf_config(model)
    config.bos_token_id, config.eos_token_id = 1, 2
    source = folder.with_name(folder.name + "-config")
    source.mkdir()
    config.save_pretrained(source)
    write_tokenizer(source, tokenizer_gguf)
    folder.rmdir()
    write_mxfp4_checkpoint(model, source, folder)
    (folder / "tokenizer_config.json").write_bytes((source / "tokenizer_config.json").read_bytes())


def write_checkpoint(name: str, folder: Path, tokenizer_gguf: Path) -> None:
    if name == "gpt-oss":
        write_gpt_oss_checkpoint(folder, tokenizer_gguf)
        return
    model = replace(CASES[name], vocab_size=LLAMACPP_VOCAB, weights={})
    model.make_weights()
    config = hf_config(model)
    config.architectures = [
        {"qwen3moe": "Qwen3MoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}.get(
            model.arch, "MixtralForCausalLM"
        )
    ]
    config.bos_token_id, config.eos_token_id = 1, 2
    config.save_pretrained(folder)
    weights = {n: torch.from_numpy(np.ascontiguousarray(w)) for n, w in model.weights.items()}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(folder, tokenizer_gguf)


def greedy(path: Path) -> list[int]:
    llm = Llama(
        str(path), n_ctx=256, n_threads=2, n_batch=64, verbose=False, logits_all=True
    )  # every row kept: scores[-1] is the last
    llm.eval(PROMPT)
    tokens = []
    for _ in range(GREEDY_TOKENS):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        tokens.append(token)
        llm.eval([token])
    return tokens


# gpt-oss's file as ggml-org releases it: every matrix but the experts' Q8_0 (the quantizer's MXFP4_MOE mix)
OUTTYPES = {"gpt-oss": "q8_0"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--converter", required=True, help="llama.cpp's folder holding convert_hf_to_gguf.py")
    parser.add_argument("--tokenizer", required=True, help="the bundled SmolLM2 GGUF (its tokenizer)")
    parser.add_argument("--out", default=str(ROOT / "tests" / "data" / "moe_llamacpp.json"))
    parser.add_argument("--only", nargs="*", help="make these cases again, keep the others' records")
    args = parser.parse_args()
    out = Path(args.out)
    results = json.loads(out.read_text()) if args.only and out.is_file() else {}
    for name in sorted(args.only or [*LLAMACPP_CASES, "gpt-oss"]):
        outtype = OUTTYPES.get(name, "f32")
        with tempfile.TemporaryDirectory() as tmp:
            folder, gguf_path = Path(tmp) / name, Path(tmp) / f"{name}.gguf"
            folder.mkdir()
            write_checkpoint(name, folder, Path(args.tokenizer))
            done = subprocess.run(
                [sys.executable, str(Path(args.converter) / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype,
                 "--outfile", str(gguf_path)],
                check=False, capture_output=True, text=True,
            )  # fmt: skip
            if done.returncode != 0:
                raise SystemExit(f"{name}: convert_hf_to_gguf.py failed:\n{done.stdout[-3000:]}{done.stderr[-6000:]}")
            results[name] = {"tensors": tensor_digests(gguf_path), "greedy": greedy(gguf_path)}
            print(name, results[name]["greedy"], flush=True)
    out.write_text(json.dumps(dict(sorted(results.items())), indent=1) + "\n")


if __name__ == "__main__":
    main()
