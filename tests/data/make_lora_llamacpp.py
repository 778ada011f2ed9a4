"""Makes tests/data/lora_llamacpp.json again: llama.cpp's own converters and llama.cpp on tests/test_lora.py's tiny
Llama and two of its PEFT adapters, so that `make test` can check tokenmill's GGUF LoRA against llama.cpp's without
either of them.

The tiny model and the adapters are tests/lora_cases.py's (seeded: the same floats everywhere).
`convert_hf_to_gguf.py --outtype f32` makes the base GGUF, `convert_lora_to_gguf.py --outtype f32` each adapter's
GGUF LoRA (the converters from llama-cpp-python's source distribution: the llama.cpp that the peers' build runs),
and llama-cpp-python decodes greedily from the test's prompt with and without each adapter (`lora_path`). Recorded:
every tensor of each GGUF LoRA (type, shape, SHA-256 of its bytes: the test checks that tests/lora_gguf.py writes
the same file), and llama.cpp's tokens. Checked here as well: tokenmill on the converter's own files gives them.

Runs in tokenmill's environment (PEFT, transformers), the converters and llama.cpp in the peers':

    make lora-reference   # = .venv/bin/python tests/data/make_lora_llamacpp.py --peers-python P --converter DIR
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from tests.lora_cases import ADAPTERS, PROMPT, write_adapter, write_tiny_llama  # noqa: E402
from tests.lora_gguf import gguf_digests  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.loader.model_path import bundled_model_path  # noqa: E402

OUT = Path(__file__).parent / "lora_llamacpp.json"
CASES = ("all8", "qv8rs")  # every projection; and rsLoRA, whose sqrt scale llama.cpp's converter drops
TOKENS = 12
PROMPT_LEN = 24
LLAMACPP_GREEDY = """
import json, sys
import numpy as np
from llama_cpp import Llama
model, lora, prompt, n = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
llm = Llama(model, lora_path=lora or None, n_ctx=256, n_threads=2, n_batch=64, verbose=False, logits_all=True)
llm.eval(prompt)
out = []
for _ in range(n):
    out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
    llm.eval([out[-1]])
print(json.dumps(out))
"""


def run(command: list) -> str:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, check=False, timeout=600)
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers-python", type=Path, required=True)
    parser.add_argument("--converter", type=Path, required=True, help="llama.cpp's source (its convert_*.py)")
    args = parser.parse_args()
    prompt = PROMPT[:PROMPT_LEN]
    greedy = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = write_tiny_llama(root, bundled_model_path())
        model_gguf = root / "base.gguf"
        run([args.peers_python, args.converter / "convert_hf_to_gguf.py", base, "--outtype", "f32", "--outfile",
             model_gguf])  # fmt: skip
        record = {"prompt": prompt, "tokens": TOKENS, "adapters": {}}
        record["base_tokens"] = json.loads(run([args.peers_python, "-c", LLAMACPP_GREEDY, model_gguf, "",
                                               json.dumps(prompt), TOKENS]))  # fmt: skip
        llm = LLM(str(model_gguf))
        assert (
            llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0].outputs[0].token_ids
            == (record["base_tokens"])
        )
        for seed, name in enumerate(ADAPTERS):
            if name not in CASES:
                continue
            adapter = write_adapter(base, root / name, seed, **ADAPTERS[name])
            lora_gguf = root / f"{name}.gguf"
            run([args.peers_python, args.converter / "convert_lora_to_gguf.py", adapter, "--base", base,
                 "--outtype", "f32", "--outfile", lora_gguf])  # fmt: skip
            tokens = json.loads(run([args.peers_python, "-c", LLAMACPP_GREEDY, model_gguf, lora_gguf,
                                     json.dumps(prompt), TOKENS]))  # fmt: skip
            llm.load_lora(name, str(lora_gguf))
            params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, lora_name=name)
            ours = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
            assert ours == tokens, (name, ours, tokens)
            reader = gguf.GGUFReader(lora_gguf)
            alpha = float(reader.fields["adapter.lora.alpha"].contents())
            record["adapters"][name] = {"alpha": alpha, "tensors": gguf_digests(lora_gguf), "llamacpp_tokens": tokens}
        llm.close()
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
