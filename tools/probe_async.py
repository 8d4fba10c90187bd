"""Does a collective run beside computation on this machine? The probe behind
docs/parallel.md's Overlap section, on 2 msrun workers:

    PATH=$PWD/.venv/bin:$PATH msrun --worker_num 2 --local_worker_num 2 --master_port 8231 \
        --log_dir output/probe_async --join True tools/probe_async.py

Each worker times, three rounds: a computation alone (30 matmuls of 512 x 512), an all-reduce of
32 MB alone (ops.AllReduce, what the project runs), then the two begun together in the three ways
MindSpore 2.10 offers: mint.distributed.all_reduce(async_op=True) with its handle waited for after
the computation, the all-reduce issued op by op before the computation (PyNative returns at once
and runs it later), and the all-reduce in a Python thread beside the computation. Overlap would
make a together time near the larger of the two alone; the sum means none. Each worker prints a
line per round to its log (output/probe_async/worker_*.log).
"""
import threading
import time

import numpy as np
import mindspore as ms
from mindspore import Tensor, ops
from mindspore.communication import get_rank, init
import mindspore.mint.distributed as dist

ELEMENTS = 8_000_000                       # 32 MB of float32


def compute(a):
    """30 matmuls [512, 512], to the host."""
    y = a
    for _ in range(30):
        y = ops.matmul(y, a) * 0.001
    return y.asnumpy()


def timed(run):
    """Seconds of run() after a barrier (both workers start together)."""
    dist.barrier()
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def with_handle(x, a):
    """mint's all-reduce begun with async_op=True, the computation, then the handle's wait."""
    buf = x.copy()
    handle = dist.all_reduce(buf, async_op=True)
    compute(a)
    if handle is not None:
        handle.wait()
    buf.asnumpy()


def queued(x, a, all_reduce):
    """The all-reduce issued op by op first (PyNative queues it), then the computation."""
    out = all_reduce(x)
    compute(a)
    out.asnumpy()


def in_thread(x, a, all_reduce):
    """The all-reduce in a Python thread while this thread computes."""
    thread = threading.Thread(target=lambda: all_reduce(x).asnumpy())
    thread.start()
    compute(a)
    thread.join()


def main():
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    init()
    x = Tensor(np.ones(ELEMENTS, np.float32))
    a = Tensor(np.random.default_rng(0).random((512, 512), np.float32))
    all_reduce = ops.AllReduce()
    for round_ in range(3):
        alone = timed(lambda: compute(a)), timed(lambda: all_reduce(x).asnumpy())
        together = (timed(lambda: with_handle(x, a)), timed(lambda: queued(x, a, all_reduce)),
                    timed(lambda: in_thread(x, a, all_reduce)))
        print(f"rank {get_rank()} round {round_}: compute {alone[0] * 1e3:.0f} ms, all-reduce "
              f"{alone[1] * 1e3:.0f} ms (sum {sum(alone) * 1e3:.0f}); together: async_op handle "
              f"{together[0] * 1e3:.0f}, queued {together[1] * 1e3:.0f}, thread "
              f"{together[2] * 1e3:.0f} ms", flush=True)


if __name__ == "__main__":
    main()
