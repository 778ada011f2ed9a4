"""How many KV blocks an engine allocates (runner/kv_cache.py): an explicit count, a memory budget, or the CPU's
default of 8,192 tokens, or one max_model_len sequence when that is set longer, within a quarter of memory."""

import pytest
import torch

from tokenmill.config import EngineConfig
from tokenmill.runner import kv_cache
from tokenmill.runner.kv_cache import DEFAULT_CPU_CACHE_TOKENS, num_kv_blocks_for, split_kv_pools

CPU = torch.device("cpu")
GIB = 2**30


@pytest.fixture(autouse=True)
def four_gib_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda device: 4 * GIB)


def test_the_cpu_default_is_8192_tokens() -> None:
    assert num_kv_blocks_for(EngineConfig(block_size=16), 1024, CPU) * 16 == DEFAULT_CPU_CACHE_TOKENS == 8192


def test_a_longer_max_model_len_gets_room_for_one_sequence() -> None:
    assert num_kv_blocks_for(EngineConfig(block_size=16, max_model_len=32768), 1024, CPU) == 2048
    assert num_kv_blocks_for(EngineConfig(block_size=16, max_model_len=20000), 1024, CPU) == 1250
    assert num_kv_blocks_for(EngineConfig(block_size=16, max_model_len=2048), 1024, CPU) == 512  # not less


def test_the_default_stays_within_a_quarter_of_available_memory() -> None:
    per_block = 2 * 2**20  # 2 MiB a block: a quarter of 4 GiB holds 512 blocks
    assert num_kv_blocks_for(EngineConfig(block_size=16, max_model_len=32768), per_block, CPU) == 512


def test_a_count_or_a_budget_wins() -> None:
    assert num_kv_blocks_for(EngineConfig(num_kv_blocks=7, max_model_len=32768), 1024, CPU) == 7
    assert num_kv_blocks_for(EngineConfig(kv_cache_memory="1MiB", max_model_len=32768), 1024, CPU) == 1024


def test_a_drafts_share_of_the_memory_goes_with_the_full_pool() -> None:
    """Two pools (sliding-window layers apart) and a draft model whose K/V live in the full pool's blocks: the
    split spends the memory of num_blocks blocks of every layer and the draft, no more, and without a draft is
    the split it always was."""
    config = EngineConfig(block_size=16, max_num_seqs=4, max_num_batched_tokens=64)
    layers, local, window, layer_bytes, draft_bytes = 24, 12, 128, 1000, 7000
    num_blocks = 400
    full, num_local = split_kv_pools(config, num_blocks, layers, local, window, layer_bytes, draft_bytes)
    assert num_local == 4 * (128 // 16 + 1) + 4
    budget = num_blocks * (layers * layer_bytes + draft_bytes)
    spent = full * ((layers - local) * layer_bytes + draft_bytes) + num_local * local * layer_bytes
    assert budget - ((layers - local) * layer_bytes + draft_bytes) < spent <= budget
    assert split_kv_pools(config, num_blocks, layers, local, window) == (
        (num_blocks * layers - num_local * local) // (layers - local),
        num_local,
    )
