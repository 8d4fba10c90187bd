"""Megatron-LM's torch_dist checkpoints (its default --ckpt-format) read and written with numpy.

Megatron-LM saves them through megatron.core.dist_checkpointing (strategies/torch.py) on
PyTorch Distributed Checkpoint (torch/distributed/checkpoint/filesystem.py, metadata.py):

    <save>/latest_checkpointed_iteration.txt
    <save>/iter_0000100/.metadata        pickle of Metadata: per key, TensorStorageMetadata (dtype,
                                         global size, chunks: offsets and sizes) or
                                         BytesStorageMetadata; storage_data: per (key, offsets),
                                         _StorageInfo(relative_path, offset, length)
    <save>/iter_0000100/__<rank>_<k>.distcp
                                         each piece a torch.save archive (torch_format.py) at its
                                         offset: a tensor chunk, or an object's bytes
    <save>/iter_0000100/common.pt        torch.save of what is not sharded: args, iteration, ...
    <save>/iter_0000100/metadata.json    {"sharded_backend": "torch_dist", ...}

The keys are Megatron-core's sharded names (GPTModel.sharded_state_dict): the layers stacked on
a leading layer axis, `decoder.layers.self_attention.linear_qkv.weight` of global shape
[num_layers, 3h, h] (transformer_block.py, sharded_offsets), the pipeline's layers at their
global numbers, TP pieces at their place in the one-process tensor (SwiGLU's fc1 as [gate; up],
mlp.py apply_swiglu_sharded_factory), the local norms under transformer_engine's fused names
(`linear_qkv.layer_norm_weight`; gpt_layer_specs.py's sharded_state_dict_keys_map), each linear's
`_extra_state/shard_<layer>_<num_layers>` an object. A key assembled from its chunks is the
one-process tensor, whatever layout saved it: what makes the format layout-free.
"""
import collections
import json
import math
import os
import re

import numpy as np

from formats import torch_format
from formats.megatron_checkpoint import TE_NORMS, CheckpointError, megatron_name, project_name

METADATA = ".metadata"
COMMON = "common.pt"
BACKEND = "metadata.json"
LAYERS = "decoder.layers."
EXPERTS = LAYERS + "mlp.experts.experts."
# the versions whose names this reader knows (metadata.json, .metadata, common.pt)
BACKEND_VERSION = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
DCP_VERSION = "1.0.0"
CHECKPOINT_VERSION = 3.0
# the local spec's norms saved under transformer_engine's fused names (gpt_layer_specs.py)
FUSED_NORMS = {v: k for k, v in TE_NORMS.items()}
OPTIMIZER = "optimizer.state."
# the float32 main params' kinds: Float16OptimizerWithFloat16Params' copies (fp32_param), the
# distributed optimizer's in its fully_reshardable form (param; distrib_optimizer.py
# sharded_param_state_fully_reshardable)
MAIN, DIST_MAIN = "fp32_param", "param"
# the distributed optimizer's dp_reshardable form, Megatron-LM's default: per bucket of its
# gradient buffer a flat key "optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<i>.dtype_<d>.
# bucket_idx_<b>.<kind>" (sharded_param_state_dp_reshardable), laid out by Megatron's bucketing;
# <g> is the rank in the model-parallel group (TP x PP) whose parameters the bucket holds
BUCKETS = "optimizer.distributed."
BUCKET = re.compile(r"optimizer\.distributed\.dp_group_idx_\d+\.gbuf_idx_.+\.\w+$")
META = "meta_json"                     # common.pt's entry of this project's meta.json text
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16,
          "float64": np.float64}


def is_dist(folder):
    """An iteration folder of a torch_dist checkpoint (its .metadata index is there)."""
    return os.path.isfile(os.path.join(folder, METADATA))


def _state(obj, field):
    """A field of a dataclass object the index pickles (a torch_format.Foreign's BUILD state)."""
    state = getattr(obj, "state", None)
    if not isinstance(state, dict) or field not in state:
        raise CheckpointError(f"its {METADATA} holds {obj!r:.80} without {field}: not the index "
                              "of PyTorch Distributed Checkpoint")
    return state[field]


def read_index(folder):
    """(tensors, objects) of the folder's .metadata: tensors {key: (dtype name, global shape,
    [(offsets, sizes, file, byte offset, length)])}, objects {key: (file, byte offset,
    length)}. The version and every piece's file are checked."""
    _check_backend(folder)
    path = os.path.join(folder, METADATA)
    try:
        with open(path, "rb") as f:
            metadata = torch_format.load_pickle(f.read(), path)
    except torch_format.TorchFormatError as e:
        raise CheckpointError(str(e)) from None
    try:
        tensors, objects = _parse_index(metadata, path)
    except (AttributeError, TypeError, IndexError, ValueError) as e:
        raise CheckpointError(f"{path} holds no index of PyTorch Distributed Checkpoint "
                              f"({type(e).__name__}: {e}): the file is damaged") from None
    _check_ranges(folder, tensors, objects)
    return tensors, objects


def _parse_index(metadata, path):
    """read_index's plain data of the unpickled Metadata object."""
    version = getattr(metadata, "state", None) and metadata.state.get("version", DCP_VERSION)
    if version != DCP_VERSION:
        raise CheckpointError(f"{path} is of PyTorch Distributed Checkpoint {version}, this reader "
                              f"knows {DCP_VERSION}: a checkpoint of a newer or older torch")
    where = {}
    for index, info in _state(metadata, "storage_data").items():
        offsets = getattr(index, "state", {}).get("offset")
        key = _state(index, "fqn"), offsets and tuple(offsets)
        where[key] = _stored(info, key, path)
    tensors, objects = {}, {}
    for key, entry in _state(metadata, "state_dict_metadata").items():
        if not isinstance(entry.state, dict) or "chunks" not in entry.state:
            objects[key] = _located(where, key, None, path)
            continue
        dtype = getattr(entry.state["properties"].state[0], "name", "?")
        pieces = [(_dims(_state(c, "offsets"), f"{key}'s offsets", path),
                   _dims(_state(c, "sizes"), f"{key}'s sizes", path))
                  for c in entry.state["chunks"]]
        tensors[key] = (dtype, _dims(entry.state["size"], f"{key}'s shape", path),
                        [(o, s, *_located(where, key, o, path)) for o, s in pieces])
    return tensors, objects


def _dims(values, what, path):
    """`values` (torch.Size, a tuple) as a tuple of at most MAX_DIMS non-negative ints, or one
    line naming `what`."""
    values = tuple(values)
    if len(values) > torch_format.MAX_DIMS or not all(type(v) is int and v >= 0 for v in values):
        raise CheckpointError(f"{path}: {what} are {values!r:.80}, not up to "
                              f"{torch_format.MAX_DIMS} whole numbers: the index is damaged")
    return values


def _stored(info, key, path):
    """(file, byte offset, length) of a _StorageInfo: a file of the folder itself, a range of
    whole numbers."""
    file, offset, length = (_state(info, k) for k in ("relative_path", "offset", "length"))
    if not (isinstance(file, str) and file == os.path.basename(file) and file not in ("", "..")
            and type(offset) is int and type(length) is int and min(offset, length) >= 0):
        raise CheckpointError(f"{path} stores {key[0]!r:.80} in {file!r:.80} at byte "
                              f"{offset!r:.20}, length {length!r:.20}: not a file of its folder "
                              "and a range of its bytes; the index is damaged")
    return file, offset, length


def _located(where, key, offsets, path):
    if (key, offsets) not in where:
        raise CheckpointError(f"{path} lists {key} at {offsets} but not where it is stored: the "
                              "index is damaged")
    return where[key, offsets]


def _check_ranges(folder, tensors, objects):
    """Each file of the folder holds the byte ranges the index places in it, and they take no
    more than its bytes together (no piece is read twice: what is built from the pieces is
    bounded by the files). A file missing is left for read_piece to name with what it holds."""
    ranges = collections.defaultdict(list)
    for key, (_, _, pieces) in tensors.items():
        for offsets, _, file, offset, length in pieces:
            ranges[file].append((offset, length, f"{key} at {offsets}"))
    for key, (file, offset, length) in objects.items():
        ranges[file].append((offset, length, key))
    for file, spans in ranges.items():
        path = os.path.join(folder, file)
        if not os.path.isfile(path):
            continue
        size = os.path.getsize(path)
        for offset, length, what in spans:
            if offset + length > size:
                raise CheckpointError(f"{path} holds {size} bytes, {what} ends at byte "
                                      f"{offset + length}: the file is truncated")
        total = sum(length for _, length, _ in spans)
        if total > size:
            raise CheckpointError(f"{path}: its {METADATA} places {len(spans)} pieces of {total} "
                                  f"bytes in its {size}: pieces overlap, the index is damaged")


def _check_backend(folder):
    """metadata.json names the torch_dist backend of the version this reader knows."""
    path = os.path.join(folder, BACKEND)
    try:
        with open(path) as f:
            backend = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read ({e}): not a complete torch_dist "
                              "checkpoint") from None
    got = {k: backend.get(k) for k in BACKEND_VERSION}
    if got != BACKEND_VERSION:
        raise CheckpointError(f"{path} says {got}, this reader knows {BACKEND_VERSION}: a "
                              "checkpoint of another Megatron format or version")


def read_piece(folder, file, offset, length, what):
    """The object torch.save wrote at [offset, offset + length) of `file` in `folder`."""
    path = os.path.join(folder, file)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: its {METADATA} names it for {what}")
    with open(path, "rb") as f:
        f.seek(offset)
        raw = f.read(length)
    try:
        return torch_format.loads(raw, f"{path} at byte {offset} ({what})")
    except torch_format.TorchFormatError as e:
        raise CheckpointError(str(e)) from None


def rng_key(pp_rank, tp_rank, pp, tp):
    """The unique key of a (stage, TP rank)'s RNG state (Megatron's ShardedObject rng_state of
    global shape (pp, tp), checkpointing.py; here this project's dropout streams)."""
    return f"rng_state/shard_{pp_rank}.{tp_rank}_{pp}.{tp}"


def read_object(folder, key):
    """The object saved under `key` in the torch_dist folder, or None if it holds none."""
    objects = read_index(folder)[1]
    return read_piece(folder, *objects[key], key) if key in objects else None


def covered_rows(folder, key, dtype, shape, pieces):
    """The indices along the first axis of `key` (global `shape`) that its pieces cover, sorted
    ([0] for a 0-d tensor), checked from the index alone, before anything is allocated: each
    piece inside the shape, its sizes and elements of `dtype` within the bytes of its piece;
    each index covered whole; every index, unless the key is stacked on layers (which may skip
    some: experts in every other layer, --moe-layer-freq)."""
    if dtype not in DTYPES:
        raise CheckpointError(f"{key} in {folder} is {dtype}, not a floating-point tensor")
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    total = sum(length for *_, length in pieces)
    # each covered index holds the dimensions past the first whole: none beyond its bytes
    if max(shape[1:], default=0) > total:
        raise CheckpointError(f"{key} in {folder} has the shape {shape}, larger than the {total} "
                              "bytes of its pieces: the index is damaged")
    covered = collections.Counter()
    for offsets, sizes, file, _, length in pieces:
        where = f"{folder}/{file}: {key} at {offsets} of sizes {sizes}"
        if not len(offsets) == len(sizes) == len(shape) or any(
                o + s > n for o, s, n in zip(offsets, sizes, shape)):
            raise CheckpointError(f"{where} lies outside its shape {shape}: the index is damaged")
        if max(math.prod(sizes) * itemsize, *sizes, 0) > length:
            raise CheckpointError(f"{where} takes {math.prod(sizes) * itemsize} bytes of {dtype}, "
                                  f"more than the {length} of its piece: the index is damaged")
        for first in range(offsets[0], offsets[0] + sizes[0]) if shape else [0]:
            covered[first] += math.prod(sizes[1:])
    whole = math.prod(shape[1:])
    if any(n != whole for n in covered.values()) or (
            not key.startswith(LAYERS) and len(covered) != (shape[0] if shape else 1)):
        raise CheckpointError(f"the pieces of {key} in {folder} cover {sum(covered.values())} of "
                              f"the {math.prod(shape)} elements of its shape {shape}: a rank's "
                              "file is missing from the index, or the index is damaged")
    return sorted(covered)


def read_tensor(folder, key, dtype, shape, pieces):
    """(the rows of the global tensor `key` that its pieces cover, assembled, their indices along
    its first axis: covered_rows): float32 (bfloat16 widened exactly), float16 and float64 as
    stored. Only the rows covered are allocated: what the pieces' bytes hold."""
    rows = covered_rows(folder, key, dtype, shape, pieces)
    out = np.zeros((len(rows), *shape[1:]) if shape else (),
                   DTYPES[dtype] if dtype != "bfloat16" else np.float32)
    row = {first: r for r, first in enumerate(rows)}
    for offsets, sizes, file, offset, length in pieces:
        value = read_piece(folder, file, offset, length, f"{key} at {offsets}")
        value = value.float32() if isinstance(value, torch_format.BFloat16) else value
        if not isinstance(value, np.ndarray) or value.shape != sizes:
            raise CheckpointError(f"{folder}/{file}: {key} at {offsets} holds "
                                  f"{getattr(value, 'shape', type(value).__name__)}, its index "
                                  f"says {sizes}: the file is damaged")
        if shape:
            start = row.get(offsets[0], 0)            # a piece's indices are consecutive rows
            out[(slice(start, start + sizes[0]),
                 *(slice(o, o + s) for o, s in zip(offsets[1:], sizes[1:])))] = value
        else:
            out[()] = value
    return out, rows


def read_common(folder):
    """common.pt: the run's args, iteration and checkpoint_version, checked (metadata.json's
    backend too)."""
    _check_backend(folder)
    path = os.path.join(folder, COMMON)
    try:
        common = torch_format.load(path)
    except torch_format.TorchFormatError as e:
        raise CheckpointError(str(e)) from None
    if not isinstance(common, dict) or "args" not in common:
        raise CheckpointError(f"{path} holds no args: not the common state of Megatron-LM's "
                              "save_checkpoint")
    version = common.get("checkpoint_version")
    if version != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path} has checkpoint_version {version}, this reader knows "
                              f"{CHECKPOINT_VERSION}: a Megatron-LM newer or older than its names")
    return common


def _split(key, shape, rows, folder):
    """[(index into the global tensor of `key`, this project's global name)] of a sharded key:
    a layer of a stacked key (of its `rows`, the layers its pieces hold), and of routed experts'
    (decoder.layers.mlp.experts.experts.*, [num_layers, num_experts, ...]: experts.py
    SequentialMLP.sharded_state_dict) each expert, by Megatron's per-layer name (project_name);
    None for what holds no weight."""
    try:
        if key.startswith(EXPERTS):
            rest = key[len(EXPERTS):]
            return [((i, j), project_name(f"{LAYERS}{i}.mlp.experts.local_experts.{j}.{rest}"))
                    for i in rows for j in range(shape[1])]
        if key.startswith(LAYERS):
            return [((i,), project_name(f"{LAYERS}{i}.{key[len(LAYERS):]}")) for i in rows]
        return [((), project_name(key))]
    except CheckpointError as e:
        raise CheckpointError(f"{folder}: {e}; a torch_dist checkpoint of a Megatron-LM newer or "
                              "older than the names this project knows?") from None


def _named(folder, key, entry, param_key):
    """{global name: array} of the index entry `key` (its parameter's sharded key `param_key`):
    the layers (and experts) its pieces hold."""
    dtype, shape, pieces = entry
    names = _split(param_key, shape, covered_rows(folder, key, dtype, shape, pieces), folder)
    if all(name is None for _, name in names):
        return {}
    value, rows = read_tensor(folder, key, dtype, shape, pieces)
    row = {first: r for r, first in enumerate(rows)}
    return {name: value[(row[index[0]], *index[1:])] if index else value
            for index, name in names if name is not None}


def model_tensors(folder, tensors):
    """{"model.<name>": array} of the index `tensors` (read_index) read from `folder`, under this
    project's global names: stacked layers (and experts) split; objects (_extra_state) and the
    optimizer's keys left out. A key this project has no place for is one CheckpointError line
    naming it."""
    out = {}
    for key, entry in tensors.items():
        if not key.startswith("optimizer."):                  # optimizer_tensors'
            out.update({f"model.{n}": v for n, v in _named(folder, key, entry, key).items()})
    return out


def optimizer_tensors(folder, tensors, weights, tp=1):
    """The optimizer state of the index `tensors`: {"optimizer.<kind>.<name>", "main.<name>":
    float32 array}. Sharded as its parameters ("optimizer.state.<kind>.<key>": Megatron's
    non-distributed optimizers, optimizer.py sharded_state_dict, the float32 main params as kind
    fp32_param; the distributed optimizer's fully_reshardable form, its buckets gathered and cut
    per parameter, the main params as kind param), or in the distributed optimizer's
    dp_reshardable buckets, cut here (bucket_tensors; `weights` the folder's model_tensors, `tp`
    the TP size that saved it)."""
    out = {}
    for key, entry in tensors.items():
        if key.startswith(OPTIMIZER):
            kind, _, param = key[len(OPTIMIZER):].partition(".")
            prefix = "main" if kind in (MAIN, DIST_MAIN) else f"optimizer.{kind}"
            out.update({f"{prefix}.{n}": v.astype(np.float32)
                        for n, v in _named(folder, key, entry, param).items()})
    out.update(bucket_tensors(folder, tensors, weights, tp))
    return out


def bucket_tensors(folder, tensors, weights, tp):
    """The dp_reshardable buckets of the index `tensors` cut per parameter, as optimizer_tensors
    gives them. Megatron's gradient buffer (param_and_grad_buffer.py) lays a bucket out as its
    model-parallel rank's parameters in reverse order, each start padded to a multiple of 64;
    the checkpoint keeps each bucket's float32 main params (kind param), exp_avg and exp_avg_sq
    flat, one chunk per parameter's piece on a DP rank and one per padding. A parameter's TP
    piece (tp_pieces) starts at the chunk where the main params round to that piece of its
    weights (`weights`: {"model.<name>": array}, as stored), and goes to its place in the
    one-process tensor."""
    buckets = collections.defaultdict(dict)      # bucket's key -> {kind: (flat, chunk starts)}
    for key, (dtype, shape, pieces) in tensors.items():
        if BUCKET.match(key):
            bucket, kind = key.rsplit(".", 1)
            flat = read_tensor(folder, key, dtype, shape, pieces)[0].astype(np.float32)
            buckets[bucket][kind] = flat, sorted(offsets[0] for offsets, *_ in pieces)
    candidates = [(name[len("model."):], index, piece) for name, weight in weights.items()
                  for index, piece in tp_pieces(name, weight, tp)]
    left = {name[len("model."):]: weight.size for name, weight in weights.items()}
    out = {}
    for bucket, kinds in buckets.items():
        if DIST_MAIN not in kinds:
            raise CheckpointError(f"{folder}: the bucket {bucket} holds no main params ({DIST_MAIN}"
                                  f"), only {sorted(kinds)}: the checkpoint is incomplete")
        main, starts = kinds[DIST_MAIN]
        for start in starts:
            found = _starting_at(main, start, candidates, left)
            if found is None:                  # padding, or a piece's part on the next DP rank
                continue
            name, index, piece = candidates.pop(found)        # a piece is placed once
            left[name] -= piece.size
            for kind, (flat, _) in kinds.items():
                prefix = "main" if kind == DIST_MAIN else f"optimizer.{kind}"
                shape = weights[f"model.{name}"].shape
                whole = out.setdefault(f"{prefix}.{name}", np.zeros(shape, np.float32))
                whole[index] = flat[start:start + piece.size].reshape(piece.shape)
    missing = sorted(name for name, n in left.items() if n)
    if buckets and missing:
        raise CheckpointError(
            f"{folder}: no bucket of its distributed optimizer holds main params that round to "
            f"{missing[0]} ({len(missing)} parameters not covered): give --no-load-optim to load "
            "its weights alone")
    return out


def tp_pieces(name, weight, tp):
    """[(index into `weight`, the piece)] a TP rank of `tp` may hold of parameter `name`: the
    whole (replicated), or for each rank its rows (column-parallel, the vocabulary), its columns
    (row-parallel), for an fc1 its rows of each half (SwiGLU's [gate; up]); the whole first."""
    out = [((), weight)]
    if tp == 1 or not weight.ndim:
        return out
    rows, half = weight.shape[0] // tp, weight.shape[0] // 2 // tp
    for t in range(tp):
        out.append(((slice(t * rows, (t + 1) * rows),), weight[t * rows:(t + 1) * rows]))
        if weight.ndim == 2:
            cols = weight.shape[1] // tp
            out.append(((slice(None), slice(t * cols, (t + 1) * cols)),
                        weight[:, t * cols:(t + 1) * cols]))
        if "linear_fc1" in name:
            both = np.r_[t * half:(t + 1) * half, (tp + t) * half:(tp + t + 1) * half]
            out.append(((both,), weight[both]))
    return out


def _starting_at(main, start, candidates, left):
    """The position in `candidates` of the first (name, index, piece) whose values the float32
    main params `main` hold from `start` on, rounded to its dtype (float32, bfloat16 widened, or
    float16), of a parameter with elements `left` to place; None if there is none."""
    for position, (name, _, piece) in enumerate(candidates):
        if not left[name] or not piece.size or start + piece.size > main.size:
            continue
        head = min(piece.size, 16)                            # most candidates differ at once
        if (_rounds_to(main[start:start + head], piece.flat[:head])
                and _rounds_to(main[start:start + piece.size].reshape(piece.shape), piece)):
            return position
    return None


def _rounds_to(main, weight):
    """The float32 `main` equals `weight`, or rounds to it in bfloat16 or in float16."""
    if weight.dtype == np.float16:
        return np.array_equal(main.astype(np.float16), weight)
    return (np.array_equal(main, weight)
            or np.array_equal(torch_format.BFloat16.from_float32(main).float32(), weight))


def optimizer_step(folder, common, tensors):
    """The optimizer step of Megatron-LM's folder (`common` its common.pt, `tensors` its index)
    whose optimizer state optimizer_tensors reads, from the param groups common.pt keeps
    (distrib_optimizer.py state_dict: {"optimizer": {"param_groups": [{"step": ...}]}}), in the
    dp_reshardable form from the object "optimizer.distributed.dp_group_idx_<g>.optimizer";
    None if it holds no such state."""
    optimizer = common.get("optimizer") or {}
    # a ChainedOptimizer of several (dense, experts) keeps each under its index
    parts = [optimizer] if "optimizer" in optimizer else list(optimizer.values())
    groups = [group for part in parts if isinstance(part, dict)
              for group in (part.get("optimizer") or {}).get("param_groups") or []]
    if any(BUCKET.match(key) for key in tensors):
        objects = read_index(folder)[1]
        groups = [group for key in objects if key.startswith(BUCKETS) and ".optimizer/" in key
                  for part in read_object(folder, key) or [] if isinstance(part, dict)
                  for group in part.get("param_groups") or []]
    steps = {int(group["step"]) for group in groups if "step" in group}
    held = any(key.startswith(OPTIMIZER) or BUCKET.match(key) for key in tensors)
    if not held or len(steps) != 1:
        return None
    return steps.pop()


# ----------------------------------------------------------------------------- writing
DCP = "torch.distributed.checkpoint.metadata"
LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")   # with an _extra_state
LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.+)")
TORCH_DTYPE = {"float32": "float32", "float16": "float16", "uint16": "bfloat16"}


def sharded_key(name):
    """(Megatron-core's sharded key, the stacked axes' indices) of this project's global parameter
    `name`: a layer's parameter under the stacked key at (layer,), its norms under the fused names
    the local spec saves them as, a routed expert's at (layer, expert); the rest as
    megatron_checkpoint.megatron_name at ()."""
    key = megatron_name(name)
    if not key.startswith(LAYERS):
        return key, ()
    number, _, rest = key[len(LAYERS):].partition(".")
    expert = LOCAL_EXPERT.fullmatch(rest)
    if expert:
        return EXPERTS + expert.group(2), (int(number), int(expert.group(1)))
    return LAYERS + FUSED_NORMS.get(rest, rest), (int(number),)


def rank_items(pieces, num_layers, num_experts):
    """One writer's items [(key, offsets, global shape, value)] (value an array, BFloat16, or for
    an object offsets and shape None): `pieces` [(key prefix, global name, offsets in the
    one-process tensor, its shape, this rank's block)], layers (and routed experts) stacked on
    leading axes (the optimizer's state under "optimizer.state.<kind>." and its parameter's key);
    with the first piece of a layer linear's weight its `_extra_state/shard_<index>_<shape>`
    object (Megatron's [None]; ShardedObject's unique_key)."""
    items = []
    for prefix, name, offsets, shape, value in pieces:
        key, index = sharded_key(name)
        stacked = (num_layers, num_experts)[:len(index)]
        bits = value.bits if isinstance(value, torch_format.BFloat16) else value
        block = bits.reshape((1,) * len(index) + bits.shape)
        block = torch_format.BFloat16(block) if bits is not value else block
        items.append((prefix + key, (*index, *offsets), (*stacked, *shape), block))
        module, _, leaf = key.rpartition(".")
        if index and not prefix and leaf == "weight" and module.endswith(LINEARS) \
                and not any(offsets):
            where = ".".join(map(str, index)), ".".join(map(str, stacked))
            items.append((f"{module}._extra_state/shard_{where[0]}_{where[1]}", None, None,
                          [None]))
    return items


def write_rank_file(folder, stem, items):
    """<stem>.distcp (__<rank>_0) of `items` (rank_items), each a torch.save archive one after
    another, and its part of the index (<stem>.json, joined into .metadata by write_index)."""
    index, raw, position = [], [], 0
    for key, offsets, shape, value in items:
        data = torch_format.dumps(value)
        dtype = None
        if offsets is not None:
            bits = value.bits if isinstance(value, torch_format.BFloat16) else value
            dtype = TORCH_DTYPE[str(bits.dtype)]
        index.append({"key": key, "offsets": offsets, "shape": shape, "dtype": dtype,
                      "sizes": None if offsets is None else list(value.shape),
                      "file": stem + ".distcp", "offset": position, "length": len(data)})
        raw.append(data)
        position += len(data)
    with open(os.path.join(folder, stem + ".distcp"), "wb") as f:
        f.write(b"".join(raw))
    with open(os.path.join(folder, stem + ".json"), "w") as f:
        json.dump(index, f)


def write_index(folder, common):
    """The index (.metadata) of every writer's part, common.pt and metadata.json, in `folder`
    (the checkpoint's temporary folder, after every writer is done)."""
    parts = sorted(f for f in os.listdir(folder) if f.startswith("__") and f.endswith(".json"))
    entries = []
    for part in parts:
        with open(os.path.join(folder, part)) as f:
            entries += json.load(f)
    with open(os.path.join(folder, METADATA), "wb") as f:
        f.write(torch_format.dump_pickle(_metadata(entries)))
    torch_format.save(common, os.path.join(folder, COMMON))
    with open(os.path.join(folder, BACKEND), "w") as f:
        json.dump({**BACKEND_VERSION, "common_backend": "torch", "common_backend_version": 1}, f)
    for part in parts:
        os.remove(os.path.join(folder, part))


def _size(values):
    """torch.Size(values), as pickle writes it."""
    return torch_format.foreign_class("torch", "Size")(tuple(values))


def _metadata(entries):
    """torch.distributed.checkpoint.metadata.Metadata of the index entries, as torch pickles it:
    per key its TensorStorageMetadata (dtype, global size, chunks) or BytesStorageMetadata, per
    piece its _StorageInfo."""
    layout = torch_format.foreign_class("torch.serialization", "_get_layout")("torch.strided")
    memory = torch_format.foreign_class(DCP, "_MEM_FORMAT_ENCODING")(0)
    described, storage = {}, {}
    for e in entries:
        key, offsets = e["key"], e["offsets"]
        index = {"fqn": key, "index": None}
        if offsets is None:
            described[key] = torch_format.foreign_object(DCP, "BytesStorageMetadata", {})
        else:
            index["offset"] = _size(offsets)
            if key not in described:
                properties = torch_format.foreign_object(DCP, "TensorProperties", (
                    torch_format.TorchDtype(e["dtype"]), layout, False, memory, False))
                described[key] = torch_format.foreign_object(
                    DCP, "TensorStorageMetadata",
                    {"properties": properties, "size": _size(e["shape"]), "chunks": []})
            described[key].state["chunks"].append(torch_format.foreign_object(
                DCP, "ChunkStorageMetadata",
                {"offsets": _size(offsets), "sizes": _size(e["sizes"])}))
        where = torch_format.foreign_object("torch.distributed.checkpoint.filesystem",
                                            "_StorageInfo", {"relative_path": e["file"],
                                                             "offset": e["offset"],
                                                             "length": e["length"],
                                                             "transform_descriptors": None})
        storage[torch_format.foreign_object(DCP, "MetadataIndex", index)] = where
    return torch_format.foreign_object(DCP, "Metadata", {
        "state_dict_metadata": described, "planner_data": None, "storage_data": storage,
        "storage_meta": None, "version": DCP_VERSION})


if __name__ == "__main__":          # imported by checkpoint.py, not a script
    raise SystemExit("error: dist_checkpoint.py is a library: run "
                     "`bash run.sh import-megatron ...` (bash run.sh --help lists the commands)")
