"""Mixture of experts: Megatron-core's MoE layer (megatron/core/transformer/moe/) on MindSpore.

`MoELayer` replaces a layer's dense MLP (gpt.MLP) with the same construct(hidden [s, b, h]) ->
[s, b, h]; under sequence parallelism hidden is [s/tp, b, h]. As in MoELayer.forward
(moe_layer.py:614-719):
    shared = shared_experts(x)                      optional dense MLP on every token
    probs, routing_map = router(x)                  TopKRouter: [n, E] each, n = s*b tokens
    tokens, probs = dispatcher.dispatch(...)        to this rank's E_l = E/ep experts
    out = dispatcher.combine(experts(tokens, probs)) + shared
Tokens are flattened sequence-major, t = s_idx * b + b_idx (router.py:761).

Every shape is static, so a layer compiles in ms.jit: the `allgather` dispatcher runs each local
expert on every gathered token with its probability (0 for a token routed elsewhere or dropped),
the `alltoall` dispatcher fills fixed capacity slots [E, C, h] (C = n when dropless, so nothing
is dropped). Both compute Megatron's sums; only the FLOPs are higher. A dispatcher's
dispatch(tokens [n, h], probs, routing_map) returns (tokens [E_l, T, h], probs [E_l, T], slot
indices) for the experts, and combine(expert output [E_l, T, h], slot indices, n) -> [n, h].

Config fields, read from `cfg` (the model config; Megatron's TransformerConfig names, lines of
transformer_config.py at d98e8a64):
    hidden_size, ffn_hidden_size, hidden_act ("gelu" | "gelu_tanh" | "swiglu"), add_bias_linear,
    compute_dtype ("float32" | "float16" | "bfloat16")                     as gpt.MLP reads them
    num_moe_experts (l. 239)                     E, routed experts
    moe_ffn_hidden_size (l. 740)                 expert FFN width; None: ffn_hidden_size
    moe_router_topk (l. 760)                     k
    moe_router_score_function (l. 808)           "softmax" | "sigmoid"
    moe_router_pre_softmax (l. 799)              softmax over all E before the top-k
    moe_router_topk_scaling_factor (l. 804)      None or a factor on the final probs
    moe_router_dtype (l. 811)                    None (the input's dtype) | "fp32"
    moe_router_enable_expert_bias (l. 816)       a bias [E] on the sigmoids chooses the experts
    moe_router_bias_update_rate (l. 821)         its step (update_expert_bias)
    moe_router_load_balancing_type (l. 743)      "aux_loss" | "seq_aux_loss" | "none"
    moe_aux_loss_coeff (l. 875)                  0 computes no balancing loss
    moe_z_loss_coeff (l. 880)                    None (or 0) computes no z-loss
    moe_expert_capacity_factor (l. 917)          None: dropless
    moe_pad_expert_input_to_capacity (l. 921)    every expert gets exactly C tokens
    moe_token_drop_policy (l. 932)               "probs" | "position"
    moe_token_dispatcher_type (l. 891)           "allgather" | "alltoall"
    moe_grouped_gemm (l. 850)                    GroupedMLP instead of SequentialMLP
    moe_shared_expert_intermediate_size (l. 701) None, or the shared expert's FFN width
    moe_shared_expert_gate (l. 713)              sigmoid gate on the shared expert's output

Process groups, the current ParallelState's (parallel.rank_groups; Megatron's parallel_state.py):
    ep_group      the expert-parallel group (_EXPERT_MODEL_PARALLEL_GROUP, l. 1354-1366): ranks
                  with the same TP rank, `ep` consecutive DP x CP ranks; used when ep > 1
    tp_ep_group   TP x EP (_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP, l. 1383-1396), the allgather
                  dispatcher's group (the TP group when EP = 1)
    tp_cp_group   TP x CP (_TENSOR_AND_CONTEXT_PARALLEL_GROUP, l. 1319-1331), over which the
                  router's token counts are summed (the TP group when CP = 1)
    tp_dp_cp_group  TP x DP x CP, a stage's ranks (get_tensor_and_data_parallel_group(
                  with_context_parallel=True)), over which update_expert_bias sums a step's
                  tokens per expert
    edp_group     the expert-data-parallel group (_EXPERT_DATA_PARALLEL_GROUP): the ranks that
                  hold the same experts, over which the trainer sums the experts' gradients
                  (distributed.build_data_parallel, optimizer.ChainedOptimizer)
Experts are split over TP as Megatron's default expert_tensor_parallel_size = tp does. Why EP
sits inside DP x CP: the ranks of an EP group hold different tokens (different data or sequence
chunks) and different experts, so the dispatcher sends each token to its experts' rank and back;
the dense layers around stay data-parallel over all of DP x CP.

Auxiliary losses (moe_utils.py:291-341). The load-balancing loss and the z-loss never join the
returned loss: MoEAuxLossAutoScaler adds scale * d(loss)/d(theta) in the backward, scale being
`MoEAuxLossAutoScaler.main_loss_backward_scale`, which the trainer sets with
`MoEAuxLossAutoScaler.set_loss_scale(loss_scale / num_microbatches)` before a step's forwards
(Megatron multiplies by cp too, schedules.py:355-366, because its gradients are averaged over
CP; this project sums over CP). They are computed only in training while a backward is recorded
(Megatron's `self.training and torch.is_grad_enabled()`), and then each router gives their
values to its `tracker` hook, when what logs them has attached one (aux/coeff,
z/(coeff/|tp_cp|), as router.py:594-601, 702-708 record them; instruments/logs.py sums them over a
step, then reduces and clears them, as Megatron's MoEMetricsTracker.report).

Aux-loss-free balancing (moe_router_enable_expert_bias; router.py:180-201, 733-744,
finalize_model_grads.py:334-371). A float32 bias [E], no parameter, is added to the sigmoid
scores only to choose each token's k experts; the probabilities stay the unbiased scores. Each
forward recorded for a backward counts its routed tokens; after the step's backward
distributed.finalize_model_grads calls update_expert_bias, which sums the counts over TP x DP x
CP and moves each bias by rate * sign(mean - count). Checkpoints hold the bias as Megatron's
state dict does ("...mlp.router.expert_bias": expert_biases).

Parameter names follow Megatron's modules: router.weight|bias, experts.local_experts.J.
linear_fc1|linear_fc2.weight|bias (J local; `global_expert_name` makes it global),
shared_experts.linear_fc1|linear_fc2.weight, shared_experts.gate_weight. Initialisation
(router.py:78-88, Megatron's init_method): every weight and the router bias normal(0, std),
linear_fc2 with std / sqrt(2 num_layers), the experts' other biases zero. Expert parameters,
known by their names (`is_expert`: Megatron marks them `allreduce = False` when ep > 1 or etp !=
tp, tensor_parallel/layers.py:1033-1037, 1090; with EP = 1 their group is DP x CP anyway), have
their gradients summed over the expert-data-parallel group; they carry `partition_dim` like the
TP layers; the router's and the gate's `sequence_parallel` as Megatron marks them.
"""
import itertools
import math
import re

import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.graph.api import _pynative_executor
from mindspore.ops import constexpr

import fused
import layers
import parallel
from layers import activation, batch_matmul_nt, cast, linear
from parallel import DTYPES, F32
from settings.config import fc1_chunks

# Megatron's logged names (router.py:437, 494, 704), the order of TopKRouter.metrics
METRICS = ("load_balancing_loss", "seq_load_balancing_loss", "z_loss")
_BUFFER_IDS = itertools.count()     # the routers' buffers' names, unique as a graph needs them


@constexpr
def grad_enabled():
    """torch.is_grad_enabled(): true while MindSpore records a forward for a backward. Evaluated
    when a graph is compiled; ms.jit keeps separate graphs with and without gradients (it does
    not key them on Cell.training, so a compiled graph's training flag is the first call's)."""
    return bool(_pynative_executor.requires_grad())


@constexpr
def get_capacity(num_tokens, num_experts, capacity_factor):
    """Megatron's get_capacity (moe_utils.py:248-266): ceil(num_tokens / E * factor)."""
    return math.ceil((num_tokens / num_experts) * capacity_factor)


EXPERT_INDEX = re.compile(r"(^|\.)local_experts\.(\d+)\.")    # a routed expert's parameter


def first_expert(num_experts, ep, ep_rank):
    """The global index of EP rank `ep_rank`'s first expert: rank r holds experts r * E_l ..
    (r + 1) * E_l - 1 (moe_layer.py:187-188); 0 without experts."""
    return ep_rank * (num_experts or 0) // ep


def is_expert(name):
    """A routed expert's parameter (expert-parallel, Megatron's `allreduce = False`: reduced and
    sharded over the expert-data-parallel group, not DP x CP), by its name."""
    return EXPERT_INDEX.search(name) is not None


def global_expert_name(name, offset):
    """'...local_experts.J...' on EP rank r -> '...local_experts.{offset + J}...' (offset =
    r * E_l, this rank's first expert), so that initialisation and checkpoints see one name per
    expert in every layout; a negative offset makes a global name local again."""
    return EXPERT_INDEX.sub(
        lambda m: f"{m.group(1)}local_experts.{offset + int(m.group(2))}.", name)


def expert_biases(cell):
    """(name, Parameter) of the expert biases of the routers inside `cell`, named as Megatron's
    state dict names the buffer ("...mlp.router.expert_bias"): what a checkpoint holds beside
    the parameters, which no optimizer updates."""
    return [(f"{name}.expert_bias", router.expert_bias[0])
            for name, router in cell.cells_and_names()
            if isinstance(router, TopKRouter) and router.expert_bias is not None]


def is_expert_bias(name):
    """A router's expert bias (expert_biases), by its name: no parameter, no optimizer state."""
    return name.endswith(".expert_bias")


# ============================================================================ routing
def topk_routing_with_score_function(logits, topk, use_pre_softmax, scaling_factor,
                                     score_function, expert_bias=None):
    """Megatron's topk_routing_with_score_function (moe_utils.py:766-957): logits [n, E] ->
    (routing_probs [n, E], 0 off the top-k; routing_map [n, E] bool). softmax: top-k of the
    logits then a softmax over the k (or, pre-softmax, top-k of the softmax over all E, not
    renormalised); sigmoid: top-k of the sigmoids, renormalised over the k when k > 1; with an
    expert_bias [E] (float32) the top-k of sigmoid + bias, each weighted by its own sigmoid."""
    if score_function == "softmax" and use_pre_softmax:
        probs, top_indices = ops.topk(ops.softmax(cast(logits, F32), -1), topk)    # [n, k]
    elif score_function == "softmax":
        scores, top_indices = ops.topk(logits, topk)
        probs = ops.softmax(cast(scores, F32), -1)
    else:
        scores = ops.sigmoid(cast(logits, F32))                                     # [n, E]
        top_indices = ops.topk(scores if expert_bias is None else scores + expert_bias, topk)[1]
        probs = ops.gather_elements(scores, 1, top_indices)     # the bias chooses, not weighs
        if topk > 1:
            probs = probs / (probs.sum(-1, keepdims=True) + 1e-20)
    if scaling_factor:
        probs = probs * scaling_factor
    one_hot = ops.one_hot(top_indices, logits.shape[-1], 1.0, 0.0)                 # [n, k, E]
    routing_probs = (one_hot * cast(probs, logits.dtype).expand_dims(-1)).sum(1)
    return routing_probs, one_hot.sum(1) > 0


def token_order_key(routing_map):
    """[n, E] bool -> [E, n] float whose descending order per expert is its routed tokens in
    token order, then the others in token order: the stable descending argsort of map^T that
    Megatron's drop-and-pad permute uses (moe_utils.py:439-451)."""
    n = routing_map.shape[0]
    later = ops.arange(n, 0, -1).astype(F32)                                       # n .. 1
    return routing_map.T.astype(F32) * n + later


def index_mask(indices, size):
    """indices [E, C] into [0, size) -> bool [E, size], True at the indices (a scatter)."""
    rows = indices.shape[0]
    flat = (indices + ops.arange(rows).reshape(-1, 1).astype(indices.dtype) * size).reshape(-1)
    hits = ops.unsorted_segment_sum(ops.ones(flat.shape, F32), flat, rows * size)
    return hits.reshape(rows, size) > 0


def apply_router_token_dropping(routing_probs, routing_map, router_topk, capacity_factor,
                                drop_policy, pad_to_capacity):
    """Megatron's apply_router_token_dropping (moe_utils.py:1019-1085): each expert keeps at
    most C = get_capacity(n * k, E, factor) of this rank's n tokens, those of highest probability
    ("probs") or the earliest ("position"); with pad_to_capacity the map holds exactly C tokens
    per expert (the added ones with probability 0). Returns (probs [n, E], map [n, E] bool)."""
    num_tokens, num_experts = routing_probs.shape
    capacity = get_capacity(num_tokens * router_topk, num_experts, capacity_factor)
    if capacity > num_tokens:                     # nothing to drop
        final_map = ops.ones_like(routing_map) if pad_to_capacity else routing_map
        return routing_probs * final_map.astype(routing_probs.dtype), final_map
    # Megatron's "position" is a top-k of the 0/1 map (ties in no stated order, the intent
    # being to drop the latest tokens): here the earliest routed tokens, then the earliest others
    if drop_policy == "probs":
        key = ops.stop_gradient(routing_probs).T                                  # [E, n]
    else:
        key = token_order_key(routing_map)
    _, kept = ops.topk(key, capacity)                                             # [E, C]
    capacity_mask = index_mask(kept, num_tokens).T                                # [n, E]
    final_map = capacity_mask if pad_to_capacity else routing_map & capacity_mask
    return routing_probs * final_map.astype(routing_probs.dtype), final_map


def compute_routing_scores_for_aux_loss(logits, topk, score_function):
    """Megatron's compute_routing_scores_for_aux_loss (moe_utils.py:960-1016): logits [n, E]
    -> (routing_map [n, E] float 0/1, the top-k before any dropping; scores [n, E], the softmax
    or the sigmoids normalised over all E)."""
    if score_function == "softmax":
        scores = ops.softmax(cast(logits, F32), -1)
    else:
        scores = ops.sigmoid(cast(logits, F32))
        scores = scores / (scores.sum(-1, keepdims=True) + 1e-20)
    _, top_indices = ops.topk(scores, topk)
    routing_map = ops.one_hot(top_indices, logits.shape[-1], 1.0, 0.0).sum(1)
    return ops.stop_gradient(routing_map), scores


def switch_load_balancing_loss_func(probs, tokens_per_expert, total_num_tokens, topk,
                                    num_experts, moe_aux_loss_coeff):
    """Megatron's switch_load_balancing_loss_func (moe_utils.py:63-150), this rank's share:
    E * coeff / (k * T^2) * sum_e (sum of this rank's probs [n, E] for e) * (tokens routed to e
    over the group [E]). Summed over the group it is coeff * E * sum_e f_e P_e on the whole
    micro-batch (f_e = count_e / (k T), P_e = mean prob), 1 * coeff when perfectly balanced."""
    scale = num_experts * moe_aux_loss_coeff / (topk * total_num_tokens * total_num_tokens)
    return (probs.sum(0) * tokens_per_expert).sum() * scale


def z_loss_func(logits, z_loss_coeff):
    """Megatron's z_loss_func (moe_utils.py:153-182), ST-MoE's router z-loss:
    coeff * mean over tokens of logsumexp(logits [n, E])^2."""
    return ops.square(ops.logsumexp(cast(logits, F32), -1)).mean() * z_loss_coeff


class MoEAuxLossAutoScaler(nn.Cell):
    """Megatron's MoEAuxLossAutoScaler (moe_utils.py:291-341): the identity on an activation
    whose backward also sends `scale` as the gradient of `aux_loss`, so the backward adds
    scale * d(aux_loss)/d(theta) without the loss joining the model's output. One per call site,
    as every custom-bprop Cell. The scale is one Parameter for all layers, as Megatron's class
    attribute, read at every call of a compiled graph; a bprop may not read a Parameter, so
    callers pass `main_loss_backward_scale` in."""

    main_loss_backward_scale = Parameter(Tensor(1.0, F32), name="moe_aux_loss_scale",
                                         requires_grad=False)      # Megatron's default: 1.0

    def construct(self, output, aux_loss, scale):
        return output

    def bprop(self, output, aux_loss, scale, out, dout):
        # a plain function call: written here, ms.jit failed to compile it beside
        # fused.FusedScaleMaskSoftmax ("The pointer[func_graph->get_return()] is null")
        return MoEAuxLossAutoScaler.backward(aux_loss, scale, dout)

    @staticmethod
    def backward(aux_loss, scale, dout):
        return dout, ops.ones_like(aux_loss) * cast(scale, aux_loss.dtype), ops.zeros_like(scale)

    @staticmethod
    def set_loss_scale(scale):
        """The factor of every aux and z gradient from now on (the trainer: loss_scale / M)."""
        MoEAuxLossAutoScaler.main_loss_backward_scale.set_data(Tensor(float(scale), F32))


class TopKRouter(nn.Cell):
    """Megatron's TopKRouter (router.py:144-884): logits = x W^T (+ b) with W [E, h] (computed
    in moe_router_dtype, else the input's); the z-loss on the logits; top-k probs and routing
    map; capacity dropping; the load-balancing loss attached to the probs. construct(hidden
    [s, b, h]) -> (probs [n, E], routing_map [n, E] bool), n = s*b.

    `tracker`: a hook, None or a Cell (index, value) that what logs the losses attaches
    (instruments/logs.py): each value Megatron records under the name METRICS[index] is given to it
    (Megatron's save_to_aux_losses_tracker). With moe_router_enable_expert_bias, `expert_bias`
    [E] chooses the experts with the sigmoids, and each forward recorded for a backward adds its
    routed tokens to `local_tokens_per_expert` [E], for update_expert_bias after the step."""

    def __init__(self, cfg, tp_cp_group=None):
        super().__init__()
        self.cfg, self.topk = cfg, cfg.moe_router_topk
        balancing = cfg.moe_router_load_balancing_type in ("aux_loss", "seq_aux_loss")
        # get_aux_loss_coeff (router.py:388-401): type "none" has no coefficient
        self.aux_loss_coeff = cfg.moe_aux_loss_coeff if balancing else 0.0
        self.tp_cp = parallel.collectives(tp_cp_group)
        self.weight = Parameter(Tensor(np.zeros((cfg.num_moe_experts, cfg.hidden_size),
                                                np.float32)), name="weight")
        self.bias = Parameter(Tensor(np.zeros(cfg.num_moe_experts, np.float32)), name="bias") \
            if cfg.add_bias_linear else None
        # each TP rank routes its own tokens (router.py:85-88)
        sequence_parallel = parallel.get_state().sequence_parallel
        parallel.mark_sequence_parallel(self.get_parameters(), sequence_parallel)
        self.aux_loss_scaler, self.z_loss_scaler = MoEAuxLossAutoScaler(), MoEAuxLossAutoScaler()
        self.tracker = None
        # Megatron's float32 buffers expert_bias and local_tokens_per_expert [E] (router.py:
        # 180-201), each in a 1-tuple: no parameter, so no optimizer or initialisation sees them;
        # tokens_per_expert: the last update's sums, for the log
        self.expert_bias = self.local_tokens_per_expert = self.tokens_per_expert = None
        if cfg.moe_router_enable_expert_bias:
            self.expert_bias, self.local_tokens_per_expert = (
                (Parameter(Tensor(np.zeros(cfg.num_moe_experts, np.float32)),
                           name=f"router_{what}.{next(_BUFFER_IDS)}", requires_grad=False),)
                for what in ("expert_bias", "tokens"))

    def construct(self, hidden):
        """routing() (router.py:746-837); the losses only in training with a backward recorded."""
        cfg, (s, b) = self.cfg, hidden.shape[:2]
        dtype = F32 if cfg.moe_router_dtype == "fp32" else hidden.dtype
        logits = router_gating_linear(hidden.reshape(s * b, -1), self.weight, self.bias, dtype)
        training = self.training and grad_enabled()
        if training and cfg.moe_z_loss_coeff:
            logits = self.apply_z_loss(logits)                                    # [n, E]
        bias = None if self.expert_bias is None else self.expert_bias[0]          # [E] or None
        probs, routing_map = topk_routing_with_score_function(
            logits, self.topk, cfg.moe_router_pre_softmax, cfg.moe_router_topk_scaling_factor,
            cfg.moe_router_score_function, bias)
        if cfg.moe_expert_capacity_factor is not None:
            probs, routing_map = apply_router_token_dropping(
                probs, routing_map, self.topk, cfg.moe_expert_capacity_factor,
                cfg.moe_token_drop_policy, cfg.moe_pad_expert_input_to_capacity)
        if training and self.aux_loss_coeff > 0:
            probs = self.apply_load_balancing_loss(probs, logits, s, b)
        # Megatron's _apply_expert_bias (router.py:733-744): the kept tokens of each forward
        # recorded for a backward (no evaluation's), summed over the step's micro-batches
        if self.expert_bias is not None and grad_enabled():
            ops.assign_add(self.local_tokens_per_expert[0],
                           ops.stop_gradient(routing_map.astype(F32).sum(0)))        # [E]
        return probs, routing_map

    def apply_z_loss(self, logits):
        """Megatron's apply_z_loss (router.py:642-709): the coefficient divided by |TP x CP|, so
        that the group's sum is coeff * the micro-batch's mean; logged as z / that coefficient."""
        coeff = self.cfg.moe_z_loss_coeff / self.tp_cp.size
        z_loss = z_loss_func(logits, coeff)
        if self.tracker is not None:
            self.tracker(2, z_loss / coeff)
        return self.z_loss_scaler(logits, z_loss, self.z_loss_scaler.main_loss_backward_scale)

    def apply_load_balancing_loss(self, probs, logits, seq_length, bsz):
        """Megatron's _apply_aux_loss and _apply_seq_aux_loss (router.py:410-505), from the
        logits' top-k before any dropping. seq_aux_loss views scores and map [n, E] as
        [s, b*E], each (sequence, expert) pair an expert, and divides by b: the mean over the
        sequences of their losses. The counts are summed over TP x CP (no gradient); T is the
        group's tokens (per sequence for seq_aux_loss). Logged as aux / coeff."""
        routing_map, scores = compute_routing_scores_for_aux_loss(
            logits, self.topk, self.cfg.moe_router_score_function)
        per_sequence = self.cfg.moe_router_load_balancing_type == "seq_aux_loss"
        if per_sequence:
            routing_map = routing_map.reshape(seq_length, -1)                     # [s, b*E]
            scores = scores.reshape(seq_length, -1)
        tokens_per_expert = self.tp_cp.all_reduce(routing_map.sum(0))             # [E] or [b*E]
        total_num_tokens = scores.shape[0] * self.tp_cp.size
        aux_loss = switch_load_balancing_loss_func(scores, tokens_per_expert, total_num_tokens,
                                                   self.topk, self.cfg.num_moe_experts,
                                                   self.aux_loss_coeff)
        if per_sequence:
            aux_loss = aux_loss / bsz
        if self.tracker is not None:
            self.tracker(1 if per_sequence else 0, aux_loss / self.aux_loss_coeff)
        return self.aux_loss_scaler(probs, aux_loss, self.aux_loss_scaler.main_loss_backward_scale)


def routers(cells):
    """The TopKRouter Cells inside `cells` (model chunks, layers or routers), in model order."""
    return [cell for top in cells for _, cell in top.cells_and_names()
            if isinstance(cell, TopKRouter)]


def update_expert_bias(chunks, state):
    """Megatron's _update_router_expert_bias (finalize_model_grads.py:334-371): the step's tokens
    per expert of each training router with a bias, summed over TP x DP x CP (every rank of the
    stage: all get the same), move its bias by rate * sign(mean - tokens), a busy expert down."""
    found = [r for r in routers(chunks) if r.expert_bias is not None and r.training]
    if found:                                         # else no MoE layer on this stage
        tokens = parallel.collectives(state.tp_dp_cp_group).all_reduce(
            ops.stack([r.local_tokens_per_expert[0].value() for r in found]))       # [L, E]
        for router, count in zip(found, tokens):      # moe_utils.py:1199-1229
            step = ops.sign(count.mean() - count) * router.cfg.moe_router_bias_update_rate
            ops.assign(router.expert_bias[0], router.expert_bias[0] + step)
            ops.assign(router.local_tokens_per_expert[0], ops.zeros_like(count))  # count anew
            router.tokens_per_expert = count.asnumpy()                           # for the log


# ============================================================================ experts
def router_gating_linear(x, weight, bias, dtype):
    """Megatron's router_gating_linear (moe_utils.py): the router's logits x [n, h] W^T + b in
    `dtype` (moe_router_dtype, else the input's), to which x, W [E, h] and b [E] are cast."""
    return linear(cast(x, dtype), cast(weight, dtype), cast(bias, dtype))


def _scale_by_probs(y, probs):
    """y [..., T, f] times each token's probability [..., T], in the probs' dtype and back
    (Megatron's per_token_scale, mlp.py:336-340)."""
    return cast(cast(y, probs.dtype) * probs.expand_dims(-1), y.dtype)


def broadcast_like(bias, y):
    """An fc2 bias [..., 1 or T, h] broadcast to y's shape [..., T, h] (scaled then by each
    token's probability): a form, built in the compute dtype."""
    return ops.broadcast_to(bias, y.shape)


def expert_linear(cfg, spec, in_features, out_features, partition_dim, tp, chunks=1,
                  skip_bias_add=False):
    """One expert's linear, a one-rank layers.Linear with the spec's forms computing in the
    compute dtype (as a dense layer's at TP1): weight [out/tp, in] (fc1, partition_dim 0, fc1's
    [gate; up] split in `chunks` blocks) or [out, in/tp] (fc2, partition_dim 1), marked so, and
    `allreduce = False` (Megatron's mark: gradients summed over the expert-data-parallel group,
    not DP). No TP mappings: the dispatcher communicates (Megatron's explicit_expert_comm,
    tensor_parallel/layers.py:1032)."""
    out_local, in_local = (out_features // tp, in_features) if partition_dim == 0 else \
        (out_features, in_features // tp)
    forms = fused.forms_in(spec.linear_forms(), DTYPES[cfg.compute_dtype])
    layer = layers.Linear(in_local, out_local, cfg.add_bias_linear, skip_bias_add, forms)
    split = [layer.weight] + ([layer.bias] if layer.bias is not None and partition_dim == 0
                              else [])
    for param in split:
        param.partition_dim, param.partition_chunks = partition_dim, chunks
    for param in layer.get_parameters():
        param.allreduce = False
    return layer


class ExpertMLP(nn.Cell):
    """An expert: Megatron's MLP with is_expert (mlp.py:257-358), fc2(act(fc1 x) * p) + b2 * p:
    the probability scales the activation (after the GLU), and fc2's bias."""

    def __init__(self, cfg, spec, ffn_hidden_size, tp):
        super().__init__()
        chunks = fc1_chunks(cfg)
        self.linear_fc1 = expert_linear(cfg, spec, cfg.hidden_size, ffn_hidden_size * chunks, 0,
                                        tp, chunks)
        self.linear_fc2 = expert_linear(cfg, spec, ffn_hidden_size, cfg.hidden_size, 1, tp,
                                        skip_bias_add=True)
        # fc2's bias to its output's shape: a form, in the compute dtype
        self.act = cfg.hidden_act
        self.broadcast = fused.in_compute_dtype(broadcast_like, DTYPES[cfg.compute_dtype])

    def construct(self, x, probs):
        """x [T, h], probs [T] -> [T, h] (partial over TP)."""
        y = self.linear_fc1(x)                                                   # [T, F1/tp]
        y, bias = self.linear_fc2(_scale_by_probs(activation(y, self.act), probs))
        if bias is None:
            return y
        return y + _scale_by_probs(self.broadcast(bias, y), probs)


class SequentialMLP(nn.Cell):
    """Megatron's SequentialMLP (experts.py:1409-1519): this rank's E_l experts in
    `local_experts`, run one after another, their linears of the layer spec's class (Megatron's
    MoE submodules). construct(tokens [E_l, T, h], probs [E_l, T]) -> [E_l, T, h]: expert j's
    output for its T tokens, each scaled by its probability."""

    def __init__(self, cfg, spec, num_local_experts, tp):
        super().__init__()
        self.act = cfg.hidden_act
        # transformer_config.py:1685-1687: moe_ffn_hidden_size defaults to ffn_hidden_size
        ffn = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
        self.local_experts = nn.CellList([ExpertMLP(cfg, spec, ffn, tp)
                                          for _ in range(num_local_experts)])

    def construct(self, tokens, probs):
        outputs = []
        for j in range(len(self.local_experts)):
            outputs.append(self.local_experts[j](tokens[j], probs[j]))
        return ops.stack(outputs)


class GroupedMLP(SequentialMLP):
    """moe_grouped_gemm: the same experts and parameters as SequentialMLP (so the two load each
    other's checkpoints and are tested equal), run together as batched matmuls over weights
    stacked at each call. Megatron's TEGroupedMLP (experts.py:183) names them
    experts.linear_fc1.weight{j} instead. Its forms compute in the compute dtype, as the
    experts' linears."""

    def __init__(self, cfg, spec, num_local_experts, tp):
        super().__init__(cfg, spec, num_local_experts, tp)
        self.matmul, self.bias_add, self.broadcast = fused.forms_in(
            (batch_matmul_nt, ops.add, broadcast_like), DTYPES[cfg.compute_dtype])

    def construct(self, tokens, probs):
        experts = self.local_experts
        w1 = ops.stack([e.linear_fc1.weight for e in experts])                  # [E_l, F1/tp, h]
        w2 = ops.stack([e.linear_fc2.weight for e in experts])                  # [E_l, h, F/tp]
        y = self.matmul(tokens, w1)                                              # [E_l, T, F1/tp]
        if experts[0].linear_fc1.bias is not None:
            y = self.bias_add(y, ops.stack([e.linear_fc1.bias for e in experts]).expand_dims(1))
        y = self.matmul(_scale_by_probs(activation(y, self.act), probs), w2)     # [E_l, T, h]
        if experts[0].linear_fc2.bias is None:
            return y
        b2 = ops.stack([e.linear_fc2.bias for e in experts]).expand_dims(1)     # [E_l, 1, h]
        return y + _scale_by_probs(self.broadcast(b2, y), probs)


def make_experts(cfg, spec, num_local_experts, tp):
    """This rank's experts, SequentialMLP or with moe_grouped_gemm GroupedMLP."""
    return (GroupedMLP if cfg.moe_grouped_gemm else SequentialMLP)(
        cfg, spec, num_local_experts, tp)


class SharedExpertMLP(nn.Cell):
    """Megatron's SharedExpertMLP (shared_experts.py:101-205): a dense MLP of width
    moe_shared_expert_intermediate_size on every token, TP column/row-parallel like gpt.MLP
    (with the f~/g~ mappings under sequence parallelism), no bias; with moe_shared_expert_gate
    its output is scaled by sigmoid(x . gate_weight), gate_weight [1, h].
    construct(x [s, b, h]) -> [s, b, h]."""

    def __init__(self, cfg, spec):
        super().__init__()
        sp, size = parallel.get_state().sequence_parallel, cfg.moe_shared_expert_intermediate_size
        self.act, dtype = cfg.hidden_act, DTYPES[cfg.compute_dtype]
        chunks = fc1_chunks(cfg)
        self.linear_fc1 = parallel.ColumnParallelLinear(
            cfg.hidden_size, size * chunks, False, sequence_parallel=sp, chunks=chunks,
            forms=fused.forms_in(spec.linear_forms(), dtype))
        self.linear_fc2 = parallel.RowParallelLinear(
            size, cfg.hidden_size, False, sequence_parallel=sp,
            forms=fused.forms_in(spec.linear_forms(), dtype))
        self.gate_matmul = fused.in_compute_dtype(layers.plain_forms()[0], dtype)
        self.gate_weight = None
        if cfg.moe_shared_expert_gate:
            self.gate_weight = Parameter(Tensor(np.zeros((1, cfg.hidden_size), np.float32)),
                                         name="gate_weight")
            parallel.mark_sequence_parallel([self.gate_weight], sp)    # each gates its tokens

    def construct(self, x):
        y = self.linear_fc2(activation(self.linear_fc1(x), self.act))
        if self.gate_weight is None:
            return y
        return y * ops.sigmoid(linear(x, self.gate_weight, None, self.gate_matmul))  # [s, b, 1]


# ============================================================================ dispatchers
def _all_to_all(comm, x, dim):
    """Equal-split all-to-all over the group along dim 0: x [size * L, ...] -> [size * L, ...]
    whose block i is rank i's block for this rank (a parallel.Mapping half; dim is 0)."""
    y = comm.all_to_all(x.reshape((comm.size, -1) + x.shape[1:]), 0, 1)            # [1, size*L, ..]
    return y.reshape(x.shape)


def all_to_all(group):
    """Megatron's all_to_all mapping (tensor_parallel/mappings.py:424-484) with equal splits:
    its own inverse (block j of rank i <-> block i of rank j), so its backward is itself. On
    CPU parallel.CpuCollectives builds it from an all-gather."""
    return parallel.Mapping(_all_to_all, _all_to_all, 0, group)


class MoEAllGatherTokenDispatcher(nn.Cell):
    """Megatron's default dispatcher (token_dispatcher.py:233-372): tokens and probs are
    all-gathered over TP x EP, each local expert runs on every gathered token, the outputs are
    summed and reduce-scattered back. Megatron permutes only the routed tokens; here every
    token goes with its probability, 0 where it was not routed (or was dropped), so it adds
    exactly 0. Its backward: the gathers' reduce-scatters and the scatter's all-gather."""

    def __init__(self, num_local_experts, local_expert_offset, tp_ep_group=None):
        super().__init__()
        self.first, self.num_local_experts = local_expert_offset, num_local_experts
        self.gather_tokens = parallel.gather_from_sequence_parallel_region(tp_ep_group)
        self.gather_probs = parallel.gather_from_sequence_parallel_region(tp_ep_group)
        self.scatter_output = parallel.reduce_scatter_to_sequence_parallel_region(tp_ep_group)

    def dispatch(self, hidden, probs, routing_map):
        """hidden [n, h], probs [n, E] -> (tokens [E_l, N, h], probs [E_l, N], None) with
        N = n * |TP x EP|."""
        hidden = self.gather_tokens(hidden)                                       # [N, h]
        local = self.gather_probs(probs)[:, self.first:self.first + self.num_local_experts]
        tokens = ops.broadcast_to(hidden, (self.num_local_experts,) + hidden.shape)
        return tokens, local.T, None                                              # [E_l, N]

    def combine(self, expert_output, indices, num_tokens):
        """expert_output [E_l, N, h] -> [n, h], every rank's experts summed (indices and
        num_tokens are the alltoall dispatcher's)."""
        return self.scatter_output(expert_output.sum(0))


class MoEAlltoAllTokenDispatcher(nn.Cell):
    """Megatron's alltoall dispatcher (token_dispatcher.py:375-908) in its drop-and-pad layout
    (moe_pad_expert_input_to_capacity, l. 517-540, 758-783), the static-shape one: each expert
    has C slots, C = min(n, get_capacity(n*k, E, factor)), or C = n when dropless (no expert can
    get more). An expert's slots hold its routed tokens in token order, then tokens whose
    probability for it is 0 (Megatron pads with such tokens too): they add exactly 0.
        [E, C, h] --all-to-all over EP--> [ep, E_l, C, h] --all-gather over TP (ETP = TP)-->
        [tp*ep, E_l, C, h] -> experts [E_l, tp*ep*C, h] -> back the same way (a reduce-scatter
        over TP sums the TP shards' partial outputs) -> scatter-add into [n, h].
    ep_group None: EP = 1."""

    def __init__(self, cfg, num_local_experts, ep_group=None):
        super().__init__()
        self.num_local_experts, self.topk = num_local_experts, cfg.moe_router_topk
        self.capacity_factor = cfg.moe_expert_capacity_factor
        self.exchange = None
        if ep_group is not None:
            # one per call site: tokens, probs, output
            self.exchange = nn.CellList([all_to_all(ep_group) for _ in range(3)])
        # ETP = TP: the current TP group
        self.gather_tokens = parallel.gather_from_sequence_parallel_region()
        self.gather_probs = parallel.gather_from_sequence_parallel_region()
        self.scatter_output = parallel.reduce_scatter_to_sequence_parallel_region()

    def capacity(self, num_tokens, num_experts):
        if self.capacity_factor is None:
            return num_tokens
        slots = get_capacity(num_tokens * self.topk, num_experts, self.capacity_factor)
        return min(num_tokens, slots)

    def dispatch(self, hidden, probs, routing_map):
        """hidden [n, h], probs [n, E] -> (tokens [E_l, tp*ep*C, h], probs [E_l, tp*ep*C],
        slot indices [E, C] into this rank's tokens)."""
        num_tokens, num_experts = probs.shape
        capacity = self.capacity(num_tokens, num_experts)
        indices = ops.topk(token_order_key(routing_map), capacity)[1]             # [E, C]
        tokens = ops.gather(hidden, indices.reshape(-1), 0)                        # [E*C, h]
        # 0 in a slot that holds a token routed elsewhere: probs is 0 off the (kept) map
        slot_probs = ops.gather_elements(probs.T, 1, indices).reshape(-1)         # [E*C]
        if self.exchange is not None:
            tokens, slot_probs = self.exchange[0](tokens), self.exchange[1](slot_probs)
        tokens, slot_probs = self.gather_tokens(tokens), self.gather_probs(slot_probs)
        # [tp*ep, E_l, C, ...] -> [E_l, tp*ep*C, ...]: Megatron's sort_chunks for drop-and-pad
        tokens = tokens.reshape(-1, self.num_local_experts, capacity, tokens.shape[-1])
        tokens = tokens.transpose(1, 0, 2, 3).reshape(self.num_local_experts, -1, tokens.shape[-1])
        slot_probs = slot_probs.reshape(-1, self.num_local_experts, capacity).transpose(1, 0, 2)
        return tokens, slot_probs.reshape(self.num_local_experts, -1), indices

    def combine(self, expert_output, indices, num_tokens):
        """expert_output [E_l, tp*ep*C, h] -> [n, h]: each slot's output added to its token
        (Megatron's unpermute, a scatter-add)."""
        capacity, hidden_size = indices.shape[1], expert_output.shape[-1]
        output = expert_output.reshape(self.num_local_experts, -1, capacity, hidden_size)
        output = self.scatter_output(output.transpose(1, 0, 2, 3).reshape(-1, hidden_size))
        if self.exchange is not None:
            output = self.exchange[2](output)                                     # [E*C, h]
        return ops.unsorted_segment_sum(output, indices.reshape(-1), num_tokens)


# ============================================================================ the layer
class MoELayer(nn.Cell):
    """Megatron's MoELayer (moe_layer.py:214-719), a drop-in for gpt.MLP: construct(hidden
    [s, b, h]) -> [s, b, h] in the compute dtype. The current ParallelState gives the expert
    parallel size and rank and the groups (the module docstring). This rank holds experts
    [ep_rank * E_l, (ep_rank + 1) * E_l) (moe_layer.py:187-196)."""

    def __init__(self, cfg, spec):
        super().__init__()
        state = parallel.get_state()
        ep_group = state.ep_group if state.ep > 1 else None
        self.num_local_experts = cfg.num_moe_experts // state.ep
        # this rank's first expert among all (Megatron's local_expert_indices_offset)
        self.local_expert_offset = first_expert(cfg.num_moe_experts, state.ep, state.ep_rank)
        self.router = TopKRouter(cfg, state.tp_cp_group)
        self.experts = make_experts(cfg, spec, self.num_local_experts, state.tp)
        if cfg.moe_token_dispatcher_type == "allgather":
            self.token_dispatcher = MoEAllGatherTokenDispatcher(
                self.num_local_experts, self.local_expert_offset, state.tp_ep_group)
        else:                                                     # "alltoall"
            self.token_dispatcher = MoEAlltoAllTokenDispatcher(cfg, self.num_local_experts,
                                                               ep_group)
        self.shared_experts = None
        if cfg.moe_shared_expert_intermediate_size:
            self.shared_experts = SharedExpertMLP(cfg, spec)

    def construct(self, hidden):
        s, b, h = hidden.shape
        # the shared expert first, as Megatron (moe_layer.py:660-662)
        shared = self.shared_experts(hidden) if self.shared_experts is not None else None
        probs, routing_map = self.router(hidden)                                  # [n, E] each
        tokens, probs, indices = self.token_dispatcher.dispatch(hidden.reshape(s * b, h), probs,
                                                                routing_map)
        output = self.token_dispatcher.combine(self.experts(tokens, probs), indices, s * b)
        output = output.reshape(s, b, h)
        return output if shared is None else output + shared


if __name__ == "__main__":          # imported by gpt.py, not a script
    raise SystemExit("error: moe.py is a library: run `bash run.sh` (bash run.sh --help "
                     "lists the commands)")
