"""Pretrain a GPT from one YAML:
`python train.py [--config config.yaml] [Megatron flags] [section.key=value]`.

Also `python train.py preprocess <Megatron preprocess_data.py flags>`, `check --nproc N [flags]`
(what run.sh runs before msrun: the config, the layout for N workers and the input files, checked
in one process), `generate --load DIR --prompt TEXT` (sample.py), and the checkpoint commands
`convert`, `import-hf`, `export-hf`, `import-megatron` (checkpoint.py, hf_gpt2.py), and
`plan --world-size N` (memory.py): the table COMMANDS.

One training step (Megatron's train_step, one process):
  for each of micro_batch_num micro-batches: loss_i * loss_scale / micro_batch_num, backward,
  gradients summed; then their data-parallel reduction (distributed.py) and optimizer.step()
  (optimizer.py): unscale, check inf/nan (skip the step if found), clip, update with the
  scheduler's lr and weight decay.
"""
import logging
import math
import os
import signal
import sys
import time
import traceback

import numpy as np
import yaml
import mindspore as ms
from mindspore import Tensor

import context_parallel
import data
import distributed
import moe
import optimizer as opt
import parallel
import pipeline
from formats import checkpoint, hf_gpt2
from gpt import (Compiled, DropoutRNG, hidden_dtype, init_weights, is_embedding_copy, layer_spec,
                 num_floating_point_operations)
from settings.cli import (CONFIG_FLAG, HelpRequested, load_config, parse_command, raw_config,
                          training_help)
from settings.config import (PER_SPLIT_PATHS, SHIPPED_CORPUS, ConfigError, main_grad_dtype,
                             moe_layer_pattern, padded_vocab_size, parse_blend, recompute_counts,
                             samples_per_split, to_dict)
from tokenizer import build_tokenizer
from tools import flight_recorder, memory, sample
from tools.metrics import Metrics
from tools.profiler import StepProfiler

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


_MINDSPORE_READY = []


def setup_mindspore(cfg=None):
    """PyNative on the configured device, CPU threads, seed. The device and threads are set once
    per process (MindSpore refuses to set threads twice) and before the first op: launch_blocking
    has no effect once ops have run."""
    training_cfg = cfg.training_config if cfg is not None else None
    if training_cfg is not None:
        ms.set_seed(training_cfg.seed)
    if _MINDSPORE_READY:
        return
    _MINDSPORE_READY.append(True)
    device = training_cfg.device_target if training_cfg is not None else "CPU"
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        ms.set_device(device)
    except RuntimeError:                             # already set (once communication is up)
        if ms.get_context("device_target") != device:
            raise
    if device == "CPU":
        local = os.environ.get("MS_LOCAL_WORKER_NUM", os.environ.get("LOCAL_WORKER_NUM", "1"))
        local = int(local or 1)                      # the workers sharing this machine's cores
        threads = ((training_cfg is not None and training_cfg.threads_num)
                   or max(1, (os.cpu_count() or 1) // local))
        ms.device_context.cpu.op_tuning.threads_num(threads)
        # PyNative normally queues ops to dispatch threads; on a few shared CPU cores those threads
        # contend with the kernels. Launching each op in the caller's thread measured 5.8x faster
        # op by op, 1.5x compiled, 9x with TP2 on 2 workers (tiny model, 2 cores;
        # docs/performance.md).
        ms.runtime.launch_blocking()


def device_available(target):
    """mindspore.hal.is_available(target), its library loader's messages for a missing backend
    ("Load dynamic library ... failed") kept off the console: the answer is the news."""
    if target == "CPU":
        return True
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        return ms.hal.is_available(target)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def check_inputs(cfg):
    """What the run needs, checked before any work: its device, kernels for its precision, its
    files."""
    dataset_cfg, model_cfg = cfg.dataset_config, cfg.model_config
    target = cfg.training_config.device_target
    if not device_available(target):
        # probed: this CPU wheel answers False for Ascend and GPU (libmindspore_ascend.so absent)
        raise ConfigError(f"training_config.device_target={target} (context.device_target): this "
                          f"MindSpore has no {target} backend on this machine; set "
                          "training_config.device_target=CPU")
    if cfg.training_config.device_target == "CPU" and model_cfg.compute_dtype == "bfloat16":
        # probed on MindSpore 2.10: "Select CPU operator ... fail" (docs/half-precision.md)
        raise ConfigError("model_config.compute_dtype=bfloat16 (--bf16): MindSpore 2.10 has no "
                          "bfloat16 CPU kernel for MatMul, Softmax, Tanh or Sqrt; train with "
                          "--fp16 on the CPU, or set training_config.device_target to GPU or "
                          "Ascend")
    if dataset_cfg.tokenizer_type == "GPT2BPETokenizer":
        for key in ("vocab_file", "merge_file"):
            if not os.path.isfile(getattr(dataset_cfg, key)):
                wanted = "vocab.json" if key == "vocab_file" else "merges.txt"
                raise ConfigError(f"dataset_config.{key}={getattr(dataset_cfg, key)} not found: "
                                  f"give the GPT-2 {wanted} (--{key.replace('_', '-')})")
    if not dataset_cfg.mock_data:
        for key in ("data_path", *PER_SPLIT_PATHS):
            if getattr(dataset_cfg, key) is not None:
                setattr(dataset_cfg, key, resolve_corpora(getattr(dataset_cfg, key), key))
    training_cfg = cfg.training_config
    load = training_cfg.load_checkpoint
    if load and not checkpoint.holds_checkpoint(load):
        print(f"warning: no checkpoint in --load {load}: training starts from "
              "scratch", file=sys.stderr)
        training_cfg.load_checkpoint = ""            # Megatron: a new folder means a new run
    if training_cfg.load_checkpoint:
        checkpoint.check_fits(cfg, training_cfg.load_checkpoint)
    checkpoint.check_save_folder(training_cfg.output_dir, training_cfg.load_checkpoint,
                                 training_cfg.finetune, training_cfg.ckpt_step)


def resolve_corpora(words, key):
    """A blend's words (config.parse_blend) with each folder (MindSpore Transformers'
    dataset_dir) replaced by the corpora in it, and each corpus's .bin/.idx checked; the
    shipped corpus is tokenized on first use."""
    prefixes, weights = parse_blend(words, "dataset_config." + key)
    shipped = SHIPPED_CORPUS[1] + "_text_document"
    if shipped in prefixes and parallel.launched_world_size() == 1:
        data.ensure_preprocessed(SHIPPED_CORPUS[0], SHIPPED_CORPUS[1], "GPT2BPETokenizer",
                                 "data/gpt2-vocab.json", "data/gpt2-merges.txt", workers=2)
    resolved = []
    for k, prefix in enumerate(prefixes):
        found = data.data_prefixes(prefix)
        if weights is not None and len(found) > 1:
            raise ConfigError(f"dataset_config.{key}: the folder {prefix} holds {len(found)} "
                              "corpora but has one weight: give each corpus its own weight")
        for corpus in found:
            for ext in (".bin", ".idx"):
                if not os.path.isfile(corpus + ext):
                    raise ConfigError(f"dataset_config.{key}={corpus}: {corpus}{ext} not found; "
                                      "run `bash run.sh preprocess ...` (or `bash run.sh` for "
                                      "the shipped corpus) or use --mock-data")
        resolved += ([words[2 * k]] if weights is not None else []) + found
    return resolved[0] if len(resolved) == 1 else resolved


def build_data(cfg, tokenizer):
    dataset_cfg, training_cfg = cfg.dataset_config, cfg.training_config
    seq_length, num_samples = cfg.model_config.seq_length, samples_per_split(cfg)
    if dataset_cfg.mock_data:
        vocab = dataset_cfg.vocab_size or tokenizer.vocab_size
        return tuple(data.MockGPTDataset(n, seq_length, vocab, training_cfg.seed + i) if n else None
                     for i, n in enumerate(num_samples))
    blend, per_split = data.data_blends(dataset_cfg)
    first = (blend or per_split[0])[0][0]
    cache = dataset_cfg.data_cache_path or os.path.join(os.path.dirname(first) or ".", "cache")
    return data.build_gpt_datasets(blend, dataset_cfg.split, seq_length, training_cfg.seed,
                                   num_samples, tokenizer.eod, cache_dir=cache,
                                   per_split=per_split,
                                   reset_position_ids=dataset_cfg.reset_position_ids,
                                   reset_attention_mask=dataset_cfg.reset_attention_mask,
                                   eod_mask_loss=dataset_cfg.eod_mask_loss,
                                   shuffle=dataset_cfg.shuffle)


def build_model(cfg, tokenizer, state):
    model_cfg, dataset_cfg = cfg.model_config, cfg.dataset_config
    vocab = tokenizer.vocab_size
    if dataset_cfg.mock_data and dataset_cfg.vocab_size:
        vocab = dataset_cfg.vocab_size
    model_cfg.padded_vocab_size = padded_vocab_size(model_cfg, vocab)
    rng = DropoutRNG(cfg.training_config.seed, state.tp_rank)
    parallel_cfg = cfg.parallel_config
    chunks = pipeline.build_chunks(model_cfg, state.pp, state.pp_rank,
                                   parallel_cfg.virtual_pipeline_model_parallel_size,
                                   parallel_cfg.num_layer_list, rng,
                                   recompute_counts(parallel_cfg, model_cfg)[state.pp_rank])
    for chunk in chunks:
        init_weights(chunk, cfg.training_config.seed)
    return chunks, rng


def build_scaler(cfg):
    """Megatron's grad scaler: a static --loss-scale if given, else dynamic when computing in
    float16 (its range needs it), else none (a constant 1.0; bfloat16 has float32's range)."""
    training_cfg = cfg.training_config
    if training_cfg.loss_scale is not None:
        return opt.ConstantGradScaler(training_cfg.loss_scale)
    if cfg.model_config.compute_dtype == "float16":
        return opt.DynamicGradScaler(training_cfg.loss_scale_value, training_cfg.min_loss_scale,
                                     growth_interval=training_cfg.loss_scale_window,
                                     hysteresis=training_cfg.hysteresis)
    return opt.ConstantGradScaler(1.0)


def counted_in_norm(chunks, state):
    """Per parameter of `chunks`, whether its gradient counts in the norm on this rank: one
    replicated over TP (norms, row biases, position embeddings) on TP rank 0 (Megatron's
    param_is_not_tensor_parallel_duplicate), and the word embedding on the first stage, not its
    copy on the last (gpt.is_embedding_copy)."""
    return [(hasattr(param, "partition_dim") or state.tp_rank == 0)
            and not is_embedding_copy(chunk, param)
            for chunk in chunks for _, param in chunk.parameters_and_names()]


def build_data_parallel(cfg, model, state=None):
    """Megatron's DistributedDataParallel (distributed.py) for a model or a list of model chunks:
    the dense parameters' gradients in a buffer reduced over the DP x CP group, the experts'
    (moe.is_expert) in one over the expert-data-parallel group; both divided by the DP size
    (averaged over DP, summed over CP: gpt.GPTModel); reduce-scattered for the distributed
    optimizer (use_distributed_optimizer with several DP x CP ranks), else all-reduced."""
    state = state or parallel.get_state()
    named = [item for chunk in _chunks(model) for item in chunk.parameters_and_names()]
    expert = [i for i, (name, _) in enumerate(named) if moe.is_expert(name)]
    dense = [i for i in range(len(named)) if i not in set(expert)]
    bucket_size, scale = cfg.training_config.bucket_size, 1.0 / state.dp
    dp_cp = state.dp * state.cp
    groups = [(dense, dict(group=state.dp_cp_group, group_size=dp_cp, rank=state.dp_cp_rank)),
              (expert, dict(group=state.edp_group, group_size=dp_cp // state.ep,
                            rank=state.edp_rank))]
    groups = [(positions, group) for positions, group in groups if positions]
    buffers = [distributed.GradBuffer([named[i][1] for i in positions], bucket_size=bucket_size,
                                      gradient_scaling_factor=scale, **group)
               for positions, group in groups]
    reduce_scatter = cfg.training_config.use_distributed_optimizer and dp_cp > 1
    return distributed.DistributedDataParallel(buffers, [positions for positions, _ in groups],
                                               reduce_scatter)


def _chunks(model):
    return model if isinstance(model, list) else [model]


def build_optimizer(cfg, model, ddp, state=None):
    """(optimizer, scheduler) for a model or a list of model chunks and its
    DistributedDataParallel `ddp`: Megatron's mixed-precision optimizer around AdamW/Adam/SGD
    (optimizer.MixedPrecisionOptimizer), or, where ddp reduce-scatters, the
    DistributedOptimizer over each buffer's shards; one per buffer of ddp (the dense parameters,
    the experts'), chained (optimizer.ChainedOptimizer) when there are two."""
    optimizer_cfg, training_cfg = cfg.optimizer_config, cfg.training_config
    state = state or parallel.get_state()
    chunks = _chunks(model)
    named = [item for chunk in chunks for item in chunk.parameters_and_names()]
    counted = counted_in_norm(chunks, state)
    scaler = build_scaler(cfg)
    # ddp's buffers: the dense parameters', then the experts' if any. The norm over TP x PP; the
    # experts' also over EP (Megatron's expert_tensor_model_pipeline group)
    norm_groups = [[state.mp_group], [state.mp_group, state.ep_group if state.ep > 1 else None]]
    optimizers = [_build_one_optimizer(cfg, [named[i] for i in positions], scaler,
                                       [counted[i] for i in positions], norm,
                                       buffer if ddp.reduce_scatter else None)
                  for positions, buffer, norm in zip(ddp.positions, ddp.buffers, norm_groups)]
    optim = (optimizers[0] if len(optimizers) == 1
             else opt.ChainedOptimizer(optimizers, ddp.positions))
    schedule = optimizer_cfg.learning_rate_scheduler_kwargs
    scheduler = opt.OptimizerParamScheduler(
        max_lr=optimizer_cfg.learning_rate, min_lr=schedule.min_lr,
        lr_warmup_steps=schedule.lr_warmup_iters, lr_decay_steps=schedule.lr_decay_iters,
        lr_decay_style=schedule.lr_decay_style, start_wd=optimizer_cfg.start_weight_decay,
        end_wd=optimizer_cfg.end_weight_decay, wd_incr_steps=training_cfg.training_iters,
        wd_incr_style=optimizer_cfg.weight_decay_incr_style)
    return optim, scheduler


def _build_one_optimizer(cfg, named, scaler, counted, norm_groups, sharded_buffer):
    """The optimizer of parameters `named` ([(name, param)]), its gradient norm reduced over
    `norm_groups`; with `sharded_buffer` (their distributed.GradBuffer) the
    DistributedOptimizer over its shards."""
    optimizer_cfg, training_cfg = cfg.optimizer_config, cfg.training_config
    wd_mults = [0.0 if opt.no_weight_decay(n, param.shape) else 1.0 for n, param in named]

    def make(params, mults):
        return opt.build_optimizer(optimizer_cfg.optimizer_type, params,
                                   betas=tuple(optimizer_cfg.betas), eps=optimizer_cfg.eps,
                                   momentum=optimizer_cfg.momentum, wd_mults=mults)
    clip = training_cfg.grad_clip_kwargs
    common = dict(scaler=scaler, clip_type=clip.grad_clip_type, clip_value=clip.clip_value,
                  norm_groups=norm_groups, counted=counted,
                  cast=layer_spec(cfg.model_config).cast)
    params = [param for _, param in named]
    if sharded_buffer is not None:
        return opt.DistributedOptimizer(make, params, wd_mults, **common, buffer=sharded_buffer)
    return opt.MixedPrecisionOptimizer(make, params, wd_mults, **common)


# ----------------------------------------------------------------------------- one step
def to_tensors(batch, state=None):
    """A numpy micro-batch -> model inputs (tokens, position_ids, attention_mask, labels,
    loss_mask), with context parallelism this cp rank's share of the sequence."""
    if state is not None:
        batch = context_parallel.get_batch_on_this_cp_rank(batch, state)
    mask = batch.get("attention_mask")
    return (Tensor(batch["tokens"]), Tensor(batch["position_ids"]),
            None if mask is None else Tensor(mask), Tensor(batch["labels"]),
            Tensor(batch["loss_mask"]))


class Trainer:
    """Forward/backward over micro-batches, then the optimizer step (Megatron train_step).
    `model` is a GPTModel or, with pipeline parallelism, this rank's list of model chunks;
    `ddp` comes from build_data_parallel, `optimizer` and `scheduler` from build_optimizer."""

    def __init__(self, cfg, model, ddp, optimizer, scheduler, state=None):
        self.cfg, self.ddp, self.optimizer, self.scheduler = cfg, ddp, optimizer, scheduler
        self.scaler = optimizer.scaler
        self.chunks = model if isinstance(model, list) else [model]
        self.state = state or parallel.get_state()
        self.params = [param for chunk in self.chunks for param in chunk.get_parameters()]
        self.distributed = ddp.reduce_scatter            # the distributed optimizer's shards
        self.dp_cp_size = self.state.dp * self.state.cp
        model_cfg = cfg.model_config
        self.grad_dtype = parallel.DTYPES[main_grad_dtype(cfg)]   # micro-batches' gradients' sum
        self.cast = layer_spec(model_cfg).cast              # the gradients' cast to grad_dtype
        # ms.jit cannot compile host RNG calls (dropout masks come from numpy streams).
        dropout = model_cfg.hidden_dropout_rate or model_cfg.attention_dropout_rate
        self.compiled = cfg.training_config.use_jit and not dropout
        self.pipeline = None
        if self.state.pp > 1:
            hop = pipeline.hop_shape(model_cfg, cfg.dataset_config.batch_size, self.state.cp,
                                     self.state.tp, self.state.sequence_parallel)
            self.pipeline = pipeline.PipelineRunner(self.chunks, self.state, hop,
                                                    hidden_dtype(model_cfg), self.grad_dtype,
                                                    self.compiled,
                                                    cfg.parallel_config.pipeline_schedule,
                                                    self.cast)
        self.trace = None                 # a list: the next step records its passes' times
        self.forward = Compiled(self.chunks[0]) if self.compiled else self.chunks[0]
        self.loss_weight = 1.0
        self.num_moe_layers = sum(moe_layer_pattern(model_cfg))
        self.moe_losses = {}              # the last step's aux and z losses (moe.report_metrics)
        self.seconds = dict.fromkeys(TIMERS, 0.0)       # time per phase since the last log line
        self.grad_fn = ms.value_and_grad(self._weighted_loss, None, self.params)

    def set_train(self, mode):
        for chunk in self.chunks:
            chunk.set_train(mode)

    def _weighted_loss(self, *inputs):
        return self.forward(*inputs) * self.loss_weight

    def forward_backward(self, micro_batches):
        """(loss of each micro-batch, gradients of sum(loss) * scale / m summed over them in
        grad_dtype); with pipeline parallelism through the schedule, the losses only on the last
        stage."""
        num_microbatches = len(micro_batches)
        self.loss_weight = self.scaler.scale / num_microbatches
        if self.num_moe_layers:
            # the aux and z losses' gradients get the main loss' weight (Megatron's
            # schedules.py:366 multiplies by cp too: its CP gradients are averaged, ours summed)
            moe.MoEAuxLossAutoScaler.set_loss_scale(self.loss_weight)
        if self.pipeline is not None:
            return self.pipeline.run([to_tensors(b, self.state) for b in micro_batches],
                                     self.loss_weight, trace=self.trace)
        losses, acc = [], None
        for batch in micro_batches:
            loss, grads = self.grad_fn(*to_tensors(batch, self.state))
            losses.append(float(loss.asnumpy()) / self.loss_weight)
            grads = [self.cast(g, self.grad_dtype) for g in grads]
            acc = grads if acc is None else [a + g for a, g in zip(acc, grads)]
        return losses, acc

    def train_step(self, micro_batches):
        """Megatron's train_step: forward and backward over the micro-batches, the gradients'
        reductions (distributed.finalize_model_grads), then optimizer.step(), called once (prepare
        the grads: unscale, inf/nan check, and on overflow nothing more; clip; update), then the
        scheduler's step if it updated. Returns (mean loss over the micro-batches,
        updated, gradient norm, lr used)."""
        parallel.ledger.reset()
        self.set_train(True)
        clock = time.perf_counter()
        losses, grads = self.forward_backward(micro_batches)
        if self.num_moe_layers:         # Megatron's track_moe_metrics, every step on every rank
            state = self.state
            self.moe_losses = moe.report_metrics(self.chunks, 1 / len(micro_batches),
                                                 self.num_moe_layers, state.pp_group,
                                                 state.tp_cp_group, state.dp_group)
        clock = self._lap("forward-backward", clock)
        grads = distributed.finalize_model_grads(grads, self.params, self.state, self.ddp)
        clock = self._lap("grads-reduce", clock)
        lr = self.scheduler.get_lr()
        updated, grad_norm, _ = self.optimizer.step(grads, lr, self.scheduler.get_wd())
        if updated:                                  # Megatron: a skipped step does not count
            self.scheduler.step(1)
        self._lap("optimizer", clock)
        loss = sum(losses) / len(micro_batches) if losses else 0.0   # none before the last stage
        return self.dp_mean(loss), updated, grad_norm, lr

    def _lap(self, name, since):
        now = time.perf_counter()
        self.seconds[name] += now - since
        return now

    def timers_line(self, steps):
        """Milliseconds per step in each phase since the last call (Megatron's timers); with
        pipeline parallelism forward-backward splits into this rank's passes and its exchanges
        (the wait for the neighbour, so the bubble, included)."""
        ms_per_step = {k: v * 1000 / steps for k, v in self.seconds.items()}
        parts = [f"forward-backward {ms_per_step['forward-backward']:.1f}"]
        if self.pipeline is not None:
            runner = self.pipeline.seconds
            parts[0] += (f" (passes {runner['compute'] * 1000 / steps:.1f}, exchanges and waiting "
                         f"{runner['exchange'] * 1000 / steps:.1f})")
        parts += [f"{k} {ms_per_step[k]:.1f}" for k in TIMERS[1:]]
        self.reset_timers()
        return "timers (ms per step): " + ", ".join(parts)

    def reset_timers(self):
        self.seconds = dict.fromkeys(TIMERS, 0.0)
        if self.pipeline is not None:
            self.pipeline.reset_timers()

    def dp_mean(self, value):
        """A per-rank number averaged over the data-parallel ranks (for the log)."""
        if self.dp_cp_size == 1:
            return value
        total = parallel.collectives(self.state.dp_cp_group).all_reduce(
            Tensor([value], ms.float32))
        return float(total.asnumpy()[0]) / self.dp_cp_size


def data_loader(cfg, dataset, state, consumed):
    """This DP rank's micro-batches of `dataset` from sample `consumed`, as --dataloader-type
    says (Megatron's build_pretraining_data_loader)."""
    args = dataset, cfg.dataset_config.batch_size, state.dp_rank, state.dp, consumed
    if cfg.dataset_config.dataloader_type == "cyclic":
        return data.RandomMicroBatchIterator(*args, cfg.dataset_config.data_sharding)
    return data.MicroBatchIterator(*args)


def evaluate(trainer, dataset, consumed, iters, cfg):
    """Mean loss of the trainer's forward (the model, maybe compiled) over `iters` global batches
    of `dataset` starting at sample `consumed`, this DP rank's part, averaged over DP."""
    state, runner = trainer.state, trainer.pipeline
    trainer.set_train(False)
    num_microbatches = cfg.dataset_config.micro_batch_num
    it = data_loader(cfg, dataset, state, consumed)
    losses = []
    for _ in range(iters):
        batches = [to_tensors(b, state) for _, b in zip(range(num_microbatches), it)]
        if runner is None:
            losses += [float(trainer.forward(*batch).asnumpy()) for batch in batches]
        elif len(batches) == num_microbatches:        # a pipeline runs whole global batches
            losses += runner.run(batches, forward_only=True)[0]
    trainer.set_train(True)
    if state.pp > 1 and not state.is_last_stage:       # only the last stage has losses
        trainer.dp_mean(0.0)
        return float("nan")
    return trainer.dp_mean(sum(losses) / len(losses)) if losses else float("nan")


# ----------------------------------------------------------------------------- the loop
def pretrain(cfg, notes=()):
    """Train as cfg says (Megatron's pretrain and its train loop); `notes` (the guides' spellings
    translated, inert keys) are logged first. Returns this rank's model chunks."""
    started = time.time()
    training_cfg, dataset_cfg = cfg.training_config, cfg.dataset_config
    tokenizer = build_tokenizer(dataset_cfg.tokenizer_type, dataset_cfg.vocab_file,
                                dataset_cfg.merge_file, dataset_cfg.vocab_size)
    train_ds, valid_ds, test_ds = build_data(cfg, tokenizer)
    trainer, rng = set_up(cfg, tokenizer, notes)
    iteration, consumed = 0, 0
    if training_cfg.load_checkpoint:
        iteration, consumed = checkpoint.load_training_state(cfg, trainer, rng)
    if training_cfg.exit_signal_handler:              # noted here, acted on between steps
        _SIGTERM.clear()
        signal.signal(signal.SIGTERM, lambda signum, frame: _SIGTERM.append(signum))
    estimate = log_start(cfg, trainer, train_ds, valid_ds, test_ds)
    state = trainer.state
    it = data_loader(cfg, train_ds, state, consumed)
    profiler = StepProfiler(cfg, state.rank)
    metrics = open_metrics(cfg, state, iteration)
    window = LogWindow(cfg, trainer, iteration + 1, metrics)
    last_saved = iteration
    estimate.begin()                                  # the measured peak counts from here
    while iteration < training_cfg.training_iters:
        epoch = it.epoch
        scale = trainer.scaler.scale                  # the step may change it
        iteration += 1
        window.log(iteration, epoch, scale, *profiled_step(cfg, trainer, it, profiler, iteration))
        if maybe_evaluate(cfg, trainer, valid_ds, iteration, metrics):
            window.restart_clock()
        if maybe_save(cfg, iteration, it.consumed_samples, trainer, rng):
            last_saved = iteration
            window.restart_clock()
        reason = exit_reason(training_cfg, iteration, started)
        if reason:
            if last_saved != iteration:
                checkpoint.save_training_state(cfg, iteration, it.consumed_samples, trainer, rng)
            log.info(f"exiting at iteration {iteration}: {reason}; "
                     f"continue with --load {training_cfg.output_dir}")
            return trainer.chunks
    log.info(estimate.measured())
    if iteration > last_saved:                        # at the end, unless nothing was trained
        checkpoint.save_training_state(cfg, iteration, it.consumed_samples, trainer, rng)
    if test_ds is not None and training_cfg.eval_iters:
        loss = evaluate(trainer, test_ds, 0, training_cfg.eval_iters, cfg)
        log_eval_loss("test", iteration, loss, metrics)
    return trainer.chunks


def profiled_step(cfg, trainer, it, profiler, iteration):
    """Trainer.train_step on the next global batch of `it`, step `iteration` to the profiler;
    with --pipeline-trace the last step's passes are timed and reported."""
    training_cfg = cfg.training_config
    last_step = iteration == training_cfg.training_iters
    if training_cfg.pipeline_trace and trainer.pipeline is not None and last_step:
        trainer.trace = []                        # time the passes of the last step
    profiler.before(iteration)
    step = trainer.train_step([next(it) for _ in range(cfg.dataset_config.micro_batch_num)])
    profiler.after(iteration)
    if trainer.trace is not None:
        report_pipeline_trace(cfg, trainer)
        trainer.trace = None
    return step


def set_up(cfg, tokenizer, notes):
    """MindSpore, the process groups, this rank's log (`notes` first), then the model, its
    optimizer and the Trainer: (trainer, the dropout RNG)."""
    setup_mindspore(cfg)
    parallel_cfg = cfg.parallel_config
    state = parallel.initialize_model_parallel(
        parallel_cfg.tensor_model_parallel_size, parallel_cfg.pipeline_model_parallel_size,
        parallel_cfg.context_parallel_size, parallel_cfg.sequence_parallel,
        parallel_cfg.ulysses_degree_in_cp, parallel_cfg.expert_model_parallel_size)
    setup_logging(cfg.training_config.output_dir, state.rank,
                  to_console=state.rank == loss_rank(state))
    for note in notes:
        (log.warning if note.startswith("warning: ") else log.info)(note)
    if state.world_size > 1:
        log.info(parallel.grid_table(state.world_size, state.tp, state.cp, state.pp, state.ep))
    model, rng = build_model(cfg, tokenizer, state)
    ddp = build_data_parallel(cfg, model, state)
    return Trainer(cfg, model, ddp, *build_optimizer(cfg, model, ddp, state), state), rng


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
    estimate = memory.RankReport(cfg, state, n_params, trainer.optimizer.state_bytes())
    log.info(estimate.startup(trainer.compiled))
    log.info("model compiled with ms.jit" if trainer.compiled else "model runs op by op (PyNative)"
             + (": dropout inside" if training_cfg.use_jit else ""))
    if trainer.pipeline is not None:
        log.info(f"pipeline stage {state.pp_rank}: " + ", ".join(
            f"chunk {chunk_id} = layers {ch.layer_offset}..{ch.layer_offset + len(ch.layers) - 1}"
            for chunk_id, ch in enumerate(trainer.chunks)))
    return estimate


def maybe_evaluate(cfg, trainer, dataset, iteration, metrics):
    """Every eval_interval steps, the validation loss over the next eval_iters global batches
    of `dataset` (each evaluation its own batches), logged and recorded in `metrics`. True if
    it ran."""
    training_cfg, dataset_cfg = cfg.training_config, cfg.dataset_config
    interval, iters = training_cfg.eval_interval, training_cfg.eval_iters
    if dataset is None or not iters or iteration % interval:
        return False
    start = (iteration // interval - 1) * iters * dataset_cfg.global_batch_size
    log_eval_loss("validation", iteration, evaluate(trainer, dataset, start, iters, cfg), metrics)
    return True


def maybe_save(cfg, iteration, consumed, trainer, rng):
    """Every save_interval steps before the last (which pretrain saves), a checkpoint. True if
    it saved."""
    training_cfg = cfg.training_config
    interval = training_cfg.save_interval
    if not interval or iteration % interval or iteration >= training_cfg.training_iters:
        return False
    checkpoint.save_training_state(cfg, iteration, consumed, trainer, rng)
    return True


class LogWindow:
    """Megatron's training_log over the steps since the last train line: their summed loss, how
    many were skipped on inf/nan (Megatron's "number of skipped iterations"), and the time per
    step since `start` over the `timed` steps; restart_clock leaves out time spent outside steps
    (compilation, evaluation, saves). Each train line's numbers also go to `metrics` (a
    metrics.Metrics on the rank that logs the loss, else None)."""

    def __init__(self, cfg, trainer, first_iteration, metrics):
        self.cfg, self.trainer, self.first_iteration = cfg, trainer, first_iteration
        self.metrics = metrics
        dataset_cfg, model_cfg = cfg.dataset_config, cfg.model_config
        self.batch_size = dataset_cfg.global_batch_size
        self.tokens_per_step = self.batch_size * model_cfg.seq_length
        self.flops_per_step = num_floating_point_operations(model_cfg, self.batch_size)
        self.reset()

    def reset(self):
        self.loss, self.steps, self.skipped = 0.0, 0, 0
        self.moe_losses = {}                           # name -> sum over the window's steps
        self.restart_clock()

    def restart_clock(self):
        self.timed, self.start = 0, time.perf_counter()

    def add(self, loss, updated):
        self.loss, self.steps, self.timed = self.loss + loss, self.steps + 1, self.timed + 1
        self.skipped += not updated
        for name, value in self.trainer.moe_losses.items():
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
            trainer.reset_timers()
            self.restart_clock()
        if not updated:
            log.warning(f"skipped iteration {iteration}: inf/nan in the gradients; "
                        + scale_change(scale, trainer.scaler))
        if training_cfg.log_comm_ledger:
            log.info(f"comm: Step:{iteration}, " + parallel.ledger.line())
        if log_now:
            if trainer.state.is_last_stage:           # the loss exists on the last stage only
                scalars = self.scalars(grad_norm, lr)
                moe_losses = {k: v / self.steps for k, v in self.moe_losses.items()}
                log.info(train_line(iteration, epoch, updated, scalars, moe_losses))
                if self.metrics is not None:
                    self.metrics.train(iteration, **scalars, **moe_losses)
            log.info(trainer.timers_line(self.timed))
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


_SIGTERM = []


def exit_reason(training_cfg, iteration, started):
    """Megatron's ways to end a job early (the caller saves first): --exit-interval, SIGTERM on any
    rank with --exit-signal-handler, --exit-duration-in-mins of wall time on any rank. The ranks
    agree through one all-reduce, so they all stop after the same step. None: go on."""
    if training_cfg.exit_interval and iteration % training_cfg.exit_interval == 0:
        return f"--exit-interval {training_cfg.exit_interval}"
    if training_cfg.exit_signal_handler and parallel.any_rank(bool(_SIGTERM)):
        return "SIGTERM received (--exit-signal-handler)"
    minutes = training_cfg.exit_duration_in_mins
    if minutes and parallel.any_rank(time.time() - started > 60 * minutes):
        return f"--exit-duration-in-mins {training_cfg.exit_duration_in_mins} reached"
    return None


def report_pipeline_trace(cfg, trainer):
    """Gather the step's pass times over the pipeline; the loss rank writes the timeline (text
    and SVG under output_dir) and logs the bubble: measured, in the unit-time schedule, in
    theory."""
    state = trainer.state
    traces = pipeline.gather_trace(trainer.trace, state)
    if state.rank != loss_rank(state):
        return
    path = os.path.join(cfg.training_config.output_dir, "pipeline_timeline")
    log.info(pipeline.write_timeline(traces, cfg.dataset_config.micro_batch_num,
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


# ----------------------------------------------------------------------------- commands
def main(argv):
    """Run one command (COMMANDS; `train` when the first argument is a flag or key=value) and
    return its exit code: the command's (None: 0), 2 with one `error: ` line for a wrong command
    line, config or checkpoint, 130 for Ctrl-C in preprocess."""
    argv = list(argv)
    command = argv[0] if argv and not argv[0].startswith("-") and "=" not in argv[0] else "train"
    if command != "train":
        argv = argv[1:]
    try:
        if command not in COMMANDS:
            raise ConfigError(f"unknown command {command!r}: use train (default), "
                              f"{', '.join(list(COMMANDS)[1:])}")
        return COMMANDS[command](argv) or 0
    except HelpRequested as e:
        print(e)
        return 0
    except data.Interrupted as e:                 # Ctrl-C in preprocess (or the shipped corpus's)
        print(e, file=sys.stderr)
        return 130                                # a shell's code for SIGINT: 128 + 2
    except (ConfigError, checkpoint.CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def train_main(argv):
    """The training command: its config checked (errors are main's), then pretrain, whose
    errors every worker reports itself (fail): 2 for an expected one, 1 for a bug."""
    cfg, notes = configure("train", argv)
    record_worker_pid()
    flight_recorder.start(os.environ.get("FLIGHT_RECORDER_DIR")          # run.sh: msrun's log
                          or os.path.join(cfg.training_config.output_dir, "log"),
                          int(os.environ.get("RANK_ID", "0")), parallel.launched_world_size())
    try:
        pretrain(cfg, notes)
    except (ConfigError, checkpoint.CheckpointError, OSError) as e:    # one line, the fix in it
        fail(expected_message(e))
        return 2
    except Exception:                                                  # a bug: its traceback, once
        fail(f"training failed: {traceback.format_exc()}")
        return 1
    return 0


def check_main(argv):
    """What run.sh runs before msrun: the training command for --nproc workers, checked in one
    process (config, layout, input files)."""
    configure("check", argv)


def configure(command, argv):
    """(config, notes) of a `train` or `check` command line: the flags, the --config files and
    key=value overrides layered over config.yaml (under the --load checkpoint's model with
    --use-checkpoint-args), then check_inputs."""
    if command == "train" and ("--help" in argv or "-h" in argv):
        raise HelpRequested(training_help())
    flags = {"--config": CONFIG_FLAG,
             "--use-checkpoint-args": (None, bool, "the model and tokenizer of the --load "
                                                   "checkpoint, unless given")}
    about = ""
    if command == "check":
        flags["--nproc"] = (1, int, "the number of workers msrun will start")
        about = ("Check a training command for --nproc workers in one process, as run.sh "
                 "does before msrun starts them.")
    options, argv = parse_command(command, argv, flags, passthrough="training flags", about=about)
    world = options.get("nproc", parallel.launched_world_size())
    if world < 1:
        raise ConfigError(f"--nproc {world}: give the number of workers, 1 or more")
    notes, under = [], None
    if options["use_checkpoint_args"]:        # Megatron: the checkpoint's model, unless given
        training = raw_config(options["config"], argv, []).get("training_config", {})
        load = training.get("load_checkpoint")
        if load and checkpoint.holds_checkpoint(load):
            under = checkpoint.checkpoint_args(
                checkpoint.saved_config(load, training.get("ckpt_step")))
    cfg = load_config(options["config"], argv, world, notes, under)
    check_inputs(cfg)
    return cfg, notes


def preprocess_main(argv):
    data.preprocess_main(argv)                    # its prefixes are no exit code


def generate_main(argv):
    setup_mindspore()                             # the device and threads the model runs on
    sample.generate_main(argv)


def record_worker_pid():
    """Under run.sh, a worker's pid in RUN_SH_PID_DIR/rank_N.pid: run.sh names a worker killed
    from outside by its rank."""
    pid_dir = os.environ.get("RUN_SH_PID_DIR")
    if pid_dir and os.environ.get("MS_ROLE") == "MS_WORKER":
        path = os.path.join(pid_dir, f"rank_{os.environ['RANK_ID']}.pid")
        data.write_atomic(path, str(os.getpid()))


# Every command by name, the training first; the checkpoint commands and plan take their own
# flags and need no MindSpore set-up.
COMMANDS = {"train": train_main, "check": check_main, "preprocess": preprocess_main,
            "generate": generate_main, "convert": checkpoint.convert_main,
            "import-hf": hf_gpt2.import_main, "export-hf": hf_gpt2.export_main,
            "import-megatron": checkpoint.import_megatron_main, "plan": memory.plan_main}


def expected_message(e):
    if isinstance(e, OSError):                      # an unwritable or full --save, a vanished file
        return (f"{e.filename or 'a file'}: {e.strerror or e}; free space, fix the permissions "
                "or choose another --save")
    return str(e)


def fail(message):
    """An error on any worker: the rank's error.log and one line on the console (msrun shows every
    worker's console), prefixed by the rank when there are several, so the cause is where the
    user looks."""
    if os.environ.get("MS_ROLE") == "MS_SCHED":    # msrun's scheduler: it only relays a failure
        return
    if log.handlers:
        log.error(f"error: {message}")
    flight_recorder.dump(f"error: {message}")
    world = parallel.launched_world_size()
    prefix = f"[rank {int(os.environ.get('RANK_ID', 0))}] " if world > 1 else ""
    print(f"{prefix}error: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
