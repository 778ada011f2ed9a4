"""The one place where tokenmill picks a device. Nothing else calls .cuda() or names a device."""

import torch

from tokenmill.errors import InvalidParameterError

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def select_device(requested: str | None = None, rank_on_host: int | None = None) -> torch.device:
    """`None` or "auto": CUDA when torch sees a GPU, else the CPU. "cpu", "cuda" or "cuda:N" force one.

    `rank_on_host`: this process is that tensor-parallel rank among those on its machine, and takes CUDA device
    number `rank_on_host` (one GPU per rank; an explicit "cuda:N" is not allowed then)."""
    if requested in (None, "auto"):
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    else:
        try:
            device = torch.device(requested)
        except RuntimeError as exc:
            raise InvalidParameterError(f"unknown device {requested!r}", "device") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidParameterError("device 'cuda' was asked for, but torch sees no GPU", "device")
    if device.type == "cuda" and rank_on_host is not None:
        if device.index is not None:
            raise InvalidParameterError(
                "with tensor parallelism each rank takes its own GPU: use device 'cuda'", "device"
            )
        if rank_on_host >= torch.cuda.device_count():
            raise InvalidParameterError(
                f"rank {rank_on_host} on this machine needs GPU {rank_on_host}, but torch sees "
                f"{torch.cuda.device_count()}",
                "device",
            )
        device = torch.device("cuda", rank_on_host)
        torch.cuda.set_device(device)
    return device


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
        raise InvalidParameterError(f"dtype {dtype} is not supported (use one of {', '.join(_DTYPES)})", "dtype")
    if dtype not in _DTYPES:
        raise InvalidParameterError(f"dtype {dtype!r} is not supported (use one of {', '.join(_DTYPES)})", "dtype")
    return _DTYPES[dtype]
