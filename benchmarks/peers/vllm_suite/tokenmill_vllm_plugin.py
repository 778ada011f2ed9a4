"""A pytest plugin for vLLM's own test suite (loaded by run.py with `-p tokenmill_vllm_plugin`, in the venv that
holds vLLM): its harness, tests/utils.py's RemoteOpenAIServer, starts `tokenmill serve` where it would start
`vllm serve`. Nothing else of the suite changes: its fixtures, clients and assertions run as vLLM's CI runs them.

The model a test names is served under that name from a local file (no network here): $TOKENMILL_SUITE_MODELS is
a JSON list of [name prefix, model path, extra tokenmill arguments], the first matching prefix wins ("" matches
every name). vLLM's serve arguments become tokenmill's where tokenmill has the option (TRANSLATED); those that
only steer a GPU or vLLM's internals are dropped (DROPPED, each with why); a few it has no option for are dropped
where the requests then ask for what they set, so that tokenmill's 400 fails those tests (UNMATCHED_VALUES); every
other one is passed on as it is, so a feature tokenmill lacks fails that test's server visibly instead of being
ignored. vLLM started without --reasoning-parser leaves a reply's thinking in its content: tokenmill is started
with --reasoning-parser none then (its own default reads the thinking the chat template implies)."""

import json
import os
import subprocess
import sys

# vLLM's option -> tokenmill's (each takes one value)
TRANSLATED = {
    "--max-model-len": "--max-model-len",
    "--max_model_len": "--max-model-len",
    "--reasoning-parser": "--reasoning-parser",
    "--tool-call-parser": "--tool-call-parser",
    "--seed": "--seed",
    "--port": "--port",
    "--host": "--host",
    "--served-model-name": "--served-model-name",
    "--max-num-seqs": "--max-num-seqs",
    "--max-logprobs": "--max-logprobs",
    "--api-key": "--api-key",
    "--speculative-config": "--speculative-config",
    "--tensor-parallel-size": "--tensor-parallel-size",
}
# options without a value that change nothing tokenmill does
DROPPED_FLAGS = {
    "--enforce-eager": "CUDA graphs off: tokenmill's CPU path has none",
    "--no-async-scheduling": "vLLM's scheduler overlap; tokenmill's step is synchronous",
    "--enable-auto-tool-choice": "tokenmill always lets the model choose under tool_choice auto",
    "--trust-remote-code": "no remote code: the models are local files",
    "--enable-prompt-tokens-details": "tokenmill's usage always has prompt_tokens_details (cached_tokens)",
    "--enable-chunked-prefill": "tokenmill always prefills in chunks (--max-num-batched-tokens a step)",
    "--enable-tokenizer-info-endpoint": "tokenmill always serves /tokenizer_info",
}
# options with a value that change nothing tokenmill does
DROPPED_VALUES = {
    "--gpu-memory-utilization": "a GPU memory share",
    "--dtype": "the GPU's compute type; tokenmill computes the tiny stand-ins in float32 on the CPU",
    "--structured-outputs-config.backend": "vLLM's grammar library; tokenmill's is llguidance",
    "--runner": "vLLM's choice of a generating or a pooling model runner; tokenmill embeds with any model it serves",
}
# options with a value tokenmill has no option for, dropped so that the server starts: the tests that need what they
# set ask for it in their requests, which tokenmill refuses (a 400), so those tests fail on their own, visibly
UNMATCHED_VALUES: dict[str, str] = {}  # none left (--max-logprobs was one until tokenmill took it)
THINK_TAGS = {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}


def tokenmill_args(model: str, vllm_args: list[str]) -> list[str]:
    """`vllm serve MODEL ARGS` as tokenmill serve's arguments."""
    table = json.loads(os.environ["TOKENMILL_SUITE_MODELS"])
    path, extra = next((p, e) for prefix, p, e in table if model.startswith(prefix))
    out = ["--model", path, "--served-model-name", model, *extra]
    if not any(arg.partition("=")[0] == "--reasoning-parser" for arg in vllm_args):
        out += ["--reasoning-parser", "none"]  # vLLM without a reasoning parser leaves the thinking in the content
    args = list(vllm_args)
    while args:
        arg = args.pop(0)
        name, _, inline = arg.partition("=")
        if name in DROPPED_FLAGS:
            continue
        if name in DROPPED_VALUES or name in UNMATCHED_VALUES or name in TRANSLATED or name == "--reasoning-config":
            value = inline if inline else args.pop(0)
            if name in TRANSLATED:
                out += [TRANSLATED[name], value]
            elif name == "--reasoning-config" and json.loads(value) != THINK_TAGS:
                out += [name, value]  # tags other than <think>'s, which tokenmill's think parser reads
            continue
        out.append(arg)
    return out


def _start_server(self, model: str, vllm_serve_args: list[str], env_dict: dict[str, str] | None) -> None:
    env = os.environ.copy()
    if env_dict is not None:
        env.update(env_dict)
    command = [os.environ["TOKENMILL_BIN"], "serve", *tokenmill_args(model, vllm_serve_args)]
    print(f"Launching tokenmill for vLLM's RemoteOpenAIServer: {' '.join(command)}", flush=True)
    self.proc = subprocess.Popen(command, env=env, stdout=sys.stdout, stderr=sys.stderr, start_new_session=True)


def _no_download(self, model: str, args) -> None:
    """The models are local files (TOKENMILL_SUITE_MODELS)."""


def pytest_configure(config) -> None:
    import tests.utils as vllm_test_utils

    vllm_test_utils.RemoteOpenAIServer._start_server = _start_server
    vllm_test_utils.RemoteOpenAIServer._pre_download_model = _no_download
