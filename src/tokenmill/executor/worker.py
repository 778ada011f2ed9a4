"""A rank other than 0: load its shard, then run every step rank 0 describes until told to stop.

Started by tokenmill itself (`python -m tokenmill.executor.worker --spec ... --rank R --store-port P`, see
launcher.py) or by torchrun (`tokenmill serve` on a rank other than 0 comes here). A worker never schedules or
samples: it builds the step's tensors from rank 0's description, runs its shard (the collectives join the
ranks' parts), sends its logits' columns to rank 0 and waits for the next message.
"""

import argparse
import logging
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from tokenmill.distributed.group import (
    STARTUP_TIMEOUT,
    ParallelGroup,
    join_group,
    local_store_client,
    torchrun_store,
)
from tokenmill.executor import step_message
from tokenmill.executor.heartbeat import Heartbeat
from tokenmill.executor.launcher import RankSpec
from tokenmill.executor.startup import load_and_report
from tokenmill.executor.step_message import Kind
from tokenmill.loader.lora_file import read_lora
from tokenmill.runner.device import select_device
from tokenmill.runner.memory import MemoryTrimmer, bound_onednn_cache
from tokenmill.runner.model_runner import ModelRunner

logger = logging.getLogger("tokenmill.worker")

PARENT_CHECK_S = 0.5


def serve_steps(runner: ModelRunner, group: ParallelGroup) -> int:
    """Rank 0's messages until SHUTDOWN (-> 0). A broken collective raises."""
    first = torch.empty(step_message.CAPACITY, dtype=torch.int32)
    trimmer = MemoryTrimmer()  # as rank 0's engine loop: freed memory goes back to the system
    while True:
        message = step_message.receive(group, first)
        trimmer.maybe_release()
        if message.kind == Kind.STEP:
            runner.copy_blocks(message.block_copies, message.local_block_copies)
            runner.execute(message.chunks)
        elif message.kind == Kind.ALLOCATE:
            runner.allocate_kv_cache(message.argument, message.local_argument)
        elif message.kind == Kind.LOAD_LORA:  # rank 0 read and checked it first
            runner.add_lora(message.argument, read_lora(message.text))
        elif message.kind == Kind.UNLOAD_LORA:
            runner.remove_lora(message.argument)
        elif message.kind == Kind.PING:
            group.all_reduce(torch.zeros(1))
        else:
            return 0


def run_rank(spec: RankSpec, group: ParallelGroup, heartbeat: Heartbeat) -> int:
    bound_onednn_cache()  # before the first matrix product, as LLMEngine does on rank 0
    runner = load_and_report(spec, group)
    heartbeat.stop()  # from here on, the steps' collectives and rank 0's pings tell whether this rank answers
    if runner is None:
        return 1
    code = serve_steps(runner, group)
    group.destroy()
    return code


def run_torchrun_worker(spec: RankSpec) -> int:
    """A rank > 0 started by torchrun: the rendezvous comes from its environment (env://)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = select_device(spec.device, local_rank)
    heartbeat = Heartbeat(torchrun_store(client=True), rank)
    group = join_group(rank, world, device, spec.collective_timeout_s, torchrun_store())
    logger.info("rank %d of %d joined", rank, world)
    return run_rank(spec, group, heartbeat)


def _exit_with_parent(parent: int) -> None:
    """tokenmill's own workers leave as soon as the process that started them is gone (however it ended)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="tokenmill-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a tokenmill tensor-parallel worker (started by tokenmill)")
    parser.add_argument("--spec", required=True, help="the model and engine settings (JSON)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--store-port", type=int, required=True, help="rank 0's TCPStore on 127.0.0.1")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {args.rank} %(levelname)s %(message)s")
    _exit_with_parent(os.getppid())
    spec = RankSpec.from_json(args.spec)
    store = dist.TCPStore("127.0.0.1", args.store_port, spec.tensor_parallel_size, False, STARTUP_TIMEOUT)
    heartbeat = Heartbeat(local_store_client(args.store_port, spec.tensor_parallel_size), args.rank)
    store.set(f"joined/{args.rank}", "1")
    device = select_device(spec.device, args.rank)
    group = join_group(args.rank, spec.tensor_parallel_size, device, spec.collective_timeout_s, store)
    try:
        return run_rank(spec, group, heartbeat)
    except Exception:
        logger.exception("rank %d stopped", args.rank)
        return 1


if __name__ == "__main__":
    sys.exit(main())
