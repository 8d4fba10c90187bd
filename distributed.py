"""Data parallelism as Megatron-core's megatron/core/distributed/ does it, the side of a step
between the backward and the optimizer (optimizer.py):
    GradBuffer               ParamAndGradBuffer (param_and_grad_buffer.py): the gradients of a
                             group of parameters in one flat buffer, cut into buckets
    DistributedDataParallel  distributed_data_parallel.py without overlap: each bucket divided by
                             the DP size and all-reduced over its data-parallel group, or, for the
                             distributed optimizer, reduce-scattered so each rank keeps its shard
    finalize_model_grads     finalize_model_grads.py: every reduction of a step's gradients, in
                             order
The dense parameters are reduced over DP x CP, the experts over the expert-data-parallel group
(moe.py), each group through its own buffer (Megatron's buffers and expert_parallel_buffers).
"""

import numpy as np
from mindspore import ops

import moe
from parallel import collectives, get_state


class GradBuffer:
    """Megatron's ParamAndGradBuffer, rebuilt each step from the accumulated gradients.

    Parameter i owns elements [offsets[i], offsets[i] + numel_i) of one flat buffer, in order.
    The buffer is cut into buckets of about `bucket_size` elements along parameter boundaries,
    each padded to a multiple of `group_size` so that it splits into equal shards, one per rank
    of the data-parallel `group` that reduces it (DP x CP ranks for the dense parameters, the
    expert-data-parallel group for experts): the shard a distributed optimizer owns on each rank.
    `rank` is this process' place in `group`; checkpoint conversion builds buffers of other
    layouts without a group, only to read their shards."""

    def __init__(self, params, group_size, bucket_size=None, group=None, rank=0,
                 gradient_scaling_factor=1.0):
        self.shapes = [tuple(param.shape) for param in params]
        sizes = [int(np.prod(s)) for s in self.shapes]
        self.offsets, self.buckets = [], []            # buckets: (start, end) in the buffer
        start = position = 0
        for i, n in enumerate(sizes):
            self.offsets.append(position)
            position += n
            last = i == len(sizes) - 1
            if last or (bucket_size and position - start >= bucket_size):
                end = start + -(-(position - start) // group_size) * group_size
                self.buckets.append((start, end))
                start = position = end
        self.numel, self.sizes, self.group_size = position, sizes, group_size
        self.group, self.rank = group, rank
        self.gradient_scaling_factor = gradient_scaling_factor

    def flatten(self, tensors):
        """list of tensors shaped like the params, one dtype -> flat [numel] in it, zeros in the
        padding."""
        pieces, position, dtype = [], 0, tensors[0].dtype
        for t, offset, n in zip(tensors, self.offsets, self.sizes):
            if offset > position:
                pieces.append(ops.zeros(offset - position, dtype))
            pieces.append(t.reshape(-1))
            position = offset + n
        if self.numel > position:
            pieces.append(ops.zeros(self.numel - position, dtype))
        return ops.cat(pieces)

    def unflatten(self, flat):
        """flat [numel] -> new tensors shaped like the params. A slice is a view of the whole
        buffer in MindSpore, which in-place kernels (copy_) refuse once reshaped: copy it."""
        return [flat[o:o + n].reshape(s).copy()
                for o, n, s in zip(self.offsets, self.sizes, self.shapes)]

    def shard_ranges(self, rank):
        """The (start, end) ranges of the buffer that `rank` owns: its 1/group_size of every
        bucket."""
        n = self.group_size
        return [(b0 + rank * (b1 - b0) // n, b0 + (rank + 1) * (b1 - b0) // n)
                for b0, b1 in self.buckets]

    def pieces(self, rank):
        """(bucket, param index, start, end) of each overlap of a parameter with `rank`'s shard
        of a bucket, start and end in the buffer: what a distributed optimizer updates."""
        out = []
        for b, (s0, s1) in enumerate(self.shard_ranges(rank)):
            for i, (o, n) in enumerate(zip(self.offsets, self.sizes)):
                lo, hi = max(s0, o), min(s1, o + n)
                if lo < hi:
                    out.append((b, i, lo, hi))
        return out

    def all_reduce(self, grads):
        """The gradients multiplied by gradient_scaling_factor (1 / DP) and summed over `group`,
        one all-reduce per bucket, in the gradients' dtype (Megatron's DDP without overlap: it
        scales before the sum, which keeps a float16 sum in range). Experts with EP = DP x CP
        have a group of one rank: their gradients are still divided by the DP size."""
        if self.group_size == 1 and self.gradient_scaling_factor == 1.0:
            return grads
        flat = self.flatten(grads) * self.gradient_scaling_factor
        reduced = [collectives(self.group).all_reduce(flat[b0:b1]) for b0, b1 in self.buckets]
        return self.unflatten(ops.cat(reduced))

    def reduce_scatter(self, grads):
        """The gradients scaled as all_reduce's and reduce-scattered over `group`: this rank's
        pieces (`pieces(rank)`), one flat tensor each, in the gradients' dtype."""
        flat = self.flatten(grads) * self.gradient_scaling_factor
        shards = [collectives(self.group).reduce_scatter(flat[b0:b1]) for b0, b1 in self.buckets]
        starts = [s0 for s0, _ in self.shard_ranges(self.rank)]
        return [shards[b][lo - starts[b]:hi - starts[b]] for b, _, lo, hi in self.pieces(self.rank)]


class DistributedDataParallel:
    """Megatron's DistributedDataParallel without overlap: `buffers`, one GradBuffer per group
    of parameters reduced together, each with `positions`, its parameters' places in the model's
    parameter order (the dense parameters, then the experts'). reduce_grads all-reduces each
    buffer, or with `reduce_scatter` (the distributed optimizer) reduce-scatters it."""

    def __init__(self, buffers, positions, reduce_scatter=False):
        self.buffers, self.positions = buffers, positions
        self.reduce_scatter = reduce_scatter

    def reduce_grads(self, grads):
        """The model's gradients (one per parameter) -> what the optimizer takes: per buffer the
        reduced gradients of its parameters, or this rank's pieces of them; one list with one
        buffer, a list per buffer for a ChainedOptimizer."""
        reduced = []
        for buffer, positions in zip(self.buffers, self.positions):
            mine = [grads[i] for i in positions]
            reduced.append(buffer.reduce_scatter(mine) if self.reduce_scatter
                           else buffer.all_reduce(mine))
        return reduced[0] if len(reduced) == 1 else reduced


def finalize_model_grads(grads, params, state, ddp, model=()):
    """Megatron's finalize_model_grads (megatron/core/distributed/finalize_model_grads.py): every
    reduction of a step's gradients, after the last backward, in the gradients' dtype (Megatron's
    main_grad: float32 with accumulate_allreduce_grads_in_fp32 or float32 parameters, else the
    parameters' half precision):
      1. sequence parallelism: norm weights and row-parallel biases saw only this rank's shard of
         the sequence, so their gradients (marked `sequence_parallel`) are all-reduced over TP;
      2. tied embeddings over pipeline stages: the first stage's word embedding and the last
         stage's output-layer copy (marked `shared_embedding`) are all-reduced over the embedding
         group, so both copies take the same step and stay equal;
      3. data parallelism (`ddp`, DistributedDataParallel.reduce_grads): summed over CP (each cp
         rank's gradient is its tokens' share of the loss, see gpt.GPTModel) and averaged over
         DP, one all-reduce over the DP x CP group per bucket of the contiguous buffer, or, with
         the distributed optimizer, reduce-scattered to this rank's pieces; experts' gradients
         over the expert-data-parallel group instead;
      4. the routers' expert biases of `model` (this rank's model chunks) from the step's tokens
         per expert (moe.update_expert_bias; no gradient).
    `state` is the current parallel.ParallelState. Returns the gradients the optimizer takes."""
    grads = [collectives(state.tp_group).all_reduce(g)
             if getattr(param, "sequence_parallel", False) else g
             for g, param in zip(grads, params)]
    grads = [collectives(state.embedding_group).all_reduce(g)
             if getattr(param, "shared_embedding", False) else g
             for g, param in zip(grads, params)]
    moe.update_expert_bias(model, state)
    return ddp.reduce_grads(grads)


def build_data_parallel(cfg, model, state=None):
    """Megatron's DistributedDataParallel for a model or a list of model chunks (their parameters
    in order): the dense parameters' gradients in a buffer reduced over the DP x CP group, the
    experts' (marked `allreduce = False`, Megatron's mark: moe.expert_linear) in one over the
    expert-data-parallel group; both divided by the DP size (averaged over DP, summed over CP:
    gpt.GPTModel's loss); reduce-scattered for the distributed optimizer
    (use_distributed_optimizer with several DP x CP ranks), else all-reduced."""
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
    buffers = [GradBuffer([params[i] for i in positions], bucket_size=bucket_size,
                          gradient_scaling_factor=scale, **group)
               for positions, group in groups]
    reduce_scatter = cfg.training_config.use_distributed_optimizer and dp_cp > 1
    return DistributedDataParallel(buffers, [positions for positions, _ in groups],
                                   reduce_scatter)


if __name__ == "__main__":          # imported by train.py, not a script
    raise SystemExit("error: distributed.py is a library: run `bash run.sh` (bash run.sh --help "
                     "lists the commands)")
