"""The grammar stage of the step: every constrained sample's allowed tokens, where its grammar is now.

A request's constraint is compiled once (the input processor compiles it first, so one that cannot compile is a
400) and each of its samples follows it with a matcher of its own. Samples that sample this step get their masks
in a thread while the forward pass runs (llguidance releases the GIL); samples that verify proposals are masked
position by position as the speculator verifies them, each after the tokens accepted before it, so constrained
requests speculate and a forbidden proposal is never accepted.
"""

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.engine.request import SampleState
from tokenmill.structured.params import StructuredOutputsParams
from tokenmill.tokenizer.gguf_tokenizer import Tokenizer

if TYPE_CHECKING:
    from tokenmill.structured.grammars import GrammarCompiler

Masks = Future[dict[int, torch.Tensor]]  # seq_id -> bool [vocab], computed while the forward pass runs


class StructuredOutputManager:
    """The engine's constraint compiler (made at first use: llguidance's tokenizer costs about 0.3 s) and the
    masks it gives each constrained sample."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_constraint_bytes: int, max_compile_seconds: float):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._limits = (max_constraint_bytes, max_compile_seconds)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()  # the server's threads validate requests while the step runs
        self._mask_pool: ThreadPoolExecutor | None = None

    @property
    def compiler(self) -> "GrammarCompiler":
        with self._lock:
            if self._compiler is None:
                from tokenmill.structured.grammars import GrammarCompiler

                self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size, *self._limits)
            return self._compiler

    def matcher(self, constraint: StructuredOutputsParams) -> Any:
        """A new matcher at the start of the output, for one sample of a request with this constraint."""
        return self.compiler.matcher(self.compiler.compile(constraint))

    def start_masks(self, matchers: dict[int, Any]) -> Masks | None:
        """The allowed tokens of these samples (seq_id -> their matcher), computed in a thread; None without any."""
        if not matchers:
            return None
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-grammar")
        compiler = self.compiler

        def compute() -> dict[int, torch.Tensor]:
            allowed = compiler.allowed(list(matchers.values()))  # [C, vocab]
            return dict(zip(matchers, allowed, strict=True))

        return self._mask_pool.submit(compute)

    def mask_now(self, sample: SampleState) -> torch.Tensor:
        """A sample's allowed tokens where its grammar is now (bool [vocab]), computed on the caller's thread."""
        return self.compiler.allowed([sample.grammar])[0]

    @staticmethod
    def admits(sample: SampleState, mask: torch.Tensor) -> bool:
        """Record how many tokens the mask allows; False when nothing may be sampled (the grammar is in error, or
        a limit was hit): the sample then ends with the constraint's error."""
        sample.allowed_tokens = int(mask.sum())
        return not sample.grammar.is_error() and sample.allowed_tokens > 0

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()
