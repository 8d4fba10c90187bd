"""GPT model in MindSpore PyNative, with Megatron-core's GPTModel semantics.

Activations flow as [s, b, h] (sequence first), as in Megatron, so that sequence parallelism can
later split dim 0. A model may be one pipeline stage: `pre_process` builds the embedding (input is
token ids [b, s]), `post_process` the final norm, output layer and loss (input is hidden [s, b, h]).

Every small operator (the linears' matmul and bias add, the norms, activations, softmax, loss) is
the plain form written here or in layers.py, unless the layer spec (`layer_spec`, chosen once at
model build) puts its fast form from fused.py in its place; the layers that a layout splits (the
linears, the embedding, the cross-entropy, the core attention under CP) are the spec's too, one
rank's in the local spec, each layout's own in their place. Initial weights come from numpy, seeded
by the seed and the parameter's *global* name (`init_weights`), so a model's start is identical
whatever the layout.
"""
import contextlib
import dataclasses
import math
import re
import zlib

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

import context_parallel
import fused
import layers
import moe
import parallel
from context_parallel import (attention_block, attention_block_grads, merge_partial_attention,
                              no_dropout, sum_head_groups)
from data import causal_mask
from layers import activation, batch_matmul_nt, cast
from parallel import DTYPES, F32
from settings.config import fc1_chunks, moe_layer_pattern

FLASH_BLOCK = 128       # FlashAttention's default block (tokens), memory.py's estimate's too
MASKED = -1e30          # added to masked attention scores: exp underflows to 0, no inf arithmetic


def additive_mask(mask):
    """bool mask (True = masked) -> additive float bias, far cheaper than masked_fill per layer."""
    return Tensor(np.where(mask, MASKED, 0.0).astype(np.float32))


def causal_mask_bias(s):
    """The causal mask of s tokens (data.causal_mask) as an additive bias [1, 1, s, s]."""
    return additive_mask(causal_mask(s)[None, None])


def _zeros(*shape):
    return Tensor(np.zeros(shape, np.float32))


def make_linear(cfg, spec, in_features, out_features, bias, kind, **options):
    """A linear of the spec's class for its role (Megatron's; one rank's: layers.Linear, the
    local spec's): "column" (qkv, fc1, the output layer: a layout may split its output dim over
    TP, fc1's [gate; up] in `chunks`=2 blocks) or "row" (proj, fc2: its input dim), with the
    spec's matmul and bias add computing in the compute dtype (make_linear_forms). options:
    skip_bias_add (the linear returns (output, bias or None), the bias added by what follows:
    the activation, the residual's bias-dropout-add), chunks (a column's), own_weight (a
    column's: without, it is called with a weight, the tied output layer's)."""
    build = spec.column_linear if kind == "column" else spec.row_linear
    return build(in_features, out_features, bias, forms=make_linear_forms(cfg, spec), **options)


def make_linear_forms(cfg, spec):
    """A linear's (matmul, bias_add): the spec's linear_forms, computing in the compute dtype."""
    return fused.forms_in(spec.linear_forms(), DTYPES[cfg.compute_dtype])


def make_activation(cfg, spec):
    """fc1's activation of the spec's form, fc1's bias added in the compute dtype
    (fused.in_compute_dtype), as a linear adds its own."""
    return fused.in_compute_dtype(spec.activation(cfg.hidden_act), DTYPES[cfg.compute_dtype])


def make_bias_dropout_add(cfg, spec, rng):
    """A sub-layer's bias-dropout-add of the spec's form with the layer's hidden_dropout, the
    linear's bias added in the compute dtype (fused.in_compute_dtype; the residual as it is)."""
    return fused.in_compute_dtype(spec.bias_dropout_add(hidden_dropout(cfg, rng)),
                                  DTYPES[cfg.compute_dtype])


def cast_parameters(model, dtype):
    """Every parameter of `model` in `dtype`, each replaced by a Parameter made in that dtype,
    with its name and marks (sequence_parallel, shared_embedding, ...); one replacement for a
    parameter two Cells hold. Parameter.set_dtype is not enough in MindSpore 2.10: op by op, a
    custom-bprop Cell (fused.LinearMatMul) hands a set_dtype'd parameter its gradient in the
    dtype it was made in, and the tied embedding then fails to add its float16 and float32
    gradients (test_half_precision_parameters_take_their_gradients_in_their_dtype)."""
    made = {}
    for _, cell in model.cells_and_names():
        for attr, param in list(cell.parameters_and_names(expand=False)):
            if param.dtype == dtype:
                continue
            if id(param) not in made:
                new = Parameter(param.astype(dtype), name=param.name,
                                requires_grad=param.requires_grad)
                fresh = set(vars(new))
                for key, value in vars(param).items():
                    if key not in fresh:
                        setattr(new, key, value)
                made[id(param)] = new
            setattr(cell, attr, made[id(param)])


class Embedding(nn.Cell):
    """Word embedding table [V, h]; ids [b, s] -> [b, s, h] (VocabParallelEmbedding under TP)."""

    def __init__(self, num_embeddings, embedding_dim):
        super().__init__()
        self.weight = Parameter(_zeros(num_embeddings, embedding_dim), name="weight")

    def construct(self, ids):
        return ops.gather(self.weight, ids, 0)


def hidden_dtype(cfg):
    """The dtype of the hidden states [s, b, h] between layers and pipeline stages: the compute
    dtype, or float32 with fp32_residual_connection (Megatron keeps the residual stream in fp32)."""
    return F32 if cfg.fp32_residual_connection else DTYPES[cfg.compute_dtype]


class LayerNorm(nn.Cell):
    def __init__(self, hidden, eps):
        super().__init__()
        self.weight = Parameter(Tensor(np.ones(hidden, np.float32)), name="weight")
        self.bias = Parameter(_zeros(hidden), name="bias")
        self.norm = ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1, epsilon=eps)

    def construct(self, x):
        """Normalised in float32 whatever x's dtype (Megatron's fused LayerNorm), returned in it."""
        y = self.norm(cast(x, F32), cast(self.weight, F32), cast(self.bias, F32))[0]
        return cast(y, x.dtype)


class RMSNorm(nn.Cell):
    """x / sqrt(mean(x^2) + eps) * w (Zhang & Sennrich 2019); ops.rms_norm has no CPU kernel."""

    def __init__(self, hidden, eps):
        super().__init__()
        self.weight = Parameter(Tensor(np.ones(hidden, np.float32)), name="weight")
        self.eps = eps

    def construct(self, x):
        y = cast(x, F32)                                       # normalise in fp32
        y = y * ops.rsqrt((y * y).mean(-1, keep_dims=True) + self.eps) * cast(self.weight, F32)
        return cast(y, x.dtype)


def make_norm(cfg, spec):
    """A norm of the spec's class over the hidden size."""
    return spec.norm(cfg.hidden_size, cfg.norm_epsilon)


class DropoutRNG:
    """Named numpy random streams for dropout masks, like Megatron's CUDA RNG tracker: "default"
    is shared by all tensor-parallel ranks, "model-parallel" differs per TP rank. Host streams keep
    the state explicit, so a checkpoint stores it and a resumed run draws the same masks."""

    def __init__(self, seed, tp_rank=0):
        self.streams = {"default": np.random.default_rng(seed),
                        "model-parallel": np.random.default_rng(seed + 2718 + tp_rank)}

    def mask(self, shape, rate, stream="default", dtype=F32):
        """keep / (1 - rate) for each element, dropped with probability `rate`, in the
        activations' `dtype`."""
        keep = self.streams[stream].random(shape) >= rate
        return Tensor((keep / (1.0 - rate)).astype(ms.dtype_to_nptype(dtype)))

    def state_dict(self):
        return {k: g.bit_generator.state for k, g in self.streams.items()}

    def load_state_dict(self, state):
        for k, s in state.items():
            self.streams[k].bit_generator.state = s


class Dropout(nn.Cell):
    def __init__(self, rate, rng, stream="default"):
        super().__init__()
        self.rate, self.rng, self.stream = rate, rng, stream

    def construct(self, x):
        if self.rate == 0.0 or not self.training:
            return x
        return x * self.rng.mask(x.shape, self.rate, self.stream, x.dtype)


def hidden_dropout(cfg, rng):
    """The dropout of the hidden states [s, b, h] (the embeddings', the residual adds'): replicated
    activations draw the "default" stream, the same over TP; sequence shards [s/tp, b, h] differ,
    so under sequence parallelism each TP rank draws its own ("model-parallel")."""
    stream = "model-parallel" if parallel.get_state().sequence_parallel else "default"
    return Dropout(cfg.hidden_dropout_rate, rng, stream)


def rotary_tables(max_positions, dim, base):
    """cos/sin [max_positions, dim] of RoPE (Su et al. 2021), Megatron's non-interleaved layout."""
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    freqs = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return Tensor(np.cos(emb).astype(np.float32)), Tensor(np.sin(emb).astype(np.float32))


class Rotary(nn.Cell):
    """RoPE's rotation of queries or keys at their positions, x cos + rotate_half(x) sin."""

    def construct(self, x, cos, sin):
        """x [s, b, n, d]; cos, sin [s, b, 1, d]."""
        x1, x2 = ops.split(x, x.shape[-1] // 2, axis=-1)
        return x * cos + ops.cat((-x2, x1), axis=-1) * sin


class ScaledMaskedSoftmax(nn.Cell):
    """softmax(scores * scale + mask_bias) over the last dim: the core attention's softmax, `scale`
    query-key layer scaling's layer number (1 without it)."""

    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def construct(self, scores, mask_bias):
        return layers.scaled_masked_softmax(scores, mask_bias, self.scale)


class SplitLastDim(nn.Cell):
    """x [..., sum(sizes)] -> its pieces of `sizes` along the last dim (the q, k, v of a query
    group)."""

    def __init__(self, sizes):
        super().__init__()
        self.sizes = tuple(sizes)

    def construct(self, x):
        return ops.split(x, self.sizes, axis=-1)


class BiasActivation(nn.Cell):
    """An MLP's activation (layers.activation) of fc1's output y plus its bias."""

    def __init__(self, act):
        super().__init__()
        self.act = act

    def construct(self, y, bias):
        """y [..., f], bias None or [f] -> [..., f] (SwiGLU: [..., 2f] -> [..., f])."""
        if bias is not None:
            y = y + bias
        return activation(y, self.act)


class BiasDropoutAdd(nn.Cell):
    """residual + dropout(y + bias): a sub-layer's output joining the residual stream (Megatron's
    bias_dropout_add), `dropout` the layer's hidden_dropout."""

    def __init__(self, dropout):
        super().__init__()
        self.dropout = dropout

    def construct(self, y, bias, residual):
        """y [s, b, h] (a row-parallel linear's reduced output), bias None or [h], residual
        [s, b, h] -> [s, b, h] in the residual's dtype (float32 with fp32_residual_connection:
        the add promotes y, as in Megatron)."""
        if bias is not None:
            y = y + bias
        return residual + self.dropout(y)


def keep_mask(mask_bias, batch, heads):
    """The attention's mask bias as it is, [1 or b, 1, s, s]: each score add broadcasts it."""
    return mask_bias


# ============================================================================ the layer spec
@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """The class (or builder) of each layer and small operator a model is built with, chosen
    once by layer_spec: Megatron-core's layer specs (megatron/core/models/gpt/gpt_layer_specs.py),
    whose local spec builds Megatron's own layers and whose transformer_engine spec puts
    Transformer Engine's fused ones in their place, the layers' code the same. The local spec
    holds one rank's layers; a layout puts its own in their place (layer_spec). Each builder
    makes one Cell per call site; each field's comment gives what the builder takes, then what
    the operator it builds computes. Besides the layers, the spec holds the cast that the
    training step uses on gradients and main params (`cast`: train.py hands it to the
    optimizer and the pipeline)."""
    column_linear: object           # (in, out, bias, forms, ...): x [..., in] -> [..., out]
    row_linear: object              # (in, out, bias, forms, ...): x [..., in] -> [..., out]
    linear_forms: object            # (): a linear's (matmul, bias_add), layers.Linear's `forms`
    embedding: type                 # (vocab, h): ids [b, s] -> [b, s, h]
    core_attention: object          # CoreAttention's arguments: softmax(q k^T / sqrt(d)) v
    moe_layer: object               # (cfg, spec): [s, b, h] -> [s, b, h]; None: no experts
    norm: object                    # (hidden, eps): x [..., h] -> [..., h]
    split: type                     # (sizes): x [..., sum(sizes)] -> pieces
    rotary: type                    # (): (x [s, b, n, d], cos, sin [s, b, 1, d]) -> x rotated
    softmax: type                   # (scale): (scores, mask_bias) -> probabilities
    activation: object              # (act): (fc1's y, bias or None) -> act(y + bias)
    bias_dropout_add: type          # (dropout): (y, bias or None, residual) -> residual + ...
    cross_entropy: type             # (): (logits [n, V], labels [n]) -> loss [n]
    mask_layout: object             # (mask_bias, batch, heads) -> the mask bias the layers add
    cast: object                    # (t, dtype) -> t in dtype, op by op: gradients, main params


def local_spec(cfg):
    """One rank's layers, every operator in its plain form (written in this file and
    layers.py): what a learner reads first and the default build runs."""
    return LayerSpec(column_linear=layers.Linear, row_linear=layers.Linear,
                     linear_forms=layers.plain_forms, embedding=Embedding,
                     core_attention=FlashAttention if cfg.use_flash_attention else CoreAttention,
                     moe_layer=None, norm=RMSNorm if cfg.normalization == "RMSNorm" else LayerNorm,
                     split=SplitLastDim, rotary=Rotary, softmax=ScaledMaskedSoftmax,
                     activation=BiasActivation, bias_dropout_add=BiasDropoutAdd,
                     cross_entropy=CrossEntropy, mask_layout=keep_mask, cast=cast)


def layer_spec(cfg):
    """The spec a model is built with: the local spec, or with model_config.fusions
    (--fusions) its fast forms (fast_spec); then the layout's layers in place of one rank's:
    TP's linears, embedding, cross-entropy and sequence-parallel norms
    (parallel.tensor_parallel_spec), CP's core attention (context_parallel.context_parallel_spec),
    and with experts the MoE layer (moe.MoELayer) for the layers moe_layer_freq picks."""
    spec = fast_spec(cfg) if cfg.fusions else local_spec(cfg)
    state = parallel.get_state()
    if state.tp > 1:
        spec = parallel.tensor_parallel_spec(spec, state.sequence_parallel)
    if state.cp > 1:
        spec = context_parallel.context_parallel_spec(spec, state, cfg.cp_comm_type)
    if cfg.num_moe_experts:
        spec = dataclasses.replace(spec, moe_layer=moe.MoELayer)
    return spec


def fast_spec(cfg):
    """The local spec with the fast forms of fused.py in place of the plain ones, each where its
    own key asks for it (config.py turns every such key off without fusions); each tested equal
    to its plain form (test_fused_form_equals_its_plain_form). The linears' matmul and bias add,
    the q/k/v split, the tiled mask and the step's cast have no key of their own."""
    local = local_spec(cfg)
    rms = cfg.normalization == "RMSNorm"
    fused_norm = cfg.use_fused_rmsnorm if rms else cfg.persist_layer_norm
    return dataclasses.replace(
        local, linear_forms=fused.fast_linear_forms, split=fused.FusedSplitLastDim,
        norm=(fused.FusedRMSNorm if rms else fused.FusedLayerNorm) if fused_norm else local.norm,
        rotary=fused.FusedRotary if cfg.apply_rope_fusion else local.rotary,
        softmax=fused.FusedScaleMaskSoftmax if cfg.masked_softmax_fusion else local.softmax,
        activation=lambda act: fused_activation(cfg, act),
        bias_dropout_add=(fused.FusedBiasDropoutAdd if cfg.bias_dropout_fusion
                          else local.bias_dropout_add),
        cross_entropy=(fused.FusedCrossEntropy if cfg.cross_entropy_loss_fusion
                       else local.cross_entropy),
        # flash attention adds the mask block by block: tiled, it would only keep b x n copies
        mask_layout=keep_mask if cfg.use_flash_attention else fused.tile_mask,
        cast=fused.eager_cast)


def fused_activation(cfg, act):
    """The MLP's activation, fused as its key asks: SwiGLU (apply_swiglu_fusion), or a GELU with
    fc1's bias (bias_gelu_fusion; without MLP biases there is no bias to fuse)."""
    if act == "swiglu":
        return fused.SwiGLU() if cfg.apply_swiglu_fusion else BiasActivation(act)
    if cfg.bias_gelu_fusion and cfg.add_bias_linear:
        return fused.BiasGelu(tanh=act == "gelu_tanh")
    return BiasActivation(act)


class CoreAttention(nn.Cell):
    """softmax(q k^T / sqrt(d) + mask) v over one whole sequence (Megatron's core attention):
    scores, softmax, dropout, weighted sum. With grouped query attention each key/value head
    serves `per_group` consecutive query heads. The scores are computed in the compute dtype and
    the softmax runs in float32 unless attention_softmax_in_fp32 is off; Megatron's
    apply_query_key_layer_scaling divides q k^T by the layer number (1-based) in half precision,
    where deep layers' scores could overflow, and multiplies it back in the float32 softmax."""

    def __init__(self, cfg, spec, rng, per_group, layer_number=1):
        super().__init__()
        self.per_group = per_group
        self.dropout = Dropout(cfg.attention_dropout_rate, rng, "model-parallel")
        self.softmax_in_fp32 = cfg.attention_softmax_in_fp32
        coeff = layer_number if cfg.apply_query_key_layer_scaling else 1
        self.scale = 1.0 / (math.sqrt(cfg.hidden_size // cfg.num_attention_heads) * coeff)
        self.softmax_scale = float(coeff)                    # applied to the float32 scores
        self.softmax = spec.softmax(self.softmax_scale if self.softmax_in_fp32 else 1.0)

    def to_heads(self, x, repeat):
        """[s, b, g, d] -> [b, g * repeat, s, d], each head repeated `repeat` times (GQA)."""
        x = x.transpose(1, 2, 0, 3)
        return ops.repeat_interleave(x, repeat, 1) if repeat > 1 else x

    def construct(self, q, k, v, mask_bias):
        """q [s, b, n, d], k, v [s, b, g, d], mask_bias broadcasting to [b, n, s, s] (0 where
        attention is allowed, -1e30 where masked) -> context [s, b, n, d]."""
        # [b, n, s, d] each: k and v repeated for the query heads of their group
        q = self.to_heads(q, 1)
        k, v = self.to_heads(k, self.per_group), self.to_heads(v, self.per_group)
        scores = batch_matmul_nt(q * self.scale, k)                # [b, n, s, s]
        if self.softmax_in_fp32:
            scores = scores.astype(F32)
        # in float16 the -1e30 of a masked score becomes -inf: exp gives 0 all the same
        probs = self.softmax(scores, mask_bias).astype(q.dtype)
        return ops.bmm(self.dropout(probs), v).transpose(2, 0, 1, 3)   # [s, b, n, d]


def flash_block(s, block_size):
    """The block FlashKernel takes for s tokens: the largest divisor of s not above block_size
    (its loops take equal blocks: 128 for s = 4096, 10 for s = 40 and block_size 16)."""
    size = min(block_size, s)
    while s % size:
        size -= 1
    return size


def _put(x, index, block):
    """x [b, n, s, *] with block [b, n, len(index), *] written at positions `index` of dim 2."""
    index = ops.broadcast_to(index.reshape(1, 1, -1, 1), block.shape)
    return ops.tensor_scatter_elements(x, index, block, 2)


def _add(x, index, block):
    """x with block added at positions `index` of dim 2 (as _put)."""
    return _put(x, index, ops.gather(x, index, 2) + block)


class FlashAttention(CoreAttention):
    """CoreAttention block by block (FlashAttention-2, Dao 2023): queries and keys/values in blocks
    of `block_size` tokens (flash_block: a divisor of s); each query block's partial attentions
    over its key blocks are merged by their log-sum-exp (context_parallel.merge_partial_attention,
    the ring's merge); key blocks wholly above the causal diagonal are skipped (every mask here is
    causal: a GPT's, or a document mask, which only removes more). The backward (FlashKernel's
    bprop) keeps only the output and the log-sum-exp and recomputes each block's probabilities,
    so the largest s x s tensor of a layer is one block's [b, n, block, block]. Scores and softmax
    are float32 and there is no attention dropout (config.py refuses both other settings)."""

    def __init__(self, cfg, spec, rng, per_group, layer_number=1, block_size=None):
        super().__init__(cfg, spec, rng, per_group, layer_number)
        self.kernel = FlashKernel(self, block_size or FLASH_BLOCK)

    def construct(self, q, k, v, mask_bias):
        """As CoreAttention."""
        return self.kernel(q, k, v, mask_bias)[0]


class FlashKernel(nn.Cell):
    """(context [s, b, n, d], log-sum-exp [b, n, s, 1]) of FlashAttention, with its backward. The
    blocks are visited by `while` loops on tensor counters and taken by index (gather), so that
    ms.jit compiles one loop body: unrolled over s/B x s/B block pairs, the graph kept every pair's
    buffers and took minutes to compile (docs/performance.md#flash-attention)."""

    def __init__(self, core, block_size):
        super().__init__()
        self.block_size = block_size
        self.scale, self.softmax_scale = core.scale, core.softmax_scale
        self.per_group, self.to_heads = core.per_group, core.to_heads

    def construct(self, q, k, v, mask_bias):
        q = self.to_heads(q * self.scale, 1)                                 # [b, n, s, d]
        k, v = self.to_heads(k, self.per_group), self.to_heads(v, self.per_group)
        size = flash_block(q.shape[2], self.block_size)
        offsets = ops.arange(size, dtype=ms.int32)
        out, lse = ops.zeros_like(q), ops.zeros(q.shape[:3] + (1,), F32)
        i, count = Tensor(0, ms.int32), Tensor(q.shape[2] // size, ms.int32)
        while i < count:
            rows = offsets + i * size                               # query block i's positions
            q_i, mask_i = ops.gather(q, rows, 2), ops.gather(mask_bias, rows, 2)
            part = self.block(q_i, k, v, mask_i, offsets)
            j = Tensor(1, ms.int32)
            while j <= i:            # key blocks 1..i: block j > i lies above the causal diagonal
                part = merge_partial_attention(
                    part, self.block(q_i, k, v, mask_i, offsets + j * size))
                j = j + 1
            out, lse = _put(out, rows, part[0]), _put(lse, rows, part[1])
            i = i + 1
        return out.transpose(2, 0, 1, 3), lse                               # [s, b, n, d]

    def block(self, q_i, k, v, mask_i, cols):
        """(out, lse) of query block q_i [b, n, B, d] (its mask rows mask_i [.., B, s]) over the
        keys at positions `cols` [B]."""
        return attention_block(q_i, ops.gather(k, cols, 2), ops.gather(v, cols, 2),
                               ops.gather(mask_i, cols, 3), no_dropout, self.softmax_scale)

    def bprop(self, q, k, v, mask_bias, out, dout):
        # a plain function call: ms.jit (MindSpore 2.10) fails to compile this backward written
        # in the bprop itself or called as self.backward ("The pointer[func_graph->get_return()]
        # is null"); test_flash_attention_equals_core_attention[documents-compiled] runs it
        return FlashKernel.backward(self, q, k, v, mask_bias, out, dout)

    def backward(self, q, k, v, mask_bias, out, dout):
        """FlashAttention-2's backward, block by block: P = exp(S - LSE), D = rowsum(dO * O);
        dV += P^T dO; dP = dO V^T; dS = P * (dP - D); dQ += dS K, dK += dS^T Q (Q and the scores'
        scale folded in as the forward applies them). GQA: each key/value head's gradient is the
        sum over the per_group query heads it served."""
        dtype = q.dtype
        qh = self.to_heads(q * self.scale, 1)                                # [b, n, s, d]
        kh, vh = self.to_heads(k, self.per_group), self.to_heads(v, self.per_group)
        o, do = out[0].transpose(1, 2, 0, 3), dout[0].transpose(1, 2, 0, 3)
        rows_d = (cast(do, F32) * cast(o, F32)).sum(-1, keepdims=True)       # D [b, n, s, 1]
        size = flash_block(qh.shape[2], self.block_size)
        offsets = ops.arange(size, dtype=ms.int32)
        dq, dk, dv = ops.zeros_like(qh), ops.zeros_like(kh), ops.zeros_like(vh)
        i, count = Tensor(0, ms.int32), Tensor(qh.shape[2] // size, ms.int32)
        while i < count:
            rows = offsets + i * size
            query = (ops.gather(qh, rows, 2), ops.gather(do, rows, 2),
                     ops.gather(out[1], rows, 2), ops.gather(rows_d, rows, 2),
                     ops.gather(mask_bias, rows, 2))
            dq_i = ops.zeros_like(query[0])
            j = Tensor(0, ms.int32)
            while j <= i:                            # the forward's pairs: key blocks 0..i
                cols = offsets + j * size
                grads = self.block_grads(query, kh, vh, cols)
                dq_i = dq_i + grads[0]
                dk, dv = _add(dk, cols, grads[1]), _add(dv, cols, grads[2])
                j = j + 1
            dq = _put(dq, rows, dq_i)
            i = i + 1
        dq = dq * self.scale                                                 # [b, n, s, d]
        dk, dv = sum_head_groups(dk, self.per_group), sum_head_groups(dv, self.per_group)
        return (cast(dq.transpose(2, 0, 1, 3), dtype), cast(dk, k.dtype), cast(dv, v.dtype),
                ops.zeros_like(mask_bias))

    def block_grads(self, query, k, v, cols):
        """Gradients of a query block over the key block at positions `cols` [B]: dq (of the
        scaled q) [b, n, B, d], dk, dv [b, n, B, d]. `query`: its q, dO [b, n, B, d], LSE and D
        [b, n, B, 1] and mask rows [.., B, s]; k, v [b, n, s, d]."""
        *rows, mask_i = query
        return attention_block_grads(tuple(rows), ops.gather(k, cols, 2), ops.gather(v, cols, 2),
                                     ops.gather(mask_i, cols, 3), self.softmax_scale)


class SelfAttention(nn.Cell):
    """Causal multi-head attention with grouped query attention (GQA, Ainslie et al. 2023).

    linear_qkv's output is laid out per query group, as in Megatron: for each of the ng groups,
    its np/ng query heads, then one key head, then one value head (each d wide). Splitting that
    dimension into equal contiguous pieces hands whole groups to each TP rank. With context
    parallelism the core attention runs across the cp ranks (context_parallel.py)."""

    def __init__(self, cfg, spec, rng, layer_number=1):
        super().__init__()
        self.heads, self.groups = cfg.num_attention_heads, cfg.num_query_groups
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        qkv_out = (self.heads + 2 * self.groups) * self.head_dim
        self.linear_qkv = make_linear(cfg, spec, cfg.hidden_size, qkv_out, cfg.qkv_has_bias,
                                      "column")
        # (output, bias): the layer's bias-dropout-add adds the bias, unless a sandwich norm
        # norms the output with it
        self.linear_proj = make_linear(cfg, spec, self.heads * self.head_dim, cfg.hidden_size,
                                       cfg.out_proj_has_bias, "row",
                                       skip_bias_add=not cfg.use_sandwich_norm)
        self.rotary = spec.rotary()
        # Local head and group counts: TP may give this rank only some of the groups.
        self.per_group = self.heads // self.groups
        self.qkv_sizes = (self.per_group * self.head_dim, self.head_dim, self.head_dim)
        self.split_qkv = spec.split(self.qkv_sizes)
        group_width = (self.per_group + 2) * self.head_dim    # its query heads, a key, a value
        self.local_groups = self.linear_qkv.weight.shape[0] // group_width
        self.local_heads = self.local_groups * self.per_group
        self.core_attention = spec.core_attention(cfg, spec, rng, self.per_group, layer_number)

    def construct(self, x, rope, mask_bias):
        """x [s, b, h] ([s/tp, b, h] with sequence parallelism; s is this cp rank's share); rope
        None or (cos, sin) [s, b, 1, d]; mask_bias broadcasting to [b, n, s', s'], float for the
        core attention's heads and sequence, 0 where attention is allowed and -1e30 where it is
        masked -> linear_proj's [s, b, h] (with its bias beside it, as skip_bias_add)."""
        heads, groups, per_group = self.local_heads, self.local_groups, self.per_group
        qkv = self.linear_qkv(x)                                    # [s, b, (n + 2g) d / tp]
        s, b = qkv.shape[0], qkv.shape[1]
        qkv = qkv.reshape(s, b, groups, (per_group + 2) * self.head_dim)
        q, k, v = self.split_qkv(qkv)                               # [s, b, g, (n/g or 1) d]
        q = q.reshape(s, b, heads, self.head_dim)                   # [s, b, n, d]
        if rope is not None:
            q, k = self.rotary(q, *rope), self.rotary(k, *rope)     # k [s, b, g, d]
        context = self.core_attention(q, k, v, mask_bias)           # [s, b, n, d]
        return self.linear_proj(context.reshape(s, b, heads * self.head_dim))


class MLP(nn.Cell):
    """fc1 -> activation -> fc2. For SwiGLU (Shazeer 2020) fc1 outputs [gate; up], 2*ffn wide. fc1's
    bias is added by the activation, fc2's by the layer's bias-dropout-add (Megatron's
    skip_bias_add), unless a sandwich norm norms fc2's output with it."""

    def __init__(self, cfg, spec):
        super().__init__()
        chunks = fc1_chunks(cfg)
        self.linear_fc1 = make_linear(cfg, spec, cfg.hidden_size, cfg.ffn_hidden_size * chunks,
                                      cfg.add_bias_linear, "column", chunks=chunks,
                                      skip_bias_add=True)
        self.activation = make_activation(cfg, spec)
        self.linear_fc2 = make_linear(cfg, spec, cfg.ffn_hidden_size, cfg.hidden_size,
                                      cfg.add_bias_linear, "row",
                                      skip_bias_add=not cfg.use_sandwich_norm)

    def construct(self, x):
        return self.linear_fc2(self.activation(*self.linear_fc1(x)))


def replay_dropout(rng):
    """context_fn for Cell.recompute(use_reentrant=False): MindSpore's recompute replays only its
    own RNG, so the numpy dropout streams are replayed here. The forward notes their state, the
    recomputation starts from it (the same masks), then restores the state training has
    reached."""
    def context_fn():
        saved = {}

        @contextlib.contextmanager
        def forward():
            saved.update(rng.state_dict())
            yield

        @contextlib.contextmanager
        def recompute():
            now = rng.state_dict()
            rng.load_state_dict(saved)
            try:
                yield
            finally:
                rng.load_state_dict(now)
        return forward(), recompute()
    return context_fn


class RecomputedLayers(nn.Cell):
    """Consecutive transformer layers recomputed as one (Megatron's full recompute): the forward
    keeps only the group's input; the backward runs the group's forward again to get the rest."""

    def __init__(self, layers, rng):
        super().__init__()
        # the model's own layers: their names stay layers.i
        self.members = nn.CellList(layers)
        # early_stop=False: the early stop ends the recomputation by an exception, which a
        # custom-bprop Cell on its way (the TP mappings, the linears' fused.LinearMatMul)
        # turns into "Stack input_args_info_stack_ is empty" op by op (MindSpore 2.10)
        self.recompute(use_reentrant=False, early_stop=False, context_fn=replay_dropout(rng))

    def construct(self, x, rope, mask_bias):
        for layer in self.members:
            x = layer(x, rope, mask_bias)
        return x


def recompute_core_attention(attention, rng):
    """Selective recompute (Korthikanti et al. 2022): a SelfAttention's core attention, the s x s
    part, recomputed in the backward. With CP, what runs between the Ulysses all-to-alls (the
    ring's gathers included): MindSpore 2.10's recompute fails when a custom-bprop Cell gives the
    recomputed block's output."""
    core = attention.core_attention
    inner = core.attend if isinstance(core, context_parallel.ContextParallelAttention) else core
    inner.recompute(use_reentrant=False, context_fn=replay_dropout(rng))


def recompute_blocks(cfg, layers, rng, rebuilt):
    """The units a model chunk runs, in order, Megatron's recompute_granularity applied: selective,
    the layers with their core attention recomputed (recompute_core_attention); full, uniform:
    groups of recompute_num_layers layers, every group recomputed; full, block: the first
    `rebuilt` layers of the chunk (config.recompute_counts) recomputed one by one, the others
    kept."""
    if cfg.recompute_granularity == "selective":
        for layer in layers:
            recompute_core_attention(layer.self_attention, rng)
    if cfg.recompute_granularity != "full" or not len(layers):
        return layers
    layers = list(layers)
    if cfg.recompute_method == "uniform":
        per = cfg.recompute_num_layers
        groups = [layers[i:i + per] for i in range(0, len(layers), per)]
        return nn.CellList([RecomputedLayers(group, rng) for group in groups])
    recomputed = [RecomputedLayers([layer], rng) for layer in layers[:rebuilt]]
    return nn.CellList(recomputed + layers[rebuilt:])


class TransformerLayer(nn.Cell):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x))). With sandwich norm
    each sub-layer's output is normed again before the residual add (CogView, PanGu). The MLP is
    the spec's MoE layer (same input and output) on the layers moe_layer_freq selects
    (Megatron's gpt_layer_specs: layer_number is 1-based and global)."""

    def __init__(self, cfg, spec, rng, layer_number=1):
        super().__init__()
        self.input_layernorm = make_norm(cfg, spec)
        self.self_attention = SelfAttention(cfg, spec, rng, layer_number)
        self.pre_mlp_layernorm = make_norm(cfg, spec)
        self.moe = moe_layer_pattern(cfg)[layer_number - 1]
        self.mlp = spec.moe_layer(cfg, spec) if self.moe else MLP(cfg, spec)
        self.sandwich = cfg.use_sandwich_norm
        if self.sandwich:
            self.post_attention_norm = make_norm(cfg, spec)
            self.post_mlp_norm = make_norm(cfg, spec)
        self.attention_bda = make_bias_dropout_add(cfg, spec, rng)
        self.mlp_bda = make_bias_dropout_add(cfg, spec, rng)

    def construct(self, x, rope, mask_bias):
        """x [s, b, h] ([s/tp, b, h] under SP): the residual stream, in gpt.hidden_dtype; the
        sub-layers compute in the compute dtype and return (output, bias or None), except a
        sandwich norm's output (its bias normed in) and an MoE layer's."""
        y = self.self_attention(self.input_layernorm(x), rope, mask_bias)
        if self.sandwich:
            y = (self.post_attention_norm(y), None)
        x = self.attention_bda(y[0], y[1], x)
        y = self.mlp(self.pre_mlp_layernorm(x))
        if self.sandwich:
            y = (self.post_mlp_norm(y), None)
        elif self.moe:
            y = (y, None)
        return self.mlp_bda(y[0], y[1], x)


class CrossEntropy(nn.Cell):
    """The loss of one TP rank (VocabParallelCrossEntropy under TP)."""

    def construct(self, logits, labels):
        """Per-token loss [n] from logits [n, V] and labels [n]: -log_softmax(z)[label]."""
        log_probs = ops.log_softmax(logits, -1)                             # [n, V]
        return -ops.gather_elements(log_probs, 1, labels.reshape(-1, 1)).reshape(-1)


class RotaryEmbedding(nn.Cell):
    """RoPE's tables (rotary_tables) and their rows at the positions [b, s] -> (cos, sin)
    [s, b, 1, d] each, in the compute dtype (Megatron's RotaryEmbedding)."""

    def __init__(self, cfg):
        super().__init__()
        self.cos, self.sin = rotary_tables(cfg.max_position_embeddings,
                                           cfg.hidden_size // cfg.num_attention_heads,
                                           cfg.rotary_base)
        self.dtype = DTYPES[cfg.compute_dtype]

    def construct(self, position_ids):
        return tuple(cast(ops.gather(t, position_ids, 0), self.dtype)
                     .transpose(1, 0, 2).expand_dims(2) for t in (self.cos, self.sin))


def core_heads(cfg, state):
    """The heads in one core attention: this TP rank's (whole query groups: config.py checks
    that TP divides them), fewer under Ulysses, which spreads them over its ranks."""
    return cfg.num_attention_heads // state.tp // state.cp_ulysses


class AttentionMask(nn.Cell):
    """The additive mask bias the core attentions add, in the spec's layout (the fast forms tile
    it to a core attention's heads): from the document mask (bool [b, 1, s, s], True = masked)
    or the causal one, over the tokens a core attention sees (context_parallel.attended_length:
    the sequence, or with context parallelism what this rank's attention spans)."""

    def __init__(self, cfg, spec):
        super().__init__()
        self.state = parallel.get_state()
        local = cfg.seq_length // self.state.cp
        self.causal_bias = causal_mask_bias(context_parallel.attended_length(local, self.state))
        self.layout, self.heads = spec.mask_layout, core_heads(cfg, self.state)

    def construct(self, attention_mask, position_ids, batch):
        s = context_parallel.attended_length(position_ids.shape[1], self.state)
        if attention_mask is not None:
            bias = ops.masked_fill(ops.zeros(attention_mask.shape, F32), attention_mask, MASKED)
        elif s == self.causal_bias.shape[-1]:
            bias = self.causal_bias
        else:
            bias = causal_mask_bias(s)
        return self.layout(bias, batch, self.heads)


class LanguageModelLoss(nn.Cell):
    """Megatron's loss (compute_language_model_loss, then pretrain_gpt's loss_func): the mean
    cross-entropy over the tokens loss_mask keeps, summed over the context-parallel ranks first
    (context_parallel.LossOverCP); per token the spec's cross-entropy.
    (logits [s, b, V/tp], labels and loss_mask [b, s]) -> loss []."""

    def __init__(self, spec):
        super().__init__()
        self.cross_entropy = spec.cross_entropy()
        self.loss_over_cp = context_parallel.LossOverCP(parallel.get_state())

    def construct(self, logits, labels, loss_mask):
        losses = self.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.T.reshape(-1))
        mask = loss_mask.T.reshape(-1).astype(F32)
        total, count = (cast(losses, F32) * mask).sum().reshape(1), mask.sum().reshape(1)
        total, count = self.loss_over_cp(total, count)
        return (total / ops.maximum(count, 1.0)).reshape(())


class GPTModel(nn.Cell):
    """Megatron's GPTModel: the embedding (`pre_process`: this stage embeds), the layers
    [layer_offset, layer_offset + num_layers), the final norm and the output layer
    (`post_process`: this stage ends with the loss), with the layer spec's forms; the whole
    model, or one pipeline stage.

    construct(x, position_ids, attention_mask, labels, loss_mask):
      x: token ids [b, s] if pre_process, else hidden states [s, b, h] from the previous stage;
      attention_mask: None (causal) or bool [b, 1, s, s], True = masked (Megatron's convention);
      returns the mean loss over loss_mask if post_process and labels are given, the logits
      [b, s, V] if post_process without labels, else hidden states [s, b, h]."""

    def __init__(self, cfg, spec, pre_process=True, post_process=True, layer_offset=0,
                 num_layers=None, rng=None):
        super().__init__()
        self.cfg, self.pre_process, self.post_process = cfg, pre_process, post_process
        self.layer_offset, self.rng = layer_offset, rng or DropoutRNG(0)
        self.tied = not cfg.untie_embeddings_and_output_weights
        self.hidden_dtype = hidden_dtype(cfg)
        if pre_process:
            self._build_embeddings(cfg, spec)
        n = cfg.num_layers if num_layers is None else num_layers
        self.layers = nn.CellList([TransformerLayer(cfg, spec, self.rng, layer_offset + i + 1)
                                   for i in range(n)])
        self.blocks = self.layers          # what construct runs: recompute_blocks may group them
        if post_process:
            self._build_output_layer(cfg, spec)
        self.rotary_pos_emb = RotaryEmbedding(cfg) if cfg.position_embedding_type == "rope" \
            else None
        self.attention_mask = AttentionMask(cfg, spec)

    def _build_embeddings(self, cfg, spec):
        """The first stage's word embedding (the spec's), its absolute position embeddings, the
        embeddings' dropout."""
        h, vocab = cfg.hidden_size, cfg.padded_vocab_size
        self.word_embeddings = spec.embedding(vocab, h)
        if cfg.position_embedding_type == "absolute":
            self.position_embeddings = Parameter(_zeros(cfg.max_position_embeddings, h),
                                                 name="position_embeddings")
        self.enter_sequence_parallel = parallel.sequence_parallel_scatter()
        self.embedding_dropout = hidden_dropout(cfg, self.rng)

    def _build_output_layer(self, cfg, spec):
        """The last stage's final norm, its output layer (a column-parallel linear whose weight,
        tied, is the word embedding's on a stage that has it: Megatron's
        skip_weight_param_allocation), the logits' dtype (float32 for the loss unless
        fp16_lm_cross_entropy) and the loss."""
        self.final_layernorm = make_norm(cfg, spec)
        self.shares_weight = self.tied and self.pre_process
        self.output_layer = make_linear(cfg, spec, cfg.hidden_size, cfg.padded_vocab_size,
                                        False, "column", own_weight=not self.shares_weight)
        self.gather_logits = parallel.tensor_parallel_gather()
        self.logits_dtype = DTYPES[cfg.compute_dtype] if cfg.fp16_lm_cross_entropy else F32
        self.loss = LanguageModelLoss(spec)

    def embed(self, tokens, position_ids):
        """tokens [b, s] -> the hidden states [s, b, h] ([s/tp, b, h] under SP) in hidden_dtype:
        word and position embeddings, then dropout."""
        x = self.word_embeddings(tokens)                                      # [b, s, h]
        if self.cfg.position_embedding_type == "absolute":
            x = x + ops.gather(self.position_embeddings, position_ids, 0)
        x = cast(x, self.hidden_dtype).transpose(1, 0, 2)                     # [s, b, h]
        return self.embedding_dropout(self.enter_sequence_parallel(x))        # [s/tp, b, h]

    def decode(self, x, position_ids, attention_mask, blocks):
        """x [s, b, h] ([s/tp, b, h] under SP) through `blocks` (the layers, or recomputed
        groups of them), with RoPE's tables and the mask bias at these positions."""
        rope = None if self.rotary_pos_emb is None else self.rotary_pos_emb(position_ids)
        bias = self.attention_mask(attention_mask, position_ids, x.shape[1])
        for block in blocks:
            x = block(x, rope, bias)
        return x

    def construct(self, x, position_ids, attention_mask=None, labels=None, loss_mask=None):
        if self.pre_process:
            x = self.embed(x, position_ids)                                   # [s, b, h]
        x = self.decode(x, position_ids, attention_mask, self.blocks)
        if not self.post_process:
            return x
        return self.head(x, labels, loss_mask)

    def head(self, x, labels=None, loss_mask=None, tied_weight=None):
        """The last stage's end, x [s, b, h] ([s/tp, b, h] under SP) -> the final norm and the
        logits [s, b, V/tp] (Megatron's parallel_lm_logits, computed in the compute dtype),
        then the loss if labels are given, else the logits gathered, [b, s, V]. A tied output
        layer multiplies by the word embedding, or by `tied_weight`, a copy of it given as an
        input (ModelPiece)."""
        weight = None
        if self.shares_weight:
            weight = self.word_embeddings.weight if tied_weight is None else tied_weight
        logits = cast(self.output_layer(self.final_layernorm(x), weight), self.logits_dtype)
        if labels is not None:
            return self.loss(logits, labels, loss_mask)
        return self.gather_logits(logits).transpose(1, 0, 2)                  # [b, s, V]


def model_pieces(model, blocks_per_piece=None):
    """A GPTModel's forward as the ModelPieces the schedule runs (pipeline.ForwardBackward), which
    share its parameters: one piece, the whole model, or with Megatron's overlap pieces of
    `blocks_per_piece` blocks each, whose gradients are final one piece at a time."""
    n = len(model.blocks)
    size = blocks_per_piece or max(n, 1)
    return [ModelPiece(model, start, min(start + size, n)) for start in range(0, max(n, 1), size)]


class ModelPiece(nn.Cell):
    """Blocks [start, end) of a GPTModel `model`, run as GPTModel.construct runs them all: the
    piece with the first block also embeds (if the model does), the one with the last also
    ends with the model's head. construct takes GPTModel.construct's inputs, x being token ids
    or the previous piece's hidden states [s, b, h]; `params`: the model's parameters it uses.
    It does not own them (auto_prefix=False keeps their names).

    The tied embedding is used by the first piece and the last. PyNative gives a parameter no
    gradient from a recorded forward after the first that uses it (its later uses count as
    those of an intermediate), so the last piece takes the output layer's weight as an input,
    a copy of the word embedding (tied_weight(): the parameter it copies, or None), and its
    gradient comes back as that input's."""

    def __init__(self, model, start, end):
        super().__init__(auto_prefix=False)
        # a tuple: slicing the CellList would make a new one, which renames its cells'
        # parameters
        self.model, self.blocks = model, tuple(model.blocks[i] for i in range(start, end))
        self.embeds = start == 0 and model.pre_process
        self.ends = end == len(model.blocks) and model.post_process
        self.copies_tie = self.ends and not self.embeds and model.tied and model.pre_process
        self.params = [p for block in self.blocks for p in block.get_parameters()]
        if self.embeds:
            self.params = list(model.word_embeddings.get_parameters()) + (
                [model.position_embeddings] if hasattr(model, "position_embeddings") else []
            ) + self.params
        if self.ends:              # a shared output weight is the first piece's, or an input
            self.params += (list(model.final_layernorm.get_parameters())
                            + list(model.output_layer.get_parameters()))

    def tied_weight(self):
        return self.model.word_embeddings.weight if self.copies_tie else None

    def construct(self, x, position_ids, attention_mask=None, labels=None, loss_mask=None,
                  tied_weight=None):
        model = self.model
        if self.embeds:
            x = model.embed(x, position_ids)                                  # [s, b, h]
        x = model.decode(x, position_ids, attention_mask, self.blocks)
        if not self.ends:
            return x
        return model.head(x, labels, loss_mask, tied_weight)


def model_provider(cfg, pre_process=True, post_process=True, layer_offset=0, num_layers=None,
                   rng=None, recomputed_layers=None):
    """A GPTModel (one pipeline stage, or the whole model) as training builds it, Megatron's
    model_provider: the layer spec's forms (layer_spec), the recompute choices (recompute_blocks:
    full recompute, block, rebuilds `recomputed_layers` of its first layers, by default
    recompute_num_layers), a stage's marks of the tied embedding (tie_embeddings), its
    parameters in params_dtype (cast_parameters, Megatron's Float16Module). Weights are not
    initialised (init_weights)."""
    model = GPTModel(cfg, layer_spec(cfg), pre_process, post_process, layer_offset, num_layers,
                     rng)
    rebuilt = cfg.recompute_num_layers if recomputed_layers is None else recomputed_layers
    model.blocks = recompute_blocks(cfg, model.layers, model.rng, rebuilt)
    tie_embeddings(model)
    cast_parameters(model, DTYPES[cfg.params_dtype])
    return model


def tie_embeddings(chunk):
    """Megatron's marks of the tie, when the model is cut into stages (language_module.py's
    setup_embeddings_and_output_layer): the last stage's output layer is a copy of the first
    stage's word embedding (`shared`: is_embedding_copy), and both are `shared_embedding`,
    whose gradients distributed.finalize_model_grads sums over the embedding group."""
    if not chunk.tied or (chunk.pre_process and chunk.post_process):
        return
    if chunk.pre_process:
        chunk.word_embeddings.weight.shared_embedding = True
    elif chunk.post_process:
        chunk.output_layer.weight.shared_embedding = True
        chunk.output_layer.weight.shared = True


class Compiled(nn.Cell):
    """`model` compiled by ms.jit into one graph (and so its backward too): on CPU 2-3x faster
    than op-by-op PyNative, tensor-parallel collectives included. Dropout is not allowed inside:
    its masks come from host RNG streams, which a graph cannot call, so train.py runs dropout
    models eagerly. Its calls go through parallel.compiled_call, where the collectives'
    observers see them."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def construct(self, *inputs):
        return parallel.compiled_call(self, self.graph, inputs)

    @ms.jit
    def graph(self, *inputs):
        return self.model(*inputs)


def is_embedding_copy(param):
    """Whether `param` is the last stage's copy of the word embedding, its output layer under
    tied embeddings over pipeline stages (marked `shared` as Megatron marks it:
    gpt.tie_embeddings): it starts, loads and saves as the word embedding and counts in the
    gradient norm on the first stage only (Megatron's param_is_not_shared)."""
    return getattr(param, "shared", False)


LAYER_INDEX = re.compile(r"^layers\.(\d+)\.")          # a parameter of a model chunk's layer


def global_name(chunk, name):
    """The name of `chunk`'s parameter `name` in the whole model, so that every layout seeds and
    saves a weight under one name: its layer numbered among all layers ("layers.3." on a stage
    that starts at layer 4 -> "layers.7."), a routed expert among all experts (its MoE layer's
    first expert, moe.global_expert_name)."""
    match = LAYER_INDEX.match(name)
    if match is None:
        return name
    layer = int(match.group(1))
    if moe.is_expert(name):
        name = moe.global_expert_name(name, chunk.layers[layer].mlp.local_expert_offset)
    return f"layers.{layer + chunk.layer_offset}." + name[match.end():]


def init_value(name, shape, cfg, seed):
    """Megatron's initialisation, drawn from a stream keyed by (seed, global name): normal(0, std)
    for weights and embeddings (embedding_init_method_std if given), std / sqrt(2 * num_layers)
    for the output projections of each block, zeros for biases, ones for norm weights (post-norm
    scale for sandwich norms)."""
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name:
        if leaf == "bias":
            return np.zeros(shape, np.float32)
        scale = 1.0
        if "post_attention_norm" in name:
            scale = cfg.attn_post_norm_scale
        elif "post_mlp_norm" in name:
            scale = cfg.ffn_post_norm_scale
        return np.full(shape, scale, np.float32)
    if leaf == "bias" and ".router." not in name:   # Megatron draws the router's bias like its
        return np.zeros(shape, np.float32)          # weight (router.py:78-83)
    std = cfg.init_method_std
    if "embeddings" in name and cfg.embedding_init_method_std is not None:
        std = cfg.embedding_init_method_std          # Megatron-core's embedding_init_method_std
    if "linear_proj" in name or "linear_fc2" in name:
        std = std / math.sqrt(2.0 * cfg.num_layers)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return rng.normal(0.0, std, size=shape).astype(np.float32)


def init_weights(model, seed):
    """Fill every parameter of `model` from init_value: a parameter split over TP draws the full
    master weight and keeps this rank's slice, so every layout starts from the same model. The
    output layer of a stage without the embedding starts as a copy of the word embedding when
    the two are tied."""
    state = parallel.get_state()
    for name, param in model.parameters_and_names():
        gname = global_name(model, name)
        if is_embedding_copy(param):
            gname = "word_embeddings.weight"
        dim = getattr(param, "partition_dim", None)
        if dim is None:
            value = init_value(gname, param.shape, model.cfg, seed)
        else:
            full = list(param.shape)
            full[dim] *= state.tp
            value = parallel.shard(init_value(gname, tuple(full), model.cfg, seed), dim,
                                   state.tp_rank, state.tp, getattr(param, "partition_chunks", 1))
        param.set_data(Tensor(value))


def num_floating_point_operations(cfg, batch_size):
    """Megatron's num_floating_point_operations (megatron/training/training.py): matmul FLOPs of
    one training iteration of `batch_size` sequences, forward and backward (3 GEMMs per weight:
    forward, data gradient, weight gradient; 2 FLOPs per multiply-add; Narayanan et al. 2021,
    appendix): the sum of its terms (flops_terms) over the layers, dense and MoE, plus the
    output layer."""
    dense, moe_layer, output = flops_terms(cfg, batch_size)
    moe_layers = sum(moe_layer_pattern(cfg))
    return (cfg.num_layers - moe_layers) * dense + moe_layers * moe_layer + output


def flops_terms(cfg, batch_size):
    """The terms num_floating_point_operations sums: (a dense layer's, an MoE layer's, the
    output layer's) FLOPs, each Megatron's 12 b s h^2 times its part of the formula's bracket.
    Counts GQA's smaller key/value projections, SwiGLU's third matrix, the full s x s attention
    scores and, in MoE layers, the experts each token goes to; the embedding lookup is no
    matmul."""
    h = cfg.hidden_size
    head_dim = h // cfg.num_attention_heads
    query_to_hidden = head_dim * cfg.num_attention_heads / h
    gated = 1.5 if cfg.hidden_act == "swiglu" else 1.0
    attention = ((1 + cfg.num_query_groups / cfg.num_attention_heads + cfg.seq_length / h)
                 * query_to_hidden)
    # an MoE layer: k routed experts and the shared one per token (the router's GEMM not counted)
    moe_ffn = 0 if not cfg.num_moe_experts else (cfg.moe_ffn_hidden_size * cfg.moe_router_topk
                                                 + (cfg.moe_shared_expert_intermediate_size or 0))
    unit = 12 * batch_size * cfg.seq_length * h * h
    return (unit * (attention + cfg.ffn_hidden_size / h * gated),
            unit * (attention + moe_ffn / h * gated), unit * cfg.padded_vocab_size / (2 * h))


def generate(model, prompt_ids, max_new_tokens, temperature=1.0, top_k=0, vocab_size=None,
             rng=None, on_token=None):
    """Autoregressive sampling from a one-stage model: greedy when temperature == 0, else
    softmax(logits / temperature) restricted to the top_k tokens. Padded vocabulary entries
    (ids >= vocab_size) are never sampled. Recomputes the window each step (no KV cache); the
    window slides over the last seq_length tokens, so any number can be sampled. Returns the new
    ids; `on_token(id)` is called with each as it is sampled (to stream them)."""
    rng = rng or np.random.default_rng(0)
    model.set_train(False)
    ids, s = list(prompt_ids), model.cfg.seq_length
    for _ in range(max_new_tokens):
        window = ids[-s:]
        tokens = Tensor(np.array([window], np.int32))
        positions = Tensor(np.arange(len(window), dtype=np.int32)[None])
        logits = model(tokens, positions)[0, -1].asnumpy().astype(np.float64)
        if vocab_size is not None:
            logits = logits[:vocab_size]
        if temperature == 0:
            ids.append(int(logits.argmax()))
        else:
            logits = logits / temperature
            if top_k:
                logits[logits < np.sort(logits)[-top_k]] = -np.inf
            probs = np.exp(logits - logits.max())
            ids.append(int(rng.choice(len(probs), p=probs / probs.sum())))
        if on_token is not None:
            on_token(ids[-1])
    return ids[len(prompt_ids):]


if __name__ == "__main__":          # imported by train.py, not a script
    raise SystemExit("error: gpt.py is a library: run `bash run.sh` (bash run.sh --help "
                     "lists the commands)")
