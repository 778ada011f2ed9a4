"""The native kernels' library built with one source file swapped, loaded beside the tree's own: the A/B benchmarks
(products_ab.py, attention_ab.py) alternate two builds in one process."""

import shutil
import subprocess
import tempfile
from pathlib import Path

import tokenmill.native as native

SOURCES = Path(native.__file__).parent


def build_with(name: str, variant: Path):
    """The library with `variant` as its source file `name` (e.g. "products.c"), loaded as native.load() loads the
    tree's (threads set up); native.load() itself still returns the tree's."""
    folder = Path(tempfile.mkdtemp())
    for f in SOURCES.iterdir():
        if f.suffix in (".c", ".h"):
            shutil.copy(f, folder / f.name)
    shutil.copy(variant, folder / name)
    objects = []
    for f in sorted(folder.glob("*.c")):
        objects.append(str(f.with_suffix(".o")))
        subprocess.run(
            [native.compiler(), *native._FLAGS, "-c", str(f), "-o", objects[-1]], check=True, capture_output=True
        )
    library = folder / "kernels.so"
    subprocess.run([native.compiler(), *native._LINK_FLAGS, *objects, "-o", str(library), *native._LIBS], check=True)
    saved = (native._lib, native._tried, native._build)
    native._lib, native._tried, native._build = None, False, (lambda force=False: library)
    lib = native.load()
    native._lib, native._tried, native._build = saved
    return lib
