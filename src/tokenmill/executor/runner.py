"""Rank 0 of a tensor-parallel model: the engine's runner, with every step also described to the other ranks.

`TensorParallelRunner` has the ModelRunner interface the engine uses. Each step it broadcasts one compact step
description (step_message.py) and then runs its own shard; the other ranks build the same tensors from the
description and run theirs, the collectives in the model joining the parts, and only rank 0 receives the
logits. It also measures the time spent in collectives per step, pings the ranks when the engine is idle (a rank
that died or hangs is found within the collective timeout, not at the next request) and stops them at the end.
"""

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

import torch

from tokenmill.config.model_shape import ModelConfig
from tokenmill.distributed.group import ParallelGroup, join_group, local_store_client, torchrun_rank, torchrun_store
from tokenmill.distributed.shard import ShardPlan
from tokenmill.errors import CollectiveError
from tokenmill.executor import step_message
from tokenmill.executor.heartbeat import StartupWatch, process_stopped
from tokenmill.executor.launcher import STOP_GRACE_S, RankSpec, RankStartupError, WorkerProcesses
from tokenmill.executor.startup import load_and_collect, split_cpu_threads
from tokenmill.executor.step_message import Kind, Message
from tokenmill.layers.lora import AdapterWeights
from tokenmill.loader.lora_file import LoRAFile
from tokenmill.loader.model_path import resolve_model_path
from tokenmill.loader.model_source import open_model_source
from tokenmill.model.config_from_source import model_config_from_source
from tokenmill.runner.device import select_device
from tokenmill.runner.model_runner import ModelRunner, StepChunk, StepOutput

logger = logging.getLogger(__name__)


class TensorParallelRunner:
    def __init__(self, runner: ModelRunner, group: ParallelGroup, workers: WorkerProcesses | None, threads_before: int):
        self.runner = runner
        self._threads_before = threads_before  # this process's CPU threads before its cores were split
        self.group = group
        self.workers = workers  # None under torchrun, which owns the processes
        self.world_size = group.world_size
        self._pending_copies: list[tuple[int, int]] = []
        self._pending_local_copies: list[tuple[int, int]] = []
        self.last_step_collective_s = 0.0  # the last step's time in collectives (rank 0's view)
        self._closed = False

    # ---- the ModelRunner interface ----------------------------------------------------------------------------

    @property
    def model_config(self) -> ModelConfig:
        return self.runner.model_config

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.runner.kv_dtype

    @property
    def kv_scale_bytes(self) -> int:
        return self.runner.kv_scale_bytes

    def kv_bytes_per_block(self) -> int:
        """Rank 0's part (its KV heads); every rank holds the same number of blocks."""
        return self.runner.kv_bytes_per_block()

    @property
    def num_local_layers(self) -> int:
        return self.runner.num_local_layers

    def allocate_kv_cache(self, num_blocks: int, num_local_blocks: int = 0) -> None:
        step_message.send(self.group, Message(Kind.ALLOCATE, num_blocks, local_argument=num_local_blocks))
        self.runner.allocate_kv_cache(num_blocks, num_local_blocks)

    def copy_blocks(self, copies: list[tuple[int, int]], local_copies: list[tuple[int, int]] = ()) -> None:
        self._pending_copies += copies  # sent with the next step's description
        self._pending_local_copies += local_copies

    def add_lora(self, lora_id: int, lora: LoRAFile) -> AdapterWeights:
        """Rank 0 builds its part first (a bad adapter fails here, before any rank is told), then every rank reads
        its own part of the same file."""
        adapter = self.runner.add_lora(lora_id, lora)
        path = str(lora.path.resolve())  # a rank may run in another directory (torchrun, another machine's)
        step_message.send(self.group, Message(Kind.LOAD_LORA, lora_id, text=path))
        return adapter

    def remove_lora(self, lora_id: int) -> None:
        step_message.send(self.group, Message(Kind.UNLOAD_LORA, lora_id))
        self.runner.remove_lora(lora_id)

    def execute(self, chunks: list[StepChunk]) -> StepOutput:
        before = self.group.collective_seconds
        copies, self._pending_copies = self._pending_copies, []
        local_copies, self._pending_local_copies = self._pending_local_copies, []
        try:
            message = Message(Kind.STEP, chunks=chunks, block_copies=copies, local_block_copies=local_copies)
            step_message.send(self.group, message)
            self.runner.copy_blocks(copies, local_copies)
            out = self.runner.execute(chunks)
        except (RuntimeError, CollectiveError) as exc:  # gloo raises RuntimeError: a peer closed, or a timeout
            raise self._failure(exc) from exc
        self.last_step_collective_s = self.group.collective_seconds - before
        return out

    # ---- the ranks -----------------------------------------------------------------------------------------------

    def ping(self) -> None:
        """Every rank answers a tiny collective, or this raises (a dead rank at once, a hung one after the
        collective timeout)."""
        try:
            step_message.send(self.group, Message(Kind.PING))
            self.group.all_reduce(torch.zeros(1))
        except (RuntimeError, CollectiveError) as exc:
            raise self._failure(exc) from exc

    def _failure(self, exc: BaseException) -> CollectiveError:
        """What failed, naming the ranks whose processes ended or are stopped (tokenmill's own workers)."""
        ended = []
        for rank, process in (self.workers.processes if self.workers is not None else {}).items():
            code = process.poll()
            if code is not None:
                how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
                ended.append(f"rank {rank} (pid {process.pid}) {how}")
            elif process_stopped(process.pid):
                ended.append(f"rank {rank} (pid {process.pid}) is stopped")
        what = str(exc) if isinstance(exc, CollectiveError) else f"a tensor-parallel collective failed: {exc}"
        return CollectiveError("; ".join([what, *ended]))

    def close(self) -> None:
        """Tell the ranks to stop and wait for tokenmill's own workers to exit (killing those that do not)."""
        if self._closed:
            return
        self._closed = True
        try:
            step_message.send(self.group, Message(Kind.SHUTDOWN))
        except Exception as exc:  # noqa: BLE001 - a rank already gone: the workers are stopped below anyway
            logger.warning("could not tell every rank to stop: %s", exc)
        if self.workers is not None:
            self.workers.stop(grace_s=STOP_GRACE_S)  # they leave on SHUTDOWN
        try:
            self.group.destroy()
        except Exception as exc:  # noqa: BLE001
            logger.warning("leaving the process group: %s", exc)
        if self.device.type == "cpu":
            split_cpu_threads(1, self._threads_before)  # the process may go on with other engines


def join_while_watched(
    spec: RankSpec, store: torch.distributed.Store, local_rank: int, check_alive: Callable[[], None]
) -> ParallelGroup:
    """Rank 0's side of join_group, in a thread while this one checks the ranks: gloo's rendezvous waits for a
    rank's address as long as the control group's timeout (a year), so a rank that stops answering before it
    publishes one is found here. Such a thread stays blocked; start-up fails and the process normally exits."""
    device = select_device(spec.device, local_rank)
    result: list[ParallelGroup | BaseException] = []

    def join() -> None:
        try:
            result.append(join_group(0, spec.tensor_parallel_size, device, spec.collective_timeout_s, store))
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
            result.append(exc)

    # a daemon thread: one left blocked must not hold the interpreter's exit (an executor's would)
    thread = threading.Thread(target=join, name="tokenmill-join", daemon=True)
    thread.start()
    while thread.is_alive():
        check_alive()
        thread.join(timeout=0.05)
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def start_tensor_parallel(spec: RankSpec) -> TensorParallelRunner:
    """Rank 0: check that the model splits, start (or, under torchrun, meet) the other ranks, load every shard.
    Raises ShardingError when the sizes do not divide, RankStartupError naming the rank that failed."""
    n = spec.tensor_parallel_size
    config = model_config_from_source(open_model_source(resolve_model_path(spec.model)))
    for rank in range(n):
        ShardPlan.for_rank(config, rank, n)  # a size that does not divide fails here, before anything starts
    start = time.monotonic()
    threads_before = torch.get_num_threads()
    rank = torchrun_rank()
    if rank is None:
        workers: WorkerProcesses | None = WorkerProcesses(spec)
        store, local_rank = workers.store, 0
        watch_store, pids = local_store_client(workers.store.port, n), {r: p.pid for r, p in workers.processes.items()}
    else:
        world = int(os.environ["WORLD_SIZE"])
        if rank != 0 or world != n:
            raise RankStartupError(
                f"torchrun started rank {rank} of {world}, but tensor_parallel_size is {n}: the world size must "
                f"equal the tensor-parallel size, and only rank 0 runs the engine"
            )
        workers, store, local_rank = None, torchrun_store(), int(os.environ.get("LOCAL_RANK", 0))
        watch_store, pids = torchrun_store(client=True), {}  # torchrun watches its own processes

    def kill(rank: int) -> None:  # a worker of ours that stopped answering: its end ends every wait for it
        if workers is not None:
            workers.processes[rank].kill()

    watch = StartupWatch(watch_store, n, spec.collective_timeout_s, pids, kill)

    def check_alive() -> None:
        if watch.failure is not None:
            raise RankStartupError(watch.failure)
        if workers is not None:
            workers.check_alive()

    group = None
    try:
        if workers is not None:
            workers.wait_joined(check_alive)
        group = join_while_watched(spec, store, local_rank, check_alive)
        runner = load_and_collect(spec, group, check_alive)
    except BaseException as exc:
        if workers is not None:
            workers.stop()
        if group is not None:
            group.destroy()
        split_cpu_threads(1, threads_before)
        if watch.failure is not None and not isinstance(exc, RankStartupError):
            raise RankStartupError(watch.failure) from exc  # what broke the wait, not how it broke
        raise
    finally:
        watch.stop()
    logger.info("%d ranks joined and loaded their shards in %.2f s", n, time.monotonic() - start)
    return TensorParallelRunner(runner, group, workers, threads_before)
