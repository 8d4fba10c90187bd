"""Can a parameter's memory be let go between a piece's forward and its backward, as ZeRO-3
(FSDP's optim_grads_params) needs? The probe behind issue #64's FSDP notes, one process:

    PATH=$PWD/.venv/bin:$PATH python -m tools.probe_zero3

A step runs as pipeline.ForwardBackward runs one: the forward recorded (set_grad), then the
backward replayed by GradOperation with a sens. Between them the weights (4 matrices of
4096 x 4096 float32: 256 MiB) are replaced by one-element placeholders (set_data), as shards would
replace them, then as much new memory is allocated: the process grows by it unless the weights'
memory was let go. Before the backward the weights are set back, or set to half their values:
whether the gradients change says whether the backward reads the parameters or what the forward
saved of them. Then the same weights in a graph compiled by ms.jit (as gpt.Compiled compiles a
piece): set anew with set_data between two calls, and written in place with copy_, whether the
graph's output follows them.
"""
import resource

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

WIDTH, LAYERS = 4096, 4


def rss_mib():
    """This process's resident memory now (MiB), from /proc."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2 ** 20


class Stack(nn.Cell):
    """LAYERS matmuls x @ W_i with a tanh between: the activations [8, WIDTH] stay small."""

    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(0)
        for i in range(LAYERS):
            setattr(self, f"w{i}", Parameter(Tensor(
                rng.standard_normal((WIDTH, WIDTH)).astype(np.float32) * 0.02), name=f"w{i}"))

    def construct(self, x):
        for i in range(LAYERS):
            x = ops.tanh(ops.matmul(x, getattr(self, f"w{i}")))
        return x.sum()


def step(replace, scale):
    """One step: (MiB the process grew by allocating the weights' size after the forward, with
    the weights replaced by placeholders or not, the gradients with the weights set back times
    `scale` before the backward)."""
    net = Stack()
    params = net.trainable_params()
    full = [p.value().copy() for p in params]
    x = Tensor(np.ones((8, WIDTH), np.float32))
    net.set_grad()
    net(x).asnumpy()
    if replace:
        for p in params:
            p.set_data(Tensor(np.zeros((1,), np.float32)), slice_shape=True)
    before = rss_mib()
    others = [ops.ones((WIDTH, WIDTH), ms.float32) * 2 for _ in params]
    ops.stack([o.sum() for o in others]).asnumpy()        # run now (PyNative may run later)
    grown = rss_mib() - before
    del others
    for p, value in zip(params, full):
        p.set_data(value * scale, slice_shape=True)
    grads = ops.GradOperation(get_by_list=True, sens_param=True)(net, ms.ParameterTuple(params))(
        x, Tensor(1.0, ms.float32))
    return grown, [g.asnumpy() for g in grads]


class Compiled(nn.Cell):
    """`net` compiled by ms.jit, as gpt.Compiled compiles a model piece."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def construct(self, x):
        return self.graph(x)

    @ms.jit
    def graph(self, x):
        return self.net(x)


def compiled_follows(write):
    """Whether a compiled graph's output changes when its weights are doubled by `write`
    ("set_data": new tensors, as ZeRO-3's gather sets them; "copy_": in place)."""
    net = Stack()
    graph = Compiled(net)
    x = Tensor(np.ones((8, WIDTH), np.float32))
    before = float(graph(x).asnumpy())
    for p in net.trainable_params():
        doubled = p.value() * 2
        if write == "set_data":
            p.set_data(doubled, slice_shape=True)
        else:
            p.copy_(doubled)
    return float(graph(x).asnumpy()) != before


def main():
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    follows = {write: "follows" if compiled_follows(write) else "does not follow"
               for write in ("set_data", "copy_")}
    print(f"a graph compiled by ms.jit {follows['set_data']} weights set anew (set_data) and "
          f"{follows['copy_']} weights written in place (copy_)")
    kept_growth, _ = step(False, 1.0)
    freed_growth, same = step(True, 1.0)
    _, halved = step(True, 0.5)
    reads = "the same" if all(np.array_equal(a, b) for a, b in zip(same, halved)) else "other"
    print(f"weights {LAYERS * WIDTH * WIDTH * 4 / 2 ** 20:.0f} MiB; allocating as much after the "
          f"forward grows the process by {kept_growth:.0f} MiB with them kept, "
          f"{freed_growth:.0f} MiB with them replaced; weights halved before the backward give "
          f"{reads} gradients")


if __name__ == "__main__":
    main()
