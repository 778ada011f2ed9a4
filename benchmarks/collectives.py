"""What one sum over tensor-parallel ranks costs on this machine: gloo's all-reduce, gloo's send/receive round
trip, a plain TCP round trip on loopback, and tokenmill's shared-memory sum (native/shm_reduce.c), on a decode
step's 576 floats (SmolLM2-135M's hidden size).

    .venv/bin/python benchmarks/collectives.py [--ranks 2 3] [--floats 576] [--repeats 2000]

Prints one JSON line per rank count (microseconds per operation, rank 0's view).
"""

import argparse
import datetime
import json
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(seconds=60)


def timed(fn, repeats: int) -> float:
    for _ in range(50):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def rank_main(rank: int, world: int, port: int, floats: int, repeats: int, results) -> None:
    from tokenmill.distributed.shm import open_shared_memory

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, TIMEOUT)
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, world, TIMEOUT)
    shm = open_shared_memory(dist.PrefixStore("shm/", store), rank, world, 60.0)
    x = torch.ones(floats)

    def round_trip() -> None:  # rank 0 and rank 1; the others idle
        if rank == 0:
            gloo.send([x], 1, 0).wait()
            gloo.recv([x], 1, 0).wait()
        elif rank == 1:
            gloo.recv([x], 0, 0).wait()
            gloo.send([x], 0, 0).wait()

    figures = {"gloo_allreduce_us": timed(lambda: gloo.allreduce([x]).wait(), repeats)}
    figures["gloo_send_recv_round_trip_us"] = timed(round_trip, repeats) if rank < 2 else 0.0
    if shm is not None:
        figures["shm_allreduce_us"] = timed(lambda: shm.all_reduce(x), repeats)
    gloo.barrier().wait()
    if rank == 0:
        results.put(figures)


def tcp_round_trip_us(repeats: int) -> float:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    for s in (client, peer):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ctx = mp.get_context("fork")
    echo = ctx.Process(target=lambda: [peer.sendall(peer.recv(4096)) for _ in range(repeats + 50)], daemon=True)
    echo.start()

    def once() -> None:
        client.sendall(b"x" * 64)
        client.recv(4096)

    figure = timed(once, repeats)
    echo.join(5)
    return figure


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 3])
    parser.add_argument("--floats", type=int, default=576)
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args()
    tcp = tcp_round_trip_us(args.repeats)
    for world in args.ranks:
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(
            rank_main, args=(world, port, args.floats, args.repeats, results), nprocs=world, start_method="spawn"
        )
        figures = {k: round(v, 1) for k, v in results.get().items()}
        print(
            json.dumps({"ranks": world, "floats": args.floats, "tcp_loopback_round_trip_us": round(tcp, 1), **figures})
        )


if __name__ == "__main__":
    main()
