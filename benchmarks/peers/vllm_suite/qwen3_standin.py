"""What stands in for a Qwen3 checkpoint's behaviour in the vLLM suite's runs (run.py): a logits processor that
tokenmill loads with `--logits-processors qwen3_standin:ThinkingStandIn`, over a tiny random-weight model carrying
Qwen3's chat template and <think> tokens.

A real Qwen3 opens a <think> block, thinks, closes it and answers, unless its prompt already holds a closed, empty
block (`enable_thinking: false`), when it only answers. The random weights do neither, so this processor leans each
reply toward that shape: while the reply is still the script's prefix, the script's next token gets a bonus large
enough to win. It is a preference, not a mask: where the request's own constraint (a named tool's grammar) or the
sampler's thinking budget rules the token out, the reply leaves the script and the model's own tokens go on, under
every mask as usual. Off the script, the random weights left alone under a JSON schema write a number or a string
that never ends (a 1,000-token integer); a model ends them after a few tokens, so there the processor gives the
closing tokens (", }, ], commas) the bonus at about one position in CLOSE_EVERY, chosen by a hash of the prompt and
the position: the values stay short, differ between prompts, and repeat for the same prompt (temperature 0 stays
deterministic). A tiny random model's choices hardly depend on its prompt (two prompts gave the same "name"), where a
model's do: off the script each position's logits also get noise seeded by the prompt and the position (NOISE).
The script comes from $TOKENMILL_STANDIN_SCRIPT (JSON, token ids of the stand-in's tokenizer):
{"think": [...], "answer": [...], "think_end": id, "closers": [...]}, the answer ending with the end-of-turn token.
"""

import json
import os
import zlib

import torch

BONUS = 1e4  # over any logit of the random weights
CLOSE_EVERY = 4  # off the script, the closing tokens are preferred at about one position in this many
NOISE = 4.0  # off the script, the scale of the prompt-seeded noise on the logits (the random weights' are about 1)
CLOSED_TAIL_TOKENS = 2  # the template closed the thinking: its prompt ends "</think>\n\n" (an earlier turn's
# </think> comes before "<|im_end|>\n<|im_start|>assistant\n")


class ThinkingStandIn:
    def __init__(self) -> None:
        script = json.loads(os.environ["TOKENMILL_STANDIN_SCRIPT"])
        self.think: list[int] = script["think"]
        self.answer: list[int] = script["answer"]
        self.think_end: int = script["think_end"]
        self.closers = torch.tensor(script["closers"], dtype=torch.int64)

    def applies(self, params) -> bool:
        return True

    def __call__(self, params, prompt_token_ids, output_token_ids, logits: torch.Tensor) -> torch.Tensor:
        closed = self.think_end in prompt_token_ids[-CLOSED_TAIL_TOKENS:]
        script = self.answer if closed else self.think + self.answer
        n = len(output_token_ids)
        if n < len(script) and list(output_token_ids) == script[:n]:
            logits[script[n]] += BONUS
            return logits
        seed = zlib.crc32(str([*prompt_token_ids[-32:], n]).encode())
        noise = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
        logits += NOISE * noise.to(logits.device, logits.dtype)
        if seed % CLOSE_EVERY == 0:
            logits[self.closers.to(logits.device)] += BONUS
        return logits
