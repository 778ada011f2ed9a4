"""A custom logits processor for the server tests (`--logits-processors tests.scripted_logits:ScriptedReply`): a
request whose vllm_xargs carry {"script": [token ids]} gets exactly those tokens, in order (greedy), whatever the
model's random weights would say; the script's last token ends it (the model's EOS). Through the real engine: the
step, the detokenizer, the structured-output masks and every API's formatting run as for any reply."""

import torch


class ScriptedReply:
    def applies(self, params) -> bool:
        return "script" in (params.extra_args or {})

    def __call__(self, params, prompt_token_ids, output_token_ids, logits: torch.Tensor) -> torch.Tensor:
        script = params.extra_args["script"]
        token = script[min(len(output_token_ids), len(script) - 1)]
        forced = torch.full_like(logits, float("-inf"))
        forced[token] = 0.0
        return forced


class ScriptedEveryReply(ScriptedReply):
    """The same for every request, the script's token ids read from $TOKENMILL_TEST_SCRIPT (JSON): for clients
    that send no vllm_xargs, such as the request explorer's page."""

    def __init__(self) -> None:
        import json
        import os

        self.script = json.loads(os.environ["TOKENMILL_TEST_SCRIPT"])

    def applies(self, params) -> bool:
        return True

    def __call__(self, params, prompt_token_ids, output_token_ids, logits: torch.Tensor) -> torch.Tensor:
        token = self.script[min(len(output_token_ids), len(self.script) - 1)]
        forced = torch.full_like(logits, float("-inf"))
        forced[token] = 0.0
        return forced
