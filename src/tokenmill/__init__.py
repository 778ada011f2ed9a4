"""tokenmill: an LLM inference engine and OpenAI-compatible server.

`from tokenmill import LLM, SamplingParams`. Names load lazily, so that torch-free parts (the scheduler, the
block manager, sampling parameters) can be imported without torch.
"""

import os
from typing import TYPE_CHECKING, Any

from tokenmill.log import setup_logging

# MKL (torch's CPU BLAS, also inside its fused attention) may round a product otherwise with its operands at another
# memory alignment: on an AVX2 CPU with 2 threads torch's attention gave a decode row other last bits beside other
# rows than alone. STRICT makes MKL's results independent of alignment; it is read at MKL's first computation, so
# it is set here, before any (a process that used MKL before importing tokenmill keeps its own mode).
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

setup_logging()

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "SamplingParams",
    "BeamSearchParams",
    "PoolingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "__version__",
]

if TYPE_CHECKING:
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.outputs import CompletionOutput, RequestOutput
    from tokenmill.pooling_params import PoolingParams
    from tokenmill.sampling_params import BeamSearchParams, SamplingParams
    from tokenmill.structured import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from tokenmill.entrypoints.llm import LLM

        return LLM
    if name in ("SamplingParams", "BeamSearchParams"):
        from tokenmill import sampling_params

        return getattr(sampling_params, name)
    if name == "PoolingParams":
        from tokenmill.pooling_params import PoolingParams

        return PoolingParams
    if name == "StructuredOutputsParams":
        from tokenmill.structured import StructuredOutputsParams

        return StructuredOutputsParams
    if name in ("RequestOutput", "CompletionOutput"):
        from tokenmill import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
