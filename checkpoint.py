"""Checkpoints in Megatron's directory layout, written so that a crash never leaves a half one.

    <save>/latest_checkpointed_iteration.txt            "100", written last
    <save>/iter_0000100/mp_rank_00/model_optim_rng.ckpt  model weights "model.<name>" and optimizer
                                                         state "optimizer.<state>.<name>" (MindSpore
                                                         ckpt or safetensors, `ckpt_format`)
    <save>/iter_0000100/mp_rank_00/meta.json             iteration, consumed samples, scheduler,
                                                         loss scaler, RNG streams, config
Names are global parameter names (gpt.global_name), so a shard says what it holds whatever the layout.
A checkpoint is assembled in `.iter_0000100.tmp/` and renamed into place; then `latest` is replaced.
"""
import json
import os
import shutil

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor

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
