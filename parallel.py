"""Megatron-style model parallelism on MindSpore PyNative: process groups, one communication
interface, the f/g mappings, and the tensor-parallel layers.

Process groups follow Megatron's RankGenerator with order "tp-cp-dp-pp": global rank
    r = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank)),
so TP ranks are adjacent and PP ranks furthest apart. Expert parallelism is carved out of DP x CP
as in Megatron's expert RankGenerator ("tp-ep-dp-pp", expert TP = TP): with dp_cp_rank =
dp_rank * cp + cp_rank = ep_rank + ep * edp_rank,
    r = tp_rank + tp * (ep_rank + ep * (edp_rank + edp * pp_rank)),     edp = dp * cp / ep,
so an expert-parallel group is `ep` adjacent DP x CP ranks and the expert-data-parallel group
(edp) the ranks holding the same experts.

Mappings (Shoeybi et al. 2019, "Megatron-LM"; Korthikanti et al. 2022 for sequence parallelism,
the ~ ones along the sequence dimension):
    f  = copy_to_tensor_model_parallel_region        fwd identity        bwd all-reduce
    g  = reduce_from_tensor_model_parallel_region    fwd all-reduce      bwd identity
    g~ = reduce_scatter_to_sequence_parallel_region  fwd reduce-scatter  bwd all-gather
    f~ = gather_from_sequence_parallel_region        fwd all-gather      bwd reduce-scatter
Each is an nn.Cell with a custom `bprop`, the way autograd goes through a collective in MindSpore.
Activations are [s, b, h] (sequence first), so sequence parallelism splits dim 0.

Communication goes through one name, `collectives(group)`: the Collectives Cell of a process
group, one per group and process, e.g. `collectives(state.dp_cp_group).all_reduce(t)`. The same
Cell serves the model op by op and compiled by ms.jit, and the optimizer between compiled calls.
Every collective passes one recording point, which tells its observers (the ledger, the flight
recorder: tools/) what ran. HCCL/NCCL run the native primitives; on the CPU, where only
AllReduce compiles, CpuCollectives builds the others from it (its own section, "on the CPU").
Two functions run only between compiled calls, with mint.distributed: `broadcast` and the
pipeline's point-to-point `exchange`.
"""
import functools
import os
from dataclasses import dataclass, field, replace

import numpy as np
import mindspore as ms
import mindspore.mint.distributed as dist
from mindspore import Tensor, mint, nn, ops
from mindspore.communication import GlobalComm, create_group, get_rank, init
from mindspore.graph.api import _pynative_executor
from mindspore.ops import constexpr

from backends import shared_memory
from layers import linear, plain_forms, zero_param
from settings.config import check_expert_parallel_size, cp_ring_size, data_parallel_size

F32 = ms.float32                                     # the one float32 alias, imported where used
DTYPES = {"float32": F32, "float16": ms.float16, "bfloat16": ms.bfloat16}    # config's dtype names

# ============================================================================ process groups
_GROUPS = {}        # group name -> (kind, global ranks); every group this process has named
_STATE = None


def rank_grid(world_size, tp, cp, pp, ep=None):
    """The global ranks as an array [pp, dp, cp, tp], axes from slowest to fastest (the rank
    formula above), after the layout's divisibility rules (config.data_parallel_size,
    config.check_expert_parallel_size); with `ep`, the same ranks as [pp, edp, ep, tp]."""
    dp = data_parallel_size(world_size, tp, cp, pp)
    grid = np.arange(world_size).reshape(pp, dp, cp, tp)
    if ep is None:
        return grid
    check_expert_parallel_size(ep, dp * cp)
    return grid.reshape(pp, dp * cp // ep, ep, tp)


def rank_groups(world_size, tp, cp, pp, ulysses=None, ep=1):
    """kind -> list of rank lists, for the layout tp x cp x dp x pp (dp = world / (tp*cp*pp)).
    Context parallelism as ring x ulysses (context_parallel.py): "cp_ulysses" groups are runs of
    `ulysses` adjacent cp ranks (default: all of them), "cp_ring" groups the ranks `ulysses`
    apart. Experts (moe.py): "ep" groups `ep` adjacent DP x CP ranks, "edp" the ranks holding
    the same experts, "tp_ep" is TP x EP (the allgather dispatcher's group), "tp_cp" TP x CP
    (over which a router counts its tokens), "tp_dp_cp" TP x DP x CP, a stage's every rank (over
    which the routers' expert biases count their tokens)."""
    grid, expert_grid = rank_grid(world_size, tp, cp, pp), rank_grid(world_size, tp, cp, pp, ep)

    def along(*axes, of=grid):   # groups varying `axes` (of pp=0, dp=1, cp=2, tp=3), the rest fixed
        rest = [a for a in range(4) if a not in axes]
        size = int(np.prod([of.shape[a] for a in axes]))
        return of.transpose(rest + list(axes)).reshape(-1, size).tolist()

    groups = {"tp": along(3), "cp": along(2), "dp": along(1), "pp": along(0),
              "dp_cp": along(1, 2), "mp": along(0, 3), "tp_cp": along(2, 3),
              "ep": along(2, of=expert_grid), "edp": along(1, of=expert_grid),
              "tp_ep": along(2, 3, of=expert_grid), "tp_dp_cp": along(1, 2, 3)}
    ulysses = cp if ulysses is None else ulysses
    groups["cp_ulysses"] = [g[i:i + ulysses] for g in groups["cp"] for i in range(0, cp, ulysses)]
    groups["cp_ring"] = [g[i::ulysses] for g in groups["cp"] for i in range(ulysses)]
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
    sequence_parallel: bool = False                      # TP layers keep activations [s/tp, b, h]
    cp_ulysses: int = 1                                  # cp = ring x ulysses (context_parallel.py)
    cp_ulysses_group: str = None
    cp_ring_group: str = None
    ep: int = 1                                          # expert parallel size (moe.py)
    ep_rank: int = 0
    edp_rank: int = 0                                    # rank in the expert-data-parallel group
    ep_group: str = None
    edp_group: str = None
    tp_ep_group: str = None
    tp_cp_group: str = None
    tp_dp_cp_group: str = None

    @property
    def dp_cp_rank(self):
        """This rank's place in its dp_cp group (cp ranks adjacent): the distributed optimizer's
        shard."""
        return self.dp_rank * self.cp + self.cp_rank

    @property
    def cp_ring(self):
        """The ring's size: cp = ring x ulysses (context_parallel.py)."""
        return cp_ring_size(self.cp, self.cp_ulysses)

    @property
    def is_first_stage(self):
        return self.pp_rank == 0

    @property
    def is_last_stage(self):
        return self.pp_rank == self.pp - 1


def launched_world_size():
    """The number of workers msrun started (MS_WORKER_NUM; RANK_SIZE for other launchers), 1
    when run alone."""
    return int(os.environ.get("MS_WORKER_NUM", os.environ.get("RANK_SIZE", "1")))


def world():
    """(world size, rank) from msrun's environment; init() only when there are several workers:
    it waits until every worker has called it (msrun's --cluster_time_out), once per process."""
    size = launched_world_size()
    if size == 1:
        return 1, 0
    if "world" not in _GROUPS:
        init()
        _GROUPS["world"] = ("world", list(range(size)))
    return size, get_rank()


def _use_group(kind, ranks):
    """Name the group of `ranks` and create it (once per process) if it has several ranks."""
    name = f"{kind}-" + "-".join(map(str, ranks))
    if len(ranks) > 1 and name not in _GROUPS:          # create_group accepts a name only once
        create_group(name, list(ranks))
    _GROUPS[name] = (kind, list(ranks))
    return name


# a group that holds the same ranks as the one named beside it is that group (no second
# communicator): a CP subgroup that is all of CP, TP x CP without CP, the expert groups without
# EP, TP x DP x CP without TP
SAME_RANKS_AS = {"cp_ulysses": "cp", "cp_ring": "cp", "tp_cp": "tp", "edp": "dp_cp",
                 "tp_ep": "tp", "tp_dp_cp": "dp_cp"}


def initialize_model_parallel(tp=1, pp=1, cp=1, sequence_parallel=False, ulysses=None, ep=1,
                              cpu_collectives="mccl"):
    """Build (or switch to) the layout tp x cp x dp x pp and return this rank's ParallelState;
    `ulysses` (default cp) is the Ulysses degree within cp (context_parallel.py), `ep` the expert
    parallel size, carved out of dp x cp (moe.py); `cpu_collectives` the CPU's all-reduce:
    MindSpore's ("mccl") or through shared memory ("shared_memory", backends/)."""
    global _STATE
    _BACKEND["cpu_collectives"] = cpu_collectives
    world_size, rank = world()
    ulysses = cp if ulysses is None else ulysses
    groups = rank_groups(world_size, tp, cp, pp, ulysses, ep)
    mine = {kind: next((g for g in gs if rank in g), None) for kind, gs in groups.items()
            if kind != "pp_pairs"}
    names = {kind: _use_group(kind, g) for kind, g in mine.items()
             if g is not None and not (kind in SAME_RANKS_AS and g == mine[SAME_RANKS_AS[kind]])}
    for kind, base in SAME_RANKS_AS.items():
        names.setdefault(kind, names[base])
    pairs = {next(r for r in g if r != rank): _use_group("pp_pair", g)
             for g in groups["pp_pairs"] if rank in g}
    _STATE = ParallelState(
        world_size=world_size, rank=rank, tp=tp, cp=cp, dp=len(mine["dp"]), pp=pp,
        tp_rank=mine["tp"].index(rank), cp_rank=mine["cp"].index(rank),
        dp_rank=mine["dp"].index(rank), pp_rank=mine["pp"].index(rank),
        tp_group=names["tp"], cp_group=names["cp"], dp_group=names["dp"], pp_group=names["pp"],
        dp_cp_group=names["dp_cp"], mp_group=names["mp"], embedding_group=names.get("embedding"),
        pair_groups=pairs, sequence_parallel=sequence_parallel, cp_ulysses=ulysses,
        cp_ulysses_group=names["cp_ulysses"], cp_ring_group=names["cp_ring"],
        ep=ep, ep_rank=mine["ep"].index(rank), edp_rank=mine["edp"].index(rank),
        ep_group=names["ep"], edp_group=names["edp"], tp_ep_group=names["tp_ep"],
        tp_cp_group=names["tp_cp"], tp_dp_cp_group=names["tp_dp_cp"])
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


def barrier():
    """All ranks wait here: a one-element all-reduce on the world group, read back (PyNative is
    asynchronous; mint's barrier logs a spurious device error on CPU)."""
    if get_state().world_size > 1:
        flag = Tensor([0.0], ms.float32)
        _record("world", "barrier", (1,), ms.float32, "world")
        dist.all_reduce(flag, group=GlobalComm.WORLD_COMM_GROUP)
        flag.asnumpy()


def any_rank(flag):
    """True on every rank when `flag` is true on any (a one-element all-reduce on the world
    group)."""
    if get_state().world_size == 1:
        return bool(flag)
    count = Tensor([float(bool(flag))], ms.float32)
    _record("world", "any_rank", (1,), ms.float32, "world")
    dist.all_reduce(count, group=GlobalComm.WORLD_COMM_GROUP)
    return bool(count.asnumpy()[0] > 0)


def grid_table(world_size, tp, cp, pp, ep=1):
    """One line per rank: its coordinates in the tp-cp-dp-pp grid, and with expert parallelism
    its EP rank (its place among `ep` adjacent DP x CP ranks)."""
    grid, expert_grid = rank_grid(world_size, tp, cp, pp), rank_grid(world_size, tp, cp, pp, ep)
    experts = f" ep={ep}" if ep > 1 else ""
    lines = [f"rank -> tp, cp, dp, pp{', ep' if ep > 1 else ''}   "
             f"(tp={tp} cp={cp} dp={grid.shape[1]} pp={pp}{experts})"]
    for (pp_rank, dp_rank, cp_rank, tp_rank), r in np.ndenumerate(grid):
        ep_rank = np.unravel_index(r, expert_grid.shape)[2]
        lines.append(f"{r:4d} -> {tp_rank}, {cp_rank}, {dp_rank}, {pp_rank}"
                     + (f", {ep_rank}" if ep > 1 else ""))
    return "\n".join(lines)


def group_ranks(group):
    """Global ranks of a group named by this module, in group-rank order."""
    return _GROUPS[group][1]


# ============================================================================ communication
# Every collective passes one recording point, `_record`, which tells the observers what ran (the
# ledger of a step's bytes, instruments/ledger.py; the flight recorder,
# instruments/flight_recorder.py): op by op as it runs, inside ms.jit once, while the graph
# compiles. A compiled graph's call goes
# through `compiled_call`, which each observer wraps, knowing from the compilation what it holds.
OBSERVERS = []


def observe(observer):
    """Tell `observer` of every collective from now on: `observer.collective(kind, op, group,
    ranks, shape, dtype)` and `observer.graph_call(graph, key, run)` around a compiled graph's
    `run()`. Once, however often it is asked."""
    if observer not in OBSERVERS:
        OBSERVERS.append(observer)


@constexpr
def _record(kind, op, shape, dtype, group):
    """One collective on `group` (a name of this module, of kind `kind`), to the observers: at
    run time op by op, at compile time inside ms.jit (a constexpr)."""
    ranks = _GROUPS.get(group, (None, []))[1]
    for observer in OBSERVERS:
        observer.collective(kind, op, group, ranks, tuple(shape), dtype)


def compiled_call(graph, run, inputs):
    """run(*inputs), a call of the compiled `graph` (gpt.Compiled), inside each observer's
    graph_call. MindSpore compiles a graph per input shapes and dtypes, with or without
    gradients: `key`."""
    key = (_pynative_executor.requires_grad(),
           tuple(None if t is None else (tuple(t.shape), t.dtype) for t in inputs))
    call = functools.partial(run, *inputs)
    for observer in OBSERVERS:
        call = functools.partial(observer.graph_call, graph, key, call)
    return call()


class Collectives(nn.Cell):
    """Out-of-place collectives on one process group, the same code op by op and inside ms.jit;
    each tells the observers (_record), then runs. A one-rank group returns its input. The
    device's native primitives (HCCL, NCCL); on the CPU, CpuCollectives."""

    def __init__(self, group, size, rank, kind):
        super().__init__()
        self.kind, self.size, self.rank, self.group = kind, size, rank, group
        live = size > 1 and group is not None
        self.sum = ops.AllReduce(group=group) if live else None
        if live:
            self.build(group, size)

    def build(self, group, size):
        """The native primitives beside the sum."""
        self.max = ops.AllReduce(ops.ReduceOp.MAX, group=group)
        self.gather = ops.AllGather(group=group)
        self.scatter = ops.ReduceScatter(group=group)
        self.alltoall = {dims: ops.AlltoAll(size, dims[0], dims[1], group=group)
                         for dims in ((2, 0), (0, 2))}       # Ulysses: [s, b, heads, d]

    def all_reduce(self, x):
        if self.size == 1:
            return x
        _record(self.kind, "all_reduce", x.shape, x.dtype, self.group)
        return self.sum(x)

    def all_reduce_max(self, x):
        """Elementwise max over the group."""
        if self.size == 1:
            return x
        _record(self.kind, "all_reduce", x.shape, x.dtype, self.group)
        return self._max(x)

    def all_gather(self, x, dim=0):
        """[.., d, ..] on each of n ranks -> [.., n*d, ..], in group-rank order."""
        if self.size == 1:
            return x
        _record(self.kind, "all_gather", x.shape, x.dtype, self.group)
        return self._gather(x, dim % x.ndim)

    def all_to_all(self, x, scatter_dim, gather_dim):
        """Piece j (of n) of x along scatter_dim goes to rank j; the pieces received are joined
        along gather_dim in rank order: [.., n*a, .., c, ..] -> [.., a, .., n*c, ..]."""
        if self.size == 1:
            return x
        _record(self.kind, "all_to_all", x.shape, x.dtype, self.group)
        return self._all_to_all(x, scatter_dim % x.ndim, gather_dim % x.ndim)

    def reduce_scatter(self, x, dim=0):
        """[.., n*d, ..] on each of n ranks -> this rank's [.., d, ..] slice of the sum."""
        if self.size == 1:
            return x
        _record(self.kind, "reduce_scatter", x.shape, x.dtype, self.group)
        return self._reduce_scatter(x, dim % x.ndim)

    def send_recv(self, x, step=1):
        """One step of a ring: x [..] goes to the rank `step` places on in the group (rank
        i -> i + step mod n) and the rank `step` places back sends its x [..] here (Megatron's
        ring attention passes its key and value blocks so; context_parallel.RingKernel)."""
        if self.size == 1:
            return x
        _record(self.kind, "send_recv", x.shape, x.dtype, self.group)
        return self._send_recv(x, step)

    def _max(self, x):
        return self.max(x)

    def _gather(self, x, dim):
        out = self.gather(x)                                            # [n*d, ..]
        return out if dim == 0 else ops.cat(ops.chunk(out, self.size, 0), dim)

    def _send_recv(self, x, step):
        """From an all-gather, the rank `step` places back kept: what compiles on every device
        here (a device's send/recv would move one block, not n)."""
        return self._gather(x.expand_dims(0), 0)[(self.rank - step) % self.size]

    def _all_to_all(self, x, scatter_dim, gather_dim):
        return self.alltoall[(scatter_dim, gather_dim)](x)

    def _reduce_scatter(self, x, dim):
        src = x if dim == 0 else ops.cat(ops.chunk(x, self.size, dim), 0)   # [n*.., d, ..]
        return self.scatter(src)


_COLLECTIVES = {}             # (group, CPU backend) -> its Collectives
_BACKEND = {"cpu_collectives": "mccl"}     # initialize_model_parallel's choice for this layout


def collectives(group=None):
    """The Collectives Cell of a group named by this module (default: the current TP group), one
    per group and process: CpuCollectives on the CPU. A model built for a rank of another layout
    (checkpoint conversion builds them all in one process) gets one that holds no primitives: it
    is never run."""
    state = get_state()
    group = state.tp_group if group is None else group
    kind = CpuCollectives if ms.get_context("device_target") == "CPU" else Collectives
    if group not in _GROUPS:
        return kind(None, state.tp, state.tp_rank, "tp")
    key = (group, _BACKEND["cpu_collectives"])
    if key not in _COLLECTIVES:
        group_kind, ranks = _GROUPS[group]
        _COLLECTIVES[key] = kind(group, len(ranks), ranks.index(state.rank), group_kind)
    return _COLLECTIVES[key]


def broadcast(t, src_global_rank, group):
    """t from global rank `src_global_rank` to every rank of `group` (a new tensor; t is left as
    it is), with mint.distributed: called between compiled graphs, never inside one."""
    if len(group_ranks(group)) == 1:
        return t
    _record(_GROUPS[group][0], "broadcast", t.shape, t.dtype, group)
    out = t.copy()
    dist.broadcast(out, src=src_global_rank, group=group)
    return out


def exchange(t, peer_global_rank):
    """Send t to the peer and return the peer's same-shape tensor (Megatron's
    send_forward_recv_backward), on the two ranks' pair group, with mint.distributed: the
    pipeline's hops, between compiled graphs (on the CPU, cpu_exchange)."""
    group = get_state().pair_groups[peer_global_rank]
    _record("pp_pair", "exchange", t.shape, t.dtype, group)
    if ms.get_context("device_target") == "CPU":
        return cpu_exchange(t, peer_global_rank, group)
    out = mint.zeros(t.shape, dtype=t.dtype)
    ops_ = [dist.P2POp(dist.isend, t.contiguous(), peer_global_rank, group=group),
            dist.P2POp(dist.irecv, out, peer_global_rank, group=group)]
    for handle in dist.batch_isend_irecv(ops_):
        handle.wait()
    return out


# ----------------------------------------------------------------------------- on the CPU
# MindSpore's CPU backend compiles only the AllReduce primitive (a sum, on any group) and has no
# send/recv: every other collective is built from what it has, with the same results as the
# native ones (a sum of zero-padded pieces gathers), at up to n times their traffic.
class CpuCollectives(Collectives):
    """Collectives whose all-gather is an AllReduce of a zero buffer holding this rank's slice,
    and whose reduce-scatter, all-to-all and max are built from it. With --cpu-collectives
    shared_memory the sum is backends/shared_memory.py's, for the workers of one machine."""

    def build(self, group, size):
        """Nothing beside the sum, which may go through shared memory instead, with the ring's
        steps one block each way."""
        self.shared = _BACKEND["cpu_collectives"] == "shared_memory"
        if self.shared:
            self.sum = shared_memory.all_reduce_op(group, size, self.rank)
            self.step_on = shared_memory.send_recv_op(group, size, self.rank, 1)
            self.step_back = shared_memory.send_recv_op(group, size, self.rank, -1)

    def _send_recv(self, x, step):
        """Through shared memory, one block moved; with MindSpore's all-reduce, an all-gather
        (Collectives._send_recv)."""
        if self.shared:
            return self.step_on(x) if step == 1 else self.step_back(x)
        return Collectives._send_recv(self, x, step)

    def _max(self, x):
        return self._gather(x.expand_dims(0), 0).max(axis=0)     # the max of the gathered

    def _gather(self, x, dim):
        pieces = [x if i == self.rank else ops.zeros_like(x) for i in range(self.size)]
        return self.sum(ops.cat(pieces, dim))

    def _all_to_all(self, x, scatter_dim, gather_dim):
        """An all-gather along gather_dim, then this rank's piece of scatter_dim."""
        whole = self._gather(x, gather_dim)
        return ops.split(whole, x.shape[scatter_dim] // self.size, scatter_dim)[self.rank]

    def _reduce_scatter(self, x, dim):
        """An all-reduce, then this rank's slice."""
        return ops.split(self.sum(x), x.shape[dim] // self.size, dim)[self.rank]


def cpu_exchange(t, peer_global_rank, group):
    """parallel.exchange on the CPU: one all-gather over the pair (mint's, or the pair's
    CpuCollectives' through shared memory), the peer's half kept."""
    peer = group_ranks(group).index(peer_global_rank)
    if _BACKEND["cpu_collectives"] == "shared_memory":
        return collectives(group)._gather(t.expand_dims(0), 0)[peer]      # [2, ...] -> [...]
    bufs = [mint.zeros(t.shape, dtype=t.dtype) for _ in range(2)]
    dist.all_gather(bufs, t, group=group)
    return bufs[peer]


# ============================================================================ mappings (f, g)
# The halves of the mappings: functions (comm, x, dim) -> tensor, a Mapping's forward and
# backward.
def _identity(comm, x, dim):
    return x


def _all_reduce(comm, x, dim):
    return comm.all_reduce(x)


def _all_gather(comm, x, dim):               # [.., d, ..] -> [.., n*d, ..]
    return comm.all_gather(x, dim)


def _reduce_scatter(comm, x, dim):           # [.., n*d, ..] -> [.., d, ..], summed
    return comm.reduce_scatter(x, dim)


def _keep_own(comm, x, dim):                 # [.., n*d, ..] -> [.., d, ..], no communication
    return ops.split(x, x.shape[dim] // comm.size, dim)[comm.rank]


def _sequence_to_heads(comm, x, dim):        # [s/n, b, heads, d] -> [s, b, heads/n, d]
    return comm.all_to_all(x, 2, 0)


def _heads_to_sequence(comm, x, dim):        # [s, b, heads/n, d] -> [s/n, b, heads, d]
    return comm.all_to_all(x, 0, 2)


class Mapping(nn.Cell):
    """One of Megatron's autograd functions: `fwd` in construct, `bwd` on the gradient in bprop
    (each one of the functions above), along `dim`, over `group` (default: the current TP group);
    identity for one rank. Build one with the factories below, which bear Megatron's names.
    Call each instance once per model pass: inside ms.jit (MindSpore 2.10) two calls of one
    custom-bprop Cell in a graph get wrong gradients, so every call site owns its Mapping."""

    def __init__(self, fwd, bwd, dim, group=None):
        super().__init__()
        self.fwd, self.bwd, self.dim = fwd, bwd, dim
        self.collectives = collectives(group)

    def construct(self, x):
        return self.fwd(self.collectives, x, self.dim % x.ndim)

    def bprop(self, x, out, dout):
        return (self.bwd(self.collectives, dout, self.dim % dout.ndim),)


# Megatron's names (megatron/core/tensor_parallel/mappings.py), each a new Mapping.
def copy_to_tensor_model_parallel_region(group=None):
    """f: forward identity, backward all-reduce (the input of a column-parallel layer)."""
    return Mapping(_identity, _all_reduce, 0, group)


def reduce_from_tensor_model_parallel_region(group=None):
    """g: forward all-reduce, backward identity (the output of a row-parallel layer)."""
    return Mapping(_all_reduce, _identity, 0, group)


def gather_from_tensor_model_parallel_region(group=None):
    """Forward all-gather of the last dim [.., d/n] -> [.., d], backward this rank's slice."""
    return Mapping(_all_gather, _keep_own, -1, group)


def scatter_to_tensor_model_parallel_region(group=None):
    """Forward this rank's slice of the last dim [.., d] -> [.., d/n], backward all-gather."""
    return Mapping(_keep_own, _all_gather, -1, group)


def scatter_to_sequence_parallel_region(group=None):
    """Forward this rank's slice of the sequence [s, ..] -> [s/n, ..], backward all-gather."""
    return Mapping(_keep_own, _all_gather, 0, group)


def gather_from_sequence_parallel_region(group=None):
    """f~: forward all-gather of the sequence [s/n, ..] -> [s, ..], backward reduce-scatter."""
    return Mapping(_all_gather, _reduce_scatter, 0, group)


def reduce_scatter_to_sequence_parallel_region(group=None):
    """g~: forward reduce-scatter of the sequence [s, ..] -> [s/n, ..], backward all-gather."""
    return Mapping(_reduce_scatter, _all_gather, 0, group)


# the model's edges (gpt.GPTModel): a mapping where the layout needs it, else the identity
def sequence_parallel_scatter():
    """The embedding's output [s, b, h] -> this rank's [s/tp, b, h] under sequence parallelism
    (Megatron's LanguageModelEmbedding scatters it), unchanged without."""
    return scatter_to_sequence_parallel_region() if get_state().sequence_parallel else nn.Identity()


def tensor_parallel_gather():
    """The logits [s, b, V/tp] of inference -> [s, b, V], gathered over TP; one rank's as
    they are."""
    return gather_from_tensor_model_parallel_region() if get_state().tp > 1 else nn.Identity()


# DeepSpeed-Ulysses (context_parallel.py): each all-to-all's backward is the other one
def all_to_all_sequence_to_heads(group=None):
    """Forward [s/n, b, heads, d] -> [s, b, heads/n, d], backward the inverse all-to-all."""
    return Mapping(_sequence_to_heads, _heads_to_sequence, 0, group)


def all_to_all_heads_to_sequence(group=None):
    """Forward [s, b, heads/n, d] -> [s/n, b, heads, d], backward the inverse all-to-all."""
    return Mapping(_heads_to_sequence, _sequence_to_heads, 0, group)


# ==================================================================== tensor-parallel layers
def mark_sequence_parallel(params, sequence_parallel):
    """With sequence parallelism, mark parameters replicated over TP that see only this rank's
    sequence shard [s/tp, b, h] (the norms, the row-parallel linears' biases, a router): each
    rank's gradient is a partial sum, all-reduced over TP (distributed.finalize_model_grads)."""
    if sequence_parallel:
        for param in params:
            param.sequence_parallel = True


def shard(full, dim, rank, size, chunks=1):
    """This rank's slice of a full master weight along dim. With chunks > 1 (fc1's [gate; up])
    each of the `chunks` blocks is split separately and the slices are concatenated."""
    return np.concatenate([np.split(block, size, axis=dim)[rank]
                           for block in np.split(full, chunks, axis=dim)], axis=dim)


class ColumnParallelLinear(nn.Cell):
    """Y = X A with A split by columns: A = [A_1 .. A_n], rank i computes Y_i = X A_i.
    Weight [out/tp, in]; input [s, b, in] through f (or [s/tp, b, in] through f~ with sequence
    parallelism); output [s, b, out/tp], or [s, b, out] with gather_output. skip_bias_add
    (Megatron's): (output without the bias, the bias or None), for what follows to add it.
    `forms`: its (matmul, bias_add), plain_forms' unless given. Without `own_weight`
    (Megatron's skip_weight_param_allocation) it is called with the weight to use."""

    def __init__(self, in_features, out_features, bias=True, gather_output=False,
                 sequence_parallel=False, chunks=1, skip_bias_add=False, forms=None,
                 own_weight=True):
        super().__init__()
        state = get_state()
        self.skip_bias_add = skip_bias_add
        if sequence_parallel:
            self.enter = gather_from_sequence_parallel_region()                  # f~
        else:
            self.enter = copy_to_tensor_model_parallel_region()                  # f
        self.gather_output = None
        if gather_output:
            self.gather_output = gather_from_tensor_model_parallel_region()
        self.weight = None
        if own_weight:
            self.weight = zero_param((out_features // state.tp, in_features), "weight", 0, chunks)
        self.bias = zero_param((out_features // state.tp,), "bias", 0, chunks) if bias else None
        self.matmul, self.bias_add = forms or plain_forms()

    def construct(self, x, weight=None):
        x = self.enter(x)                                                # [s, b, in]
        weight = self.weight if weight is None else weight               # [out/tp, in]
        bias = None if self.skip_bias_add else self.bias
        y = linear(x, weight, bias, self.matmul, self.bias_add)          # [s, b, out/tp]
        if self.gather_output is not None:
            y = self.gather_output(y)                                    # [s, b, out]
        return (y, self.bias) if self.skip_bias_add else y


class RowParallelLinear(nn.Cell):
    """Y = X A with A split by rows: A = [A_1; ..; A_n], X = [X_1 .. X_n], Y = sum_i X_i A_i
    through g (or g~ with sequence parallelism). Weight [out, in/tp]; input [s, b, in/tp];
    output [s, b, out] (or [s/tp, b, out]); the bias is added once, after the reduction, or
    with skip_bias_add returned beside the reduced output for what follows to add once.
    `forms`: its (matmul, bias_add), plain_forms' unless given. Sequence parallelism takes a
    parallel input (Megatron's rule)."""

    def __init__(self, in_features, out_features, bias=True, input_is_parallel=True,
                 sequence_parallel=False, skip_bias_add=False, forms=None):
        super().__init__()
        state = get_state()
        self.skip_bias_add = skip_bias_add
        self.scatter_input = None
        if not input_is_parallel:
            self.scatter_input = scatter_to_tensor_model_parallel_region()
        if sequence_parallel:
            self.reduce = reduce_scatter_to_sequence_parallel_region()           # g~
        else:
            self.reduce = reduce_from_tensor_model_parallel_region()             # g
        self.weight = zero_param((out_features, in_features // state.tp), "weight", 1)
        self.bias = zero_param((out_features,), "bias") if bias else None
        if bias:
            mark_sequence_parallel([self.bias], sequence_parallel)
        self.matmul, self.bias_add = forms or plain_forms()

    def construct(self, x):
        if self.scatter_input is not None:
            x = self.scatter_input(x)                                    # [s, b, in/tp]
        # [s, b, out], or [s/tp, b, out] with sequence parallelism
        y = self.reduce(linear(x, self.weight, None, self.matmul))
        if self.skip_bias_add:
            return y, self.bias
        if self.bias is None:
            return y
        flat = self.bias_add(y.reshape(-1, y.shape[-1]), self.bias)
        return flat.reshape(y.shape)


class VocabParallelEmbedding(nn.Cell):
    """Embedding table split by vocabulary rows: rank i holds ids [i*V/tp, (i+1)*V/tp). Ids
    [b, s] outside that range look up row 0 and are zeroed; g sums the ranks -> [b, s, h]."""

    def __init__(self, num_embeddings, embedding_dim):
        super().__init__()
        state = get_state()
        per_rank = num_embeddings // state.tp
        self.start, self.end = state.tp_rank * per_rank, (state.tp_rank + 1) * per_rank
        self.reduce = reduce_from_tensor_model_parallel_region()
        self.weight = zero_param((per_rank, embedding_dim), "weight", 0)

    def construct(self, ids):
        outside = (ids < self.start) | (ids >= self.end)                 # [b, s]
        local = ops.where(outside, ops.zeros_like(ids), ids - self.start)
        emb = ops.gather(self.weight, local, 0)                          # [b, s, h]
        emb = emb * (~outside).astype(emb.dtype).expand_dims(-1)
        return self.reduce(emb)


def _vocab_target(logits, labels, rank):
    """(local target index [n], mask [n] True where the label is on another rank) for this
    rank's logits [n, V/tp]."""
    per_rank = logits.shape[-1]
    start = rank * per_rank
    outside = (labels < start) | (labels >= start + per_rank)
    return ops.where(outside, ops.zeros_like(labels), labels - start), outside


class VocabParallelCrossEntropy(nn.Cell):
    """Megatron's vocab-parallel cross-entropy from this rank's logits [n, V/tp] (fp32) and the
    labels [n] (int32) -> loss [n]: three all-reduces forward (MAX of the row max, SUM of exp,
    SUM of the target logit), none backward. The sums go through g (identity backward), so
    autodiff yields Megatron's backward, softmax - one_hot on this rank's columns; the max only
    keeps exp in range and carries no gradient."""

    def __init__(self, group=None):
        super().__init__()
        self.collectives = collectives(group)
        self.reduce_sum_exp = reduce_from_tensor_model_parallel_region(group)
        self.reduce_target = reduce_from_tensor_model_parallel_region(group)

    def construct(self, logits, labels):
        row_max = self.collectives.all_reduce_max(ops.stop_gradient(logits.max(axis=-1)))      # [n]
        z = logits - row_max.expand_dims(-1)                                             # [n, V/tp]
        local, outside = _vocab_target(logits, labels, self.collectives.rank)
        predicted = ops.gather_elements(z, 1, local.expand_dims(-1)).squeeze(-1)         # [n]
        predicted = predicted * (~outside).astype(z.dtype)
        return ops.log(self.reduce_sum_exp(ops.exp(z).sum(-1))) - self.reduce_target(predicted)



def tensor_parallel_spec(spec, sequence_parallel):
    """A layer spec (gpt.LayerSpec) with TP's layers in place of one rank's: the column- and
    row-parallel linears (f and g, or f~ and g~ with sequence parallelism), the embedding split
    over the vocabulary and its cross-entropy, and with sequence parallelism the norms marked
    (sequence_parallel_norm). Megatron's local spec holds these layers at any TP size."""
    return replace(
        spec, column_linear=functools.partial(ColumnParallelLinear,
                                              sequence_parallel=sequence_parallel),
        row_linear=functools.partial(RowParallelLinear, sequence_parallel=sequence_parallel),
        embedding=VocabParallelEmbedding, cross_entropy=VocabParallelCrossEntropy,
        norm=sequence_parallel_norm(spec.norm) if sequence_parallel else spec.norm)


def sequence_parallel_norm(norm):
    """A builder of `norm`'s norms, their parameters marked: norms are replicated over TP, and
    under sequence parallelism each rank normalises its own sequence shard [s/tp, b, h], so its
    gradient is a partial sum (mark_sequence_parallel)."""
    def build(*args):
        built = norm(*args)
        mark_sequence_parallel(built.get_parameters(), True)
        return built
    return build

if __name__ == "__main__":          # imported by train.py, not a script
    raise SystemExit("error: parallel.py is a library: run `bash run.sh` (bash run.sh --help "
                     "lists the commands)")
