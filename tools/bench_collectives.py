"""The collectives on this machine, MindSpore's beside gloo's (`bash run.sh bench --collectives`,
tools/bench.py): what each layout's communication costs here, before any layout is blamed.

For 2 and 4 workers and each size (4 KB to 64 MB of float32), the median seconds of:
    all_reduce, all_gather, reduce_scatter   parallel.collectives on the workers' group (on the
                                             CPU, CpuCollectives: all-gather and reduce-scatter
                                             built from AllReduce), op by op and inside ms.jit,
                                             with MindSpore's all-reduce (mccl) and through
                                             shared memory (backends/shared_memory.py)
    exchange                                 the pipeline's hop, parallel.cpu_exchange between
                                             ranks 2i and 2i + 1 (op by op: it runs between
                                             graphs)
and, with the torch of `--torch PYTHON`, gloo's (tools/collective_timing.py, timed the same way).
`size` is one rank's tensor (all_gather's input, reduce_scatter's output times n).

    python -m tools.bench_collectives OUT      (each msrun worker; rank 0 writes the JSON lines)
"""
import sys

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn

import parallel
from tools.collective_timing import SIZES, median_seconds, write


class Graph(nn.Cell):
    """`op` (a Collectives method) compiled by ms.jit, as the model's graphs hold it."""

    def __init__(self, op):
        super().__init__()
        self.op = op

    @ms.jit
    def construct(self, x):
        return self.op(x)


def runs(comm, group, peer):
    """(op, mode, function of a tensor) of every measurement (the exchange: mint's, either
    backend)."""
    calls = {"all_reduce": comm.all_reduce, "all_gather": comm.all_gather,
             "reduce_scatter": comm.reduce_scatter}
    return ([(op, "op", fn) for op, fn in calls.items()]
            + [(op, "jit", Graph(fn)) for op, fn in calls.items()]
            + [("exchange", "op", lambda t: parallel.cpu_exchange(t, peer, group))])


def main(out):
    """Every op, size and mode on this msrun job's workers."""
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    ms.runtime.launch_blocking()
    workers = parallel.launched_world_size()
    peer = parallel.initialize_model_parallel(pp=workers).rank ^ 1     # ranks 2i and 2i + 1
    pair = parallel.get_state().pair_groups[peer]                      # the pipeline's hop
    for backend in ("mccl", "shared_memory"):
        state = parallel.initialize_model_parallel(tp=workers, cpu_collectives=backend)
        measured = runs(parallel.collectives(state.tp_group), pair, peer)
        for size in SIZES:
            one = Tensor(np.ones(size // 4, np.float32))                # [size / 4]
            whole = Tensor(np.ones(size // 4 * workers, np.float32))    # reduce_scatter's input
            for op, mode, fn in measured:
                x = whole if op == "reduce_scatter" else one
                seconds = median_seconds(lambda: fn(x).asnumpy(), parallel.barrier, size)
                if state.rank == 0:
                    write(out, dict(backend=backend, mode=mode, op=op, size=size,
                                    workers=workers, seconds=seconds))


if __name__ == "__main__":
    main(sys.argv[1])
