"""tokenmill's hand-written CPU kernels (C, compiled for this machine on first use, loaded with ctypes).

repack.c lays GGUF's blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4) out for the products in groups
of 16 interleaved rows, as the file has them (no re-coding), and dequantizes rows back; products.c has the matrix
products over them (integer dot products against int8 activations, one or two passes); decoder.c the decoder
layers of a llama model for the tokens of a decode step (norms, projections, rope, the KV-cache write, attention
over the paged cache, SwiGLU) in one call per step instead of ~40 torch operations per layer; attention.c prompt
chunks' attention over the paged cache (flash attention, layers/native_attention.py); lowrank.c LoRA's low-rank
products with a row's bits independent of its batch (layers/lora.py); dequantize.c the
Q4_1/Q8_0 dequantization used at load; shm_reduce.c the tensor-parallel sums over shared memory; matrix_units.c
whether the CPU's matrix units (AMX) can run here (matrix_units.py asks, once a process); kernels.h is what they
share, kv_elements.h the KV cache's element types (float32, float16, bfloat16). The library is built
with the system C compiler into a cache directory keyed by the source, the compiler flags and the CPU; without
a compiler tokenmill falls back to torch's kernels and says so once in the log.
"""

import ctypes
import hashlib
import logging
import os
import subprocess
import sysconfig
import tempfile
from pathlib import Path

import torch

from tokenmill.cache import cache_dir

logger = logging.getLogger(__name__)

# every file the library is built from (all of them key the cache; the .c files are compiled)
_SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "kernels.h",
        "kv_elements.h",
        "pool.c",
        "repack.c",
        "products.c",
        "dequantize.c",
        "decoder.c",
        "attention.c",
        "lowrank.c",
        "shm_reduce.c",
        "matrix_units.c",
    )
]
# -ffast-math lets the exp() loops (softmax, SiLU) use glibc's vector math (libmvec) and the sums reassociate
# into vector lanes; the kernels need neither infinities nor NaNs nor a fixed summation order
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC", "-std=c11"]
# Linked in a second command without -ffast-math: linked with it, gcc adds crtfastmath.o, which turns on
# flush-to-zero for the whole process when the library loads, and Python's own floats then read 5e-324 as 0.0
_LINK_FLAGS = ["-shared", "-fopenmp"]
# TOKENMILL_NATIVE_MARCH=haswell (AVX2) or x86-64 (plain C) builds the other code paths, for testing them
_LIBS = ["-lmvec", "-lm"]  # after the source: the linker only keeps libraries that earlier objects need
# tm_reduce_fn(ctx, x, n): sums the n floats at x over the tensor-parallel ranks in place; 0 on success
REDUCE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
MAX_PARTS = 4  # kernels.h's TM_MAX_PARTS


class Part(ctypes.Structure):
    """kernels.h's tm_part: `n` rows (a multiple of 16) of `k` inputs of GGML type `type`, repacked at `data`."""

    _fields_ = [("type", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("data", ctypes.c_void_p)]


class Weight(ctypes.Structure):
    """kernels.h's tm_weight: parts stacked along the outputs, in order."""

    _fields_ = [("n_parts", ctypes.c_int64), ("parts", Part * MAX_PARTS)]


_lib: ctypes.CDLL | None = None
_tried = False


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def compiler() -> str:
    """The C compiler the kernels are built with: $CC, else Python's own, else cc."""
    return (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]


def _build(force: bool = False) -> Path:
    cc = compiler()
    march = os.environ.get("TOKENMILL_NATIVE_MARCH")
    flags = [f"-march={march}" if f == "-march=native" and march else f for f in _FLAGS]
    command = [cc, *flags, "-c", "SOURCES", "&&", cc, *_LINK_FLAGS, "OBJECTS", "-o", "TARGET", *_LIBS]
    sources = b"".join(source.read_bytes() for source in _SOURCES)
    key = hashlib.sha256(sources + repr(command).encode() + _cpu_signature().encode())
    target = cache_dir() / f"kernels-{key.hexdigest()[:16]}.so"
    if force or not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        with tempfile.TemporaryDirectory() as objects:
            built = []
            for source in (source for source in _SOURCES if source.suffix == ".c"):
                built.append(str(Path(objects) / f"{source.stem}.o"))
                subprocess.run([cc, *flags, "-c", str(source), "-o", built[-1]], check=True, capture_output=True)
            command = [cc, *_LINK_FLAGS, *built, "-o", str(tmp), *_LIBS]
            subprocess.run(command, check=True, capture_output=True)
        tmp.replace(target)  # atomic: concurrent processes never load a half-written file
    return target


def load() -> ctypes.CDLL | None:
    """The compiled kernels, or None when they cannot be built here (then callers use torch's kernels)."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("TOKENMILL_NATIVE", "1") == "0":
        return None
    try:
        try:
            lib = ctypes.CDLL(str(_build()))
        except OSError:  # a cached library that does not load (say, from an older toolchain): build it again
            lib = ctypes.CDLL(str(_build(force=True)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = exc.stderr.decode(errors="replace")[-500:] if isinstance(exc, subprocess.CalledProcessError) else exc
        logger.warning("native kernels unavailable (%s); using torch's int4 kernel", detail)
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    weight = ctypes.POINTER(Weight)
    lib.tm_repack_bytes.argtypes = [i64, i64, i64]
    lib.tm_repack_bytes.restype = i64
    lib.tm_repack.argtypes = [i64, p, i64, i64, p]
    lib.tm_repack.restype = ctypes.c_int
    lib.tm_qmatmul.argtypes = [weight, p, i64, i64, p]
    lib.tm_qmatmul.restype = ctypes.c_int
    lib.tm_weight_rows.argtypes = [weight, p, i64, p]
    lib.tm_weight_rows.restype = ctypes.c_int
    lib.tm_llama_check.argtypes = [p]  # const tm_llama_model *
    lib.tm_llama_check.restype = ctypes.c_int
    lib.tm_llama_decode.argtypes = [p, p]  # const tm_llama_model *, const tm_decode_step *
    lib.tm_llama_decode.restype = ctypes.c_int
    lib.tm_pool_stalls.argtypes = []
    lib.tm_pool_stalls.restype = i64
    lib.tm_prefill_attention.argtypes = [p]  # const tm_prefill_attention_args *
    lib.tm_prefill_attention.restype = ctypes.c_int
    lib.tm_lowrank_rows.argtypes = [p, i64, i64, p, i64, p, i64, p]
    lib.tm_lowrank_rows.restype = ctypes.c_int
    lib.tm_kv_store.argtypes = [p, p, i64, i64]
    lib.tm_kv_store.restype = ctypes.c_int
    for name in ("tm_dequantize_q4_1", "tm_dequantize_q8_0"):
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        getattr(lib, name).restype = None
    lib.tm_shm_bytes.argtypes = [i64, i64]
    lib.tm_shm_bytes.restype = i64
    lib.tm_shm_init.argtypes = [p, i64, i64]
    lib.tm_shm_init.restype = None
    lib.tm_shm_join.argtypes = [p, i64, ctypes.c_int32]
    lib.tm_shm_join.restype = None
    lib.tm_shm_allreduce.argtypes = [p, p, i64]
    lib.tm_shm_allreduce.restype = ctypes.c_int
    lib.tm_shm_gather_columns.argtypes = [p, p, i64, i64, p]
    lib.tm_shm_gather_columns.restype = ctypes.c_int
    lib.tm_vector_path.argtypes = []
    lib.tm_vector_path.restype = ctypes.c_char_p
    lib.tm_set_threads.argtypes = [ctypes.c_int]
    lib.tm_pool_probe.argtypes = [i64, i64, i64, i64, p]
    lib.tm_pool_probe.restype = None
    lib.tm_pool_solo.argtypes = []
    lib.tm_pool_solo.restype = ctypes.c_int
    lib.tm_amx_reported.argtypes = []
    lib.tm_amx_reported.restype = ctypes.c_int
    lib.tm_amx_request.argtypes = []
    lib.tm_amx_request.restype = ctypes.c_int
    lib.tm_amx_tile_check.argtypes = []
    lib.tm_amx_tile_check.restype = ctypes.c_int
    from tokenmill.native.threads import set_threads, usable_cpus  # noqa: PLC0415 - threads imports torch only

    set_threads(min(torch.get_num_threads(), usable_cpus()), lib)
    _lib = lib
    return lib
