"""The CPU's matrix units (Intel AMX), asked about once a process, in one place: does the CPU report them, does
Linux grant this process their tile state, and does one tile product come out right. The product runs in a child
process first: a tile instruction that the kernel did not enable (a hypervisor that hides the state while CPUID
shows it; a process that never asked) dies of SIGILL, and that must never be the server. Only then does this
process ask for the state itself.

The products run on AVX-512 VNNI (or AVX2, or plain C) until a product runs on the tiles; describe() is the log
line that says which path the products take and why the tiles do not.
"""

import ctypes
import functools
import signal
import subprocess
import sys
from dataclasses import dataclass

TILE_CHECK_SECONDS = 30  # the child loads the kernels' library alone (no torch): well under a second
# the child: asks for the tile state and runs the product whatever the answer (without the state it dies of
# SIGILL, as it should); exit status 0 right, 1 wrong
_CHILD = "import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); lib.tm_amx_request(); sys.exit(lib.tm_amx_tile_check())"


@dataclass(frozen=True)
class MatrixUnits:
    amx: bool  # the tiles can run in this process: reported, granted, and a tile product came out right
    reason: str  # what was found, in words


@functools.cache
def probe(lib: ctypes.CDLL) -> MatrixUnits:
    """The matrix units of this machine and process (asked once; `lib`: the loaded native kernels)."""
    if not lib.tm_amx_reported():
        return MatrixUnits(False, "the CPU does not report AMX-TILE and AMX-INT8")
    ok, found = tile_check_in_child(lib._name)
    if not ok:
        return MatrixUnits(False, f"the CPU reports AMX, but {found}")
    refused = lib.tm_amx_request()
    if refused:
        return MatrixUnits(False, f"the CPU reports AMX, but Linux refused this process the tile state ({refused})")
    return MatrixUnits(True, found)


def tile_check_in_child(library: str, timeout: float = TILE_CHECK_SECONDS) -> tuple[bool, str]:
    """Run one tile product in a child process that loads the kernels' `library` (a path) -> (whether it came out
    right, what happened, in words)."""
    command = [sys.executable, "-I", "-c", _CHILD, library]
    try:
        done = subprocess.run(command, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"a tile product did not finish in {timeout:.0f} s"
    if done.returncode < 0:
        killed = signal.Signals(-done.returncode)
        why = " (the tile state is not enabled)" if killed == signal.SIGILL else ""
        return False, f"a tile product died of {killed.name}{why}"
    if done.returncode == 1:
        return False, "a tile product came out wrong"
    if done.returncode != 0:
        detail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        return False, f"the tile check could not run ({detail[0]})"
    return True, "a tile product ran right (TDPBSSD)"


def describe(lib: ctypes.CDLL) -> str:
    """The log line: which path the products take, and what the matrix units are here."""
    units = probe(lib)
    tiles = "usable, not used by the products yet" if units.amx else "not used"
    return f"native products on {lib.tm_vector_path().decode()}; AMX {tiles}: {units.reason}"
