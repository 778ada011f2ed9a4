"""Engine options (the names `LLM(...)` and `tokenmill serve` accept), validated when made. No torch here."""

import re
from dataclasses import dataclass, field, fields
from typing import Any

from tokenmill.config.speculative import SpeculativeConfig
from tokenmill.config.watermark import WatermarkConfig
from tokenmill.errors import InvalidParameterError

KV_CACHE_DTYPE_NAMES = ("auto", "float32", "float16", "bfloat16", "int8")  # runner/kv_cache.py resolves them
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2}
_UNITS.update({"g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4})


def parse_memory(value: str | int | float) -> int:
    """ "1GiB", "512MiB", "2GB", 1073741824 -> bytes."""
    if isinstance(value, bool):
        raise InvalidParameterError(f"memory size {value!r} is not a size", "kv_cache_memory")
    if isinstance(value, int | float):
        size = int(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise InvalidParameterError(
                f"memory size {value!r} is not understood (examples: '1GiB', '512MiB', '2GB')", "kv_cache_memory"
            )
        size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise InvalidParameterError(f"memory size {value!r} must be positive", "kv_cache_memory")
    return size


def option(default: Any, help: str, type: type | None = None, group: str = "engine", **cli: Any) -> Any:
    """A dataclass field that is also a command-line option: `tokenmill serve --<name-with-dashes>` (or cli's
    flags) of `type` (None: a switch, --x / --no-x), in the help's `group`; cli may add choices, flags, metavar
    and action (store_true or store_false: a switch one way only, under its flags). The option's own default is
    None (unset: the field's default applies), so a config file or LLM(...) and the command line mean the same."""
    metadata = {"help": help, "type": type, "group": group, **cli}
    if isinstance(default, list):  # a list of its own for every instance
        return field(default_factory=default.copy, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class EngineConfig:
    block_size: int = option(16, "tokens per KV-cache block (default 16)", int)
    num_kv_blocks: int | None = option(None, "KV-cache size in blocks (wins over --kv-cache-memory)", int)
    kv_cache_memory: str | int | None = option(
        None,
        "KV-cache size in bytes, e.g. 1GiB (default: 8,192 tokens on the CPU, or one --max-model-len sequence if "
        "longer, at most a quarter of available memory; 70%% of free GPU memory on CUDA)",
        str,
    )
    # resolved by runner/kv_cache.py
    kv_cache_dtype: str = option(
        "auto",
        "the KV cache's element type (default auto: float16 under the native CPU decoder, else the model's; "
        "int8: a float32 scale per token and head)",
        str,
        choices=KV_CACHE_DTYPE_NAMES,
    )
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of shared prompt prefixes (default: on)")
    weight_cache: bool = option(
        False,
        "keep the quantized weights as the native kernels lay them out in a file under the cache directory (about "
        "the model file's size, one per model), so that later loads map it instead of reading and repacking the "
        "model file (default: off)",
    )
    max_num_seqs: int = option(64, "sequences per step (default 64)", int)
    max_num_batched_tokens: int = option(512, "tokens per step: prefill chunks + decodes (default 512)", int)
    decode_step_ms: float = option(
        250.0,
        "while more than one call has work, a step carries only the prompt tokens the engine computes in about this "
        "many milliseconds (measured as it runs; at least a block), so a long prompt or a large embedding call does "
        "not slow another client's stream or first token (default 250; 0: no limit)",
        float,
    )
    max_model_len: int | None = option(
        None, "prompt + output limit (default: the model's context, capped by the cache)", int
    )
    max_logprobs: int = option(
        20,  # OpenAI's top_logprobs limit (sampling_params.MAX_LOGPROBS)
        "the most log-probabilities a request may ask for at a position (logprobs, top_logprobs, prompt_logprobs; "
        "a request's -1 asks for the whole vocabulary); -1: no limit (default 20, vLLM's --max-logprobs)",
        int,
    )
    device: str | None = option(None, "cpu, cuda or cuda:N (default: CUDA if available, else CPU)", str, group="model")
    seed: int = option(0, "seed of requests that have none", int)
    tensor_parallel_size: int = option(
        1,
        "split the model over this many ranks, one per device (default 1). Without torchrun, tokenmill starts "
        "the other ranks itself; under torchrun, the world size must equal it",
        int,
        group="tensor parallelism",
        flags=("--tensor-parallel-size", "-tp"),
    )
    collective_timeout_s: float = option(
        15.0,
        "seconds a rank may take to answer a step's collective before it counts as failed (default 15)",
        float,
        group="tensor parallelism",
        flags=("--collective-timeout",),
    )
    # model/generation_defaults.py
    generation_config: str = option(
        "auto",
        "sampling defaults for what a request leaves unset: auto (default: the model's recommended settings, "
        "from its generation_config.json or GGUF metadata, else its family's, else llama.cpp's), "
        "tokenmill (temperature 1, no top-p/top-k/penalty), or a generation_config.json (or its folder)",
        str,
    )
    # tokenmill.spec_decode: a SpeculativeConfig, a dict of its fields or their JSON
    speculative_config: Any = option(
        None,
        'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": K} (optional: '
        '"prompt_lookup_max" 4, "prompt_lookup_min" 2, "disable_by_batch_size" 8, "verify_row_cost" 0.17): up to '
        "K tokens proposed from the sequence's own earlier tokens, as many as pay by its acceptance rate; or "
        '{"method": "draft_model", "model": PATH_OR_NAME, "num_speculative_tokens": K} (optional: "quantization" '
        "auto): up to K tokens proposed by a smaller model with the same tokenizer. All proposals are verified in "
        "one pass; the output is what it would be without them",
        str,
    )
    # runner/watermark.py: a WatermarkConfig, a dict of its fields or their JSON
    watermark_config: Any = option(
        None,
        'watermark the text sampled at a temperature above 0, as vLLM does: {"key": K} (a secret below 2**64; '
        'optional: "algorithm" gumbel or dual_key_gumbel, "alpha" 0.1, "context_width" 4, "deduplicate_contexts" '
        'none, single_turn or all, "deduplicate_contexts_max_history" 8192, "prf" philox). Each token is Gumbel-max '
        "sampled with noise keyed by the tokens before it, so the key's holder can detect the text; a request's "
        "watermarking: false opts out, greedy requests are never watermarked",
        str,
    )
    # structured outputs (tokenmill/structured/grammars.py)
    max_constraint_bytes: int = option(
        1024 * 1024,
        "the largest structured-output constraint compiled, in bytes of its JSON schema, regex, grammar or "
        "choices (default 1048576); a larger one is refused with 400 before compiling",
        int,
    )
    max_constraint_compile_seconds: float = option(
        10.0,
        "how long a constraint may take to compile (default 10); a slower one is refused with 400, and so is "
        "every later request with the same constraint (compiles run off the event loop and the engine's thread)",
        float,
    )

    # engine/lora_registry.py
    lora_modules: Any = option(
        None,
        "a LoRA adapter served beside the model: NAME=PATH (a PEFT directory or a GGUF LoRA file), given once per "
        "adapter; a request chooses it by NAME as its model (vLLM's --lora-modules)",
        str,
        flags=("--lora", "--lora-modules"),
        action="append",
        metavar="NAME=PATH",
    )

    # runner/logits_processors.py
    logits_processors: list[str] | str | None = option(
        None,
        "custom logits processors, comma-separated importable names (module:Class or module.Class), each applied "
        "to the requests it chooses (as a rule those that carry arguments for it: vLLM's vllm_xargs)",
        str,
    )

    def __post_init__(self) -> None:
        self.lora_modules = parse_lora_modules(self.lora_modules)
        if isinstance(self.logits_processors, str):
            self.logits_processors = [n.strip() for n in self.logits_processors.split(",") if n.strip()]
        if self.logits_processors is not None and not all(isinstance(n, str) for n in self.logits_processors):
            raise InvalidParameterError("logits_processors must be importable names", "logits_processors")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            _positive_int(name, getattr(self, name))
        _positive_int("max_constraint_bytes", self.max_constraint_bytes)
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise InvalidParameterError(
                f"max_logprobs must be -1 (no limit) or an integer of 0 or more, not {self.max_logprobs!r}",
                "max_logprobs",
            )
        _positive_number("max_constraint_compile_seconds", self.max_constraint_compile_seconds)
        for name in ("num_kv_blocks", "max_model_len"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.kv_cache_memory is not None:
            parse_memory(self.kv_cache_memory)
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise InvalidParameterError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_NAMES)}, got {self.kv_cache_dtype!r}",
                "kv_cache_dtype",
            )
        _positive_number("collective_timeout_s", self.collective_timeout_s)
        if (
            isinstance(self.decode_step_ms, bool)
            or not isinstance(self.decode_step_ms, int | float)
            or not (self.decode_step_ms >= 0)
        ):
            raise InvalidParameterError(
                f"decode_step_ms must be 0 or more milliseconds, got {self.decode_step_ms!r}", "decode_step_ms"
            )
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise InvalidParameterError(
                "generation_config must be 'auto', 'tokenmill' or a path to a generation_config.json",
                "generation_config",
            )
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.watermark_config = WatermarkConfig.parse(self.watermark_config)
        if self.watermark_config is not None and self.speculative_config is not None:
            raise InvalidParameterError(
                "watermark_config cannot be combined with speculative_config: accepted proposals would go unmarked",
                "watermark_config",
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise InvalidParameterError("enable_prefix_caching must be true or false", "enable_prefix_caching")
        if not isinstance(self.weight_cache, bool):
            raise InvalidParameterError("weight_cache must be true or false", "weight_cache")

    @classmethod
    def from_options(cls, options: dict) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidParameterError(
                f"unknown engine option(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})", unknown[0]
            )
        return cls(**options)


def parse_lora_modules(value: Any) -> dict[str, str] | None:
    """{name: path}, a list of "NAME=PATH" strings (the command line's), or one such string -> {name: path}."""
    if value is None or isinstance(value, dict) and not value:
        return None
    items = value.items() if isinstance(value, dict) else None
    if items is None:
        entries = [value] if isinstance(value, str) else value
        if not isinstance(entries, list | tuple) or not all(isinstance(e, str) and "=" in e for e in entries):
            raise InvalidParameterError("lora_modules must be NAME=PATH entries (--lora NAME=PATH)", "lora_modules")
        items = [tuple(part.strip() for part in e.split("=", 1)) for e in entries]
    modules: dict[str, str] = {}
    for name, path in items:
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise InvalidParameterError(f"lora_modules: {name!r}={path!r} needs a name and a path", "lora_modules")
        if name in modules:
            raise InvalidParameterError(f"lora_modules: the name {name!r} is given twice", "lora_modules")
        modules[name] = path
    return modules


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidParameterError(f"{name} must be a positive integer, got {value!r}", name)


def _positive_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise InvalidParameterError(f"{name} must be a positive number, got {value!r}", name)
