"""Pipeline parallelism: 1F1B and interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM"), run for real across msrun workers.

The model is cut into p stages (one per pipeline rank), or with interleaving into p*v virtual
stages: rank r holds the v model chunks of virtual stages r, r + p, ..., r + (v-1)*p, so an
activation goes round the ring of ranks v times.

Three layers, each readable on its own:
  schedule(p, rank, m, v)  the order in which one rank runs forward (F) and backward (B) passes of
                           its micro-batches, by Megatron's rules (warmup, steady 1F1B, cooldown);
  simulate(p, m, v)        a tick-by-tick simulation of all ranks running their schedules, which
                           yields, per rank, its passes interleaved with the point-to-point
                           exchanges they need. Every exchange is a rendezvous of two ranks, and
                           every rank meets its exchanges in one global order (tick, rank pair), so
                           no schedule can deadlock, whatever the communication backend;
  ForwardBackward.run      executes this rank's steps with MindSpore: each F records the chunk's
                           forward (set_grad), each B replays it through GradOperation with the
                           received output gradient (sens), oldest micro-batch first per chunk.
A hop carries the hidden states [s, b, h] ([s/tp, b, h] under sequence parallelism).
Without pipeline parallelism the same runner runs the schedule of one stage (p = 1): every
training step's forward and backward go through ForwardBackward.run.
"""
import contextlib

import numpy as np
import mindspore as ms
from mindspore import Tensor, mint, ops

import gpt
import layers
import parallel
from settings.config import stage_layer_counts


# ============================================================================ layer assignment
def layer_split(num_layers, pp, vpp=1, num_layer_list=None):
    """(offset, count) of the layers of each virtual stage vs = chunk * pp + rank: the counts of
    config.stage_layer_counts (num_layer_list per rank, [3, 1], or per rank and chunk,
    [[2, 1], [1, 2]], the guide's layer_list), dealt out in virtual-stage order."""
    per_rank = stage_layer_counts(num_layers, pp, vpp, num_layer_list)
    counts = [per_rank[vs % pp][vs // pp] for vs in range(pp * vpp)]
    offsets = np.cumsum([0] + counts[:-1]).tolist()
    return list(zip(offsets, counts))


def build_chunks(provider, model_cfg, pp, pp_rank, vpp=1, num_layer_list=None, rng=None,
                 recomputed=None):
    """This pipeline rank's model chunks, each built by `provider` (Megatron's get_model with its
    model_provider: gpt.model_provider; weights not initialised): chunk i is virtual stage
    i * pp + pp_rank; the first virtual stage embeds, the last has the loss. recomputed: per
    chunk, the layers full recompute rebuilds (config.recompute_counts)."""
    split = layer_split(model_cfg.num_layers, pp, vpp, num_layer_list)
    chunks = []
    for chunk in range(vpp):
        vs = chunk * pp + pp_rank
        offset, count = split[vs]
        chunks.append(provider(
            model_cfg, pre_process=vs == 0, post_process=vs == len(split) - 1,
            layer_offset=offset, num_layers=count, rng=rng,
            recomputed_layers=None if recomputed is None else recomputed[chunk]))
    return chunks


# ============================================================================ schedules
def schedule(p, rank, m, v=1, forward_only=False, kind="1f1b"):
    """This rank's passes, in order: a list of ("F" or "B", micro-batch, chunk).

    kind "afab", all forward then all backward (GPipe, Huang et al. 2019): every forward of the
      step, then every backward in the same order. The naive schedule: the same bubble as 1F1B,
      but all m micro-batches are in flight at once, so a stage holds m activations.

    v = 1, 1F1B (PipeDream-Flush): p - rank - 1 warmup forwards (at most m), then one forward
      and one backward alternately, then the remaining backwards: at most p - rank micro-batches
      are ever in flight on this rank (instead of m with all-forward-then-all-backward).
    v > 1, interleaved: the k-th forward runs chunk (k mod pv) // p on micro-batch
      (k // pv) * p + k mod p, i.e. p micro-batches through chunk 0, the same p through chunk 1,
      ...; backwards go through the chunks in reverse. Warmup = (p - rank - 1) * 2 + (v - 1) * p
      passes (all of them when m == p), capped at m * v. Needs m divisible by p."""
    if forward_only:
        return [("F", _microbatch(k, p, v), _chunk(k, p, v, True)) for k in range(m * v)]
    total = m * v
    if kind == "afab":
        return ([("F", _microbatch(k, p, v), _chunk(k, p, v, True)) for k in range(total)]
                + [("B", _microbatch(k, p, v), _chunk(k, p, v, False)) for k in range(total)])
    if v == 1:
        warmup = min(p - rank - 1, m)
    elif m == p:
        warmup = total
    else:
        warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    forwards = [("F", _microbatch(k, p, v), _chunk(k, p, v, True)) for k in range(total)]
    backwards = [("B", _microbatch(k, p, v), _chunk(k, p, v, False)) for k in range(total)]
    order = forwards[:warmup]
    for k in range(total - warmup):                  # steady state: one forward, one backward
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[total - warmup:]         # cooldown


def _chunk(k, p, v, forward):
    """Megatron's get_model_chunk_id: the chunk of the k-th forward (or backward) pass."""
    chunk = (k % (p * v)) // p
    return chunk if forward else v - 1 - chunk


def _microbatch(k, p, v):
    """The micro-batch of the k-th pass: p consecutive micro-batches per chunk in each group."""
    return (k // (p * v)) * p + k % p


def peak_in_flight(passes):
    """Most micro-batches forwarded and not yet backwarded at once (activations held)."""
    held = peak = 0
    for kind, _, _ in passes:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def simulate(p, m, v=1, forward_only=False, kind="1f1b"):
    """Run all ranks' schedules in lockstep ticks (every pass one tick; a tensor sent in tick t
    can be used from tick t + 1) and return (steps, ticks):

      steps[rank]: the rank's passes ("F"|"B", micro-batch, chunk) and, after the pass of a tick,
        its exchanges ("X", peer, sent key or None, received key or None), one per neighbour it
        trades with in that tick, in increasing (min rank, max rank) order. Keys name tensors:
        ("act", mb, vs) is the input of virtual stage vs, ("grad", mb, vs) the gradient of its
        output;
      ticks[rank]: (tick, "F" or "B", micro-batch, chunk) of each pass, the unit-time timeline.
    A pass waits for its input; if no rank can move, the schedule is wrong and this raises."""
    last = p * v - 1
    todo = [schedule(p, r, m, v, forward_only, kind) for r in range(p)]
    done = [0] * p
    have = [set() for _ in range(p)]                  # keys delivered to each rank
    steps, ticks = [[] for _ in range(p)], [[] for _ in range(p)]
    tick = 0
    while any(done[r] < len(todo[r]) for r in range(p)):
        sends = []                                    # (src, dst, key) produced in this tick
        for r in range(p):
            if done[r] == len(todo[r]):
                continue
            f_or_b, mb, chunk = todo[r][done[r]]
            vs = chunk * p + r
            if f_or_b == "F":
                if vs > 0 and ("act", mb, vs) not in have[r]:
                    continue
                if vs < last:
                    sends.append((r, (vs + 1) % p, ("act", mb, vs + 1)))
            else:
                if vs < last and ("grad", mb, vs) not in have[r]:
                    continue
                if vs > 0:
                    sends.append((r, (vs - 1) % p, ("grad", mb, vs - 1)))
            steps[r].append((f_or_b, mb, chunk))
            ticks[r].append((tick, f_or_b, mb, chunk))
            done[r] += 1
        if not sends and not any(t and t[-1][0] == tick for t in ticks):
            raise RuntimeError(f"pipeline schedule p={p} m={m} v={v} deadlocks at tick {tick}: "
                               + "; ".join(_waits(todo, done, p, v)))
        # a hop to this rank's own next piece (one stage: p = 1) needs no exchange
        for pair in sorted({tuple(sorted((s, d))) for s, d, _ in sends if s != d}):
            for me in pair:
                peer = pair[1] if me == pair[0] else pair[0]
                out = next((k for s, d, k in sends if s == me and d == peer), None)
                inp = next((k for s, d, k in sends if s == peer and d == me), None)
                steps[me].append(("X", peer, out, inp))
        for _, dst, key in sends:
            have[dst].add(key)
        tick += 1
    return steps, ticks


def _waits(todo, done, p, v):
    """What each rank left waiting in a deadlocked simulation waits for: "rank 0 waits for the
    gradient of micro-batch 0 from rank 1" (its next pass's input, which no rank sends)."""
    said = []
    for r in range(p):
        if done[r] < len(todo[r]):
            kind, mb, chunk = todo[r][done[r]]
            vs = chunk * p + r
            what, peer = (("activation", vs - 1) if kind == "F" else ("gradient", vs + 1))
            said.append(f"rank {r} waits for the {what} of micro-batch {mb} from rank {peer % p}")
    return said


def bubble_fraction(busy, span):
    """Idle over busy time (Narayanan's bubble time fraction t_pb / t_id): per rank, with `busy`
    its pass time and `span` the step's length."""
    return [(span - b) / b for b in busy]


def theory_bubble(p, m, v=1):
    """(p - 1) / m for 1F1B, (p - 1) / (v m) interleaved."""
    return (p - 1) / (v * m)


# ============================================================================ execution
def hop_shape(model_cfg, micro_batch_size, cp=1, tp=1, sequence_parallel=False):
    """What one hop carries, the one place it is worked out (train.py's runner, memory.py's
    count): a micro-batch's hidden states on a cp rank, [s/cp, b, h], or their shard
    [s/cp/tp, b, h] under sequence parallelism."""
    shard = tp if sequence_parallel else 1
    return (model_cfg.seq_length // cp // shard, micro_batch_size, model_cfg.hidden_size)


class ForwardBackward:
    """Megatron's forward_backward_func (pipeline_parallel/schedules.py), the one that runs every
    step's forward and backward passes in every layout: this rank's passes of its `pieces`
    (gpt.ModelPiece: a model chunk, or with Megatron's overlap a few blocks of one), piece i
    being virtual stage i * pp + pp_rank, each compiled by ms.jit if `compiled`.
    - Pipeline parallelism: the pieces are this rank's model chunks and the passes follow
      `schedule` (1F1B, interleaved or AFAB, `kind`) through `simulate`'s exchanges.
    - One stage (pp = 1): the schedule of p = 1, Megatron's forward_backward_no_pipelining: each
      micro-batch's forward, then its backward; with the overlap's v pieces, the interleaved
      schedule of p = 1, whose hops stay on this rank.
    A hop is a tensor of shape `hop` (hop_shape's) in `hop_dtype` (gpt.hidden_dtype). The
    gradients of `params` (the model's parameters, in its order) are summed over micro-batches
    in `grad_dtype`, each cast by `cast` (layers.cast, or the layer spec's fast form). Data
    parallelism enters through Megatron's callbacks: `param_sync_func(params)` before each pass
    of a piece (the distributed optimizer's gather of its parameters, `params` those the pass
    reads), `param_release_func(params)` after it (ZeRO-3 lets them go again),
    `grad_sync_func(final)` after a piece's last backward with [(position in params, gradient)]
    of what it made final (the overlap; the earlier micro-batches run without it, Megatron's
    no_sync_func), or with `shard_grads` (ZeRO-2) after each of its backwards, the gradients it
    takes then kept no longer; and after the schedule the Trainer's finalize_model_grads. A
    training step runs each pass inside
    `phase(("F" or "B", micro-batch, piece))` and each exchange inside `phase("exchange")` (what
    times them)."""

    def __init__(self, pieces, params, state, hop, hop_dtype, grad_dtype, compiled=False,
                 kind="1f1b", cast=layers.cast, phase=contextlib.nullcontext,
                 param_sync_func=None, grad_sync_func=None, param_release_func=None,
                 shard_grads=False):
        self.kind, self.cast, self.phase = kind, cast, phase    # kind "1f1b" or "afab"
        self.param_sync_func, self.grad_sync_func = param_sync_func, grad_sync_func
        self.param_release_func, self.shard_grads = param_release_func, shard_grads
        self.pieces = [gpt.Compiled(piece) for piece in pieces] if compiled else pieces
        self.hop, self.hop_dtype, self.grad_dtype = hop, hop_dtype, grad_dtype
        self.p, self.v, self.rank = state.pp, len(pieces), state.pp_rank
        self.params = [piece.params for piece in pieces]
        self.tied = [piece.tied_weight() for piece in pieces]     # an input's copy, or None
        # what a forward of each piece reads: its parameters and the tied weight it copies
        self.reads = [ps + ([] if t is None else [t]) for ps, t in zip(self.params, self.tied)]
        # where each piece's parameters, and its tied weight's gradient, go in `params`
        self.positions, self.tied_at = piece_positions(pieces, params, self.tied)
        self.count = len(params)
        self.peers = parallel.group_ranks(state.pp_group)          # pp rank -> global rank
        self.grad_with_input = ops.GradOperation(get_all=True, get_by_list=True, sens_param=True)
        # the first virtual stage takes token ids, which have no gradient
        self.grad_params_only = ops.GradOperation(get_by_list=True, sens_param=True)
        self.steps = {}                     # (m, forward_only) -> this rank's simulated steps
        for piece in self.pieces:
            piece.set_grad(True)            # record each forward, for its backward to replay

    def run(self, micro_batches, loss_weight=1.0, forward_only=False):
        """micro_batches: per micro-batch the model inputs (tokens, position_ids, attention_mask,
        labels, loss_mask). Returns (losses of the last stage, one per micro-batch, else [];
        gradients of `params`, of loss * loss_weight, summed over micro-batches, each None with
        forward_only). forward_only (evaluation) records nothing for a backward, is not timed
        and calls no grad_sync_func."""
        if not forward_only:
            return self._run(micro_batches, loss_weight, False, self.phase)
        for piece in self.pieces:
            piece.set_grad(False)
        result = self._run(micro_batches, loss_weight, True, contextlib.nullcontext)
        for piece in self.pieces:
            piece.set_grad(True)
        return result

    def _run(self, micro_batches, loss_weight, forward_only, phase):
        """This rank's steps for len(micro_batches) micro-batches (see simulate), one by one,
        each in its `phase`."""
        m = len(micro_batches)
        key = (m, forward_only)
        if key not in self.steps:
            self.steps[key] = simulate(self.p, m, self.v, forward_only, self.kind)[0][self.rank]
        # hops keyed ("act" or "grad", micro-batch, virtual stage); a forward's inputs by
        # (micro-batch, piece), kept for its backward
        received, outgoing, saved = {}, {}, {}
        losses, grads = [], [None] * self.count
        backwards = [0] * self.v                                    # backward passes per piece
        for step in self.steps[key]:
            if step[0] == "X":
                with phase("exchange"):                    # waiting for the peer included
                    self._exchange(step, outgoing, received)
                continue
            kind, mb, piece = step
            with phase(step):
                if kind == "F":
                    args = self._forward(micro_batches[mb], mb, piece, received, outgoing,
                                         losses)
                    if not forward_only:
                        saved[(mb, piece)] = args
                    continue
                self._backward(saved.pop((mb, piece)), mb, piece, loss_weight, received,
                               outgoing, grads)
            backwards[piece] += 1
            if self.grad_sync_func and (self.shard_grads or backwards[piece] == m):
                handed = self.grad_sync_func([(i, grads[i])
                                              for i in reversed(self.positions[piece])])
                for i in handed if self.shard_grads else ():    # they live on in the shards
                    grads[i] = None
        return [float(loss.asnumpy()) for loss in losses], grads

    @contextlib.contextmanager
    def _gathered(self, params):
        """Around a pass: the `params` it reads gathered before, released after (the
        callbacks')."""
        if self.param_sync_func:
            self.param_sync_func(params)
        yield
        if self.param_release_func:
            self.param_release_func(params)

    def _send(self, key, tensor, received, outgoing):
        """A hop to virtual stage key[2]: kept here if this rank holds it (one stage), else
        held for the exchange with its rank."""
        (received if key[2] % self.p == self.rank else outgoing)[key] = tensor

    def _exchange(self, step, outgoing, received):
        """One rendezvous with a neighbour: send this rank's hop, receive the peer's."""
        _, peer, out_key, in_key = step
        # the exchange is symmetric: a rank with nothing to send sends zeros
        send = (outgoing.pop(out_key) if out_key
                else mint.zeros(self.hop, dtype=self.hop_dtype))
        got = parallel.exchange(send, self.peers[peer])        # the sent output is freed here
        if in_key:
            received[in_key] = got

    def _forward(self, inputs, mb, piece, received, outgoing, losses):
        """Piece `piece`'s forward of micro-batch mb: its output goes out as a hop, or on the
        last virtual stage is the loss. Returns the piece's inputs (for its backward)."""
        vs, last = piece * self.p + self.rank, self.p * self.v - 1
        tokens, position_ids, mask, labels, loss_mask = inputs
        x = tokens if vs == 0 else received.pop(("act", mb, vs))
        args = (x, position_ids, mask) + ((labels, loss_mask) if vs == last else ())
        with self._gathered(self.reads[piece]):
            if self.tied[piece] is not None:
                args += (self.tied[piece].value().copy(),)
            out = self.pieces[piece](*args)
        if vs == last:
            losses.append(out)
        else:
            self._send(("act", mb, vs + 1), out, received, outgoing)
        return args

    def _backward(self, args, mb, piece, loss_weight, received, outgoing, grads):
        """Piece `piece`'s backward of micro-batch mb from its saved inputs `args`, seeded by
        loss_weight on the last virtual stage, else by the received output gradient; the input
        gradient goes out as a hop. Adds the parameters' gradients, in grad_dtype, to `grads`
        (a tied weight's, the gradient of its copy, to the parameter's)."""
        vs, last = piece * self.p + self.rank, self.p * self.v - 1
        dout = Tensor(loss_weight, ms.float32) if vs == last else received.pop(("grad", mb, vs))
        cell, params = self.pieces[piece], self.params[piece]
        with self._gathered(params):
            if vs == 0:
                g_params = self.grad_params_only(cell, params)(*args, dout)
            else:
                g_inputs, g_params = self.grad_with_input(cell, params)(*args, dout)
        if vs > 0:
            self._send(("grad", mb, vs - 1), g_inputs[0], received, outgoing)
            if self.tied[piece] is not None:
                g_params = tuple(g_params) + (g_inputs[-1],)
        for i, g in zip(self.positions[piece] + self.tied_at[piece], g_params):
            g = self.cast(g, self.grad_dtype)
            grads[i] = g if grads[i] is None else grads[i] + g


def piece_positions(pieces, params, tied):
    """(per piece the positions in `params` of its parameters, per piece [the position of its
    tied weight] or []: `tied`, per piece the parameter whose copy it takes as an input, or
    None). Every parameter belongs to one piece."""
    where = {id(param): i for i, param in enumerate(params)}
    positions = [[where[id(param)] for param in piece.params] for piece in pieces]
    if sorted(i for ps in positions for i in ps) != list(range(len(params))):
        raise ValueError("the pieces do not hold each of the model's parameters once")
    return positions, [[] if t is None else [where[id(t)]] for t in tied]


if __name__ == "__main__":          # imported by train.py, not a script
    raise SystemExit("error: pipeline.py is a library: run `bash run.sh` (bash run.sh --help "
                     "lists the commands)")
