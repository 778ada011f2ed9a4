"""tokenmill: an LLM inference engine and OpenAI-compatible server.

`from tokenmill import LLM, SamplingParams`. Names load lazily, so that torch-free parts (the scheduler, the
block manager, sampling parameters) can be imported without torch.
"""

from typing import TYPE_CHECKING, Any

from tokenmill.log import setup_logging

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
