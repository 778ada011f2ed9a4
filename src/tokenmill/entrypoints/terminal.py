"""What `tokenmill generate` and `tokenmill chat` do to the terminal: a loading line that shows progress while the
model loads, and keys typed while an answer streams kept out of the answer (and offered as the next input)."""

import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO


class LoadingLine:
    """`loading MODEL: PHASE 1.2 s` on stderr, redrawn every 0.1 s on a terminal (one line per phase otherwise),
    then `loaded MODEL in 2.3 s`. `phase(text)` names what happens now."""

    def __init__(self, model: str, stream: TextIO | None = None):
        self.model = model
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        self._phase = "starting"
        self._start = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._redraw, daemon=True, name="loading-line")

    def __enter__(self) -> "LoadingLine":
        if self.live:
            self._thread.start()
        return self

    def phase(self, text: str) -> None:
        self._phase = text
        if not self.live:
            self._print_line()

    def __exit__(self, kind: Any, *_: Any) -> None:
        self._stop.set()
        if self.live:
            self._thread.join()
            self.stream.write("\r\033[K")
        if kind is None:
            self.stream.write(f"loaded {self.model} in {time.monotonic() - self._start:.1f} s\n")
        self.stream.flush()

    def _print_line(self) -> None:
        self.stream.write(f"loading {self.model}: {self._phase}\n")
        self.stream.flush()

    def _redraw(self) -> None:
        while not self._stop.wait(0.1):
            elapsed = time.monotonic() - self._start
            self.stream.write(f"\r\033[Kloading {self.model}: {self._phase} {elapsed:.1f} s")
            self.stream.flush()


class HeldInput:
    """While an answer streams, the terminal neither echoes keys nor lets them form a line: what is typed is read
    back when the answer ends instead of being printed inside the answer, as a shell takes type-ahead: `lines`,
    each ended by Enter (to be sent in turn, shown as they are), and `text`, what followed the last Enter (the
    start of the next line); backspaces applied. Ctrl-C still interrupts. Does nothing off a terminal."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stdin
        self.lines: list[str] = []
        self.text = ""
        self._saved: list | None = None

    def __enter__(self) -> "HeldInput":
        try:
            import termios

            fd = self.stream.fileno()
            if not os.isatty(fd):
                return self
            self._saved = termios.tcgetattr(fd)
            quiet = termios.tcgetattr(fd)
            quiet[3] &= ~(termios.ECHO | termios.ICANON)  # lflags: no echo, bytes readable as typed
            termios.tcsetattr(fd, termios.TCSANOW, quiet)
        except (ImportError, OSError, ValueError):  # no termios (Windows) or no real terminal
            self._saved = None
        return self

    def __exit__(self, *_: Any) -> None:
        if self._saved is None:
            return
        import termios

        fd = self.stream.fileno()
        typed = bytearray()
        while select.select([fd], [], [], 0)[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            typed += chunk
        termios.tcsetattr(fd, termios.TCSANOW, self._saved)
        self.lines, self.text = edited(typed.decode("utf-8", "replace"))


class Interrupts:
    """While active, Ctrl-C (SIGINT) raises nothing: it is noted (`seen`), for the loop in progress to stop at a
    point of its own choosing (an engine step is never cut in the middle). Main thread only, as signal handlers."""

    def __init__(self) -> None:
        self.seen = False
        self._previous: Any = None

    def __enter__(self) -> "Interrupts":
        self._previous = signal.signal(signal.SIGINT, self._note)
        return self

    def _note(self, signum: int, frame: Any) -> None:
        self.seen = True

    def __exit__(self, *_: Any) -> None:
        signal.signal(signal.SIGINT, self._previous)


def edited(typed: str) -> tuple[list[str], str]:
    """Keys as a line editor would leave them -> (the lines Enter ended, what follows the last Enter): backspace
    deletes within a line (an entered line is gone, as in a terminal), control keys go; "\r\n" is one Enter."""
    lines: list[str] = []
    out: list[str] = []
    for i, ch in enumerate(typed):
        if ch in "\x7f\b":
            if out:
                out.pop()
        elif ch in "\r\n":
            if not (ch == "\n" and i and typed[i - 1] == "\r"):
                lines.append("".join(out))
            out = []
        elif ch == "\t" or ch >= " ":
            out.append(ch)
    return lines, "".join(out)


class TypeAhead:
    """What was typed while answers streamed, in the order typed: `lines` ended by Enter (not yet sent; blank ones
    dropped) and the partial line after them."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.partial = ""

    def add(self, lines: list[str], partial: str) -> None:
        """One answer's held keys (HeldInput's lines and text): its first line continues the partial one."""
        if lines:
            entered = [self.partial + lines[0], *lines[1:]]
            self.lines += [line.strip() for line in entered if line.strip()]
            self.partial = partial
        else:
            self.partial += partial

    def take_partial(self) -> str:
        partial, self.partial = self.partial, ""
        return partial.lstrip()


def input_with(prefill: str, prompt: str, read: Callable[[str], str] = input) -> str:
    """input(prompt) whose line starts with `prefill` (editable) where readline is available."""
    if not prefill:
        return read(prompt)
    try:
        import readline
    except ImportError:  # no line editor: show what was typed, and take it as the start of the line
        return prefill + read(prompt + prefill)
    readline.set_startup_hook(lambda: readline.insert_text(prefill))
    try:
        return read(prompt)
    finally:
        readline.set_startup_hook(None)
