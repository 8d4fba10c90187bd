"""Context parallelism: every micro-batch's sequence is split over the cp ranks of a group, and
attention, the one place where tokens meet, is computed across them. Everything else in a layer
(norms, MLP, dropout, residuals) works token by token and needs nothing. Three algorithms, named as
MindSpeed names them (parallel_config.context_parallel_algo):

  ulysses_cp_algo   DeepSpeed-Ulysses (Jacobs et al. 2023): an all-to-all before core attention
                    swaps the sequence split for a head split, so each rank attends over the whole
                    sequence with 1/cp of the heads; a second all-to-all swaps back.
  megatron_cp_algo  ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers";
                    Megatron-core's context parallelism): each rank keeps its queries and meets the
                    keys and values of every rank block by block, passed round the ring; the partial
                    softmaxes are merged by their log-sum-exp (online softmax, Milakov &
                    Gimelshein 2018).
  hybrid_cp_algo    USP (Fang & Zhao 2024, "A Unified Sequence Parallelism Approach"): Ulysses
                    inside groups of ulysses_degree_in_cp adjacent cp ranks, the ring across them.
One description covers all three: cp = ring x ulysses,
cp_rank = ring_rank * ulysses + ulysses_rank (ulysses = cp: Ulysses alone; ulysses = 1: the ring
alone).

Which tokens a rank holds (get_batch_on_this_cp_rank): with a ring the sequence is cut into
2 x ring chunks and ring rank r keeps chunks r and 2*ring-1-r. Under the causal mask a query
attends only to earlier keys, so contiguous pieces would give the last rank ring times the work of
the first; the zig-zag pairs an early chunk with a late one and every rank does the same work
(Megatron's load balancing). Each Ulysses rank then keeps a contiguous 1/ulysses of that, so the
Ulysses all-to-all gives back the ring rank's two chunks in order. Positions (absolute embeddings
and RoPE) follow the tokens: position_ids are sliced with them.

The ring, here (cp_comm_type p2p, Megatron's default): each step passes a block of keys and
values to the next ring rank (Collectives.send_recv: through shared memory, one block moved; with
MindSpore's CPU all-reduce, which has no send/recv, an all-gather of which the previous rank's part
is kept), so a rank holds two blocks, and the backward recomputes each block's probabilities as
FlashAttention does and passes the gradients back round. cp_comm_type all_gather gathers every
rank's keys and values first (Megatron-core's other form; AllGatherAttention), holding the whole
sequence's K and V, and lets autograd keep each block's probabilities.
"""
import dataclasses

import numpy as np
from mindspore import nn, ops

from layers import batch_matmul_nt, cast
from parallel import (F32, all_to_all_heads_to_sequence, all_to_all_sequence_to_heads,
                      collectives, gather_from_sequence_parallel_region,
                      reduce_from_tensor_model_parallel_region)
from settings.config import cp_ring_size


# ============================================================================ the split
def cp_token_indices(seq_length, cp, cp_rank, ulysses):
    """Positions [seq_length / cp] of the tokens that cp rank `cp_rank` holds (see above)."""
    ring = cp_ring_size(cp, ulysses)
    ring_rank, ulysses_rank = cp_rank // ulysses, cp_rank % ulysses
    positions = np.arange(seq_length)
    if ring > 1:
        chunks = np.split(positions, 2 * ring)
        positions = np.concatenate([chunks[ring_rank], chunks[2 * ring - 1 - ring_rank]])
    return np.split(positions, ulysses)[ulysses_rank]


def get_batch_on_this_cp_rank(batch, state):
    """Megatron's get_batch_on_this_cp_rank: tokens, labels, loss mask and position ids [b, s] ->
    this rank's [b, s/cp]. An attention mask [b, 1, s, s] stays whole: only Ulysses takes one
    (config.py refuses reset_attention_mask with a ring), and it attends over the whole sequence."""
    if state.cp == 1:
        return batch
    keep = cp_token_indices(batch["tokens"].shape[1], state.cp, state.cp_rank, state.cp_ulysses)
    return {k: v if k == "attention_mask" else v[:, keep] for k, v in batch.items()}


def attention_work(seq_length, ring, balanced=True):
    """Query-key pairs each ring rank computes under the causal mask (the attention work), with
    the zig-zag split or with contiguous pieces: docs/context-parallel.md's load-balance table."""
    work = []
    for r in range(ring):
        if balanced:
            mine = cp_token_indices(seq_length, ring, r, 1)
        else:
            mine = np.split(np.arange(seq_length), ring)[r]
        work.append(int((mine + 1).sum()))             # the query at position p sees p + 1 keys
    return work


# ============================================================================ attention
def attention_scores(q, k, bias, softmax_scale=1.0):
    """float32 scores of one block, q [b, n, sq, d] (scaled by 1/sqrt(d)), k [b, n, sk, d], bias
    None or broadcasting to [b, n, sq, sk] -> [b, n, sq, sk]: the ring's blocks and
    gpt.FlashAttention's (whose backward recomputes them with this same function)."""
    scores = batch_matmul_nt(q, k).astype(F32)
    if softmax_scale != 1.0:
        scores = scores * softmax_scale
    if bias is not None:
        scores = scores + bias
    return scores


def attention_block(q, k, v, bias, dropout, softmax_scale=1.0):
    """One block of attention with its log-sum-exp: q [b, n, sq, d] (already scaled by 1/sqrt(d)),
    k, v [b, n, sk, d], bias None or [b, n, sq, sk] -> (softmax(q k^T + bias) v [b, n, sq, d],
    logsumexp of the scores [b, n, sq, 1]). The scores, softmax and merges are float32 whatever
    the compute dtype; softmax_scale multiplies them there (gpt.CoreAttention's query-key layer
    scaling). The max only keeps exp in range (no gradient)."""
    scores = attention_scores(q, k, bias, softmax_scale)
    top = ops.stop_gradient(scores.max(axis=-1, keepdims=True))
    weights = ops.exp(scores - top)
    total = weights.sum(-1, keepdims=True)
    out = ops.bmm(dropout((weights / total).astype(q.dtype)), v)
    return out, top + ops.log(total)


def merge_partial_attention(a, b):
    """Two attentions of the same queries over disjoint sets of keys -> the attention over both:
    each weighted by its share exp(lse_i - lse) of the total softmax mass (online softmax)."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    high = ops.maximum(lse_a, lse_b)
    lse = high + ops.log(ops.exp(lse_a - high) + ops.exp(lse_b - high))       # float32
    return cast(ops.exp(lse_a - lse) * out_a + ops.exp(lse_b - lse) * out_b, out_a.dtype), lse


def attention_block_grads(query, k, v, bias, softmax_scale=1.0):
    """Gradients of one block from its probabilities recomputed (FlashAttention-2's backward):
    P = exp(S - LSE), dV = P^T dO, dP = dO V^T, dS = P * (dP - D), dQ = dS K, dK = dS^T Q.
    query: its q (scaled by 1/sqrt(d)) and dO [b, n, sq, d], LSE and D = rowsum(dO * O)
    [b, n, sq, 1]; k, v [b, n, sk, d]; bias None or broadcasting to [b, n, sq, sk] ->
    (dq of the scaled q [b, n, sq, d], dk, dv [b, n, sk, d]): the ring's blocks and
    gpt.FlashKernel's."""
    q, do, lse, d = query
    p = ops.exp(attention_scores(q, k, bias, softmax_scale) - lse)            # [b, n, sq, sk]
    d_scores = p * (batch_matmul_nt(do, v).astype(F32) - d)
    d_scores = cast(d_scores * softmax_scale, q.dtype)                        # d(q k^T)
    return (ops.bmm(d_scores, k), ops.bmm(d_scores.swapaxes(-1, -2), q),
            ops.bmm(cast(p, q.dtype).swapaxes(-1, -2), do))


def sum_head_groups(grad, per_group):
    """A gradient [b, n, s, d] over the query heads -> [s, b, g, d]: each key/value group's
    gradient is the sum over the per_group query heads it served (GQA)."""
    b, n, s, d = grad.shape
    return grad.reshape(b, n // per_group, per_group, s, d).sum(2).transpose(2, 0, 1, 3)


def ring_step(parts, qh, k, v, j, rank, bias, block):
    """parts, the (out, lse) of local chunks r and 2R-1-r so far (None before rank r's own
    block, the first), merged with the attention over ring rank j's block: k, v [b, n, S, d],
    the case RingAttention's docstring gives for j; block(q, k, v, bias) -> (out, lse)."""
    half = qh.shape[2] // 2
    if j == rank:
        return _halves(block(qh, k, v, bias), half)
    first, second = parts
    if j < rank:
        a, b = _halves(block(qh, k[:, :, :half], v[:, :, :half], None), half)
        return merge_partial_attention(first, a), merge_partial_attention(second, b)
    return first, merge_partial_attention(second, block(qh[:, :, half:], k, v, None))


def _halves(part, half):
    """(out, lse) of 2 * half queries -> the same of the first half and of the last half."""
    out, lse = part
    return (out[:, :, :half], lse[:, :, :half]), (out[:, :, half:], lse[:, :, half:])


class RingAttention(nn.Cell):
    """Ring attention (Megatron-core's cp_comm_type=p2p, its AttnFuncWithCPAndKVP2P): this
    rank's queries stay; the keys and values travel round the ring group one block at a time,
    and the partial results are merged by their log-sum-exp (merge_partial_attention). A rank
    holds two K/V blocks, the one in hand and the one arriving (RingKernel).

    Which blocks are computed: this rank (ring rank r of R) holds the queries, keys and values of
    chunks r and 2R-1-r (S/2 tokens each); ring rank j holds chunks j and 2R-1-j. Under the
    causal mask chunk a attends to chunk b fully if b < a, with the causal mask if b == a, and
    not at all if b > a, so against rank j's block:
      j == r: both local chunks, with the local causal mask;
      j <  r: both local chunks against chunk j only (S x S/2 scores);
      j >  r: only local chunk 2R-1-r, against both of rank j's chunks (S/2 x S).
    Every rank computes the same number of scores; blocks that would be masked out are skipped."""

    def __init__(self, core, state):
        super().__init__()
        self.kernel = RingKernel(core, state)

    def construct(self, q, k, v, bias):
        """q [S, b, n, d], k, v [S, b, g, d] (S local tokens), bias [b, n, S, S] the causal
        mask of the local tokens -> context [S, b, n, d]."""
        return self.kernel(q, k, v, bias)[0]


class RingKernel(nn.Cell):
    """(context [S, b, n, d], log-sum-exp [b, n, S, 1]) of RingAttention, with its backward.
    Forward: R steps; at step i the block of ring rank r - i is in hand and the next one is
    already on its way (send_recv to rank r + 1 issued before the block is computed, as Megatron
    issues its isend/irecv; on this CPU the transfer is synchronous, so nothing overlaps). The
    backward keeps only q, k, v, the output and the log-sum-exp, as FlashAttention's, and goes
    round the other way (Megatron's order): the blocks in reverse, each block's keys and values
    sent to rank r - 1 with the partial sums of their gradients, which reach the block's owner at
    the last step. Each way R - 1 steps of two blocks: a rank holds two K/V blocks, not the
    sequence's (the attention dropout that a replay would need is refused, settings/config.py)."""

    def __init__(self, core, state):
        super().__init__()
        self.ring, self.rank = state.cp_ring, state.cp_rank // state.cp_ulysses
        self.comm = collectives(state.cp_ring_group)
        self.scale, self.softmax_scale = core.scale, core.softmax_scale
        self.per_group, self.to_heads = core.per_group, core.to_heads

    def construct(self, q, k, v, bias):
        qh = self.to_heads(q * self.scale, 1)                                 # [b, n, S, d]
        block, parts = (k, v), None        # parts: (out, lse) of local chunks r and 2R-1-r
        for step in range(self.ring):
            coming = block
            if step < self.ring - 1:       # the next block travels while this one is computed
                coming = (self.comm.send_recv(block[0]), self.comm.send_recv(block[1]))
            parts = self.attend(qh, block, (self.rank - step) % self.ring, bias, parts)
            block = coming
        (first, lse_first), (second, lse_second) = parts
        return (ops.cat((first, second), 2).transpose(2, 0, 1, 3),           # [S, b, n, d]
                ops.cat((lse_first, lse_second), 2))                          # [b, n, S, 1]

    def attend(self, qh, block, j, bias, parts):
        """ring_step with rank j's block (k, v [S, b, g, d])."""
        k, v = self.to_heads(block[0], self.per_group), self.to_heads(block[1], self.per_group)
        return ring_step(parts, qh, k, v, j, self.rank, bias, self.block)

    def block(self, q, k, v, bias):
        return attention_block(q, k, v, bias, no_dropout, self.softmax_scale)

    def bprop(self, q, k, v, bias, out, dout):
        # a plain function call, as gpt.FlashKernel's (ms.jit compiles it so)
        return RingKernel.backward(self, q, k, v, bias, out, dout)

    def backward(self, q, k, v, bias, out, dout):
        """At step i the block of ring rank r + 1 + i is in hand (the local one last), with the
        partial sums of its dK and dV from the ranks that held it before."""
        qh = self.to_heads(q * self.scale, 1)                                 # [b, n, S, d]
        o, do = out[0].transpose(1, 2, 0, 3), dout[0].transpose(1, 2, 0, 3)   # [b, n, S, d]
        rows_d = (cast(do, F32) * cast(o, F32)).sum(-1, keepdims=True)       # D [b, n, S, 1]
        query, dq = (qh, do, out[1], rows_d), ops.zeros_like(qh)
        block, grads = (self.comm.send_recv(k, -1), self.comm.send_recv(v, -1)), None
        for step in range(self.ring):
            j = (self.rank + 1 + step) % self.ring
            coming = (k, v)                              # the last block is this rank's own
            if step < self.ring - 2:
                coming = (self.comm.send_recv(block[0], -1), self.comm.send_recv(block[1], -1))
            dq_j, dk_j, dv_j = self.block_grads(query, block, j, bias)
            dq = dq + dq_j
            if grads is not None:                        # the partial sums that came with it
                dk_j, dv_j = dk_j + grads[0], dv_j + grads[1]
            grads = (dk_j, dv_j)
            if step < self.ring - 1:
                grads = (self.comm.send_recv(dk_j, -1), self.comm.send_recv(dv_j, -1))
                block = coming
        return (cast((dq * self.scale).transpose(2, 0, 1, 3), q.dtype),
                cast(grads[0], k.dtype), cast(grads[1], v.dtype), ops.zeros_like(bias))

    def block_grads(self, query, block, j, bias):
        """(dq [b, n, S, d], dk, dv [S, b, g, d]) of this rank's queries against rank j's block,
        the forward's case for j (zeros where it computed nothing)."""
        half = query[0].shape[2] // 2
        k, v = self.to_heads(block[0], self.per_group), self.to_heads(block[1], self.per_group)
        if j == self.rank:
            dq, dk, dv = attention_block_grads(query, k, v, bias, self.softmax_scale)
        elif j < self.rank:            # both local chunks against chunk j: dk, dv of its half
            dq, dk, dv = attention_block_grads(query, k[:, :, :half], v[:, :, :half], None,
                                               self.softmax_scale)
            dk, dv = _pad_halves(dk, dv, first=True)
        else:                          # local chunk 2R-1-r against both: dq of its half
            later = tuple(t[:, :, half:] for t in query)
            dq, dk, dv = attention_block_grads(later, k, v, None, self.softmax_scale)
            dq = _pad_halves(dq, first=False)[0]
        return dq, sum_head_groups(dk, self.per_group), sum_head_groups(dv, self.per_group)


def _pad_halves(*grads, first):
    """Gradients [b, n, S/2, d] of one half of a block's S tokens -> [b, n, S, d], zero in the
    other half (`first`: they are the first half's)."""
    return tuple(ops.cat((g, ops.zeros_like(g)) if first else (ops.zeros_like(g), g), 2)
                 for g in grads)


def no_dropout(x):
    """The identity in a dropout's place: blocks whose backward recomputes them (the ring's,
    gpt.FlashKernel's)."""
    return x


class AllGatherAttention(nn.Cell):
    """Ring attention's blocks after an all-gather (Megatron-core's cp_comm_type=all_gather):
    the keys and values of every rank of the ring group are all-gathered first, so each rank
    holds the whole sequence's K and V (the backward reduce-scatters their gradients); then this
    rank's queries meet them one rank's block at a time, the blocks RingAttention computes, and
    autograd keeps what their backward needs."""

    def __init__(self, core, state):
        super().__init__()
        self.core, self.ring, self.rank = core, state.cp_ring, state.cp_rank // state.cp_ulysses
        # keys and values of the whole ring, rank order; backward: reduce-scatter of their gradients
        self.gather_keys = gather_from_sequence_parallel_region(state.cp_ring_group)
        self.gather_values = gather_from_sequence_parallel_region(state.cp_ring_group)

    def construct(self, q, k, v, bias):
        """As RingAttention."""
        core, S = self.core, q.shape[0]
        keys, values = self.gather_keys(k), self.gather_values(v)             # [R*S, b, g, d]
        q = core.to_heads(q * core.scale, 1)                                   # [b, n, S, d]
        parts = None                                 # (out, lse) of local chunks r and 2R-1-r
        for j in [self.rank] + [j for j in range(self.ring) if j != self.rank]:
            k_j = core.to_heads(keys[j * S:(j + 1) * S], core.per_group)     # [b, n, S, d]
            v_j = core.to_heads(values[j * S:(j + 1) * S], core.per_group)
            parts = ring_step(parts, q, k_j, v_j, j, self.rank, bias, self.block)
        return ops.cat((parts[0][0], parts[1][0]), 2).transpose(2, 0, 1, 3)   # [S, b, n, d]

    def block(self, q, k, v, bias):
        return attention_block(q, k, v, bias, self.core.dropout, self.core.softmax_scale)


class ContextParallelAttention(nn.Cell):
    """Core attention across the cp ranks: Ulysses all-to-alls (if ulysses > 1) around the ring
    (if ring > 1) or around `core`, the one-sequence attention of gpt.py.
    q [s/cp, b, n, d], k, v [s/cp, b, g, d] -> [s/cp, b, n, d] (n, g: this TP rank's heads)."""

    def __init__(self, core, state, comm_type="a2a"):
        super().__init__()
        self.ulysses = state.cp_ulysses
        if self.ulysses > 1:
            group = state.cp_ulysses_group
            self.scatter_q, self.scatter_k, self.scatter_v = (
                all_to_all_sequence_to_heads(group) for _ in range(3))
            self.gather_context = all_to_all_heads_to_sequence(group)
        if state.cp_ring == 1:
            self.attend = core
        elif comm_type == "all_gather":
            self.attend = AllGatherAttention(core, state)
        else:
            self.attend = RingAttention(core, state)

    def construct(self, q, k, v, bias):
        if self.ulysses > 1:
            # heads and groups split in the same contiguous order: they stay paired;
            # [s/cp, b, n, d] -> [s/ring, b, n/u, d]
            q, k, v = self.scatter_q(q), self.scatter_k(k), self.scatter_v(v)
        context = self.attend(q, k, v, bias)
        if self.ulysses > 1:
            context = self.gather_context(context)                             # [s/cp, b, n, d]
        return context


def context_parallel_spec(spec, state, comm_type):
    """A layer spec (gpt.LayerSpec) whose core attention runs across the cp ranks: the spec's
    one-sequence core attention inside ContextParallelAttention, the ring's blocks passed as
    `comm_type` (model_config.cp_comm_type) says."""
    def core_attention(*args):
        return ContextParallelAttention(spec.core_attention(*args), state, comm_type)
    return dataclasses.replace(spec, core_attention=core_attention)


def attended_length(length, state):
    """The tokens a core attention attends over, from this rank's share `length` of the
    sequence: Ulysses' all-to-all gives it its group's tokens (length x ulysses degree); the
    ring keeps its share and passes the keys and values round (RingAttention)."""
    return length * state.cp_ulysses


class LossOverCP(nn.Cell):
    """Megatron's loss_func under context parallelism: each cp rank holds part of every
    sequence's tokens, so the loss sum (forward all-reduce, backward identity: g over the CP
    group) and the token count are summed over CP before dividing; each rank's gradient is then
    its tokens' share. (total [1], count [1]) -> the same summed over CP, as they are without."""

    def __init__(self, state):
        super().__init__()
        self.cp = state.cp
        if self.cp > 1:
            self.reduce_loss = reduce_from_tensor_model_parallel_region(state.cp_group)
            self.count_tokens = collectives(state.cp_group)

    def construct(self, total, count):
        if self.cp == 1:
            return total, count
        return self.reduce_loss(total), self.count_tokens.all_reduce(ops.stop_gradient(count))


if __name__ == "__main__":          # imported by train.py, not a script
    raise SystemExit("error: context_parallel.py is a library: run `bash run.sh` "
                     "(bash run.sh --help lists the commands)")
