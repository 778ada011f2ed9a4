"""The one place where tokenmill picks a device. Nothing else calls .cuda() or names a device."""

import torch

from tokenmill.errors import InvalidParameterError

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def select_device(requested: str | None = None) -> torch.device:
    """`None` or "auto": CUDA when torch sees a GPU, else the CPU. "cpu", "cuda" or "cuda:N" force one."""
    if requested in (None, "auto"):
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(requested)
    except RuntimeError as exc:
        raise InvalidParameterError(f"unknown device {requested!r}", "device") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidParameterError("device 'cuda' was asked for, but torch sees no GPU", "device")
    return device


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
        raise InvalidParameterError(f"dtype {dtype} is not supported (use one of {', '.join(_DTYPES)})", "dtype")
    if dtype not in _DTYPES:
        raise InvalidParameterError(f"dtype {dtype!r} is not supported (use one of {', '.join(_DTYPES)})", "dtype")
    return _DTYPES[dtype]
