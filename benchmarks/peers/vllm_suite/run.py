"""vLLM's own OpenAI-server tests (tests/entrypoints/openai of vLLM 0.33.0's source distribution), run unchanged
against `tokenmill serve`: `make vllm-suite`, or

    .venv/bin/python benchmarks/peers/vllm_suite/run.py [--python .venv-vllm-suite/bin/python] [TEST ...]

Runs in tokenmill's venv (it writes the stand-in models with tokenmill's loader and tests/gguf_builder.py), and
runs pytest in the venv that holds vLLM (`make vllm-suite` makes it: vLLM's wheel without its CUDA dependencies,
with VLLM_TARGET_DEVICE=cpu, the CPU platform vLLM's CPU build reports), where tokenmill_vllm_plugin.py makes the
suite's RemoteOpenAIServer start tokenmill.

No network here, so the Hub checkpoints the tests name are served by stand-ins under the names the tests use:
- Qwen/Qwen3-*: a tiny random-weight qwen3 model with Qwen3's chat template (tests/data/templates/qwen3.jinja) and
  the bundled SmolLM2's tokenizer plus Qwen3's added tokens (<think>, </think>, <tool_call>, </tool_call>, single
  tokens as in Qwen3's own vocabulary); qwen3_standin.py leans its replies toward Qwen3's shape (think, then
  answer; only answer when the template closed the thinking). The tests' own tokenizer (vllm.tokenizers'
  get_tokenizer of the same name) is that tokenizer, from an offline Hugging Face cache written here.
- any other name: the bundled SmolLM2-135M-Instruct, whose tokenizer (and chat template) the offline cache holds
  under its own name (HuggingFaceTB/SmolLM2-135M-Instruct) for the tests that read it.
Prints a JSON summary (passed, failed, skipped, each failure's first line) and writes pytest's junit XML.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "src"))

from tests.gguf_builder import QWEN3_ADDED, TinyModel, write_tiny_gguf  # noqa: E402
from tokenmill.loader.gguf_file import GGUFFile  # noqa: E402
from tokenmill.loader.model_path import bundled_model_path  # noqa: E402
from tokenmill.tokenizer.gguf_tokenizer import Tokenizer  # noqa: E402

VLLM_VERSION = "0.33.0"
SIMPLE_INDEX = "https://pypi.org/simple/vllm/"
CACHE = Path.home() / ".cache" / "tokenmill" / "vllm-suite"
HERE = Path(__file__).resolve().parent
QWEN3_TEMPLATE = REPO / "tests" / "data" / "templates" / "qwen3.jinja"
QWEN3_NAMES = ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B", "Qwen/Qwen3-8B")  # the names the selected tests use
SNAPSHOT = "0" * 40  # the offline cache's revision of each stand-in's tokenizer
STANDIN_THINKING = "<think>\nThe user asks for a sum. One plus one is two, so I answer 2.\n</think>\n\n"
STANDIN_ANSWER = "1 + 1 = 2."

# whole files, each failure then read and named in benchmarks/README.md: the reasoning and named-tool tests (issue
# 37), then those of vLLM's request extensions (issue 39: prompt_logprobs, echo, logprob_token_ids,
# allowed_token_ids, return_tokens_as_token_ids, truncate_prompt_tokens, continue_final_message,
# continuous_usage_stats)
DEFAULT_TESTS = (
    "tests/entrypoints/openai/chat_completion/test_include_reasoning.py",
    "tests/entrypoints/openai/chat_completion/test_thinking_token_budget.py",
    "tests/entrypoints/openai/chat_completion/test_completion_with_function_calling.py",
    "tests/entrypoints/openai/responses/test_simple.py",
    "tests/entrypoints/openai/responses/test_function_call.py",
    "tests/entrypoints/openai/completion/test_completion.py",
    "tests/entrypoints/openai/completion/test_prompt_validation.py",
    "tests/entrypoints/openai/chat_completion/test_chat_echo.py",
    "tests/entrypoints/openai/chat_completion/test_logprob_token_ids.py",
    "tests/entrypoints/openai/test_chunked_prompt.py",
    "tests/entrypoints/serve/tokenize/test_tokenization.py",
    "tests/entrypoints/pooling/basic/test_truncation.py",
)
SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the bundled model, under the name the tests use
# other checkpoints the tests read a tokenizer or config of, which the bundled model stands in for (test_chat_echo's
# vocabulary size)
SMOLLM2_STANDS_FOR = ("Qwen/Qwen2-1.5B-Instruct",)


def vllm_source(cache: Path) -> Path:
    """vLLM's source distribution, downloaded once and unpacked (its tests and pytest configuration)."""
    root = cache / f"vllm-{VLLM_VERSION}"
    if (root / "tests" / "utils.py").exists():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / f"vllm-{VLLM_VERSION}.tar.gz"
    if not archive.exists():
        index = urllib.request.urlopen(SIMPLE_INDEX, timeout=60).read().decode()
        url = re.search(rf'href="([^"#]*vllm-{re.escape(VLLM_VERSION)}\.tar\.gz)', index)
        if url is None:
            raise SystemExit(f"no vllm-{VLLM_VERSION}.tar.gz in {SIMPLE_INDEX}")
        urllib.request.urlretrieve(url.group(1), archive)
    with tarfile.open(archive) as tar:
        tar.extractall(cache, filter="data")
    return root


def qwen3_standin(work: Path) -> tuple[Path, Tokenizer]:
    """The tiny qwen3 model with Qwen3's template and added tokens (Qwen3's context), and its tokenizer; written
    anew each run (a second), so it is never a stale one."""
    path = work / "qwen3-standin.gguf"
    template = QWEN3_TEMPLATE.read_text()
    model = TinyModel(arch="qwen3", vocab_size=49152 + len(QWEN3_ADDED), context=40960, head_size=16)
    write_tiny_gguf(path, model, tokenizer_from=bundled_model_path(), chat_template=template, added_tokens=QWEN3_ADDED)
    return path, Tokenizer.from_gguf(GGUFFile(path))


def closing_tokens(tokenizer: Tokenizer) -> list[int]:
    """The tokens that only close JSON values: quotes, braces, brackets and commas (the stand-in's preference
    where the random weights would write a value forever)."""
    closing = set('",}]')
    ids = []
    for i in range(tokenizer.vocab_size):
        text = tokenizer.decode([i]).strip()
        if text and set(text) <= closing:
            ids.append(i)
    return ids


def write_hf_cache(
    hub: Path,
    names: tuple[str, ...],
    tokenizer: Tokenizer,
    template: str,
    model_type: str = "qwen3",
    pad_token: str = "<|endoftext|>",
) -> None:
    """An offline Hugging Face cache where each name's tokenizer is `tokenizer`, with `template` (HF_HUB_OFFLINE
    reads it): the stand-in's under Qwen3's names, the bundled SmolLM2's under its own."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": pad_token,
        "chat_template": template,
    }
    for name in names:
        repo = hub / f"models--{name.replace('/', '--')}"
        snapshot = repo / "snapshots" / SNAPSHOT
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(SNAPSHOT)
        (snapshot / "tokenizer.json").write_text(tokenizer.backend.to_str())
        (snapshot / "tokenizer_config.json").write_text(json.dumps(config))
        model_config = {"model_type": model_type, "vocab_size": tokenizer.vocab_size}
        (snapshot / "config.json").write_text(json.dumps(model_config))


def summary(junit: Path) -> dict:
    """pytest's junit XML -> counts and each failure's test and first line."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            counts["failed"] += 1
            failures.append({"test": name, "why": (problem.get("message") or "").splitlines()[0][:300]})
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tests", nargs="*", default=list(DEFAULT_TESTS), help="pytest node ids in vLLM's tree")
    parser.add_argument("--python", default=str(REPO / ".venv-vllm-suite" / "bin" / "python"))
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--pytest-args", default="", help="more pytest arguments, one string")
    args = parser.parse_args()

    source = vllm_source(args.cache)
    work = args.cache / "work"
    work.mkdir(parents=True, exist_ok=True)
    standin, tokenizer = qwen3_standin(work)
    write_hf_cache(work / "hf" / "hub", QWEN3_NAMES, tokenizer, QWEN3_TEMPLATE.read_text())
    bundled = GGUFFile(bundled_model_path())
    smollm2 = Tokenizer.from_gguf(bundled)
    write_hf_cache(
        work / "hf" / "hub",
        (SMOLLM2_NAME, *SMOLLM2_STANDS_FOR),
        smollm2,
        bundled.get("tokenizer.chat_template"),
        "llama",
        "<|im_end|>",
    )
    script = {
        "think": tokenizer.encode(STANDIN_THINKING),
        "answer": tokenizer.encode(STANDIN_ANSWER) + [tokenizer.token_to_id("<|im_end|>")],
        "think_end": tokenizer.token_to_id("</think>"),
        "closers": closing_tokens(tokenizer),
    }
    standin_args = ["--logits-processors", "qwen3_standin:ThinkingStandIn"]
    models = [["Qwen/Qwen3", str(standin), standin_args], ["", str(bundled_model_path()), []]]
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(work / "hf"),
        # the plugin and the stand-in's logits processor; then this checkout's tokenmill, ahead of the one the venv
        # installed (a git worktree runs its own code)
        "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO / "src")]),
        "TOKENMILL_BIN": str(Path(sys.executable).parent / "tokenmill"),
        "TOKENMILL_SUITE_MODELS": json.dumps(models),
        "TOKENMILL_STANDIN_SCRIPT": json.dumps(script),
    }
    junit = work / "junit.xml"
    command = [
        str(Path(args.python).absolute()),
        "-m",
        "pytest",
        "-p",
        "tokenmill_vllm_plugin",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rfE",
    ]
    command += [f"--junitxml={junit}", *args.pytest_args.split(), *args.tests]
    print(" ".join(command), file=sys.stderr, flush=True)
    code = subprocess.call(command, cwd=source, env=env, stdout=sys.stderr)  # stdout: the JSON alone
    result = {"vllm": VLLM_VERSION, "tests": args.tests, "exit_code": code, **summary(junit)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
