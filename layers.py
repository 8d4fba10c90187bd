"""The layers of one rank, what the model is built with (gpt.py, moe.py) and what tensor
parallelism splits (parallel.py's column- and row-parallel linears hold the same matmul): a
linear and its forms, the cast, the MLP's activations, the attention's masked softmax.
Activations are [s, b, h] (sequence first); a linear's weight is [out, in] (torch's and
Megatron's layout)."""
import numpy as np
from mindspore import Parameter, Tensor, nn, ops


# x [n, in] @ W [out, in]^T, no transpose copy of W: a linear's matmul
_matmul_nt = ops.MatMul(transpose_b=True)
# attention scores q [b, n, s, d] @ k [b, n, t, d]^T -> [b, n, s, t], no transpose copy of k
# (gpt.CoreAttention and context_parallel.attention_block)
batch_matmul_nt = ops.BatchMatMul(transpose_b=True)


def cast(t, dtype):
    """t in `dtype`; astype only when needed: a same-dtype cast still copies."""
    return t if t is None or t.dtype == dtype else t.astype(dtype)


def linear(x, weight, bias=None, matmul=_matmul_nt, bias_add=ops.bias_add):
    """x [..., in] -> [..., out] = x W^T + b, as a 2-D `matmul` [n, in] x [out, in] -> [n, out]
    and a `bias_add` [n, out] + [out] (a linear's own, see plain_forms); x, W and b in one dtype
    (under half precision the forms cast them first: fused.in_compute_dtype)."""
    y = matmul(x.reshape(-1, x.shape[-1]), weight)                               # [n, out]
    if bias is not None:
        y = bias_add(y, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def plain_forms():
    """A linear's (matmul, bias_add): x [n, in] @ W [out, in]^T and y [n, out] + b [out] with
    autodiff's backward; the linears' `forms` unless given (fused.fast_linear_forms gives this
    CPU's fast ones; the layer spec, gpt.layer_spec, chooses)."""
    return ops.MatMul(transpose_b=True), ops.bias_add


# GPT-2's gelu_new, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (Hendrycks & Gimpel 2016)
GELU_TANH_K = 0.7978845608028654        # sqrt(2 / pi)
GELU_TANH_C = 0.044715


def gelu_tanh(x):
    """GPT-2's gelu_new written out: on CPU these elementwise ops and their gradients are faster
    than the GeLU kernel's."""
    return 0.5 * x * (1.0 + ops.tanh(GELU_TANH_K * (x + GELU_TANH_C * x * x * x)))


def activation(y, act):
    """An MLP's activation of fc1's output y (gpt.MLP and moe.py's experts): "swiglu" on its
    [gate; up] halves (Shazeer 2020; each TP shard holds its halves' slices), "gelu_tanh" or the
    exact "gelu"."""
    if act == "swiglu":
        gate, up = ops.chunk(y, 2, axis=-1)
        return ops.silu(gate) * up
    if act == "gelu_tanh":
        return gelu_tanh(y)
    return ops.gelu(y, approximate="none")


def scaled_masked_softmax(scores, mask_bias, scale):
    """softmax(scores * scale + mask_bias) over the last dim (the core attention's): scores
    [b, n, s, t] in the softmax's dtype, mask_bias broadcasting to it (0 or -1e30), `scale`
    query-key layer scaling's layer number (1 without it)."""
    if scale != 1.0:
        scores = scores * scale
    return ops.softmax(scores + cast(mask_bias, scores.dtype), -1)


class Linear(nn.Cell):
    """y = x W^T + b with W [out, in], the layout of torch and Megatron: the linear of one TP
    rank. skip_bias_add (Megatron's): (y without the bias, the bias or None), for what follows
    to add it. `forms`: its (matmul, bias_add), plain_forms' unless given. Without `own_weight`
    (Megatron's skip_weight_param_allocation) it is called with the weight to use. `chunks`:
    the blocks of the output (fc1's [gate; up]) that a split over TP keeps whole
    (parallel.ColumnParallelLinear's, which a layer spec puts in its place); one rank keeps
    the output whole."""

    def __init__(self, in_features, out_features, bias=True, skip_bias_add=False, forms=None,
                 own_weight=True, chunks=1):
        super().__init__()
        self.weight = zero_param((out_features, in_features), "weight") if own_weight else None
        self.bias = zero_param((out_features,), "bias") if bias else None
        self.skip_bias_add = skip_bias_add
        self.matmul, self.bias_add = forms or plain_forms()

    def construct(self, x, weight=None):
        """x [..., in] -> [..., out]"""
        weight = self.weight if weight is None else weight
        if self.skip_bias_add:
            return linear(x, weight, None, self.matmul), self.bias
        return linear(x, weight, self.bias, self.matmul, self.bias_add)


def zero_param(shape, name, partition_dim=None, chunks=1):
    """A float32 Parameter [shape] of zeros (init_weights fills it); a tensor-parallel one marked
    with the dim it is split along and its blocks (parallel.shard)."""
    param = Parameter(Tensor(np.zeros(shape, np.float32)), name=name)
    if partition_dim is not None:
        param.partition_dim, param.partition_chunks = partition_dim, chunks
    return param


if __name__ == "__main__":          # imported by the model, not a script
    raise SystemExit("error: layers.py is a library: run `bash run.sh` (bash run.sh --help "
                     "lists the commands)")
