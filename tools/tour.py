"""The tour: every parallelism of the project trained beside one process, a row per layout.

    bash run.sh tour [--layouts tp,pp_vpp,...] [--output output/tour] [--fusions] [--no-jit]
    bash run.sh tour --break NAME|all|list   a named bug planted (tools/bugs.py): what catches it

A tiny GPT (MODEL: 4 layers, hidden 64, 4 heads, sequence 64, byte tokens of the shipped
tinyshakespeare) trains STEPS steps, compiled by ms.jit as in production, in each layout of LAYOUTS
and in one process, from the same initial weights on the same batches (float32; the fp16 row
against a float16 process); with --fusions every run, the one-process ones too, has the fast forms
of fused.py (gpt.layer_spec), and with --no-jit every run goes op by op. The layouts of one worker
count share one msrun launch, its workers running them one after another (this file is their
program too: `python tour.py --runs RUNS.json`, which calls train.main per run; a run that fails
ends its workers, and the runs after it go on in a new launch); a row is printed as each run ends:

    vs one        the largest relative difference of the STEPS losses and gradient norms from
                  one process's, then `equal` within RTOL, else `DIFFERS`: the tour stops there,
                  naming the layout and which differed (a gradient off by a constant factor, as
                  a DP sum instead of a mean makes it, moves the norm; Adam and clipping keep
                  the losses within 1e-7)
    comm MiB      what a step hands to collectives on the busiest rank, from the ledger
                  (instruments/ledger.py, training_config.log_comm_ledger) beside
                  memory.communication's formula for that rank; "=" when every rank's ledger
                  equals its formula, call for call and byte for byte
    bubble        the pipeline's measured idle / busy time (timeline.write_timeline) beside
                  (p - 1) / (v m); each pipeline row leaves its timeline SVG in its folder
    peak MiB      the largest resident-memory growth of a rank during training (memory.RankReport)
                  beside that rank's estimate (memory.stage_memory, what `bash run.sh plan`
                  prints): compiled CPU graphs keep every intermediate, several times the estimate
                  (docs/memory.md)
    tokens/s      the median step after the first two (the first compiles)

Under each row, the functions that do that layout's work (module.name, as the code spells them).
Every run's log, metrics.jsonl and loss.svg stay in <output>/<layout>/.
"""
import contextlib
import glob
import io
import json
import os
import shutil
import subprocess
import sys
import time
from collections import namedtuple

import numpy as np

import data
import parallel
import train
from instruments import memory
from settings.cli import (PROJECT, PROJECT_CONFIG, answered, load_config, msrun_command,
                          parse_command)
from settings.config import ConfigError
from tools import bugs

SHAKESPEARE = os.path.join(PROJECT, "data", "tinyshakespeare.txt")      # the shipped corpus
STEPS = 10
MODEL = ["--tokenizer-type", "ByteTokenizer", "--num-layers", "4", "--hidden-size", "64",
         "--ffn-hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--train-iters", str(STEPS), "--log-interval", "1", "--eval-iters", "0", "--lr", "1e-3",
         "--lr-warmup-iters", "2", "training_config.log_comm_ledger=true",
         "training_config.save_interval=null"]
# the one-process references: name: flags
# experts (moe.py): 4 of them, top-2, both balancing losses; no biases, as TP needs
MOE = ["--num-experts", "4", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001",
       "--disable-bias-linear"]
# the same with sigmoid scores and expert biases moved by the step's tokens (DeepSeek-V3's
# auxiliary-loss-free balancing)
MOE_BIAS = MOE + ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                  "--moe-router-bias-update-rate", "0.01"]
REFERENCES = {"one": [], "one_fp16": ["--fp16", "--initial-loss-scale", "4096"], "one_moe": MOE,
              "one_moe_bias": MOE_BIAS}
# how far a layout's losses and gradient norms may be from one process's, relative: float32 1e-5
# both; float16 3e-5 for the loss (a layout reorders float16 sums whose roundings, 2^-11 relative
# each, mostly cancel in a loss averaged over every token of the batch) and 5e-4 for the gradient
# norm (the gradients themselves are float16, Megatron's main_grad, summed and reduced in another
# order: about one float16 rounding, 2^-11 = 4.9e-4): docs/half-precision.md
FLOAT32, FLOAT16 = {"loss": 1e-5, "grad norm": 1e-5}, {"loss": 3e-5, "grad norm": 5e-4}
RTOL = {"one": FLOAT32, "one_fp16": FLOAT16, "one_moe": FLOAT32, "one_moe_bias": FLOAT32}

TP2, SP = ["--tensor-model-parallel-size", "2"], ["--sequence-parallel"]
PP2, VPP2 = (["--pipeline-model-parallel-size", "2", "training_config.pipeline_trace=true"],
             ["--virtual-pipeline-model-parallel-size", "2"])
CP2, RING = ["--context-parallel-size", "2"], ["--cp-comm-type", "p2p"]
DISTOPT = ["--use-distributed-optimizer"]
# two buckets (each at least 150000 elements, cut at a parameter's end), drawn in a timeline
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "150000",
           "training_config.pipeline_trace=true"]
EP2 = ["--expert-model-parallel-size", "2"]
# Megatron-FSDP: ZeRO-3 (its default strategy) and ZeRO-2
FSDP = ["--use-megatron-fsdp"]
ZERO2 = FSDP + ["--data-parallel-sharding-strategy", "optim_grads"]
Layout = namedtuple("Layout", "title workers flags reference code")
LAYOUTS = {
    "tp": Layout("TP2", 2, TP2, "one",
                 "parallel.ColumnParallelLinear, parallel.RowParallelLinear"),
    "tp_sp": Layout("TP2 + sequence parallel", 2, TP2 + SP, "one",
                    "parallel.reduce_scatter_to_sequence_parallel_region"),
    "dp": Layout("DP2", 2, [], "one",
                 "distributed.BucketLayout, distributed.DistributedDataParallel"),
    "dp_distopt": Layout("DP2 + distributed optimizer", 2, DISTOPT, "one",
                         "optimizer.DistributedOptimizer"),
    "dp_overlap": Layout("DP2 + distributed optimizer, overlapped", 2, DISTOPT + OVERLAP, "one",
                         "distributed.OverlappedDistributedDataParallel"),
    "pp": Layout("PP2, 1F1B", 2, PP2, "one", "pipeline.schedule, pipeline.ForwardBackward"),
    "pp_vpp": Layout("PP2 x 2 chunks, interleaved 1F1B", 2, PP2 + VPP2, "one",
                     "pipeline.build_chunks, pipeline.schedule"),
    "cp_ulysses": Layout("CP2, Ulysses", 2, CP2, "one",
                         "parallel.all_to_all_sequence_to_heads"),
    "cp_ring": Layout("CP2, ring attention passing K/V blocks", 2, CP2 + RING, "one",
                      "context_parallel.RingAttention"),
    "cp_all_gather": Layout("CP2, ring attention after an all-gather", 2,
                            CP2 + ["--cp-comm-type", "all_gather"], "one",
                            "context_parallel.AllGatherAttention"),
    "fsdp_zero2": Layout("DP2, Megatron-FSDP ZeRO-2 (optim_grads)", 2, ZERO2, "one",
                         "distributed.ShardedGradDataParallel"),
    "fsdp_zero3": Layout("DP2, Megatron-FSDP ZeRO-3 (optim_grads_params)", 2, FSDP, "one",
                         "optimizer.ShardedParamOptimizer"),
    "fp16": Layout("float16 (--fp16), DP2 + distributed optimizer", 2,
                   DISTOPT + REFERENCES["one_fp16"], "one_fp16", "optimizer.DynamicGradScaler"),
    "ep": Layout("EP2 over DP2, alltoall", 2,
                 MOE + EP2 + ["--moe-token-dispatcher-type", "alltoall"], "one_moe",
                 "moe.MoEAlltoAllTokenDispatcher, optimizer.ChainedOptimizer"),
    "ep_bias": Layout("EP2 over DP2, alltoall, expert biases", 2,
                      MOE_BIAS + EP2 + ["--moe-token-dispatcher-type", "alltoall"],
                      "one_moe_bias", "moe.update_expert_bias"),
    "ep_tp_sp": Layout("EP2 x TP2 + SP, allgather", 4, MOE + EP2 + TP2 + SP, "one_moe",
                       "moe.MoEAllGatherTokenDispatcher, parallel.rank_groups"),
    "fsdp_zero3_tp_sp": Layout("ZeRO-3 over DP2 x TP2 + SP", 4, FSDP + TP2 + SP, "one",
                               "distributed.fsdp_units"),
    "fsdp_zero3_pp": Layout("ZeRO-3 over DP2 x PP2 x 2 chunks", 4, FSDP + PP2 + VPP2, "one",
                            "distributed.fsdp_units, pipeline.ForwardBackward"),
    "cp_hybrid": Layout("CP4 = Ulysses 2 x ring 2", 4,
                        ["--context-parallel-size", "4", "--context-parallel-algo",
                         "hybrid_cp_algo", "--ulysses-degree-in-cp", "2"], "one",
                        "context_parallel.cp_token_indices"),
    "4d": Layout("TP2+SP x CP2 (ring) x PP2 x DP2, distributed optimizer", 16,
                 TP2 + SP + CP2 + RING + PP2 + DISTOPT, "one",
                 "parallel.rank_groups"),
}
TOUR_FLAGS = {"--layouts": (list(LAYOUTS), list, "the layouts to run, in this order: "
                            + ", ".join(LAYOUTS) + " (comma- or space-separated)"),
              "--output": (os.path.join("output", "tour"), str,
                           "the folder of every run's log, metrics and timeline"),
              "--break": (None, str, "plant the bug NAME of tools/bugs.py in the layouts it "
                          "concerns (not --layouts) and show which proof catches it; NAME,NAME "
                          "or `all`, each bug in turn; `list` lists them"),
              "--fusions": (False, bool, "every run, one process's too, with the fast forms of "
                            "fused.py (model_config.fusions=true)"),
              "--no-jit": (False, bool, "every run, one process's too, op by op "
                           "(training_config.use_jit=false): the suite's form, quicker to start "
                           "on this tiny model")}


def parse(argv):
    """The options of `bash run.sh tour`: (layout names in LAYOUTS' order, output folder, the
    flags every run adds to MODEL, the bugs to plant: None, "list" or names of bugs.BUGS ("all":
    every one); with bugs, the layouts are theirs)."""
    options, _ = parse_command("tour", argv, TOUR_FLAGS,
                               about="Every layout of a tiny GPT trained beside one process.")
    broken = options["break"]
    if broken not in (None, "list"):
        broken = list(bugs.BUGS) if broken == "all" else broken.split(",")
        unknown = [name for name in broken if name not in bugs.BUGS]
        if unknown or not broken:
            raise ConfigError(f"tour: --break {','.join(unknown)}: choose from list, all, "
                              f"{', '.join(bugs.BUGS)}")
    names = [n for item in options["layouts"] for n in item.split(",") if n]
    if broken not in (None, "list"):
        names = [n for name in broken for n in bugs.BUGS[name].layouts]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown or not names:
        raise ConfigError(f"tour: --layouts {','.join(unknown) or '(none)'}: choose from "
                          f"{', '.join(LAYOUTS)}")
    model_flags = ((["--fusions"] if options["fusions"] else [])
                   + (["--no-jit"] if options["no_jit"] else []))
    return ([n for n in LAYOUTS if n in names], os.path.abspath(options["output"]), model_flags,
            broken)


# ----------------------------------------------------------------------------- the runs
class Launch:
    """A group of runs in one process (`workers` 1: no msrun) or one msrun launch, started at
    once; `wait(name)` returns when that run has ended on every worker (each worker writes
    <folder>/tour_done.<rank> after its train.main) and raises RunFailed if it failed on a
    worker (<folder>/tour_failed.<rank>) or the launch ended first."""

    def __init__(self, workers, runs, output, label):
        self.workers, self.output = workers, output
        self.runs_file = os.path.join(output, f"runs_{label}.json")
        for pid_file in glob.glob(f"{self.runs_file}.pid.*"):      # a launch's before it
            os.remove(pid_file)
        data.write_atomic(self.runs_file, json.dumps(runs))
        # `python -m`: this file is in tools/, its imports are the project's folder's
        program = ["-m", "tools.tour", "--runs", self.runs_file]
        self.log_dir = os.path.join(output, f"launch_{label}")       # console.log, worker logs
        if workers == 1:
            cmd, env = [sys.executable, *program], None
        else:
            cmd, env = msrun_command(workers, self.log_dir, ["python", *program])
        os.makedirs(self.log_dir, exist_ok=True)
        self.console = open(os.path.join(self.log_dir, "console.log"), "w")
        self.process = subprocess.Popen(cmd, cwd=PROJECT, env=env, stdout=self.console,
                                        stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, name):
        folder = os.path.join(self.output, name)
        while True:
            done = all(os.path.exists(os.path.join(folder, f"tour_done.{r}"))
                       for r in range(self.workers))
            if done:
                return folder
            failed = any(os.path.exists(os.path.join(folder, f"tour_failed.{r}"))
                         for r in range(self.workers))
            if failed or self.process.poll() is not None:     # msrun ends a minute later
                raise RunFailed(f"{name} did not finish{error_of(folder, self.workers)}: see "
                                f"{folder}/log/rank_*/ and {self.log_dir}/")
            time.sleep(0.2)

    def stop(self):
        """Kill the launch if it still runs, and its workers: msrun starts each in a session of
        its own (out of msrun's process group), which would run the launch's other runs on."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, 9)
            self.process.wait()
        for pid_file in glob.glob(f"{self.runs_file}.pid.*"):
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(open(pid_file).read()), 9)
        self.console.close()


def error_of(folder, workers):
    """": rank R: <the last line of its error>" of the first rank whose error.log has one (a
    deadlock named, an exception's message), else ""."""
    for rank in range(workers):
        path = os.path.join(folder, "log", f"rank_{rank}", "error.log")
        lines = open(path).read().split("\n") if os.path.exists(path) else []
        said = [line.strip() for line in lines if line.strip()]
        if said:
            return f": rank {rank}: {said[-1]}"
    return ""


class RunFailed(Exception):
    """A run of the tour that did not finish or does not equal one process."""


def run_argv(name, flags, prefix, output, model_flags=()):
    """train.py's argv for the run `name` of the tour."""
    return ["--config", PROJECT_CONFIG, *MODEL, *model_flags, "--data-path", prefix, *flags,
            "--save", os.path.join(output, name)]


def worker(runs_file):
    """The program of each worker (or the one process): every [name, argv, bug] of runs_file
    through train.main, the bug (bugs.patches: a bug's name or an exercise's function; or None)
    planted while it runs, then
    <save>/tour_done.<rank>; the first failure ends the worker (<save>/tour_failed.<rank>; msrun
    then stops the others). Its pid goes to RUNS.json.pid.<pid>."""
    rank = os.environ.get("RANK_ID", "0")
    # for Launch.stop: msrun's scheduler runs this program too, as rank 0
    data.write_atomic(f"{runs_file}.pid.{os.getpid()}", str(os.getpid()))
    for _, argv, bug in json.loads(open(runs_file).read()):
        with bugs.planted(bugs.patches(bug) if bug else []):
            code = train.main(argv)
        save = argv[argv.index("--save") + 1]
        open(os.path.join(save, f"tour_{'failed' if code else 'done'}.{rank}"), "w").close()
        if code != 0:
            sys.exit(code)


# ----------------------------------------------------------------------------- the rows
def train_records(folder):
    """The training records of a run's metrics.jsonl (metrics.py), in step order."""
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [r for r in records if r["split"] == "train"]


def rank_lines(folder, rank, prefix):
    """The lines of rank `rank`'s info.log that start with `prefix`."""
    with open(os.path.join(folder, "log", f"rank_{rank}", "info.log")) as f:
        return [line.rstrip("\n") for line in f if line.startswith(prefix)]


COMPARED = {"loss": "loss", "grad_norm": "grad norm"}     # metrics.jsonl key: what the rows say


def differences(folder, reference_folder, steps=None):
    """{"loss": d, "grad norm": d}: the largest relative difference of the run's values of each
    step from the reference's (of the first `steps` steps, else of all)."""
    run, one = (train_records(f)[:steps] for f in (folder, reference_folder))
    if len(run) != len(one):
        raise RunFailed(f"{folder}: {len(run)} steps, one process {len(one)}")
    return {name: float(np.max(np.abs(np.subtract([r[key] for r in run], [r[key] for r in one]))
                               / np.abs([r[key] for r in one])))
            for key, name in COMPARED.items()}


def verdict(found, rtol):
    """`equal` when every difference of `found` (differences) is within its tolerance of `rtol`
    (RTOL's kind), else `DIFFERS: its grad norm by 1.0e+00 (more than 1e-05)`, naming each that
    is not."""
    beyond = [f"its {name} by {d:.1e} (more than {rtol[name]:g})" for name, d in found.items()
              if not d <= rtol[name]]
    return f"DIFFERS: {', '.join(beyond)}" if beyond else "equal"


def ledger_items(line):
    """`comm: Step:N, kind op calls bytes, ...` -> {(kind, op): (calls, bytes)}."""
    items = [i.split() for i in line.split(", ")[1:] if i != "none"]
    return {(kind, op): (int(calls), int(nbytes)) for kind, op, calls, nbytes in items}


def communication(folder, cfg, workers):
    """(ledger MiB, formula MiB) of the busiest rank's step, and whether every rank's
    ledger equals its formula (memory.communication of the rank's pipeline stage)."""
    per_stage = workers // cfg.parallel_config.pipeline_model_parallel_size
    ledgers, formulas = [], []
    for rank in range(workers):
        # the step before the last: the last one also gathers the pipeline trace
        ledgers.append(ledger_items(rank_lines(folder, rank, f"comm: Step:{STEPS - 1},")[0]))
        formulas.append(memory.communication(cfg, rank // per_stage))
    sizes = [sum(b for _, b in items.values()) / memory.MIB for items in ledgers]
    busiest = int(np.argmax(sizes))
    formula = sum(b for _, b in formulas[busiest].values()) / memory.MIB
    return sizes[busiest], formula, ledgers == formulas


def bubble(folder, cfg, workers):
    """(measured, theory) from the pipeline line of the rank that logs the loss (the first of
    the last stage, as logs.loss_rank), or None without a pipeline."""
    p = cfg.parallel_config
    grid = parallel.rank_grid(workers, p.tensor_model_parallel_size, p.context_parallel_size,
                              p.pipeline_model_parallel_size)
    lines = rank_lines(folder, int(grid[-1, 0, 0, 0]), "pipeline: bubble")
    if not lines:
        return None
    words = lines[-1].replace(",", "").replace(";", "").split()
    return float(words[words.index("measured") + 1]), float(words[words.index("theory") + 1])


def peak_memory(folder, workers):
    """(measured MiB, estimate MiB) of the rank whose resident memory grew most in training."""
    pairs = []
    for rank in range(workers):
        words = rank_lines(folder, rank, "memory: measured")[-1].split()
        pairs.append((float(words[words.index("growth") + 1]),
                      float(words[words.index("estimate") + 1])))
    return max(pairs)


def tokens_per_s(folder):
    """The median tokens/s of the steps after the first two (the first compiles)."""
    return float(np.median([r["tokens_per_s"] for r in train_records(folder)[2:]]))


HEADER = ("layout      ranks  vs one process             comm MiB/step     bubble       "
          "peak MiB    tokens/s\n"
          "                   loss    grad norm          ledger  formula   meas. (p-1)/vm  "
          "meas. plan")


def row(name, folder, reference_folder, model_flags=()):
    """The tour's row for the run `name` in `folder`, and its verdict (verdict)."""
    layout = LAYOUTS[name]
    cfg = load_config(PROJECT_CONFIG, [*MODEL, *model_flags, *layout.flags], layout.workers)
    cfg.model_config.padded_vocab_size = memory.vocab_rows(cfg)
    found = differences(folder, reference_folder)
    said = verdict(found, RTOL[layout.reference])
    ledger, formula, same = communication(folder, cfg, layout.workers)
    pipe = bubble(folder, cfg, layout.workers)
    pipe = f"{pipe[0]:5.3f} {pipe[1]:5.3f}" if pipe else f"{'-':>5} {'-':>5}"
    measured, estimate = peak_memory(folder, layout.workers)
    text = (f"{name:<13} {layout.workers:>2}  {found['loss']:7.1e} {found['grad norm']:7.1e} "
            f"{said[:7]:<7}  "
            f"{ledger:7.3f} {'=' if same else '!='} {formula:7.3f}  {pipe}  "
            f"{measured:6.0f} {estimate:5.1f}  {tokens_per_s(folder):7.0f}")
    return text, said


# ----------------------------------------------------------------------------- bash run.sh tour
def start(workers, runs, prefix, output, model_flags, label):
    """Launch `runs` (Run: references and layouts, each with its bug) on `workers` workers,
    their folders emptied first; `label` names the launch's folder."""
    specs = []
    for run in runs:
        shutil.rmtree(os.path.join(output, run.name), ignore_errors=True)
        flags = REFERENCES[run.layout] if run.layout in REFERENCES else LAYOUTS[run.layout].flags
        specs.append([run.name, run_argv(run.name, flags, prefix, output, model_flags), run.bug])
    return Launch(workers, specs, output, label)


# a run of the tour: its folder under the output (`name`), the layout or reference it trains,
# the bug planted in it (what bugs.patches takes: a name of bugs.BUGS, or a learner's function
# from an exercise's copy; or None)
Run = namedtuple("Run", "name layout bug")


def launches(runs):
    """[(workers, [Run])]: the one-process references the layouts of `runs` are compared with,
    then the runs of each worker count, in order."""
    references = [Run(r, r, None) for r in REFERENCES
                  if any(LAYOUTS[run.layout].reference == r for run in runs)]
    counts = sorted({LAYOUTS[run.layout].workers for run in runs})
    return [(1, references)] + [(w, [run for run in runs if LAYOUTS[run.layout].workers == w])
                                for w in counts]


def ended(runs, prefix, output, model_flags):
    """Yield (run, its folder or the RunFailed that ended it) for each of `runs` and the
    references they need, in one launch per worker count (launches); a run that fails ends its
    workers, so the runs after it go on in a new launch. The launch is stopped when the caller
    stops reading."""
    for workers, group in launches(runs):
        yield from _ended(workers, group, prefix, output, model_flags)


def _ended(workers, runs, prefix, output, model_flags):
    """ended for the runs of one worker count."""
    left, attempt = list(runs), 0
    while left:
        launch = start(workers, left, prefix, output, model_flags,
                       f"{workers}" + (f"_{attempt}" if attempt else ""))
        try:
            for i, run in enumerate(left):
                try:
                    folder = launch.wait(run.name)
                except RunFailed as e:
                    yield run, e
                    left, attempt = left[i + 1:], attempt + 1
                    break
                yield run, folder
            else:
                left = []
        finally:
            launch.stop()


def tour(runs, output, model_flags=(), on_caught=None):
    """Run the references, then each worker count's runs in one launch, printing a row per
    layout as it ends. Without `on_caught` (the plain tour), stop at the first run that fails or
    differs: 1, else 0. With it (--break), a layout that fails or differs catches its run's bug:
    on_caught(bug, the RunFailed) says so, the bug's later runs are passed over, and the tour
    ends when every bug is caught: 0 (1 when a reference fails)."""
    with contextlib.redirect_stdout(io.StringIO()):          # preprocessing's progress lines
        prefix = data.ensure_preprocessed(SHAKESPEARE, os.path.join(output, "data", "shakespeare"),
                                          "ByteTokenizer")
    print(HEADER, flush=True)
    caught = set()
    # closed on a return too, which stops the running launch at once
    with contextlib.closing(ended(runs, prefix, output, model_flags)) as outcomes:
        for run, outcome in outcomes:
            if run.bug in caught:
                continue
            try:
                if isinstance(outcome, RunFailed):
                    raise outcome
                if run.layout not in REFERENCES:
                    print(report(run.layout, outcome, output, model_flags), flush=True)
            except RunFailed as e:
                if on_caught is None or run.bug is None:
                    print(f"tour: stopped: {e}", flush=True)
                    return 1
                caught.add(run.bug)
                on_caught(run.bug, e)
                if caught == {r.bug for r in runs}:
                    return 0
    return 0


def report(name, folder, output, model_flags=()):
    """The lines of layout `name` (its row, the code that does its work, its timeline), or
    RunFailed if its losses differ from one process's."""
    layout = LAYOUTS[name]
    text, said = row(name, folder, os.path.join(output, layout.reference), model_flags)
    lines = [text, f"    {layout.title}: {layout.code}"]
    if "training_config.pipeline_trace=true" in layout.flags:
        kind = "pipeline" if "--pipeline-model-parallel-size" in layout.flags else "ddp"
        lines.append(f"    timeline: {shown(folder)}/{kind}_timeline.svg")
    if said != "equal":
        print("\n".join(lines), flush=True)
        raise RunFailed(f"{name} differs from one process: {said[len('DIFFERS: '):]}: its log "
                        f"is in {shown(folder)}/log")
    return "\n".join(lines)


def shown(path):
    """A path as printed: relative to the working folder when inside it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


@answered
def main(argv):
    """bash run.sh tour: see the module docstring."""
    names, output, model_flags, bug = parse(argv)
    if bug == "list":
        print("\n".join(bugs.catalogue()))
        return 0
    if bug:
        return broken_tour(bug, output, model_flags)
    started = time.time()
    os.makedirs(output, exist_ok=True)
    form = "op by op" if "--no-jit" in model_flags else "compiled"
    print(f"tour: {len(names)} layout(s) of a tiny GPT, {STEPS} {form} steps each, beside one "
          f"process (output: {shown(output)})", flush=True)
    code = tour([Run(name, name, None) for name in names], output, model_flags)
    if code == 0:
        minutes, seconds = divmod(round(time.time() - started), 60)
        print(f"tour: {len(names)} layout(s), each equal to one process, in {minutes} min "
              f"{seconds} s")
    return code


def broken_tour(names, output, model_flags):
    """`--break NAME` (names: [NAME]), `--break NAME,NAME` or `--break all` (every bug): each bug
    planted (in the workers' memory) in its layouts, the runs sharing launches, beside one
    process; as each is caught, what it changed and why the proof caught it. Exit 1 when every
    bug was caught, 3 when one was not (a hole in the proofs, named)."""
    started = time.time()
    os.makedirs(output, exist_ok=True)
    runs = [Run(layout if len(names) == 1 else f"{bug}/{layout}", layout, bug)
            for bug in names for layout in bugs.BUGS[bug].layouts]
    # a deadlock ends its workers: its runs go last, so that no launch starts again after it
    runs.sort(key=lambda run: bugs.BUGS[run.bug].proof == "deadlock")
    if len(names) == 1:
        print(f"tour: the bug {names[0]} planted in {', '.join(r.layout for r in runs)}, beside "
              f"one process (output: {shown(output)})", flush=True)
    else:
        print(f"tour: {len(names)} bugs of tools/bugs.py, each planted in its layouts, beside one "
              f"process (output: {shown(output)})", flush=True)
    caught = []

    def on_caught(bug, failed):
        print(f"tour: the bug {bug} caught: {failed}")
        print("\n".join(bugs.explanation(bug)), flush=True)
        caught.append(bug)
    if tour(runs, output, model_flags, on_caught):
        return 1
    missed = [bug for bug in names if bug not in caught]
    for bug in missed:
        print("\n".join(bugs.explanation(bug)))
        print(f"tour: the bug {bug} was not caught: a hole in the proofs")
    if missed:
        return 3
    if len(names) > 1:
        minutes, seconds = divmod(round(time.time() - started), 60)
        print(f"tour: {len(names)} bugs, each caught, in {minutes} min {seconds} s")
    return 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--runs"]:
        worker(sys.argv[2])
    else:
        sys.exit(main(sys.argv[1:]))
