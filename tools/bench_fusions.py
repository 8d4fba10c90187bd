"""Each fused form's gain in the benchmark's model, the figures of docs/performance.md#fusions:

    .venv/bin/python bench_fusions.py [--steps 10]
    .venv/bin/python bench_fusions.py broadcast
    .venv/bin/python bench_fusions.py layernorm [--torch PYTHON]

One process times a compiled forward + backward of bench.py's model (micro-batch 8), and of it
LLaMA-style (RoPE, SwiGLU, RMSNorm, no biases), under --fusions with every keyed fused form
(fused.py) off, each one alone, and all on, the runs alternated step by step (this machine's speed
drifts): the median ms of each and its gain over all off (which keeps the forms with no key of
their own: the linears', the q/k/v split's, the tiled mask). `broadcast` times an elementwise
product whose second operand is a column [n, 1] or a row [h] broadcast by the op itself, against
the same operand made full-size first by a MatMul with a ones vector (fused.broadcast_column,
broadcast_row), the reason the fused forms do the latter. `layernorm` times 9 chained LayerNorms on
[2048, 256], forward and backward, as the ops.LayerNorm kernel (gpt.LayerNorm) and as
fused.FusedLayerNorm, and with --torch as PyTorch's kernels
(`PYTHON bench_torch.py torch-layernorm`). Not part of bench.py, whose PyTorch reference runs
under a python without MindSpore.
"""
import subprocess
import sys
import time

import numpy as np
import mindspore as ms
from mindspore import nn

import fused
import gpt
import train
from fused import broadcast_column, broadcast_row
from settings.cli import PROJECT, HelpRequested, load_config, parse_command
from settings.config import padded_vocab_size
from tools.bench import MODEL, torch_environment
from tools.bench_torch import SHAPE

# each fused form's key and its flag that turns it off under --fusions
FUSIONS = {"bias_gelu_fusion": "--no-bias-gelu-fusion",
           "masked_softmax_fusion": "--no-masked-softmax-fusion",
           "bias_dropout_fusion": "--no-bias-dropout-fusion",
           "persist_layer_norm": "--no-persist-layer-norm",
           "apply_rope_fusion": "--no-rope-fusion",
           "apply_swiglu_fusion": "--no-bias-swiglu-fusion",
           "use_fused_rmsnorm": "model_config.use_fused_rmsnorm=false",
           "cross_entropy_loss_fusion": "--no-cross-entropy-loss-fusion"}
# the benchmark's model, and a LLaMA-style one for RoPE, SwiGLU and RMSNorm
FUSION_MODELS = {"gpt2": [], "llama": ["--position-embedding-type", "rope", "--swiglu",
                                       "--disable-bias-linear", "--normalization", "RMSNorm"]}


def fused_step(flags):
    """A compiled forward + backward of the benchmark model with --fusions and `flags`: a
    function of no arguments, compiled and run twice (warm)."""
    cfg = load_config([], [*MODEL, "--micro-batch-size", "8", "--fusions", *flags])
    cfg.model_config.padded_vocab_size = padded_vocab_size(cfg.model_config, SHAPE["vocab"])
    model = gpt.model_provider(cfg.model_config)
    gpt.init_weights(model, 0)
    grad_fn = ms.value_and_grad(gpt.Compiled(model), None, model.trainable_params())
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, SHAPE["vocab"], (SHAPE["batch"], SHAPE["seq"] + 1))
    batch = train.to_tensors({"tokens": tokens[:, :-1].astype(np.int32),
                              "labels": tokens[:, 1:].astype(np.int32),
                              "loss_mask": np.ones((SHAPE["batch"], SHAPE["seq"]), np.float32),
                              "position_ids": np.tile(np.arange(SHAPE["seq"], dtype=np.int32),
                                                      (SHAPE["batch"], 1))})

    def step():
        loss, grads = grad_fn(*batch)
        return float(loss.asnumpy() + grads[-1].asnumpy().sum())
    step()
    step()
    return step


def fusion_variants(model):
    """(name, flags) of `model`'s runs: every form off, each of its forms alone, all on."""
    plain = list(FUSIONS.values())
    absent = {"gpt2": ("apply_rope_fusion", "apply_swiglu_fusion", "use_fused_rmsnorm"),
              "llama": ("bias_gelu_fusion", "persist_layer_norm", "bias_dropout_fusion")}[model]
    variants = [("all off", plain)]
    variants += [(f"{key} alone", [f for f in plain if f != off])
                 for key, off in FUSIONS.items() if key not in absent]
    return variants + [("all on", [])]


def fusion_probe(argv):
    """Each model's step with every fused form off, each one alone and all on, the runs
    alternated step by step (this machine's speed drifts): median ms and the gain over off."""
    options = parse_command("fusions", argv, {"--steps": (10, int, "timed steps per run")})[0]
    train.setup_mindspore()
    for model, flags in FUSION_MODELS.items():
        runs = [(name, fused_step(flags + extra)) for name, extra in fusion_variants(model)]
        times = {name: [] for name, _ in runs}
        for _ in range(options["steps"]):
            for name, step in runs:
                start = time.perf_counter()
                step()
                times[name].append(1000 * (time.perf_counter() - start))
        base = float(np.median(times["all off"]))
        for name, _ in runs:
            ms_step = float(np.median(times[name]))
            print(f"{model}: {name:28s} {ms_step:6.0f} ms  {base / ms_step:.2f}x", flush=True)


class _Products(nn.Cell):
    """x * operand `repeats` times, the operand broadcast by Mul ("broadcast") or made full-size
    first, each time, as the fused forms do ("column": broadcast_column, "row": broadcast_row);
    returns one element (the rest stays in the graph)."""

    def __init__(self, mode, repeats):
        super().__init__()
        self.mode, self.repeats = mode, repeats

    def construct(self, x, operand):
        for _ in range(self.repeats):
            if self.mode == "column":
                x = x * broadcast_column(operand, x.shape[-1])
            elif self.mode == "row":
                x = x * broadcast_row(operand, x.shape[0])
            else:
                x = x * operand
        return x.reshape(-1)[:1]


def broadcast_probe(repeats=8, rounds=15):
    """Median ms of one product over [2048, 256] (a LayerNorm's input) and [8, 8, 256, 256] (the
    benchmark's attention scores), by broadcast and by full-size operand, alternated."""
    train.setup_mindspore()
    rng = np.random.default_rng(0)
    x, scores = (ms.Tensor(rng.standard_normal(shape).astype(np.float32))
                 for shape in ((2048, 256), (8, 8, 256, 256)))
    cases = {"[2048, 256] x column [2048, 1]": (x, (2048, 1), "column"),
             "[2048, 256] x row [256]": (x, (256,), "row"),
             "[8, 8, 256, 256] x column [8, 8, 256, 1]": (scores, (8, 8, 256, 1), "column")}
    runs = {}
    for name, (tensor, shape, mode) in cases.items():
        operand = ms.Tensor(rng.standard_normal(shape).astype(np.float32))
        for how, kind in (("broadcast by Mul", "broadcast"), ("made full first", mode)):
            graph = ms.jit(_Products(kind, repeats).construct)
            graph(tensor, operand).asnumpy()
            runs[(name, how)] = (graph, tensor, operand, [])
    for _ in range(rounds):
        for graph, tensor, operand, times in runs.values():
            start = time.perf_counter()
            graph(tensor, operand).asnumpy()
            times.append(1000 * (time.perf_counter() - start) / repeats)
    for (name, how), (*_, times) in runs.items():
        print(f"{name:42s} {how:17s} {np.median(times):6.2f} ms", flush=True)


class _NormChain(nn.Cell):
    """`norms` LayerNorms of class `norm`, chained as x = norm(x) / 2 + x; returns sum(x)."""

    def __init__(self, norm, norms=9):
        super().__init__()
        self.norms = nn.CellList([norm(SHAPE["hidden"], 1e-5) for _ in range(norms)])

    def construct(self, x):
        for norm in self.norms:
            x = norm(x) * 0.5 + x
        return x.sum()


class _MulChain(nn.Cell):
    """`muls` products x = x * 0.999, forward and backward 2 `muls` elementwise passes."""

    def __init__(self, muls=20):
        super().__init__()
        self.muls = muls

    def construct(self, x):
        for _ in range(self.muls):
            x = x * 0.999
        return x.sum()


def _alternated(cells, x, rounds):
    """{name: median ms} of each cell's compiled forward + backward on x, alternated."""
    runs = {}
    for name, cell in cells.items():
        step = ms.jit(ms.value_and_grad(cell, 0, cell.trainable_params() or None))
        step(x)
        runs[name] = (step, [])
    for _ in range(rounds):
        for step, times in runs.values():
            start = time.perf_counter()
            step(x)[1][0].asnumpy()
            times.append(1000 * (time.perf_counter() - start))
    return {name: float(np.median(times)) for name, (_, times) in runs.items()}


def layernorm_probe(argv, rounds=20):
    """Median ms of 9 chained LayerNorms forward and backward, as the ops.LayerNorm kernel and
    as fused.FusedLayerNorm, and of one elementwise pass (a chain of 20 products, 40 passes with the
    backward); PyTorch's with --torch (`PYTHON bench_torch.py torch-layernorm`)."""
    options = parse_command("layernorm", argv, {"--torch": (None, str, "a python with torch")})[0]
    train.setup_mindspore()
    x = ms.Tensor(np.random.default_rng(0).standard_normal(
        (SHAPE["batch"] * SHAPE["seq"], SHAPE["hidden"])).astype(np.float32))
    ms_times = _alternated({"ops.LayerNorm kernel": _NormChain(gpt.LayerNorm),
                            "fused.FusedLayerNorm": _NormChain(fused.FusedLayerNorm),
                            "mul": _MulChain()}, x, rounds)
    print(f"MindSpore: one elementwise pass {ms_times.pop('mul') / 40:.3f} ms")
    for name, ms_ in ms_times.items():
        print(f"MindSpore {name:22s} 9 norms {ms_:7.2f} ms", flush=True)
    if options["torch"]:
        out = subprocess.run([options["torch"], "-m", "tools.bench_torch", "torch-layernorm"],
                             cwd=PROJECT, env=torch_environment(), check=True,
                             capture_output=True, text=True).stdout
        torch_times = dict(line.split(": ") for line in out.strip().splitlines())
        print(f"PyTorch: one elementwise pass {float(torch_times['mul']) / 40:.3f} ms")
        norms_ms = float(torch_times["layernorm"])
        print(f"PyTorch {'torch.nn.LayerNorm':24s} 9 norms {norms_ms:7.2f} ms")


if __name__ == "__main__":
    try:
        if sys.argv[1:2] == ["broadcast"]:
            broadcast_probe()
            sys.exit(0)
        if sys.argv[1:2] == ["layernorm"]:
            layernorm_probe(sys.argv[2:])
            sys.exit(0)
        fusion_probe(sys.argv[1:])
    except HelpRequested as e:
        print(e)
