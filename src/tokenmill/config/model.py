"""Which model the engine runs and how: the model, its compute dtype and its weights' quantization, validated once
when made (LLMEngine makes one from its arguments; the command line's model options are generated from these
fields, as the engine's are from EngineConfig's). No torch here."""

from dataclasses import dataclass

from tokenmill.config.engine import option
from tokenmill.config.quantization import QUANTIZATIONS, parse_quantization
from tokenmill.errors import InvalidParameterError

DTYPES = ("float32", "bfloat16", "float16")  # runner/device.py's parse_dtype makes them torch dtypes


@dataclass
class ModelOptions:
    model: str | None = option(
        None,
        "a .gguf file, a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json), a name "
        "from `tokenmill models` (smollm2-135m, gemma3-270m), or a Hugging Face Hub repository, downloaded into "
        "its cache: ORG/NAME (safetensors) or ORG/NAME-GGUF:QUANT (the GGUF file whose name holds QUANT, e.g. "
        "Q4_K_M); default: the bundled SmolLM2-135M",
        str,
        group="model",
    )
    dtype: str = option("float32", "compute dtype", str, group="model", choices=DTYPES)
    # the parsed mode (config/quantization.py): None for float weights. LLM(...) defaults to None, as vLLM's
    # does; the command line to auto, the fastest (its cli_default). What each mode means: config/quantization.py
    quantization: str | None = option(
        None,
        "auto (default): the file's own quantized blocks (float tensors quantized as they load) through the native "
        "integer kernels, no float copy (on a GPU: float weights); none: weights dequantized to --dtype, exact "
        "float32 results; int4: Q4_0/Q4_1/Q4_K as the file has them, every other type re-coded to Q4_1; int8: 8 "
        "bits per output row (int4 and int8: CPU kernels, refused on a GPU)",
        str,
        group="model",
        choices=QUANTIZATIONS,
        cli_default="auto",
    )
    # a Hub repository's revision and file (entrypoints/model_names.py downloads it; the engine gets its path)
    revision: str | None = option(
        None, "the Hub repository's branch, tag or commit (default: main)", str, group="model"
    )
    hf_file: str | None = option(
        None, "one .gguf file of the Hub repository, by its path there (instead of :QUANT)", str, group="model"
    )

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, str):  # a torch dtype: torch.float32 -> "float32"
            self.dtype = str(self.dtype).removeprefix("torch.")
        if self.dtype not in DTYPES:
            raise InvalidParameterError(
                f"dtype {self.dtype!r} is not supported (use one of {', '.join(DTYPES)})", "dtype"
            )
        if self.model is not None and not isinstance(self.model, str):
            self.model = str(self.model)  # a path
        self.quantization = parse_quantization(self.quantization)
