"""Megatron-LM checkpoints written by real torch, for the tests of megatron_checkpoint.py.

Run once by hand in a scratch venv outside the project (torch is never a dependency of it; the
suite only reads what this wrote):

    python3 -m venv /tmp/torchref && /tmp/torchref/bin/pip install torch==2.13.0 numpy
    /tmp/torchref/bin/python data/megatron/make_fixtures.py            # writes data/megatron/
    /tmp/torchref/bin/python data/megatron/make_fixtures.py --inspect DIR
        # prints, with torch.load, every rank file of the checkpoint folder DIR: its keys, args,
        # model names, dtypes and shapes, optimizer structure (e.g. this project's
        # --ckpt-format torch output)

Each fixture is a tiny GPT with Megatron-LM's semantics and random (seeded) weights, saved as
megatron/training/checkpointing.py's save_checkpoint saves with --ckpt-format torch:
`latest_checkpointed_iteration.txt`, `iter_000000N/mp_rank_TT[_PPP]/model_optim_rng.pt` holding
args, checkpoint_version 3.0, iteration, model (model0, model1 with a virtual pipeline),
optimizer, opt_param_scheduler, rng_state, num_floating_point_operations_so_far. Its
`expected.json` holds a prompt of token ids, the greedy continuation computed by this file's
float64 forward of the weights as stored, the smallest gap between the two largest logits on
the way (the seed is the first that keeps it at least MIN_MARGIN, far above float32 noise) and
the logits after the prompt.
`torch_sample.pt` holds views, shared storages, every dtype and the Python objects Megatron's
files carry, for the tests of torch_format.py.
"""
import argparse
import collections
import enum
import json
import math
import os
import random
import sys
import types

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT = [3, 141, 59, 26, 200, 97]
NEW_TOKENS = 8
MIN_MARGIN = 0.05
MIN_DISTINCT = 5
VOCAB = 250                                   # --vocab-size of Megatron's NullTokenizer


class ModelType(enum.Enum):
    """megatron.core.enums.ModelType, pickled in args.model_type as Megatron's own."""
    encoder_or_decoder = 1


def register_megatron_enums():
    """Make megatron.core.enums.ModelType importable (pickle names a class by module and name;
    Megatron itself is not installed)."""
    for name in ("megatron", "megatron.core", "megatron.core.enums"):
        sys.modules.setdefault(name, types.ModuleType(name))
    ModelType.__module__ = "megatron.core.enums"
    sys.modules["megatron.core.enums"].ModelType = ModelType


# The fixtures: Megatron flags (after validate_args) of each, and its layout
SPECS = {
    "tp1_gpt2": dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=128,
                     seq_length=16, position_embedding_type="learned_absolute",
                     normalization="LayerNorm", add_bias_linear=True, bias_gelu_fusion=True,
                     tp=1, pp=1, vpp=None, dtype="float32", legacy=False, iteration=10),
    "tp2_llama_bf16": dict(num_layers=2, hidden_size=32, num_attention_heads=4,
                           group_query_attention=True, num_query_groups=2, ffn_hidden_size=64,
                           seq_length=16, position_embedding_type="rope",
                           use_rotary_position_embeddings=True, normalization="RMSNorm",
                           swiglu=True, add_bias_linear=False, bias_gelu_fusion=False,
                           untie_embeddings_and_output_weights=True, tp=2, pp=1, vpp=None,
                           dtype="bfloat16", legacy=False, iteration=20),
    "pp2_vpp2_fp16": dict(num_layers=4, hidden_size=32, num_attention_heads=4,
                          ffn_hidden_size=64, seq_length=16,
                          position_embedding_type="learned_absolute", normalization="LayerNorm",
                          add_bias_linear=True, bias_gelu_fusion=False, tp=1, pp=2, vpp=2,
                          dtype="float16", legacy=False, iteration=30),
    "legacy_tp2_pp2": dict(num_layers=2, hidden_size=32, num_attention_heads=4,
                           ffn_hidden_size=128, seq_length=16,
                           position_embedding_type="learned_absolute", normalization="LayerNorm",
                           add_bias_linear=True, bias_gelu_fusion=True, openai_gelu=True, tp=2,
                           pp=2, vpp=None, dtype="float32", legacy=True, iteration=40),
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def padded_vocab(spec):
    """Megatron's _vocab_size_with_padding: the tokenizer's ids (NullTokenizer: vocab_size + 1)
    rounded up to make_vocab_size_divisible_by x TP."""
    multiple = 128 * spec["tp"]
    return -(-(VOCAB + 1) // multiple) * multiple


def megatron_args(spec):
    """The args Namespace save_checkpoint stores: Megatron's names and validated values."""
    s, h = spec, spec["hidden_size"]
    half = s["dtype"] != "float32"
    return argparse.Namespace(
        num_layers=s["num_layers"], hidden_size=h, ffn_hidden_size=s["ffn_hidden_size"],
        num_attention_heads=s["num_attention_heads"],
        group_query_attention=s.get("group_query_attention", False),
        num_query_groups=s.get("num_query_groups", 1), kv_channels=h // s["num_attention_heads"],
        seq_length=s["seq_length"], max_position_embeddings=s["seq_length"],
        make_vocab_size_divisible_by=128, padded_vocab_size=padded_vocab(s),
        position_embedding_type=s["position_embedding_type"],
        use_rotary_position_embeddings=s.get("use_rotary_position_embeddings", False),
        rotary_base=10000, rotary_percent=1.0, rotary_interleaved=False, use_rope_scaling=False,
        rotary_seq_len_interpolation_factor=None, add_position_embedding=True,
        normalization=s["normalization"], norm_epsilon=1e-5, apply_layernorm_1p=False,
        apply_residual_connection_post_layernorm=False, swiglu=s.get("swiglu", False),
        openai_gelu=s.get("openai_gelu", False), squared_relu=False, quick_geglu=False,
        bias_gelu_fusion=s["bias_gelu_fusion"], bias_swiglu_fusion=True,
        add_bias_linear=s["add_bias_linear"], add_qkv_bias=s["add_bias_linear"],
        untie_embeddings_and_output_weights=s.get("untie_embeddings_and_output_weights", False),
        qk_layernorm=False, multi_latent_attention=False, num_experts=None,
        moe_router_topk=2, expert_model_parallel_size=1, mtp_num_layers=None, window_size=None,
        softmax_scale=None, hidden_dropout=0.1, attention_dropout=0.1, init_method_std=0.02,
        apply_query_key_layer_scaling=False, attention_softmax_in_fp32=half,
        fp32_residual_connection=False, tensor_model_parallel_size=s["tp"],
        pipeline_model_parallel_size=s["pp"], virtual_pipeline_model_parallel_size=s["vpp"],
        num_layers_per_virtual_pipeline_stage=(s["num_layers"] // (s["pp"] * s["vpp"])
                                               if s["vpp"] else None),
        sequence_parallel=s["tp"] > 1, context_parallel_size=1, data_parallel_size=1,
        world_size=s["tp"] * s["pp"], rank=0, use_distributed_optimizer=False,
        transformer_impl="local", use_legacy_models=s["legacy"],
        model_type=ModelType.encoder_or_decoder, fp16=s["dtype"] == "float16",
        bf16=s["dtype"] == "bfloat16", params_dtype=DTYPES[s["dtype"]],
        main_params_dtype=torch.float32,
        accumulate_allreduce_grads_in_fp32=s["dtype"] == "bfloat16",
        loss_scale=None, initial_loss_scale=2.0 ** 32, min_loss_scale=1.0, loss_scale_window=1000,
        hysteresis=2, optimizer="adam", lr=3e-4, min_lr=3e-5, lr_decay_style="cosine",
        lr_warmup_iters=2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
        clip_grad=1.0, micro_batch_size=2, global_batch_size=4, train_iters=100, seed=1234,
        iteration=s["iteration"], consumed_train_samples=4 * s["iteration"],
        tokenizer_type="NullTokenizer", vocab_size=VOCAB, vocab_file=None, merge_file=None,
        ckpt_format="torch", save="/checkpoints/gpt", load=None, no_save_optim=None,
        no_save_rng=None)


def full_weights(spec, seed):
    """The whole model, Megatron-core names with global layer numbers, rounded to the stored
    dtype (returned in float64, as the forward uses them). The layers' outputs are scaled up so
    that they, not the token's own embedding, decide the next token."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)
    s, h, f = spec, spec["hidden_size"], spec["ffn_hidden_size"]
    heads, groups = s["num_attention_heads"], s.get("num_query_groups", s["num_attention_heads"])
    d, bias, ln = h // heads, s["add_bias_linear"], s["normalization"] == "LayerNorm"
    w = {"embedding.word_embeddings.weight": 0.5 * randn(padded_vocab(s), h)}
    if s["position_embedding_type"] == "learned_absolute":
        w["embedding.position_embeddings.weight"] = 0.3 * randn(s["seq_length"], h)
    linears = {"self_attention.linear_qkv": ((heads + 2 * groups) * d, h),
               "self_attention.linear_proj": (h, heads * d),
               "mlp.linear_fc1": (2 * f if s.get("swiglu") else f, h), "mlp.linear_fc2": (h, f)}
    norms = ["input_layernorm", "pre_mlp_layernorm"]
    for i in range(s["num_layers"]):
        p = f"decoder.layers.{i}."
        for norm in norms:
            w[p + norm + ".weight"] = 1 + 0.1 * randn(h)
            if ln:
                w[p + norm + ".bias"] = 0.1 * randn(h)
        for module, (rows, cols) in linears.items():
            scale = 3.0 if module in ("self_attention.linear_proj", "mlp.linear_fc2") else 1.0
            w[p + module + ".weight"] = scale * randn(rows, cols) / math.sqrt(cols)
            if bias:
                w[p + module + ".bias"] = 0.1 * randn(rows)
    w["decoder.final_layernorm.weight"] = 1 + 0.1 * randn(h)
    if ln:
        w["decoder.final_layernorm.bias"] = 0.1 * randn(h)
    if s.get("untie_embeddings_and_output_weights"):
        w["output_layer.weight"] = 0.5 * randn(padded_vocab(s), h)
    return {k: v.to(DTYPES[s["dtype"]]).double() for k, v in w.items()}


def norm(x, w, name, spec):
    if spec["normalization"] == "RMSNorm":
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w[name + ".weight"]
    return torch.nn.functional.layer_norm(x, x.shape[-1:], w[name + ".weight"],
                                          w[name + ".bias"], 1e-5)


def linear(x, w, name):
    return torch.nn.functional.linear(x, w[name + ".weight"], w.get(name + ".bias"))


def activation(u, spec):
    """Megatron's MLP activation (megatron/core/transformer/mlp.py; the legacy ParallelMLP):
    SwiGLU silu(gate) * up; GeLU with the tanh approximation when fused with its bias
    (fused_bias_gelu.py) or, in the legacy model, with --openai-gelu; exact GeLU otherwise."""
    if spec["legacy"] and spec.get("openai_gelu"):
        return torch.nn.functional.gelu(u, approximate="tanh")
    if spec.get("swiglu"):
        gate, up = torch.chunk(u, 2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    fused = spec["bias_gelu_fusion"] and spec["add_bias_linear"]
    return torch.nn.functional.gelu(u, approximate="tanh" if fused else "none")


def rotary(x, positions, d):
    """Megatron's RoPE (rope_utils.py, not interleaved): x * cos + rotate_half(x) * sin."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.outer(positions.double(), inv_freq)
    emb = torch.cat([freqs, freqs], -1)[:, None, :]                     # [s, 1, d]
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return x * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()


def attention(x, w, p, spec):
    """x [s, h] -> [s, h]: linear_qkv's rows per query group [q heads; k; v] (attention.py),
    each key/value head serving its group's query heads, causal softmax(q k^T / sqrt(d))."""
    s_len, heads = x.shape[0], spec["num_attention_heads"]
    groups = spec.get("num_query_groups", heads)
    d, per = spec["hidden_size"] // heads, heads // groups
    qkv = linear(x, w, p + "self_attention.linear_qkv").view(s_len, groups, (per + 2) * d)
    q, k, v = torch.split(qkv, [per * d, d, d], dim=-1)
    q = q.reshape(s_len, heads, d)
    if spec["position_embedding_type"] == "rope":
        positions = torch.arange(s_len)
        q, k = rotary(q, positions, d), rotary(k, positions, d)
    k, v = k.repeat_interleave(per, 1), v.repeat_interleave(per, 1)       # [s, n, d]
    scores = torch.einsum("snd,tnd->nst", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.triu(torch.ones(s_len, s_len, dtype=torch.bool), 1),
                                float("-inf"))
    context = torch.einsum("nst,tnd->snd", scores.softmax(-1), v).reshape(s_len, heads * d)
    return linear(context, w, p + "self_attention.linear_proj")


def logits(w, spec, ids):
    """Megatron's GPT forward (pre-norm layers, float64): token ids [s] -> logits [s, V]."""
    ids = torch.tensor(ids)
    x = w["embedding.word_embeddings.weight"][ids]
    if spec["position_embedding_type"] == "learned_absolute":
        x = x + w["embedding.position_embeddings.weight"][: len(ids)]
    for i in range(spec["num_layers"]):
        p = f"decoder.layers.{i}."
        x = x + attention(norm(x, w, p + "input_layernorm", spec), w, p, spec)
        u = linear(norm(x, w, p + "pre_mlp_layernorm", spec), w, p + "mlp.linear_fc1")
        x = x + linear(activation(u, spec), w, p + "mlp.linear_fc2")
    x = norm(x, w, "decoder.final_layernorm", spec)
    out = w.get("output_layer.weight", w["embedding.word_embeddings.weight"])
    return x @ out.T


def greedy(w, spec):
    """(the NEW_TOKENS greedy ids after PROMPT, the smallest top-1 - top-2 logit gap), over the
    tokenizer's VOCAB + 1 ids (the padded rows are never sampled)."""
    ids, margin = list(PROMPT), float("inf")
    for _ in range(NEW_TOKENS):
        top = logits(w, spec, ids)[-1, : VOCAB + 1].topk(2).values
        margin = min(margin, float(top[0] - top[1]))
        ids.append(int(logits(w, spec, ids)[-1, : VOCAB + 1].argmax()))
    return ids[len(PROMPT):], margin


COLUMN = ("linear_qkv", "linear_fc1", "word_embeddings", "output_layer")
ROW = ("linear_proj", "linear_fc2")
LAYER_ORDER = ("input_layernorm", "self_attention.linear_proj", "self_attention.linear_qkv",
               "pre_mlp_layernorm", "mlp.linear_fc1", "mlp.linear_fc2")     # registration order
LEGACY = {"input_layernorm": "input_layernorm", "self_attention.linear_qkv":
          "self_attention.query_key_value", "self_attention.linear_proj": "self_attention.dense",
          "pre_mlp_layernorm": "post_attention_layernorm", "mlp.linear_fc1": "mlp.dense_h_to_4h",
          "mlp.linear_fc2": "mlp.dense_4h_to_h"}
LEGACY_ORDER = ("input_layernorm", "self_attention.linear_qkv", "self_attention.linear_proj",
                "pre_mlp_layernorm", "mlp.linear_fc1", "mlp.linear_fc2")


def tp_piece(name, value, rank, spec):
    """TP rank `rank`'s piece (megatron/core/tensor_parallel/layers.py): column-parallel weights
    and biases and the vocab-parallel embedding on dim 0 (SwiGLU's fc1 per [gate; up] block),
    row-parallel weights on dim 1, the rest replicated."""
    tp = spec["tp"]
    if any(c in name for c in COLUMN):
        if spec.get("swiglu") and "linear_fc1" in name:
            return torch.cat([block.chunk(tp)[rank] for block in value.chunk(2)])
        return value.chunk(tp)[rank].clone()
    if any(r in name for r in ROW) and name.endswith(".weight"):
        return value.chunk(tp, dim=1)[rank].clone()
    return value.clone()


def chunk_entries(w, spec, stage, chunk):
    """(name in the state dict of `chunk` of pipeline `stage`, its source in `w`, or None for
    an `_extra_state`) in Megatron-core's registration order, layers numbered from 0."""
    pp, vpp = spec["pp"], spec["vpp"] or 1
    per = spec["num_layers"] // (pp * vpp)
    offset = (chunk * pp + stage) * per          # chunk by chunk over the stages
    pre, post = stage == 0 and chunk == 0, stage == pp - 1 and chunk == vpp - 1
    entries = [(n, n) for n in w if n.startswith("embedding.")] if pre else []
    for i in range(per):
        for module in LAYER_ORDER:
            source, local = f"decoder.layers.{offset + i}.{module}", f"decoder.layers.{i}.{module}"
            entries += [(f"{local}.{leaf}", f"{source}.{leaf}") for leaf in ("weight", "bias")
                        if f"{source}.{leaf}" in w]
            entries += [(f"{local}._extra_state", None)] if "linear" in module else []
    if post:
        entries += [(n, n) for n in w if n.startswith("decoder.final_layernorm")]
        if "output_layer.weight" in w:
            entries.append(("output_layer.weight", "output_layer.weight"))
        elif not pre:                               # the tied last stage's copy of the embedding
            entries.append(("output_layer.weight", "embedding.word_embeddings.weight"))
        entries.append(("output_layer._extra_state", None))
    return entries


def chunk_state(w, spec, rank, stage, chunk):
    """One model chunk's state dict on TP rank `rank`, as Megatron-core's
    state_dict_for_save_checkpoint gives it, in the model's dtype."""
    state = collections.OrderedDict()
    for local, source in chunk_entries(w, spec, stage, chunk):
        state[local] = None if source is None else \
            tp_piece(source, w[source], rank, spec).to(DTYPES[spec["dtype"]])
    return state


def legacy_state(state, pre, post, spec):
    """The legacy GPTModel's nested state_dict_for_save_checkpoint of the same chunk
    (megatron/legacy/model/gpt_model.py, language_model.py): embedding, encoder (its layers and
    final_layernorm), output_layer when untied; a tied last stage's copy of the word embedding
    as word_embeddings_for_head."""
    lm, encoder = collections.OrderedDict(), collections.OrderedDict()
    if pre:
        lm["embedding"] = {"word_embeddings": {"weight": state["embedding.word_embeddings.weight"]}}
        if "embedding.position_embeddings.weight" in state:
            lm["embedding"]["position_embeddings"] = {
                "weight": state["embedding.position_embeddings.weight"]}
    layers = sorted({int(k.split(".")[2]) for k in state if k.startswith("decoder.layers.")})
    for i in layers:
        for module in LEGACY_ORDER:
            for leaf in ("weight", "bias", "_extra_state"):
                key = f"decoder.layers.{i}.{module}.{leaf}"
                if key in state:
                    encoder[f"layers.{i}.{LEGACY[module]}.{leaf}"] = state[key]
    for leaf in ("weight", "bias"):
        if post and f"decoder.final_layernorm.{leaf}" in state:
            encoder[f"final_layernorm.{leaf}"] = state[f"decoder.final_layernorm.{leaf}"]
    lm["encoder"] = encoder
    tied = not spec.get("untie_embeddings_and_output_weights")
    out = {"language_model": lm}
    if post and not tied:
        lm["output_layer"] = {"weight": state["output_layer.weight"]}
    if post and tied and not pre:
        out["word_embeddings_for_head"] = {"weight": state["output_layer.weight"]}
    return out


def optimizer_state(params, spec, seed):
    """This rank's optimizer.state_dict() (megatron/core/optimizer/optimizer.py; `params` are
    (name, tensor) in named_parameters order, chunk by chunk). FP32Optimizer: torch AdamW's
    state dict. Float16OptimizerWithFloat16Params (--fp16, --bf16): {"optimizer": AdamW's over
    float32 copies, "grad_scaler" (--fp16's DynamicGradScaler), "fp32_from_fp16_params": the
    copies per group}. Groups as megatron/core/optimizer/__init__.py's _get_param_groups makes
    them: first the parameters without overrides (weight decay), then biases and 1-D weights
    (wd_mult 0). One AdamW step at lr 0 on seeded gradients fills exp_avg and exp_avg_sq and
    leaves the weights as saved; the groups then hold the scheduler's lr."""
    g = torch.Generator().manual_seed(seed)
    groups = [[], []]
    for name, value in params:
        main = value.detach().float().clone()
        main.grad = 1e-3 * torch.randn(main.shape, generator=g)
        groups[1 if value.dim() == 1 or name.endswith(".bias") else 0].append(main)
    megatron_keys = dict(is_expert_parallel=False, default_config=True, lr_mult=1.0,
                         is_decoupled_lr=False, max_lr=3e-4, min_lr=3e-5)
    adam = torch.optim.AdamW([dict(params=groups[0], wd_mult=1.0, **megatron_keys),
                              dict(params=groups[1], wd_mult=0.0, **megatron_keys)],
                             lr=0.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    adam.step()
    for group in adam.param_groups:
        group["lr"], group["weight_decay"] = 2.9e-4, 0.1 * group["wd_mult"]
    if spec["dtype"] == "float32":
        return adam.state_dict()
    state = {"optimizer": adam.state_dict()}
    if spec["dtype"] == "float16":
        state["grad_scaler"] = {"scale": torch.tensor(65536.0), "growth_tracker": 3,
                                "hysteresis_tracker": 2}
    state["fp32_from_fp16_params"] = groups
    return state


def scheduler_state(spec):
    """OptimizerParamScheduler.state_dict() (megatron/core/optimizer_param_scheduler.py); its
    steps count samples."""
    samples = 4 * spec["iteration"]
    return {"max_lr": 3e-4, "lr_warmup_steps": 8, "num_steps": samples, "lr_decay_style": "cosine",
            "lr_decay_steps": 400, "min_lr": 3e-5, "start_wd": 0.1, "end_wd": 0.1,
            "wd_incr_style": "constant", "wd_incr_steps": 400}


def rng_state(seed):
    """checkpointing.get_rng_state with --ckpt-format torch: a list, one dict per data-parallel
    rank gathered (one without --data-parallel-random-init). No CUDA here: its generator states
    (8 bytes of seed, 8 of offset) are made up."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    cuda = torch.tensor(list(seed.to_bytes(8, "little") + bytes(8)), dtype=torch.uint8)
    return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": cuda,
             "rng_tracker_states": {"model-parallel-rng": cuda.clone()}}]


def flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict)
                   else {prefix + key: value})
    return out


def rank_file(w, spec, rank, stage, seed):
    """The dict save_checkpoint hands torch.save (generate_state_dict, then the FLOPs)."""
    vpp = spec["vpp"] or 1
    models = []
    for chunk in range(vpp):
        state = chunk_state(w, spec, rank, stage, chunk)
        pre, post = stage == 0 and chunk == 0, stage == spec["pp"] - 1 and chunk == vpp - 1
        models.append(legacy_state(state, pre, post, spec) if spec["legacy"] else state)
    out = {"args": megatron_args(spec), "checkpoint_version": 3.0, "iteration": spec["iteration"]}
    out.update({"model": models[0]} if vpp == 1 else {f"model{i}": m for i, m in enumerate(models)})
    params = [(n, v) for m in models for n, v in flat(m).items() if v is not None]
    out["optimizer"] = optimizer_state(params, spec, seed)
    out["opt_param_scheduler"] = scheduler_state(spec)
    out["rng_state"] = rng_state(seed * 100 + rank)
    out["num_floating_point_operations_so_far"] = 1.25e12 * spec["iteration"]
    return out


def write_fixture(name, spec, out, first_seed):
    """The checkpoint folder out/name and its expected.json; the weights of the first seed
    whose greedy tokens clear MIN_MARGIN and are not one token repeated (MIN_DISTINCT)."""
    for seed in range(first_seed, first_seed + 500):
        w = full_weights(spec, seed)
        new, margin = greedy(w, spec)
        if margin >= MIN_MARGIN and len(set(new)) >= MIN_DISTINCT:
            break
    root = os.path.join(out, name)
    folder = os.path.join(root, f"iter_{spec['iteration']:07d}")
    for stage in range(spec["pp"]):
        for rank in range(spec["tp"]):
            shard = f"mp_rank_{rank:02d}" + (f"_{stage:03d}" if spec["pp"] > 1 else "")
            os.makedirs(os.path.join(folder, shard), exist_ok=True)
            torch.save(rank_file(w, spec, rank, stage, seed),
                       os.path.join(folder, shard, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(spec["iteration"]))
    last = logits(w, spec, PROMPT)[-1, : VOCAB + 1]
    expected = {"prompt": PROMPT, "greedy": new, "vocab": VOCAB + 1, "min_margin": margin,
                "prompt_logits": [round(float(x), 6) for x in last],
                "seed": seed, "dtype": spec["dtype"], "tp": spec["tp"], "pp": spec["pp"],
                "vpp": spec["vpp"], "legacy": spec["legacy"]}
    with open(os.path.join(root, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
    print(f"{name}: seed {seed}, greedy {new}, smallest margin {margin:.3f}")


def write_torch_sample(path):
    """Views and shared storages, every dtype, and the Python objects of Megatron's files (args
    with torch dtypes and an enum, numpy's and Python's random states, byte tensors)."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    sample = {
        "base": base, "column": base[:, 2], "transposed": base.t(), "block": base[1:3, 1:5],
        "strided": base.view(-1)[5:17:3], "same": base,
        "half": torch.arange(6, dtype=torch.float16).reshape(2, 3) / 4,
        "bfloat16": torch.tensor([1.5, -2.25, 3.0e-3, 65504.0], dtype=torch.bfloat16),
        "double": torch.arange(3, dtype=torch.float64) / 3, "long": torch.arange(-2, 3),
        "int": torch.arange(4, dtype=torch.int32), "short": torch.arange(3, dtype=torch.int16),
        "int8": torch.arange(-3, 3, dtype=torch.int8),
        "uint8": torch.arange(250, 256, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3), "parameter": torch.nn.Parameter(torch.ones(2)),
        "args": argparse.Namespace(params_dtype=torch.bfloat16, fp16=torch.float16,
                                   main_params_dtype=torch.float32,
                                   model_type=ModelType.encoder_or_decoder, layers=[1, 2],
                                   name="gpt"),
        "np_rng_state": np.random.get_state(), "random_rng_state": random.getstate(),
        "torch_rng_state": torch.get_rng_state(),
        "ordered": collections.OrderedDict([("b", 1), ("a", 2)]),
        "nested": {"t": (1, [2.5, None], {"x": True})}, "np_scalar": np.float64(0.25),
        "np_array": np.arange(3, dtype=np.int16)}
    torch.save(sample, path)


def describe(obj, depth=0):
    """A short outline of `obj`: containers' keys and sizes, tensors' dtypes and shapes."""
    pad = "  " * depth
    if isinstance(obj, torch.Tensor):
        return f"{obj.dtype} {tuple(obj.shape)}"
    if isinstance(obj, dict) and depth < 4:
        return "\n".join([f"{type(obj).__name__} of {len(obj)}"] + [
            f"{pad}  {k!r}: {describe(v, depth + 1)}" for k, v in list(obj.items())[:12]]
            + ([f"{pad}  ... {len(obj) - 12} more"] if len(obj) > 12 else []))
    if isinstance(obj, (list, tuple)) and depth < 4 and obj:
        return f"{type(obj).__name__} of {len(obj)}, first: {describe(obj[0], depth + 1)}"
    return f"{type(obj).__name__} {str(obj)[:60]}"


def inspect(root):
    """Print every rank file of the checkpoint folder `root`, read by torch.load."""
    register_megatron_enums()
    text = open(os.path.join(root, "latest_checkpointed_iteration.txt")).read().strip()
    folder = os.path.join(root, "release" if text == "release" else f"iter_{int(text):07d}")
    for shard in sorted(e for e in os.listdir(folder) if e.startswith("mp_rank_")):
        path = os.path.join(folder, shard, "model_optim_rng.pt")
        state = torch.load(path, map_location="cpu", weights_only=False)
        print(f"== {path}\nkeys: {list(state)}")
        print(f"checkpoint_version {state.get('checkpoint_version')}, "
              f"iteration {state.get('iteration')}")
        print(f"args: {describe(vars(state['args']) if 'args' in state else None)}")
        for key in [k for k in state if k == "model" or k[5:].isdigit() and k.startswith("model")]:
            print(f"{key}:")
            for name, value in flat(state[key]).items():
                print(f"  {name}: {describe(value)}")
        for key in ("optimizer", "opt_param_scheduler", "rng_state"):
            print(f"{key}: {describe(state.get(key))}")


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inspect", metavar="DIR", help="print this checkpoint folder instead")
    parser.add_argument("--out", default=HERE, help="where the fixtures go")
    args = parser.parse_args(argv)
    if args.inspect:
        inspect(args.inspect)
        return
    register_megatron_enums()
    torch.use_deterministic_algorithms(True)
    for i, (name, spec) in enumerate(SPECS.items()):
        write_fixture(name, spec, args.out, 1000 * i)
    write_torch_sample(os.path.join(args.out, "torch_sample.pt"))


if __name__ == "__main__":
    main(sys.argv[1:])
