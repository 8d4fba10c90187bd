"""Tests of moe.py (Megatron-core's MoE layer), one process, CPU, fp32: `pytest tests_moe.py`.

  router      probs and routing map against numpy (softmax, pre-softmax, sigmoid, top-k scaling),
              capacity and both drop policies on a hand example, the refused settings
  losses      aux_loss, seq_aux_loss and z-loss values by hand; their injected gradients against
              autodiff of loss + scale * (aux + z); the scale set from outside a compiled graph;
              the logged values and their report; training the router on the aux loss evens
              the expert load
  experts     SequentialMLP == GroupedMLP; the dropless layer == every expert on every token
              weighted by the routing probs; capacity; shared experts; both dispatchers equal;
              the layer compiled by ms.jit == op by op; names and attributes
"""
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, ops

import gpt
import moe
import parallel
import train

train.setup_mindspore()        # CPU, threads, ops launched in this thread (before any op runs)
F32 = ms.float32


def moe_config(**overrides):
    """A small MoE model config: h 8, E 4, top-2, expert FFN 12, no losses, allgather."""
    cfg = dict(hidden_size=8, ffn_hidden_size=16, hidden_act="gelu_tanh", add_bias_linear=False,
               compute_dtype="float32", num_moe_experts=4, moe_ffn_hidden_size=12,
               moe_router_topk=2, moe_router_score_function="softmax", moe_router_pre_softmax=False,
               moe_router_topk_scaling_factor=None, moe_router_dtype=None,
               moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0,
               moe_z_loss_coeff=None, moe_expert_capacity_factor=None,
               moe_pad_expert_input_to_capacity=False, moe_token_drop_policy="probs",
               moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
               moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False)
    cfg.update(overrides)
    return SimpleNamespace(**cfg)


def fill(cell, seed=0, std=0.5):
    """Every parameter normal(0, std) from a stream keyed by (seed, name): cells with the same
    names get the same values."""
    for name, p in cell.parameters_and_names():
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        p.set_data(Tensor(rng.normal(0.0, std, p.shape).astype(np.float32)))
    return cell


def random(shape, seed):
    return Tensor(np.random.default_rng(seed).normal(size=shape).astype(np.float32))


def layer_of(seed=0, **overrides):
    layer = fill(moe.MoELayer(moe_config(**overrides)), seed)
    layer.set_train(True)
    return layer


def run(f, x, cell):
    """Output of f(x) and the gradients of sum(f(x) * probe) for x and every parameter of
    `cell`, by name, as numpy."""
    names, params = zip(*cell.parameters_and_names())
    probe = random(f(x).shape, 99)

    def loss(x):
        y = f(x)
        return (y * probe).sum(), y

    (_, y), (dx, dw) = ms.value_and_grad(loss, 0, list(params), has_aux=True)(x)
    return {"output": y.asnumpy(), "input": dx.asnumpy(),
            **{n: g.asnumpy() for n, g in zip(names, dw)}}


def assert_same(a, b, atol=1e-6, rtol=1e-5):
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=rtol, atol=atol, err_msg=key)


# ============================================================================ router
def np_softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_route(logits, k, score_function, pre_softmax, scaling_factor):
    """Megatron's topk_routing_with_score_function in numpy -> (probs [n, E], map [n, E])."""
    rows = np.arange(len(logits))[:, None]
    if score_function == "sigmoid":
        scores = 1 / (1 + np.exp(-logits))
        top = np.argsort(-scores, -1)[:, :k]
        probs = scores[rows, top]
        probs = probs / (probs.sum(-1, keepdims=True) + 1e-20) if k > 1 else probs
    elif pre_softmax:
        scores = np_softmax(logits)
        top = np.argsort(-scores, -1)[:, :k]
        probs = scores[rows, top]
    else:
        top = np.argsort(-logits, -1)[:, :k]
        probs = np_softmax(logits[rows, top])
    dense, routing_map = np.zeros_like(logits), np.zeros(logits.shape, bool)
    dense[rows, top], routing_map[rows, top] = probs * (scaling_factor or 1.0), True
    return dense, routing_map


@pytest.mark.parametrize("score_function, pre_softmax, k, scaling_factor", [
    ("softmax", False, 2, None), ("softmax", True, 2, None), ("softmax", True, 1, None),
    ("sigmoid", False, 2, None), ("sigmoid", False, 1, None), ("softmax", False, 3, 2.5),
    ("softmax", True, 2, 1.5), ("sigmoid", False, 2, 0.5)])
def test_router_probs_and_routing_map_equal_numpy(score_function, pre_softmax, k, scaling_factor):
    cfg = moe_config(moe_router_score_function=score_function, moe_router_pre_softmax=pre_softmax,
                     moe_router_topk=k, moe_router_topk_scaling_factor=scaling_factor,
                     add_bias_linear=True)
    router = fill(moe.TopKRouter(cfg))
    x = random((6, 3, 8), 1)
    probs, routing_map = router(x)
    logits = x.asnumpy().reshape(18, 8) @ router.weight.asnumpy().T + router.bias.asnumpy()
    want_probs, want_map = np_route(logits, k, score_function, pre_softmax, scaling_factor)
    np.testing.assert_allclose(probs.asnumpy(), want_probs, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(routing_map.asnumpy(), want_map)


def hand_router(policy, pad):
    """3 experts, top-1 pre-softmax, capacity factor 1 over 6 tokens: C = ceil(6/3) = 2. With
    h = E and W = I the logits are the tokens. Expert 0 gets tokens 0, 1, 2, 4 (probabilities
    in the order 1 > 2 > 0 > 4), expert 1 token 3, expert 2 token 5."""
    cfg = moe_config(hidden_size=3, num_moe_experts=3, moe_router_topk=1,
                     moe_router_pre_softmax=True, moe_expert_capacity_factor=1.0,
                     moe_token_drop_policy=policy, moe_pad_expert_input_to_capacity=pad)
    router = moe.TopKRouter(cfg)
    router.weight.set_data(Tensor(np.eye(3, dtype=np.float32)))
    logits = np.array([[2, 0, 0], [4, 0, 0], [3, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 1.5]],
                      np.float32)
    probs, routing_map = router(Tensor(logits.reshape(6, 1, 3)))
    return np_softmax(logits), probs.asnumpy(), routing_map.asnumpy()


@pytest.mark.parametrize("policy, kept", [("probs", [1, 2]), ("position", [0, 1])])
def test_capacity_drops_the_lowest_probabilities_or_the_latest_tokens(policy, kept):
    scores, probs, routing_map = hand_router(policy, pad=False)
    want_map = np.zeros((6, 3), bool)
    want_map[kept, 0], want_map[3, 1], want_map[5, 2] = True, True, True
    np.testing.assert_array_equal(routing_map, want_map)
    np.testing.assert_allclose(probs, scores * want_map, rtol=1e-6)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_padding_to_capacity_gives_every_expert_capacity_tokens_with_probability_0(policy):
    scores, probs, routing_map = hand_router(policy, pad=True)
    _, unpadded_probs, unpadded_map = hand_router(policy, pad=False)
    np.testing.assert_array_equal(routing_map.sum(0), [2, 2, 2])
    assert (routing_map | ~unpadded_map).all()           # the kept tokens stay
    np.testing.assert_allclose(probs, unpadded_probs)
    if policy == "position":                             # padded with the earliest other tokens
        np.testing.assert_array_equal(np.nonzero(routing_map[:, 1])[0], [0, 3])
        np.testing.assert_array_equal(np.nonzero(routing_map[:, 2])[0], [0, 5])


def test_capacity_above_the_token_count_drops_nothing():
    cfg = moe_config(moe_expert_capacity_factor=4.0)      # C = ceil(12 * 2 / 4 * 4) = 24 > 12
    router, plain = fill(moe.TopKRouter(cfg)), fill(moe.TopKRouter(moe_config()))
    x = random((6, 2, 8), 2)
    for got, want in zip(router(x), plain(x)):
        np.testing.assert_array_equal(got.asnumpy(), want.asnumpy())


@pytest.mark.parametrize("overrides", [
    dict(moe_router_topk=1), dict(moe_router_score_function="sqrtsoftplus"),
    dict(moe_router_load_balancing_type="sinkhorn"), dict(moe_router_dtype="fp64"),
    dict(moe_pad_expert_input_to_capacity=True), dict(moe_token_drop_policy="random"),
    dict(moe_token_dispatcher_type="flex"), dict(moe_shared_expert_intermediate_size=8,
                                                 add_bias_linear=True)])
def test_settings_the_layer_does_not_compute_are_refused(overrides):
    with pytest.raises(ValueError):
        moe.MoELayer(moe_config(**overrides))
