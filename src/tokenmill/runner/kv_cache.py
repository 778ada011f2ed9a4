"""The KV cache's element type, and how many KV blocks to allocate: from an explicit count, a memory budget, or a
default (on the CPU, 8,192 tokens or one max_model_len sequence if longer, within a quarter of available memory; on
CUDA, a share of free GPU memory)."""

import logging

import torch

from tokenmill.config import EngineConfig, parse_memory

logger = logging.getLogger(__name__)

DEFAULT_CPU_SHARE = 0.25  # of available memory, at most
# and at most this many tokens: a whole 8K context (llama.cpp's and Ollama's servers default to 4,096). The cache
# is resident from the start (it is written when allocated): for the bundled model, 360 MiB, so that an idle
# `tokenmill serve` stays under 1 GiB (benchmarks/README.md, "Reliability"). More with --kv-cache-memory.
DEFAULT_CPU_CACHE_TOKENS = 8192
DEFAULT_GPU_SHARE = 0.7  # of free GPU memory after the weights are loaded

# int8: values with a float32 scale per token and head (layers/kv_quant.py)
KV_CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, native_decoder: bool) -> torch.dtype:
    """`auto`: float16 where the native decoder reads the cache (it converts 16 values per instruction, and decode
    reads half the bytes: faster, benchmarks/README.md "Real sizes"), else the model's own dtype (torch's
    attention would convert every gathered block first). float16 rather than bfloat16: 3 more mantissa bits, and
    llama.cpp's default too."""
    if name == "auto":
        return torch.float16 if native_decoder else model_dtype
    return KV_CACHE_DTYPES[name]


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 1024**3


def num_kv_blocks_for(config: EngineConfig, bytes_per_block: int, device: torch.device) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory is not None:
        budget = parse_memory(config.kv_cache_memory)
    elif device.type == "cuda":
        budget = int(available_memory_bytes(device) * DEFAULT_GPU_SHARE)
    else:
        budget = int(available_memory_bytes(device) * DEFAULT_CPU_SHARE)
        # a --max-model-len over the default gets room for one sequence of it (within the same share of memory)
        tokens = max(DEFAULT_CPU_CACHE_TOKENS, config.max_model_len or 0)
        return max(1, min(budget // bytes_per_block, -(-tokens // config.block_size)))
    return max(1, budget // bytes_per_block)


def split_kv_pools(
    config: EngineConfig,
    num_blocks: int,
    layers: int,
    local: int,
    window: int | None,
    layer_block_bytes: int = 1,
    draft_block_bytes: int = 0,
) -> tuple[int, int]:
    """num_blocks blocks for every layer -> (blocks of the full-attention layers' pool, blocks of the
    sliding-window layers' own pool, or 0 without such layers).

    The memory is what one pool for every layer would take. With sliding-window layers, their pool holds what
    max_num_seqs sequences read in their windows plus a step's new tokens (at least one sequence's), since their
    blocks go back once they leave the window; the rest of the memory goes to the full-attention layers, whose
    blocks every position keeps. A draft model's K/V (draft_block_bytes a block, against layer_block_bytes of each
    of the target's layers) live in the full pool's blocks: its block tables are the ones the draft reads."""
    if not local:
        return num_blocks, 0
    bs = config.block_size
    assert window is not None  # local layers have a window
    step_blocks = -(-config.max_num_batched_tokens // bs)  # a step's new tokens, all in one sequence
    one = -(-window // bs) + 2 + step_blocks  # what one sequence may hold during a step
    want = config.max_num_seqs * (-(-window // bs) + 1) + step_blocks
    num_local = max(one, min(num_blocks, want))
    lb, db = layer_block_bytes, draft_block_bytes
    return max(1, (num_blocks * (layers * lb + db) - num_local * local * lb) // ((layers - local) * lb + db)), num_local
