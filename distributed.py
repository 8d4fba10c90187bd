"""Data parallelism as Megatron-core's megatron/core/distributed/ does it, the side of a step
between the backward and the optimizer (optimizer.py):
    BucketLayout             ParamAndGradBuffer (param_and_grad_buffer.py): where the gradients
                             of a group of parameters lie in one flat buffer, cut into buckets
    DistributedDataParallel  distributed_data_parallel.py: each bucket divided by the DP size
                             and all-reduced over its data-parallel group, or, for the
                             distributed optimizer, reduce-scattered so each rank keeps its shard
    finalize_model_grads     finalize_model_grads.py: every reduction of a step's gradients, in
                             order
and Megatron's overlap (--overlap-grad-reduce): OverlappedDistributedDataParallel starts each
bucket's collective once the backward has made its gradients final, which the schedule
(pipeline.ForwardBackward) reports piece by piece (grad_sync_func).
The dense parameters are reduced over DP x CP, the experts over the expert-data-parallel group
(moe.py), each group through its own buffer (Megatron's buffers and expert_parallel_buffers).
"""

import contextlib
from typing import NamedTuple

import numpy as np
from mindspore import ops

import gpt
import moe
from parallel import collectives, get_state
from settings.config import sharded_by_fsdp


class ShardPiece(NamedTuple):
    """The overlap of one parameter with one rank's shard of one bucket: what a distributed
    optimizer updates as one flat tensor."""
    bucket: int             # the bucket's index in the layout
    param: int              # the parameter's index in the layout's parameters
    start: int              # where the overlap starts in the flat buffer
    end: int                # where it ends (exclusive)


class BucketLayout:
    """The layout of Megatron's ParamAndGradBuffer for a group of parameters: where each
    parameter's gradient lies in one flat buffer, the buffer's buckets, and each rank's shard of
    them. The layout holds no buffer: reduce_bucket builds a bucket's flat gradients from the
    step's accumulated gradients when it reduces them.

    Parameter i owns elements [offsets[i], offsets[i] + numel_i) of the flat buffer, in order.
    The buffer is cut into buckets of about `bucket_size` elements along parameter boundaries,
    each padded to a multiple of `group_size` so that it splits into equal shards, one per rank
    of the data-parallel `group` that reduces it (DP x CP ranks for the dense parameters, the
    expert-data-parallel group for experts): the shard a distributed optimizer owns on each rank.
    `rank` is this process' place in `group`; checkpoint conversion builds layouts for other
    data-parallel sizes without a group, only to read their shards. Megatron-FSDP cuts the
    buffer by its units instead (`units`: how many parameters each holds, in order; fsdp_units):
    one bucket per unit, gathered and reduce-scattered alone."""

    def __init__(self, params, group_size, bucket_size=None, group=None, rank=0,
                 gradient_scaling_factor=1.0, units=None):
        self.shapes = [tuple(param.shape) for param in params]
        sizes = [int(np.prod(s)) for s in self.shapes]
        unit_ends = set(np.cumsum(units).tolist()) if units else set()
        self.offsets, self.buckets = [], []            # buckets: (start, end) in the buffer
        start = position = 0
        for i, n in enumerate(sizes):
            self.offsets.append(position)
            position += n
            last = i == len(sizes) - 1
            if units:
                full = i + 1 in unit_ends
            else:
                full = bucket_size and position - start >= bucket_size
            if last or full:
                end = start + -(-(position - start) // group_size) * group_size
                self.buckets.append((start, end))
                start = position = end
        self.sizes, self.group_size = sizes, group_size
        self.group, self.rank = group, rank
        self.gradient_scaling_factor = gradient_scaling_factor

    def shard_ranges(self, rank):
        """The (start, end) ranges of the buffer that `rank` owns: its 1/group_size of every
        bucket."""
        n = self.group_size
        return [(b0 + rank * (b1 - b0) // n, b0 + (rank + 1) * (b1 - b0) // n)
                for b0, b1 in self.buckets]

    def pieces(self, rank):
        """The ShardPieces of `rank`: each overlap of a parameter with its shard of a bucket,
        bucket by bucket, in the parameters' order."""
        out = []
        for b, (s0, s1) in enumerate(self.shard_ranges(rank)):
            for i, (o, n) in enumerate(zip(self.offsets, self.sizes)):
                start, end = max(s0, o), min(s1, o + n)
                if start < end:
                    out.append(ShardPiece(b, i, start, end))
        return out

    def bucket_params(self, b):
        """The indices of the parameters in bucket b (buckets end on parameter boundaries)."""
        b0, b1 = self.buckets[b]
        return [i for i, o in enumerate(self.offsets) if b0 <= o < b1]

    def reduce_bucket(self, b, grads, scatter=False):
        """Bucket b's gradients (one per bucket_params(b)) multiplied by gradient_scaling_factor
        (1 / DP; before the sum, as Megatron's DDP: a float16 sum stays in range) and summed over
        `group` in one collective: all-reduced, the new gradients, or with `scatter`
        reduce-scattered, this rank's pieces of the bucket (pieces(rank) in bucket b, flat).
        Experts with EP = DP x CP have a group of one rank: still divided by the DP size."""
        if not scatter and self.group_size == 1 and self.gradient_scaling_factor == 1.0:
            return grads                                          # one rank: nothing to reduce
        (b0, b1), params = self.buckets[b], self.bucket_params(b)
        end = self.offsets[params[-1]] + self.sizes[params[-1]]
        padding = [ops.zeros(b1 - end, grads[0].dtype)] if b1 > end else []
        flat = ops.cat([g.reshape(-1) for g in grads] + padding) * self.gradient_scaling_factor
        if not scatter:
            flat = collectives(self.group).all_reduce(flat)                      # [b1 - b0]
            return [flat[self.offsets[i] - b0:self.offsets[i] - b0 + self.sizes[i]]
                    .reshape(self.shapes[i]) for i in params]
        shard = collectives(self.group).reduce_scatter(flat)         # [(b1 - b0) / group_size]
        s0 = self.shard_ranges(self.rank)[b][0]
        return [shard[piece.start - s0:piece.end - s0] for piece in self.pieces(self.rank)
                if piece.bucket == b]


class DistributedDataParallel:
    """Megatron's DistributedDataParallel: `buffers` (Megatron's name), one BucketLayout per
    group of parameters reduced together, each with `positions`, its parameters' places in the
    model's parameter order (the dense parameters, then the experts'). reduce_grads all-reduces
    each bucket, or with `reduce_scatter` (the distributed optimizer) reduce-scatters it, last
    bucket first (the backward's order), each inside `phase(("R", bucket, buffer))` (what
    observes it: a timeline). OverlappedDistributedDataParallel starts them during the
    backward."""

    every_backward = False          # Megatron-FSDP's: each micro-batch's gradients handed over

    def __init__(self, buffers, positions, reduce_scatter=False, phase=contextlib.nullcontext):
        self.buffers, self.positions = buffers, positions
        self.reduce_scatter, self.phase = reduce_scatter, phase

    def is_ready(self, position):
        """Whether the gradient of the model's parameter `position` was reduced already."""
        return False

    def reduce_grads(self, grads):
        """The model's gradients (one per parameter) -> what the optimizer takes: one list per
        buffer (a ChainedOptimizer's optimizer each), the reduced gradients of its parameters,
        or with `reduce_scatter` this rank's pieces of them (its ShardPieces)."""
        reduced = []
        for k, (buffer, positions) in enumerate(zip(self.buffers, self.positions)):
            mine = [grads[i] for i in positions]
            buckets = {b: self._reduce_bucket(k, b, [mine[i] for i in buffer.bucket_params(b)])
                       for b in reversed(range(len(buffer.buckets)))}
            reduced.append([g for b in range(len(buffer.buckets)) for g in buckets[b]])
        return reduced

    def _reduce_bucket(self, k, b, grads):
        with self.phase(("R", b, k)):
            return self.buffers[k].reduce_bucket(b, grads, self.reduce_scatter)


def reduced_over_model_parallel(grad, param, state):
    """A gradient with what it needs before the data-parallel reduction: summed over TP if its
    parameter saw only this rank's shard of the sequence (marked `sequence_parallel`: norm
    weights and row-parallel biases under sequence parallelism), and over the embedding group if
    it is one of the tied embedding's two copies (marked `shared_embedding`: the first stage's
    word embedding, the last stage's output layer), so both take one step."""
    if getattr(param, "sequence_parallel", False):
        grad = collectives(state.tp_group).all_reduce(grad)
    if getattr(param, "shared_embedding", False):
        grad = collectives(state.embedding_group).all_reduce(grad)
    return grad


def finalize_model_grads(grads, params, state, ddp, model=()):
    """Megatron's finalize_model_grads (megatron/core/distributed/finalize_model_grads.py): every
    reduction of a step's gradients not done during the backward, in the gradients' dtype
    (Megatron's main_grad: float32 with accumulate_allreduce_grads_in_fp32 or float32
    parameters, else the parameters' half precision): 1. over TP under sequence parallelism,
    over the embedding group for the tied embedding's copies (reduced_over_model_parallel);
    2. the expert biases of `model`'s routers (this rank's chunks) from the step's tokens per
    expert (moe.update_expert_bias); 3. data parallelism (`ddp.reduce_grads`): summed over CP
    (each cp rank's gradient is its tokens' share of the loss, see gpt.GPTModel) and averaged
    over DP, one all-reduce over the DP x CP group per bucket, or, with the distributed
    optimizer, reduce-scattered to this rank's pieces; experts' over the expert-data-parallel
    group. `state` is the current parallel.ParallelState. Returns what the optimizer takes: one
    list of gradients per buffer of `ddp`."""
    grads = [grad if ddp.is_ready(i) else reduced_over_model_parallel(grad, param, state)
             for i, (grad, param) in enumerate(zip(grads, params))]
    moe.update_expert_bias(model, state)
    return ddp.reduce_grads(grads)


# ============================================================================ Megatron's overlap
# With overlap_grad_reduce a bucket's collective starts as soon as the backward has made its
# gradients final, while the backward goes on (on a device; this CPU runs collectives in the
# same queue as computation: docs/parallel.md, Megatron's overlap). The values are the same.
class OverlappedDistributedDataParallel(DistributedDataParallel):
    """DistributedDataParallel with overlap_grad_reduce: register_grad_ready (Megatron's, called
    from its backward hooks, here by the schedule: grad_sync_func) keeps a gradient final for the
    step and starts the collective of the bucket it completes (Megatron's start_grad_sync of
    that bucket); reduce_grads (finish_grad_sync) registers the rest, reduces the buckets not
    started, last first, and returns reduce_grads' result."""

    def __init__(self, buffers, positions, reduce_scatter=False, phase=contextlib.nullcontext):
        super().__init__(buffers, positions, reduce_scatter, phase)
        # model position -> (buffer, parameter index in it)
        self.place = {p: (k, i) for k, ps in enumerate(positions) for i, p in enumerate(ps)}
        self.bucket_of = [{i: b for b in range(len(buf.buckets)) for i in buf.bucket_params(b)}
                          for buf in buffers]
        self.ready, self.reduced = [{} for _ in buffers], [{} for _ in buffers]

    def is_ready(self, position):
        k, i = self.place[position]
        return i in self.ready[k]

    def register_grad_ready(self, position, grad):
        k, i = self.place[position]
        self.ready[k][i] = grad
        b = self.bucket_of[k][i]
        bucket = self.buffers[k].bucket_params(b)
        if all(j in self.ready[k] for j in bucket):
            self.reduced[k][b] = self._reduce_bucket(k, b, [self.ready[k][j] for j in bucket])

    def reduce_grads(self, grads):
        for position in reversed(range(len(grads))):
            if not self.is_ready(position):
                self.register_grad_ready(position, grads[position])
        out = [[g for b in range(len(buffer.buckets)) for g in self.reduced[k][b]]
               for k, buffer in enumerate(self.buffers)]
        self.ready, self.reduced = [{} for _ in self.buffers], [{} for _ in self.buffers]
        return out


def grad_sync_func(cfg, ddp, params, state):
    """Megatron's grad_sync_func, which the schedule (pipeline.ForwardBackward) calls after a
    piece's last backward with [(position, gradient)] of the parameters it made final, or with
    Megatron-FSDP's ZeRO-2/3 (ddp.every_backward) after each of its backwards with that
    micro-batch's: each handed to `ddp` (reduced over TP first under sequence parallelism),
    whose buckets start as they complete; it returns the positions handed. None where this rank
    does not overlap: without overlap_grad_reduce, and with delay_grad_reduce on the pipeline
    stages after the first, which reduce after the schedule, in the pipeline's bubble. The tied
    embedding's copies wait for finalize_model_grads: their all-reduce joins the first and the
    last stage, which end their backward at different times, and a blocking collective begun by
    one mid-schedule would wait for a stage that first waits for its hops."""
    training_cfg = cfg.training_config
    delayed = training_cfg.delay_grad_reduce and state.pp > 1 and not state.is_first_stage
    if not ddp.every_backward and (not training_cfg.overlap_grad_reduce or delayed):
        return None

    def sync(final):
        handed = []
        for position, grad in final:
            param = params[position]
            if not getattr(param, "shared_embedding", False):
                ddp.register_grad_ready(position,
                                        reduced_over_model_parallel(grad, param, state))
                handed.append(position)
        return handed
    return sync


# ============================================================================ Megatron-FSDP
# ZeRO-2 (Rajbhandari et al. 2020; Megatron-FSDP's optim_grads, and optim_grads_params, whose
# parameters optimizer.ShardedParamOptimizer shards): a unit's gradients of each micro-batch are
# reduce-scattered as soon as its backward has made them, and only this rank's shard is summed
# over the micro-batches: no rank keeps a whole model's gradients between two backwards.
class ShardedGradDataParallel(OverlappedDistributedDataParallel):
    """Megatron-FSDP's gradient side: the schedule hands each backward's gradients of a piece to
    register_grad_ready (grad_sync_func, every micro-batch) and keeps none; a bucket (one FSDP
    unit: fsdp_units) complete for the micro-batch is reduce-scattered at once and its shard
    added to this rank's sum. reduce_grads, after the schedule, reduces what was not handed (the
    tied embedding's copies under pipeline parallelism, summed over the embedding group first
    by finalize_model_grads) and returns the summed shards."""

    every_backward = True

    def __init__(self, buffers, positions, reduce_scatter=True, phase=contextlib.nullcontext):
        super().__init__(buffers, positions, reduce_scatter, phase)
        self.handed = set()                  # positions whose gradients were handed this step

    def is_ready(self, position):
        return position in self.handed

    def register_grad_ready(self, position, grad):
        self.handed.add(position)
        k, i = self.place[position]
        self.ready[k][i] = grad
        b = self.bucket_of[k][i]
        bucket = self.buffers[k].bucket_params(b)
        if all(j in self.ready[k] for j in bucket):
            shard = self._reduce_bucket(k, b, [self.ready[k].pop(j) for j in bucket])
            summed = self.reduced[k].get(b)
            self.reduced[k][b] = (shard if summed is None
                                  else [a + g for a, g in zip(summed, shard)])

    def reduce_grads(self, grads):
        out = super().reduce_grads(grads)
        self.handed = set()
        return out


def data_parallel_class(training_cfg, dp_cp):
    """The DDP class Megatron's get_model wraps the model in (`dp_cp`: DP x CP ranks): with
    Megatron-FSDP's ZeRO-2/3 over several ranks ShardedGradDataParallel; with the overlap
    OverlappedDistributedDataParallel, whose buckets start during the backward; else
    DistributedDataParallel."""
    if any(sharded_by_fsdp(training_cfg)) and dp_cp > 1:
        return ShardedGradDataParallel
    if training_cfg.overlap_grad_reduce:
        return OverlappedDistributedDataParallel
    return DistributedDataParallel


def blocks_per_piece(training_cfg, pp):
    """How many blocks a piece of the schedule holds (gpt.model_pieces) on a rank of `pp` stages:
    on one stage, one with Megatron's overlap (gradients final block by block) or with
    Megatron-FSDP's ZeRO-2/3 (a block is its unit, Megatron's fsdp_unit_modules); else None, the
    whole chunk (a pipeline's pieces are its chunks)."""
    one_by_one = training_cfg.overlap_grad_reduce or any(sharded_by_fsdp(training_cfg))
    return 1 if pp == 1 and one_by_one else None


def fsdp_units(chunks, training_cfg, pp, params, positions):
    """Megatron-FSDP's units of one buffer, as BucketLayout takes them: the parameters at
    `positions` of `params` (the chunks' parameters) in runs that belong to one piece of the
    schedule (blocks_per_piece), a copy of the tied embedding (marked shared_embedding, reduced
    over the embedding group) a unit of its own. Returns each unit's parameter count, in order."""
    pieces = [piece for chunk in chunks
              for piece in gpt.model_pieces(chunk, blocks_per_piece(training_cfg, pp))]
    piece_of = {id(param): k for k, piece in enumerate(pieces) for param in piece.params}
    units, last = [], None
    for i in positions:
        unit = ("tie", i) if getattr(params[i], "shared_embedding", False) else piece_of[
            id(params[i])]
        if units and unit == last:
            units[-1] += 1
        else:
            units.append(1)
        last = unit
    return units


def build_data_parallel(cfg, model, state=None, phase=contextlib.nullcontext,
                        ddp_class=DistributedDataParallel):
    """Megatron's DistributedDataParallel for a model or a list of model chunks (their parameters
    in order), of `ddp_class` (Megatron's get_model chooses it: train.set_up): the dense
    parameters' gradients in a buffer reduced over the DP x CP group, the experts' (marked
    `allreduce = False`, Megatron's mark: moe.expert_linear) in one over the
    expert-data-parallel group; both divided by the DP size (averaged over DP, summed over CP:
    gpt.GPTModel's loss); reduce-scattered for the distributed optimizer
    (use_distributed_optimizer with several DP x CP ranks), else all-reduced. `phase`:
    DistributedDataParallel's."""
    state = state or get_state()
    chunks = model if isinstance(model, list) else [model]
    params = [param for chunk in chunks for param in chunk.get_parameters()]
    expert = [i for i, param in enumerate(params) if not getattr(param, "allreduce", True)]
    dense = [i for i in range(len(params)) if i not in set(expert)]
    bucket_size, scale = cfg.training_config.bucket_size, 1.0 / state.dp
    dp_cp = state.dp * state.cp
    groups = [(dense, dict(group=state.dp_cp_group, group_size=dp_cp, rank=state.dp_cp_rank)),
              (expert, dict(group=state.edp_group, group_size=dp_cp // state.ep,
                            rank=state.edp_rank))]
    groups = [(positions, group) for positions, group in groups if positions]
    reduce_scatter = cfg.training_config.use_distributed_optimizer and dp_cp > 1
    by_units = reduce_scatter and any(sharded_by_fsdp(cfg.training_config))
    buffers = [BucketLayout([params[i] for i in positions], bucket_size=bucket_size,
                            gradient_scaling_factor=scale, **group,
                            units=fsdp_units(chunks, cfg.training_config, state.pp, params,
                                             positions) if by_units else None)
               for positions, group in groups]
    return ddp_class(buffers, [positions for positions, _ in groups], reduce_scatter, phase)


if __name__ == "__main__":          # imported by train.py, not a script
    raise SystemExit("error: distributed.py is a library: run `bash run.sh` (bash run.sh --help "
                     "lists the commands)")
