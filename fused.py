"""Fused forms of the model's small operators, each equal to a plain form in gpt.py or parallel.py
(values and gradients: test_fused_form_equals_its_plain_form), chosen by its config key.

Why, on MindSpore 2.10's CPU backend (cpu_kernel_probes.py; docs/performance.md#fusions):
- Reductions over rows are slow kernels: BiasAddGrad, ReduceSum, ReduceMean and LayerNormGrad
  run 3x slower than a MatMul against a ones (or 1/h) vector doing the same sum. So a norm's
  means are `x @ avg` with avg a [h, 1] column of 1/h, a softmax backward's row sums
  `(dY * Y) @ ones[s, 1]`, and every bias or norm weight gradient parallel.column_sum.
- Autodiff of a written-out formula keeps and re-reads its intermediates and adds a gradient op
  per forward op; a custom backward (an nn.Cell's `bprop`) does the algebra once: the saved
  outputs (a norm's normalised x and 1/rms, a GELU's tanh, SwiGLU's sigmoid) are returned as
  extra outputs of the Cell, so its bprop gets them in `out` instead of recomputing them.

MindSpore 2.10 facts these Cells are written around: gradients reach a custom-bprop Cell's
inputs only (weights and biases are passed in as inputs); a backward written inside `bprop`
sometimes fails to compile under ms.jit ("The pointer[func_graph->get_return()] is null"), so
each bprop calls its class's `backward` as a plain function, as gpt.FlashKernel does; and
recompute fails when a custom-bprop Cell gives the recomputed block's output, so none of these
ends a layer (bias_dropout_add is plain ops). Norms and the softmax compute in float32 inside,
as their plain forms do.
"""
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from parallel import F32, cast, column_sum


def _mean_column(h):
    """[h, 1] of 1/h: x [n, h] @ it is the row mean [n, 1] as one MatMul."""
    return Tensor(np.full((h, 1), 1.0 / h, np.float32))


class _LayerNormKernel(nn.Cell):
    """(y, xhat, rstd) of x [n, h] float32: xhat = (x - mean) * rstd, y = xhat * w + b."""

    def __init__(self, hidden, eps):
        super().__init__()
        self.avg, self.eps = _mean_column(hidden), eps

    def construct(self, x, weight, bias):
        centred = x - ops.matmul(x, self.avg)                                # [n, h]
        rstd = ops.rsqrt(ops.matmul(centred * centred, self.avg) + self.eps)  # [n, 1]
        xhat = centred * rstd
        return ops.bias_add(xhat * weight, bias), xhat, rstd

    def bprop(self, x, weight, bias, out, dout):
        return _LayerNormKernel.backward(self, weight, out, dout)

    def backward(self, weight, out, dout):
        """dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy w; dw = sum(dy xhat),
        db = sum(dy) over the rows."""
        dy, xhat, rstd = dout[0], out[1], out[2]
        g = dy * weight
        dx = rstd * (g - ops.matmul(g, self.avg) - xhat * ops.matmul(g * xhat, self.avg))
        return dx, column_sum(dy * xhat), column_sum(dy)


class LayerNorm(nn.Cell):
    """gpt.LayerNorm (the ops.LayerNorm kernel) with its means as MatMuls and a hand backward
    (Megatron's fused LayerNorm; model_config.persist_layer_norm)."""

    def __init__(self, hidden, eps):
        super().__init__()
        self.weight = Parameter(Tensor(np.ones(hidden, np.float32)), name="weight")
        self.bias = Parameter(Tensor(np.zeros(hidden, np.float32)), name="bias")
        self.kernel = _LayerNormKernel(hidden, eps)

    def construct(self, x):
        """x [..., h] in any dtype -> normalised in float32, returned in x's dtype."""
        y = self.kernel(cast(x, F32).reshape(-1, x.shape[-1]), cast(self.weight, F32),
                        cast(self.bias, F32))[0]
        return cast(y.reshape(x.shape), x.dtype)


class _RMSNormKernel(nn.Cell):
    """(y, xhat, rstd) of x [n, h] float32: xhat = x * rstd, rstd = 1 / sqrt(mean(x^2) + eps)."""

    def __init__(self, hidden, eps):
        super().__init__()
        self.avg, self.eps = _mean_column(hidden), eps

    def construct(self, x, weight):
        rstd = ops.rsqrt(ops.matmul(x * x, self.avg) + self.eps)             # [n, 1]
        xhat = x * rstd
        return xhat * weight, xhat, rstd

    def bprop(self, x, weight, out, dout):
        return _RMSNormKernel.backward(self, weight, out, dout)

    def backward(self, weight, out, dout):
        """dx = rstd (g - xhat mean(g xhat)) with g = dy w; dw = sum(dy xhat) over the rows."""
        dy, xhat, rstd = dout[0], out[1], out[2]
        g = dy * weight
        dx = rstd * (g - xhat * ops.matmul(g * xhat, self.avg))
        return dx, column_sum(dy * xhat)


class RMSNorm(nn.Cell):
    """gpt.RMSNorm with its mean as a MatMul and a hand backward (MindSpeed's
    --use-fused-rmsnorm; model_config.use_fused_rmsnorm)."""

    def __init__(self, hidden, eps):
        super().__init__()
        self.weight = Parameter(Tensor(np.ones(hidden, np.float32)), name="weight")
        self.kernel = _RMSNormKernel(hidden, eps)

    def construct(self, x):
        y = self.kernel(cast(x, F32).reshape(-1, x.shape[-1]), cast(self.weight, F32))[0]
        return cast(y.reshape(x.shape), x.dtype)


GELU_TANH_K = 0.7978845608028654        # sqrt(2 / pi), gpt.gelu_tanh's
GELU_TANH_C = 0.044715
INV_SQRT_2PI = 0.3989422804014327


class _BiasGeluKernel(nn.Cell):
    """(gelu(x), x, t) of x = y + bias, y [n, f], bias [f]: t is tanh(k (x + c x^3)) for the
    tanh form, Phi(x) = (1 + erf(x / sqrt 2)) / 2 for the exact one; its backward needs x and t."""

    def __init__(self, tanh):
        super().__init__()
        self.tanh = tanh

    def construct(self, y, bias):
        x = ops.bias_add(y, bias)
        if self.tanh:
            t = ops.tanh(GELU_TANH_K * (x + GELU_TANH_C * x * x * x))
            return 0.5 * x * (1.0 + t), x, t
        t = 0.5 * (1.0 + ops.erf(x * 0.7071067811865476))
        return x * t, x, t

    def bprop(self, y, bias, out, dout):
        return _BiasGeluKernel.backward(self, bias, out, dout)

    def backward(self, bias, out, dout):
        """gelu'(x) = (1 + t) / 2 + x (1 - t^2) k (1 + 3 c x^2) / 2 (tanh form), or
        Phi(x) + x phi(x) (exact); the bias gradient sums dx over the rows."""
        dy, x, t = dout[0], out[1], out[2]
        if self.tanh:
            x2 = x * x
            slope = 0.5 * (1.0 + t) + (0.5 * GELU_TANH_K) * x * (1.0 - t * t) * (
                1.0 + (3.0 * GELU_TANH_C) * x2)
        else:
            slope = t + INV_SQRT_2PI * x * ops.exp(-0.5 * x * x)
        dx = dy * slope
        return dx, cast(column_sum(dx), bias.dtype)


class BiasGelu(nn.Cell):
    """gelu(y + bias): the plain MLP's bias add in linear_fc1 (parallel.BiasAdd) and then
    gpt.gelu_tanh (tanh) or ops.gelu (exact), as one Cell with a hand backward (Megatron's
    bias_gelu fusion, --no-bias-gelu-fusion; model_config.bias_gelu_fusion)."""

    def __init__(self, tanh):
        super().__init__()
        self.kernel = _BiasGeluKernel(tanh)

    def construct(self, y, bias):
        """y [..., f] without its bias, bias [f] -> [..., f], in y's dtype."""
        out = self.kernel(y.reshape(-1, y.shape[-1]), cast(bias, y.dtype))[0]
        return out.reshape(y.shape)


class _SwiGLUKernel(nn.Cell):
    """(silu(gate) * up, sigmoid(gate)) of y = [gate, up] [..., 2f]."""

    def construct(self, y):
        gate, up = ops.chunk(y, 2, axis=-1)
        sig = ops.sigmoid(gate)
        return gate * sig * up, sig

    def bprop(self, y, out, dout):
        return _SwiGLUKernel.backward(y, out, dout)

    @staticmethod
    def backward(y, out, dout):
        """d gate = dy up s (1 + gate (1 - s)), d up = dy gate s, with s = sigmoid(gate)."""
        gate, up = ops.chunk(y, 2, axis=-1)
        dy, sig = dout[0], out[1]
        silu = gate * sig
        d_gate = dy * up * (sig + silu * (1.0 - sig))
        return (ops.cat((d_gate, dy * silu), -1),)


class SwiGLU(nn.Cell):
    """gpt.MLP's `ops.silu(gate) * up` with a hand backward that reuses the forward's sigmoid
    (MindSpeed's --use-fused-swiglu; model_config.apply_swiglu_fusion)."""

    def __init__(self):
        super().__init__()
        self.kernel = _SwiGLUKernel()

    def construct(self, y):
        """y [..., 2f] = [gate, up] (fc1's output, bias included) -> [..., f]."""
        return self.kernel(y)[0]


class Rotary(nn.Cell):
    """gpt.apply_rotary, x cos + rotate_half(x) sin, with its backward written out: the
    transpose of rotate_half is a rotation back, dx = dy cos + rotate_half^T(dy sin)
    (Megatron's --apply-rope-fusion / --no-rope-fusion; model_config.apply_rope_fusion)."""

    def construct(self, x, cos, sin):
        """x [s, b, n, d]; cos, sin [s, b, 1, d] (no gradient: fixed tables)."""
        x1, x2 = ops.split(x, x.shape[-1] // 2, axis=-1)
        return x * cos + ops.cat((-x2, x1), axis=-1) * sin

    def bprop(self, x, cos, sin, out, dout):
        return Rotary.backward(x, cos, sin, dout)

    @staticmethod
    def backward(x, cos, sin, dout):
        z1, z2 = ops.split(dout * sin, x.shape[-1] // 2, axis=-1)
        return dout * cos + ops.cat((z2, -z1), axis=-1), ops.zeros_like(cos), ops.zeros_like(sin)


class ScaledMaskedSoftmax(nn.Cell):
    """softmax(scores * scale + mask_bias) over the last dim, gpt.CoreAttention's softmax, with
    its backward's row sums as a MatMul: dx = scale (dY Y - Y (dY Y) @ ones[s, 1]) (Megatron's
    masked softmax fusion, --no-masked-softmax-fusion; model_config.masked_softmax_fusion)."""

    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def construct(self, scores, mask_bias):
        """scores [b, n, s, t] in the softmax's dtype; mask_bias [b, n, s, t] (0 or -1e30)."""
        if self.scale != 1.0:
            scores = scores * self.scale
        return ops.softmax(scores + cast(mask_bias, scores.dtype), -1)

    def bprop(self, scores, mask_bias, out, dout):
        return ScaledMaskedSoftmax.backward(self, mask_bias, out, dout)

    def backward(self, mask_bias, out, dout):
        weighted = dout * out                                                # [b, n, s, t]
        rows = ops.matmul(weighted, ops.ones((out.shape[-1], 1), out.dtype))   # [b, n, s, 1]
        d_scores = weighted - out * rows
        if self.scale != 1.0:
            d_scores = d_scores * self.scale
        return d_scores, ops.zeros_like(mask_bias)


class CrossEntropy(nn.Cell):
    """gpt.cross_entropy, the per-token loss [n] from logits [n, V] and labels [n], from one
    softmax kernel: lse = max(z) - log(max(softmax(z))), since the largest probability is
    1 / sum(exp(z - max(z))) and never below 1/V, so its log cannot underflow; loss = lse -
    z[label]. The backward is (softmax(z) - one_hot(label)) * dloss, the softmax recomputed
    (the plain form keeps log_softmax's [n, V] output, this one the logits) and the one-hot a
    scatter-add of -dloss. On this CPU 2.7x faster than log_softmax's kernels (Megatron's
    cross-entropy loss fusion, --cross-entropy-loss-fusion;
    model_config.cross_entropy_loss_fusion)."""

    def construct(self, logits, labels):
        probs = ops.softmax(logits, -1)                                      # [n, V]
        lse = logits.max(axis=-1) - ops.log(probs.max(axis=-1))              # [n]
        return lse - ops.gather_elements(logits, 1, labels.reshape(-1, 1)).reshape(-1)

    def bprop(self, logits, labels, out, dout):
        return CrossEntropy.backward(logits, labels, dout)

    @staticmethod
    def backward(logits, labels, dout):
        d_loss = dout.reshape(-1, 1)                                         # [n, 1]
        d_logits = ops.softmax(logits, -1) * d_loss                          # [n, V]
        d_logits = ops.tensor_scatter_elements(d_logits, labels.reshape(-1, 1), -d_loss, axis=1,
                                               reduction="add")
        return d_logits, ops.zeros_like(labels)


def bias_dropout_add(y, bias, residual, dropout, bias_add):
    """residual + dropout(y + bias), y [s, b, h] the reduced output of a row-parallel linear
    that skipped its bias (skip_bias_add), added once here: gpt.TransformerLayer's
    `x + dropout(linear_proj(...))` (Megatron's bias_dropout_add, --no-bias-dropout-fusion;
    model_config.bias_dropout_fusion). Plain ops, no custom backward: it ends a layer, and a
    custom-bprop Cell there breaks MindSpore 2.10's recompute. `bias_add` is the layer's own
    parallel.BiasAdd."""
    y = bias_add(y.reshape(-1, y.shape[-1]), cast(bias, y.dtype)).reshape(y.shape)
    return residual + cast(dropout(y), residual.dtype)


if __name__ == "__main__":          # imported by gpt.py, not a script
    raise SystemExit("error: fused.py is a library: run `bash run.sh` (bash run.sh --help "
                     "lists the commands)")
