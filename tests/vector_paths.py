"""The native kernels' other vector paths: this machine builds AVX-512; older CPUs get AVX2 or plain C. A test file
reruns its kernel tests against those builds in a child process (TOKENMILL_NATIVE_MARCH picks the build)."""

import os
import subprocess
import sys

# (gcc's -march, the path tm_vector_path reports for that build)
OTHER_PATHS = [("haswell", "avx2"), ("x86-64", "portable")]


def rerun_on_path(test_file: str, march: str, path: str, select: str) -> str:
    """The tests of `test_file` that `-k select` picks, run against the `march` build; its pytest output. Fails
    unless they pass and the build takes `path`."""
    env = {**os.environ, "TOKENMILL_NATIVE_MARCH": march, "TOKENMILL_TEST_VECTOR_PATH": path}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", select]
    out = subprocess.run(command, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stdout[-3000:]
    check = [sys.executable, "-c", "from tokenmill import native; print(native.load().tm_vector_path().decode())"]
    assert subprocess.run(check, capture_output=True, text=True, env=env).stdout.strip() == path
    return out.stdout
