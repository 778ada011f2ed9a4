"""What every rank does once joined: load its shard, and tell rank 0 whether it could.

Every rank leaves its result in the store (an empty string, or what went wrong); rank 0 reads them all before the
first step and answers with a verdict, so a rank that cannot load is named in rank 0's error and every rank exits
instead of waiting for the others.
"""

import logging
import os
from collections.abc import Callable

from tokenmill import native
from tokenmill.config.quantization import quantization_on
from tokenmill.distributed.group import STARTUP_TIMEOUT, ParallelGroup
from tokenmill.distributed.shard import ShardPlan
from tokenmill.executor.launcher import RankSpec, RankStartupError, wait_for_keys
from tokenmill.loader.model_path import resolve_model_path
from tokenmill.loader.model_source import open_model_source
from tokenmill.model.config_from_source import model_config_from_source
from tokenmill.native.threads import set_threads, usable_cpus
from tokenmill.runner.device import parse_dtype
from tokenmill.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

VERDICT = "verdict"  # store key: "go" once every rank loaded, else "abort"


def ranks_on_this_host(world_size: int) -> int:
    """How many ranks run on this machine: torchrun's LOCAL_WORLD_SIZE, else all of them."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def split_cpu_threads(local_world_size: int, cores: int | None = None) -> int:
    """On the CPU the machine's cores (or `cores`) are split between the ranks on it, for torch and the native
    kernels alike; returns this rank's thread count."""
    threads = max(1, (cores or usable_cpus()) // max(1, local_world_size))
    set_threads(threads, native.load())
    return threads


def load_shard(spec: RankSpec, group: ParallelGroup) -> ModelRunner:
    """This rank's part of the model, on the device it joined with."""
    device = group.device
    if device.type == "cpu":
        # ranks that share memory share this machine's cores, even when torchrun counts them as separate nodes
        ranks = group.world_size if group.shm is not None else ranks_on_this_host(group.world_size)
        split_cpu_threads(ranks)
        cores = usable_cpus()
        if group.rank == 0 and ranks > cores:
            logger.warning(
                "tensor parallelism over %d ranks on %d CPU cores: the ranks take turns on the cores, and every "
                "step waits for the rank that is not running, so expect it slower than one rank (use at most %d "
                "ranks on this machine)",
                ranks,
                cores,
                cores,
            )
    gguf = open_model_source(resolve_model_path(spec.model))
    plan = ShardPlan.for_rank(model_config_from_source(gguf), group.rank, group.world_size)
    quantization = quantization_on(spec.quantization, device.type)  # as LLMEngine decides on rank 0
    return ModelRunner(
        gguf,
        parse_dtype(spec.dtype),
        device,
        spec.block_size,
        quantization,
        (plan, group),
        kv_cache_dtype=spec.kv_cache_dtype,
        weight_cache=spec.weight_cache,
    )


def load_and_report(spec: RankSpec, group: ParallelGroup) -> ModelRunner | None:
    """A worker rank: load the shard, report to rank 0 and wait for its verdict -> the runner, or None when this
    rank or another could not load (this rank's own error is logged here and named in rank 0's)."""
    try:
        runner, status = load_shard(spec, group), ""
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which names this rank
        logger.exception("rank %d could not load its shard", group.rank)
        runner, status = None, f"{type(exc).__name__}: {exc}"
    group.store.set(f"loaded/{group.rank}", status)
    # a failed rank stays until rank 0 has read its report: torchrun ends a node's other ranks when one exits
    group.store.wait([VERDICT], STARTUP_TIMEOUT)
    return runner if group.store.get(VERDICT) == b"go" else None


def load_and_collect(spec: RankSpec, group: ParallelGroup, check_alive: Callable[[], None]) -> ModelRunner:
    """Rank 0: load its own shard and hear from every rank (`check_alive` raises when a rank's process is gone).
    Raises RankStartupError naming each rank that could not load; every rank then exits."""
    try:
        runner, status = load_shard(spec, group), ""
    except Exception as exc:  # noqa: BLE001 - reported with the others
        runner, status = None, f"{type(exc).__name__}: {exc}"
    group.store.set("loaded/0", status)
    keys = [f"loaded/{rank}" for rank in range(group.world_size)]
    wait_for_keys(group.store, keys, check_alive, "not every rank loaded its shard")
    statuses = [group.store.get(key).decode() for key in keys]
    failures = [f"rank {rank} could not load its shard: {s}" for rank, s in enumerate(statuses) if s]
    group.store.set(VERDICT, "abort" if failures else "go")
    if failures or runner is None:
        raise RankStartupError("; ".join(failures))
    return runner
