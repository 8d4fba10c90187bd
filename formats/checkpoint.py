"""Checkpoints in Megatron's directory layout, written so that a crash never leaves a half one.

    <save>/latest_checkpointed_iteration.txt
        "100", written last
    <save>/iter_0000100/mp_rank_TT/model_optim_rng.ckpt
        one folder per TP rank (mp_rank_TT_PPP with pipeline stages, then _EEE per expert
        parallel rank): weights "model.<name>" and optimizer state "optimizer.<state>.<name>"
        (MindSpore ckpt or safetensors, CRC-checked)
    <save>/iter_0000100/mp_rank_TT/distrib_optim_DDD.ckpt
        with the distributed optimizer: DP x CP rank DDD's fp32 master shard and moments (with
        EP, DDD is the expert-data-parallel rank; the file holds the rank's dense and expert
        pieces)
    <save>/iter_0000100/mp_rank_TT/meta.json
        iteration, consumed samples, layout, scheduler, loss scaler, RNG streams, config
Names are global parameter names (gpt.global_name), so a shard says what it holds whatever the
layout. All ranks write into `.iter_0000100.tmp/`; rank 0 renames it into place, then replaces
`latest`.
"""
import contextlib
import functools
import itertools
import json
import logging
import os
import shutil
import time
import zlib

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, ops

import moe
import optimizer as opt
import parallel
from data import fsync_folder, write_atomic
from distributed import BucketLayout, fsdp_units
from formats import dist_checkpoint, megatron_checkpoint, torch_format
from formats.megatron_checkpoint import LATEST, WEIGHTS, CheckpointError, iteration_dir, shard_name
from gpt import global_name, is_embedding_copy, model_provider
from parallel import F32
from pipeline import build_chunks, layer_split
from settings.cli import PROJECT_CONFIG, REQUIRED, from_saved, load_config, parse_command
from settings.config import ConfigError, sharded_by_fsdp, to_dict, to_namespace
from tokenizer import build_tokenizer

log = logging.getLogger("train")


def save_checkpoint(root, iteration, shards, ckpt_format="ckpt", keep_max=None,
                    barrier=lambda: None, leader=True, finish=None):
    """Write checkpoint `iteration` under `root`. `shards` maps a shard folder (mp_rank_..) to
    (files, meta): `files` maps a file stem to tensors (name -> numpy array or Tensor), `meta`
    (JSON-able, or None) goes to the folder's meta.json. With several ranks every rank calls
    this with what it writes: the leader makes the temporary folder, all ranks write their
    files, then the leader completes it (`finish(tmp)`: torch_dist's index of every rank's
    files), renames it into place, points `latest` at it and keeps the newest `keep_max`
    checkpoints."""
    final = iteration_dir(root, iteration)
    tmp = os.path.join(root, f".iter_{iteration:07d}.tmp")
    tracked = latest_iteration(root) if os.path.isfile(os.path.join(root, LATEST)) else -1
    # replacing it, a crash midway would lose it
    if os.path.exists(final) and iteration <= tracked:
        raise CheckpointError(f"{final} already exists: save into an empty folder or continue "
                              "from it with --load")
    if leader:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)   # left by a save that was killed
        shutil.rmtree(final, ignore_errors=True)  # beyond `latest`: killed before the tracker moved
        os.makedirs(tmp)
    barrier()
    try:
        _write_shards(tmp, shards, ckpt_format)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)        # a failed save leaves nothing half-written
        raise
    barrier()
    if leader:
        try:
            if finish:
                finish(tmp)
            write_atomic(os.path.join(tmp, CHECKSUMS), json.dumps(checksums(tmp), indent=1))
            _sync_tree(tmp)
        except Exception:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        # each step on disk before the next (docs/checkpoints.md): the folder's files, its
        # name in root, then `latest` (write_atomic syncs it and root), and only then the pruning
        os.replace(tmp, final)
        fsync_folder(root)
        write_atomic(os.path.join(root, LATEST), str(iteration))
        if keep_max:                          # the oldest go, never the one just written
            for old in sorted(i for i in saved_iterations(root) if i <= iteration)[:-keep_max]:
                shutil.rmtree(iteration_dir(root, old), ignore_errors=True)
    barrier()
    return final


def _sync_tree(folder):
    """Every file under `folder` to disk, then each folder below it, `folder` last: what the
    ranks wrote (MindSpore's save_checkpoint syncs nothing) is on disk before it is renamed into
    place. fsync writes the file's data whichever descriptor names it (man 2 fsync)."""
    for top, _, names in os.walk(folder, topdown=False):
        for name in names:
            fd = os.open(os.path.join(top, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_folder(top)


CHECKSUMS = "checksums.json"   # {file under the iteration folder: [bytes, CRC-32]}


def checksums(folder):
    """Each file under `folder` (relative path) -> [its size, the CRC-32 of its bytes]: what a
    damaged checkpoint (a file truncated, overwritten or lost since the save) no longer matches,
    whatever its format."""
    sums = {}
    for top, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(top, name)
            crc = 0
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    crc = zlib.crc32(block, crc)
            sums[os.path.relpath(path, folder)] = [os.path.getsize(path), crc]
    sums.pop(CHECKSUMS, None)
    return sums


def damage(root, iteration):
    """What no longer matches the checksums saved with checkpoint `iteration` ("path: what"), or
    None when it is intact, or saved without checksums (by Megatron-LM, or by this project before
    it wrote them)."""
    folder = iteration_dir(root, iteration)
    listed = os.path.join(folder, CHECKSUMS)
    if not os.path.isdir(folder):
        return f"{folder}: missing"
    if not os.path.isfile(listed):
        return None
    try:
        saved = json.load(open(listed))
    except (OSError, ValueError) as e:
        return f"{listed}: unreadable ({type(e).__name__})"
    found = checksums(folder)
    for name, (size, crc) in sorted(saved.items()):
        path = os.path.join(folder, name)
        if name not in found:
            return f"{path}: missing"
        if found[name][0] != size:
            return f"{path}: {found[name][0]} bytes, saved with {size} (truncated or overwritten)"
        if found[name][1] != crc:
            return f"{path}: its bytes differ from those saved (CRC-32)"
    return None


def newest_intact(root, below):
    """The newest checkpoint in `root` below iteration `below` that is intact, or None."""
    for iteration in sorted((i for i in saved_iterations(root) if i < below), reverse=True):
        if damage(root, iteration) is None:
            return iteration
    return None


EXTENSIONS = {"ckpt": "ckpt", "safetensors": "safetensors", "torch": "pt"}


def _write_shards(tmp, shards, ckpt_format):
    """Each shard folder's files and meta.json, under the temporary folder: tensors (name ->
    array) as MindSpore ckpt or safetensors, CRC-checked; with the torch format a file's content
    (megatron_checkpoint.rank_file) as torch.save writes it; with torch_dist a rank's items
    (dist_checkpoint.rank_items) as its .distcp file."""
    for shard, (files, meta) in shards.items():
        if files or meta is not None:
            os.makedirs(os.path.join(tmp, shard), exist_ok=True)
        for stem, content in files.items():
            if ckpt_format == "torch_dist":
                dist_checkpoint.write_rank_file(os.path.join(tmp, shard), stem, content)
                continue
            path = os.path.join(tmp, shard, f"{stem}.{EXTENSIONS[ckpt_format]}")
            if ckpt_format == "torch":
                with _named(path):
                    torch_format.save(content, path)
                continue
            items = []
            for name, value in content.items():
                if isinstance(value, np.ndarray):
                    value = Tensor(np.ascontiguousarray(value))
                items.append({"name": name, "data": Parameter(value, name=name)})
            with _named(path):
                ms.save_checkpoint(items, path, crc_check=True, format=ckpt_format)
        if meta is not None:
            path = os.path.join(tmp, shard, "meta.json")
            with _named(path):
                write_atomic(path, json.dumps(meta, indent=1))


@contextlib.contextmanager
def _named(path):
    """A failed write of `path` as one OSError that names it: MindSpore raises RuntimeError for a
    full disk or a bad folder, and a full disk's OSError (ENOSPC) from a write names no file."""
    try:
        yield
    except (RuntimeError, OSError) as e:
        raise OSError(None, f"writing failed ({str(e).splitlines()[0]})", path) from None


def saved_iterations(root):
    return [int(name[5:]) for name in os.listdir(root)
            if name.startswith("iter_") and name[5:].isdigit()]


# the model_config keys that make a checkpoint's model what it is (besides the padded vocabulary)
ARCHITECTURE = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "group_query_attention", "num_query_groups", "max_position_embeddings",
                "position_embedding_type", "rotary_base", "normalization", "norm_epsilon",
                "hidden_act", "qkv_has_bias", "out_proj_has_bias", "add_bias_linear",
                "untie_embeddings_and_output_weights", "use_sandwich_norm",
                "attn_post_norm_scale", "ffn_post_norm_scale", "fp32_residual_connection",
                "num_moe_experts", "moe_ffn_hidden_size", "moe_layer_freq",
                "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
                "moe_router_enable_expert_bias")


def saved_config(root, step=None):
    """The config (a dict) the checkpoint in root (the latest, or iteration `step`) was saved
    with."""
    return load_checkpoint(root, first_shard(root, step), stems=(), step=step)[1]["config"]


def checkpoint_args(saved):
    """Megatron's --use-checkpoint-args (load_args_from_checkpoint): the saved model, sequence
    length and tokenizer as a config tree, layered under the run's own files and flags."""
    saved_model, saved_dataset = saved["model_config"], saved["dataset_config"]
    keys = [k for k in ARCHITECTURE
            if k != "num_query_groups" or saved_model["group_query_attention"]]
    model = {k: saved_model[k] for k in keys + ["seq_length"]}
    return {"model_config": dict(model, vocab_size=saved_model["padded_vocab_size"]),
            "dataset_config": {"tokenizer_type": saved_dataset["tokenizer_type"]}}


def check_fits(cfg, root):
    """Before any work: every way the checkpoint in root disagrees with this run, in one line.
    Its optimizer state, when loaded, is of its optimizer and its parameters' precision (half
    precision keeps float32 main params beside the state)."""
    step = cfg.training_config.ckpt_step
    _, meta = load_checkpoint(root, first_shard(root, step), stems=(), step=step)
    saved = meta["config"]
    saved_model, training_cfg = saved["model_config"], cfg.training_config
    pairs = [(f"model_config.{k}", saved_model.get(k), getattr(cfg.model_config, k))
             for k in ARCHITECTURE]
    pairs.append(("dataset_config.tokenizer_type", saved["dataset_config"]["tokenizer_type"],
                  cfg.dataset_config.tokenizer_type))
    weights_only = training_cfg.finetune or training_cfg.no_load_optim
    if not (weights_only or meta.get("optimizer_step") is None):
        pairs.append(("optimizer_config.optimizer_type",
                      saved["optimizer_config"]["optimizer_type"],
                      cfg.optimizer_config.optimizer_type))
        pairs.append(("model_config.params_dtype (--fp16/--bf16)",
                      saved_model.get("params_dtype") or "float32", cfg.model_config.params_dtype))
    differences = [f"{k} (checkpoint {a}, this run {b})" for k, a, b in pairs if a != b]
    if differences:
        raise CheckpointError(f"checkpoint {root} does not match this run: "
                              f"{', '.join(differences)}; give --use-checkpoint-args to take the "
                              "checkpoint's model, or the same flags")
    batch = saved["dataset_config"].get("global_batch_size")
    if not training_cfg.finetune and batch not in (None, cfg.dataset_config.global_batch_size):
        # the data's samples are counted in global batches (consumed samples, the dataset's size)
        raise CheckpointError(f"checkpoint {root} was trained with global batch {batch}, this "
                              f"run's is {cfg.dataset_config.global_batch_size}: give "
                              f"--global-batch-size {batch} (and a --micro-batch-size that "
                              "divides it), or --finetune to start a new run from its weights")


def holds_checkpoint(root):
    """A tracker or an iteration folder: a checkpoint (perhaps a damaged one) is there."""
    if not os.path.isdir(root):
        return False
    return os.path.exists(os.path.join(root, LATEST)) or bool(saved_iterations(root))


def intact_checkpoint(load, save, alone):
    """Before a run loads the latest checkpoint in `load`: None when it is intact; when it is
    damaged, the newest intact one is loaded instead: returns (the --ckpt-step to load, the
    warning line naming the damage). Continuing a run in its own folder (`save` is `load`) the
    damaged one is set aside (damaged_iter_NNNNNNN_TIME) and `latest` points at the intact one
    (no --ckpt-step needed), so the run saves that iteration again; `alone`: only one process may
    do that, before the workers start (run.sh's check), not each of them."""
    latest = latest_iteration(load)
    why = damage(load, latest)
    if why is None:
        return None
    intact = newest_intact(load, latest)
    if intact is None:
        raise CheckpointError(f"{why}, and {load} holds no earlier intact checkpoint: restore it "
                              "from a copy")
    loading = f"loading iteration {intact}, the newest intact checkpoint in {load}"
    if not save or os.path.abspath(save) != os.path.abspath(load):
        return intact, f"warning: {why}: {loading}"
    folder = iteration_dir(load, latest)
    if not alone:
        raise CheckpointError(f"{why}; iteration {intact} is intact: launch with bash run.sh, "
                              f"which sets the damaged one aside first, or move {folder} away and "
                              f"write {intact} into {LATEST}")
    # a name of its own: an earlier one may hold a damaged copy of the same iteration
    aside = os.path.join(load, f"damaged_{os.path.basename(folder)}_{time.time_ns()}")
    try:
        os.replace(folder, aside)
    except FileNotFoundError:                 # another node's launcher set it aside first
        aside = "damaged_iter_* by another node's launcher"
    write_atomic(os.path.join(load, LATEST), str(intact))
    return None, f"warning: {why}: set aside as {aside}; {loading}"


def check_save_folder(save, load, finetune=False, step=None):
    """Before training: the --save folder holds no checkpoint of another run. One folder holds one
    run: saving a fresh run beside an older one would let pruning (which keeps the highest
    iterations) delete the new checkpoints, and `latest` would jump between runs. Continuing the
    run that is there (--load pointing at the same folder) is the one way to add to it."""
    # exists before isdir: another rank may create the folder between the two calls
    if os.path.exists(save) and not os.path.isdir(save):
        raise CheckpointError(f"training_config.output_dir={save} is a file: give a folder "
                              "for --save")
    if not os.path.isdir(save):
        return
    saved = saved_iterations(save)
    if not saved:
        return
    if not load or os.path.abspath(load) != os.path.abspath(save):
        raise CheckpointError(f"training_config.output_dir={save} already holds checkpoints "
                              f"(iterations up to {max(saved)}) of another run: continue it with "
                              f"--load {save}, or save into an empty folder")
    if finetune and max(saved) > 0:
        raise CheckpointError("--finetune restarts at iteration 0, below the checkpoints in "
                              f"{save}: save the fine-tuned run into another folder")
    if step is not None and step < max(saved):
        raise CheckpointError(f"training_config.ckpt_step={step} is below the checkpoints in "
                              f"{save} (up to {max(saved)}): save the run from it into another "
                              "folder")


def load_iteration(root, step=None):
    """The iteration a load of `root` reads: `step` (Megatron's --ckpt-step) if given, else the
    latest (its tracker file)."""
    if step is None:
        return latest_iteration(root)
    if not os.path.isdir(iteration_dir(root, step)):
        held = sorted(saved_iterations(root))
        raise CheckpointError(f"--ckpt-step {step} (training_config.ckpt_step): {root} holds no "
                              f"iteration {step} (it holds {held}): give one of those")
    return step


def latest_iteration(root):
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        raise CheckpointError(f"no checkpoint in {root}: {LATEST} is missing (check --load)")
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} holds {text!r}, not an iteration number")
    return int(text)


def load_checkpoint(root, shard="mp_rank_00", crc_check=True, stems=(WEIGHTS,), step=None):
    """(tensors name -> numpy array, meta) of the files `stems` of the checkpoint `latest`
    points at (or of iteration `step`), in this rank's `shard` folder; of a torch_dist
    checkpoint (no shard folders) its meta alone."""
    iteration = load_iteration(root, step)
    if dist_checkpoint.is_dist(iteration_dir(root, iteration)):
        return {}, dist_state(root, iteration, tensors=False)[1]
    folder = os.path.join(iteration_dir(root, iteration), shard)
    meta_path = os.path.join(folder, "meta.json")
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"{meta_path} is missing: the checkpoint of iteration {iteration} "
                              "is incomplete or was saved with another parallel layout")
    try:
        meta = json.load(open(meta_path))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_path} is damaged: {e}") from None
    fmt = meta.get("ckpt_format", "ckpt")
    tensors = {}
    for stem in stems:
        path = os.path.join(folder, f"{stem}.{EXTENSIONS[fmt]}")
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing")
        if fmt == "torch":
            state = megatron_checkpoint.load_rank(path)
            tensors.update(megatron_checkpoint.rank_arrays(
                state, shard_offsets(meta, shard), shard_ep_rank(meta, shard), path))
            continue
        try:
            params = ms.load_checkpoint(path, crc_check=crc_check, format=fmt)
        except Exception as e:                                               # noqa: BLE001
            raise CheckpointError(f"{path} is damaged or unreadable ({type(e).__name__}): "
                                  "restore it or load an earlier checkpoint") from None
        tensors.update({k: v.asnumpy() for k, v in params.items()})
    return tensors, meta


def shard_offsets(meta, shard):
    """The first global layer of each model chunk of the shard folder `shard` (mp_rank_TT_PPP)
    of a checkpoint whose meta.json is `meta`."""
    layout, saved_model = meta["layout"], meta["config"]["model_config"]
    pp, vpp = layout["pp"], layout["vpp"]
    pp_rank = int(shard.split("_")[3]) if pp > 1 else 0           # mp_rank_TT_PPP[_EEE]
    split = layer_split(saved_model["num_layers"], pp, vpp, layout["num_layer_list"])
    return [split[chunk_id * pp + pp_rank][0] for chunk_id in range(vpp)]


def shard_ep_rank(meta, shard):
    """The EP rank of the shard folder `shard` (mp_rank_TT[_PPP]_EEE) of a checkpoint whose
    meta.json is `meta`; 0 without expert parallelism."""
    return int(shard.rsplit("_", 1)[1]) if meta["layout"].get("ep", 1) > 1 else 0


def load_shards(root, optimizer=False, step=None):
    """([tensors of TP rank 0, 1, ...], meta) of the latest checkpoint (or iteration `step`),
    whatever its layout: the files of all pipeline stages of a TP rank go into one dict (their
    names are global); with `optimizer`, the distributed optimizer's pieces too, joined per
    parameter."""
    _, meta = load_checkpoint(root, first_shard(root, step), stems=(), step=step)
    layout = meta["layout"]
    ep = layout.get("ep", 1)
    stems = [WEIGHTS]
    if optimizer and layout["distributed_optimizer"]:
        stems += [f"distrib_optim_{rank:03d}" for rank in range(layout["dp"] * layout["cp"] // ep)]
    shards = []
    for tp_rank in range(layout["tp"]):
        tensors = {}                 # every stage's and EP rank's: a dense piece may be in any
        for pp_rank in range(layout["pp"]):
            for ep_rank in range(ep):
                shard = shard_name(tp_rank, pp_rank, layout["pp"], ep_rank, ep)
                tensors.update(load_checkpoint(root, shard, stems=stems, step=step)[0])
        shards.append(_join_pieces(tensors))
    return shards, meta


# ----------------------------------------------------------------------------- training state
def named_state(cell):
    """(name, Parameter) of all a checkpoint holds of `cell`: its parameters, then the routers'
    expert biases (moe.expert_biases, Megatron's buffers: no optimizer state)."""
    return list(cell.parameters_and_names()) + moe.expert_biases(cell)


def named_parameters(chunks):
    """("model.<global name>", parameter or buffer) of this rank's model chunks (named_state).
    Global names tell the chunks of a virtual pipeline apart (their layer numbers differ)."""
    return [(f"model.{global_name(chunk, n)}", param) for chunk in chunks
            for n, param in named_state(chunk)]


def model_tensors(chunks):
    """name -> value of this rank's parameters and buffers, under their global names."""
    return {name: param.asnumpy() for name, param in named_parameters(chunks)}


def parameter_names(chunks):
    """The global names of this rank's parameters, in optimizer order."""
    return [global_name(chunk, n) for chunk in chunks for n, _ in chunk.parameters_and_names()]


def layout_of(cfg):
    """What a checkpoint's file names and contents depend on."""
    parallel_cfg, training_cfg = cfg.parallel_config, cfg.training_config
    # the distributed optimizer shards over the dp x cp ranks; over one it is the plain one
    shards = parallel_cfg.data_parallel_size * parallel_cfg.context_parallel_size
    return {"tp": parallel_cfg.tensor_model_parallel_size,
            "ep": parallel_cfg.expert_model_parallel_size,
            "pp": parallel_cfg.pipeline_model_parallel_size,
            "vpp": parallel_cfg.virtual_pipeline_model_parallel_size,
            "num_layer_list": parallel_cfg.num_layer_list,
            "cp": parallel_cfg.context_parallel_size, "dp": parallel_cfg.data_parallel_size,
            "distributed_optimizer": bool(training_cfg.use_distributed_optimizer and shards > 1),
            "bucket_size": training_cfg.bucket_size,
            # Megatron-FSDP's ZeRO-2/3 cut the buffer by units, not bucket_size
            "fsdp_units": bool(shards > 1 and any(sharded_by_fsdp(training_cfg)))}


def _meta(cfg, iteration, consumed, step, scheduler_state, scaler_state, rng_state):
    """A checkpoint's meta.json: where training stands, the layout and the config."""
    return {"iteration": iteration, "consumed_train_samples": consumed, "optimizer_step": step,
            "opt_param_scheduler": scheduler_state, "grad_scaler": scaler_state,
            "rng_state": rng_state, "ckpt_format": cfg.training_config.ckpt_format,
            "layout": layout_of(cfg), "config": to_dict(cfg)}


# ----------------------------------------------------------------------------- optimizer state
def optimizer_state(optimizer, names):
    """(arrays, step): the state of an optimizer.py optimizer keyed by its parameters' `names`
    (one per parameter), as a checkpoint stores it: the inner optimizer's
    "optimizer.<state>.<name>" and the float32 main params that are copies "main.<name>"; a
    distributed optimizer's of this rank's pieces "<name>@<first element>"."""
    return over_chain(optimizer, names, _state_of)


def _state_of(optimizer, names):
    names, copies = _main_copies(optimizer, names)
    arrays = {f"optimizer.{kind}.{name}": t.asnumpy()
              for kind, tensors in optimizer.inner.state.items()
              for name, t in zip(names, tensors)}
    arrays.update({f"main.{name}": main.asnumpy() for name, main in copies})
    return arrays, optimizer.inner.step_count


def load_optimizer_state(optimizer, arrays, step, names):
    """The inverse of optimizer_state."""
    over_chain(optimizer, names, lambda part, some: _load_state_of(part, arrays, step, some))


def _load_state_of(optimizer, arrays, step, names):
    names, copies = _main_copies(optimizer, names)
    for name, main in copies:
        main.copy_(Tensor(arrays[f"main.{name}"]))
    inner = optimizer.inner
    inner.load_state_dict({"step": step, **{f"{kind}.{i}": arrays[f"optimizer.{kind}.{name}"]
                                           for kind in inner.state
                                           for i, name in enumerate(names)}})
    return {}, step


def _main_copies(optimizer, names):
    """(the names the inner optimizer's tensors go by, [(name, float32 main param that is a
    copy)]): per parameter, or a distributed optimizer's per piece (all of them copies)."""
    if isinstance(optimizer, opt.DistributedOptimizer):
        pieces = piece_names(optimizer.buffer, optimizer.buffer.rank, names)
        return pieces, list(zip(pieces, optimizer.main_params))
    return names, [(name, main) for name, param, main
                   in zip(names, optimizer.params, optimizer.main_params) if main is not param]


def piece_names(buffer, rank, names):
    """One name per piece of `rank`'s shard of `buffer` (a distributed.BucketLayout; `names`:
    one per parameter), "<name>@<first element>": what a distributed optimizer updates, so that
    the pieces of every rank of the group together cover each parameter and join back."""
    return [f"{names[piece.param]}@{piece.start - buffer.offsets[piece.param]}"
            for piece in buffer.pieces(rank)]


def gathered_optimizer_state(optimizer, names):
    """(arrays, step): a distributed optimizer's float32 main params "main.<name>" and inner state
    "optimizer.<state>.<name>" of every rank of its group, each gathered whole and shaped like
    its parameter, on every rank: Megatron's fully reshardable form (distrib_optimizer.py
    get_parameter_state_dp_zero), one all-gather per state and bucket."""
    return over_chain(optimizer, names, _gathered_state_of)


def _gathered_state_of(optimizer, names):
    kinds = {"main": optimizer.main_params,
             **{f"optimizer.{kind}": pieces for kind, pieces in optimizer.inner.state.items()}}
    arrays = {}
    for prefix, pieces in kinds.items():
        whole = unflattened(optimizer.buffer, ops.cat([
            optimizer.gathered_bucket(b, pieces, F32) for b in range(len(optimizer.shards))]))
        arrays.update({f"{prefix}.{name}": t.asnumpy() for name, t in zip(names, whole)})
    return arrays, optimizer.inner.step_count


def unflattened(buffer, flat):
    """A distributed.BucketLayout's flat [numel] -> new tensors shaped like its parameters. A
    slice is a view of the whole buffer in MindSpore, which in-place kernels (copy_) refuse once
    reshaped: copied."""
    return [flat[o:o + n].reshape(s).copy()
            for o, n, s in zip(buffer.offsets, buffer.sizes, buffer.shapes)]


def over_chain(optimizer, names, one):
    """one(optimizer, names) -> (arrays, step) of `optimizer`, or of each optimizer of a
    ChainedOptimizer with the names of its own parameters (its `indices`: the dense ones, then
    the experts'), joined."""
    if not isinstance(optimizer, opt.ChainedOptimizer):
        return one(optimizer, names)
    arrays, step = {}, None
    for part, some in zip(optimizer.optimizers, optimizer.split(names)):
        got, step = one(part, some)
        arrays.update(got)
    return arrays, step


def save_training_state(cfg, iteration, consumed, trainer, rng):
    """Megatron layout: mp_rank_TT[_PPP][_EEE]/ per TP rank, stage and EP rank, written by its
    first DP x CP rank (its first expert-data-parallel rank); with the distributed optimizer
    every rank adds its own distrib_optim_DDD file (DDD its expert-data-parallel rank, which is
    its DP x CP rank without EP). With the torch format the weights file is Megatron's
    model_optim_rng.pt (megatron_checkpoint.rank_file)."""
    training_cfg, state = cfg.training_config, trainer.state
    if training_cfg.ckpt_format == "torch_dist":
        return _save_dist(cfg, iteration, consumed, trainer, rng)
    opt_tensors, step = optimizer_state(trainer.optimizer, parameter_names(trainer.chunks))
    writer = state.edp_rank == 0
    files, meta = {}, None
    if writer:
        meta = _meta(cfg, iteration, consumed, step, trainer.scheduler.state_dict(),
                     trainer.scaler.state_dict(), rng.state_dict())
        # the optimizer state, unless the distributed optimizer's own files hold it
        files[WEIGHTS] = {**model_tensors(trainer.chunks),
                          **({} if trainer.ddp.reduce_scatter else opt_tensors)}
        if training_cfg.ckpt_format == "torch":
            offsets = [chunk.layer_offset for chunk in trainer.chunks]
            files[WEIGHTS] = megatron_checkpoint.rank_file(cfg, meta, files[WEIGHTS], offsets,
                                                           state.ep_rank)
    if trainer.ddp.reduce_scatter:
        files[f"distrib_optim_{state.edp_rank:03d}"] = opt_tensors
    shard = shard_name(state.tp_rank, state.pp_rank, state.pp, state.ep_rank, state.ep)
    path = save_checkpoint(training_cfg.output_dir, iteration, {shard: (files, meta)},
                           training_cfg.ckpt_format, training_cfg.keep_checkpoint_max,
                           barrier=parallel.barrier, leader=state.rank == 0)
    log.info(f"saved checkpoint at iteration {iteration} to {path}")


def _save_dist(cfg, iteration, consumed, trainer, rng):
    """save_training_state in torch_dist: each first expert-data-parallel rank writes the unique
    pieces of its TP rank and stage (__<rank>_0.distcp), rank 0 the index and common.pt. The
    optimizer state is per parameter, as Megatron's non-distributed optimizer keeps it: the
    distributed optimizer's pieces gathered whole (Megatron's fully reshardable form), its
    float32 main params kept only beside half-precision weights (of float32 ones they are the
    weights)."""
    training_cfg, state = cfg.training_config, trainer.state
    names = parameter_names(trainer.chunks)
    if trainer.ddp.reduce_scatter:
        opt_tensors, step = gathered_optimizer_state(trainer.optimizer, names)
        if cfg.model_config.params_dtype == "float32":
            opt_tensors = {k: v for k, v in opt_tensors.items() if not k.startswith("main.")}
    else:
        opt_tensors, step = optimizer_state(trainer.optimizer, names)
    meta = _meta(cfg, iteration, consumed, step, trainer.scheduler.state_dict(),
                 trainer.scaler.state_dict(), rng.state_dict())
    shards = {}
    if state.edp_rank == 0:
        values = {**model_tensors(trainer.chunks), **opt_tensors}
        pieces = _dist_pieces(trainer.chunks, state.tp_rank, state.tp, values,
                              cfg.model_config.params_dtype, state.ep_rank)
        items = dist_checkpoint.rank_items(pieces, cfg.model_config.num_layers,
                                           cfg.model_config.num_moe_experts)
        # each (stage, TP rank)'s dropout streams, as Megatron's ShardedObject rng_state
        items.append((dist_checkpoint.rng_key(state.pp_rank, state.tp_rank, state.pp, state.tp),
                      None, None, rng.state_dict()))
        shards[""] = ({f"__{state.rank}_0": items}, None)
    path = save_checkpoint(training_cfg.output_dir, iteration, shards, "torch_dist",
                           training_cfg.keep_checkpoint_max, barrier=parallel.barrier,
                           leader=state.rank == 0,
                           finish=lambda tmp: dist_checkpoint.write_index(tmp, _dist_common(
                               cfg, meta)))
    log.info(f"saved checkpoint at iteration {iteration} to {path}")


def _dist_common(cfg, meta):
    """torch_dist's common.pt: Megatron's args, version, iteration and schedule, and this
    project's meta (layout, config, optimizer step, loss scaler, RNG streams) as JSON text."""
    args = megatron_checkpoint.megatron_args(cfg, meta["iteration"],
                                             meta["consumed_train_samples"])
    args.ckpt_format = "torch_dist"
    return {"args": args, "checkpoint_version": dist_checkpoint.CHECKPOINT_VERSION,
            "iteration": meta["iteration"], "opt_param_scheduler": meta["opt_param_scheduler"],
            dist_checkpoint.META: json.dumps(meta), "num_floating_point_operations_so_far": 0}


# this project's prefix -> the sharded key's (Megatron's optimizer sharded_state_dict)
DIST_PREFIX = {"model": "", "main": dist_checkpoint.OPTIMIZER + dist_checkpoint.MAIN + "."}


def _dist_pieces(chunks, tp_rank, tp, values, params_dtype, ep_rank=0):
    """[(key prefix, global name, offsets, one-process shape, block)] of the parameters of
    `chunks` this rank holds a unique part of (replicated ones on TP rank 0 alone, dense ones on
    EP rank 0 alone; the tied output layer's copy left out), for each of `values`' "model.",
    "main.", "optimizer.<kind>." entries: a TP piece at its place in the one-process tensor,
    SwiGLU's [gate; up] halves each at its own."""
    kinds = sorted({k.split(".")[1] for k in values if k.startswith("optimizer.")})
    prefixes = {**DIST_PREFIX, **{f"optimizer.{kind}": f"{dist_checkpoint.OPTIMIZER}{kind}."
                                  for kind in kinds}}
    out = []
    for chunk in chunks:
        for n, param in named_state(chunk):
            dim, name = getattr(param, "partition_dim", None), global_name(chunk, n)
            if is_embedding_copy(param) or (dim is None and tp_rank) or \
                    (ep_rank and not moe.is_expert(name)):
                continue
            blocks = getattr(param, "partition_chunks", 1) if dim is not None else 1
            shape = list(param.shape)
            if dim is not None:
                shape[dim] *= tp
            for prefix, key_prefix in prefixes.items():
                value = values.get(f"{prefix}.{name}")
                if value is None:                # float32 weights keep no separate main params
                    continue
                if prefix == "model" and params_dtype == "bfloat16":
                    value = torch_format.BFloat16.from_float32(value.astype(np.float32))
                out += _blocks(key_prefix, name, value, shape, dim, blocks, tp_rank)
    return out


def _blocks(prefix, name, value, shape, dim, blocks, tp_rank):
    """The pieces of one rank's `value` of a parameter split on `dim` in `blocks` (or whole)."""
    if dim is None:
        return [(prefix, name, [0] * len(shape), shape, value)]
    bf16 = isinstance(value, torch_format.BFloat16)
    array = value.bits if bf16 else value
    step = array.shape[dim] // blocks
    out = []
    for b in range(blocks):
        offsets = [0] * len(shape)
        offsets[dim] = b * shape[dim] // blocks + tp_rank * step
        block = np.ascontiguousarray(np.take(array, range(b * step, (b + 1) * step), axis=dim))
        out.append((prefix, name, offsets, shape, torch_format.BFloat16(block) if bf16 else block))
    return out


def load_training_state(cfg, trainer, rng):
    """Restore from training_config.load_checkpoint; returns (iteration, consumed). A checkpoint
    of another layout (TP, PP, VPP, CP, DP, EP, the distributed optimizer; this project's
    formats and torch_dist) is converted on load, as `convert` would write it for this run."""
    training_cfg, state = cfg.training_config, trainer.state
    root, step = training_cfg.load_checkpoint, training_cfg.ckpt_step
    if dist_checkpoint.is_dist(iteration_dir(root, load_iteration(root, step))):
        return _load_dist_training_state(cfg, trainer, rng)
    _, meta = load_checkpoint(root, first_shard(root, step), stems=(), step=step)
    # --finetune, or imported weights (no optimizer step saved)
    weights_only = training_cfg.finetune or meta.get("optimizer_step") is None
    layout = layout_of(cfg)
    # checkpoints written before expert parallelism have no "ep"
    saved_layout = meta.get("layout") and {"ep": 1, **meta["layout"]}
    if saved_layout:                            # nor before Megatron-FSDP: buckets by size
        saved_layout.setdefault("fsdp_units", False)
    same_model_split = saved_layout and all(saved_layout.get(k) == layout[k]
                                            for k in ("tp", "ep", "pp", "vpp", "num_layer_list"))
    # Without the distributed optimizer's shards every DP and CP rank holds the same state (as
    # in Megatron)
    unsharded = same_model_split and not (saved_layout["distributed_optimizer"]
                                          or layout["distributed_optimizer"])
    if saved_layout != layout and not ((weights_only or unsharded) and same_model_split):
        full, meta = full_state(root, optimizer=not weights_only, step=step)
        log.info(f"checkpoint {root} converted on load from layout {saved_layout} to this run's "
                 f"layout {layout}")
        return _load_cut(cfg, trainer, rng, full, meta)
    shard = shard_name(state.tp_rank, state.pp_rank, state.pp, state.ep_rank, state.ep)
    stems = [WEIGHTS]
    if trainer.ddp.reduce_scatter and not (training_cfg.finetune or training_cfg.no_load_optim):
        stems.append(f"distrib_optim_{state.edp_rank:03d}")
    tensors, meta = load_checkpoint(root, shard, stems=stems, step=step)
    return _restore(cfg, trainer, rng, tensors, meta, weights_only)


def _restore(cfg, trainer, rng, tensors, meta, weights_only):
    """This rank's weights, optimizer state (`tensors`, global names), schedule, loss scale and
    RNG streams (`meta`) put in place; returns (iteration, consumed)."""
    training_cfg, chunks = cfg.training_config, trainer.chunks
    for name, param in named_parameters(chunks):
        saved = tensors.get(name)
        if saved is None or saved.shape != tuple(param.shape):
            got = "missing" if saved is None else f"shape {saved.shape}"
            raise CheckpointError(
                f"checkpoint {training_cfg.load_checkpoint} does not fit the model: {name} is "
                f"{got}, the model wants {tuple(param.shape)}; use the model_config it was saved "
                "with")
    for name, param in named_parameters(chunks):
        param.set_data(Tensor(tensors[name], param.dtype))      # in the parameter's own dtype
    trainer.optimizer.reload_main_params()
    if weights_only:
        why = ("finetune" if training_cfg.finetune else "--no-load-optim"
               if training_cfg.no_load_optim else "no optimizer state saved")
        log.info(f"loaded weights of iteration {meta['iteration']} from "
                 f"{training_cfg.load_checkpoint} ({why}: iteration 0)")
        return 0, 0
    if not training_cfg.no_load_optim:
        load_optimizer_state(trainer.optimizer, tensors, meta["optimizer_step"],
                             parameter_names(chunks))
        _load_scheduler(cfg.optimizer_config, trainer.scheduler, meta["opt_param_scheduler"],
                        meta["iteration"])
        if meta["grad_scaler"] is not None:     # Megatron-LM's own folder: this run's scale
            trainer.scaler.load_state_dict(meta["grad_scaler"])
    if not training_cfg.no_load_rng and meta["rng_state"] is not None:
        rng.load_state_dict(meta["rng_state"])
    log.info(f"loaded checkpoint of iteration {meta['iteration']} from "
             f"{training_cfg.load_checkpoint}")
    return meta["iteration"], meta["consumed_train_samples"]


def _load_dist_training_state(cfg, trainer, rng):
    """load_training_state of a torch_dist checkpoint, whatever layout saved it (_load_cut), each
    (stage, TP rank) its own dropout streams where the folder holds them; Megatron-LM's own loads
    its weights, and its optimizer's moments and step where it holds them."""
    training_cfg, state = cfg.training_config, trainer.state
    root, step = training_cfg.load_checkpoint, training_cfg.ckpt_step
    folder = iteration_dir(root, load_iteration(root, step))
    full, meta = dist_state(root, step, optimizer=not (training_cfg.finetune
                                                     or training_cfg.no_load_optim))
    if meta.get("layout"):          # this project's streams (Megatron-LM's are of torch)
        own = dist_checkpoint.read_object(folder, dist_checkpoint.rng_key(
            state.pp_rank, state.tp_rank, state.pp, state.tp))
        meta = dict(meta, rng_state=own or meta["rng_state"])   # another layout: rank 0's
    saved = f"layout {meta['layout']}" if meta.get("layout") else "Megatron-LM"
    log.info(f"torch_dist checkpoint {root} (saved by {saved}) cut for this run's layout "
             f"{layout_of(cfg)}")
    return _load_cut(cfg, trainer, rng, full, meta)


def _load_cut(cfg, trainer, rng, full, meta):
    """Restore from the one-process tensors `full` (full_state's): this rank's TP piece, stage
    and experts cut from them, and the distributed optimizer's pieces, as write_layout cuts them
    for `convert`."""
    training_cfg, state = cfg.training_config, trainer.state
    weights_only = training_cfg.finetune or meta.get("optimizer_step") is None
    optim = not (weights_only or training_cfg.no_load_optim)
    kinds = sorted({k.split(".")[1] for k in full if k.startswith("optimizer.")}) if optim else []
    for key in [k for k in full if k.startswith("model.") and optim]:
        full.setdefault("main." + key[len("model."):], full[key].astype(np.float32))
    prefixes = ["model"] + (["main"] + [f"optimizer.{k}" for k in kinds] if optim else [])
    names, _, tensors = _rank_values(full, trainer.chunks, state.tp_rank, state.tp, prefixes)
    if optim:
        tensors.update(_optimizer_pieces(trainer.optimizer, names, tensors, prefixes[1:]))
    return _restore(cfg, trainer, rng, tensors, meta, weights_only)


def _optimizer_pieces(optimizer, names, values, prefixes):
    """The distributed optimizer's "<prefix>.<name>@<start>" pieces of this rank (of each
    optimizer of a chain that is one) from the rank's whole "<prefix>.<name>" `values`."""
    def pieces_of(part, some):
        if not isinstance(part, opt.DistributedOptimizer):
            return {}, None
        out = {}
        for piece, key in zip(part.pieces, piece_names(part.buffer, part.buffer.rank, some)):
            start = piece.start - part.buffer.offsets[piece.param]
            for prefix in prefixes:
                flat = values[f"{prefix}.{some[piece.param]}"].reshape(-1)
                out[f"{prefix}.{key}"] = flat[start:start + piece.end - piece.start]
        return out, None
    return over_chain(optimizer, names, pieces_of)[0]


def _load_scheduler(optimizer_cfg, scheduler, saved, iteration):
    """Megatron's rules when the run's lr schedule differs from the checkpoint's: override -> this
    run's, use_checkpoint -> the checkpoint's (named in a warning), neither -> refused. Without
    a saved schedule (Megatron-LM's own folder: its schedule counts samples) this run's, at the
    checkpoint's `iteration`."""
    if saved is None:
        scheduler.num_steps = iteration
        log.info(f"learning-rate schedule: this run's, at iteration {iteration} (the checkpoint "
                 "holds none of this project's)")
        return
    override, differ = optimizer_cfg.override_opt_param_scheduler, scheduler.differences(saved)
    if differ and not (override or optimizer_cfg.use_checkpoint_opt_param_scheduler):
        raise CheckpointError("the learning-rate schedule differs from the checkpoint's: "
                              + _pairs(differ) + "; give --use-checkpoint-opt_param-scheduler "
                              "or --override-opt_param-scheduler")
    scheduler.load_state_dict(saved, override)
    if differ:
        kept = "this run" if override else "the checkpoint"
        hint = "" if override else "; --override-opt_param-scheduler takes this run's"
        log.warning(f"learning-rate schedule: {kept}'s values kept: " + _pairs(differ) + hint)


def _pairs(differ):
    """The differing schedule values, each as "key (checkpoint a, this run b)"."""
    def shown(value):                  # a warmup from a fraction: 0.6, not 0.6000000000000001
        return f"{value:g}" if isinstance(value, float) else value
    return ", ".join(f"{k} (checkpoint {shown(a)}, this run {shown(b)})" for k, a, b in differ)


# ----------------------------------------------------------------------------- layout conversion
def build_rank_chunks(model_cfg, tp, pp, tp_rank=0, pp_rank=0, vpp=1, num_layer_list=None,
                      ep=1, ep_rank=0):
    """The model chunks (pipeline.build_chunks) of one rank of a tp x ep x pp layout, built in
    this process: construction needs the sizes and ranks, not the process groups. Values are
    not initialised. With tp = pp = ep = 1, the one-process model."""
    previous = parallel.use_state(parallel.ParallelState(
        world_size=tp * pp * ep, rank=model_rank(tp, pp, ep, tp_rank, pp_rank, ep_rank), tp=tp,
        cp=1, dp=ep, pp=pp, tp_rank=tp_rank, cp_rank=0, dp_rank=ep_rank, pp_rank=pp_rank,
        tp_group="", cp_group="", dp_group="", pp_group="", dp_cp_group="", mp_group="", ep=ep,
        ep_rank=ep_rank, sequence_parallel=tp > 1))     # shapes do not depend on SP; MoE needs it
    try:
        return build_chunks(model_provider, model_cfg, pp, pp_rank, vpp, num_layer_list)
    finally:
        parallel.use_state(previous)


def model_rank(tp, pp, ep, tp_rank, pp_rank, ep_rank):
    """The global rank of TP rank `tp_rank`, EP rank `ep_rank`, stage `pp_rank` in the
    tp x ep x pp layout (DP = EP) of build_rank_chunks (parallel.rank_grid)."""
    return int(parallel.rank_grid(tp * pp * ep, tp, 1, pp)[pp_rank, ep_rank, 0, tp_rank])


def full_state(root, optimizer=True, step=None):
    """(tensors, meta) of the latest checkpoint in `root` (or iteration `step`) as one process
    would hold them: weights "model.<name>" and, with `optimizer` and if saved, moments
    "optimizer.<kind>.<name>" and float32 main params "main.<name>", full size, whatever layout
    wrote them (TP shards merged, stages united, distributed-optimizer pieces joined)."""
    if dist_checkpoint.is_dist(iteration_dir(root, load_iteration(root, step))):
        return dist_state(root, step, optimizer=optimizer)
    shards, meta = load_shards(root, optimizer, step)
    model_cfg = to_namespace(meta["config"]).model_config
    [one] = build_rank_chunks(model_cfg, 1, 1)            # one process: its names and full shapes
    kinds = set()
    if optimizer:
        kinds = {k.split(".")[1] for k in shards[0] if k.startswith("optimizer.")}
    prefixes = ["model"] + [f"optimizer.{kind}" for kind in kinds]
    if optimizer and any(k.startswith("main.") for k in shards[0]):
        # float32 main params, kept beside half-precision weights
        prefixes.append("main")
    full_shapes = {f"model.{name}": tuple(bias.shape) for name, bias in moe.expert_biases(one)}
    for name, param in one.parameters_and_names():
        full_shapes.update({f"{prefix}.{name}": tuple(param.shape) for prefix in prefixes})
    return megatron_checkpoint.merge_tensor_parallel(
        shards, full_shapes, lambda name: megatron_checkpoint.tp_chunks(model_cfg, name)), meta


def _join_pieces(tensors):
    """Distributed-optimizer pieces "<prefix>.<name>@<start>" (flat) -> "<prefix>.<name>" shaped
    like the weight "model.<name>" beside them (prefix "main" or "optimizer.<kind>")."""
    pieces = {}
    for key, value in tensors.items():
        if "@" in key:
            base, start = key.rsplit("@", 1)
            pieces.setdefault(base, []).append((int(start), value))
    out = {k: v for k, v in tensors.items() if "@" not in k}
    for base, parts in pieces.items():
        name = base.split(".", 1)[1] if base.startswith("main.") else base.split(".", 2)[2]
        shape = tensors[f"model.{name}"].shape
        flat = np.concatenate([v for _, v in sorted(parts, key=lambda item: item[0])])
        size = int(np.prod(shape))
        if flat.size != size:
            raise CheckpointError(f"distributed optimizer pieces of {name} cover {flat.size} of "
                                  f"{size} elements: a distrib_optim file is missing")
        out[base] = flat.reshape(shape)
    return out


def _rank_values(tensors, chunks, tp_rank, tp, prefixes):
    """(names, params, values) of one rank's model chunks: the global name of each parameter, the
    parameter, and for each of `prefixes` ("model", "main", "optimizer.<kind>") its value from the
    one-process `tensors`, this TP rank's shard of it (a tied output layer copies the embedding)."""
    names, params, values = [], [], {}
    for chunk in chunks:
        for n, _ in moe.expert_biases(chunk):    # no optimizer state; a missing one: _restore
            key = f"model.{global_name(chunk, n)}"
            if key in tensors:
                values[key] = tensors[key]
        for n, param in chunk.parameters_and_names():
            name = global_name(chunk, n)
            source = "word_embeddings.weight" if is_embedding_copy(param) else name
            for prefix in prefixes:
                value = tensors[f"{prefix}.{source}"]
                dim = getattr(param, "partition_dim", None)
                if dim is not None:
                    blocks = getattr(param, "partition_chunks", 1)
                    value = parallel.shard(value, dim, tp_rank, tp, blocks)
                values[f"{prefix}.{name}"] = value
            names.append(name)
            params.append(param)
    return names, params, values


def _distrib_optim_files(values, names, params, dp_cp, bucket_size, kinds, ep=1, ep_rank=0,
                         units_of=None):
    """{distrib_optim_DDD: the pieces of the float32 main params and the state that the rank of
    expert-data-parallel rank DDD in EP rank `ep_rank` holds}: of the dense parameters its DP x
    CP rank's (ep_rank + ep * DDD) shard over the `dp_cp` DP x CP ranks, of the experts its shard
    over the dp_cp / ep ranks that hold them (distributed.build_data_parallel's two buffers),
    cut by bucket_size or, with `units_of(positions)`, Megatron-FSDP's units."""
    expert = [moe.is_expert(name) for name in names]
    groups = [([i for i, e in enumerate(expert) if not e], dp_cp, lambda d: ep_rank + ep * d),
              ([i for i, e in enumerate(expert) if e], dp_cp // ep, lambda d: d)]
    files = {}
    for edp_rank in range(dp_cp // ep):
        pieces = {}
        for positions, size, shard_of in groups:
            some = [names[i] for i in positions]
            buffer = BucketLayout([params[i] for i in positions], size, bucket_size,
                                  units=units_of and units_of(positions))
            rank = shard_of(edp_rank)
            for piece, key in zip(buffer.pieces(rank), piece_names(buffer, rank, some)):
                offset = buffer.offsets[piece.param]
                for prefix in ["main"] + [f"optimizer.{kind}" for kind in kinds]:
                    flat = values[f"{prefix}.{some[piece.param]}"].reshape(-1)
                    pieces[f"{prefix}.{key}"] = flat[piece.start - offset:piece.end - offset]
        files[f"distrib_optim_{edp_rank:03d}"] = pieces
    return files


def each_rank_chunks(parallel_cfg, model_cfg):
    """(tp_rank, pp_rank, ep_rank, that model-parallel rank's chunks) for every rank of the
    layout's TP x PP x EP grid."""
    tp, pp = parallel_cfg.tensor_model_parallel_size, parallel_cfg.pipeline_model_parallel_size
    ep = parallel_cfg.expert_model_parallel_size
    for tp_rank, pp_rank, ep_rank in itertools.product(range(tp), range(pp), range(ep)):
        yield tp_rank, pp_rank, ep_rank, build_rank_chunks(
            model_cfg, tp, pp, tp_rank, pp_rank, parallel_cfg.virtual_pipeline_model_parallel_size,
            parallel_cfg.num_layer_list, ep, ep_rank)


def with_main_copies(tensors, model_cfg):
    """`tensors` (one-process, "model.<name>" ...) with a float32 "main.<name>" beside every
    weight that has none, the weights in the run's params_dtype (numpy has no bfloat16: kept as
    saved)."""
    tensors = dict(tensors)
    for key in [k for k in tensors if k.startswith("model.")]:
        tensors.setdefault("main." + key[len("model."):], tensors[key].astype(np.float32))
        if model_cfg.params_dtype in ("float32", "float16"):
            tensors[key] = tensors[key].astype(model_cfg.params_dtype)
    return tensors


def write_layout(root, tensors, meta, cfg):
    """Write `tensors` (one-process, from full_state) as checkpoint meta["iteration"] of `root`
    in cfg's layout: every (TP, stage, EP) folder, and with the distributed optimizer one
    distrib_optim_DDD file per rank holding that rank's pieces, as training would. Weights are
    stored in the run's params_dtype; float32 main params ("main.<name>", the weights themselves
    when `tensors` has none) where the optimizer keeps copies: half-precision parameters, or
    the distributed optimizer's pieces."""
    if cfg.training_config.ckpt_format == "torch_dist":
        return _write_dist_layout(root, tensors, meta, cfg)
    parallel_cfg, model_cfg = cfg.parallel_config, cfg.model_config
    tp, pp = parallel_cfg.tensor_model_parallel_size, parallel_cfg.pipeline_model_parallel_size
    dp_cp = parallel_cfg.data_parallel_size * parallel_cfg.context_parallel_size
    layout = layout_of(cfg)
    distributed = layout["distributed_optimizer"]
    kinds = sorted({k.split(".")[1] for k in tensors if k.startswith("optimizer.")})
    tensors = with_main_copies(tensors, model_cfg)
    shards, ep = {}, parallel_cfg.expert_model_parallel_size
    for tp_rank, pp_rank, ep_rank, chunks in each_rank_chunks(parallel_cfg, model_cfg):
        prefixes = ["model", "main"] + [f"optimizer.{kind}" for kind in kinds]
        names, params, values = _rank_values(tensors, chunks, tp_rank, tp, prefixes)
        # half-precision parameters keep float32 copies in the optimizer (with its state)
        own_main = model_cfg.params_dtype != "float32" and not distributed and bool(kinds)
        # the weights file holds the optimizer's values unless the distributed optimizer's
        # files do
        files = {WEIGHTS: {k: v for k, v in values.items()
                           if k.startswith("model.")
                           or (not distributed and (k.startswith("optimizer.") or own_main))}}
        if cfg.training_config.ckpt_format == "torch":
            files[WEIGHTS] = megatron_checkpoint.rank_file(
                cfg, meta, files[WEIGHTS], [chunk.layer_offset for chunk in chunks], ep_rank)
        if distributed:
            units_of = None
            if layout["fsdp_units"]:
                units_of = functools.partial(fsdp_units, chunks, cfg.training_config, pp, params)
            files.update(_distrib_optim_files(values, names, params, dp_cp,
                                              layout["bucket_size"], kinds, ep, ep_rank,
                                              units_of))
        shard_meta = dict(meta, layout=layout, config=to_dict(cfg),
                          ckpt_format=cfg.training_config.ckpt_format)
        shards[shard_name(tp_rank, pp_rank, pp, ep_rank, ep)] = (files, shard_meta)
    return save_checkpoint(root, meta["iteration"], shards, cfg.training_config.ckpt_format)


def _write_dist_layout(root, tensors, meta, cfg):
    """write_layout in torch_dist: the one-process `tensors` cut as the first data-parallel rank
    of each TP rank and stage of cfg's layout would write them in training (one .distcp each;
    the folder loads into any layout), weights in the run's params_dtype, float32 main params
    beside half-precision ones."""
    parallel_cfg, model_cfg = cfg.parallel_config, cfg.model_config
    tp, pp = parallel_cfg.tensor_model_parallel_size, parallel_cfg.pipeline_model_parallel_size
    kinds = sorted({k.split(".")[1] for k in tensors if k.startswith("optimizer.")})
    prefixes = ["model"] + (["main"] if kinds and model_cfg.params_dtype != "float32" else []) \
        + [f"optimizer.{kind}" for kind in kinds]
    tensors = with_main_copies(tensors, model_cfg)
    files, ep = {}, parallel_cfg.expert_model_parallel_size
    for tp_rank, pp_rank, ep_rank, chunks in each_rank_chunks(parallel_cfg, model_cfg):
        values = _rank_values(tensors, chunks, tp_rank, tp, prefixes)[2]
        pieces = _dist_pieces(chunks, tp_rank, tp, values, model_cfg.params_dtype, ep_rank)
        rank = model_rank(tp, pp, ep, tp_rank, pp_rank, ep_rank)   # a writer of each piece
        files[f"__{rank}_0"] = dist_checkpoint.rank_items(pieces, model_cfg.num_layers,
                                                          model_cfg.num_moe_experts)
    meta = dict(meta, layout=layout_of(cfg), config=to_dict(cfg), ckpt_format="torch_dist")
    return save_checkpoint(root, meta["iteration"], {"": (files, None)}, "torch_dist",
                           finish=lambda tmp: dist_checkpoint.write_index(
                               tmp, _dist_common(cfg, meta)))


# ----------------------------------------------------------------------------- command line
CONVERT_FLAGS = {"--load": (REQUIRED, str, "checkpoint folder (any layout)"),
                 "--ckpt-step": (None, int, "the iteration to convert (default: the latest)"),
                 "--save": (REQUIRED, str, "new or empty folder"),
                 "--nproc": (1, int, "ranks of the new layout (its data-parallel size follows)")}


def check_new_folder(command, save, world):
    """A command that writes a new checkpoint: its --nproc is positive and --save is a new or
    empty folder (one error line naming the command otherwise)."""
    if world < 1:
        raise ConfigError(f"{command}: --nproc must be a positive number of ranks, got {world}")
    if os.path.exists(save) and not os.path.isdir(save):
        raise ConfigError(f"{command}: --save {save} is a file; give a new or empty folder")
    if os.path.exists(os.path.join(save, LATEST)):
        raise ConfigError(f"{command}: {save} already holds a checkpoint; give an empty or new "
                          "folder for --save")


def convert_main(argv):
    """convert --load DIR [--ckpt-step I] --save NEW [--nproc N] [layout flags]: the latest
    checkpoint of DIR (or iteration I), weights and optimizer state, rewritten for N ranks
    (default 1) in the layout the flags give (--tensor-model-parallel-size,
    --pipeline-model-parallel-size, --sequence-parallel, --virtual-pipeline-model-parallel-size,
    parallel_config.num_layer_list=..., --use-distributed-optimizer)."""
    options, argv = parse_command("convert", argv, CONVERT_FLAGS,
                                  passthrough="layout flags, as in training",
                                  about="Rewrite the latest checkpoint of --load for another "
                                        "layout.")
    load, save, world = options["load"], options["save"], options["nproc"]
    step = options["ckpt_step"]
    check_new_folder("convert", save, world)
    load_iteration(load, step)
    _, meta = load_checkpoint(load, first_shard(load, step), stems=(), step=step)
    padded = meta["config"]["model_config"]["padded_vocab_size"]
    cfg = from_saved(meta["config"], [f"model_config.vocab_size={padded}", *argv], world)
    cfg.training_config.output_dir = save
    cfg.model_config.padded_vocab_size = padded
    tensors, meta = full_state(load, step=step)
    path = write_layout(save, tensors, meta, cfg)
    print(f"converted {load} (iteration {meta['iteration']}, layout {meta['layout']}) to "
          f"{path}, layout {layout_of(cfg)}")


def first_shard(root, step=None):
    """The shard folder holding meta.json of the latest checkpoint (or iteration `step`):
    mp_rank_00 (TP only), mp_rank_00_000 (with pipeline stages or expert parallelism) or
    mp_rank_00_000_000 (both)."""
    folder = iteration_dir(root, load_iteration(root, step))
    for shard in (shard_name(0), shard_name(0, 0, 2), shard_name(0, 0, 2, 0, 2)):
        if os.path.isdir(os.path.join(folder, shard)):
            return shard
    return shard_name(0)


# ------------------------------------------------------------------- Megatron-LM's checkpoints in
def _megatron_config(overrides, argv=(), world=1):
    """This project's config (config.yaml) of a Megatron checkpoint's `overrides`, then `argv`,
    for `world` ranks, its padded vocabulary the checkpoint's."""
    cfg = load_config(PROJECT_CONFIG, list(overrides) + list(argv), world)
    cfg.model_config.padded_vocab_size = cfg.model_config.vocab_size
    return cfg


def _megatron_weights(files, model_cfg, first):
    """One-process float32 tensors of a Megatron checkpoint's rank files, shaped by this project's
    model of `model_cfg` (megatron_checkpoint.read_weights)."""
    [one] = build_rank_chunks(model_cfg, 1, 1)
    shapes = {f"model.{n}": tuple(param.shape) for n, param in named_state(one)}
    return megatron_checkpoint.read_weights(files, shapes, model_cfg, first)


def _dist_weights(folder, index, model_cfg):
    """One-process float32 tensors of the torch_dist checkpoint in `folder` (its .metadata
    `index`), checked against this project's model of `model_cfg`."""
    [one] = build_rank_chunks(model_cfg, 1, 1)
    shapes = {f"model.{n}": tuple(param.shape) for n, param in named_state(one)}
    values = dist_checkpoint.model_tensors(folder, index)
    if not model_cfg.untie_embeddings_and_output_weights:
        values.pop("model.output_layer.weight", None)
    megatron_checkpoint.check_shards([values], shapes, 1)
    return {k: v.astype(np.float32) for k, v in values.items()}


def dist_state(root, step=None, tensors=True, optimizer=True):
    """(tensors, meta) of the torch_dist checkpoint of `root` (iteration `step`, or the latest):
    one-process "model.<name>" weights (float32, or float16 as stored) and, with `optimizer`, the
    optimizer's "optimizer.<kind>.<name>" and "main.<name>" if the folder holds them; its meta
    (this project's, kept in common.pt, or one built from Megatron-LM's args)."""
    folder = iteration_dir(root, load_iteration(root, step))
    common = dist_checkpoint.read_common(folder)
    if dist_checkpoint.META in common:
        meta = json.loads(common[dist_checkpoint.META])
    else:
        meta = _megatron_meta(common, folder)
    index, _ = dist_checkpoint.read_index(folder)
    if dist_checkpoint.META not in common:
        meta["optimizer_step"] = dist_checkpoint.optimizer_step(folder, common, index)
    if not tensors:
        return {}, meta
    values = dist_checkpoint.model_tensors(folder, index)
    if optimizer:                      # the TP size that saved it: Megatron-LM's buckets
        tp = getattr(common["args"], "tensor_model_parallel_size", None) or 1
        values.update(dist_checkpoint.optimizer_tensors(folder, index, values, tp))
    if not meta["config"]["model_config"]["untie_embeddings_and_output_weights"]:
        values.pop("model.output_layer.weight", None)
    return values, meta


def _megatron_meta(common, folder):
    """A meta of this project's for Megatron-LM's torch_dist checkpoint: its model and
    tokenizer from the args, its iteration and consumed samples; no optimizer step (dist_state
    sets it where the folder holds optimizer state it reads), schedule, scale or streams."""
    args = common["args"]
    try:
        overrides = megatron_checkpoint.model_overrides(args)
    except ConfigError as e:
        raise ConfigError(f"{folder}/{dist_checkpoint.COMMON}: {e}") from None
    overrides += megatron_checkpoint.tokenizer_overrides(
        args, int(vars(args)["padded_vocab_size"]))[0]
    config = to_dict(_megatron_config(overrides))
    config["dataset_config"]["global_batch_size"] = vars(args).get("global_batch_size")
    return {"iteration": common.get("iteration", 0),
            "consumed_train_samples": int(vars(args).get("consumed_train_samples") or 0),
            "optimizer_step": None, "opt_param_scheduler": None, "grad_scaler": None,
            "rng_state": None, "ckpt_format": "torch_dist", "layout": None, "config": config}


def megatron_source(root):
    """(iteration, overrides, note, weights, what) of the latest Megatron-LM checkpoint in `root`,
    --ckpt-format torch or torch_dist: the model and tokenizer as section.key=value overrides
    (note: a tokenizer this project lacks), `weights(model_cfg)` its one-process float32 tensors
    {"model.<name>"} for this project's model of `model_cfg`, `what` its layout and dtype for
    the log. A model this project cannot hold is one ConfigError line naming the setting."""
    iteration, folder = megatron_checkpoint.checkpoint_folder(root)
    if dist_checkpoint.is_dist(folder):
        index, _ = dist_checkpoint.read_index(folder)
        common = dist_checkpoint.read_common(folder)
        args = common["args"]
        try:
            model = megatron_checkpoint.model_overrides(args)
        except ConfigError as e:
            raise ConfigError(f"{folder}/{dist_checkpoint.COMMON}: {e}") from None
        tokenizer, note = megatron_checkpoint.tokenizer_overrides(
            args, int(vars(args)["padded_vocab_size"]))
        dtypes = "/".join(sorted({dtype for dtype, _, _ in index.values()}))
        return (iteration, model + tokenizer, note,
                lambda model_cfg: _dist_weights(folder, index, model_cfg),
                f"torch_dist, {dtypes} weights")
    iteration, files, first = megatron_checkpoint.checkpoint_files(root)
    tp, pp, ep = megatron_checkpoint.folder_sizes(files)
    overrides, note = megatron_checkpoint.checkpoint_overrides(first, files[0, 0, 0], tp, pp, ep)
    return (iteration, overrides, note,
            lambda model_cfg: _megatron_weights(files, model_cfg, first),
            f"{tp} x {pp} x {ep} (EP) ranks, {megatron_checkpoint.weights_dtype(first)} weights")


def read_megatron(root):
    """(tensors, overrides, iteration) of the Megatron-LM checkpoint in `root` (either format; any
    TP and PP, virtual too; mcore or legacy names; float32, float16 or bfloat16 weights):
    one-process tensors {"model.<name>": float32}, the model and tokenizer as section.key=value
    overrides, the iteration."""
    iteration, overrides, _, weights, _ = megatron_source(root)
    return weights(_megatron_config(overrides).model_config), overrides, iteration


def _check_tokenizer(dataset_cfg, padded):
    """The tokenizer an import names builds and fits the model's vocabulary."""
    try:
        tokenizer = build_tokenizer(dataset_cfg.tokenizer_type, dataset_cfg.vocab_file,
                                    dataset_cfg.merge_file, dataset_cfg.vocab_size)
    except OSError as e:
        raise ConfigError(f"import-megatron: {dataset_cfg.tokenizer_type}: {e.filename} cannot "
                          f"be read ({e.strerror}): give --vocab-file and --merge-file") from None
    if tokenizer.vocab_size > padded:
        raise ConfigError(f"import-megatron: the tokenizer's {tokenizer.vocab_size} tokens do not "
                          f"fit the model's vocabulary of {padded}: give the tokenizer flags it "
                          "was trained with (--tokenizer-type, --vocab-file, --vocab-size)")


IMPORT_MEGATRON_FLAGS = {"--save": (REQUIRED, str, "new or empty folder"),
                         "--nproc": (1, int, "ranks of the checkpoint's layout")}


def import_megatron_main(argv):
    """import-megatron DIR --save OUT [--nproc N] [layout flags] [flags]: the latest Megatron-LM
    checkpoint (--ckpt-format torch or torch_dist) in DIR as a checkpoint of this project in
    any layout, its weights only (training starts its own optimizer), the model and tokenizer
    from its args."""
    options, argv = parse_command("import-megatron", argv, IMPORT_MEGATRON_FLAGS,
                                  positional=("DIR",), passthrough="layout and training flags",
                                  about="A Megatron-LM checkpoint (--ckpt-format torch or "
                                        "torch_dist) as a checkpoint.")
    root, save, world = options["dir"], options["save"], options["nproc"]
    check_new_folder("import-megatron", save, world)
    iteration, overrides, note, weights, what = megatron_source(root)
    cfg = _megatron_config(overrides, argv, world)
    model_cfg = cfg.model_config
    cfg.training_config.output_dir = save
    _check_tokenizer(cfg.dataset_config, model_cfg.padded_vocab_size)
    tensors = weights(model_cfg)
    meta = {"iteration": iteration, "consumed_train_samples": 0, "optimizer_step": None,
            "opt_param_scheduler": None, "grad_scaler": None, "rng_state": None,
            "imported_from": os.path.abspath(root)}
    path = write_layout(save, tensors, meta, cfg)
    if note:
        print(f"import-megatron: {note}")
    print(f"imported {root} (iteration {iteration}, {what}; {model_cfg.num_layers} layers, "
          f"hidden {model_cfg.hidden_size}) to {path} in {model_cfg.params_dtype}, layout "
          f"{layout_of(cfg)}")


if __name__ == "__main__":          # imported by train.py, not a script
    raise SystemExit("error: checkpoint.py is a library: run `bash run.sh convert ...`"
                     " (bash run.sh --help lists the commands)")
