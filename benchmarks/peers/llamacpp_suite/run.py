"""llama.cpp's own server tests (tools/server/tests of the llama.cpp that llama-cpp-python 0.3.36's source
distribution ships), run unchanged against `tokenmill serve`: `make llamacpp-suite`, or

    .venv/bin/python benchmarks/peers/llamacpp_suite/run.py [--python .venv-llamacpp-suite/bin/python] [TEST ...]

A pytest plugin (tokenmill_llamacpp_plugin.py) skips the suite's model downloads; its own ServerProcess
starts "llama-server" from $LLAMA_SERVER_BIN_PATH: here a two-line script that runs llama_server_shim.py, which
turns llama-server's arguments into tokenmill's and starts `tokenmill serve`. Nothing else of the suite changes:
its fixtures, requests and assertions run as llama.cpp's CI runs them.

No network here, so every model the tests name is the bundled SmolLM2-135M-Instruct (served under the test's
alias): tests that check a checkpoint's own words or token counts fail, and are named so in benchmarks/README.md.
Prints a JSON summary (passed, failed, skipped, each failure's first line) and writes pytest's junit XML.
"""

import argparse
import json
import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "src"))

from tokenmill.loader.model_path import bundled_model_path  # noqa: E402

VERSION = "0.3.36"  # llama-cpp-python's; its vendor/llama.cpp holds the server and its tests
CACHE = Path.home() / ".cache" / "tokenmill" / "llamacpp-suite"
HERE = Path(__file__).resolve().parent
TESTS = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/tools/server/tests"
TEMPLATES = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/models/templates"

# the files about llama.cpp's own API and the server's behaviour (issue 39); the others test llama.cpp's router,
# MCP, multimodal, LoRA, rerank and tool-call features, or need their checkpoints' replies
DEFAULT_TESTS = (
    "unit/test_basic.py",
    "unit/test_tokenize.py",
    "unit/test_completion.py",
    "unit/test_template.py",
    "unit/test_slot_save.py",
    "unit/test_security.py",
    "unit/test_metrics.py",
    "unit/test_infill.py",
    "unit/test_ignore_eos.py",
)


def llamacpp_tests(cache: Path, python: str) -> Path:
    """The suite (and the chat templates its tests read), from llama-cpp-python's source distribution, downloaded
    once by pip."""
    root = cache / TESTS
    if (root / "utils.py").exists():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / f"llama_cpp_python-{VERSION}.tar.gz"
    if not archive.exists():
        pip = [python, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", str(cache)]
        subprocess.check_call([*pip, f"llama-cpp-python=={VERSION}"])
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith((TESTS, TEMPLATES))]
        tar.extractall(cache, members=members, filter="data")
    return root


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
    parser.add_argument("tests", nargs="*", default=list(DEFAULT_TESTS), help="pytest node ids in tools/server/tests")
    parser.add_argument("--python", default=str(REPO / ".venv-llamacpp-suite" / "bin" / "python"))
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--pytest-args", default="", help="more pytest arguments, one string")
    args = parser.parse_args()

    python = str(Path(args.python).absolute())
    tests = llamacpp_tests(args.cache, python)
    work = args.cache / "work"
    work.mkdir(parents=True, exist_ok=True)
    shim = work / "llama-server"  # what the suite runs as its server binary
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{HERE / "llama_server_shim.py"}" "$@"\n')
    shim.chmod(0o755)
    env = {
        **os.environ,
        "LLAMA_SERVER_BIN_PATH": str(shim),
        "LLAMA_CACHE": str(work / "llama-cache"),
        "TOKENMILL_BIN": str(Path(sys.executable).parent / "tokenmill"),
        "TOKENMILL_SUITE_MODEL": str(bundled_model_path()),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
    }
    junit = work / "junit.xml"
    command = [python, "-m", "pytest", "-p", "tokenmill_llamacpp_plugin", "-p", "no:cacheprovider", "-q", "-rfE"]
    command.append(f"--junitxml={junit}")
    command += [*args.pytest_args.split(), *args.tests]
    print(" ".join(command), file=sys.stderr, flush=True)
    code = subprocess.call(command, cwd=tests, env=env, stdout=sys.stderr)  # stdout: the JSON alone
    result = {"llama_cpp_python": VERSION, "tests": args.tests, "exit_code": code, **summary(junit)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
