"""Pretrain a GPT from one YAML:
`python train.py [--config config.yaml] [Megatron flags] [section.key=value]`.

Also `python train.py preprocess <Megatron preprocess_data.py flags>`, `check --nproc N [flags]`
(what run.sh runs before msrun: the config, the layout for N workers and the input files, checked
in one process), `generate --load DIR --prompt TEXT` (instruments/sample.py), and the checkpoint
commands `convert`, `import-hf`, `export-hf`, `import-megatron` (formats/), and `plan --world-size
N` (instruments/memory.py): the table COMMANDS.

One training step (Megatron's train_step, one process):
  for each of micro_batch_num micro-batches: loss_i * loss_scale / micro_batch_num, backward,
  gradients summed; then their data-parallel reduction (distributed.py) and optimizer.step()
  (optimizer.py): unscale, check inf/nan (skip the step if found), clip, update with the
  scheduler's lr and weight decay. What a run prints and records watches the steps from outside
  (instruments/logs.py).
"""
import contextlib
import os
import signal
import sys
import time
import traceback

import mindspore as ms
from mindspore import Tensor

import context_parallel
import data
import distributed
import moe
import optimizer as opt
import parallel
import pipeline
from backends import shared_memory
from formats import checkpoint, hf_gpt2
from gpt import (DropoutRNG, hidden_dtype, init_weights, layer_spec, model_pieces,
                 model_provider)
from instruments import flight_recorder, memory, sample
from instruments.ledger import LEDGER
from instruments.logs import (LogWindow, Timers, log, log_eval_loss, log_start, loss_rank,
                              open_metrics, setup_logging)
from settings.cli import (CONFIG_FLAG, HelpRequested, end_with_parent, load_config, parse_command,
                          raw_config, training_help)
from settings.config import (PER_SPLIT_PATHS, SHIPPED_CORPUS, ConfigError, local_worker_num,
                             lr_schedule_steps, main_grad_dtype, moe_layer_pattern,
                             padded_vocab_size, parse_blend, recompute_counts, samples_per_split,
                             global_batch_size_at, sample_based, sharded_by_fsdp)
from tokenizer import build_tokenizer


_MINDSPORE_READY = []


def setup_mindspore(cfg=None, bind_core=True):
    """PyNative on the configured device, CPU threads, seed. The device and threads are set once
    per process (MindSpore refuses to set threads twice) and before the first op: launch_blocking
    has no effect once ops have run. Each of several workers msrun started on one machine keeps
    to cores of its own (bind_cores) if cfg's training_config.bind_core, or without cfg
    `bind_core`."""
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
        local = int(local_worker_num() or 1)        # the workers sharing this machine's cores
        threads = ((training_cfg is not None and training_cfg.threads_num)
                   or max(1, (os.cpu_count() or 1) // local))
        ms.device_context.cpu.op_tuning.threads_num(threads)
        index = worker_index(training_cfg.bind_core if training_cfg is not None else bind_core,
                             local)
        if index is not None:
            bind_cores(index, local)
        # PyNative normally queues ops to dispatch threads; on a few shared CPU cores those threads
        # contend with the kernels. Launching each op in the caller's thread measured 5.8x faster
        # op by op, 1.5x compiled, 9x with TP2 on 2 workers (tiny model, 2 cores;
        # docs/performance.md).
        ms.runtime.launch_blocking()


def worker_index(bind, local):
    """This worker's place among the `local` workers of its machine if it is to keep to cores of
    its own: `bind`, and several workers, this one started by msrun (which sets RANK_ID); else
    None (one process, or processes that share the cores as they please)."""
    rank = os.environ.get("RANK_ID")
    return int(rank) % local if bind and rank is not None and local > 1 else None


def worker_cores(allowed, index, workers):
    """The cores worker `index` of the `workers` on this machine keeps to: an equal share of the
    `allowed` ones, or with more workers than cores one core, taken in turn (workers index,
    index + cores, ... share it: a TP pair, adjacent ranks, on two cores)."""
    allowed = sorted(allowed)
    if workers >= len(allowed):
        return {allowed[index % len(allowed)]}
    share = len(allowed) // workers
    return set(allowed[index * share:(index + 1) * share])


def bind_cores(index, workers):
    """Keeps every thread of this process, those to come too (a thread inherits its creator's
    cores), to worker_cores. Unbound, two workers' threads on 2 cores met on one core while the
    other idled, and MindSpore's runtime threads, which spin on sched_yield, took turns from the
    other worker's kernels: bound, TP2 ran 1.3x faster, DP2 1.13x, PP2 1.17x
    (docs/performance.md). msrun's own --bind_core does this for as many workers as cores."""
    cores = worker_cores(os.sched_getaffinity(0), index, workers)
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):          # a thread that has ended
            os.sched_setaffinity(int(tid), cores)


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
    if training_cfg.load_checkpoint and training_cfg.ckpt_step is None:
        fallback = checkpoint.intact_checkpoint(load, training_cfg.output_dir,
                                                parallel.launched_world_size() == 1)
        if fallback:                       # the latest is damaged: the newest intact one
            training_cfg.ckpt_step, warning = fallback
            print(warning, file=sys.stderr)
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
            data.IndexedDataset(corpus)           # its .idx checked against its .bin
        resolved += ([words[2 * k]] if weights is not None else []) + found
    return resolved[0] if len(resolved) == 1 else resolved


def check_token_ids(dataset_cfg, tokenizer=None):
    """Each corpus's token ids below the tokenizer's vocabulary: one pass over its .bin
    (docs/training.md gives the cost), so once a launch, in one process: run.sh's `check` before
    msrun starts the workers, or a run alone. Without `tokenizer`, the run's is built here, once a
    corpus holds tokens."""
    blend, per_split = data.data_blends(dataset_cfg)
    blends = [blend] if per_split is None else [b for b in per_split if b]
    for prefix in dict.fromkeys(p for prefixes, _ in blends for p in prefixes):
        indexed = data.IndexedDataset(prefix)
        if indexed.end:                           # no tokens, no wrong one
            tokenizer = tokenizer or build_tokenizer(dataset_cfg.tokenizer_type,
                                                     dataset_cfg.vocab_file,
                                                     dataset_cfg.merge_file,
                                                     dataset_cfg.vocab_size)
            indexed.check_token_ids(tokenizer.vocab_size, "dataset_config.tokenizer_type="
                                    + dataset_cfg.tokenizer_type)


def build_data(cfg, tokenizer):
    dataset_cfg, training_cfg = cfg.dataset_config, cfg.training_config
    seq_length, num_samples = cfg.model_config.seq_length, samples_per_split(cfg)
    if dataset_cfg.mock_data:
        vocab = dataset_cfg.vocab_size or tokenizer.vocab_size
        return tuple(data.MockGPTDataset(n, seq_length, vocab, training_cfg.seed + i) if n else None
                     for i, n in enumerate(num_samples))
    if parallel.launched_world_size() == 1:       # several workers: run.sh's check did it
        check_token_ids(dataset_cfg, tokenizer)
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
    chunks = pipeline.build_chunks(model_provider, model_cfg, state.pp, state.pp_rank,
                                   parallel_cfg.virtual_pipeline_model_parallel_size,
                                   parallel_cfg.num_layer_list, rng,
                                   recompute_counts(parallel_cfg, model_cfg)[state.pp_rank])
    for chunk in chunks:
        init_weights(chunk, cfg.training_config.seed)
    return chunks, rng


def optimizer_and_scheduler(cfg, model, ddp, state=None):
    """(optimizer, scheduler) of a model or a list of model chunks and its
    DistributedDataParallel `ddp`: Megatron's get_megatron_optimizer (optimizer.py), casting
    with the layer spec's cast, and its get_optimizer_param_scheduler."""
    optimizer = opt.get_megatron_optimizer(cfg, model, ddp, opt.build_scaler(cfg), state,
                                           layer_spec(cfg.model_config).cast)
    return optimizer, get_optimizer_param_scheduler(cfg)


def get_optimizer_param_scheduler(cfg):
    """Megatron's: the learning-rate and weight-decay schedules of the config, their steps
    counted as config.lr_schedule_steps gives them (iterations, or samples)."""
    optimizer_cfg = cfg.optimizer_config
    schedule = optimizer_cfg.learning_rate_scheduler_kwargs
    warmup, decay, wd_incr, wsd = lr_schedule_steps(schedule, cfg.training_config)
    return opt.OptimizerParamScheduler(
        max_lr=optimizer_cfg.learning_rate, min_lr=schedule.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=decay, lr_decay_style=schedule.lr_decay_style,
        start_wd=optimizer_cfg.start_weight_decay, end_wd=optimizer_cfg.end_weight_decay,
        wd_incr_steps=wd_incr, wd_incr_style=optimizer_cfg.weight_decay_incr_style,
        init_lr=schedule.lr_warmup_init, wsd_decay_steps=wsd,
        lr_wsd_decay_style=schedule.lr_wsd_decay_style)


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
    """Megatron's train_step for `model`, a GPTModel or this rank's list of model chunks: the
    schedule's forward and backward over a step's micro-batches (pipeline.ForwardBackward), the
    gradients' reductions, the optimizer's step. What data parallelism and the experts do in a
    step comes as values, handed by build_trainer as Megatron's training.py sets them in its
    config: `finalize_model_grads_func(grads, params, state, ddp, chunks)` (every reduction of
    the gradients after the schedule), `grad_sync_func` (the schedule's, during the backward, or
    None) and `aux_loss_scale_func(loss weight)` (the experts' auxiliary losses' backward scale,
    or None without experts). `phase(name)`: a context manager around each phase of a step and
    pass, for what observes them (instruments/logs.Timers)."""

    def __init__(self, cfg, model, ddp, optimizer, scheduler, state, phase,
                 finalize_model_grads_func, grad_sync_func=None, aux_loss_scale_func=None):
        self.cfg, self.ddp, self.optimizer, self.scheduler = cfg, ddp, optimizer, scheduler
        self.phase, self.scaler, self.state = phase, optimizer.scaler, state
        self.finalize_model_grads_func = finalize_model_grads_func
        self.aux_loss_scale_func = aux_loss_scale_func
        self.chunks = model if isinstance(model, list) else [model]
        self.params = [param for chunk in self.chunks for param in chunk.get_parameters()]
        model_cfg, training_cfg = cfg.model_config, cfg.training_config
        # ms.jit cannot compile host RNG calls (dropout masks come from numpy streams), nor see
        # ZeRO-3's parameters set anew (optimizer.ShardedParamOptimizer)
        dropout = model_cfg.hidden_dropout_rate or model_cfg.attention_dropout_rate
        zero3 = ddp.reduce_scatter and sharded_by_fsdp(training_cfg)[1]
        self.compiled = training_cfg.use_jit and not dropout and not zero3
        blocks = distributed.blocks_per_piece(training_cfg, state.pp)
        pieces = [piece for chunk in self.chunks for piece in model_pieces(chunk, blocks)]
        hop = pipeline.hop_shape(model_cfg, cfg.dataset_config.batch_size, state.cp, state.tp,
                                 state.sequence_parallel)
        self.schedule = pipeline.ForwardBackward(
            pieces, self.params, state, hop, hidden_dtype(model_cfg),
            parallel.DTYPES[main_grad_dtype(cfg)], self.compiled,
            cfg.parallel_config.pipeline_schedule, optimizer.cast, phase,
            param_sync_func=optimizer.finish_param_sync, grad_sync_func=grad_sync_func,
            param_release_func=optimizer.release_params, shard_grads=ddp.every_backward)

    def set_train(self, mode):
        for chunk in self.chunks:
            chunk.set_train(mode)

    def forward_backward(self, micro_batches):
        """(loss of each micro-batch, gradients of sum(loss) * scale / m summed over them in
        the main gradients' dtype); with pipeline parallelism the losses only on the last
        stage."""
        self.loss_weight = self.scaler.scale / len(micro_batches)
        if self.aux_loss_scale_func:
            # the aux and z losses' gradients get the main loss' weight (Megatron's
            # schedules.py:366 multiplies by cp too: its CP gradients are averaged, ours summed)
            self.aux_loss_scale_func(self.loss_weight)
        tensors = [to_tensors(b, self.state) for b in micro_batches]
        return self.schedule.run(tensors, self.loss_weight)

    def train_step(self, micro_batches):
        """Megatron's train_step: forward and backward over the micro-batches, the gradients'
        reductions (finalize_model_grads_func), then optimizer.step(), called once (prepare
        the grads: unscale, inf/nan check, and on overflow nothing more; clip; update), then the
        scheduler's step if it updated. Returns (mean loss over the micro-batches,
        updated, gradient norm, lr used)."""
        self.set_train(True)
        with self.phase("forward-backward"):
            losses, grads = self.forward_backward(micro_batches)
        with self.phase("grads-reduce"):
            grads = self.finalize_model_grads_func(grads, self.params, self.state, self.ddp,
                                                   self.chunks)
        with self.phase("optimizer"):
            lr = self.scheduler.get_lr()
            updated, grad_norm = self.optimizer.step(grads, lr, self.scheduler.get_wd())
            if updated:                              # Megatron: a skipped step does not count
                # sample-based training counts its schedules in samples (Megatron: always)
                samples = len(micro_batches) * self.cfg.dataset_config.batch_size * self.state.dp
                self.scheduler.step(samples if sample_based(self.cfg.training_config) else 1)
        loss = sum(losses) / len(micro_batches) if losses else 0.0   # none before the last stage
        return self.dp_mean(loss), updated, grad_norm, lr

    def dp_mean(self, value):
        """A per-rank number averaged over the data-parallel ranks (for the log)."""
        size = self.state.dp * self.state.cp
        if size == 1:
            return value
        total = parallel.collectives(self.state.dp_cp_group).all_reduce(
            Tensor([value], ms.float32))
        return float(total.asnumpy()[0]) / size


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
    state = trainer.state
    trainer.optimizer.finish_param_sync()    # parameters a step left to the next forward, written
    trainer.set_train(False)
    num_microbatches = cfg.dataset_config.micro_batch_num
    it = data_loader(cfg, dataset, state, consumed)
    losses = []
    for _ in range(iters):
        batches = [to_tensors(b, state) for _, b in zip(range(num_microbatches), it)]
        if batches and (state.pp == 1 or len(batches) == num_microbatches):
            # a pipeline runs whole global batches
            losses += trainer.schedule.run(batches, forward_only=True)[0]
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
    timers = Timers()
    trainer, rng = set_up(cfg, tokenizer, notes, timers)
    iteration, consumed = 0, 0
    if training_cfg.load_checkpoint:
        iteration, consumed = checkpoint.load_training_state(cfg, trainer, rng)
    if training_cfg.exit_signal_handler:              # noted here, acted on between steps
        _SIGTERM.clear()
        signal.signal(signal.SIGTERM, lambda signum, frame: _SIGTERM.append(signum))
        shared_memory.watch_sigterm()                 # seen at once in a shared-memory wait
    estimate = log_start(cfg, trainer, train_ds, valid_ds, test_ds)
    state = trainer.state
    it = data_loader(cfg, train_ds, state, consumed)
    metrics = open_metrics(cfg, state, iteration)
    window = LogWindow(cfg, trainer, iteration + 1, metrics, timers)
    last_saved = iteration
    if training_cfg.save_initial_checkpoint and not training_cfg.load_checkpoint:
        checkpoint.save_training_state(cfg, 0, 0, trainer, rng)   # a seed (a restart loads)
    estimate.begin()                                  # the measured peak counts from here
    while iteration < training_cfg.training_iters:
        epoch = it.epoch
        scale = trainer.scaler.scale                  # the step may change it
        iteration += 1
        # Megatron's update_num_microbatches: the ramp-up's global batch, else the whole one
        batch_size = global_batch_size_at(it.consumed_samples, dataset_cfg.global_batch_size,
                                          dataset_cfg.rampup_batch_size)
        window.set_batch_size(batch_size)
        batches = [next(it) for _ in range(batch_size // (dataset_cfg.batch_size * state.dp))]
        with window.step(iteration):
            step = trainer.train_step(batches)
        window.log(iteration, epoch, scale, *step)
        if maybe_evaluate(cfg, trainer, valid_ds, iteration, metrics):
            window.restart_clock()
        if maybe_save(cfg, iteration, it.consumed_samples, trainer, rng):
            last_saved = iteration
            window.restart_clock()
        reason = exit_reason(training_cfg, iteration, started)
        if reason:
            trainer.optimizer.finish_param_sync()
            if last_saved != iteration:
                checkpoint.save_training_state(cfg, iteration, it.consumed_samples, trainer, rng)
            log.info(f"exiting at iteration {iteration}: {reason}; "
                     f"continue with --load {training_cfg.output_dir}")
            return trainer.chunks
    trainer.optimizer.finish_param_sync()
    log.info(estimate.measured())
    if iteration > last_saved:                        # at the end, unless nothing was trained
        checkpoint.save_training_state(cfg, iteration, it.consumed_samples, trainer, rng)
    if test_ds is not None and training_cfg.eval_iters:
        loss = evaluate(trainer, test_ds, 0, training_cfg.eval_iters, cfg)
        log_eval_loss("test", iteration, loss, metrics)
    return trainer.chunks


def set_up(cfg, tokenizer, notes, phase=contextlib.nullcontext):
    """MindSpore, the process groups, this rank's log (`notes` first), then the model, its
    optimizer and the Trainer, its phases observed by `phase`: (trainer, the dropout RNG)."""
    setup_mindspore(cfg)
    parallel_cfg = cfg.parallel_config
    state = parallel.initialize_model_parallel(
        parallel_cfg.tensor_model_parallel_size, parallel_cfg.pipeline_model_parallel_size,
        parallel_cfg.context_parallel_size, parallel_cfg.sequence_parallel,
        parallel_cfg.ulysses_degree_in_cp, parallel_cfg.expert_model_parallel_size,
        cfg.training_config.cpu_collectives)
    setup_logging(cfg.training_config.output_dir, state.rank,
                  to_console=state.rank == loss_rank(state))
    for note in notes:
        (log.warning if note.startswith("warning: ") else log.info)(note)
    if state.world_size > 1:
        log.info(parallel.grid_table(state.world_size, state.tp, state.cp, state.pp, state.ep))
        log.info(f"CPU cores {sorted(os.sched_getaffinity(0))} of {os.cpu_count()}")
    model, rng = build_model(cfg, tokenizer, state)
    parallel.observe(LEDGER)
    # Megatron's get_model wraps the model in its DDP class
    ddp_class = distributed.data_parallel_class(cfg.training_config, state.dp * state.cp)
    ddp = distributed.build_data_parallel(cfg, model, state, phase, ddp_class)
    return build_trainer(cfg, model, ddp, *optimizer_and_scheduler(cfg, model, ddp, state), state,
                         phase), rng


def build_trainer(cfg, model, ddp, optimizer, scheduler, state=None,
                  phase=contextlib.nullcontext):
    """The Trainer of `model` (a GPTModel or this rank's chunks) handed the callbacks Megatron's
    training.py sets in its config before the loop: finalize_model_grads_func
    (distributed.finalize_model_grads), grad_sync_func (distributed.grad_sync_func's: `ddp`'s
    buckets started during the backward, with the overlap; else None) and, with experts, the
    scale of their auxiliary losses' gradients (moe.MoEAuxLossAutoScaler.set_loss_scale)."""
    state = state or parallel.get_state()
    chunks = model if isinstance(model, list) else [model]
    params = [param for chunk in chunks for param in chunk.get_parameters()]
    has_moe = any(moe_layer_pattern(cfg.model_config))
    return Trainer(cfg, model, ddp, optimizer, scheduler, state, phase,
                   distributed.finalize_model_grads,
                   distributed.grad_sync_func(cfg, ddp, params, state),
                   moe.MoEAuxLossAutoScaler.set_loss_scale if has_moe else None)


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
    trainer.optimizer.finish_param_sync()
    checkpoint.save_training_state(cfg, iteration, consumed, trainer, rng)
    return True


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


# ----------------------------------------------------------------------------- commands
def main(argv):
    """Run one command (COMMANDS; `train` when the first argument is a flag or key=value) and
    return its exit code: the command's (None: 0), 2 with one `error: ` line for a wrong command
    line, config or checkpoint, 130 for Ctrl-C in preprocess."""
    end_with_parent()
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
    except (ConfigError, checkpoint.CheckpointError, OSError,     # one line, the fix in it
            shared_memory.SegmentError) as e:
        fail(expected_message(e))
        return 2
    except Exception:                                                  # a bug: its traceback, once
        fail(f"training failed: {traceback.format_exc()}")
        return 1
    return 0


def check_main(argv):
    """What run.sh runs before msrun: the training command for --nproc workers, checked in one
    process (config, layout, input files, the corpora's token ids)."""
    dataset_cfg = configure("check", argv)[0].dataset_config
    if not dataset_cfg.mock_data:
        check_token_ids(dataset_cfg)


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
    record_launch(cfg)
    return cfg, notes


def preprocess_main(argv):
    data.preprocess_main(argv)                    # its prefixes are no exit code


def generate_main(argv):
    setup_mindspore()                             # the device and threads the model runs on
    sample.generate_main(argv)


def record_launch(cfg):
    """Under run.sh, what its restarts need (--max-restarts) in RUN_SH_LAUNCH_FILE, once the
    config is checked: the run's max_restarts and the folder a restart resumes from."""
    path = os.environ.get("RUN_SH_LAUNCH_FILE")
    if path:
        training_cfg = cfg.training_config
        data.write_atomic(path, f"{training_cfg.max_restarts} {training_cfg.output_dir}\n")


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
