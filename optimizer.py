"""The optimizer step of Megatron-style training: schedules, optimizers, clipping, loss scaling,
the step of mixed-precision training and the distributed optimizer's shards. The data-parallel
reduction that hands it the gradients is distributed.py.

Mirrors megatron/core/optimizer_param_scheduler.py and megatron/core/optimizer/{optimizer,
distrib_optimizer,clip_grads,grad_scaler}.py, written with basic MindSpore ops (PyNative).

The inner optimizers (AdamW, Adam, SGD) update a list of float32 tensors in place with
`Tensor.copy_` (the in-place arithmetic methods such as `mul_` do not write back on CPU in
MindSpore 2.10): Megatron's *main params*. Every entry may be a Parameter (float32 parameters are
their own main params) or a plain Tensor (a float32 copy of a half-precision parameter, or a flat
piece owned by the distributed optimizer). `MixedPrecisionOptimizer.step` is Megatron's
optimizer.step(): prepare_grads (unscale, find inf/nan, update the loss scale), clip_grad_norm,
step_with_ready_grads (update, copy back).
"""

import math

import numpy as np
from mindspore import Tensor, ops

from gpt import is_embedding_copy
from layers import cast
from parallel import F32, collectives, get_state
from settings.config import sharded_by_fsdp
from settings.keys import LR_DECAY_STYLES, WD_INCR_STYLES


# ----------------------------------------------------------------------------- schedules
class OptimizerParamScheduler:
    """Megatron's OptimizerParamScheduler: lr warmup + decay and weight-decay increment.

    `num_steps` counts optimizer iterations. The lr rises linearly from `init_lr` to `max_lr`
    while num_steps <= lr_warmup_steps, then follows `lr_decay_style` down to `min_lr`
    (cosine annealing: Loshchilov & Hutter, SGDR), reaching `min_lr` after lr_decay_steps.
    WSD (warmup, stable, decay) holds max_lr until its last `wsd_decay_steps`, then decays in
    `lr_wsd_decay_style`. The weight decay goes from `start_wd` to `end_wd` over `wd_incr_steps`.
    """

    def __init__(self, max_lr, min_lr, lr_warmup_steps, lr_decay_steps, lr_decay_style,
                 start_wd, end_wd, wd_incr_steps, wd_incr_style, init_lr=0.0,
                 wsd_decay_steps=None, lr_wsd_decay_style="exponential"):
        if lr_decay_style == "WSD" and not wsd_decay_steps:
            raise ValueError("lr_decay_style 'WSD' needs wsd_decay_steps")
        if lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"lr_decay_style must be one of {LR_DECAY_STYLES}, "
                             f"got {lr_decay_style!r}")
        if wd_incr_style not in WD_INCR_STYLES:
            raise ValueError(f"weight_decay_incr_style must be one of {WD_INCR_STYLES}, "
                             f"got {wd_incr_style!r}")
        if not 0.0 <= min_lr <= max_lr or init_lr > max_lr:
            raise ValueError(f"need 0 <= min_lr <= max_lr and init_lr <= max_lr, got "
                             f"min_lr={min_lr}, max_lr={max_lr}, init_lr={init_lr}")
        if not 0 <= lr_warmup_steps < lr_decay_steps:
            raise ValueError(f"need 0 <= lr_warmup_steps < lr_decay_steps, got "
                             f"{lr_warmup_steps} and {lr_decay_steps}")
        if not 0.0 <= start_wd <= end_wd:
            raise ValueError(f"need 0 <= start_wd <= end_wd, got {start_wd} and {end_wd}")
        if wd_incr_style == "constant" and start_wd != end_wd:
            raise ValueError("weight_decay_incr_style 'constant' requires start_wd == end_wd")
        self.init_lr, self.max_lr, self.min_lr = float(init_lr), float(max_lr), float(min_lr)
        self.lr_warmup_steps, self.lr_decay_steps = lr_warmup_steps, lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps, self.lr_wsd_decay_style = wsd_decay_steps, lr_wsd_decay_style
        self.start_wd, self.end_wd = float(start_wd), float(end_wd)
        self.wd_incr_steps, self.wd_incr_style = wd_incr_steps, wd_incr_style
        self.num_steps = 0

    def get_lr(self):
        """Learning rate at `num_steps` (Megatron get_lr)."""
        n = self.num_steps
        if self.lr_warmup_steps > 0 and n <= self.lr_warmup_steps:
            return self.init_lr + (self.max_lr - self.init_lr) * n / self.lr_warmup_steps
        if self.lr_decay_style == "constant":
            return self.max_lr
        if n > self.lr_decay_steps:
            return self.min_lr
        if self.lr_decay_style == "inverse-square-root":
            lr = self.max_lr * max(self.lr_warmup_steps, 1) ** 0.5 / max(n, 1) ** 0.5
            return max(self.min_lr, lr)
        decay_ratio = (n - self.lr_warmup_steps) / (self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "WSD":
            coeff = self._wsd_coeff(n)
        elif self.lr_decay_style == "linear":
            coeff = 1.0 - decay_ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def _wsd_coeff(self, n):
        """WSD's share of (max_lr - min_lr) at step n: 1 until the last wsd_decay_steps, then
        down to 0 in lr_wsd_decay_style (Megatron's)."""
        anneal_start = self.lr_decay_steps - self.wsd_decay_steps
        if n <= anneal_start:
            return 1.0
        ratio = (n - anneal_start) / self.wsd_decay_steps
        return {"linear": 1.0 - ratio, "cosine": 0.5 * (math.cos(math.pi * ratio) + 1.0),
                "exponential": 2.0 * math.pow(0.5, ratio) - 1.0,
                "minus_sqrt": 1.0 - math.sqrt(ratio)}[self.lr_wsd_decay_style]

    def get_wd(self):
        """Weight decay at `num_steps` (Megatron get_wd)."""
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = self.num_steps / self.wd_incr_steps
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def step(self, increment=1):
        self.num_steps += increment

    def state_dict(self):
        return {k: getattr(self, k) for k in (
            "max_lr", "min_lr", "init_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style",
            "wsd_decay_steps", "lr_wsd_decay_style", "start_wd", "end_wd", "wd_incr_steps",
            "wd_incr_style", "num_steps")}

    def differences(self, d):
        """[(key, checkpoint value, this run's)] of the schedule's values (not the step count)."""
        return [(k, v, getattr(self, k)) for k, v in d.items()
                if k != "num_steps" and v != getattr(self, k)]

    def load_state_dict(self, d, override=False):
        """The step count is the checkpoint's; the schedule's values (lr, warmup, decay, weight
        decay) are the checkpoint's, or this run's with `override` (Megatron's
        --override-opt_param-scheduler)."""
        for k, v in d.items():
            if k == "num_steps" or not override:
                setattr(self, k, v)


# ----------------------------------------------------------------------------- optimizers
def no_weight_decay(name, shape):
    """Megatron's parameter groups (get_param_groups): biases and 1-D parameters (norm weights)
    get no weight decay."""
    return name.endswith("bias") or len(shape) == 1


class _Optimizer:
    """Shared bookkeeping: params, per-entry weight-decay multipliers, named state tensors."""

    state_names = ()

    def __init__(self, params, wd_mults=None):
        self.params = list(params)
        if wd_mults is None:
            wd_mults = [1.0] * len(self.params)
        self.wd_mults = [float(mult) for mult in wd_mults]
        if len(self.wd_mults) != len(self.params):
            raise ValueError(f"wd_mults has {len(self.wd_mults)} entries for "
                             f"{len(self.params)} params")
        self.step_count = 0
        self.state = {name: [ops.zeros(param.shape, F32) for param in self.params]
                      for name in self.state_names}

    def state_dict(self):
        d = {"step": self.step_count}
        for name, tensors in self.state.items():
            d.update({f"{name}.{i}": t.asnumpy() for i, t in enumerate(tensors)})
        return d

    def load_state_dict(self, d):
        self.step_count = int(d["step"])
        for name, tensors in self.state.items():
            for i, t in enumerate(tensors):
                t.copy_(Tensor(np.asarray(d[f"{name}.{i}"], dtype=np.float32)))


class AdamW(_Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter), = torch AdamW / apex
    FusedAdam(adam_w_mode)."""

    state_names = ("exp_avg", "exp_avg_sq")
    decoupled = True

    def __init__(self, params, betas=(0.9, 0.999), eps=1e-8, wd_mults=None, fused=True):
        super().__init__(params, wd_mults)
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.fused = fused                  # False: the written-out formula (adam_update)

    def step(self, grads, lr, wd):
        """Decoupled decay p *= 1 - lr*wd (AdamW) or g += wd*p (Adam), then MindSpore's fused
        in-place Adam kernel, 40x faster on CPU than the ~15 elementwise ops it replaces. The kernel
        computes lr*sqrt(1-b2^t)/(1-b1^t) * m / (sqrt(v) + eps'); with eps' = eps*sqrt(1-b2^t) that
        is exactly torch's lr * m_hat / (sqrt(v_hat) + eps)."""
        self.step_count += 1
        b1, b2, t = self.beta1, self.beta2, self.step_count
        f32 = lambda x: Tensor(x, F32)                                   # noqa: E731
        args = (f32(b1 ** t), f32(b2 ** t), f32(lr), f32(b1), f32(b2),
                f32(self.eps * math.sqrt(1 - b2 ** t)))
        for param, g, m, v, mult in zip(self.params, grads, self.state["exp_avg"],
                                        self.state["exp_avg_sq"], self.wd_mults):
            decay = wd * mult
            if decay and self.decoupled:
                param.copy_(param * (1 - lr * decay))
            elif decay:
                g = g + param * decay                                  # classic L2 penalty
            if self.fused:
                _fused_adam(param, m, v, *args, g)
            else:
                adam_update(param, g, m, v, t, lr, b1, b2, self.eps)


_fused_adam = ops.Adam()            # updates (param, m, v) in place


def adam_update(p, g, m, v, t, lr, beta1, beta2, eps):
    """The Adam update of step t written out (Kingma & Ba 2015; torch.optim.Adam), in place:
        m = b1 m + (1 - b1) g,   v = b2 v + (1 - b2) g^2,
        p = p - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps).
    The fused kernel of AdamW.step computes the same in one pass; the tests hold them equal."""
    m.copy_(m * beta1 + g * (1 - beta1))
    v.copy_(v * beta2 + g * g * (1 - beta2))
    p.copy_(p - (m / (1 - beta1 ** t)) * lr / (ops.sqrt(v / (1 - beta2 ** t)) + eps))


class Adam(AdamW):
    """Adam (Kingma & Ba) with weight decay as an L2 term added to the gradient."""

    decoupled = False


class SGD(_Optimizer):
    """SGD with heavy-ball momentum and L2 weight decay, torch.optim.SGD semantics."""

    def __init__(self, params, momentum=0.0, wd_mults=None):
        self.state_names = ("momentum_buffer",) if momentum else ()
        super().__init__(params, wd_mults)
        self.momentum = momentum

    def step(self, grads, lr, wd):
        bufs = self.state.get("momentum_buffer", [None] * len(self.params))
        for param, g, buf, mult in zip(self.params, grads, bufs, self.wd_mults):
            if wd * mult:
                g = g + param * (wd * mult)
            if buf is not None:
                buf.copy_(g if self.step_count == 0 else buf * self.momentum + g)
                g = buf
            param.copy_(param - g * lr)
        self.step_count += 1


OPTIMIZERS = {"AdamW": AdamW, "Adam": Adam, "SGD": SGD}


def base_optimizer(optimizer_type, params, betas=(0.9, 0.999), eps=1e-8, momentum=0.0,
                   wd_mults=None):
    """Megatron's --optimizer switch: the optimizer that updates the main params."""
    if optimizer_type not in OPTIMIZERS:
        raise ValueError(f"optimizer_type must be one of {tuple(OPTIMIZERS)}, "
                         f"got {optimizer_type!r}")
    if optimizer_type == "SGD":
        return SGD(params, momentum=momentum, wd_mults=wd_mults)
    return OPTIMIZERS[optimizer_type](params, betas=betas, eps=eps, wd_mults=wd_mults)


# ----------------------------------------------------------------------------- clipping
def grad_norm_sq(grads):
    """Local sum of squares (Megatron get_grad_norm_fp32 before its all-reduce), as a float:
    each gradient's as the MatMul g[1, n] @ g[n, 1], op by op (Megatron's multi_tensor_l2norm
    is one kernel for all the tensors): faster here than (g * g).sum(), and not compiled, whose
    compilation costs every run more at its first step than it saves (docs/performance.md)."""
    if not grads:
        return 0.0
    squares = [ops.matmul(g.reshape(1, -1), g.reshape(-1, 1)).reshape(()) for g in grads]
    return float(ops.addn(squares).asnumpy())


def clip_grads_by_global_norm(grads, max_norm, total_norm):
    """Megatron clip_grad_by_total_norm_fp32: scale by max_norm/(total_norm+1e-6) if that is < 1."""
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        return [g * clip_coeff for g in grads]
    return list(grads)


def clip_grad_norm(grads, max_norm):
    """Single-process global-norm clipping (--clip-grad); returns (grads, norm before clipping)."""
    total_norm = math.sqrt(grad_norm_sq(grads))
    return clip_grads_by_global_norm(grads, max_norm, total_norm), total_norm


def clip_grads_by_value(grads, clip_value):
    """Elementwise clamp of every gradient to [-clip_value, clip_value]."""
    return [ops.clamp(g, -clip_value, clip_value) for g in grads]


# ----------------------------------------------------------------------------- loss scaling
class ConstantGradScaler:
    """Static loss scale for fp16 training (Megatron ConstantGradScaler)."""

    def __init__(self, scale):
        if scale <= 0.0:
            raise ValueError(f"loss scale must be > 0, got {scale}")
        self.scale = float(scale)

    @property
    def inv_scale(self):
        return 1.0 / self.scale

    def update(self, found_inf):
        """A constant scale does not move (Megatron's ConstantGradScaler.update)."""

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        """Nothing to restore: the scale comes from the config."""


class DynamicGradScaler(ConstantGradScaler):
    """Dynamic loss scaling (Micikevicius et al., mixed precision; Megatron DynamicGradScaler).

    Multiplies the scale by `backoff_factor` (not below `min_scale`) once `hysteresis`
    overflowing steps have been seen since the last growth, and by `growth_factor` after
    `growth_interval` consecutive clean steps.
    """

    def __init__(self, initial_scale, min_scale, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=1000, hysteresis=2):
        super().__init__(initial_scale)
        if not (0.0 < min_scale <= initial_scale and growth_factor > 1.0
                and 0.0 < backoff_factor < 1.0 and growth_interval > 0 and hysteresis > 0):
            raise ValueError("need 0 < min_scale <= initial_scale, growth_factor > 1, "
                             "0 < backoff_factor < 1, growth_interval > 0, hysteresis > 0")
        self.min_scale = float(min_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    def update(self, found_inf):
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self):
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state_dict):
        self.scale = float(state_dict["scale"])
        self.growth_tracker = state_dict["growth_tracker"]
        self.hysteresis_tracker = state_dict["hysteresis_tracker"]


# ----------------------------------------------------------------------------- the step
class MixedPrecisionOptimizer:
    """Megatron's optimizer step (megatron/core/optimizer/optimizer.py: MixedPrecisionOptimizer,
    with Float16OptimizerWithFloat16Params and FP32Optimizer as its two cases): an inner optimizer
    (`make_optimizer(main_params, wd_mults)`) updates float32 main params, which are the model's
    parameters themselves when those are float32, and float32 copies of them when they are half
    precision (Micikevicius et al. 2018, "Mixed Precision Training": the copies keep the small
    updates that a float16 weight would round away). step(grads, lr, wd) takes the gradients
    distributed.finalize_model_grads reduced and runs Megatron's three phases:
      1. prepare_grads: main grads (float32, divided by the loss scale); inf/nan found through the
         gradient norm's reduction over `norm_groups`; the loss scaler's update; on overflow the
         step ends there, weights and state untouched;
      2. clip_grad_norm: by the global norm (or by value, clip_type GradClipByValue; 0: none);
      3. step_with_ready_grads: the inner update of the main params, then main params -> model
         params.
    `counted[i]`: gradient i counts in the norm (a parameter replicated over TP counts on one rank,
    Megatron's param_is_not_tensor_parallel_duplicate; the tied output layer copy not at all).
    `main_params`: by default one per parameter, the parameter itself if float32, else a float32
    copy; the distributed optimizer gives its own (float32 copies of its pieces), with
    `wd_mults` and `counted` one per main param.
    `cast(t, dtype)` casts one tensor: the cast of the layer spec (gpt.layer_spec), which is
    layers.cast, or its fast form fused.eager_cast when fusions are on."""

    def __init__(self, make_optimizer, params, wd_mults, scaler, clip_type, clip_value,
                 norm_groups, counted, cast=cast, main_params=None):
        self.params, self.cast = list(params), cast
        self.scaler, self.clip_type, self.clip_value = scaler, clip_type, clip_value
        self.norm_groups, self.counted = [g for g in norm_groups if g is not None], list(counted)
        if main_params is None:
            main_params = [cast(param, F32) for param in self.params]
        self.main_params = main_params
        self.inner = make_optimizer(self.main_params, wd_mults)

    @property
    def step_count(self):
        return self.inner.step_count

    def step(self, grads_per_buffer, lr, wd):
        """Megatron's optimizer.step() from the step's reduced gradients as
        distributed.finalize_model_grads returns them, one list per data-parallel buffer: here
        one, this optimizer's (model dtype or float32, still scaled). prepare_grads, then on
        overflow nothing more, else clip_grad_norm and step_with_ready_grads. Returns
        (update_successful, grad_norm): the norm is inf or nan on overflow (the train line shows
        it)."""
        (grads,) = grads_per_buffer                 # one buffer (a ChainedOptimizer: several)
        found_inf, main_grads, grad_norm = self.prepare_grads(grads)
        if found_inf:                               # weights, state and schedule untouched
            return False, grad_norm
        main_grads = self.clip_grad_norm(main_grads, grad_norm)
        return self.step_with_ready_grads(main_grads, lr, wd), grad_norm

    def prepare_grads(self, grads):
        """Megatron's prepare_grads: the main grads (float32, divided by the loss scale), whether
        one holds inf/nan, and the loss scaler's update. found_inf comes through the gradient
        norm's reduction (the squared norm is inf/nan iff some gradient is, or is so large its
        square overflows), so it needs no all-reduce of its own. Returns (found_inf, main grads,
        grad norm)."""
        main_grads = self.main_grads(grads)
        found_inf, grad_norm = found_inf_and_norm(self.global_norm_sq(main_grads), self.scaler)
        return found_inf, main_grads, grad_norm

    def clip_grad_norm(self, main_grads, grad_norm):
        """Megatron's clip_grad_norm with the norm prepare_grads reduced: by the global norm, or
        elementwise with clip_type GradClipByValue; clip_value 0 disables clipping."""
        if self.clip_value and self.clip_type == "ClipGlobalNorm":
            return clip_grads_by_global_norm(main_grads, self.clip_value, grad_norm)
        if self.clip_value:
            return clip_grads_by_value(main_grads, self.clip_value)
        return main_grads

    def step_with_ready_grads(self, main_grads, lr, wd):
        """Megatron's step_with_ready_grads: the inner update of the main params, then main
        params -> model params. Returns True (the update succeeded)."""
        self.inner.step(main_grads, lr, wd)
        self._copy_main_params_to_model_params()
        return True

    def main_grads(self, grads):
        """Reduced gradients in float32, divided by the loss scale: one new tensor each, or none."""
        inv_scale = self.scaler.inv_scale
        grads = [self.cast(g, F32) for g in grads]
        return grads if inv_scale == 1.0 else [g * inv_scale for g in grads]

    def global_norm_sq(self, main_grads):
        """Squared norm of the whole model's gradient: this rank's counted gradients, summed over
        the ranks that hold other parts of the model (`norm_groups`)."""
        mine = [g for g, is_counted in zip(main_grads, self.counted) if is_counted]
        local = Tensor([grad_norm_sq(mine)], F32)
        for group in self.norm_groups:
            local = collectives(group).all_reduce(local)
        return float(local.asnumpy()[0])

    def _copy_main_params_to_model_params(self):
        for param, main in zip(self.params, self.main_params):
            if main is not param:
                param.copy_(main)

    def reload_main_params(self):
        """The main params from the model's parameters (after loading weights)."""
        for param, main in zip(self.params, self.main_params):
            if main is not param:
                main.copy_(param)

    def finish_param_sync(self, params=None):
        """Nothing waits: the step wrote the params (OverlappedParamGatherOptimizer's wait)."""

    def release_params(self, params):
        """Nothing is let go: every rank keeps its whole parameters (ShardedParamOptimizer's)."""


class ChainedOptimizer:
    """Megatron's ChainedOptimizer (megatron/core/optimizer/optimizer.py): with experts, the dense
    parameters' optimizer and the experts' (moe.py), each taking the gradients of its own
    data-parallel buffer (distributed.DistributedDataParallel: DP x CP; the expert-data-parallel
    group) and reducing its norm over the ranks holding other parts (the experts also over EP),
    stepped as one: one gradient norm over both, one loss-scaler update, one clip. `indices[k]`:
    the positions, in the model's parameter order, of optimizer k's parameters; the optimizers
    share one scaler."""

    def __init__(self, optimizers, indices):
        self.optimizers, self.indices = optimizers, indices
        self.scaler, self.cast = optimizers[0].scaler, optimizers[0].cast

    def split(self, items):
        """One per parameter of the model -> one list per optimizer."""
        return [[items[i] for i in positions] for positions in self.indices]

    @property
    def step_count(self):
        return self.optimizers[0].step_count

    def step(self, grads_per_buffer, lr, wd):
        """MixedPrecisionOptimizer.step over the chain, from one list of reduced gradients per
        buffer of the data-parallel reduction (distributed.finalize_model_grads), buffer k's for
        optimizer k: the norm is the square root of the optimizers' squared norms summed."""
        main_grads = [opt.main_grads(gs) for opt, gs in zip(self.optimizers, grads_per_buffer)]
        norm_sq = sum(opt.global_norm_sq(gs) for opt, gs in zip(self.optimizers, main_grads))
        found_inf, grad_norm = found_inf_and_norm(norm_sq, self.scaler)
        if found_inf:
            return False, grad_norm
        for opt, gs in zip(self.optimizers, main_grads):
            opt.step_with_ready_grads(opt.clip_grad_norm(gs, grad_norm), lr, wd)
        return True, grad_norm

    def reload_main_params(self):
        for opt in self.optimizers:
            opt.reload_main_params()

    def finish_param_sync(self, params=None):
        for opt in self.optimizers:
            opt.finish_param_sync(params)

    def release_params(self, params):
        for opt in self.optimizers:
            opt.release_params(params)


def found_inf_and_norm(norm_sq, scaler):
    """(found_inf, gradient norm) from the reduced squared norm, the loss scaler updated: inf/nan
    in any gradient makes the squared norm inf/nan (prepare_grads)."""
    found_inf = not math.isfinite(norm_sq)
    scaler.update(found_inf)
    return found_inf, math.sqrt(norm_sq)


def params_in_pieces(params, buffer, pieces, cast):
    """Each of `pieces` (distributed.ShardPieces of `buffer`, a BucketLayout) cut from its
    parameter, flat, in float32: [end - start] each."""
    out = []
    for piece in pieces:
        offset = buffer.offsets[piece.param]           # where the parameter starts in the buffer
        flat = cast(params[piece.param], F32).reshape(-1)
        out.append(flat[piece.start - offset:piece.end - offset])
    return out


class DistributedOptimizer(MixedPrecisionOptimizer):
    """Megatron's distributed optimizer (ZeRO stage 1, Rajbhandari et al. 2020): each rank of a
    data-parallel group keeps float32 main params and optimizer state for only its shard of
    every bucket of the group's flat gradient buffer (`buffer`: its layout, a
    distributed.BucketLayout).

    It takes this rank's pieces of the gradients, which distributed.finalize_model_grads
    reduce-scattered; step() updates them with the inner optimizer and all-gathers the updated
    shards, in the model's dtype, into every rank's params. The inner optimizer sees one flat
    tensor per (parameter, shard) overlap, a piece (distributed.ShardPiece), so per-parameter
    weight-decay multipliers still apply."""

    def __init__(self, make_optimizer, params, wd_mults, scaler, clip_type, clip_value,
                 norm_groups, counted, buffer, cast=cast):
        pieces = buffer.pieces(buffer.rank)
        main_params = [piece.copy() for piece in params_in_pieces(params, buffer, pieces, cast)]
        # the norm: this rank's pieces, summed over the shards first
        super().__init__(make_optimizer, params, [wd_mults[p.param] for p in pieces], scaler,
                         clip_type, clip_value, [buffer.group] + list(norm_groups),
                         [counted[p.param] for p in pieces], cast, main_params)
        self.buffer, self.pieces = buffer, pieces
        self.shards = buffer.shard_ranges(buffer.rank)         # this rank's range in each bucket

    def reload_main_params(self):
        """The float32 pieces from the model's parameters (after loading weights)."""
        pieces = params_in_pieces(self.params, self.buffer, self.pieces, self.cast)
        for piece, main in zip(pieces, self.main_params):
            main.copy_(piece.copy())

    def gathered_bucket(self, b, pieces, dtype):
        """Bucket b of the buffer [b1 - b0] from this rank's flat `pieces` (one per self.pieces)
        all-gathered in `dtype` over the group, zeros in its padding."""
        s0, s1 = self.shards[b]
        mine = [v for piece, v in zip(self.pieces, pieces) if piece.bucket == b]
        filled = sum(int(v.shape[0]) for v in mine)
        if filled < s1 - s0:                                   # the bucket's padding
            mine.append(ops.zeros(s1 - s0 - filled, F32))
        return collectives(self.buffer.group).all_gather(self.cast(ops.cat(mine), dtype))

    def _copy_main_params_to_model_params(self):
        """All-gather each bucket's updated shards, in the parameters' dtype, into the params."""
        for b in range(len(self.shards)):
            self._write_bucket(b)

    def _write_bucket(self, b):
        """Bucket b gathered (gathered_bucket) into its parameters."""
        flat = self.gathered_bucket(b, self.main_params, self.params[0].dtype)       # [b1 - b0]
        b0 = self.buffer.buckets[b][0]
        for i in self.buffer.bucket_params(b):
            start = self.buffer.offsets[i] - b0
            value = flat[start:start + self.buffer.sizes[i]].reshape(self.buffer.shapes[i])
            self._write(self.params[i], value.copy())

    def _write(self, param, value):
        param.copy_(value)


class OverlappedParamGatherOptimizer(DistributedOptimizer):
    """The distributed optimizer with overlap_param_gather (Megatron's): a step leaves every
    bucket pending, and finish_param_sync(params), Megatron's forward pre-hook, which the
    runners call before each forward of a piece or chunk, gathers those holding `params`, so
    that on a device a bucket's all-gather runs under the forward of the layers before it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bucket_of = {id(self.params[i]): b for b in range(len(self.shards))
                          for i in self.buffer.bucket_params(b)}
        self.pending = set()                     # buckets whose params wait for their gather

    def _copy_main_params_to_model_params(self):
        self.pending = set(range(len(self.shards)))

    def finish_param_sync(self, params=None):
        """Each pending bucket that holds one of `params` (None: every bucket) gathered into its
        parameters, first bucket first (the forward's order)."""
        wanted = self.pending if params is None else self.pending & {
            self.bucket_of[id(p)] for p in params if id(p) in self.bucket_of}
        for b in sorted(wanted):
            self._write_bucket(b)
        self.pending -= wanted


class ShardedParamOptimizer(OverlappedParamGatherOptimizer):
    """ZeRO-3 (Megatron-FSDP's optim_grads_params): the distributed optimizer whose model
    parameters are whole only while a pass reads them. After each pass release_params lets a
    bucket's parameters go (a one-element placeholder in their place); before the next pass
    that reads them finish_param_sync gathers the bucket again from every rank's shard (the
    float32 main pieces, cast to the model's dtype). The buckets are Megatron-FSDP's units, one
    block each on one stage (distributed.fsdp_units). A rank holds its shards, the parameters of
    the pass in hand, and what PyNative's record of each forward keeps for its backward (part of
    the weights: tools/probe_zero3.py). A gather sets each parameter's data anew (set_data): an
    ms.jit graph keeps reading the storage it was compiled with (the same probe), so ZeRO-3 runs
    op by op (train.Trainer)."""

    def _write(self, param, value):
        param.set_data(value, slice_shape=True)

    def release_params(self, params):
        """Each bucket holding one of `params` let go, to be gathered before its next use."""
        buckets = {self.bucket_of[id(p)] for p in params if id(p) in self.bucket_of}
        for b in buckets - self.pending:
            for i in self.buffer.bucket_params(b):
                self.params[i].set_data(ops.zeros(1, self.params[i].dtype), slice_shape=True)
        self.pending |= buckets


# ----------------------------------------------------------------------------- from the config
def get_megatron_optimizer(cfg, model, ddp, scaler, state=None, cast=cast):
    """Megatron's get_megatron_optimizer for a model or a list of model chunks and its
    distributed.DistributedDataParallel `ddp`: the mixed-precision optimizer around
    AdamW/Adam/SGD (MixedPrecisionOptimizer), or, where ddp reduce-scatters, the
    DistributedOptimizer over each buffer's shards; one per buffer of ddp (the dense parameters,
    the experts'), chained (ChainedOptimizer) when there are two, sharing the loss `scaler`
    (build_scaler). `cast`: the layer spec's cast of one tensor (MixedPrecisionOptimizer)."""
    state = state or get_state()
    chunks = model if isinstance(model, list) else [model]
    named = [item for chunk in chunks for item in chunk.parameters_and_names()]
    counted = counted_in_norm(chunks, state)
    # ddp's buffers: the dense parameters', then the experts' if any. The norm over TP x PP; the
    # experts' also over EP (Megatron's expert_tensor_model_pipeline group)
    norm_groups = [[state.mp_group], [state.mp_group, state.ep_group if state.ep > 1 else None]]
    optimizers = [_one_optimizer(cfg, [named[i] for i in positions], scaler,
                                 [counted[i] for i in positions], norm,
                                 buffer if ddp.reduce_scatter else None, cast)
                  for positions, buffer, norm in zip(ddp.positions, ddp.buffers, norm_groups)]
    return optimizers[0] if len(optimizers) == 1 else ChainedOptimizer(optimizers, ddp.positions)


def _one_optimizer(cfg, named, scaler, counted, norm_groups, sharded_buffer, cast):
    """The optimizer of parameters `named` ([(name, param)]), its gradient norm reduced over
    `norm_groups`; with `sharded_buffer` (their buffer's distributed.BucketLayout) the
    DistributedOptimizer over its shards."""
    optimizer_cfg, training_cfg = cfg.optimizer_config, cfg.training_config
    wd_mults = [0.0 if no_weight_decay(n, param.shape) else 1.0 for n, param in named]

    def make(params, mults):
        return base_optimizer(optimizer_cfg.optimizer_type, params,
                              betas=tuple(optimizer_cfg.betas), eps=optimizer_cfg.eps,
                              momentum=optimizer_cfg.momentum, wd_mults=mults)
    clip = training_cfg.grad_clip_kwargs
    common = dict(scaler=scaler, clip_type=clip.grad_clip_type, clip_value=clip.clip_value,
                  norm_groups=norm_groups, counted=counted, cast=cast)
    params = [param for _, param in named]
    if sharded_buffer is not None:
        if sharded_by_fsdp(training_cfg)[1]:
            kind = ShardedParamOptimizer
        elif optimizer_cfg.overlap_param_gather:
            kind = OverlappedParamGatherOptimizer
        else:
            kind = DistributedOptimizer
        return kind(make, params, wd_mults, **common, buffer=sharded_buffer)
    return MixedPrecisionOptimizer(make, params, wd_mults, **common)


def counted_in_norm(chunks, state):
    """Per parameter of `chunks`, whether its gradient counts in the norm on this rank: one
    replicated over TP (norms, row biases, position embeddings) on TP rank 0 (Megatron's
    param_is_not_tensor_parallel_duplicate), and the word embedding on the first stage, not its
    copy on the last (Megatron's param_is_not_shared: gpt.is_embedding_copy)."""
    return [(hasattr(param, "partition_dim") or state.tp_rank == 0)
            and not is_embedding_copy(param)
            for chunk in chunks for param in chunk.get_parameters()]


def build_scaler(cfg):
    """Megatron's grad scaler: a static --loss-scale if given, else dynamic when computing in
    float16 (its range needs it), else none (a constant 1.0; bfloat16 has float32's range)."""
    training_cfg = cfg.training_config
    if training_cfg.loss_scale is not None:
        return ConstantGradScaler(training_cfg.loss_scale)
    if cfg.model_config.compute_dtype == "float16":
        return DynamicGradScaler(training_cfg.loss_scale_value, training_cfg.min_loss_scale,
                                 growth_interval=training_cfg.loss_scale_window,
                                 hysteresis=training_cfg.hysteresis)
    return ConstantGradScaler(1.0)


if __name__ == "__main__":          # imported by train.py, not a script
    raise SystemExit("error: optimizer.py is a library: run `bash run.sh` (bash run.sh --help "
                     "lists the commands)")
