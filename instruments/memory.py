"""Memory, communication and FLOPs of a layout, per rank, from the config alone: `bash run.sh plan`
(any model, any world size, in seconds, nothing allocated) and the start-up report of a training
run (`RankReport`), whose end logs the measured peak beside it.

Everything is counted in bytes, each tensor at its dtype's size (DTYPE_BYTES), with P the
parameters on the rank (its pipeline chunks, its TP shard of each split weight; a tied output layer
on the last stage is a copy of the word embedding):

  weights      P x params_dtype (4 bytes in float32, 2 in float16 with --fp16)
  gradients    P x main_grad_dtype: summed over the step's micro-batches in float32, or in the
               parameters' half precision (config.main_grad_dtype)
  optimizer    float32 state: AdamW/Adam 2P (two moments), SGD P (momentum) or 0, plus the float32
               main params of half-precision parameters, P (optimizer.MixedPrecisionOptimizer); with
               the distributed optimizer each of the dp x cp ranks keeps 1/(dp x cp) of the state
               and of the float32 main params (optimizer_state_bytes measures them), of
               the routed experts' 1/(dp x cp / ep), their expert-data-parallel group's share
  activations  what the backward keeps of each micro-batch in flight (`layer_activations`, after
               Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
               Models", Table 2, written for this code) at the compute dtype's size, but for what
               stays float32 (norm inputs, the float32 softmax, the loss's logits), plus the working
               set of one layer's backward; an MoE layer's router, dispatched tokens and experts
               instead of the MLP's (`moe_activations`)

Megatron's theoretical_memory_usage.py counts 18 bytes per parameter with --fp16 (fp16 weight,
fp32 gradient, fp32 main param and two moments): here the same with
--accumulate-allreduce-grads-in-fp32, 16 with --fp16 alone or in float32; with the distributed
optimizer the main params and moments (12 bytes) are split over dp x cp ranks: 6 + 12 / (dp x cp),
4 + 12 / (dp x cp), 8 + 12 / (dp x cp) (docs/half-precision.md has the table).
"""
import math
import re
from types import SimpleNamespace

import data
import gpt
import optimizer as opt
import pipeline
from settings.cli import CONFIG_FLAG, REQUIRED, load_config, parse_command
from parallel import DTYPES
from settings.config import (SPLIT_FLAGS, ConfigError, cp_ring_size, fc1_chunks,
                             main_grad_dtype, megatron_layer_counts, moe_layer_pattern,
                             padded_vocab_size, recompute_counts, samples_per_split,
                             sharded_by_fsdp)
from tokenizer import build_tokenizer

DTYPE_BYTES = {name: dtype.itemsize for name, dtype in DTYPES.items()}   # config's dtype names
F32_BYTES = 4
GIB = 1024 ** 3
MIB = 1024 ** 2
# MLP activation tensors the backward keeps, in units of [s, b, ffn/tp]: GELU keeps its input and
# output (fc2's input); the written-out tanh form 0.5 x (1 + tanh(0.798 (x + 0.0447 x^3))) keeps
# x, 0.0447 x, 0.0447 x^2, the tanh, 1 + tanh, 0.5 x and the output; SwiGLU keeps the gate, the
# up projection, silu(gate) and the output
MLP_KEPT = {"gelu": 2, "gelu_tanh": 7, "swiglu": 4}
# fused.BiasGelu keeps fc1's output, its own output and the GELU's slope
BIAS_GELU_KEPT = 3
# Temporaries of one layer's core attention, in units of its scores [b, n/tp, s, s]: the forward's
# scores and scores + mask; the backward's gradient of the softmax output, the softmax gradient's
# three intermediates, the scores' gradient and its transpose (for the key gradient); and two
# more that the measured peak of the plain form holds beside them, not attributed to a named
# tensor (test_memory_estimate_matches_the_measured_peak_and_recompute_lowers_it: with 8 the
# full-recompute run measured 1.33x its estimate). The fused softmax's backward
# (fused.FusedScaleMaskSoftmax) has four at its peak: the softmax-output gradient, dY * Y, the row
# sums made full and Y times them (docs/memory.md)
CORE_TEMPORARIES = 10
FUSED_CORE_TEMPORARIES = 4


# ============================================================================ the model's shapes
def vocab_rows(cfg):
    """The padded vocabulary, as train.build_model derives it (the tokenizer read, not the data)."""
    model_cfg, dataset_cfg = cfg.model_config, cfg.dataset_config
    if model_cfg.vocab_size is not None:
        return model_cfg.vocab_size
    if dataset_cfg.mock_data and dataset_cfg.vocab_size:
        size = dataset_cfg.vocab_size
    else:
        tokenizer = build_tokenizer(dataset_cfg.tokenizer_type, dataset_cfg.vocab_file,
                                    dataset_cfg.merge_file, dataset_cfg.vocab_size)
        size = tokenizer.vocab_size
    return padded_vocab_size(model_cfg, size)


def chunk_first_layers(model_cfg, parallel_cfg):
    """Per pipeline rank, the first global layer of each of its model chunks (as
    stage_chunks)."""
    pp = parallel_cfg.pipeline_model_parallel_size
    vpp = parallel_cfg.virtual_pipeline_model_parallel_size
    split = pipeline.layer_split(model_cfg.num_layers, pp, vpp, parallel_cfg.num_layer_list)
    return [[split[chunk_id * pp + r][0] for chunk_id in range(vpp)] for r in range(pp)]


def cp_split(parallel_cfg):
    """(cp, Ulysses degree, ring size): cp = ring x ulysses (config sets ulysses_degree_in_cp: cp
    for Ulysses, 1 for the ring, the hybrid's own value)."""
    cp = parallel_cfg.context_parallel_size
    ulysses = parallel_cfg.ulysses_degree_in_cp
    return cp, ulysses, cp_ring_size(cp, ulysses)


def ring_passes_blocks(model_cfg, parallel_cfg):
    """Whether the ring passes key/value blocks (context_parallel.RingAttention, cp_comm_type
    p2p or a2a+p2p), which keeps and recomputes as flash attention does, rather than
    all-gathering them."""
    return cp_split(parallel_cfg)[2] > 1 and model_cfg.cp_comm_type != "all_gather"


def stage_chunks(model_cfg, parallel_cfg):
    """Per pipeline rank, its model chunks as (layers, embeds, has the loss), from
    pipeline.layer_split: chunk c of rank r is virtual stage c * pp + r."""
    pp = parallel_cfg.pipeline_model_parallel_size
    vpp = parallel_cfg.virtual_pipeline_model_parallel_size
    split = pipeline.layer_split(model_cfg.num_layers, pp, vpp, parallel_cfg.num_layer_list)
    last = len(split) - 1
    return [[(split[chunk_id * pp + r][1], chunk_id * pp + r == 0, chunk_id * pp + r == last)
             for chunk_id in range(vpp)]
            for r in range(pp)]


# ============================================================================ parameters
def layer_parameters(model_cfg, tp=1, moe=False, ep=1):
    """One transformer layer on a TP rank: the column-parallel qkv and fc1 and the row-parallel
    proj and fc2 weights split over tp (with qkv's and fc1's biases); norms and the row-parallel
    biases (added after the reduction) replicated. An MoE layer (`moe`) has moe_parameters
    instead of the MLP's."""
    h, heads, ffn = model_cfg.hidden_size, model_cfg.num_attention_heads, model_cfg.ffn_hidden_size
    head_dim = h // heads
    norm = h * (2 if model_cfg.normalization == "LayerNorm" else 1)
    # GQA: n query heads, g key heads and g value heads, head_dim wide each
    qkv = (heads + 2 * model_cfg.num_query_groups) * head_dim
    split = h * qkv + qkv * model_cfg.qkv_has_bias + heads * head_dim * h
    norms = (2 + 2 * model_cfg.use_sandwich_norm) * norm
    mlp = moe_parameters(model_cfg, tp, ep) if moe else mlp_parameters(model_cfg, ffn, tp)
    return norms + split // tp + h * model_cfg.out_proj_has_bias + mlp


def mlp_parameters(model_cfg, ffn, tp, bias=None):
    """An MLP of width `ffn` on a TP rank: fc1 (SwiGLU: [gate; up]) and its bias split, fc2
    split, fc2's bias replicated; `bias` (default add_bias_linear) whether it has biases."""
    h = model_cfg.hidden_size
    bias = model_cfg.add_bias_linear if bias is None else bias
    fc1 = ffn * fc1_chunks(model_cfg)                                 # SwiGLU: [gate; up]
    return (h * fc1 + fc1 * bias + ffn * h) // tp + h * bias


def moe_parameters(model_cfg, tp=1, ep=1):
    """An MoE layer on a TP x EP rank (moe.MoELayer): the router [E, h] (and bias), replicated;
    E / ep experts, each an MLP of moe_ffn_hidden_size split over TP; the shared expert, split
    over TP, without bias, and its gate [1, h]."""
    h, experts = model_cfg.hidden_size, model_cfg.num_moe_experts
    router = experts * (h + model_cfg.add_bias_linear)
    count = router + experts // ep * mlp_parameters(model_cfg, model_cfg.moe_ffn_hidden_size, tp)
    shared = model_cfg.moe_shared_expert_intermediate_size
    if shared:
        count += mlp_parameters(model_cfg, shared, tp, bias=False)
        count += h * model_cfg.moe_shared_expert_gate
    return count


def chunk_parameters(model_cfg, tp, layers, embeds, has_loss, first=0, ep=1):
    """A model chunk (gpt.GPTModel) of `layers` layers from global layer `first` on a TP x EP
    rank: its layers (the MoE ones, config.moe_layer_pattern, with E / ep experts); the
    vocabulary-parallel word embedding and the absolute position embeddings if it embeds; the
    final norm and the output layer if it has the loss (the word embedding itself when tied in
    the same chunk, else a copy)."""
    h, vocab = model_cfg.hidden_size, model_cfg.padded_vocab_size
    pattern = moe_layer_pattern(model_cfg)[first:first + layers]
    count = sum(layer_parameters(model_cfg, tp, moe, ep) for moe in pattern)
    if embeds:
        count += vocab * h // tp
        if model_cfg.position_embedding_type == "absolute":
            count += model_cfg.max_position_embeddings * h
    if has_loss:
        count += h * (2 if model_cfg.normalization == "LayerNorm" else 1)
        if model_cfg.untie_embeddings_and_output_weights or not embeds:
            count += vocab * h // tp
    return count


def total_parameters(model_cfg):
    """The model's parameters, each counted once (one process)."""
    return chunk_parameters(model_cfg, 1, model_cfg.num_layers, True, True)


def stage_parameters(cfg, rank):
    """Parameters on each TP x EP rank of pipeline rank `rank` (every one holds as many)."""
    model_cfg, parallel_cfg = cfg.model_config, cfg.parallel_config
    firsts = chunk_first_layers(model_cfg, parallel_cfg)[rank]
    return sum(chunk_parameters(model_cfg, parallel_cfg.tensor_model_parallel_size, *chunk,
                                first, parallel_cfg.expert_model_parallel_size)
               for chunk, first in zip(stage_chunks(model_cfg, parallel_cfg)[rank], firsts))


def optimizer_bytes(cfg, params, experts=0):
    """Bytes of float32 optimizer state and main params on a rank holding `params` parameters,
    `experts` of them routed experts' (see the module doc). The distributed optimizer
    (optimizer.get_megatron_optimizer, with several dp x cp ranks) shards the dense parameters
    over the dp x cp ranks and the experts' over their expert-data-parallel group of
    dp x cp / ep ranks (as Megatron's expert optimizer does), each shard a float32 copy with its
    state; a group of one rank still keeps the whole copy."""
    optimizer_cfg, training_cfg = cfg.optimizer_config, cfg.training_config
    parallel_cfg = cfg.parallel_config
    # float32 state values per parameter: Adam's two moments, SGD's momentum or nothing
    if optimizer_cfg.optimizer_type != "SGD":
        per_param = 2
    elif optimizer_cfg.momentum:
        per_param = 1
    else:
        per_param = 0
    shards = parallel_cfg.data_parallel_size * parallel_cfg.context_parallel_size
    if training_cfg.use_distributed_optimizer and shards > 1:
        expert_shards = shards // parallel_cfg.expert_model_parallel_size
        return F32_BYTES * (math.ceil((per_param + 1) * (params - experts) / shards)
                            + math.ceil((per_param + 1) * experts / expert_shards))
    # float32 main params beside half-precision ones
    copies = cfg.model_config.params_dtype != "float32"
    return F32_BYTES * (per_param + copies) * params


# ============================================================================ activations
def norm_kept(model_cfg):
    """[s, b, h] float32 tensors a norm keeps: the LayerNorm kernel its input; RMSNorm written
    out, and both fused forms (fused.py), also x normalised."""
    return 1 if model_cfg.normalization == "LayerNorm" and not model_cfg.persist_layer_norm else 2


def mlp_kept(model_cfg):
    """[s, b, ffn/tp] tensors a dense MLP's activation keeps (MLP_KEPT, or fused.BiasGelu's)."""
    if (model_cfg.bias_gelu_fusion and model_cfg.add_bias_linear
            and model_cfg.hidden_act != "swiglu"):
        return BIAS_GELU_KEPT
    return MLP_KEPT[model_cfg.hidden_act]


def layer_activations(model_cfg, parallel_cfg, micro_batch_size, moe=False):
    """What the backward keeps of one transformer layer for one micro-batch on one rank:
    [(tensor, bytes, in the core attention)]. s = seq_length, h hidden, n heads, g query groups,
    f ffn, tp, cp; x = b s h / cp, the layer's hidden states on a cp rank, whole over TP. Tensors
    are of the compute dtype (c bytes a value) but the norms' inputs, normalised in float32, and
    the float32 softmax's output (with its half-precision copy for the weighted sum). An MoE layer
    (`moe`) keeps moe_activations instead of the MLP's.

    Sequence parallelism keeps the norms' inputs and the dropout masks at [s/tp, b, h]; the inputs
    of qkv and fc1 are all-gathered to [s, b, h], and their matmuls keep the gathered copy (Megatron
    keeps the shard and gathers again in the backward). The core attention's scores on a rank are
    [b, n/tp, s, s] / cp whatever the algorithm: Ulysses attends over the whole sequence with
    n/(tp cp) heads, the ring over its s/cp queries and every key (cp_comm_type all_gather: the
    whole sequence's K and V all-gathered, ring x the Ulysses shapes; a ring passing blocks keeps
    what flash attention keeps). Selective recompute keeps the core attention's inputs (q, k, v)
    instead of its inside."""
    h, n, g = model_cfg.hidden_size, model_cfg.num_attention_heads, model_cfg.num_query_groups
    s, tp = model_cfg.seq_length, parallel_cfg.tensor_model_parallel_size
    cp, _, ring = cp_split(parallel_cfg)
    sp = tp if parallel_cfg.sequence_parallel else 1
    x = micro_batch_size * s * h // cp
    scores = micro_batch_size * n * s * s // (tp * cp)
    norm = norm_kept(model_cfg)
    c = DTYPE_BYTES[model_cfg.compute_dtype]
    softmax = c + (F32_BYTES if model_cfg.attention_softmax_in_fp32 and c < F32_BYTES else 0)
    mlp = moe_activations(model_cfg, parallel_cfg, micro_batch_size) if moe else [
        ("fc1 input [s, b, h]", c * x, False),
        ("MLP activations [s, b, ffn/tp]",
         c * mlp_kept(model_cfg) * x * model_cfg.ffn_hidden_size // (h * tp), False)]
    core = [("q scaled, k and v repeated per query head [b, n/tp, s, h/n]",
             c * (1 + 2 * ring) * x // tp, True),
            ("softmax output [b, n/tp, s, s]", softmax * scores, True)]
    if model_cfg.masked_softmax_fusion:
        # fused.FusedScaleMaskSoftmax's custom backward keeps its input, the scores, too
        core.append(("softmax input, kept by the fused softmax [b, n/tp, s, s]",
                     softmax * scores, True))
    if model_cfg.use_flash_attention or ring_passes_blocks(model_cfg, parallel_cfg):
        # gpt.FlashKernel's bprop, and context_parallel.RingKernel's, keeps its inputs, its
        # output and the log-sum-exp
        core = [("flash or ring attention: q, k, v [s, b, n + 2g, h/n] and output "
                 "[s, b, n/tp, h/n]", c * (2 * n + 2 * g) * x // (n * tp), True),
                ("flash or ring attention: log-sum-exp [b, n/tp, s, 1], float32",
                 F32_BYTES * scores // s, True)]
    rows = [("norm inputs [s/tp (SP), b, h]",
             F32_BYTES * (2 + 2 * model_cfg.use_sandwich_norm) * norm * x // sp, False),
            ("qkv input [s, b, h]", c * x, False), *core,
            ("proj input [s, b, h/tp]", c * x // tp, False), *mlp]
    if model_cfg.position_embedding_type == "rope":
        # x cos + rotate_half(x) sin keeps both factors
        rows.append(("q and k and their rotated halves (RoPE) [s, b, n + g, h/n]",
                     c * 2 * (n + g) * x // (n * tp), False))
    if model_cfg.attention_dropout_rate:
        rows.append(("attention dropout mask and output [b, n/tp, s, s]", c * 2 * scores, True))
    if model_cfg.hidden_dropout_rate:
        rows.append(("hidden dropout masks [s/tp (SP), b, h]", c * 2 * x // sp, False))
    if model_cfg.recompute_granularity == "selective":
        rows.append(("q, k, v kept for the recomputed core attention",
                     c * (n + 2 * g) * x // (n * tp), False))
    return rows


def expert_capacity(model_cfg, n):
    """Slots per expert of the alltoall dispatcher for n tokens on a rank
    (moe.MoEAlltoAllTokenDispatcher.capacity): n when dropless, else
    min(n, ceil(n k / E x capacity factor)), Megatron's get_capacity."""
    factor = model_cfg.moe_expert_capacity_factor
    if factor is None:
        return n
    return min(n, math.ceil(n * model_cfg.moe_router_topk / model_cfg.num_moe_experts * factor))


def dispatched_rows(model_cfg, parallel_cfg, n):
    """T, the tokens each of a rank's E / ep experts runs on for n routed tokens on the rank
    (moe.py's static shapes): the allgather dispatcher gathers every token of the TP x EP group,
    T = n tp ep, each with its probability (0 where not routed there); the alltoall dispatcher
    fills capacity slots, T = tp ep C (expert_capacity; C = n dropless). Either way with or
    without moe_pad_expert_input_to_capacity, which changes only which slots carry a probability.
    Megatron permutes only the routed tokens: dropless and balanced (each expert k / E of them)
    its experts would see n tp k / ep rows each on average, E / k times fewer than here."""
    tp, ep = parallel_cfg.tensor_model_parallel_size, parallel_cfg.expert_model_parallel_size
    if model_cfg.moe_token_dispatcher_type == "allgather":
        return n * tp * ep
    return tp * ep * expert_capacity(model_cfg, n)


def moe_activations(model_cfg, parallel_cfg, micro_batch_size):
    """What an MoE layer (moe.MoELayer) keeps for the backward of one micro-batch on a rank, the
    rows replacing the MLP's in layer_activations; n = b s / (cp tp) tokens routed on the rank
    (TP needs SP), r bytes a router value (float32 with moe_router_dtype fp32, else c). The
    router: its input [n, h], the top-k's one-hot [n, k, E] and probs [n, k] (float32), the
    scores of pre-softmax or sigmoid routing and of the aux loss [n, E] (float32), the z-loss's
    logits, capacity dropping's probs and mask [n, E]; the experts: each of the E / ep runs on
    T = dispatched_rows tokens [T, h], keeps its MLP's activations [T, moe_ffn/tp] and those
    again at the probs' dtype with the probs [T] (fc2(act(fc1 x) p)), with biases fc2's bias
    broadcast to [T, h]; the shared expert keeps a dense MLP's, and with its gate the output."""
    h, experts, k = model_cfg.hidden_size, model_cfg.num_moe_experts, model_cfg.moe_router_topk
    s, tp = model_cfg.seq_length, parallel_cfg.tensor_model_parallel_size
    cp = parallel_cfg.context_parallel_size
    local = experts // parallel_cfg.expert_model_parallel_size              # E / ep on a rank
    sp = tp if parallel_cfg.sequence_parallel else 1
    c, act = DTYPE_BYTES[model_cfg.compute_dtype], MLP_KEPT[model_cfg.hidden_act]
    r = F32_BYTES if model_cfg.moe_router_dtype == "fp32" else c
    n, x = micro_batch_size * s // (cp * sp), micro_batch_size * s * h // cp
    # the router's matmul keeps its input, cast to float32 with moe_router_dtype fp32
    rows = [("router input [n, h]", (c + (r != c) * r) * n * h, False),
            ("router top-k: one-hot [n, k, E] and probs [n, k], float32",
             F32_BYTES * n * k * (experts + 1), False)]
    full_scores = (model_cfg.moe_router_score_function == "sigmoid"
                   or model_cfg.moe_router_pre_softmax)
    balancing = model_cfg.moe_aux_loss_coeff and model_cfg.moe_router_load_balancing_type != "none"
    kept = [("router scores [n, E], float32", F32_BYTES, full_scores),
            ("aux-loss scores [n, E], float32", F32_BYTES, balancing),
            ("z-loss logits [n, E]", r, model_cfg.moe_z_loss_coeff),
            ("capacity: probs and mask [n, E]", 2 * r,
             model_cfg.moe_expert_capacity_factor is not None)]
    rows += [(name, size * n * experts, False) for name, size, used in kept if used]
    rows_t = local * dispatched_rows(model_cfg, parallel_cfg, n)         # E/ep x T
    ffn = model_cfg.moe_ffn_hidden_size
    rows += [("dispatched tokens [E/ep, T, h]",
              c * rows_t * h * (1 + model_cfg.add_bias_linear), False),
             ("expert MLP activations [E/ep, T, moe_ffn/tp] and probs [E/ep, T]",
              (c * act + r) * rows_t * ffn // tp + r * rows_t, False)]
    shared = model_cfg.moe_shared_expert_intermediate_size
    if shared:
        # its fc1 keeps the SP all-gathered input (without SP the router's input); the gate the
        # shared output [s/tp, b, h]
        rows.append(("shared expert: fc1 input, MLP activations [s, b, shared/tp], gated output",
                     c * (x * (sp > 1) + act * x * shared // (h * tp)
                          + model_cfg.moe_shared_expert_gate * x // sp), False))
    return rows


def chunk_activations(model_cfg, parallel_cfg, micro_batch_size, layers, embeds, has_loss,
                      recomputed, first=0):
    """(kept per micro-batch, recompute working set), in bytes, of a chunk of `layers` layers from
    global layer `first` (its MoE layers config.moe_layer_pattern's) of which full recompute
    recomputes `recomputed`: uniform keeps the input [s/tp (SP), b, h] of each group of
    recompute_num_layers layers and rebuilds one group at a time; block keeps the input of each of
    its first `recomputed` layers and rebuilds one at a time; selective keeps every layer but its
    core attention and rebuilds one layer's."""
    pattern = moe_layer_pattern(model_cfg)[first:first + layers]
    per_layer = [layer_activations(model_cfg, parallel_cfg, micro_batch_size, moe)
                 for moe in pattern]
    full = [sum(e for _, e, _ in rows) for rows in per_layer]
    core = sum(e for _, e, inside in per_layer[0] if inside)   # the same attention in every layer
    s, cp = model_cfg.seq_length, parallel_cfg.context_parallel_size
    x = micro_batch_size * s * model_cfg.hidden_size // cp
    sp = parallel_cfg.tensor_model_parallel_size if parallel_cfg.sequence_parallel else 1
    c, logits = DTYPE_BYTES[model_cfg.compute_dtype], c_or_f32(model_cfg)
    hidden = c if not model_cfg.fp32_residual_connection else F32_BYTES
    if model_cfg.recompute_granularity == "selective":
        kept, working = sum(full) - layers * core, core
    elif model_cfg.recompute_granularity == "full" and model_cfg.recompute_method == "uniform":
        group = model_cfg.recompute_num_layers
        kept = hidden * -(-layers // group) * x // sp
        working = max(sum(full[i:i + group]) for i in range(0, layers, group))
    elif model_cfg.recompute_granularity == "full":
        # block: the recomputed layers keep their inputs, the others all they keep
        kept = hidden * recomputed * x // sp + sum(full[recomputed:])
        working = max(full[:recomputed], default=0)
    else:
        kept, working = sum(full), 0
    if embeds:
        # token and position ids (int32), and the embedding dropout's mask [s/tp (SP), b, h]
        kept += 4 * 2 * micro_batch_size * s // cp
        if model_cfg.hidden_dropout_rate:
            kept += c * x // sp
    if has_loss:
        # the final norm's input (float32), the output layer's input, the logits and their
        # log-softmax [s/cp, b, V/tp] (fused.FusedCrossEntropy: its softmax)
        norm = norm_kept(model_cfg)
        cp_tp = cp * parallel_cfg.tensor_model_parallel_size
        vocab = micro_batch_size * s * model_cfg.padded_vocab_size // cp_tp
        kept += F32_BYTES * norm * x // sp + c * x + logits * 2 * vocab
    return kept, working


def c_or_f32(model_cfg):
    """Bytes of a logit value for the loss: float32 unless fp16_lm_cross_entropy."""
    return DTYPE_BYTES[model_cfg.compute_dtype] if model_cfg.fp16_lm_cross_entropy else F32_BYTES


def in_flight(cfg, rank):
    """Micro-batches whose activations pipeline rank `rank` holds at once: the peak of its
    schedule (1F1B: min(pp - rank, micro-batches); interleaved: Megatron's warmup; afab: every
    micro-batch), counted in model chunks; one without a pipeline (each micro-batch's backward
    follows its forward)."""
    parallel_cfg = cfg.parallel_config
    if parallel_cfg.pipeline_model_parallel_size == 1:
        return 1
    passes = pipeline.schedule(parallel_cfg.pipeline_model_parallel_size, rank,
                               cfg.dataset_config.micro_batch_num,
                               parallel_cfg.virtual_pipeline_model_parallel_size,
                               kind=parallel_cfg.pipeline_schedule)
    return pipeline.peak_in_flight(passes)


def flash_transients(cfg, tp):
    """gpt.FlashAttention's transients: (mask bytes, values in one block pair's scores, bytes of
    the backward's dq, dk, dv [b, n/(tp cp), s, h/n] and their scattered updates; Ulysses, the
    only CP flash attention runs under, spreads the heads). The mask is not tiled: none beside
    the model's causal one, a document mask [b, 1, s, s] in float32."""
    model_cfg, micro_batch_size = cfg.model_config, cfg.dataset_config.batch_size
    s, heads = model_cfg.seq_length, tp * cfg.parallel_config.context_parallel_size
    block = gpt.flash_block(s, gpt.FLASH_BLOCK)
    mask = F32_BYTES * micro_batch_size * s ** 2 * cfg.dataset_config.reset_attention_mask
    scores = micro_batch_size * model_cfg.num_attention_heads * block ** 2 // heads
    c = DTYPE_BYTES[model_cfg.compute_dtype]
    return mask, scores, 2 * 3 * c * micro_batch_size * s * model_cfg.hidden_size // heads


def stage_activations(cfg, rank):
    """Activation bytes on a rank of pipeline stage `rank`: (kept, transient, in flight).
    kept: the in-flight chunk forwards times the largest chunk's kept activations (exact for
    equal chunks). transient, beside them: the causal-mask bias tiled to [b, n/tp, s, s] once per
    forward (gpt.GPTModel.construct; flash_transients with flash attention), then the larger of
    two moments of the backward: the loss's, with the logits' gradient [s, b, V/tp] (last stage),
    and a layer's, with its core attention's temporaries (CORE_TEMPORARIES, or
    FUSED_CORE_TEMPORARIES), the gradients of its kept tensors and the recompute working set."""
    model_cfg, parallel_cfg = cfg.model_config, cfg.parallel_config
    micro_batch_size, s = cfg.dataset_config.batch_size, model_cfg.seq_length
    stage = stage_chunks(model_cfg, parallel_cfg)[rank]
    chunks = [chunk_activations(model_cfg, parallel_cfg, micro_batch_size, *chunk, n, first)
              for chunk, n, first in zip(stage, recompute_counts(parallel_cfg, model_cfg)[rank],
                                         chunk_first_layers(model_cfg, parallel_cfg)[rank])]
    tp, (cp, _, ring) = parallel_cfg.tensor_model_parallel_size, cp_split(parallel_cfg)
    scores = micro_batch_size * model_cfg.num_attention_heads * s ** 2 // (tp * cp)
    mask = F32_BYTES * scores // ring                             # [b, n/(tp u), s/r, s/r], float32
    softmax = DTYPE_BYTES[model_cfg.compute_dtype]
    if model_cfg.attention_softmax_in_fp32:
        softmax = F32_BYTES
    # the gradients of a layer's kept tensors are as large as those tensors (the larger layer's,
    # dense or MoE, if the stage has both)
    gradients = max(sum(e for _, e, _ in layer_activations(model_cfg, parallel_cfg,
                                                           micro_batch_size, moe))
                    for moe in set(stage_layer_kinds(cfg, rank)))
    if model_cfg.use_flash_attention:
        mask, scores, flash_gradients = flash_transients(cfg, tp)
        gradients += flash_gradients
    elif ring_passes_blocks(model_cfg, parallel_cfg):
        scores //= ring                 # one block's [b, n/(tp u), s/r, s/r] at a time
    temporaries = FUSED_CORE_TEMPORARIES if model_cfg.masked_softmax_fusion else CORE_TEMPORARIES
    layer = softmax * temporaries * scores + gradients + max(w for _, w in chunks)
    logits = 0
    if any(chunk[2] for chunk in stage):                              # the stage has the loss
        vocab = model_cfg.padded_vocab_size
        logits = c_or_f32(model_cfg) * micro_batch_size * s * vocab // (cp * tp)
    count = in_flight(cfg, rank)
    return count * max(k for k, _ in chunks), mask + max(layer, logits), count


# ============================================================================ communication
def communication(cfg, rank):
    """Collectives per step on a rank of pipeline stage `rank`, as instruments/ledger.py counts
    them ({(group kind, op): (calls, bytes of the input tensors)}), by the formulas the suite's
    test_tp_ledger_counts_match_the_formulas and test_dp_ledger_counts_match_the_formulas check:
    per micro-batch, tensor parallelism all-reduces [s, b, h] 4 times a layer, once for the
    embedding and once for the logits' gradient, plus the cross-entropy's 3 of [s, b]; with
    sequence parallelism those of the layers and edges become all-gathers of [s/tp, b, h] and
    reduce-scatters of [s, b, h], and the norms' and row biases' gradients are all-reduced each
    step. Data parallelism: each gradient bucket all-reduced (or reduce-scattered and
    all-gathered by the distributed optimizer) and the logged loss; the pipeline: the simulated
    schedule's exchanges of [s (/tp under SP), b, h], and the tied embedding's gradient between
    the first and last stage. Context parallelism (context_parallel.py), per layer and
    micro-batch with a = b s / cp tokens on a rank: Ulysses 4 all-to-alls of q, k, v and the
    context forward and 4 backward; the ring passes k and v [a, g d / tp] ring - 1 times forward
    and backward, and their gradients ring - 1 times (cp_comm_type all_gather: k and v
    all-gathered forward, their ring-times-larger gradients reduce-scattered backward); the loss
    and token count are
    all-reduced over CP. Experts: _expert_collectives."""
    model_cfg, parallel_cfg = cfg.model_config, cfg.parallel_config
    chunks = stage_chunks(model_cfg, parallel_cfg)[rank]
    layers = sum(chunk[0] for chunk in chunks)
    first, last = any(c[1] for c in chunks), any(c[2] for c in chunks)
    out = {}

    def add(kind, op, calls, nbytes):
        if calls:
            old = out.get((kind, op), (0, 0))
            out[(kind, op)] = (old[0] + calls, old[1] + nbytes)
    _tensor_parallel_collectives(cfg, layers, first, last, add, stage_moe_layers(cfg, rank))
    _context_parallel_collectives(cfg, layers, last, add)
    # the gradient norm: the dense optimizer's, and the experts' (optimizer.ChainedOptimizer)
    norms = 1 + bool(model_cfg.num_moe_experts)
    if parallel_cfg.tensor_model_parallel_size * parallel_cfg.pipeline_model_parallel_size > 1:
        add("mp", "all_reduce", norms, norms * F32_BYTES)
    _data_parallel_collectives(cfg, rank, add)
    _expert_collectives(cfg, rank, add)
    _pipeline_collectives(cfg, rank, first, last, add)
    return out


def _hidden_elements(cfg):
    """Elements of the hidden states [s/cp, b, h] of a micro-batch on a cp rank: a pipeline hop
    without sequence parallelism (pipeline.hop_shape)."""
    return math.prod(pipeline.hop_shape(cfg.model_config, cfg.dataset_config.batch_size,
                                        cfg.parallel_config.context_parallel_size))


def _tensor_parallel_collectives(cfg, layers, first, last, add, moe_layers=0):
    """TP's collectives per step on a stage of `layers` layers (`moe_layers` of them MoE, whose
    MLP is the dispatcher's, _expert_collectives, and the shared expert if any) that embeds
    (`first`) and/or has the loss (`last`), passed to add(kind, op, calls, bytes): see
    communication."""
    model_cfg, parallel_cfg, dataset_cfg = cfg.model_config, cfg.parallel_config, cfg.dataset_config
    tp, mb = parallel_cfg.tensor_model_parallel_size, dataset_cfg.micro_batch_num
    if tp == 1:
        return
    size, hidden = collective_bytes(cfg), _hidden_elements(cfg)
    shared = bool(model_cfg.moe_shared_expert_intermediate_size)
    mlps = layers - moe_layers * (not shared)                     # the TP-split MLPs
    # per micro-batch: 2 a layer for attention and 2 an MLP (forward and backward), the logits'
    edges = 2 * layers + 2 * mlps + last
    if not parallel_cfg.sequence_parallel:
        # the layers' and the logits' all-reduces, then the embedding's
        add("tp", "all_reduce", mb * edges, mb * edges * hidden * size.compute)
        add("tp", "all_reduce", mb * first, mb * first * hidden * size.params)
    else:
        # each becomes an all-gather of [s/tp, b, h] and a reduce-scatter of [s, b, h]
        add("tp", "all_gather", mb * edges, mb * edges * hidden * size.compute // tp)
        add("tp", "all_gather", mb * first, mb * first * hidden * size.hidden // tp)
        add("tp", "reduce_scatter", mb * edges, mb * edges * hidden * size.compute)
        add("tp", "all_reduce", mb * first, mb * first * hidden * size.params)
        # the gradients of the replicated norms and row-parallel biases, once a step, [h] each
        norm = 2 if model_cfg.normalization == "LayerNorm" else 1
        per_layer = ((2 + 2 * model_cfg.use_sandwich_norm) * norm + model_cfg.out_proj_has_bias
                     + model_cfg.add_bias_linear)
        # (every micro-batch's under Megatron-FSDP's ZeRO-2/3, before its reduce-scatter)
        times = mb if fsdp_shards(cfg)[0] else 1
        marked = layers * per_layer + last * norm
        add("tp", "all_reduce", times * marked, times * marked * size.grad * model_cfg.hidden_size)
        if moe_layers:               # the routers' [E, h] and the shared experts' gates [1, h]
            gates = moe_layers * model_cfg.moe_shared_expert_gate
            add("tp", "all_reduce", times * (moe_layers + gates), times * size.grad
                * model_cfg.hidden_size * (moe_layers * model_cfg.num_moe_experts + gates))
    if last:
        # the vocabulary-parallel cross-entropy's max, sum of exp and target logit, [s, b] each
        tokens = dataset_cfg.batch_size * model_cfg.seq_length // parallel_cfg.context_parallel_size
        add("tp", "all_reduce", 3 * mb, 3 * mb * tokens * size.logits)


def _context_parallel_collectives(cfg, layers, last, add):
    """CP's collectives per step on a stage of `layers` layers, the loss's too if it has it
    (`last`), passed to add(kind, op, calls, bytes): see communication."""
    model_cfg, parallel_cfg, dataset_cfg = cfg.model_config, cfg.parallel_config, cfg.dataset_config
    tp, mb = parallel_cfg.tensor_model_parallel_size, dataset_cfg.micro_batch_num
    cp = parallel_cfg.context_parallel_size
    if cp == 1:
        return
    _, ulysses, ring = cp_split(parallel_cfg)
    size = collective_bytes(cfg)
    # bytes of q [b s / cp, h/tp] and of k or v [b s / cp, g d / tp] on a rank
    micro_batch_size, s = dataset_cfg.batch_size, model_cfg.seq_length
    q = size.compute * micro_batch_size * s // cp * model_cfg.hidden_size // tp
    kv = q * model_cfg.num_query_groups // model_cfg.num_attention_heads
    if ulysses > 1:
        kind = "cp" if ring == 1 else "cp_ulysses"
        add(kind, "all_to_all", 8 * mb * layers, 2 * mb * layers * (2 * q + 2 * kv))
    kind = "cp" if ulysses == 1 else "cp_ring"
    if ring_passes_blocks(model_cfg, parallel_cfg):
        # k and v passed ring - 1 times forward; backward, again, and their gradients
        add(kind, "send_recv", 6 * (ring - 1) * mb * layers, 6 * (ring - 1) * mb * layers * kv)
    elif ring > 1:
        add(kind, "all_gather", 2 * mb * layers, 2 * mb * layers * kv)
        add(kind, "reduce_scatter", 2 * mb * layers, 2 * mb * layers * ring * kv)
    # the loss and the token count (float32)
    add("cp", "all_reduce", 2 * mb * last, 2 * mb * last * F32_BYTES)


def _data_parallel_collectives(cfg, rank, add):
    """The gradient reduction over the dp x cp ranks of pipeline rank `rank` (each bucket
    all-reduced, or reduce-scattered and the parameters all-gathered by the distributed
    optimizer) and the logged loss, passed to add(kind, op, calls, bytes)."""
    parallel_cfg = cfg.parallel_config
    shards = parallel_cfg.data_parallel_size * parallel_cfg.context_parallel_size
    if shards == 1:
        return
    dense = stage_parameters(cfg, rank) - expert_parameters(cfg, rank)
    _gradient_buffer(cfg, "dp_cp", shards, dense, add,
                     [(dense, once) for dense, _, once in fsdp_units(cfg, rank)])
    add("dp_cp", "all_reduce", 1, F32_BYTES)                  # the logged loss


def _gradient_buffer(cfg, kind, shards, params, add, units=()):
    """One optimizer's gradient reduction over `shards` ranks (group `kind`) of `params`
    parameters: each bucket all-reduced, or reduce-scattered and the parameters all-gathered
    and the norm summed over the shards by the distributed optimizer; under Megatron-FSDP's
    ZeRO-2/3 per unit (`units`: the buffer's units' parameter counts), _fsdp_buffer."""
    training_cfg, size = cfg.training_config, collective_bytes(cfg)
    if shards == 1:
        return
    buckets = math.ceil(params / training_cfg.bucket_size) if training_cfg.bucket_size else 1
    if units and fsdp_shards(cfg)[0]:
        _fsdp_buffer(cfg, kind, shards, units, add)
    elif training_cfg.use_distributed_optimizer:
        add(kind, "reduce_scatter", buckets, size.grad * params)
        add(kind, "all_gather", buckets, size.params * params // shards)
    else:
        add(kind, "all_reduce", buckets, size.grad * params)
        return
    add(kind, "all_reduce", 1, F32_BYTES)                     # the norm over the shards


def _fsdp_buffer(cfg, kind, shards, units, add):
    """Megatron-FSDP's reductions of one buffer of `units` ((parameter count, reduced once a
    step) each, the count padded to a multiple of `shards`: distributed.BucketLayout) per step:
    each unit's gradients reduce-scattered per micro-batch (the tied embedding's copy once);
    with ZeRO-2 each unit's parameters all-gathered after the step, with ZeRO-3 before each
    forward and each backward of it, and on one stage the first unit once more per micro-batch
    for the tied output layer's copy of the word embedding."""
    size, mb = collective_bytes(cfg), cfg.dataset_config.micro_batch_num
    padded = [-(-unit // shards) * shards for unit, _ in units]
    times = [1 if once else mb for _, once in units]
    add(kind, "reduce_scatter", sum(times),
        size.grad * sum(t * n for t, n in zip(times, padded)))
    if not fsdp_shards(cfg)[1]:
        add(kind, "all_gather", len(units), size.params * sum(padded) // shards)
        return
    model_cfg = cfg.model_config
    tie = (kind == "dp_cp" and cfg.parallel_config.pipeline_model_parallel_size == 1
           and not model_cfg.untie_embeddings_and_output_weights and model_cfg.num_layers > 1)
    add(kind, "all_gather", mb * (2 * len(units) + tie),
        mb * size.params * (2 * sum(padded) + tie * padded[0]) // shards)


def expert_parameters(cfg, rank):
    """The routed experts' parameters on a TP x EP rank of pipeline rank `rank` (moe.is_expert's
    ones), E / ep per MoE layer."""
    model_cfg, parallel_cfg = cfg.model_config, cfg.parallel_config
    if not model_cfg.num_moe_experts:
        return 0
    per_expert = mlp_parameters(model_cfg, model_cfg.moe_ffn_hidden_size,
                                parallel_cfg.tensor_model_parallel_size)
    return (stage_moe_layers(cfg, rank) * model_cfg.num_moe_experts
            // parallel_cfg.expert_model_parallel_size * per_expert)


def stage_layer_kinds(cfg, rank):
    """Per layer of pipeline rank `rank`'s chunks, whether it is an MoE layer."""
    model_cfg, parallel_cfg = cfg.model_config, cfg.parallel_config
    pattern = moe_layer_pattern(model_cfg)
    return [moe for chunk, first in zip(stage_chunks(model_cfg, parallel_cfg)[rank],
                                        chunk_first_layers(model_cfg, parallel_cfg)[rank])
            for moe in pattern[first:first + chunk[0]]]


def stage_moe_layers(cfg, rank):
    """The MoE layers of pipeline rank `rank`'s chunks."""
    return sum(stage_layer_kinds(cfg, rank))


def _expert_collectives(cfg, rank, add):
    """An MoE model's collectives per step on pipeline rank `rank` (moe.py), passed to add(kind,
    op, calls, bytes): per MoE layer and micro-batch the router's token counts over TP x CP
    (forward), the dispatcher's (moe.MoEAllGatherTokenDispatcher: tokens [n, h] and probs
    [n, E] all-gathered over TP x EP, the output [N, h] reduce-scattered, N = n tp ep, and
    backward the reverse of each; moe.MoEAlltoAllTokenDispatcher over EP: tokens, probs and
    output [E C, h], [E C], [E C, h] forward and backward, TP 1); per step the routers' losses' sums
    [3] over PP, TP x CP and DP, with an expert bias the stage's tokens per expert [L, E] over TP x
    DP x CP (moe.update_expert_bias), the experts' norm over EP and their gradients over the
    expert-data-parallel group."""
    model_cfg, parallel_cfg, dataset_cfg = cfg.model_config, cfg.parallel_config, cfg.dataset_config
    if not model_cfg.num_moe_experts:
        return
    tp, cp, ep = (parallel_cfg.tensor_model_parallel_size, parallel_cfg.context_parallel_size,
                  parallel_cfg.expert_model_parallel_size)
    dp, pp = parallel_cfg.data_parallel_size, parallel_cfg.pipeline_model_parallel_size
    tp_cp = "tp_cp" if cp > 1 else "tp"                            # parallel.SAME_RANKS_AS
    layers = stage_moe_layers(cfg, rank)
    calls = layers * dataset_cfg.micro_batch_num
    size, experts = collective_bytes(cfg), model_cfg.num_moe_experts
    probs = F32_BYTES if model_cfg.moe_router_dtype == "fp32" else size.compute
    tokens = dataset_cfg.batch_size * model_cfg.seq_length // (cp * tp)     # n, this rank's
    counts = experts * (dataset_cfg.batch_size if model_cfg.moe_router_load_balancing_type
                        == "seq_aux_loss" else 1)
    if model_cfg.moe_aux_loss_coeff and model_cfg.moe_router_load_balancing_type != "none":
        if tp * cp > 1:
            add(tp_cp, "all_reduce", calls, calls * counts * F32_BYTES)
    _dispatcher_collectives(model_cfg, tp, ep, tokens, calls, size.compute, probs, add)
    for kind, ranks in (("pp", pp), (tp_cp, tp * cp), ("dp", dp)):
        if ranks > 1:
            add(kind, "all_reduce", 1, 3 * F32_BYTES)              # the routers' losses (logs.py)
    if model_cfg.moe_router_enable_expert_bias and layers and tp * dp * cp > 1:
        add("tp_dp_cp" if tp > 1 else "dp_cp", "all_reduce", 1,   # parallel.SAME_RANKS_AS
            layers * experts * F32_BYTES)
    if ep > 1:
        add("ep", "all_reduce", 1, F32_BYTES)                      # the experts' norm
    experts_here = expert_parameters(cfg, rank)
    _gradient_buffer(cfg, "edp" if ep > 1 else "dp_cp", dp * cp // ep, experts_here, add,
                     [(experts, False) for _, experts, _ in fsdp_units(cfg, rank) if experts])


def _dispatcher_collectives(model_cfg, tp, ep, n, calls, compute, probs, add):
    """The dispatcher's collectives (see _expert_collectives) for n tokens on a rank, `calls`
    MoE layers x micro-batches."""
    h, experts = model_cfg.hidden_size, model_cfg.num_moe_experts
    if model_cfg.moe_token_dispatcher_type == "allgather":
        if tp * ep == 1:
            return
        kind, big = ("tp_ep" if ep > 1 else "tp"), n * tp * ep
        add(kind, "all_gather", 3 * calls, calls * (2 * n * h * compute + n * experts * probs))
        add(kind, "reduce_scatter", 3 * calls,
            calls * (2 * big * h * compute + big * experts * probs))
        return
    slots = experts * expert_capacity(model_cfg, n)               # alltoall: [E C, h] a rank
    if ep > 1:
        add("ep", "all_to_all", 6 * calls, 2 * calls * slots * (2 * h * compute + probs))
    if tp > 1:       # then over TP (ETP = TP): tokens and probs gathered, outputs reduce-scattered
        add("tp", "all_gather", 3 * calls, calls * slots * (2 * h * compute + probs))
        add("tp", "reduce_scatter", 3 * calls, calls * tp * slots * (2 * h * compute + probs))


def _pipeline_collectives(cfg, rank, first, last, add):
    """The pipeline's exchanges on pipeline rank `rank` (its schedule's hops) and, on the first
    and last stage of a tied model, the word embedding's gradient all-reduce, passed to
    add(kind, op, calls, bytes)."""
    model_cfg, parallel_cfg, dataset_cfg = cfg.model_config, cfg.parallel_config, cfg.dataset_config
    tp, pp = parallel_cfg.tensor_model_parallel_size, parallel_cfg.pipeline_model_parallel_size
    if pp == 1:
        return
    size = collective_bytes(cfg)
    steps = pipeline.simulate(pp, dataset_cfg.micro_batch_num,
                              parallel_cfg.virtual_pipeline_model_parallel_size,
                              kind=parallel_cfg.pipeline_schedule)[0][rank]
    hops = sum(step[0] == "X" for step in steps)
    hop = pipeline.hop_shape(model_cfg, dataset_cfg.batch_size, parallel_cfg.context_parallel_size,
                             tp, parallel_cfg.sequence_parallel)
    add("pp_pair", "exchange", hops, hops * math.prod(hop) * size.hidden)
    if (first or last) and not model_cfg.untie_embeddings_and_output_weights:
        embedding = model_cfg.padded_vocab_size * model_cfg.hidden_size
        add("embedding", "all_reduce", 1, size.grad * embedding // tp)


def collective_bytes(cfg):
    """Bytes of a value in each kind of tensor the collectives carry: the compute dtype's
    activations, the hidden states between layers and stages (gpt.hidden_dtype), the
    parameters (the embedding's output, the distributed optimizer's all-gather), the gradients
    (config.main_grad_dtype) and the loss's logits."""
    model_cfg = cfg.model_config
    compute = DTYPE_BYTES[model_cfg.compute_dtype]
    return SimpleNamespace(compute=compute, params=DTYPE_BYTES[model_cfg.params_dtype],
                           hidden=F32_BYTES if model_cfg.fp32_residual_connection else compute,
                           grad=DTYPE_BYTES[main_grad_dtype(cfg)], logits=c_or_f32(model_cfg))


# ============================================================================ FLOPs
def flops_per_iteration(cfg):
    """(model FLOPs, recompute FLOPs) of one iteration of the global batch: Megatron's
    num_floating_point_operations (gpt.py), and the forward passes recompute adds: full, one
    forward (a third of forward + backward) of every recomputed layer, at the layers' mean;
    selective, the core attention's two batched matmuls, 2 x 2 b s^2 n (h/n) per layer and
    sequence."""
    model_cfg, parallel_cfg, dataset_cfg = cfg.model_config, cfg.parallel_config, cfg.dataset_config
    batch = dataset_cfg.global_batch_size
    model = gpt.num_floating_point_operations(model_cfg, batch)
    per_layer = (model - gpt.flops_terms(model_cfg, batch)[2]) / model_cfg.num_layers
    if model_cfg.recompute_granularity == "selective":
        attention = 4 * batch * model_cfg.seq_length ** 2 * model_cfg.hidden_size
        return model, model_cfg.num_layers * attention
    recomputed = sum(sum(chunks) for chunks in recompute_counts(parallel_cfg, model_cfg))
    return model, recomputed * per_layer / 3


def stage_flops(cfg):
    """Per pipeline stage, its part of the iteration's model FLOPs (gpt.flops_terms, summing to
    flops_per_iteration's): its decoder layers, dense or MoE, and on the stage holding the loss
    the output layer and the loss; the embedding lookup is no matmul. Forward and backward scale
    every term alike (3 GEMMs per weight), so a stage's share of these is its forward's share."""
    model_cfg = cfg.model_config
    dense, moe_layer, output = gpt.flops_terms(model_cfg, cfg.dataset_config.global_batch_size)
    flops = []
    for rank, chunks in enumerate(stage_chunks(model_cfg, cfg.parallel_config)):
        layers = sum(moe_layer if moe else dense for moe in stage_layer_kinds(cfg, rank))
        flops.append(layers + output * any(has_loss for _, _, has_loss in chunks))
    return flops


def with_split(cfg, num_layer_list):
    """A copy of cfg whose pipeline stages hold `num_layer_list` (cfg itself untouched)."""
    parallel_cfg = SimpleNamespace(**{**vars(cfg.parallel_config),
                                      "num_layer_list": num_layer_list})
    return SimpleNamespace(**{**vars(cfg), "parallel_config": parallel_cfg})


def split_candidates(layers, pp):
    """(flags, num_layer_list) of every split by Megatron's split flags, without virtual chunks,
    that Megatron allows and this project runs (config.megatron_layer_counts applies both's
    rules: every stage at least one decoder layer), fewest flags first, each split once: the
    even split (layers divisible by pp, Megatron's rule without flags), the first and / or the
    last stage's count, the embedding and / or the loss accounted as a layer."""
    found = {}
    if layers % pp == 0:
        found[(layers // pp,) * pp] = "the even split (no split flag)"
    first, last = "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"
    embedding = "account_for_embedding_in_pipeline_split"
    loss = "account_for_loss_in_pipeline_split"
    options = ([{first: n} for n in range(1, layers)] + [{last: n} for n in range(1, layers)]
               + [{embedding: True}, {loss: True}, {embedding: True, loss: True}]
               + [{first: n, last: m} for n in range(1, layers) for m in range(1, layers - n + 1)])
    for flags in options:
        parallel_cfg = SimpleNamespace(**{**dict.fromkeys(SPLIT_FLAGS), **flags},
                                       pipeline_model_parallel_size=pp)
        try:
            counts = megatron_layer_counts(parallel_cfg, layers)
        except ConfigError:
            continue                   # Megatron refuses it, or it leaves a stage no layer
        found.setdefault(tuple(counts), " ".join(
            SPLIT_FLAGS[key] if value is True else f"{SPLIT_FLAGS[key]} {value}"
            for key, value in flags.items()))
    return [(flags, list(counts)) for counts, flags in found.items()]


def balanced_split(cfg):
    """(flags, num_layer_list, largest stage's share of the model FLOPs) of the split_candidates
    whose largest stage (stage_flops) is smallest, the first of equals, for a config without
    virtual chunks; None if none is smaller than the config's own split's."""
    now = stage_flops(cfg)
    best = None
    for flags, counts in split_candidates(cfg.model_config.num_layers,
                                          cfg.parallel_config.pipeline_model_parallel_size):
        largest = max(stage_flops(with_split(cfg, counts)))
        # equal up to rounding (the same layers summed in another order) is not smaller
        if largest < max(now) * (1 - 1e-9) and (best is None or largest < best[2]):
            best = (flags, counts, largest)
    return None if best is None else (best[0], best[1], best[2] / sum(now))


def balance_lines(cfg):
    """The plan's lines on the pipeline's balance: each stage's layers and share of the model
    FLOPs, then the Megatron split that balances them best (balanced_split)."""
    model_cfg, parallel_cfg = cfg.model_config, cfg.parallel_config
    flops = stage_flops(cfg)
    lines = []
    for rank, chunks in enumerate(stage_chunks(model_cfg, parallel_cfg)):
        output = " and the output layer" if any(loss for _, _, loss in chunks) else ""
        lines.append(f"plan: stage {rank} FLOPs: layers {[layers for layers, _, _ in chunks]}"
                     f"{output}, {flops[rank] / sum(flops):.1%} of the model FLOPs")
    largest = f"{max(flops) / sum(flops):.1%}"
    if parallel_cfg.virtual_pipeline_model_parallel_size > 1:
        return lines + ["plan: a balanced split: not searched with virtual pipeline chunks "
                        "(Megatron's split flags are searched without them)"]
    best = balanced_split(cfg)
    if best is None:
        lines.append(f"plan: a balanced split: this one (largest stage {largest} of the FLOPs; "
                     "no split by Megatron's flags has a smaller largest stage)")
    else:
        lines.append(f"plan: a balanced split: {best[0]}, layers {best[1]} (largest stage "
                     f"{best[2]:.1%} of the FLOPs, now {largest})")
    return lines


# ============================================================================ per rank
def fsdp_shards(cfg):
    """(gradients sharded, weights sharded, over how many ranks): Megatron-FSDP's ZeRO-2 and
    ZeRO-3 over the dp x cp ranks (config.sharded_by_fsdp; nothing with one rank)."""
    parallel_cfg, training_cfg = cfg.parallel_config, cfg.training_config
    shards = parallel_cfg.data_parallel_size * parallel_cfg.context_parallel_size
    grads, weights = sharded_by_fsdp(training_cfg) if shards > 1 else (False, False)
    return grads, weights, shards


def fsdp_units(cfg, rank):
    """Megatron-FSDP's units on a rank of pipeline stage `rank` (distributed.fsdp_units), each
    as (dense parameters, routed experts' parameters, reduced once a step): a layer with what
    its piece adds (the embedding on the first, the final norm and output layer on the last) on
    one stage; a model chunk under pipeline parallelism, whose schedule runs chunks whole, the
    tied embedding's copy there a unit of its own, reduced after the schedule
    (distributed.grad_sync_func) rather than every micro-batch."""
    model_cfg, parallel_cfg = cfg.model_config, cfg.parallel_config
    tp, ep = parallel_cfg.tensor_model_parallel_size, parallel_cfg.expert_model_parallel_size
    pattern = moe_layer_pattern(model_cfg)
    experts = 0
    if model_cfg.num_moe_experts:
        experts = model_cfg.num_moe_experts // ep * mlp_parameters(
            model_cfg, model_cfg.moe_ffn_hidden_size, tp)
    if parallel_cfg.pipeline_model_parallel_size == 1:
        n = model_cfg.num_layers
        chunks = [(1, i == 0, i == n - 1, i) for i in range(n)]
    else:
        chunks = [(*chunk, first) for chunk, first in zip(
            stage_chunks(model_cfg, parallel_cfg)[rank],
            chunk_first_layers(model_cfg, parallel_cfg)[rank])]
    tied = not model_cfg.untie_embeddings_and_output_weights
    table = model_cfg.padded_vocab_size * model_cfg.hidden_size // tp    # the word embedding
    units = []
    for layers, embeds, has_loss, first in chunks:
        moe = experts * sum(pattern[first:first + layers])
        units.append([chunk_parameters(model_cfg, tp, layers, embeds, has_loss, first, ep) - moe,
                      moe, False])
        if not tied or not (embeds or has_loss) or (embeds and has_loss):
            continue
        if parallel_cfg.pipeline_model_parallel_size > 1:      # a copy: a unit of its own
            units[-1][0] -= table
            units.append([table, 0, True])
        elif has_loss:                            # the output layer is the first unit's table
            units[-1][0] -= table
    return [tuple(unit) for unit in units]


def stage_memory(cfg, rank):
    """Bytes on a rank of pipeline stage `rank`: a namespace of parameters (a count), weights,
    gradients, optimizer, activations (kept), transient (see stage_activations), in_flight,
    dynamic (what the step allocates: the larger of its two phases) and peak (weights + optimizer
    + dynamic). The backward phase holds the activations and the gradients, twice with several
    micro-batches (their running sum and this micro-batch's); the update phase, activations gone,
    holds three times the gradients while a micro-batch's are added to the sum (old sum, new, sum),
    or in the optimizer step the gradients, the float32 main grads made of them (divided by the
    loss scale; none when that is 1 and they are float32) and the copy clipping makes. The
    data-parallel buckets' flat copies (distributed.BucketLayout.reduce_bucket) are not
    counted. Megatron-FSDP (fsdp_shards): ZeRO-2 keeps 1/(dp x cp) of the gradients summed over
    the micro-batches, and one unit's whole (fsdp_unit_parameters) in its backward; ZeRO-3
    1/(dp x cp) of the weights, and one unit gathered whole (ZeRO's formulas, Rajbhandari et al.
    2020, section 5)."""
    params = stage_parameters(cfg, rank)
    weights = params * DTYPE_BYTES[cfg.model_config.params_dtype]
    grads = params * DTYPE_BYTES[main_grad_dtype(cfg)]
    unit_grads = 0
    sharded_grads, sharded_weights, shards = fsdp_shards(cfg)
    unit = max(dense + experts for dense, experts, _ in fsdp_units(cfg, rank))
    if sharded_weights:
        weights = (math.ceil(params / shards) + unit) * DTYPE_BYTES[cfg.model_config.params_dtype]
    if sharded_grads:
        grads = math.ceil(params / shards) * DTYPE_BYTES[main_grad_dtype(cfg)]
        unit_grads = unit * DTYPE_BYTES[main_grad_dtype(cfg)]
    kept, transient, count = stage_activations(cfg, rank)
    optim = optimizer_bytes(cfg, params, expert_parameters(cfg, rank))
    several = cfg.dataset_config.micro_batch_num > 1
    clip = bool(cfg.training_config.grad_clip_kwargs.clip_value)
    # the step: the gradients, float32 main grads beside them unless they are those gradients
    # (float32 and no loss scale), and a clipped copy
    loss_scale = cfg.training_config.loss_scale
    scaled = cfg.model_config.compute_dtype == "float16" or loss_scale not in (None, 1.0)
    main_grads = F32_BYTES * params if scaled or grads != F32_BYTES * params else 0
    update = max(3 * grads if several else grads, grads + main_grads + clip * F32_BYTES * params)
    dynamic = max((2 if several else 1) * grads + unit_grads + kept + transient, update)
    return SimpleNamespace(parameters=params, weights=weights, gradients=grads, optimizer=optim,
                           activations=kept, transient=transient, in_flight=count,
                           dynamic=dynamic, peak=weights + optim + dynamic)


def recompute_text(model_cfg):
    if model_cfg.recompute_granularity is None:
        return "no recompute"
    if model_cfg.recompute_granularity == "selective":
        return "selective recompute (core attention)"
    return f"full recompute, {model_cfg.recompute_method}, {model_cfg.recompute_num_layers}"


def gib(nbytes):
    return f"{nbytes / GIB:.2f} GiB"


def mib(nbytes):
    return f"{nbytes / MIB:.1f} MiB"


def optimizer_state_bytes(optimizer):
    """The optimizer state a rank holds, measured: an optimizer.py inner optimizer's tensors
    (AdamW's two moments, SGD's momentum), plus, for a mixed-precision or distributed one, the
    float32 main params that are copies of half-precision parameters (all of a distributed
    optimizer's pieces); summed over a chain."""
    if isinstance(optimizer, opt.ChainedOptimizer):
        return sum(optimizer_state_bytes(part) for part in optimizer.optimizers)
    if not hasattr(optimizer, "inner"):                       # AdamW, Adam, SGD
        return sum(t.nbytes for tensors in optimizer.state.values() for t in tensors)
    copies = [main for param, main in zip(optimizer.params, optimizer.main_params)
              if main is not param]
    if isinstance(optimizer, opt.DistributedOptimizer):
        copies = optimizer.main_params
    return optimizer_state_bytes(optimizer.inner) + sum(t.nbytes for t in copies)


class RankReport:
    """The start-up report of a training rank and, at the end, the measured peak beside it.
    Measured: the growth of this process's resident memory from just before the first step to
    its high-water mark (Linux VmHWM, reset then through /proc/self/clear_refs), so MindSpore's
    own few hundred MB, the data and the model built before the loop are left out; the estimate
    to compare with it is stage_memory's `dynamic` (weights and optimizer state exist before the
    loop)."""

    def __init__(self, cfg, state, counted_parameters, optimizer_bytes):
        self.cfg, self.state = cfg, state
        self.mem = stage_memory(cfg, state.pp_rank)
        self.counted, self.optimizer_bytes = counted_parameters, optimizer_bytes
        self.start = None

    def startup(self, compiled):
        """The estimate, with the model's own parameter count and optimizer bytes beside it."""
        mem, model_cfg = self.mem, self.cfg.model_config
        model_flops, extra = flops_per_iteration(self.cfg)
        note = ""
        if compiled:
            note = ("; compiled by ms.jit: a CPU graph keeps every intermediate, several times "
                    "this (docs/memory.md)")
        return (f"memory: estimate for rank {self.state.rank} (stage {self.state.pp_rank}): "
                f"parameters {mem.parameters} (the model holds {self.counted}), "
                f"weights {mib(mem.weights)}, gradients {mib(mem.gradients)}, "
                f"optimizer {mib(mem.optimizer)} (measured {mib(self.optimizer_bytes)}), "
                f"activations {mib(mem.activations)} ({mem.in_flight} micro-batch(es) in flight, "
                f"{recompute_text(model_cfg)}) + transient {mib(mem.transient)}, "
                f"peak {mib(mem.peak)}"
                f"{note}; FLOPs per iteration {model_flops:.3e} (+ recompute {extra:.3e})")

    def begin(self):
        """Just before the first step: note the resident memory and reset the high-water mark."""
        self.start = rss_bytes()
        reset_peak()

    def measured(self):
        growth, estimate = peak_rss_bytes() - self.start, self.mem.dynamic
        return (f"memory: measured peak growth {growth / MIB:.1f} MiB (resident memory, from the "
                f"first step), estimate {estimate / MIB:.1f} MiB (what the step allocates: "
                f"gradients, activations, transient), measured / estimate {growth / estimate:.2f}")


def _status(key):
    """A size in bytes from /proc/self/status (given there in KiB)."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+)", f.read()).group(1)) * 1024


def rss_bytes():
    """This process's resident memory now (Linux)."""
    return _status("VmRSS")


def peak_rss_bytes():
    """The resident high-water mark since the last reset_peak (Linux; getrusage's ru_maxrss
    cannot be reset)."""
    return _status("VmHWM")


def reset_peak():
    """Reset VmHWM to the current resident memory (Linux 4.0+: write 5 to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# ============================================================================ bash run.sh plan
PLAN_FLAGS = {"--config": CONFIG_FLAG,
              "--world-size": (REQUIRED, int, "the number of ranks to plan for"),
              "--memory-per-device": (None, float,
                                      "GiB per device: list the layouts whose peak fits")}


def plan_main(argv):
    """`bash run.sh plan [--config FILE] --world-size N [--memory-per-device GIB]
    [training flags]`."""
    options, rest = parse_command("plan", argv, PLAN_FLAGS, passthrough="training flags",
                                  about="Memory, communication and FLOPs per rank of a layout, "
                                        "from the config alone: nothing is allocated, no worker "
                                        "started.")
    if options["world_size"] < 1:
        raise ConfigError("plan needs --world-size N, the number of ranks (1 or more)")
    cfg = load_config(options["config"], rest, options["world_size"])
    cfg.model_config.padded_vocab_size = vocab_rows(cfg)
    for line in plan_lines(cfg, options["world_size"]):
        print(line)
    if not cfg.dataset_config.mock_data:
        for line in data.blend_lines(*data.data_blends(cfg.dataset_config),
                                     cfg.dataset_config.split, samples_per_split(cfg)):
            print("plan: data " + line)
    if options["memory_per_device"] is not None:
        for line in fit_lines(cfg, options["config"], rest, options["world_size"],
                              options["memory_per_device"]):
            print(line)


def plan_lines(cfg, world):
    """The plan's report: the model and the layout, then per pipeline stage its memory and its
    collectives per step, the pipeline bubble and the FLOPs."""
    model_cfg, parallel_cfg, dataset_cfg = cfg.model_config, cfg.parallel_config, cfg.dataset_config
    tp, pp = parallel_cfg.tensor_model_parallel_size, parallel_cfg.pipeline_model_parallel_size
    vpp, cp = parallel_cfg.virtual_pipeline_model_parallel_size, parallel_cfg.context_parallel_size
    total = total_parameters(model_cfg)
    virtual = f" (VPP{vpp})" if vpp > 1 else ""
    sequence = "sequence parallel; " if parallel_cfg.sequence_parallel else ""
    distributed = "distributed optimizer; " if cfg.training_config.use_distributed_optimizer else ""
    if cfg.training_config.use_megatron_fsdp:
        distributed = f"Megatron-FSDP {cfg.training_config.data_parallel_sharding_strategy}; "
    micro_batch_size = dataset_cfg.batch_size
    moe_layers = sum(moe_layer_pattern(model_cfg))
    experts = f", {moe_layers} of them MoE, {layer_parameters(model_cfg, 1, True)} each" \
        if moe_layers else ""
    lines = [f"plan: parameters {total} ({total / 1e9:.3f} B: {model_cfg.num_layers} layers of "
             f"{layer_parameters(model_cfg)}{experts}, vocabulary {model_cfg.padded_vocab_size} x "
             f"hidden {model_cfg.hidden_size})",
             f"plan: layout TP{tp} x CP{cp} x PP{pp}{virtual} x "
             f"DP{parallel_cfg.data_parallel_size} = {world} ranks; "
             f"{dataset_cfg.micro_batch_num} micro-batch(es) of {micro_batch_size} x "
             f"{model_cfg.seq_length} tokens (global batch {dataset_cfg.global_batch_size}); "
             f"{sequence}{distributed}{recompute_text(model_cfg)}"]
    for rank in range(pp):
        mem = stage_memory(cfg, rank)
        layers = [chunk[0] for chunk in stage_chunks(model_cfg, parallel_cfg)[rank]]
        lines.append(f"plan: stage {rank} parameters per rank {mem.parameters} "
                     f"({mem.parameters / 1e9:.3f} B; layers {layers}): "
                     f"weights {gib(mem.weights)}, gradients {gib(mem.gradients)}, "
                     f"optimizer {gib(mem.optimizer)}, activations {gib(mem.activations)} "
                     f"({mem.in_flight} in flight; {layer_text(cfg, rank)}) "
                     f"+ transient {gib(mem.transient)}, peak {gib(mem.peak)}")
    for rank in range(pp):
        collectives = ", ".join(f"{kind} {op} x{calls} {nbytes / MIB:.1f} MiB"
                                for (kind, op), (calls, nbytes)
                                in sorted(communication(cfg, rank).items()))
        lines.append(f"plan: stage {rank} communication per step: {collectives or 'none'}")
    if pp > 1:
        bubble = pipeline.theory_bubble(pp, dataset_cfg.micro_batch_num, vpp)
        lines.append(f"plan: pipeline bubble (p - 1) / (v m) = {bubble:.3f} "
                     f"({parallel_cfg.pipeline_schedule})")
    model, extra = flops_per_iteration(cfg)
    lines.append(f"plan: FLOPs per iteration {model:.3e} (Megatron's model FLOPs) + recompute "
                 f"{extra:.3e}; per rank {(model + extra) / world:.3e}")
    return lines + (balance_lines(cfg) if pp > 1 else [])


def layer_text(cfg, rank):
    """A layer's activations per micro-batch on pipeline rank `rank`, for each kind of layer it
    has: dense, and MoE with its experts' share (the dispatched tokens and their MLPs')."""
    model_cfg, parallel_cfg = cfg.model_config, cfg.parallel_config
    parts = []
    for moe in sorted(set(stage_layer_kinds(cfg, rank))):
        rows = layer_activations(model_cfg, parallel_cfg, cfg.dataset_config.batch_size, moe)
        total = mib(sum(e for _, e, _ in rows))
        if not moe:
            parts.append(f"a layer {total} per micro-batch")
            continue
        experts = sum(e for name, e, _ in rows if name.startswith(("dispatched", "expert MLP")))
        parts.append(f"an MoE layer {total} per micro-batch, its dispatched tokens and experts' "
                     f"activations {mib(experts)}")
    return "; ".join(parts)


def fit_lines(given, path, argv, world, gibibytes):
    """Every TP x PP layout of `world` ranks the config `given` admits (DP the rest, whatever
    data_parallel_size says; CP, the micro-batch size and the global batch, or the micro-batch
    count, as given; a num_layer_list only at its own pipeline size), with its
    largest stage's peak against `gibibytes` per device, smallest peak first."""
    rows = []
    for tp in range(1, world + 1):
        for pp in range(1, world // tp + 1):
            if world % (tp * pp):
                continue
            layout = [f"parallel_config.tensor_model_parallel_size={tp}",
                      f"parallel_config.pipeline_model_parallel_size={pp}",
                      "parallel_config.data_parallel_size=null"]
            if tp == 1:
                layout.append("parallel_config.sequence_parallel=false")
            if pp != given.parallel_config.pipeline_model_parallel_size:
                layout.append("parallel_config.num_layer_list=null")
            try:
                cfg = load_config(path, list(argv) + layout, world)
            except ConfigError:
                continue                                          # the model cannot be cut so
            cfg.model_config.padded_vocab_size = vocab_rows(cfg)
            peak = max(stage_memory(cfg, r).peak for r in range(pp)) / GIB
            rows.append((peak, f"TP{tp} x PP{pp} x DP{cfg.parallel_config.data_parallel_size}"))
    lines = [f"plan: layouts of {world} ranks by peak per device "
             f"(--memory-per-device {gibibytes:g} GiB):"]
    for peak, name in sorted(rows):
        fits = "fits" if peak <= gibibytes else "does not fit"
        lines.append(f"plan:   {name:22s} peak {peak:9.2f} GiB  {fits}")
    return lines


if __name__ == "__main__":          # imported by train.py, not a script
    raise SystemExit("error: memory.py is a library: run `bash run.sh plan ...`"
                     " (bash run.sh --help lists the commands)")
