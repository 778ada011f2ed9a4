"""What a `quantization` option means, said once: "none" (or None) is float weights from the file's dequantized
blocks, "int8" / "int4" re-quantized weights, "auto" the file's own blocks through the native products. The
quantized kernels are CPU kernels: on another device `auto` means float weights and the others are refused. No
torch here."""

from tokenmill.errors import InvalidParameterError

QUANTIZATIONS = ("none", "int8", "int4", "auto")  # as the command line spells them


def parse_quantization(value: str | None) -> str | None:
    """A quantization option -> its mode (None: float weights); an unknown one is refused."""
    mode = None if value == "none" else value
    if mode not in (None, *QUANTIZATIONS[1:]):
        raise InvalidParameterError(
            f"quantization {value!r} is not supported (use None to dequantize, 'int8', 'int4' or 'auto')",
            "quantization",
        )
    return mode


def quantization_on(mode: str | None, device_type: str) -> str | None:
    """The mode a parsed quantization takes on a device ("cpu", "cuda", ...)."""
    if device_type == "cpu" or mode is None:
        return mode
    if mode == "auto":
        return None  # dense weights there
    raise InvalidParameterError(
        f"quantization {mode!r} uses CPU kernels; on {device_type} use quantization=None", "quantization"
    )
