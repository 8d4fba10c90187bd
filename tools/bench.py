"""Training speed of each layout, measured the way docs/performance.md's tables are made:

    bash run.sh bench [--repeats 2] [--steps 12] [--torch PYTHON] [--peer PYTHON]

Every run trains the benchmark shape (PyTorch nanoGPT-style: 4 layers, hidden 256, 8 heads, ffn
1024, sequence 256, vocabulary 4096, fp32, global batch 8) on mock data, compiled, and reports the
tokens/s of its last log window (compilation excluded), the timers line of the rank that holds
the loss (where a step's time goes) and each rank's measured peak memory growth from the first
step (memory.RankReport). The runs alternate, `--repeats` rounds of all of them, because
this machine's speed drifts; the table gives each run's figures per round.

    one                one process, micro-batch 8
    tp2 / tp2_sp       2 msrun workers: TP2, and TP2 with sequence parallelism
    dp2 / pp2          2 msrun workers: DP2 (micro-batch 4 each); PP2 with 4 micro-batches of 2
                       (1F1B)
    dp2_buckets, dp2_overlap, dp2_distopt, dp2_distopt_overlap
                       DP2 with buckets of a million elements, without and with
                       --overlap-grad-reduce (each against the one before it); the same with the
                       distributed optimizer, and with --overlap-param-gather too
    cp2 / cp2_ring     2 msrun workers: CP2, Ulysses and ring attention (128 tokens of each
                       sequence each)
                       each against `one` (the same model and global batch)
    moe / moe_ep2      the MLPs as 4 experts, top-2 (moe.py): one process; EP2 over DP2 with the
                       alltoall dispatcher (2 experts and 4 sequences a worker), against `moe`
    one_fp16, tp2_sp_fp16, dp2_fp16
                       the same in float16 (Megatron's --fp16, loss scale 4096 so that no step
                       is skipped)
    one_fused, tp2_fused
                       one process and TP2 with the fast forms of fused.py (--fusions), each
                       against the same layout in the plain forms, the default
    torch              the same GPT in PyTorch eager (`--torch /path/to/python-with-torch`;
                       torch is not a dependency:
                       `python3 -m venv /tmp/t && /tmp/t/bin/pip install torch numpy pyyaml`),
                       in an environment of its own (torch_environment: none of the variables
                       MindSpore's import and run.sh set, which halve PyTorch's speed)

bench_torch.py is that PyTorch model (and its LayerNorm alone, for bench_fusions.py), run by the
python given to --torch.
`python bench_fusions.py` times each fused form (fused.py) in the benchmark's model.
`bash run.sh bench --flight-recorder --layouts tp2_sp` prints instead what the flight recorder
(flight_recorder.py) costs a step of each layout: its collectives a step op by op
(memory.communication, an upper bound: a compiled graph is one event), the time to record one at
the stack depth of a backward, and its writer's share of a second, against the step's time.
`bash run.sh bench --peer PYTHON [--layouts ...]` prints instead the layouts megatron-core's bench
has (one, tp2, tp2_sp, dp2, pp2; those of --layouts if given) beside megatron-core's own GPTModel
in the same layout and shape (tools/bench_peer.py, run by PYTHON, a python with torch and
megatron-core, in torch_environment()): each round runs a layout here, then megatron-core's, layout
by layout; per layout each side's tokens/s per round, their ratio (this / megatron-core) and each
side's ratio to its own one process.
`bash run.sh bench --collectives [--torch PYTHON]` prints instead each collective's time and bus
bandwidth on 2 and 4 workers, op by op and compiled, beside gloo's with --torch's python
(tools/bench_collectives.py, tools/collective_timing.py).
`python bench.py matmul-peak` measures this machine's fp32 matmul TFLOP/s with MindSpore (all
cores): the denominator of the model FLOPs utilisation (MFU) the table reports.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

from instruments import flight_recorder, memory
from settings.cli import (PROJECT, PROJECT_CONFIG, load_config, msrun_command,
                          parse_layouts_command)
from tools import bench_peer
from tools.bench_torch import SHAPE
from tools.collective_timing import OPS, bus_bandwidth

MODEL = ["--mock-data", "--vocab-size", str(SHAPE["vocab"]), "--num-layers", str(SHAPE["layers"]),
         "--hidden-size", str(SHAPE["hidden"]), "--num-attention-heads", str(SHAPE["heads"]),
         "--ffn-hidden-size", str(SHAPE["ffn"]), "--seq-length", str(SHAPE["seq"]),
         "--global-batch-size", str(SHAPE["batch"]), "--eval-iters", "0", "--lr-warmup-iters", "1"]
LAYOUTS = {  # name: (workers, flags)
    "one": (1, ["--micro-batch-size", "8"]),
    "tp2": (2, ["--micro-batch-size", "8", "--tensor-model-parallel-size", "2"]),
    "tp2_sp": (2, ["--micro-batch-size", "8", "--tensor-model-parallel-size", "2",
                   "--sequence-parallel"]),
    "dp2": (2, ["--micro-batch-size", "4"]),
    "pp2": (2, ["--micro-batch-size", "2", "--pipeline-model-parallel-size", "2"]),
    "cp2": (2, ["--micro-batch-size", "8", "--context-parallel-size", "2"]),
    "cp2_ring": (2, ["--micro-batch-size", "8", "--context-parallel-size", "2",
                     "--cp-comm-type", "p2p"]),
    "cp2_all_gather": (2, ["--micro-batch-size", "8", "--context-parallel-size", "2",
                           "--cp-comm-type", "all_gather"]),
}
# PP2 with the split `plan` suggests for this model (Megatron's flag): 3 layers on the first
# stage, 1 beside the output layer on the last
LAYOUTS["pp2_balanced"] = (2, LAYOUTS["pp2"][1] + ["--decoder-first-pipeline-num-layers", "3"])
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
LAYOUTS.update({"moe": (1, ["--micro-batch-size", "8", *MOE]),
                "moe_ep2": (2, ["--micro-batch-size", "4", *MOE, "--expert-model-parallel-size",
                                "2", "--moe-token-dispatcher-type", "alltoall"])})
# Megatron's overlap (docs/parallel.md): buckets of a million elements (5 in this model),
# with and without it, DP2 and DP2 with the distributed optimizer
BUCKETS = ["--micro-batch-size", "4", "--ddp-bucket-size", "1000000"]
OVERLAP = ["--overlap-grad-reduce"]
DISTOPT = ["--use-distributed-optimizer"]
LAYOUTS.update({"dp2_buckets": (2, BUCKETS), "dp2_overlap": (2, BUCKETS + OVERLAP),
                "dp2_distopt": (2, BUCKETS + DISTOPT),
                "dp2_distopt_overlap": (2, BUCKETS + DISTOPT + OVERLAP
                                        + ["--overlap-param-gather"])})
BASE = {"moe_ep2": "moe", "dp2_overlap": "dp2_buckets",   # the run a layout is compared with,
        "dp2_distopt_overlap": "dp2_distopt"}               # if not `one`
FP16 = ["--fp16", "--initial-loss-scale", "4096"]
LAYOUTS.update({f"{name}_fp16": (LAYOUTS[name][0], LAYOUTS[name][1] + FP16)
                for name in ("one", "tp2_sp", "dp2")})
LAYOUTS.update({f"{name}_fused": (LAYOUTS[name][0], LAYOUTS[name][1] + ["--fusions"])
                for name in ("one", "tp2")})
BASE.update({"one_fused": "one", "tp2_fused": "tp2"})


def run_layout(name, steps, folder):
    """(tokens/s of the last log window, TFLOP/s per worker, timers line, each rank's measured
    peak memory growth in MiB) of one training run."""
    workers, flags = LAYOUTS[name]
    save = os.path.join(folder, f"{name}_{time.time_ns()}")
    args = ["train.py", *MODEL, *flags, "--train-iters", str(steps),
            "--log-interval", str(steps // 2), "--save", save,
            "training_config.save_interval=null"]
    if workers == 1:
        cmd, env = [sys.executable, *args], None
    else:
        cmd, env = msrun_command(workers, os.path.join(save, "msrun"), args)
    subprocess.run(cmd, cwd=PROJECT, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    logs = sorted((d for d in os.listdir(os.path.join(save, "log")) if d.startswith("rank_")),
                  key=lambda d: int(d[5:]))
    texts = [open(os.path.join(save, "log", rank, "info.log")).read() for rank in logs]
    peaks = [float(re.search(r"measured peak growth ([\d.]+) MiB", t).group(1)) for t in texts]
    for text in texts:                        # the loss (and its train: line) is on the last stage
        lines = text.splitlines()
        train = [i for i, line in enumerate(lines) if line.startswith("train: ")]
        if train:
            last = lines[train[-1]]
            tokens = float(re.search(r"Tokens/s: ([\d.]+)", last).group(1))
            tflops = float(re.search(r"TFLOP/s: ([\d.]+)", last).group(1))
            return tokens, tflops, lines[train[-1] + 1].split(": ", 1)[1], peaks
    raise RuntimeError(f"{name}: no train: line in {save}/log")


def torch_environment():
    """The environment the PyTorch reference runs in: PATH=/usr/bin:/bin and the user's HOME,
    LANG and TMPDIR, nothing else. This process has imported MindSpore, which sets
    LD_LIBRARY_PATH to its own CPU libraries (and PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION,
    HCCL_CONNECT_TIMEOUT), and run.sh adds its own; PyTorch started with them ran at about half
    its speed from a shell (docs/performance.md)."""
    kept = {name: os.environ[name] for name in ("HOME", "LANG", "TMPDIR") if name in os.environ}
    return {"PATH": "/usr/bin:/bin", **kept}


def run_torch(python, steps):
    """(tokens/s, no TFLOP/s, a description) of the PyTorch reference run by `python`, in
    torch_environment()."""
    out = subprocess.run([python, "-m", "tools.bench_torch", "torch-reference",
                          "--steps", str(steps)], cwd=PROJECT, env=torch_environment(),
                         check=True, capture_output=True, text=True).stdout
    tokens = float(re.search(r"tokens/s: ([\d.]+)", out).group(1))
    return tokens, None, ("PyTorch eager, forward + backward + AdamW; its environment: "
                          + ", ".join(torch_environment())), None


def peer_versions(python):
    """[torch's version, megatron-core's] in `python`, started in torch_environment(); None if it
    does not start or lacks either."""
    code = "import torch, megatron.core as m; print(torch.__version__, m.__version__)"
    try:
        done = subprocess.run([python, "-c", code], env=torch_environment(),
                              capture_output=True, text=True)
    except OSError:                                        # no such file, not executable
        return None
    return done.stdout.split()[-2:] if done.returncode == 0 else None


def run_peer(python, name, steps):
    """tokens/s of megatron-core's run of layout `name` (tools/bench_peer.py), run by `python` in
    torch_environment(): a process that imported MindSpore has variables that halve PyTorch's
    speed."""
    out = subprocess.run([python, "-m", "tools.bench_peer", "--layouts", name, "--steps",
                          str(steps)], cwd=PROJECT, env=torch_environment(), check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    return float(re.search(rf"^layout={name} .*tokens_per_s=([\d.]+)", out, re.M).group(1))


def matmul_peak(n=1024, reps=20):
    """fp32 TFLOP/s of an n x n x n MatMul, MindSpore on every core (compiled, as the model is)."""
    import numpy as np
    import mindspore as ms
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    ms.device_context.cpu.op_tuning.threads_num(os.cpu_count() or 1)
    ms.runtime.launch_blocking()
    a = ms.Tensor(np.random.default_rng(0).standard_normal((n, n)).astype(np.float32))
    @ms.jit
    def matmul(x):
        return ms.ops.matmul(x, x)

    matmul(a).asnumpy()
    start = time.perf_counter()
    for _ in range(reps):
        matmul(a).asnumpy()
    print(f"matmul TFLOP/s: {2 * n ** 3 * reps / (time.perf_counter() - start) / 1e12:.4f}")


BENCH_FLAGS = {"--repeats": (2, int, "alternating rounds of all runs"),
               "--steps": (12, int, "training steps per run (the second half is timed)"),
               "--layouts": (list(LAYOUTS), list, "runs to compare"),
               "--torch": (None, str, "a python with torch installed: adds the PyTorch reference"),
               "--flight-recorder": (None, bool, "the flight recorder's cost per step of each "
                                                 "layout, instead of the table"),
               "--collectives": (None, bool, "each collective's time and bandwidth on 2 and 4 "
                                             "workers (with --torch: beside gloo's), instead"),
               "--peer": (None, str, "a python with torch and megatron-core: each layout beside "
                                     "megatron-core's (tools/bench_peer.py), instead")}


def _report(name, rows, results, peak):
    """The table's lines for run `name`: tokens/s per round (and its ratio to the rounds of the
    run it is compared with, in `results`), TFLOP/s per worker and MFU against `peak`; then the
    last round's timers and each rank's peak memory growth."""
    tokens = [r[0] for r in rows]
    ratio, against = "", BASE.get(name, "one")
    base = [r[0] for r in results.get(against, [])]
    if base and name != against:
        ratio = f"  {_ratios(tokens, base)}x {against}"
    workers = LAYOUTS[name][0] if name in LAYOUTS else 1
    tflops = ""
    if rows[0][1] is not None:
        per_worker = "/".join(f"{r[1]:.4f}" for r in rows)
        mfu = "/".join(f"{r[1] * workers / peak:.0%}" for r in rows)
        tflops = f"  TFLOP/s per worker {per_worker} (MFU {mfu})"
    lines = [f"{name:8s} tokens/s {'/'.join(f'{t:.0f}' for t in tokens)}{ratio}{tflops}",
             f"{'':8s} {rows[-1][2]}"]
    if rows[-1][3] is not None:
        per_rank = "/".join(f"{p:.0f}" for p in rows[-1][3])
        lines.append(f"{'':8s} peak memory growth per rank {per_rank} MiB")
    return lines


def main(argv):
    """bash run.sh bench: see the module docstring."""
    options, code = parse_layouts_command("bench", argv, BENCH_FLAGS, LAYOUTS,
                                          about="Alternating speed benchmark of the layouts.")
    if options is None:
        return code
    a = SimpleNamespace(**options)
    if a.flight_recorder:
        return recorder_cost(a.layouts, a.steps)
    if a.collectives:
        return collectives_table(a.torch)
    if a.peer:
        return peer_table(a.peer, a.layouts, a.repeats, a.steps)
    runs = a.layouts + (["torch"] if a.torch else [])
    results = {name: [] for name in runs}
    peak_out = subprocess.run([sys.executable, "-m", "tools.bench", "matmul-peak"], check=True,
                              capture_output=True, text=True).stdout
    peak = float(re.search(r"TFLOP/s: ([\d.]+)", peak_out).group(1))
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(a.repeats):
            for name in runs:
                if name == "torch":
                    results[name].append(run_torch(a.torch, a.steps))
                else:
                    results[name].append(run_layout(name, a.steps, folder))
    print(f"benchmark shape {SHAPE}, {a.repeats} alternating rounds, "
          f"{time.strftime('%Y-%m-%d')}; fp32 matmul peak {peak:.4f} TFLOP/s on "
          f"{os.cpu_count()} cores")
    for name in runs:
        for line in _report(name, results[name], results, peak):
            print(line)


def peer_table(python, layouts, repeats, steps):
    """bash run.sh bench --peer PYTHON: those of `layouts` (--layouts, all by default) that
    megatron-core's bench has, each run here then by megatron-core in each of `repeats` rounds;
    per layout the tokens/s of both per round, their ratio and each side's to its own `one`. A
    PYTHON without torch or megatron-core, or no such layout, is one line on stderr and 2 before
    any run."""
    layouts = [name for name in layouts if name in bench_peer.LAYOUTS]
    if not layouts:
        print(f"error: bench --peer: megatron-core's bench has none of --layouts: choose from "
              f"{', '.join(bench_peer.LAYOUTS)}", file=sys.stderr)
        return 2
    versions = peer_versions(python)
    if not versions:
        print(f"error: bench --peer {python}: not a python with torch and megatron-core; make "
              f"one with `{bench_peer.INSTALL}`", file=sys.stderr)
        return 2
    this, peer = {name: [] for name in layouts}, {name: [] for name in layouts}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(repeats):
            for name in layouts:            # side by side in time: this machine's speed drifts
                this[name].append(run_layout(name, steps, folder)[0])
                peer[name].append(run_peer(python, name, steps))
    print(f"beside megatron-core {versions[1]} (torch {versions[0]}, {python}): benchmark shape "
          f"{SHAPE}, {repeats} alternating rounds, {time.strftime('%Y-%m-%d')}; "
          f"{os.cpu_count()} cores")
    for name in layouts:
        print(f"{name:8s} tokens/s this {'/'.join(f'{t:.0f}' for t in this[name])}, "
              f"megatron-core {'/'.join(f'{t:.0f}' for t in peer[name])}: "
              f"this / megatron-core {_ratios(this[name], peer[name])}")
        if "one" in layouts and name != "one":
            print(f"{'':8s} vs one process: this {_ratios(this[name], this['one'])}, "
                  f"megatron-core {_ratios(peer[name], peer['one'])}")
    return 0


def _ratios(tops, bottoms):
    """Round by round, tops / bottoms: "1.23/1.19"."""
    return "/".join(f"{t / b:.2f}" for t, b in zip(tops, bottoms))


def record_seconds(events=20000, depth=40):
    """(seconds to record one collective, called `depth` frames below code outside the project
    as a backward's collectives are, less those frames' own calls; CPU seconds of one write of a
    full ring buffer)."""
    saved, flight_recorder.RECORDER = flight_recorder.RECORDER, flight_recorder.Recorder()
    chain = "def down(n):\n    return down(n - 1) if n else record(*ARGS)"
    args = ("tp", "all_reduce", "tp-0-1", (0, 1), (8, 256, 256), "Float32")
    spent = []
    try:
        for record in (flight_recorder.collective, lambda *a: None):
            outside = {"record": record, "ARGS": args}
            exec(compile(chain, "<outside>", "exec"), outside)
            start = time.perf_counter()
            for _ in range(events):
                outside["down"](depth)
            spent.append((time.perf_counter() - start) / events)
        with tempfile.TemporaryDirectory() as folder:
            flight_recorder.RECORDER.path = os.path.join(folder, "record.json")
            start = time.thread_time()        # the CPU it takes: its fsync waits hold no core
            for _ in range(20):
                flight_recorder.dump()
            per_write = (time.thread_time() - start) / 20
    finally:
        flight_recorder.RECORDER = saved
    return spent[0] - spent[1], per_write


def recorder_cost(layouts, steps):
    """bash run.sh bench --flight-recorder: per layout, the recorder's time per step as a share of
    the step (its collectives op by op x the time per event, plus the writer's share)."""
    per_event, per_write = record_seconds()
    print(f"flight recorder: {per_event * 1e6:.1f} us per collective recorded, "
          f"{per_write * 1e3:.2f} ms per write of {flight_recorder.EVENTS} events (one every "
          f"{flight_recorder.WRITE_EVERY:.0f} s)")
    with tempfile.TemporaryDirectory() as folder:
        for name in layouts:
            workers, flags = LAYOUTS[name]
            cfg = load_config(PROJECT_CONFIG, [*MODEL, *flags], workers)
            cfg.model_config.padded_vocab_size = memory.vocab_rows(cfg)
            calls = sum(c for c, _ in memory.communication(cfg, 0).values())
            step = SHAPE["batch"] * SHAPE["seq"] / run_layout(name, steps, folder)[0]
            cost = calls * per_event + per_write / flight_recorder.WRITE_EVERY * step
            print(f"{name:8s} {calls} collectives a step, a step {step * 1e3:.0f} ms: recording "
                  f"{cost * 1e3:.2f} ms = {cost / step:.2%} of a step")
    return 0


def collectives_table(torch_python):
    """bash run.sh bench --collectives: tools/bench_collectives.py on 2, then 4 msrun workers,
    each followed by gloo's same measurements with `torch_python` (if given); one line per
    worker count, op and size: milliseconds and bus GB/s, op by op and compiled, and gloo's."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rows.jsonl")
        for workers in (2, 4):
            cmd, env = msrun_command(workers, os.path.join(folder, f"msrun{workers}"),
                                     ["python", "-m", "tools.bench_collectives", out])
            subprocess.run(cmd, cwd=PROJECT, env=env, check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            if torch_python:
                subprocess.run([torch_python, "-m", "tools.collective_timing", out, str(workers)],
                               cwd=PROJECT, env=torch_environment(), check=True)
        rows = [json.loads(line) for line in open(out)]
    print(f"collectives, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores: ms (bus GB/s)")
    print("MindSpore's all-reduce (mccl) and shared memory's (shm), op by op and compiled (jit)")
    print(f"{'n':>2} {'op':14} {'size':>6}" + "".join(f"{h:>15}" for h in COLUMNS))
    for workers, op, size in sorted({(r["workers"], r["op"], r["size"]) for r in rows},
                                    key=lambda k: (k[0], OPS.index(k[1]), k[2])):
        cells = [_cell(rows, backend, mode, op, size, workers)
                 for backend, mode in COLUMNS.values()]
        print(f"{workers:>2} {op:14} {size // 1024:>5}K" + "".join(cells))
    return 0


COLUMNS = {"mccl": ("mccl", "op"), "mccl jit": ("mccl", "jit"),            # header: (backend,
           "shm": ("shared_memory", "op"), "shm jit": ("shared_memory", "jit"),   # mode)
           "gloo": ("gloo", "op")}


def _cell(rows, backend, mode, op, size, workers):
    """One measurement's "ms (bus GB/s)", or "-" where there is none."""
    key = (backend, mode, op, size, workers)
    found = [r["seconds"] for r in rows
             if (r["backend"], r["mode"], r["op"], r["size"], r["workers"]) == key]
    if not found:
        return f"{'-':>15}"
    gbps = bus_bandwidth(op, size, workers, found[0]) / 1e9
    return f"{found[0] * 1e3:8.2f} ({gbps:4.2f})"


if __name__ == "__main__":
    if sys.argv[1:2] == ["matmul-peak"]:
        matmul_peak()
    else:
        sys.exit(main(sys.argv[1:]))
