"""What a training run prints and records, observing the Trainer from outside: each rank's log
(output/log/rank_N/), the opening lines, a train line every log_interval steps (Megatron's
training_log) with the timers of a step's phases, the ledger's `comm:` line, the evaluation
lines, the pipeline's timeline and bubble, and the same numbers in metrics.jsonl, loss.svg and
TensorBoard files (instruments/metrics.py) on the rank that logs the loss."""
import collections
import contextlib
import itertools
import logging
import math
import os
import sys
import time

import numpy as np
import yaml
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

import data
import moe
import parallel
from gpt import global_name, num_floating_point_operations
from instruments import memory, timeline
from instruments.ledger import LEDGER
from instruments.metrics import Metrics
from instruments.profiler import StepProfiler
from moe import METRICS
from parallel import F32
from settings.config import moe_layer_pattern, to_dict

log = logging.getLogger("train")


TIMERS = ("forward-backward", "grads-reduce", "optimizer")      # the phases of a step, timed


# ----------------------------------------------------------------------------- set-up
def setup_logging(output_dir, rank=0, to_console=True):
    """Console (the rank that holds the loss) plus output/log/rank_N/{info,error}.log."""
    folder = os.path.join(output_dir, "log", f"rank_{rank}")
    os.makedirs(folder, exist_ok=True)
    log.handlers.clear()
    log.setLevel(logging.INFO)
    log.propagate = False
    fmt = logging.Formatter("%(message)s")
    handlers = [logging.FileHandler(os.path.join(folder, "info.log"))]
    error_file = logging.FileHandler(os.path.join(folder, "error.log"), delay=True)
    error_file.setLevel(logging.ERROR)
    handlers.append(error_file)
    if to_console:                                   # errors reach the console from main's fail()
        console = logging.StreamHandler(sys.stdout)
        console.addFilter(lambda record: record.levelno < logging.ERROR)
        handlers.append(console)
    for h in handlers:
        h.setFormatter(fmt)
        log.addHandler(h)


def log_start(cfg, trainer, train_ds, valid_ds, test_ds):
    """The run's opening lines: the model and batch, missing splits, the effective config (rank
    0 writes it), the memory estimate, how the model runs, the pipeline stage's layers. Returns
    the memory report (memory.RankReport), to be begun and measured."""
    training_cfg, dataset_cfg = cfg.training_config, cfg.dataset_config
    model_cfg, state = cfg.model_config, trainer.state
    n_params = sum(int(np.prod(param.shape)) for param in trainer.params)
    log.info(f"model: {model_cfg.num_layers} layers, hidden {model_cfg.hidden_size}, "
             f"heads {model_cfg.num_attention_heads}, vocab {model_cfg.padded_vocab_size} "
             f"(padded), {n_params / 1e6:.2f}M parameters"
             f"{' on this rank' if state.world_size > 1 else ''}; "
             f"global batch {dataset_cfg.global_batch_size} = {dataset_cfg.batch_size} x "
             f"{dataset_cfg.micro_batch_num} micro-batches; {len(train_ds)} train samples")
    for name, dataset in zip(data.SPLITS, (train_ds, valid_ds, test_ds)):
        if isinstance(dataset, (data.GPTDataset, data.BlendedDataset)):
            log.info(data.describe(name, dataset))
        elif name != "train" and training_cfg.eval_iters and not dataset_cfg.mock_data:
            label = "validation" if name == "valid" else name
            why = (f"the {label} part of --split {dataset_cfg.split} holds no documents"
                   if dataset_cfg.train_data_path is None else f"no --{name}-data-path")
            log.info(f"no {label} loss: {why}")
    if state.rank == 0:                          # every key as this run uses it, defaults filled in
        path = os.path.join(training_cfg.output_dir, "effective_config.yaml")
        data.write_atomic(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))
        log.info(f"config: {path}")
    estimate = memory.RankReport(cfg, state, n_params,
                                 memory.optimizer_state_bytes(trainer.optimizer))
    log.info(estimate.startup(trainer.compiled))
    log.info("model compiled with ms.jit" if trainer.compiled else "model runs op by op (PyNative)"
             + (": dropout inside" if training_cfg.use_jit else ""))
    if state.pp > 1:
        log.info(f"pipeline stage {state.pp_rank}: " + ", ".join(
            f"chunk {chunk_id} = layers {ch.layer_offset}..{ch.layer_offset + len(ch.layers) - 1}"
            for chunk_id, ch in enumerate(trainer.chunks)))
    return estimate


class Timers:
    """Megatron's timers, from outside the Trainer: the seconds of each phase of a step (the
    Trainer's and the schedule's `phase` hook: TIMERS, each pass ("F" or "B", micro-batch,
    piece) as "passes", a pipeline's exchanges as "exchange"), since the last line; with
    `trace` a list, each pass appended as (kind, micro-batch, chunk, start, end)."""

    def __init__(self):
        self.seconds = collections.Counter()
        self.trace = None

    @contextlib.contextmanager
    def __call__(self, name):
        start, clock = time.time(), time.perf_counter()
        yield
        if isinstance(name, tuple):            # a pipeline pass, a piece's, a bucket's reduction
            if self.trace is not None:
                if ms.get_context("device_target") != "CPU":  # on CPU ops run in this thread
                    ms.runtime.synchronize()          # PyNative is asynchronous: the real work
                self.trace.append((*name, start, time.time()))
            if name[0] == "R":                 # inside forward-backward or grads-reduce: counted
                return
            name = "passes"
        self.seconds[name] += time.perf_counter() - clock

    def line(self, steps, pipelined):
        """Milliseconds per step in each phase over `steps` steps, then a new count; with a
        pipeline forward-backward splits into this rank's passes and its exchanges (the wait for
        the neighbour, so the bubble, included)."""
        ms_per_step = {k: self.seconds[k] * 1000 / steps for k in TIMERS + ("passes", "exchange")}
        parts = [f"forward-backward {ms_per_step['forward-backward']:.1f}"]
        if pipelined:
            parts[0] += (f" (passes {ms_per_step['passes']:.1f}, exchanges and waiting "
                         f"{ms_per_step['exchange']:.1f})")
        parts += [f"{k} {ms_per_step[k]:.1f}" for k in TIMERS[1:]]
        self.seconds.clear()
        return "timers (ms per step): " + ", ".join(parts)


class LogWindow:
    """Megatron's training_log over the steps since the last train line: their summed loss, how
    many were skipped on inf/nan (Megatron's "number of skipped iterations"), and the time per
    step since `start` over the `timed` steps; restart_clock leaves out time spent outside steps
    (compilation, evaluation, saves). Each train line's numbers also go to `metrics` (a
    metrics.Metrics on the rank that logs the loss, else None). Around each step (`step`): the
    ledger's count, the profiler, the MoE routers' losses, the last step's pipeline trace."""

    def __init__(self, cfg, trainer, first_iteration, metrics, timers):
        self.cfg, self.trainer, self.first_iteration = cfg, trainer, first_iteration
        self.metrics, self.timers = metrics, timers
        self.profiler = StepProfiler(cfg, trainer.state.rank)
        model_cfg = cfg.model_config
        self.set_batch_size(cfg.dataset_config.global_batch_size)
        self.num_moe_layers = sum(moe_layer_pattern(model_cfg))
        track_router_losses(trainer.chunks)
        self.step_moe_losses = {}
        self.reset()

    def set_batch_size(self, batch_size):
        """The global batch the next train line reports (it grows under --rampup-batch-size)."""
        model_cfg = self.cfg.model_config
        self.batch_size = batch_size
        self.tokens_per_step = batch_size * model_cfg.seq_length
        self.flops_per_step = num_floating_point_operations(model_cfg, batch_size)

    def reset(self):
        self.loss, self.steps, self.skipped = 0.0, 0, 0
        self.moe_losses = {}                           # name -> sum over the window's steps
        self.restart_clock()

    def restart_clock(self):
        self.timed, self.start = 0, time.perf_counter()

    @contextlib.contextmanager
    def step(self, iteration):
        """Around Trainer.train_step of step `iteration`: the ledger counts its collectives
        anew, the profiler sees it, the MoE routers' losses are reported after it; with
        --pipeline-trace the last step's passes are timed and drawn."""
        training_cfg, trainer = self.cfg.training_config, self.trainer
        traced = (training_cfg.pipeline_trace and iteration == training_cfg.training_iters
                  and (trainer.state.pp > 1 or training_cfg.overlap_grad_reduce))
        self.timers.trace = [] if traced else None
        LEDGER.reset()
        self.profiler.before(iteration)
        yield
        self.profiler.after(iteration)
        if self.num_moe_layers:         # Megatron's track_moe_metrics, every step on every rank
            state = trainer.state
            self.step_moe_losses = report_router_losses(
                trainer.chunks, 1 / self.cfg.dataset_config.micro_batch_num, self.num_moe_layers,
                state.pp_group, state.tp_cp_group, state.dp_group)
        if traced and trainer.state.pp > 1:
            report_pipeline_trace(self.cfg, trainer, [t for t in self.timers.trace if t[0] != "R"])
        elif traced and trainer.state.rank == loss_rank(trainer.state):
            path = os.path.join(training_cfg.output_dir, "ddp_timeline")
            log.info(timeline.write_ddp_timeline(self.timers.trace, path))
            log.info(f"data parallel: timeline written to {path}.svg and {path}.txt")
        self.timers.trace = None

    def add(self, loss, updated):
        self.loss, self.steps, self.timed = self.loss + loss, self.steps + 1, self.timed + 1
        self.skipped += not updated
        for name, value in self.step_moe_losses.items():
            self.moe_losses[name] = self.moe_losses.get(name, 0.0) + value

    def seconds_per_step(self):
        return (time.perf_counter() - self.start) / max(self.timed, 1)

    def log(self, iteration, epoch, scale, loss, updated, grad_norm, lr):
        """After step `iteration` (run with loss scale `scale`; the rest is train_step's): the
        first step's time apart, a skipped step's warning, the ledger line, and every
        log_interval steps (and the last) the train line and the timers."""
        training_cfg, trainer = self.cfg.training_config, self.trainer
        self.add(loss, updated)
        log_now = (iteration % training_cfg.log_interval == 0
                   or iteration == training_cfg.training_iters)
        if iteration == self.first_iteration and not log_now:
            # ms.jit compiles the graphs during the first step
            log.info(f"step {iteration}: {time.perf_counter() - self.start:.1f} s with "
                     "compilation and warm-up (left out of the Time: and timers averages)")
            self.timers.seconds.clear()
            self.restart_clock()
        if not updated:
            log.warning(f"skipped iteration {iteration}: inf/nan in the gradients; "
                        + scale_change(scale, trainer.scaler))
        if training_cfg.log_comm_ledger:
            log.info(f"comm: Step:{iteration}, " + LEDGER.line())
        if log_now:
            if trainer.state.is_last_stage:           # the loss exists on the last stage only
                scalars = self.scalars(grad_norm, lr)
                moe_losses = {k: v / self.steps for k, v in self.moe_losses.items()}
                log.info(train_line(iteration, epoch, updated, scalars, moe_losses))
                if self.metrics is not None:
                    self.metrics.train(iteration, **scalars, **moe_losses)
            if self.num_moe_layers and self.cfg.model_config.moe_router_enable_expert_bias:
                log.info(tokens_per_expert_line(trainer.chunks, iteration))    # this stage's
            log.info(self.timers.line(self.timed, trainer.state.pp > 1))
            self.reset()

    def scalars(self, grad_norm, lr):
        """The train line's numbers since the last one, named as metrics.TRAIN_TAGS's keys."""
        elapsed = self.seconds_per_step()
        return dict(loss=self.loss / self.steps, lr=lr, grad_norm=grad_norm,
                    loss_scale=self.trainer.scaler.scale, skipped_iterations=self.skipped,
                    tokens_per_s=self.tokens_per_step / elapsed,
                    tflops=self.flops_per_step / elapsed / self.trainer.state.world_size / 1e12,
                    iteration_time=elapsed, batch_size=self.batch_size)


def train_line(iteration, epoch, updated, s, moe_losses=None):
    """Megatron's training_log line (this project's spelling) from LogWindow.scalars `s`; an MoE
    model's aux and z losses (means over the window's steps) as Megatron prints them."""
    return (f"train: Epoch:{epoch}, Step:{iteration}, Loss: {s['loss']:.6f}, "
            f"Finite_grads: {updated}, Loss_scale: {s['loss_scale']}, "
            f"Grad_norm: {s['grad_norm']:.6f}, Skipped_iterations: {s['skipped_iterations']}, "
            f"Learning_rate: {s['lr']:.6e}, Time: {s['iteration_time'] * 1000:.2f} ms, "
            f"Tokens/s: {s['tokens_per_s']:.1f}, TFLOP/s: {s['tflops']:.4f}"
            + "".join(f", {name}: {value:.6E}" for name, value in (moe_losses or {}).items()))


def tokens_per_expert_line(chunks, iteration):
    """The tokens each expert took in step `iteration`, per MoE layer of this rank's `chunks`
    (moe.update_expert_bias's sums over TP x DP x CP), with the layer's max / mean, 1 when the
    load is even: how well the expert bias balances."""
    counts = [(global_name(chunk, name).split(".mlp")[0], router.tokens_per_expert)
              for chunk in chunks for name, router in chunk.cells_and_names()
              if isinstance(router, moe.TopKRouter) and router.tokens_per_expert is not None]
    layers = ", ".join(f"{layer}: {' '.join(str(int(n)) for n in c)} "
                       f"(max/mean {c.max() / c.mean():.3f})" for layer, c in counts)
    return f"moe tokens per expert: Step:{iteration}, " + (layers or "no MoE layer on this stage")


def scale_change(before, scaler):
    """The loss scaler's answer to an overflow, for the log: lowered (Megatron's backoff), or kept
    while hysteresis allows more overflows."""
    if scaler.scale != before:
        return f"loss scale {before:g} -> {scaler.scale:g}"
    left = getattr(scaler, "hysteresis_tracker", None)
    if left is None:
        return f"loss scale {before:g} (static)"
    overflows = "1 more overflow lowers" if left == 1 else f"{left} more overflows lower"
    return f"loss scale kept at {before:g} (hysteresis: {overflows} it)"


def report_pipeline_trace(cfg, trainer, trace):
    """Gather the step's pass times (`trace`, Timers') over the pipeline; the loss rank writes
    the timeline (text and SVG under output_dir) and logs the bubble: measured, in the unit-time
    schedule, in theory."""
    state = trainer.state
    traces = timeline.gather_trace(trace, state)
    if state.rank != loss_rank(state):
        return
    path = os.path.join(cfg.training_config.output_dir, "pipeline_timeline")
    log.info(timeline.write_timeline(traces, cfg.dataset_config.micro_batch_num,
                                     len(trainer.chunks), cfg.parallel_config.pipeline_schedule,
                                     path, parallel.rank_grid(state.world_size, state.tp,
                                                              state.cp, state.pp)))
    log.info(f"pipeline: timeline written to {path}.svg and {path}.txt")


def loss_rank(state):
    """The global rank that logs the loss: tp, cp, dp rank 0 of the last pipeline stage."""
    return int(parallel.rank_grid(state.world_size, state.tp, state.cp, state.pp)[-1, 0, 0, 0])


def log_eval_loss(split, iteration, loss, metrics):
    """Megatron's evaluation line: the `split` loss at `iteration` and its perplexity, on the
    last pipeline stage (the only one with a loss); recorded in `metrics` (None: not here)."""
    if not parallel.get_state().is_last_stage:        # no loss before the last pipeline stage
        return
    ppl = math.exp(min(loss, 20.0))
    log.info(f" {split} loss at iteration {iteration} | lm loss value: {loss:.6E} | "
             f"lm loss PPL: {ppl:.6E} |")
    if metrics is not None:
        metrics.evaluation(iteration, split, loss)


def open_metrics(cfg, state, iteration):
    """The run's metrics.Metrics on the rank that logs the loss (None on the others): in the
    save folder, where the log is (every run has one: --save, ./output by default), resumed at
    `iteration` (0: a fresh run); with --tensorboard-dir, event files there too."""
    if state.rank != loss_rank(state):
        return None
    training_cfg = cfg.training_config
    return Metrics(training_cfg.output_dir, training_cfg.tensorboard_dir, resume_step=iteration)


class RouterLosses(nn.Cell):
    """What a router gives its `tracker` hook (moe.TopKRouter), summed over a step's
    micro-batches: one float32 Parameter [3] of the values Megatron records under moe.METRICS'
    names (get_moe_metrics_tracker().record, moe_logging.py:94-128). In a tuple, so that the
    optimizer, initialisation and checkpoints do not see it; it adds inside a compiled graph."""

    def __init__(self):
        super().__init__()
        self.sums = (Parameter(Tensor(np.zeros(len(METRICS), np.float32)), requires_grad=False,
                               name=f"moe_router_losses.{next(_TRACKER_IDS)}"),)
        self.basis = Tensor(np.eye(len(METRICS), dtype=np.float32))       # row i: METRICS[i]

    def construct(self, index, value):
        ops.assign_add(self.sums[0], ops.stop_gradient(value.astype(F32)) * self.basis[index])


_TRACKER_IDS = itertools.count()             # unique names for the trackers' Parameters


def track_router_losses(cells):
    """A RouterLosses on every router of `cells` without one (their `tracker` hook), before their
    first forward: what report_router_losses reads."""
    for router in moe.routers(cells):
        if router.tracker is None:
            router.tracker = RouterLosses()


def report_router_losses(cells, loss_scale, num_moe_layers, pp_group=None, tp_cp_group=None,
                         dp_group=None):
    """Megatron's MoEMetricsTracker.report (moe_logging.py:130-218, 255-340), once per step and
    on every rank (the collectives run on all of METRICS): each router's sums over the step's
    micro-batches, summed over this rank's MoE layers and the pipeline stages (pp_group) and,
    for the balancing losses, over TP x CP (tp_cp_group); the z-loss averaged over TP x CP; all
    averaged over DP (dp_group, without CP). Then times loss_scale (1 / micro-batches) and
    divided by num_moe_layers (the model's MoE layers). Groups None: one rank. Returns {name:
    value} for the names this rank's routers record, and clears the sums."""
    found = moe.routers(cells)
    totals = ops.zeros(len(METRICS), F32)
    for router in found:
        totals = totals + router.tracker.sums[0].value()
        # in place: a compiled graph keeps adding to the memory it was compiled with, which
        # set_data would replace
        ops.assign(router.tracker.sums[0], ops.zeros(len(METRICS), F32))
    for group in (pp_group, tp_cp_group):
        if group is not None:
            totals = parallel.collectives(group).all_reduce(totals)
    tp_cp = parallel.collectives(tp_cp_group).size if tp_cp_group is not None else 1
    totals = totals * Tensor([1.0, 1.0, 1.0 / tp_cp], F32)
    if dp_group is not None:
        dp = parallel.collectives(dp_group)
        totals = dp.all_reduce(totals) / dp.size
    values = (totals * loss_scale / num_moe_layers).asnumpy()
    names = {name for router in found for name in router_metric_names(router)}
    return {name: float(values[METRICS.index(name)]) for name in METRICS if name in names}


def router_metric_names(router):
    """The names of METRICS a router records: its balancing loss's (with a coefficient) and the
    z-loss (with one)."""
    cfg = router.cfg
    balancing = [METRICS[cfg.moe_router_load_balancing_type == "seq_aux_loss"]]
    return tuple((balancing if router.aux_loss_coeff else [])
                 + (["z_loss"] if cfg.moe_z_loss_coeff else []))


if __name__ == "__main__":          # imported by train.py, not a script
    raise SystemExit("error: logs.py is a library: run `bash run.sh` (bash run.sh --help "
                     "lists the commands)")
