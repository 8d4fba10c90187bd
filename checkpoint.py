"""Checkpoints in Megatron's directory layout, written so that a crash never leaves a half one.

    <save>/latest_checkpointed_iteration.txt            "100", written last
    <save>/iter_0000100/mp_rank_TT/model_optim_rng.ckpt  one folder per TP rank (mp_rank_TT_PPP with
                                                         pipeline stages): weights "model.<name>" and
                                                         optimizer state "optimizer.<state>.<name>"
                                                         (MindSpore ckpt or safetensors, CRC-checked)
    <save>/iter_0000100/mp_rank_TT/distrib_optim_DDD.ckpt  with the distributed optimizer: DP rank
                                                         DDD's fp32 master shard and moments
    <save>/iter_0000100/mp_rank_TT/meta.json             iteration, consumed samples, layout, scheduler,
                                                         loss scaler, RNG streams, config
Names are global parameter names (gpt.global_name), so a shard says what it holds whatever the layout.
All ranks write into `.iter_0000100.tmp/`; rank 0 renames it into place, then replaces `latest`.
"""
import json
import logging
import os
import shutil

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor

from config import to_dict

log = logging.getLogger("train")

LATEST = "latest_checkpointed_iteration.txt"
WEIGHTS = "model_optim_rng"


class CheckpointError(ValueError):
    pass


def iteration_dir(root, iteration):
    return os.path.join(root, f"iter_{iteration:07d}")


def shard_name(tp_rank=0, pp_rank=0, pp_size=1):
    """Megatron: mp_rank_TT with one pipeline stage, mp_rank_TT_PPP with several."""
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def _write_atomic(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(root, iteration, files, meta, ckpt_format="ckpt", keep_max=None, shard="mp_rank_00",
                    barrier=lambda: None, leader=True):
    """Write checkpoint `iteration` under `root`. `files` maps a file stem to this rank's tensors
    (name -> numpy array or Tensor); empty if this rank writes nothing; `meta` (JSON-able, or
    None) goes to the shard's meta.json. With several ranks every rank calls this: the leader
    makes the temporary folder, all ranks write their files, then the leader renames it into
    place, points `latest` at it and keeps the newest `keep_max` checkpoints."""
    final = iteration_dir(root, iteration)
    tmp = os.path.join(root, f".iter_{iteration:07d}.tmp")
    if leader:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    ext = "safetensors" if ckpt_format == "safetensors" else "ckpt"
    if files or meta is not None:
        os.makedirs(os.path.join(tmp, shard), exist_ok=True)
    for stem, tensors in files.items():
        items = [{"name": k, "data": Parameter(Tensor(np.asarray(v)) if isinstance(v, np.ndarray) else v, name=k)}
                 for k, v in tensors.items()]
        ms.save_checkpoint(items, os.path.join(tmp, shard, f"{stem}.{ext}"), crc_check=True, format=ckpt_format)
    if meta is not None:
        _write_atomic(os.path.join(tmp, shard, "meta.json"), json.dumps(meta, indent=1))
    barrier()
    if leader:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomic(os.path.join(root, LATEST), str(iteration))
        if keep_max:
            for old in sorted(saved_iterations(root))[:-keep_max]:
                shutil.rmtree(iteration_dir(root, old), ignore_errors=True)
    barrier()
    return final


def saved_iterations(root):
    return [int(d[5:]) for d in os.listdir(root) if d.startswith("iter_") and d[5:].isdigit()]


def latest_iteration(root):
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        raise CheckpointError(f"no checkpoint in {root}: {LATEST} is missing (check --load)")
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} holds {text!r}, not an iteration number")
    return int(text)


def load_checkpoint(root, shard="mp_rank_00", crc_check=True, stems=(WEIGHTS,)):
    """(tensors name -> numpy array, meta) of the files `stems` of the checkpoint `latest`
    points at, in this rank's `shard` folder."""
    iteration = latest_iteration(root)
    folder = os.path.join(iteration_dir(root, iteration), shard)
    meta_path = os.path.join(folder, "meta.json")
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"{meta_path} is missing: the checkpoint of iteration {iteration} is incomplete "
                              "or was saved with another parallel layout")
    try:
        meta = json.load(open(meta_path))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_path} is damaged: {e}") from None
    fmt = meta.get("ckpt_format", "ckpt")
    tensors = {}
    for stem in stems:
        path = os.path.join(folder, f"{stem}.{'safetensors' if fmt == 'safetensors' else 'ckpt'}")
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing")
        try:
            params = ms.load_checkpoint(path, crc_check=crc_check, format=fmt)
        except Exception as e:                                               # noqa: BLE001
            raise CheckpointError(f"{path} is damaged or unreadable ({type(e).__name__}): "
                                  "restore it or load an earlier checkpoint") from None
        tensors.update({k: v.asnumpy() for k, v in params.items()})
    return tensors, meta


def load_shards(root):
    """([tensors of TP rank 0, 1, ...], meta) of the latest checkpoint, whatever its layout: the
    files of all pipeline stages of a TP rank go into one dict (their names are global)."""
    folder = iteration_dir(root, latest_iteration(root))
    single = os.path.isdir(os.path.join(folder, shard_name(0)))
    first, meta = load_checkpoint(root, shard_name(0) if single else shard_name(0, 0, 2))
    tp, pp = meta["layout"]["tp"], meta["layout"]["pp"]
    shards = []
    for tp_rank in range(tp):
        tensors = {}
        for pp_rank in range(pp):
            tensors.update(first if tp_rank == pp_rank == 0 else
                           load_checkpoint(root, shard_name(tp_rank, pp_rank, pp))[0])
        shards.append(tensors)
    return shards, meta


def merge_tensor_parallel(shards, full_shapes, chunks_of=lambda name: 1):
    """Full tensors from the per-TP-rank `shards` (list of name -> array, TP rank order). A
    tensor whose shard is smaller than its full shape was split along that dimension (in
    `chunks_of(name)` blocks, e.g. 2 for SwiGLU's [gate; up]); the others are replicated."""
    merged = {}
    for name, shape in full_shapes.items():
        parts = [s[name] for s in shards]
        split = [d for d, (a, b) in enumerate(zip(parts[0].shape, shape)) if a != b]
        if not split:
            merged[name] = parts[0]
            continue
        dim, chunks = split[0], chunks_of(name)
        blocks = [np.concatenate([np.split(p, chunks, axis=dim)[c] for p in parts], axis=dim)
                  for c in range(chunks)]
        merged[name] = np.concatenate(blocks, axis=dim)
    return merged


# ----------------------------------------------------------------------------- training state
def named_parameters(chunks):
    """("model.<global name>", parameter) of this rank's model chunks. Global names tell the
    chunks of a virtual pipeline apart (their layer numbers differ)."""
    from gpt import global_name
    return [(f"model.{global_name(n, chunk.layer_offset)}", p) for chunk in chunks
            for n, p in chunk.parameters_and_names()]


def model_tensors(chunks):
    """name -> value of this rank's parameters, under their global names."""
    return {name: p.asnumpy() for name, p in named_parameters(chunks)}


def optimizer_tensors(trainer):
    """(tensors, step) of the optimizer state: per parameter name, or, for the distributed
    optimizer, per owned piece (fp32 master shard "main.k" and its moments)."""
    if trainer.distributed:
        state = trainer.optimizer.inner.state_dict()
        tensors = {f"main.{k}": p.asnumpy() for k, p in enumerate(trainer.optimizer.main_params)}
    else:
        state = trainer.optimizer.state_dict()
        tensors = {}
    names = [n[len("model."):] for n, _ in named_parameters(trainer.chunks)]
    for key, value in state.items():
        if key != "step":
            kind, index = key.rsplit(".", 1)
            tensors[f"optimizer.{kind}.{index if trainer.distributed else names[int(index)]}"] = value
    return tensors, state["step"]


def _layout(cfg, trainer):
    s = trainer.state
    return {"tp": s.tp, "pp": s.pp, "cp": s.cp, "dp": s.dp, "distributed_optimizer": trainer.distributed}


def _barrier(state):
    """All ranks wait here: a one-element all-reduce on the world group (mint's barrier logs a
    spurious device error on CPU)."""
    if state.world_size > 1:
        import mindspore.mint.distributed as dist
        from mindspore.communication import GlobalComm
        flag = Tensor([0.0], ms.float32)
        dist.all_reduce(flag, group=GlobalComm.WORLD_COMM_GROUP)
        flag.asnumpy()                                # PyNative is asynchronous: wait for it


def save_training_state(cfg, iteration, consumed, trainer, rng):
    """Megatron layout: mp_rank_TT/ per TP rank, written by its first DP rank; with the
    distributed optimizer every DP rank adds its own distrib_optim_DDD file."""
    t, state = cfg.training_config, trainer.state
    opt_tensors, step = optimizer_tensors(trainer)
    writer = state.dp_rank == 0 and state.cp_rank == 0
    files = {}
    if writer:
        files[WEIGHTS] = {**model_tensors(trainer.chunks), **({} if trainer.distributed else opt_tensors)}
    if trainer.distributed:
        files[f"distrib_optim_{state.dp_rank + state.cp_rank * state.dp:03d}"] = opt_tensors
    meta = None
    if writer:
        meta = {"iteration": iteration, "consumed_train_samples": consumed, "optimizer_step": step,
                "opt_param_scheduler": trainer.scheduler.state_dict(),
                "grad_scaler": trainer.scaler.state_dict(), "rng_state": rng.state_dict(),
                "ckpt_format": t.ckpt_format, "layout": _layout(cfg, trainer), "config": to_dict(cfg)}
    shard = shard_name(state.tp_rank, state.pp_rank, state.pp)
    path = save_checkpoint(t.output_dir, iteration, files, meta, t.ckpt_format, t.keep_checkpoint_max,
                                      shard, barrier=lambda: _barrier(state), leader=state.rank == 0)
    log.info(f"saved checkpoint at iteration {iteration} to {path}")


def load_training_state(cfg, trainer, rng):
    """Restore from training_config.load_checkpoint (same layout); returns (iteration, consumed)."""
    t, state, chunks = cfg.training_config, trainer.state, trainer.chunks
    shard = shard_name(state.tp_rank, state.pp_rank, state.pp)
    stems = [WEIGHTS]
    if trainer.distributed and not (t.finetune or t.no_load_optim):
        stems.append(f"distrib_optim_{state.dp_rank + state.cp_rank * state.dp:03d}")
    tensors, meta = load_checkpoint(t.load_checkpoint, shard, stems=stems)
    if meta.get("layout", _layout(cfg, trainer)) != _layout(cfg, trainer) and not t.finetune:
        raise CheckpointError(
            f"checkpoint {t.load_checkpoint} was saved with layout {meta['layout']}, this run is "
            f"{_layout(cfg, trainer)}: resume with the same layout (or --finetune for the weights of the same TP size)")
    for name, p in named_parameters(chunks):
        saved = tensors.get(name)
        if saved is None or saved.shape != tuple(p.shape):
            got = "missing" if saved is None else f"shape {saved.shape}"
            raise CheckpointError(
                f"checkpoint {t.load_checkpoint} does not fit the model: {name} is {got}, the model "
                f"wants {tuple(p.shape)}; use the model_config it was saved with")
    for name, p in named_parameters(chunks):
        p.set_data(Tensor(tensors[name]))
    if trainer.distributed:
        trainer.optimizer.reload_main_params()
    if t.finetune:
        log.info(f"loaded weights of iteration {meta['iteration']} from {t.load_checkpoint} (finetune: iteration 0)")
        return 0, 0
    if not t.no_load_optim:
        saved_opt, step = optimizer_tensors(trainer)
        state_dict = {"step": meta["optimizer_step"]}
        names = [n[len("model."):] for n, _ in named_parameters(chunks)]
        for key in saved_opt:
            kind, _, rest = key.partition(".")
            if kind == "optimizer":
                sub, ident = rest.rsplit(".", 1) if trainer.distributed else rest.split(".", 1)
                index = ident if trainer.distributed else names.index(ident)
                state_dict[f"{sub}.{index}"] = tensors[key]
        if trainer.distributed:
            for k, p in enumerate(trainer.optimizer.main_params):
                p.copy_(Tensor(tensors[f"main.{k}"]))
            trainer.optimizer.inner.load_state_dict(state_dict)
        else:
            trainer.optimizer.load_state_dict(state_dict)
        trainer.scheduler.load_state_dict(meta["opt_param_scheduler"])
        trainer.scaler.load_state_dict(meta["grad_scaler"])
    if not t.no_load_rng:
        rng.load_state_dict(meta["rng_state"])
    log.info(f"loaded checkpoint of iteration {meta['iteration']} from {t.load_checkpoint}")
    return meta["iteration"], meta["consumed_train_samples"]
