"""Custom logits processors (--logits-processors), as vLLM's engine takes them: importable classes, one instance
per engine, each shown the raw logits of the requests it applies to (as a rule those that carry arguments for it:
SamplingParams.extra_args, the server's `vllm_xargs`) before biases, bans and penalties.

A processor is a class with no constructor arguments and two methods:
    applies(params: SamplingParams) -> bool        whether it acts on this request (it reads params.extra_args)
    __call__(params, prompt_token_ids, output_token_ids, logits: Tensor [vocab]) -> Tensor [vocab]
"""

import importlib
from typing import Any, Protocol

import torch

from tokenmill.errors import InvalidParameterError
from tokenmill.sampling_params import SamplingParams


class LogitsProcessor(Protocol):
    def applies(self, params: SamplingParams) -> bool: ...

    def __call__(
        self, params: SamplingParams, prompt_token_ids: list[int], output_token_ids: list[int], logits: torch.Tensor
    ) -> torch.Tensor: ...


def load_logits_processors(names: list[str] | None) -> list[Any]:
    """Each name (module:Class or module.Class) imported and instantiated; InvalidParameterError names one that
    does not import or is not a processor."""
    processors = []
    for name in names or []:
        module_name, _, attribute = name.partition(":") if ":" in name else name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), attribute)
            processor = cls()
        except (ImportError, AttributeError, ValueError, TypeError) as exc:
            raise InvalidParameterError(f"logits processor {name!r} does not load: {exc}", "logits_processors") from exc
        if not callable(processor) or not callable(getattr(processor, "applies", None)):
            raise InvalidParameterError(
                f"logits processor {name!r} needs applies(params) and __call__(params, prompt, output, logits)",
                "logits_processors",
            )
        processors.append(processor)
    return processors
