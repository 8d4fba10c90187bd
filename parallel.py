"""Megatron-style model parallelism on MindSpore PyNative: process groups, one communication
interface with a ledger, the f/g mappings, and the tensor-parallel layers.

Process groups follow Megatron's RankGenerator with order "tp-cp-dp-pp": global rank
    r = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank)),
so TP ranks are adjacent and PP ranks furthest apart.

Mappings (Shoeybi et al. 2019, "Megatron-LM"; Korthikanti et al. 2022 for sequence parallelism):
    f  = copy_to_tensor_model_parallel_region        fwd identity        bwd all-reduce
    g  = reduce_from_tensor_model_parallel_region    fwd all-reduce      bwd identity
    g~ = reduce_scatter_to_sequence_parallel_region  fwd reduce-scatter  bwd all-gather   (seq dim)
    f~ = gather_from_sequence_parallel_region        fwd all-gather      bwd reduce-scatter (seq dim)
Each is an nn.Cell with a custom `bprop`, the way autograd goes through a collective in MindSpore.
Activations are [s, b, h] (sequence first), so sequence parallelism splits dim 0.

On CPU (MCCL) only all_reduce, all_gather(list) and broadcast exist; `Comm` builds
all-gather-into-tensor, reduce-scatter and point-to-point exchange from them.
"""
import os
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import mindspore as ms
import mindspore.mint.distributed as dist
from mindspore import Parameter, Tensor, mint, nn, ops
from mindspore.communication import create_group, get_rank, init

import gpt

F32 = ms.float32

# ============================================================================ process groups
_GROUPS = {}        # group name -> (kind, global ranks); every group this process has named
_STATE = None


def rank_groups(world_size, tp, cp, pp):
    """kind -> list of rank lists, for the layout tp x cp x dp x pp (dp = world / (tp*cp*pp))."""
    if world_size % (tp * cp * pp):
        raise ValueError(f"world size {world_size} is not a multiple of tp*cp*pp = {tp * cp * pp}")
    dp = world_size // (tp * cp * pp)
    grid = np.arange(world_size).reshape(pp, dp, cp, tp)         # axes from slowest to fastest

    def along(*axes):   # groups varying `axes` (of pp=0, dp=1, cp=2, tp=3), the others fixed
        rest = [a for a in range(4) if a not in axes]
        size = int(np.prod([grid.shape[a] for a in axes]))
        return grid.transpose(rest + list(axes)).reshape(-1, size).tolist()

    groups = {"tp": along(3), "cp": along(2), "dp": along(1), "pp": along(0),
              "dp_cp": along(1, 2), "mp": along(0, 3)}
    # adjacent stages, and the ring's wrap-around (last -> first) that interleaving uses
    groups["pp_pairs"] = [g[i:i + 2] for g in groups["pp"] for i in range(pp - 1)]
    groups["pp_pairs"] += [[g[-1], g[0]] for g in groups["pp"] if pp > 2]
    if pp > 1:
        groups["embedding"] = [[g[0], g[-1]] for g in groups["pp"]]
    return groups


@dataclass
class ParallelState:
    world_size: int
    rank: int
    tp: int
    cp: int
    dp: int
    pp: int
    tp_rank: int
    cp_rank: int
    dp_rank: int
    pp_rank: int
    tp_group: str
    cp_group: str
    dp_group: str
    pp_group: str
    dp_cp_group: str
    mp_group: str
    embedding_group: str = None
    pair_groups: dict = field(default_factory=dict)      # peer global rank -> 2-rank group name

    @property
    def is_first_stage(self):
        return self.pp_rank == 0

    @property
    def is_last_stage(self):
        return self.pp_rank == self.pp - 1


def _world():
    """(world size, rank) from msrun's environment; init() only when there are several workers."""
    world = int(os.environ.get("MS_WORKER_NUM", "1"))
    if world == 1:
        return 1, 0
    if "world" not in _GROUPS:
        init()
        _GROUPS["world"] = ("world", list(range(world)))
    return world, get_rank()


def _use_group(kind, ranks):
    """Name the group of `ranks` and create it (once per process) if it has several ranks."""
    name = f"{kind}-" + "-".join(map(str, ranks))
    if len(ranks) > 1 and name not in _GROUPS:          # create_group accepts a name only once
        create_group(name, list(ranks))
    _GROUPS[name] = (kind, list(ranks))
    return name


def initialize_model_parallel(tp=1, pp=1, cp=1):
    """Build (or switch to) the layout tp x cp x dp x pp and return this rank's ParallelState."""
    global _STATE
    world, rank = _world()
    groups = rank_groups(world, tp, cp, pp)
    mine = {kind: next((g for g in gs if rank in g), None) for kind, gs in groups.items()
            if kind != "pp_pairs"}
    names = {kind: _use_group(kind, g) for kind, g in mine.items() if g is not None}
    pairs = {next(r for r in g if r != rank): _use_group("pp_pair", g)
             for g in groups["pp_pairs"] if rank in g}
    _STATE = ParallelState(
        world_size=world, rank=rank, tp=tp, cp=cp, dp=world // (tp * cp * pp), pp=pp,
        tp_rank=mine["tp"].index(rank), cp_rank=mine["cp"].index(rank),
        dp_rank=mine["dp"].index(rank), pp_rank=mine["pp"].index(rank),
        tp_group=names["tp"], cp_group=names["cp"], dp_group=names["dp"], pp_group=names["pp"],
        dp_cp_group=names["dp_cp"], mp_group=names["mp"], embedding_group=names.get("embedding"),
        pair_groups=pairs)
    return _STATE


def use_state(state):
    """Make `state` the current layout and return the previous one. Building a model needs only
    the sizes and ranks, so checkpoint conversion builds any rank's model in one process."""
    global _STATE
    previous, _STATE = _STATE, state
    return previous


def get_state():
    """The current ParallelState; a one-process layout if initialize was never called."""
    return _STATE if _STATE is not None else initialize_model_parallel()


def grid_table(world_size, tp, cp, pp):
    """One line per rank: its coordinates in the tp-cp-dp-pp grid."""
    dp = world_size // (tp * cp * pp)
    lines = [f"rank -> tp, cp, dp, pp   (tp={tp} cp={cp} dp={dp} pp={pp})"]
    for r in range(world_size):
        lines.append(f"{r:4d} -> {r % tp}, {r // tp % cp}, {r // (tp * cp) % dp}, "
                     f"{r // (tp * cp * dp)}")
    return "\n".join(lines)


def group_ranks(group):
    """Global ranks of a group named by this module, in group-rank order."""
    return _GROUPS[group][1]


def group_rank(group):
    return group_ranks(group).index(get_state().rank)


# ============================================================================ communication
class Ledger:
    """Calls and payload bytes (of the input tensor) per (group kind, op)."""

    def __init__(self):
        self.entries = {}

    def reset(self):
        self.entries = {}

    def add(self, group, op, t):
        key = (_GROUPS[group][0], op)
        calls, nbytes = self.entries.get(key, (0, 0))
        self.entries[key] = (calls + 1, nbytes + t.nbytes)

    def counts(self):
        return dict(self.entries)

    def report(self):
        lines = [f"{'group':>10} {'op':>15} {'calls':>7} {'bytes':>12}"]
        for (kind, op), (calls, nbytes) in sorted(self.entries.items()):
            lines.append(f"{kind:>10} {op:>15} {calls:7d} {nbytes:12d}")
        return "\n".join(lines)


class Comm:
    """Out-of-place collectives on named groups. mint.distributed works in place, so every call
    hands it a copy or a fresh buffer. `fallback` (CPU, or forced) builds the collectives MCCL
    lacks from all_reduce, all_gather(list) and broadcast; HCCL/NCCL use the native ones."""

    def __init__(self, force_fallback=False):
        self.force_fallback = force_fallback
        self.ledger = Ledger()

    @property
    def fallback(self):
        return self.force_fallback or ms.get_context("device_target") == "CPU"

    def all_reduce(self, t, group, op="sum"):
        if len(group_ranks(group)) == 1:
            return t
        self.ledger.add(group, "all_reduce", t)
        out = t.copy()
        dist.all_reduce(out, op=op, group=group)
        return out

    def all_gather(self, t, group, dim=0):
        """[.., d, ..] on each of n ranks -> [.., n*d, ..], in group-rank order."""
        n = len(group_ranks(group))
        if n == 1:
            return t
        self.ledger.add(group, "all_gather", t)
        dim = dim % t.ndim
        if self.fallback:
            bufs = [mint.zeros(t.shape, dtype=t.dtype) for _ in range(n)]
            dist.all_gather(bufs, t, group=group)
            return mint.cat(bufs, dim)
        out = mint.zeros((n * t.shape[0],) + t.shape[1:], dtype=t.dtype)
        dist.all_gather_into_tensor(out, t.contiguous(), group=group)
        return out if dim == 0 else mint.cat(mint.chunk(out, n, 0), dim)

    def reduce_scatter(self, t, group, dim=0):
        """[.., n*d, ..] on each of n ranks -> this rank's [.., d, ..] slice of the sum."""
        n = len(group_ranks(group))
        if n == 1:
            return t
        self.ledger.add(group, "reduce_scatter", t)
        dim, chunk = dim % t.ndim, t.shape[dim] // n
        if self.fallback:
            total = t.copy()
            dist.all_reduce(total, group=group)
            return total.narrow(dim, group_rank(group) * chunk, chunk).contiguous()
        src = t if dim == 0 else mint.cat(mint.chunk(t, n, dim), 0)      # [n*.., d, ..]
        out = mint.zeros((src.shape[0] // n,) + src.shape[1:], dtype=t.dtype)
        dist.reduce_scatter_tensor(out, src.contiguous(), group=group)
        return out

    def broadcast(self, t, src_global_rank, group):
        if len(group_ranks(group)) == 1:
            return t
        self.ledger.add(group, "broadcast", t)
        out = t.copy()
        dist.broadcast(out, src=src_global_rank, group=group)
        return out

    def exchange(self, t, peer_global_rank):
        """Send t to the peer and return the peer's same-shape tensor (Megatron's
        send_forward_recv_backward), on the two ranks' pair group: one all_gather on CPU."""
        group = get_state().pair_groups[peer_global_rank]
        self.ledger.add(group, "exchange", t)
        if self.fallback:
            bufs = [mint.zeros(t.shape, dtype=t.dtype) for _ in range(2)]
            dist.all_gather(bufs, t, group=group)
            return bufs[group_ranks(group).index(peer_global_rank)]
        out = mint.zeros(t.shape, dtype=t.dtype)
        ops_ = [dist.P2POp(dist.isend, t.contiguous(), peer_global_rank, group=group),
                dist.P2POp(dist.irecv, out, peer_global_rank, group=group)]
        for handle in dist.batch_isend_irecv(ops_):
            handle.wait()
        return out


comm = Comm()


# ============================================================================ mappings (f, g)
def _slice(x, dim, group):
    """This rank's contiguous 1/n of x along dim."""
    dim = dim % x.ndim
    chunk = x.shape[dim] // len(group_ranks(group))
    return x.narrow(dim, group_rank(group) * chunk, chunk).contiguous()


def _identity(t, group):
    return t


def _all_reduce(t, group):
    return comm.all_reduce(t, group)


def _reduce_scatter(t, group):                # [s, b, h] -> [s/n, b, h], summed
    return comm.reduce_scatter(t, group, dim=0)


def _all_gather(dim):                         # [.., d, ..] -> [.., n*d, ..]
    return lambda t, group: comm.all_gather(t, group, dim)


def _keep_own(dim):                           # [.., n*d, ..] -> [.., d, ..], no communication
    return lambda t, group: _slice(t, dim, group)


class _Mapping(nn.Cell):
    """Megatron's autograd functions: `fwd` in construct, `bwd` on the gradient in bprop."""

    def __init__(self, fwd, bwd, group):
        super().__init__()
        self.fwd, self.bwd, self.group = fwd, bwd, group

    def construct(self, x):
        return self.fwd(x, self.group)

    def bprop(self, x, out, dout):
        return (self.bwd(dout, self.group),)


_CELLS = {}


def _mapping(fwd, bwd, x, group=None):
    """Apply a mapping over `group` (default: the current TP group); identity for one rank."""
    group = group or get_state().tp_group
    if len(group_ranks(group)) == 1:
        return x
    if (fwd, bwd, group) not in _CELLS:
        _CELLS[(fwd, bwd, group)] = _Mapping(fwd, bwd, group)
    return _CELLS[(fwd, bwd, group)](x)


# Megatron's names, each (x, group=None) -> tensor; partial(_mapping, forward, backward).
copy_to_tensor_model_parallel_region = partial(_mapping, _identity, _all_reduce)          # f
reduce_from_tensor_model_parallel_region = partial(_mapping, _all_reduce, _identity)      # g
gather_from_tensor_model_parallel_region = partial(_mapping, _all_gather(-1), _keep_own(-1))
scatter_to_tensor_model_parallel_region = partial(_mapping, _keep_own(-1), _all_gather(-1))
scatter_to_sequence_parallel_region = partial(_mapping, _keep_own(0), _all_gather(0))
gather_from_sequence_parallel_region = partial(_mapping, _all_gather(0), _reduce_scatter)      # f~
reduce_scatter_to_sequence_parallel_region = partial(_mapping, _reduce_scatter, _all_gather(0))  # g~


# ============================================================================ layers
def shard(full, dim, rank, size, chunks=1):
    """This rank's slice of a full master weight along dim. With chunks > 1 (fc1's [gate; up])
    each of the `chunks` blocks is split separately and the slices are concatenated."""
    return np.concatenate([np.split(block, size, axis=dim)[rank]
                           for block in np.split(full, chunks, axis=dim)], axis=dim)


def _param(shape, name, partition_dim=None, chunks=1, sequence_parallel=False):
    p = Parameter(Tensor(np.zeros(shape, np.float32)), name=name)
    if partition_dim is not None:
        p.partition_dim, p.partition_chunks = partition_dim, chunks
    if sequence_parallel:
        p.sequence_parallel = True          # grad is partial per TP rank: all-reduce it over TP
    return p


class ColumnParallelLinear(nn.Cell):
    """Y = X A with A split by columns: A = [A_1 .. A_n], rank i computes Y_i = X A_i.
    Weight [out/tp, in]; input [s, b, in] through f (or [s/tp, b, in] through f~ with sequence
    parallelism); output [s, b, out/tp], or [s, b, out] with gather_output."""

    def __init__(self, in_features, out_features, bias=True, gather_output=False,
                 sequence_parallel=False, chunks=1):
        super().__init__()
        state = get_state()
        if out_features % (state.tp * chunks):
            raise ValueError(f"output size {out_features} is not divisible by tp*chunks = "
                             f"{state.tp * chunks}")
        self.group, self.gather_output = state.tp_group, gather_output
        self.sequence_parallel = sequence_parallel
        self.weight = _param((out_features // state.tp, in_features), "weight", 0, chunks)
        self.bias = _param((out_features // state.tp,), "bias", 0, chunks) if bias else None

    def construct(self, x):
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.group)     # [s, b, in]
        else:
            x = copy_to_tensor_model_parallel_region(x, self.group)
        y = gpt.linear(x, self.weight, self.bias)                        # [s, b, out/tp]
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y, self.group)  # [s, b, out]
        return y


class RowParallelLinear(nn.Cell):
    """Y = X A with A split by rows: A = [A_1; ..; A_n], X = [X_1 .. X_n], Y = sum_i X_i A_i
    through g (or g~ with sequence parallelism). Weight [out, in/tp]; input [s, b, in/tp];
    output [s, b, out] (or [s/tp, b, out]); the bias is added once, after the reduction."""

    def __init__(self, in_features, out_features, bias=True, input_is_parallel=True,
                 sequence_parallel=False):
        super().__init__()
        state = get_state()
        if in_features % state.tp:
            raise ValueError(f"input size {in_features} is not divisible by tp = {state.tp}")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel needs input_is_parallel=True")
        self.group, self.input_is_parallel = state.tp_group, input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.weight = _param((out_features, in_features // state.tp), "weight", 1)
        self.bias = _param((out_features,), "bias", sequence_parallel=sequence_parallel) \
            if bias else None

    def construct(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.group)   # [s, b, in/tp]
        y = gpt.linear(x, self.weight)                                   # [s, b, out] partial
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.group)  # [s/tp, b, out]
        else:
            y = reduce_from_tensor_model_parallel_region(y, self.group)
        if self.bias is None:
            return y
        return ops.bias_add(y.reshape(-1, y.shape[-1]), self.bias).reshape(y.shape)


class VocabParallelEmbedding(nn.Cell):
    """Embedding table split by vocabulary rows: rank i holds ids [i*V/tp, (i+1)*V/tp). Ids
    [b, s] outside that range look up row 0 and are zeroed; g sums the ranks -> [b, s, h]."""

    def __init__(self, num_embeddings, embedding_dim):
        super().__init__()
        state = get_state()
        if num_embeddings % state.tp:
            raise ValueError(f"vocabulary {num_embeddings} is not divisible by tp = {state.tp}")
        per_rank = num_embeddings // state.tp
        self.group, self.tp = state.tp_group, state.tp
        self.start, self.end = state.tp_rank * per_rank, (state.tp_rank + 1) * per_rank
        self.weight = _param((per_rank, embedding_dim), "weight", 0)

    def construct(self, ids):
        if self.tp == 1:
            return ops.gather(self.weight, ids, 0)
        outside = (ids < self.start) | (ids >= self.end)                 # [b, s]
        local = ops.where(outside, ops.zeros_like(ids), ids - self.start)
        emb = ops.gather(self.weight, local, 0)                          # [b, s, h]
        emb = ops.masked_fill(emb, outside.expand_dims(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(emb, self.group)


class _VocabParallelCrossEntropy(nn.Cell):
    """Megatron's vocab-parallel cross-entropy: three all-reduces forward (MAX of the row max,
    SUM of the target logit, SUM of exp), none backward. Returns (loss [n], logsumexp [n]); the
    second output is kept for bprop, which rebuilds the softmax from it."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def _target(self, logits, labels):
        """(local target index [n], mask [n] True where the label is on another rank)."""
        per_rank = logits.shape[-1]
        start = group_rank(self.group) * per_rank
        outside = (labels < start) | (labels >= start + per_rank)
        return ops.where(outside, ops.zeros_like(labels), labels - start), outside

    def construct(self, logits, labels):
        row_max = comm.all_reduce(logits.max(axis=-1), self.group, op="max")        # [n]
        z = logits - row_max.expand_dims(-1)                                         # [n, V/tp]
        local, outside = self._target(logits, labels)
        predicted = ops.gather_elements(z, 1, local.expand_dims(-1)).squeeze(-1)     # [n]
        predicted = comm.all_reduce(ops.masked_fill(predicted, outside, 0.0), self.group)
        sum_exp = comm.all_reduce(ops.exp(z).sum(-1), self.group)                   # [n]
        log_sum_exp = ops.log(sum_exp)
        return log_sum_exp - predicted, row_max + log_sum_exp

    def bprop(self, logits, labels, out, dout):
        softmax = ops.exp(logits - out[1].expand_dims(-1))                           # [n, V/tp]
        local, outside = self._target(logits, labels)
        one_hot = ops.one_hot(local, logits.shape[-1], Tensor(1.0, F32), Tensor(0.0, F32))
        one_hot = one_hot * (~outside).astype(F32).expand_dims(-1)
        return (softmax - one_hot) * dout[0].expand_dims(-1), ops.zeros_like(labels)


def vocab_parallel_cross_entropy(logits, labels, group=None):
    """Per-token loss [n] from this rank's logits [n, V/tp] (fp32) and labels [n] (int32)."""
    group = group or get_state().tp_group
    if (_VocabParallelCrossEntropy, group) not in _CELLS:
        _CELLS[(_VocabParallelCrossEntropy, group)] = _VocabParallelCrossEntropy(group)
    return _CELLS[(_VocabParallelCrossEntropy, group)](logits, labels)[0]
