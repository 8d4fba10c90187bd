"""Has MindSpore point-to-point on this CPU? The probe behind docs/context-parallel.md's "The
ring, here" (why the ring's step is a shared-memory op or an all-gather), on 2 msrun workers:

    PATH=$PWD/.venv/bin:$PATH msrun --worker_num 2 --local_worker_num 2 --master_port 8233 \
        --log_dir output/probe_send_recv --join True tools/probe_send_recv.py

Each worker tries, op by op, rank 0 sending a tensor to rank 1: mint.distributed.send/recv,
isend/irecv and batch_isend_irecv; and prints one line per way, "ok" with what arrived or
"FAIL" with the error's first line, to its log (output/probe_send_recv/worker_*.log).
"""
import mindspore as ms
import mindspore.mint.distributed as dist
from mindspore import mint
from mindspore.communication import get_rank, init


def blocking(rank, x, out):
    if rank == 0:
        dist.send(x, dst=1)
    else:
        dist.recv(out, src=0)


def non_blocking(rank, x, out):
    handle = dist.isend(x, dst=1) if rank == 0 else dist.irecv(out, src=0)
    handle.wait()


def batched(rank, x, out):
    op = dist.P2POp(dist.isend, x, 1) if rank == 0 else dist.P2POp(dist.irecv, out, 0)
    for handle in dist.batch_isend_irecv([op]):
        handle.wait()


def main():
    ms.set_context(device_target="CPU")
    init()
    rank = get_rank()
    for name, way in (("send/recv", blocking), ("isend/irecv", non_blocking),
                      ("batch_isend_irecv", batched)):
        x, out = mint.ones((4,)) * 7, mint.zeros((4,))
        try:
            way(rank, x, out)
            print(f"rank {rank} {name}: ok, received {out.asnumpy().tolist()}", flush=True)
        except Exception as e:      # the probe reports every failure, whatever its kind
            line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"rank {rank} {name}: FAIL {line}", flush=True)


if __name__ == "__main__":
    main()
