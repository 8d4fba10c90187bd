"""Each fused form's gain in the benchmark's model, the figures of docs/performance.md#fusions:

    .venv/bin/python bench_fusions.py [--steps 10]
    .venv/bin/python bench_fusions.py broadcast

One process times a compiled forward + backward of bench.py's model (micro-batch 8), and of it
LLaMA-style (RoPE, SwiGLU, RMSNorm, no biases), with every fused form (fused.py) off, each one
alone, and all on, the runs alternated step by step (this machine's speed drifts): the median
ms of each and its gain over all off. `broadcast` times an elementwise product whose second
operand is a column [n, 1] or a row [h] broadcast by the op itself, against the same operand
made full-size first by a MatMul with a ones vector (parallel.broadcast_column, broadcast_row),
the reason the fused forms do the latter. Not part of bench.py, whose PyTorch reference runs
under a python without MindSpore.
"""
import sys
import time

import numpy as np
import mindspore as ms
from mindspore import nn

import gpt
import train
from bench import MODEL, SHAPE
from cli import HelpRequested, load_config, parse_command
from config import padded_vocab_size
from parallel import broadcast_column, broadcast_row

# each fused form's key and its flag that turns it off (a plain model: all of them)
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
    """A compiled forward + backward of the benchmark model with `flags`: a function of no
    arguments, compiled and run twice (warm)."""
    cfg = load_config([], [*MODEL, "--micro-batch-size", "8", *flags])
    cfg.model_config.padded_vocab_size = padded_vocab_size(cfg.model_config, SHAPE["vocab"])
    model = gpt.GPTModel(cfg.model_config)
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


if __name__ == "__main__":
    try:
        if sys.argv[1:2] == ["broadcast"]:
            broadcast_probe()
            sys.exit(0)
        fusion_probe(sys.argv[1:])
    except HelpRequested as e:
        print(e)
