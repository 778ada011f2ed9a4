"""What a `quantization` option means, decided in one place (config/quantization.py) for the engine, the CLI,
the tensor-parallel ranks and the draft model. No torch."""

import pytest

from tokenmill.config.quantization import QUANTIZATIONS, parse_quantization, quantization_on
from tokenmill.errors import InvalidParameterError


def test_names_parse_to_modes_and_unknown_ones_are_refused() -> None:
    assert [parse_quantization(q) for q in (*QUANTIZATIONS, None)] == [None, "int8", "int4", "auto", None]
    with pytest.raises(InvalidParameterError, match="'int3' is not supported") as err:
        parse_quantization("int3")
    assert err.value.param == "quantization"


def test_the_quantized_kernels_are_cpu_kernels() -> None:
    assert [quantization_on(m, "cpu") for m in (None, "int8", "int4", "auto")] == [None, "int8", "int4", "auto"]
    assert quantization_on("auto", "cuda") is None and quantization_on(None, "cuda") is None
    with pytest.raises(InvalidParameterError, match="uses CPU kernels; on cuda"):
        quantization_on("int4", "cuda")
