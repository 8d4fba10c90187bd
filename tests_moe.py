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
    """Output of f(x) (x's shape) and the gradients of sum(f(x) * probe) for x and every
    parameter of `cell`, by name, as numpy."""
    names, params = zip(*cell.parameters_and_names())
    probe = random(x.shape, 99)

    def loss(x):
        y = f(x)
        return (y * probe).sum(), y

    (_, y), (dx, dw) = ms.value_and_grad(loss, 0, list(params), has_aux=True)(x)
    return {"output": y.asnumpy(), "input": dx.asnumpy(),
            **{n: g.asnumpy() for n, g in zip(names, dw)}}


def assert_same(a, b, tol=1e-6):
    """Equal to `tol` of each array's largest magnitude (fp32 sums in another order)."""
    assert a.keys() == b.keys()
    for key in a:
        scale = max(1.0, float(np.abs(b[key]).max()))
        np.testing.assert_allclose(a[key], b[key], rtol=0, atol=tol * scale, err_msg=key)


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
    np.testing.assert_allclose(probs.asnumpy(), want_probs, rtol=1e-5, atol=1e-7)
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


# ============================================================================ losses
@pytest.fixture(autouse=True)
def unit_aux_loss_scale():
    """Megatron's default scale, 1, in every test (the scale is one for the process)."""
    moe.MoEAuxLossAutoScaler.set_loss_scale(1.0)
    yield
    moe.MoEAuxLossAutoScaler.set_loss_scale(1.0)


def loss_router(kind, score_function="softmax", aux=0.5, z=0.1, seed=0):
    """A router with large coefficients, so that the losses' gradients show in comparisons."""
    cfg = moe_config(moe_router_load_balancing_type=kind, moe_aux_loss_coeff=aux,
                     moe_z_loss_coeff=z, moe_router_score_function=score_function,
                     add_bias_linear=True)
    router = fill(moe.TopKRouter(cfg), seed)
    router.set_train(True)
    return router, cfg


def np_losses(router, x, kind, score_function):
    """(aux / coeff, z / coeff) by hand: Switch's E * sum_e f_e P_e (per sequence, then the
    mean over sequences, for seq_aux_loss) and ST-MoE's mean of logsumexp^2."""
    s, b, h = x.shape
    e, k = router.num_experts, router.topk
    logits = (x.reshape(s * b, h) @ router.weight.asnumpy().T + router.bias.asnumpy())
    top = logits.max(-1, keepdims=True)
    z = np.mean((top[:, 0] + np.log(np.exp(logits - top).sum(-1))) ** 2)
    if score_function == "softmax":
        scores = np_softmax(logits)
    else:
        scores = 1 / (1 + np.exp(-logits))
        scores = scores / scores.sum(-1, keepdims=True)
    routed = np.zeros_like(scores)
    routed[np.arange(s * b)[:, None], np.argsort(-scores, -1)[:, :k]] = 1
    scores, routed = scores.reshape(s, b, e), routed.reshape(s, b, e)
    if kind == "seq_aux_loss":
        per_sequence = [e / (k * s * s) * (scores[:, j].sum(0) * routed[:, j].sum(0)).sum()
                        for j in range(b)]
        return np.mean(per_sequence), z
    n = s * b
    return e / (k * n * n) * (scores.sum((0, 1)) * routed.sum((0, 1))).sum(), z


def record_losses(router, x):
    """One forward with a backward recorded; the values the router logged, by name."""
    ms.grad(lambda x: router(x)[0].sum())(x)
    logged = router.metrics[0].asnumpy()
    router.metrics[0].set_data(ops.zeros(3, F32))
    return dict(zip(moe.METRICS, logged))


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss"])
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_logged_aux_and_z_losses_equal_a_hand_computation(kind, score_function):
    router, _ = loss_router(kind, score_function)
    x = random((5, 3, 8), 3)
    aux, z = np_losses(router, x.asnumpy(), kind, score_function)
    logged = record_losses(router, x)
    name = "load_balancing_loss" if kind == "aux_loss" else "seq_load_balancing_loss"
    np.testing.assert_allclose(logged[name], aux, rtol=1e-5)
    np.testing.assert_allclose(logged["z_loss"], z, rtol=1e-5)
    assert sum(logged.values()) == pytest.approx(aux + z, rel=1e-5)     # nothing else logged
    assert router.metric_names == (name, "z_loss")


def test_a_balanced_router_has_aux_loss_1():
    """Zero weights: equal scores, and the top-2 ties go to experts 0 and 1 for every token;
    f = (1/2, 1/2, 0, 0), P = 1/4 each: E * sum f P = 4 * (1/8 + 1/8) = 1."""
    router, _ = loss_router("aux_loss", z=None)
    router.weight.set_data(ops.zeros_like(router.weight))
    router.bias.set_data(ops.zeros_like(router.bias))
    assert record_losses(router, random((4, 2, 8), 4))["load_balancing_loss"] == \
        pytest.approx(1.0, rel=1e-6)


def ms_losses(router, x, cfg):
    """coeff * aux + coeff * z written out in MindSpore ops, for autodiff."""
    s, b, h = x.shape
    e, k = cfg.num_moe_experts, cfg.moe_router_topk
    logits = ops.matmul(x.reshape(s * b, h), router.weight.T) + router.bias
    z = cfg.moe_z_loss_coeff * (ops.logsumexp(logits, -1) ** 2).mean()
    scores = ops.softmax(logits, -1)
    if cfg.moe_router_score_function == "sigmoid":
        scores = ops.sigmoid(logits) / ops.sigmoid(logits).sum(-1, keepdims=True)
    routed = ops.stop_gradient(ops.one_hot(ops.topk(scores, k)[1], e, 1.0, 0.0).sum(1))
    if cfg.moe_router_load_balancing_type == "seq_aux_loss":
        scores, routed = scores.reshape(s, b, e), routed.reshape(s, b, e)
        aux = (scores.sum(0) * routed.sum(0)).sum(-1).mean() * e / (k * s * s)
    else:
        aux = (scores.sum(0) * routed.sum(0)).sum() * e / (k * s * b * s * b)
    return cfg.moe_aux_loss_coeff * aux + z


@pytest.mark.parametrize("kind, score_function", [("aux_loss", "softmax"),
                                                  ("seq_aux_loss", "sigmoid"),
                                                  ("aux_loss", "sigmoid")])
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_injected_gradients_equal_autodiff_of_loss_plus_scaled_aux_and_z(kind, score_function,
                                                                          scale):
    """Megatron's MoEAuxLossAutoScaler: the backward of the main loss alone equals autodiff of
    main + scale * (coeff aux + coeff z), for the router's weights and its input."""
    router, cfg = loss_router(kind, score_function)
    x, probe = random((5, 3, 8), 5), random((15, 4), 6)
    params = router.trainable_params()
    moe.MoEAuxLossAutoScaler.set_loss_scale(scale)
    injected = ms.grad(lambda x: (router(x)[0] * probe).sum(), 0, params)(x)
    router.set_train(False)                                     # no losses attached
    want = ms.grad(lambda x: (router(x)[0] * probe).sum() + scale * ms_losses(router, x, cfg),
                   0, params)(x)
    plain = ms.grad(lambda x: (router(x)[0] * probe).sum(), 0, params)(x)
    for got, expected, main in zip([injected[0], *injected[1]], [want[0], *want[1]],
                                   [plain[0], *plain[1]]):
        np.testing.assert_allclose(got.asnumpy(), expected.asnumpy(), atol=1e-6)
        assert np.abs(got.asnumpy() - main.asnumpy()).max() > 1e-3    # the losses count


class ScaledSquare(ms.nn.Cell):
    """x -> x, with sum(x^2) attached as an auxiliary loss."""

    def __init__(self):
        super().__init__()
        self.scaler = moe.MoEAuxLossAutoScaler()

    def construct(self, x):
        return self.scaler(x, (x * x).sum(), self.scaler.main_loss_backward_scale)


def test_the_scale_set_from_outside_reaches_a_compiled_backward():
    """d/dx sum(scaler(x, sum(x^2))) = 1 + scale * 2x, the scale read at every call of one
    compiled graph (the trainer sets loss_scale / num_microbatches)."""
    compiled = gpt.Compiled(ScaledSquare())
    x = random((3, 4), 7)
    for scale in (1.0, 0.125, 3.0):
        moe.MoEAuxLossAutoScaler.set_loss_scale(scale)
        grad = ms.grad(lambda x: compiled(x).sum())(x)
        np.testing.assert_allclose(grad.asnumpy(), 1 + 2 * scale * x.asnumpy(), rtol=1e-6)


def test_losses_are_computed_only_in_training_with_a_backward():
    router, _ = loss_router("aux_loss")
    x = random((5, 3, 8), 8)
    probs = router(x)[0].asnumpy()                           # no backward recorded
    assert not router.metrics[0].asnumpy().any()
    router.set_train(False)
    assert not any(record_losses(router, x).values())
    router.set_train(True)
    logged = record_losses(router, x)
    assert logged["load_balancing_loss"] > 0 and logged["z_loss"] > 0
    np.testing.assert_array_equal(router(x)[0].asnumpy(), probs)


def test_report_metrics_averages_micro_batches_and_layers():
    """Megatron's report: each name's sum over layers and micro-batches times loss_scale (1/M),
    divided by the MoE layers; then cleared."""
    cfg = dict(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1, add_bias_linear=True)
    layers = [layer_of(seed, **cfg) for seed in (1, 2)]
    batches = [random((4, 2, 8), seed) for seed in (9, 10)]
    for x in batches:
        for layer in layers:
            ms.grad(lambda x: layer(x).sum())(x)
    want = np.sum([np_losses(layer.router, x.asnumpy(), "aux_loss", "softmax")
                   for layer in layers for x in batches], 0) * (1 / 2) / 2
    report = moe.report_metrics(layers, loss_scale=1 / 2, num_moe_layers=2)
    assert report.keys() == {"load_balancing_loss", "z_loss"}
    np.testing.assert_allclose([report["load_balancing_loss"], report["z_loss"]], want, rtol=1e-5)
    assert not any(layer.router.metrics[0].asnumpy().any() for layer in layers)


def test_training_the_router_on_the_aux_loss_evens_the_expert_load():
    """A router whose bias sends every token to experts 0 and 1 (load max/mean = 2), trained on
    the aux loss alone (the main loss' gradient is 0) by SGD: balanced within 50 steps."""
    cfg = moe_config(moe_aux_loss_coeff=1.0, add_bias_linear=True)
    router = fill(moe.TopKRouter(cfg), std=0.2)
    router.bias.set_data(Tensor(np.array([3.0, 3.0, 0.0, 0.0], np.float32)))
    x, params = random((16, 4, 8), 11), router.trainable_params()

    def imbalance():
        router.set_train(False)
        counts = router(x)[1].astype(F32).sum(0)                      # tokens per expert
        router.set_train(True)
        return counts.max() / counts.mean()

    grad = ms.grad(lambda x: router(x)[0].sum() * 0.0, None, params)
    before = imbalance()
    for _ in range(50):
        for p, g in zip(params, grad(x)):
            ops.assign(p, p - 20.0 * g)
    after = imbalance()
    assert float(before) == 2.0 and float(after) < 1.25, (float(before), float(after))


# ============================================================================ experts
@pytest.mark.parametrize("act, bias", [("gelu_tanh", True), ("swiglu", False), ("gelu", True)])
def test_grouped_mlp_equals_sequential_mlp(act, bias):
    """The same parameters (names and values); batched matmuls against a loop of experts."""
    cfg = moe_config(hidden_act=act, add_bias_linear=bias)
    sequential, grouped = fill(moe.SequentialMLP(cfg, 3, 1)), fill(moe.GroupedMLP(cfg, 3, 1))
    assert [n for n, _ in sequential.parameters_and_names()] == \
        [n for n, _ in grouped.parameters_and_names()]
    tokens, probs = random((3, 5, 8), 12), ops.abs(random((3, 5), 13))
    assert_same(run(lambda t: grouped(t, probs), tokens, grouped),
                run(lambda t: sequential(t, probs), tokens, sequential))


def dense_reference(layer, x):
    """Every routed expert on every token, weighted by the router's probs [n, E]:
    sum_e p_e * (fc2(act(fc1 x + b1)) + b2), plus the shared expert, in plain ops."""
    s, b, h = x.shape
    tokens, act = x.reshape(s * b, h), layer.experts.act
    probs, _ = layer.router(x)
    out = 0.0
    for e, expert in enumerate(layer.experts.local_experts):
        fc1, fc2 = expert.linear_fc1, expert.linear_fc2
        y = moe.apply_activation(parallel.linear(tokens, fc1.weight, fc1.bias), act)
        out = out + probs[:, e:e + 1] * parallel.linear(y, fc2.weight, fc2.bias)
    out = out.reshape(s, b, h)
    shared = layer.shared_experts
    if shared is not None:
        y = moe.apply_activation(ops.matmul(x, shared.linear_fc1.weight.T), act)
        y = ops.matmul(y, shared.linear_fc2.weight.T)
        if shared.gate_weight is not None:
            y = y * ops.sigmoid(ops.matmul(x, shared.gate_weight.T))
        out = out + y
    return out


def np_layer(layer, x):
    """The dropless layer in numpy with its own router (gelu_tanh or swiglu experts)."""
    s, b, h = x.shape
    tokens = x.reshape(s * b, h)
    cfg = layer.router
    probs, _ = np_route(tokens @ cfg.weight.asnumpy().T, cfg.topk, cfg.score_function,
                        cfg.pre_softmax, cfg.scaling_factor)
    out = np.zeros_like(tokens)
    for e, expert in enumerate(layer.experts.local_experts):
        y = tokens @ expert.linear_fc1.weight.asnumpy().T
        if layer.experts.act == "swiglu":
            gate, up = np.split(y, 2, -1)
            y = gate / (1 + np.exp(-gate)) * up
        else:
            y = 0.5 * y * (1 + np.tanh(0.7978845608028654 * (y + 0.044715 * y ** 3)))
        out += probs[:, e:e + 1] * (y @ expert.linear_fc2.weight.asnumpy().T)
    return out.reshape(s, b, h)


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("act, bias", [("gelu_tanh", True), ("swiglu", False)])
def test_dropless_layer_equals_every_expert_on_every_token(dispatcher, grouped, act, bias):
    layer = layer_of(moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=grouped,
                     hidden_act=act, add_bias_linear=bias)
    x = random((6, 2, 8), 14)
    got = run(layer, x, layer)
    assert_same(got, run(lambda x: dense_reference(layer, x), x, layer))
    if not bias:
        np.testing.assert_allclose(got["output"], np_layer(layer, x.asnumpy()), rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
def test_capacity_layer_equals_the_dense_reference_of_the_kept_tokens(dispatcher, policy, pad):
    """Capacity factor 0.5: C = ceil(12 * 2 / 4 * 0.5) = 3 slots per expert for 24 routings."""
    layer = layer_of(moe_token_dispatcher_type=dispatcher, moe_expert_capacity_factor=0.5,
                     moe_token_drop_policy=policy, moe_pad_expert_input_to_capacity=pad)
    x = random((6, 2, 8), 15)
    probs, routing_map = layer.router(x)
    assert (probs.asnumpy() > 0).sum() < 24                        # tokens were dropped
    np.testing.assert_array_equal(routing_map.asnumpy().sum(0), 3 if pad else
                                  np.minimum(routing_map.asnumpy().sum(0), 3))
    assert_same(run(layer, x, layer), run(lambda x: dense_reference(layer, x), x, layer))


@pytest.mark.parametrize("gate", [False, True])
def test_shared_expert_adds_a_dense_mlp_on_every_token(gate):
    layer = layer_of(moe_shared_expert_intermediate_size=12, moe_shared_expert_gate=gate,
                     hidden_act="swiglu")
    x = random((6, 2, 8), 16)
    got = run(layer, x, layer)
    assert_same(got, run(lambda x: dense_reference(layer, x), x, layer))
    routed = layer_of(hidden_act="swiglu")                   # the same routed experts
    assert np.abs(got["output"] - routed(x).asnumpy()).max() > 1e-2


def test_both_dispatchers_and_explicit_one_rank_groups_give_the_same_layer():
    """allgather and alltoall (built with an expert-parallel group of one rank, EP carved from
    DP) compute the same layer, losses included."""
    state = parallel.get_state()
    cfg = dict(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1, moe_expert_capacity_factor=1.0,
               moe_token_drop_policy="position")
    plain = layer_of(**cfg)
    alltoall = fill(moe.MoELayer(moe_config(moe_token_dispatcher_type="alltoall", **cfg),
                                 ep_group=state.dp_group, tp_ep_group=state.tp_group,
                                 tp_cp_group=state.tp_group))
    alltoall.set_train(True)
    assert alltoall.token_dispatcher.exchange is not None
    x = random((6, 2, 8), 17)
    assert_same(run(alltoall, x, alltoall), run(plain, x, plain))


@pytest.mark.parametrize("dispatcher, capacity", [("allgather", None), ("alltoall", 0.75)])
def test_compiled_layer_equals_op_by_op(dispatcher, capacity):
    """The whole layer in one ms.jit graph (gpt.Compiled): output, every gradient (aux and z
    injected) and the logged losses as op by op; evaluation compiles without the losses."""
    layer = layer_of(moe_token_dispatcher_type=dispatcher, moe_expert_capacity_factor=capacity,
                     moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1,
                     moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True)
    compiled, x = gpt.Compiled(layer), random((6, 2, 8), 18)
    eager = run(layer, x, layer)
    logged = moe.report_metrics([layer], 1.0, 1)
    assert_same(run(compiled, x, layer), eager)
    assert moe.report_metrics([layer], 1.0, 1) == pytest.approx(logged, rel=1e-6)
    layer.set_train(False)
    np.testing.assert_allclose(compiled(x).asnumpy(), layer(x).asnumpy(), rtol=1e-6, atol=1e-7)
    assert not layer.router.metrics[0].asnumpy().any()


def test_parameter_names_and_attributes():
    """Megatron's module names; expert parameters marked allreduce=False and split like the TP
    layers (fc1 by rows in [gate; up] blocks, fc2 by columns); the logged sums and the shared
    scale are no parameters of the layer."""
    layer = moe.MoELayer(moe_config(num_moe_experts=2, hidden_act="swiglu",
                                    moe_shared_expert_intermediate_size=8,
                                    moe_shared_expert_gate=True))
    params = dict(layer.parameters_and_names())
    expert = [f"experts.local_experts.{j}.linear_fc{i}.weight" for j in (0, 1) for i in (1, 2)]
    assert list(params) == ["router.weight"] + expert + [
        "shared_experts.gate_weight", "shared_experts.linear_fc1.weight",
        "shared_experts.linear_fc2.weight"]
    assert params[expert[0]].shape == (24, 8) and params[expert[1]].shape == (8, 12)
    for name in expert:
        p = params[name]
        assert p.allreduce is False and p.partition_dim == (0 if "fc1" in name else 1)
    assert params[expert[0]].partition_chunks == 2
    assert not hasattr(params["router.weight"], "allreduce")
    assert len(list(layer.get_parameters())) == len(params)         # not the logged sums
    assert moe.global_expert_name("layers.3.mlp.experts.local_experts.1.linear_fc1.weight", 2, 4) \
        == "layers.3.mlp.experts.local_experts.9.linear_fc1.weight"
