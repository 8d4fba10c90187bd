"""How a collective is timed, the same for MindSpore's (tools/bench_collectives.py) and gloo's,
and gloo's side, run by the python of `bash run.sh bench --collectives --torch PYTHON` (torch is
never the project's; this file imports neither MindSpore nor the project):

    PYTHON -m tools.collective_timing OUT WORKERS

spawns WORKERS gloo processes on this machine, which time all_reduce, all_gather_into_tensor,
reduce_scatter_tensor and a batch_isend_irecv exchange between ranks 2i and 2i + 1 at each size
and write one JSON line per measurement to OUT (from rank 0).
"""
import json
import socket
import statistics
import sys
import time
import warnings

OPS = ("all_reduce", "all_gather", "reduce_scatter", "exchange")
SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)          # bytes of one rank's tensor


def repeats(size):
    """How many timed calls a size gets: a few for the largest, more for the small."""
    return max(3, min(20, (64 << 20) // (size * 4) + 3))


def bus_bandwidth(op, size, workers, seconds):
    """NCCL's tests' bus bandwidth in bytes/s (see the module docstring)."""
    factor = {"all_reduce": 2 * (workers - 1) / workers, "all_gather": workers - 1,
              "reduce_scatter": (workers - 1) / workers, "exchange": 1.0}[op]
    return factor * size / seconds


def median_seconds(run, barrier, size):
    """The median seconds of run() over repeats(size) calls, each after a barrier, after two
    untimed calls."""
    times = []
    for i in range(repeats(size) + 2):
        barrier()
        start = time.perf_counter()
        run()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def write(out, row):
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")


# ----------------------------------------------------------------------------- gloo
def gloo_worker(rank, workers, port, out):
    """gloo's ops on `workers` processes (torch.multiprocessing), rank 0 writing the rows; torch
    is imported here, as the MindSpore side imports this file's timing without it."""
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)    # reduce_scatter_tensor's name
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=workers)
    peer = rank ^ 1
    for size in SIZES:
        x = torch.ones(size // 4)
        gathered, whole = torch.empty(size // 4 * workers), torch.ones(size // 4 * workers)
        received = torch.empty(size // 4)

        def exchange():
            for handle in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer),
                                                  dist.P2POp(dist.irecv, received, peer)]):
                handle.wait()
        runs = {"all_reduce": lambda: dist.all_reduce(x.clone()),
                "all_gather": lambda: dist.all_gather_into_tensor(gathered, x),
                "reduce_scatter": lambda: dist.reduce_scatter_tensor(received, whole),
                "exchange": exchange}
        for op, run in runs.items():
            seconds = median_seconds(run, dist.barrier, size)
            if rank == 0:
                write(out, dict(backend="gloo", mode="op", op=op, size=size, workers=workers,
                                seconds=seconds))
    dist.destroy_process_group()


def gloo_main(out, workers):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(gloo_worker, args=(workers, port, out), nprocs=workers, join=True)


if __name__ == "__main__":
    gloo_main(sys.argv[1], int(sys.argv[2]))
