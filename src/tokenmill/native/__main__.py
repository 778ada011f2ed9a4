"""`python -m tokenmill.native`: build (or find) the native kernels for this machine and say where they are."""

import sys

from tokenmill import native
from tokenmill.native import matrix_units

lib = native.load()
if lib is None:
    print("tokenmill: native kernels could not be built here; torch's kernels will be used", file=sys.stderr)
else:
    print(f"tokenmill: native kernels ready ({lib._name}, {lib.tm_vector_path().decode()} path)")
    print(f"tokenmill: {matrix_units.describe(lib)}")
