"""The matrix units' probe (native/matrix_units.py): what it finds agrees with the CPU's flags, and a tile product
where the tile state is not enabled kills only the child that runs it (on a machine without AMX, every run of this
file shows that: the child dies of SIGILL and the test process goes on)."""

import ctypes
import logging
from pathlib import Path

import pytest

from tokenmill import native
from tokenmill.native import matrix_units


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


AMX = {"amx_tile", "amx_int8"} <= cpu_flags()


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    lib = native.load()
    assert lib is not None
    return lib


def test_the_cpuid_bits_are_the_kernels_flags(lib: ctypes.CDLL) -> None:
    assert bool(lib.tm_amx_reported()) == AMX


def test_a_tile_product_runs_right_or_kills_only_its_child(lib: ctypes.CDLL) -> None:
    ok, found = matrix_units.tile_check_in_child(lib._name)
    if not AMX:  # the instruction is undefined here: the child dies of it, this process does not
        assert (ok, found) == (False, "a tile product died of SIGILL (the tile state is not enabled)")
    else:  # granted and right, or the state kept from the process (a hypervisor that hides it): never wrong
        assert ok or "SIGILL" in found, found
    assert "wrong" not in found


def test_the_probe_says_why_and_the_log_says_which_path(lib: ctypes.CDLL) -> None:
    units = matrix_units.probe(lib)
    assert matrix_units.probe(lib) is units  # asked once a process
    if not AMX:
        assert units == matrix_units.MatrixUnits(False, "the CPU does not report AMX-TILE and AMX-INT8")
    else:
        assert units.amx or units.reason.startswith("the CPU reports AMX, but"), units
    line = matrix_units.describe(lib)
    assert line.startswith(f"native products on {lib.tm_vector_path().decode()}; AMX ")
    assert line.endswith(units.reason)


def test_the_engine_logs_the_products_path(caplog: pytest.LogCaptureFixture, bundled_path: Path) -> None:
    from tokenmill.entrypoints.llm import LLM

    with caplog.at_level(logging.INFO, logger="tokenmill.runner.model_runner"):
        llm = LLM(str(bundled_path), quantization="auto", max_model_len=256)
    try:
        assert any(r.getMessage().startswith("native products on ") for r in caplog.records)
    finally:
        llm.close()
