"""Megatron's training, step for step: this project's run beside megatron-core's of the same model,
data and initial weights.

    bash run.sh parity --peer PYTHON [--steps 24] [--rtol 1e-4] [--output output/parity]
                       [training flags: the model, the schedule, the layout of this side]

PYTHON has torch and megatron-core (tools/bench_peer.INSTALL; never a dependency of this
project), and runs in the minimal environment of `bench --peer` (tools/bench.torch_environment).
Three runs, one after another, in --output:
  project/  this project's training, in the layout the flags give (`--nproc N` and any of TP,
            PP, DP, CP and their flags), float32, with --save-initial-checkpoint: its iteration
            0 is the seed;
  seed/     that seed converted to one process in Megatron-LM's torch format (`convert`);
  the peer  megatron-core's training of it in one process (tools/parity_peer.py): its GPTModel,
            GPTDataset, DistributedDataParallel, optimizer and OptimizerParamScheduler.
Then a line a step: each side's loss, gradient norm and learning rate and their relative
difference, and a verdict: exit 0 when every difference is within --rtol, 1 when one is not.

What the peer cannot train the same way on this CPU is refused before any run, named in one line:
float16 or bfloat16 (the peer trains float32), dropout (the two frameworks draw other random
numbers), experts, mock data, blends and the cyclic sampler (the peer reads one corpus in
Megatron's order), activations other than GeLU and SwiGLU, sandwich norms, and biases on the
attention's projections that differ from the other linears'.
"""
import os
import subprocess
import sys

from settings.cli import PROJECT, REQUIRED, answered, load_config, parse_command
from settings.config import ConfigError
import train
from tools import bench, bench_peer, tour

FLAGS = {"--peer": (REQUIRED, str, "a python with torch and megatron-core"),
         "--steps": (24, int, "training steps of both sides (with --train-samples, the "
                              "iterations its samples make)"),
         "--rtol": (1e-4, float, "the largest relative difference of a step's loss, gradient "
                                 "norm or learning rate taken as equal"),
         "--output": (os.path.join("output", "parity"), str,
                      "the folder of the project's run, the seed and the peer's log")}
# the values parity compares: metrics.jsonl's key, the peer's key, what the table calls it
COMPARED = [("loss", "loss", "loss"), ("grad_norm", "grad_norm", "grad norm"),
            ("lr", "lr", "lr"), ("batch_size", "batch_size", "batch")]


@answered
def main(argv):
    """`bash run.sh parity`: 0 equal, 1 differing, 2 a refused command line."""
    options, flags = parse_command("parity", argv, FLAGS, passthrough="training flags")
    workers = nproc(flags)
    training = [f for i, f in enumerate(flags) if "--nproc" not in flags[max(i - 1, 0):i + 1]]
    refuse(load_config([], [*training, "--train-iters", str(options["steps"])], workers))
    # this side's command checked as run.sh checks it (config, layout, corpus): one line, 2
    if train.main(["check", "--nproc", str(workers), *training, *run_flags(options["steps"])]):
        return 2
    versions = bench.peer_versions(options["peer"])
    if not versions:
        print(f"error: parity --peer {options['peer']}: not a python with torch and "
              f"megatron-core; make one with `{bench_peer.INSTALL}`", file=sys.stderr)
        return 2
    out = os.path.abspath(options["output"])
    this = run_project(flags, options["steps"], out)
    peer = run_peer(options["peer"], out, len(this))     # --train-samples: its iterations
    print(f"parity: this project ({' '.join(flags) or 'config.yaml'}) beside megatron-core "
          f"{versions[1]} (torch {versions[0]}, one process), {options['steps']} steps")
    return report(this, peer, options["rtol"])


def nproc(flags):
    """The --nproc of the training flags (run.sh's), 1 if none."""
    return int(flags[flags.index("--nproc") + 1]) if "--nproc" in flags else 1


def refuse(cfg):
    """What the peer cannot train as this project does, one ConfigError naming it."""
    model_cfg, dataset_cfg, training_cfg = cfg.model_config, cfg.dataset_config, cfg.training_config
    refused = [
        (model_cfg.params_dtype != "float32" or model_cfg.compute_dtype != "float32",
         "--fp16/--bf16: the peer trains float32"),
        (model_cfg.hidden_dropout_rate or model_cfg.attention_dropout_rate,
         "dropout: the two frameworks draw other random numbers; give --hidden-dropout 0 "
         "--attention-dropout 0"),
        (model_cfg.num_moe_experts, "--num-experts: the peer trains a dense model"),
        (dataset_cfg.mock_data, "--mock-data: the peer reads a corpus (--data-path)"),
        (isinstance(dataset_cfg.data_path, list) and len(dataset_cfg.data_path) != 1
         or dataset_cfg.dataloader_type != "single",
         "a blend or the cyclic sampler: the peer reads one corpus in Megatron's order"),
        (model_cfg.hidden_act not in ("gelu", "gelu_tanh", "swiglu"),
         f"--hidden-act {model_cfg.hidden_act}: the peer's are gelu, gelu_tanh and swiglu"),
        (model_cfg.use_sandwich_norm, "sandwich norms: megatron-core's GPT has none"),
        (not model_cfg.qkv_has_bias == model_cfg.out_proj_has_bias == model_cfg.add_bias_linear,
         "attention biases unlike the other linears': megatron-core's add_bias_linear is one"),
        (training_cfg.load_checkpoint, "--load: parity starts both sides from a seed of its own")]
    for hit, why in refused:
        if hit:
            raise ConfigError(f"parity: {why}")


def run_flags(steps):
    """What parity adds to this side's training flags: its steps, a line each, no evaluation."""
    return ["--train-iters", str(steps), "--log-interval", "1", "--eval-iters", "0"]


def run_project(flags, steps, out):
    """This project's run (bash run.sh) and its seed converted to one process in torch format:
    its training records (metrics.jsonl)."""
    project, seed = os.path.join(out, "project"), os.path.join(out, "seed")
    for folder in (project, seed):
        if os.path.isdir(folder) and os.listdir(folder):
            subprocess.run(["rm", "-rf", folder], check=True)
    run = ["bash", "run.sh", *flags, *run_flags(steps), "--save-initial-checkpoint", "--save",
           project]
    subprocess.run(run, cwd=PROJECT, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["bash", "run.sh", "convert", "--load", project, "--ckpt-step", "0",
                    "--save", seed, "--ckpt-format", "torch"], cwd=PROJECT, check=True,
                   stdout=subprocess.DEVNULL)
    return tour.train_records(project)


def run_peer(python, out, steps):
    """megatron-core's run (tools/parity_peer.py, by `python` in bench.torch_environment): its
    records, {key: value} a step."""
    done = subprocess.run(
        [python, "-m", "tools.parity_peer", "--config",
         os.path.join(out, "project", "effective_config.yaml"), "--load",
         os.path.join(out, "seed"), "--steps", str(steps), "--cache",
         os.path.join(out, "peer_cache")],
        cwd=PROJECT, env=bench.torch_environment(), capture_output=True, text=True)
    with open(os.path.join(out, "peer.log"), "w") as f:
        f.write(done.stdout + done.stderr)
    if done.returncode:
        sys.exit(f"error: parity: megatron-core's run failed (exit {done.returncode}): "
                 f"{os.path.join(out, 'peer.log')}")
    return [dict((k, float(v)) for k, v in (pair.split("=") for pair in line.split()))
            for line in done.stdout.splitlines() if line.startswith("step=")]


def report(this, peer, rtol):
    """The table of both sides, a line a step, and the verdict: 0 within rtol, else 1."""
    print(f"{'step':>4}  " + "  ".join(f"{name:>12} this / megatron-core {'rel':>8}"
                                        for _, _, name in COMPARED))
    largest = {name: 0.0 for _, _, name in COMPARED}
    for a, b in zip(this, peer):
        cells = []
        for key, peer_key, name in COMPARED:
            x, y = a[key], b[peer_key]
            rel = abs(x - y) / max(abs(y), 1e-30)
            largest[name] = max(largest[name], rel)
            cells.append(f"{x:12.7g} / {y:<12.7g} {rel:8.1e}")
        print(f"{int(a['step']):4d}  " + "  ".join(cells))
    worst = max(largest, key=largest.get)
    equal = len(this) == len(peer) and largest[worst] <= rtol
    said = ", ".join(f"{name} {value:.1e}" for name, value in largest.items())
    print(f"parity: largest relative differences {said}: "
          + ("equal" if equal else f"DIFFER ({worst})") + f" within rtol {rtol:g}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
