"""Megatron-LM checkpoints (--ckpt-format torch) in: names, layouts, args, and the command

    bash run.sh import-megatron DIR --save OUT [--nproc N] [layout flags]

A Megatron-LM checkpoint folder (megatron/training/checkpointing.py, save_checkpoint) is
`latest_checkpointed_iteration.txt` ("N" or "release") and `iter_000000N/mp_rank_TT[_PPP][_EEE]/
model_optim_rng.pt`, one torch.save file (torch_format.py) per tensor, pipeline and expert-parallel
rank (each EP rank's holding the dense weights and its own experts), holding
args (the run's argparse.Namespace), checkpoint_version, iteration, model (model0, model1, ...
with a virtual pipeline), optimizer, opt_param_scheduler, rng_state. The model is that rank's
state dict, layer numbers local to its chunk (megatron/core/transformer/transformer_block.py),
split over TP as Megatron's layers split it (megatron/core/tensor_parallel/layers.py):
column-parallel linear_qkv and linear_fc1 and the vocab-parallel embedding and output layer on
dim 0 (SwiGLU's fc1 holds [gate; up] of its own rows on each rank), row-parallel linear_proj and
linear_fc2 on dim 1, norms, position embeddings and row-parallel biases replicated. linear_qkv's
rows are per query group [q heads of the group; k; v] (megatron/core/transformer/attention.py,
and the legacy query_key_value since checkpoint_version 2), this project's layout already.
"""
import argparse
import collections
import itertools
import os
import re

import numpy as np

import moe
from formats import torch_format
from optimizer import no_weight_decay
from settings import keys
from settings.cli import PROJECT
from settings.config import ConfigError, fc1_chunks, sample_based

LATEST = "latest_checkpointed_iteration.txt"
WEIGHTS = "model_optim_rng"                     # a rank's file: weights, optimizer state, RNG
WEIGHTS_FILE = WEIGHTS + ".pt"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or written as asked: one line naming the file."""


def iteration_dir(root, iteration):
    return os.path.join(root, f"iter_{iteration:07d}")


def shard_name(tp_rank=0, pp_rank=0, pp_size=1, ep_rank=0, ep_size=1):
    """Megatron's get_checkpoint_name: mp_rank_TT with one pipeline stage, mp_rank_TT_PPP with
    several, then _EEE with expert parallelism."""
    name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp_size > 1 else "")
    return name + (f"_{ep_rank:03d}" if ep_size > 1 else "")

# Megatron-core's GPTModel (megatron/core/models/gpt/gpt_model.py, the local layer spec of
# gpt_layer_specs.py) -> this project's names; each layer's modules are named alike
MCORE_TOP = {"embedding.word_embeddings.weight": "word_embeddings.weight",
             "embedding.position_embeddings.weight": "position_embeddings",
             "decoder.final_layernorm.weight": "final_layernorm.weight",
             "decoder.final_layernorm.bias": "final_layernorm.bias",
             "output_layer.weight": "output_layer.weight"}
# in Megatron's order of registration
MCORE_LAYER = {name: name for name in ("input_layernorm", "self_attention.linear_proj",
                                       "self_attention.linear_qkv", "pre_mlp_layernorm",
                                       "mlp.linear_fc1", "mlp.linear_fc2")}
# --transformer-impl transformer_engine fuses the norms into the next linear
TE_NORMS = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
            "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
            "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
            "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}
# the legacy GPTModel (megatron/legacy/model/language_model.py, transformer.py), its state dict
# nested per module and flattened here; its norms were renamed *_norm late in its life
LEGACY_TOP = {"language_model.embedding.word_embeddings.weight": "word_embeddings.weight",
              "language_model.embedding.position_embeddings.weight": "position_embeddings",
              "language_model.output_layer.weight": "output_layer.weight",
              "word_embeddings_for_head.weight": "output_layer.weight",  # the last stage's copy
              **{f"language_model.encoder.{norm}.{leaf}": f"final_layernorm.{leaf}"
                 for norm in ("final_layernorm", "final_norm") for leaf in ("weight", "bias")}}
LEGACY_LAYER = {"input_layernorm": "input_layernorm", "input_norm": "input_layernorm",
                "self_attention.query_key_value": "self_attention.linear_qkv",
                "self_attention.dense": "self_attention.linear_proj",
                "post_attention_layernorm": "pre_mlp_layernorm",
                "post_attention_norm": "pre_mlp_layernorm",
                "mlp.dense_h_to_4h": "mlp.linear_fc1", "mlp.dense_4h_to_h": "mlp.linear_fc2"}
LAYERS = {"decoder.layers.": MCORE_LAYER, "language_model.encoder.layers.": LEGACY_LAYER}
# Megatron-core's MoELayer in place of a layer's MLP (megatron/core/transformer/moe/moe_layer.py:
# 260, 334, 346 register router, experts, shared_experts in this order), named as this project's
# moe.py names it: TopKRouter's weight [E, h] and bias (router.py:64-72), and its persistent
# buffer expert_bias [E] with --moe-router-enable-expert-bias (l. 180-201); SequentialMLP's
# local_experts.j, j local to the EP rank (experts.py:1435-1451), the local transformer impl's
# experts with --moe-grouped-gemm too (megatron/core/models/backends.py:133-142);
# SharedExpertMLP's linears and gate_weight [1, h] (shared_experts.py:128-145), no bias (l. 124)
MOE_PARAMETER = re.compile(r"mlp\.(?:router\.(?:weight|bias|expert_bias)|experts\.local_experts\."
                           r"\d+\.linear_fc[12]\.(?:weight|bias)|shared_experts\.(?:gate_weight|"
                           r"linear_fc[12]\.weight))")
# transformer_engine's TEGroupedMLP (--moe-grouped-gemm, experts.py:183-489): expert j's linear
# as GroupedLinear's weight<j>/bias<j>, each shaped as SequentialMLP's
TE_GROUPED_EXPERT = re.compile(r"mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)")
LAYER_NUMBER = re.compile(r"(?:decoder|language_model\.encoder)\.layers\.(\d+)\.")
LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")
MOE_NAME = re.compile(r"layers\.(\d+)\.(mlp\..+)")
RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(_\d{3})?")
LINEARS = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1",
           "mlp.linear_fc2")
EXPERT_LINEAR = re.compile(r"experts\.(?:local_experts\.\d+\.)?linear_fc[12]$")  # routed, shared


# ----------------------------------------------------------------------------- names
def project_name(name, layer_offset=0, expert_offset=0):
    """This project's global name of Megatron's `name` (mcore or legacy; its layer number local
    to a chunk whose first layer is global layer `layer_offset`, its routed experts' index local
    to an EP rank whose first expert is `expert_offset`); None for what holds no weight
    (`_extra_state`, RoPE's inv_freq); CheckpointError for a name this project's GPT has no
    place for."""
    parts = name.split(".")
    if "_extra_state" in parts or parts[-2:] == ["rotary_pos_emb", "inv_freq"]:
        return None           # transformer_engine's state may nest; RoPE's table is recomputed
    top = MCORE_TOP.get(name) or LEGACY_TOP.get(name)
    if top:
        return top
    for prefix, modules in LAYERS.items():
        if not name.startswith(prefix):
            continue
        number, _, rest = name[len(prefix):].partition(".")
        module, _, leaf = TE_NORMS.get(rest, rest).rpartition(".")
        if number.isdigit() and module in modules and leaf in ("weight", "bias"):
            return f"layers.{int(number) + layer_offset}.{modules[module]}.{leaf}"
        grouped = TE_GROUPED_EXPERT.fullmatch(rest)
        if grouped:
            rest = "mlp.experts.local_experts.{2}.{0}.{1}".format(*grouped.groups())
        if number.isdigit() and prefix == "decoder.layers." and MOE_PARAMETER.fullmatch(rest):
            return moe.global_expert_name(f"layers.{int(number) + layer_offset}.{rest}",
                                          expert_offset)
    raise CheckpointError(f"Megatron's {name} has no place in this project's GPT (only dense "
                          "attention, MLP, MoE router and SequentialMLP experts, LayerNorm/"
                          "RMSNorm and embeddings are mapped)")


def megatron_name(name, layer_offset=0, expert_offset=0):
    """Megatron-core's name of this project's global `name`, its layer number made local to a
    chunk whose first layer is global layer `layer_offset`, a routed expert's index local to the
    EP rank whose first expert is `expert_offset`."""
    back = {v: k for k, v in MCORE_TOP.items()}
    if name in back:
        return back[name]
    match = LAYER_NAME.fullmatch(name)
    if match and match.group(2) in MCORE_LAYER and int(match.group(1)) >= layer_offset:
        number, module, leaf = int(match.group(1)) - layer_offset, match.group(2), match.group(3)
        return f"decoder.layers.{number}.{module}.{leaf}"
    match = MOE_NAME.fullmatch(name)
    if match and MOE_PARAMETER.fullmatch(match.group(2)) and int(match.group(1)) >= layer_offset:
        local = moe.global_expert_name(match.group(2), -expert_offset)
        if "-" not in local:
            return f"decoder.layers.{int(match.group(1)) - layer_offset}.{local}"
    raise CheckpointError(f"{name} has no Megatron-core counterpart in a chunk starting at layer "
                          f"{layer_offset} (Megatron's GPT has no sandwich norms)")


def _megatron_order(name):
    """Sort key: Megatron's state dict order (embedding, layers in order, each in registration
    order and weight before bias, final norm, output layer), which its optimizer's parameter
    indices follow."""
    match = LAYER_NAME.fullmatch(name)
    if match and match.group(2) in MCORE_LAYER:
        module = list(MCORE_LAYER).index(match.group(2))
        return 1, int(match.group(1)), module, match.group(3) == "bias"
    match = MOE_NAME.fullmatch(name)
    if match:
        return 1, int(match.group(1)), list(MCORE_LAYER).index("mlp.linear_fc1"), \
            _moe_order(match.group(2))
    top = ["word_embeddings.weight", "position_embeddings", "final_layernorm.weight",
           "final_layernorm.bias", "output_layer.weight"]
    return (0 if top.index(name) < 2 else 2), top.index(name)


def _moe_order(rest):
    """Sort key inside an MoE layer: the router, the experts by index (linear_fc1 before
    linear_fc2, weight before bias), the shared expert's gate_weight before its linears (torch's
    state_dict lists a module's own parameters before its children's)."""
    index = moe.EXPERT_INDEX.search(rest)
    if index:
        return 1, int(index.group(2)), "linear_fc2" in rest, rest.endswith("bias")
    if rest.startswith("mlp.router."):
        return 0, 0, False, rest.endswith("bias")
    return 2, 0, "linear_fc2" in rest, "linear_fc1" in rest


def rank_model_state(tensors, layer_offsets, expert_offset=0):
    """Megatron's model state of one (TP rank, pipeline stage), as save_checkpoint writes it:
    {"model": state} or, with a virtual pipeline, {"model0": ..., "model1": ...}. `tensors` are
    this rank's {"model.<global name>": value} (this project's names, values as given), its
    chunks starting at the global layers `layer_offsets` (ascending). Layer numbers become local
    to their chunk; embeddings go to the first chunk, the final norm and output layer to the
    last; each linear gets Megatron-core's `_extra_state` entry (None). Routed experts, global
    here, get the index local to the EP rank whose first expert is `expert_offset`."""
    chunks = [[] for _ in layer_offsets]
    for key in sorted(tensors, key=lambda k: _megatron_order(k[len("model."):])):
        name = key[len("model."):]
        match = LAYER_NAME.fullmatch(name)
        if match:
            layer = int(match.group(1))
            index = max(i for i, offset in enumerate(layer_offsets) if offset <= layer)
        else:
            index = 0 if "embeddings" in name else len(chunks) - 1
        chunks[index].append((megatron_name(name, layer_offsets[index], expert_offset),
                              tensors[key]))
    states = [_with_extra_state(items) for items in chunks]
    if len(states) == 1:
        return {"model": states[0]}
    return {f"model{i}": state for i, state in enumerate(states)}


def _with_extra_state(items):
    """A chunk's (name, value) pairs as an OrderedDict, `<linear>._extra_state: None` after each
    linear's parameters (megatron/core/tensor_parallel/layers.py: get_extra_state), and after
    the final norm for a tied output layer, which has no weight on the embedding's stage."""
    state = collections.OrderedDict()
    for i, (name, value) in enumerate(items):
        state[name] = value
        module = name.rsplit(".", 1)[0]
        following = items[i + 1][0].rsplit(".", 1)[0] if i + 1 < len(items) else None
        linear = module.endswith(LINEARS + ("output_layer",)) or EXPERT_LINEAR.search(module)
        if module != following and linear:
            state[f"{module}._extra_state"] = None
    if "decoder.final_layernorm.weight" in state and "output_layer._extra_state" not in state:
        state["output_layer._extra_state"] = None
    return state


def model_chunks(state):
    """The model state dicts of one rank's file, chunk by chunk ("model", or "model0", ...),
    flattened to dotted names (the legacy model nests them per module)."""
    keys = ["model"] if "model" in state else sorted(
        (k for k in state if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))
    return [_flatten(state[k]) for k in keys]


def _flatten(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def rank_tensors(state, layer_offsets, expert_offset=0):
    """The inverse of rank_model_state: a rank's file (its "model"/"modelK" state dicts, mcore or
    legacy names) -> {"model.<global name>": value}; a tied last stage's copy of the word
    embedding comes back as model.output_layer.weight, as this project's stages hold it."""
    out = {}
    for chunk, offset in zip(model_chunks(state), layer_offsets):
        for name, value in chunk.items():
            global_name = project_name(name, offset, expert_offset)
            if global_name is not None:
                out[f"model.{global_name}"] = value
    return out


# ----------------------------------------------------------------------------- args
# this project's MoE keys (keys.MOE, model_config) -> Megatron's args fields, argparse's dest of
# the flag each key takes (arguments.py:3515-3545 by hand, the rest TransformerConfig's fields as
# flags, argument_utils.py:106): the same names, num_moe_experts being --num-experts
MOE_ARGS = {row.path.split(".")[-1]: (row.flags or tuple(row.switches))[0][2:].replace("-", "_")
            for row in keys.MOE}


def _single(value):
    """A list of one value (the nargs='+' of --moe-router-load-balancing-type and
    --moe-aux-loss-coeff at arguments.py:3532-3537) as that value."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


# Megatron settings (megatron/training/arguments.py) this project's GPT cannot hold: the args
# field, the values that are refused, what the setting is
UNSUPPORTED = (
    ("moe_router_score_function", lambda v: v not in (None, "softmax", "sigmoid"),
     "router scores other than softmax and sigmoid"),
    ("moe_router_load_balancing_type",
     lambda v: _single(v) not in (None, "aux_loss", "seq_aux_loss", "none"),
     "load balancing other than one of aux_loss, seq_aux_loss and none"),
    ("moe_aux_loss_coeff", lambda v: isinstance(_single(v), list), "several aux-loss coefficients"),
    ("moe_router_dtype", lambda v: v not in (None, "fp32"), "a router dtype other than fp32"),
    ("moe_router_num_groups", lambda v: v is not None, "group-limited expert routing"),
    ("moe_input_jitter_eps", lambda v: v is not None, "router input jitter"),
    ("qk_layernorm", bool, "query and key layer norms"),
    ("multi_latent_attention", bool, "multi-latent attention"),
    ("attention_output_gate", bool, "a gated attention output"),
    ("rotary_percent", lambda v: v not in (None, 1.0), "rotary embeddings on part of a head"),
    ("rotary_interleaved", bool, "interleaved rotary embeddings"),
    ("use_rope_scaling", bool, "RoPE frequency scaling"),
    ("rotary_seq_len_interpolation_factor", lambda v: v not in (None, 1, 1.0),
     "RoPE position interpolation"),
    ("position_embedding_type", lambda v: v not in (None, "learned_absolute", "rope"),
     "position embeddings other than learned_absolute and rope"),
    ("normalization", lambda v: v not in (None, "LayerNorm", "RMSNorm"),
     "a norm other than LayerNorm and RMSNorm"),
    ("apply_layernorm_1p", bool, "zero-centred LayerNorm weights (1 + w)"),
    ("layernorm_zero_centered_gamma", bool, "zero-centred LayerNorm weights (1 + w)"),
    ("apply_residual_connection_post_layernorm", bool, "the residual taken after the norm"),
    ("squared_relu", bool, "the squared ReLU activation"),
    ("quick_geglu", bool, "the quick GeGLU activation"),
    ("use_te_activation_func", bool, "transformer_engine's activation functions"),
    ("window_size", lambda v: v is not None, "sliding-window attention"),
    ("softmax_scale", lambda v: v is not None, "a custom softmax scale"),
    ("mtp_num_layers", bool, "multi-token prediction layers"),
    ("heterogeneous_layers_config_path", lambda v: v is not None, "heterogeneous layers"),
    ("hybrid_override_pattern", lambda v: v is not None, "hybrid (Mamba) layers"),
    ("hybrid_layer_pattern", lambda v: v is not None, "hybrid (Mamba) layers"))
ROPE_SETTINGS = ("rotary_percent", "rotary_interleaved", "use_rope_scaling",
                 "rotary_seq_len_interpolation_factor")        # checked for RoPE models alone


def _hidden_act(args, legacy):
    """This project's activation for Megatron's: SwiGLU; else GeLU, which Megatron computes with
    the tanh approximation when the bias is fused into it (megatron/core/fusions/
    fused_bias_gelu.py, --bias-gelu-fusion with biases, the default) and the legacy model also
    with --openai-gelu (which Megatron-core ignores); exact (erf) GeLU otherwise."""
    get = vars(args).get
    if legacy and get("openai_gelu"):
        return "gelu_tanh"
    if get("swiglu"):
        return "swiglu"
    fused = get("bias_gelu_fusion", True) and get("add_bias_linear", True)
    return "gelu_tanh" if fused else "gelu"


def model_overrides(args, legacy=False):
    """This project's model_config overrides (section.key=value) for the GPT Megatron's `args`
    describe; ConfigError naming every setting this project cannot hold."""
    get = vars(args).get
    rope = get("position_embedding_type") == "rope" or bool(get("use_rotary_position_embeddings"))
    refused = [f"args.{k}={get(k)!r} ({what})" for k, bad, what in UNSUPPORTED
               if bad(get(k)) and (rope or k not in ROPE_SETTINGS)]
    heads, hidden = get("num_attention_heads"), get("hidden_size")
    if None in (heads, hidden, get("num_layers"), get("padded_vocab_size"), get("seq_length")):
        raise ConfigError("its args lack num_layers, hidden_size, num_attention_heads, seq_length "
                          "or padded_vocab_size: not the args of a Megatron-LM GPT")
    if get("kv_channels") not in (None, hidden // heads):
        refused.append(f"args.kv_channels={get('kv_channels')} (heads of another size than "
                       f"hidden_size / num_attention_heads = {hidden // heads})")
    etp, tp = get("expert_tensor_parallel_size"), get("tensor_model_parallel_size", 1)
    if get("num_experts") and etp not in (None, tp):
        refused.append(f"args.expert_tensor_parallel_size={etp} (experts split over another TP "
                       f"size than tensor_model_parallel_size={tp})")
    if refused:
        raise ConfigError(f"this project's GPT cannot hold {', '.join(refused)}")
    gqa = bool(get("group_query_attention")) and get("num_query_groups") not in (None, heads)
    bias = get("add_bias_linear", True)
    values = {"num_layers": get("num_layers"), "hidden_size": hidden,
              "ffn_hidden_size": get("ffn_hidden_size") or 4 * hidden,
              "num_attention_heads": heads, "group_query_attention": gqa,
              "seq_length": get("seq_length"),
              "max_position_embeddings": get("max_position_embeddings") or get("seq_length"),
              "vocab_size": get("padded_vocab_size"),
              "position_embedding_type": "rope" if rope else "absolute",
              "rotary_base": get("rotary_base", 10000),
              "normalization": get("normalization") or "LayerNorm",
              "norm_epsilon": get("norm_epsilon", get("layernorm_epsilon", 1e-5)),
              "hidden_act": _hidden_act(args, legacy), "add_bias_linear": bias,
              "out_proj_has_bias": bias, "qkv_has_bias": bias or get("add_qkv_bias", False),
              "untie_embeddings_and_output_weights": get("untie_embeddings_and_output_weights",
                                                         False),
              "use_sandwich_norm": False,
              "hidden_dropout_rate": get("hidden_dropout", 0.1),
              "attention_dropout_rate": get("attention_dropout", 0.1),
              "init_method_std": get("init_method_std", 0.02),
              "fp32_residual_connection": get("fp32_residual_connection", False)}
    if gqa:
        values["num_query_groups"] = get("num_query_groups")
    values.update(_moe_values(get))
    return [f"model_config.{k}={str(v).lower() if isinstance(v, bool) else v}"
            for k, v in values.items()]


# how Megatron ran its experts, not what they compute: not carried into this project's config
MOE_SPEED_ONLY = ("moe_permute_fusion", "moe_enable_deepep", "moe_shared_expert_overlap",
                  "overlap_moe_expert_parallel_comm")


def _moe_values(get):
    """model_overrides' MoE part: this project's MoE keys from Megatron's args (`get` reads
    them), when the args have experts; unset (None) ones keep this project's defaults, which are
    Megatron's. The flex dispatcher (DeepEP) routes and sums as allgather does: read as that."""
    if not get("num_experts"):
        return {}
    values = {key: _single(get(arg)) for key, arg in MOE_ARGS.items()
              if get(arg) is not None and key not in MOE_SPEED_ONLY}
    if values.get("moe_token_dispatcher_type") not in (None, "allgather", "alltoall"):
        values["moe_token_dispatcher_type"] = "allgather"
    return values


def tokenizer_overrides(args, padded):
    """(dataset_config overrides, a note or None) for the tokenizer of Megatron's `args`.
    GPT2BPETokenizer: its --vocab-file/--merge-file where they exist, else the project's copies
    of GPT-2's (the same files). NullTokenizer (ids as text): Megatron's older one has
    vocab_size + 1 ids (its eod the last), as this project's has; Megatron-core's newer one has
    vocab_size (eod = vocab_size - 1), taken when the first would not fit the padded vocabulary.
    A tokenizer this project lacks: NullTokenizer over the padded vocabulary, with a note."""
    kind, size = getattr(args, "tokenizer_type", None), getattr(args, "vocab_size", None)
    if kind == "GPT2BPETokenizer":
        out = [f"dataset_config.tokenizer_type={kind}"]
        for key, name in (("vocab_file", "gpt2-vocab.json"), ("merge_file", "gpt2-merges.txt")):
            given = getattr(args, key, None)
            found = given if given and os.path.isfile(given) else os.path.join(PROJECT, "data",
                                                                                name)
            out.append(f"dataset_config.{key}={found}")
        return out, None
    if kind == "NullTokenizer" and size:
        size = int(size) if int(size) < padded else int(size) - 1
        return [f"dataset_config.tokenizer_type={kind}", f"dataset_config.vocab_size={size}"], None
    note = (f"its tokenizer {kind} is not in this project: ids 0..{padded - 2} as text "
            "(NullTokenizer); give --tokenizer-type and its files to choose another")
    return ["dataset_config.tokenizer_type=NullTokenizer",
            f"dataset_config.vocab_size={padded - 1}"], note


# ----------------------------------------------------------------------------- the folder
def checkpoint_folder(root):
    """(iteration, folder) of the checkpoint that root's latest_checkpointed_iteration.txt names
    (Megatron's read_metadata: "release" is iteration 0 in release/)."""
    tracker = os.path.join(root, LATEST)
    if not os.path.isfile(tracker):
        raise CheckpointError(f"no Megatron-LM checkpoint in {root}: {LATEST} is missing")
    text = open(tracker).read().strip()
    if text != "release" and not text.isdigit():
        raise CheckpointError(f"{tracker} holds {text!r:.40}, not an iteration number or release")
    iteration = 0 if text == "release" else int(text)
    folder = os.path.join(root, "release") if text == "release" else iteration_dir(root, iteration)
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder} is missing: {tracker} names it")
    return iteration, folder


def checkpoint_files(root):
    """(iteration, {(tp_rank, pp_rank, ep_rank): path of model_optim_rng.pt}, rank 0's state) of
    the --ckpt-format torch checkpoint that root's tracker names (checkpoint_folder; Megatron's
    get_checkpoint_name: mp_rank_TT[_PPP][_EEE]), every rank's file present. mp_rank_TT_NNN is a
    pipeline stage, or an EP rank when rank 0's args have experts split over EP and one stage."""
    iteration, folder = checkpoint_folder(root)
    entries = sorted(os.listdir(folder))
    ranks = {e: [int(g.strip("_")) for g in m.groups() if g]
             for e, m in ((e, RANK_DIR.fullmatch(e)) for e in entries) if m}
    if not ranks:
        raise CheckpointError(f"{folder} holds no mp_rank_* folders and no .metadata: not a "
                              "Megatron-LM checkpoint (--ckpt-format torch or torch_dist)")
    zero = next((e for e in ranks if not any(ranks[e])), shard_name())
    first = load_rank(_present(os.path.join(folder, zero, WEIGHTS_FILE)))
    get = vars(first["args"]).get
    experts_alone = (get("pipeline_model_parallel_size") or 1) == 1 and \
        (get("expert_model_parallel_size") or 1) > 1
    keys = {}
    for entry, numbers in ranks.items():
        rest = ([0] if experts_alone and len(numbers) == 2 else []) + numbers[1:]
        keys[(numbers[0], *(rest + [0, 0])[:2])] = entry
    tp, pp, ep = folder_sizes(keys)
    files = {}
    for key in itertools.product(range(tp), range(pp), range(ep)):
        default = shard_name(key[0], key[1], pp, key[2], ep)
        files[key] = _present(os.path.join(folder, keys.get(key, default), WEIGHTS_FILE))
    return iteration, files, first


def _present(path):
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
    return path


def folder_sizes(files):
    """(tp, pp, ep) of a checkpoint's {(tp_rank, pp_rank, ep_rank): ...} rank files."""
    return tuple(1 + max(key[i] for key in files) for i in range(3))


def load_rank(path):
    """One rank's model_optim_rng.pt, checked to be Megatron's: a dict with args and a model."""
    try:
        state = torch_format.load(path)
    except torch_format.TorchFormatError as e:
        raise CheckpointError(str(e)) from None
    if not isinstance(state, dict) or not model_chunks(state):
        keys = list(state)[:6] if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{path} holds no model (it holds {keys}): not a Megatron-LM "
                              f"{WEIGHTS_FILE}")
    version = state.get("checkpoint_version", 0)
    if not isinstance(version, (int, float)) or version < 2:
        raise CheckpointError(f"{path} has checkpoint_version {version}: its query_key_value rows "
                              "predate Megatron's per-group layout (version 2); load and save it "
                              "again with Megatron-LM first")
    if not isinstance(state.get("args"), argparse.Namespace):
        raise CheckpointError(f"{path} holds no args (the run's argparse.Namespace)")
    return state


def is_legacy(state):
    return any(k.startswith("language_model.") for chunk in model_chunks(state) for k in chunk)


def checkpoint_overrides(state, path, tp, pp, ep=1):
    """(this project's overrides for the model and tokenizer, a note or None) from the args of
    the rank file `state` (read from `path`), checked against the folder's tp x pp x ep ranks."""
    args = state["args"]
    saved = (vars(args).get("tensor_model_parallel_size", 1),
             vars(args).get("pipeline_model_parallel_size", 1))
    if saved != (tp, pp):
        raise CheckpointError(f"{path}: its args say tensor x pipeline parallel {saved[0]} x "
                              f"{saved[1]}, the folder holds {tp} x {pp} ranks: incomplete")
    if (vars(args).get("expert_model_parallel_size") or 1) != ep:
        raise CheckpointError(f"{path}: its args say expert_model_parallel_size="
                              f"{vars(args).get('expert_model_parallel_size')}, the folder holds "
                              f"{ep} EP ranks (_EEE): incomplete")
    try:
        model = model_overrides(args, is_legacy(state))
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    tokenizer, note = tokenizer_overrides(args, int(vars(args)["padded_vocab_size"]))
    return model + tokenizer, note


def layer_offsets(stage_states):
    """Per pipeline stage (its TP rank 0 file in `stage_states`), the first global layer of each
    of its chunks, counted from the layers the files hold: Megatron numbers layers chunk by
    chunk over the stages (chunk 0 of stages 0, 1, ..., then chunk 1 of each; megatron/core/
    transformer/transformer_layer.py, get_transformer_layer_offset), uneven stages included."""
    counts = [[len({LAYER_NUMBER.match(n).group(1) for n in chunk if LAYER_NUMBER.match(n)})
               for chunk in model_chunks(state)] for state in stage_states]
    if len({len(c) for c in counts}) != 1:
        raise CheckpointError(f"the pipeline stages hold {[len(c) for c in counts]} model chunks: "
                              "every stage of a virtual pipeline holds as many")
    offsets, start = [[0] * len(counts[0]) for _ in counts], 0
    for chunk in range(len(counts[0])):
        for stage, stage_counts in enumerate(counts):
            offsets[stage][chunk], start = start, start + stage_counts[chunk]
    return offsets


def _float32(value, name):
    if isinstance(value, torch_format.BFloat16):
        return value.float32()
    if not isinstance(value, np.ndarray) or value.dtype.kind != "f":
        raise CheckpointError(f"{name} is {type(value).__name__}, not a floating-point tensor")
    return np.ascontiguousarray(value, np.float32)


def check_shards(shards, shapes, tp):
    """Every TP rank holds every weight, each a 1/tp piece of one dimension or replicated."""
    for rank, shard in enumerate(shards):
        missing = sorted(set(shapes) - set(shard)) or sorted(set(shard) - set(shapes))
        if missing:
            what = "lack" if missing[0] in shapes else "hold"
            raise CheckpointError(f"the files of TP rank {rank} {what} {missing[0]}: the weights "
                                  "do not fit the model their args describe")
        for name, shape in shapes.items():
            got = shard[name].shape
            split = [dim for dim, (a, b) in enumerate(zip(got, shape)) if a != b]
            piece = not split or got[split[0]] * tp == shape[split[0]]
            if len(got) != len(shape) or len(split) > 1 or not piece:
                raise CheckpointError(f"{name} of TP rank {rank} has shape {got}, which is no "
                                      f"1/{tp} piece of the model's {shape}")


def read_weights(files, shapes, model_cfg, first=None):
    """{"model.<name>": float32 array} of the rank files `files` ({(tp_rank, pp_rank, ep_rank):
    path}), as one process of this project holds them (TP shards merged, stages, chunks and EP
    ranks united: each EP rank's file holds the dense weights and its own experts, numbered
    globally here; the tied last stage's copy of the embedding dropped), checked against the
    one-process `shapes` ({"model.<name>": shape}) of `model_cfg`'s model. `first`: rank
    (0, 0, 0)'s state, when already loaded."""
    tp, pp, ep = folder_sizes(files)
    states = {key: first if key == (0, 0, 0) and first is not None else load_rank(path)
              for key, path in files.items()}
    offsets = layer_offsets([states[0, pp_rank, 0] for pp_rank in range(pp)])
    shards = []
    for tp_rank in range(tp):
        shard = {}
        for pp_rank, ep_rank in itertools.product(range(pp), range(ep)):
            key = tp_rank, pp_rank, ep_rank
            start = moe.first_expert(model_cfg.num_moe_experts, ep, ep_rank)
            named = rank_tensors(states[key], offsets[pp_rank], start).items()
            shard.update({k: _float32(v, f"{files[key]}: {k}") for k, v in named})
        if not model_cfg.untie_embeddings_and_output_weights:
            shard.pop("model.output_layer.weight", None)
        shards.append(shard)
    check_shards(shards, shapes, tp)
    return merge_tensor_parallel(shards, shapes, lambda name: tp_chunks(model_cfg, name))


def tp_chunks(model_cfg, name):
    """The blocks of a parameter (any prefix and layer) split over TP, each on its own: fc1's,
    config.fc1_chunks; one for every other."""
    return fc1_chunks(model_cfg) if "linear_fc1" in name else 1


def weights_dtype(state):
    """The dtype of a rank file's weights, as text (bfloat16 included)."""
    value = next(v for v in model_chunks(state)[0].values() if v is not None)
    return "bfloat16" if isinstance(value, torch_format.BFloat16) else str(value.dtype)


# ----------------------------------------------------------------------------- this project's runs
def megatron_args(cfg, iteration, consumed):
    """A run of this project as Megatron-LM's args (megatron/training/arguments.py names), as its
    save_checkpoint stores them: the model and tokenizer (what check_checkpoint_args compares and
    --use-checkpoint-args reads), the layout, the precision, the schedule, the data consumed. This
    project pads the vocabulary to make_vocab_size_divisible_by alone, Megatron to it x TP: the
    divisor stored is ours / TP, so that Megatron's padding gives the same rows."""
    parallel_cfg = cfg.parallel_config
    vpp = parallel_cfg.virtual_pipeline_model_parallel_size
    model = _megatron_model_args(cfg.model_config, parallel_cfg.tensor_model_parallel_size)
    precision = _megatron_precision_args(cfg.model_config, cfg.training_config)
    layout = dict(
        tensor_model_parallel_size=parallel_cfg.tensor_model_parallel_size,
        expert_model_parallel_size=parallel_cfg.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel_cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel_cfg.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        context_parallel_size=parallel_cfg.context_parallel_size,
        sequence_parallel=parallel_cfg.sequence_parallel,
        data_parallel_size=parallel_cfg.data_parallel_size, use_distributed_optimizer=False)
    run = _megatron_run_args(cfg, iteration, consumed)
    return argparse.Namespace(**model, **precision, **layout, **run)


def _megatron_model_args(model_cfg, tp):
    """megatron_args' model part, for a run of `tp` tensor-parallel ranks."""
    rope = model_cfg.position_embedding_type == "rope"
    gelu_tanh = model_cfg.hidden_act == "gelu_tanh"
    return dict(
        num_layers=model_cfg.num_layers, hidden_size=model_cfg.hidden_size,
        ffn_hidden_size=model_cfg.ffn_hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        group_query_attention=model_cfg.group_query_attention,
        num_query_groups=model_cfg.num_query_groups,
        kv_channels=model_cfg.hidden_size // model_cfg.num_attention_heads,
        seq_length=model_cfg.seq_length, max_position_embeddings=model_cfg.max_position_embeddings,
        padded_vocab_size=model_cfg.padded_vocab_size,
        make_vocab_size_divisible_by=model_cfg.make_vocab_size_divisible_by // tp,
        position_embedding_type="rope" if rope else "learned_absolute",
        use_rotary_position_embeddings=rope, rotary_base=model_cfg.rotary_base, rotary_percent=1.0,
        normalization=model_cfg.normalization, norm_epsilon=model_cfg.norm_epsilon,
        swiglu=model_cfg.hidden_act == "swiglu", openai_gelu=gelu_tanh, bias_gelu_fusion=gelu_tanh,
        add_bias_linear=model_cfg.add_bias_linear, add_qkv_bias=model_cfg.qkv_has_bias,
        untie_embeddings_and_output_weights=model_cfg.untie_embeddings_and_output_weights,
        hidden_dropout=model_cfg.hidden_dropout_rate,
        attention_dropout=model_cfg.attention_dropout_rate,
        init_method_std=model_cfg.init_method_std,
        fp32_residual_connection=model_cfg.fp32_residual_connection,
        apply_query_key_layer_scaling=model_cfg.apply_query_key_layer_scaling,
        attention_softmax_in_fp32=model_cfg.attention_softmax_in_fp32,
        fp16_lm_cross_entropy=model_cfg.fp16_lm_cross_entropy, transformer_impl="local",
        **{arg: getattr(model_cfg, key) for key, arg in MOE_ARGS.items()})


def _megatron_precision_args(model_cfg, training_cfg):
    """megatron_args' precision and loss-scaling part."""
    return dict(
        fp16=model_cfg.compute_dtype == "float16", bf16=model_cfg.compute_dtype == "bfloat16",
        params_dtype=torch_format.TorchDtype(model_cfg.params_dtype),
        accumulate_allreduce_grads_in_fp32=training_cfg.accumulate_allreduce_grads_in_fp32,
        loss_scale=training_cfg.loss_scale, initial_loss_scale=training_cfg.loss_scale_value,
        min_loss_scale=training_cfg.min_loss_scale,
        loss_scale_window=training_cfg.loss_scale_window, hysteresis=training_cfg.hysteresis)


def _megatron_run_args(cfg, iteration, consumed):
    """megatron_args' batch, schedule, optimizer, tokenizer and progress part."""
    dataset_cfg, training_cfg = cfg.dataset_config, cfg.training_config
    optimizer_cfg = cfg.optimizer_config
    schedule = optimizer_cfg.learning_rate_scheduler_kwargs
    return dict(
        micro_batch_size=dataset_cfg.batch_size, global_batch_size=dataset_cfg.global_batch_size,
        seed=training_cfg.seed, train_iters=training_cfg.training_iters,
        train_samples=training_cfg.train_samples,
        rampup_batch_size=dataset_cfg.rampup_batch_size,
        lr_warmup_samples=schedule.lr_warmup_samples, lr_decay_samples=schedule.lr_decay_samples,
        lr_wsd_decay_samples=schedule.lr_wsd_decay_samples,
        lr=optimizer_cfg.learning_rate, min_lr=schedule.min_lr,
        lr_decay_style=schedule.lr_decay_style, lr_warmup_iters=schedule.lr_warmup_iters,
        lr_warmup_fraction=schedule.lr_warmup_fraction, lr_decay_iters=schedule.lr_decay_iters,
        lr_warmup_init=schedule.lr_warmup_init, lr_wsd_decay_style=schedule.lr_wsd_decay_style,
        lr_wsd_decay_iters=schedule.lr_wsd_decay_iters, weight_decay=optimizer_cfg.weight_decay,
        start_weight_decay=optimizer_cfg.start_weight_decay,
        end_weight_decay=optimizer_cfg.end_weight_decay,
        weight_decay_incr_style=optimizer_cfg.weight_decay_incr_style,
        clip_grad=training_cfg.grad_clip_kwargs.clip_value, adam_beta1=optimizer_cfg.betas[0],
        adam_beta2=optimizer_cfg.betas[1], adam_eps=optimizer_cfg.eps,
        sgd_momentum=optimizer_cfg.momentum,
        optimizer="sgd" if optimizer_cfg.optimizer_type == "SGD" else "adam",
        tokenizer_type=dataset_cfg.tokenizer_type, vocab_file=dataset_cfg.vocab_file,
        merge_file=dataset_cfg.merge_file, vocab_size=dataset_cfg.vocab_size,
        iteration=iteration, consumed_train_samples=consumed, consumed_valid_samples=0,
        ckpt_format="torch", save=training_cfg.output_dir,
        load=training_cfg.load_checkpoint or None)


def param_groups(names, shapes):
    """Megatron's parameter groups of a rank's parameters `names` (in its model order):
    [weights with weight decay, biases and 1-D weights without] (get_param_groups), empty ones
    left out; each [(name, wd_mult)]."""
    groups = [[(n, 1.0) for n in names if not no_weight_decay(n, shapes[n])],
              [(n, 0.0) for n in names if no_weight_decay(n, shapes[n])]]
    return [g for g in groups if g]


def megatron_optimizer(arrays, step, names, shapes, cfg, scaler_state):
    """This rank's optimizer state (`arrays`: "optimizer.<kind>.<name>", "main.<name>"; the
    inner optimizer's step) as Megatron's optimizer.state_dict() (megatron/core/optimizer/
    optimizer.py): FP32Optimizer's torch.optim state dict, or for half-precision parameters
    Float16OptimizerWithFloat16Params' {optimizer, grad_scaler, fp32_from_fp16_params}. With
    routed experts, get_megatron_optimizer's ChainedOptimizer of a dense and an expert optimizer
    (optimizer/__init__.py:1170-1264, the experts' param_groups is_expert_parallel): its
    state_dict is the list of theirs (optimizer.py:1567-1571), each indexing its own parameters
    from 0."""
    parts = expert_split(names)
    states = [_one_optimizer(arrays, step, part, shapes, cfg, scaler_state, experts)
              for experts, part in enumerate(parts) if part]
    return states[0] if len(states) == 1 else states


def expert_split(names):
    """[dense names, routed experts' names] of a rank's parameters, each in model order."""
    return [[n for n in names if not moe.is_expert(n)], [n for n in names if moe.is_expert(n)]]


def _one_optimizer(arrays, step, names, shapes, cfg, scaler_state, experts):
    """megatron_optimizer's state dict of one optimizer over `names`. The torch indices run over
    param_groups in order; Adam keeps its step per parameter (torch), SGD, which has none there,
    in its group."""
    optimizer_cfg = cfg.optimizer_config
    schedule = optimizer_cfg.learning_rate_scheduler_kwargs
    sgd = optimizer_cfg.optimizer_type == "SGD"
    kinds = sorted({k.split(".")[1] for k in arrays if k.startswith("optimizer.")})
    state, groups, index = {}, [], 0
    for group in param_groups(names, shapes):
        for name, _ in group:
            state[len(state)] = dict(
                ({"step": np.array(float(step), np.float32)} if not sgd else {}),
                **{k: arrays[f"optimizer.{k}.{name}"] for k in kinds})
        mult = group[0][1]
        momentum = {"momentum": optimizer_cfg.momentum, "step": step} if sgd else {}
        groups.append({"lr": optimizer_cfg.learning_rate, "betas": tuple(optimizer_cfg.betas),
                       "eps": optimizer_cfg.eps, "weight_decay": optimizer_cfg.weight_decay * mult,
                       "wd_mult": mult, "lr_mult": 1.0,
                       "is_expert_parallel": bool(experts), "is_decoupled_lr": False,
                       "default_config": True, "max_lr": optimizer_cfg.learning_rate,
                       "min_lr": schedule.min_lr,
                       **momentum,
                       "params": list(range(index, index + len(group)))})
        index += len(group)
    torch_state = {"state": state, "param_groups": groups}
    if cfg.model_config.params_dtype == "float32":
        return torch_state
    scaler = {k: np.array(v, np.float32) if k == "scale" else v for k, v in scaler_state.items()}
    return {"optimizer": torch_state, "grad_scaler": scaler,
            "fp32_from_fp16_params": [[arrays[f"main.{n}"] for n, _ in g]
                                      for g in param_groups(names, shapes)]}


def optimizer_arrays(saved, names, shapes, path="the file"):
    """The inverse of megatron_optimizer: ({"optimizer.<kind>.<name>", "main.<name>": array},
    step) of a rank whose parameters are `names`, in its model order."""
    parts = [part for part in expert_split(names) if part]
    saved = saved if isinstance(saved, list) else [saved]
    if len(saved) != len(parts):
        raise CheckpointError(f"{path} holds {len(saved)} optimizer state dicts, its model "
                              f"{len(parts)} (dense, experts): not written for this model")
    arrays, step = {}, 0
    for state, part in zip(saved, parts):
        half = "fp32_from_fp16_params" in state
        torch_state = state["optimizer"] if half else state
        for g, (group, saved_group) in enumerate(zip(param_groups(part, shapes),
                                                     torch_state["param_groups"])):
            for (name, _), index in zip(group, saved_group["params"]):
                entry = dict(torch_state["state"].get(index, {}))
                step = int(entry.pop("step", saved_group.get("step", step)))
                arrays.update({f"optimizer.{k}.{name}": v for k, v in entry.items()})
            if half:
                masters = state["fp32_from_fp16_params"][g]
                arrays.update({f"main.{n}": v for (n, _), v in zip(group, masters)})
    return arrays, step


def rank_file(cfg, meta, tensors, offsets, ep_rank=0):
    """One rank's model_optim_rng.pt as Megatron's save_checkpoint assembles it (megatron/
    training/checkpointing.py, generate_state_dict): args, checkpoint_version 3.0, iteration,
    the model (rank_model_state), and when `meta` has an optimizer step its optimizer
    (megatron_optimizer), lr schedule and RNG state: the dropout streams stand for Megatron's RNG
    tracker (numpy states, not torch's: Megatron reads the file with --no-load-rng). `tensors`:
    the rank's "model.<name>", "optimizer.<kind>.<name>", "main.<name>" arrays (global names);
    `meta`: checkpoint.py's (iteration, consumed samples, optimizer step, scheduler, scaler,
    RNG); `offsets`: the first global layer of each of the rank's chunks; `ep_rank`: the EP rank
    whose experts `tensors` hold (their indices local to it in the file)."""
    model = {k: v for k, v in tensors.items() if k.startswith("model.")}
    start = moe.first_expert(cfg.model_config.num_moe_experts,
                             cfg.parallel_config.expert_model_parallel_size, ep_rank)
    state = {"args": megatron_args(cfg, meta["iteration"], meta["consumed_train_samples"]),
             "checkpoint_version": 3.0, "iteration": meta["iteration"],
             **rank_model_state(model, offsets, start)}
    if meta.get("optimizer_step") is not None:
        names = [k[len("model."):] for k in rank_tensors(state, offsets, start)
                 if not moe.is_expert_bias(k)]                  # the optimizer's parameters
        shapes = {n: model[f"model.{n}"].shape for n in names}
        state["optimizer"] = megatron_optimizer(tensors, meta["optimizer_step"], names, shapes, cfg,
                                                meta["grad_scaler"])
        state["opt_param_scheduler"] = megatron_scheduler_state(
            meta["opt_param_scheduler"],
            1 if sample_based(cfg.training_config) else cfg.dataset_config.global_batch_size)
        state["rng_state"] = [{"rng_tracker_states": meta["rng_state"]}]
    state["num_floating_point_operations_so_far"] = 0
    return state


def megatron_scheduler_state(state, global_batch_size):
    """The schedule's state as Megatron's OptimizerParamScheduler.state_dict holds it: its step
    counts in samples, an iteration being global_batch_size of them (this project counts
    iterations but in sample-based training, where `global_batch_size` is 1:
    config.lr_schedule_steps)."""
    steps = ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps", "wsd_decay_steps")
    return {k: v * global_batch_size if k in steps and v is not None else v
            for k, v in state.items()}


def rank_arrays(state, offsets, ep_rank=0, path="the file"):
    """The inverse of rank_file for this project's loader: the rank's "model.<name>" arrays (the
    experts of EP rank `ep_rank` under global names, by the file's args) and, if saved, its
    optimizer's ("optimizer.<kind>.<name>", "main.<name>")."""
    get = vars(state["args"]).get
    start = moe.first_expert(get("num_experts"), get("expert_model_parallel_size") or 1, ep_rank)
    arrays = rank_tensors(state, offsets, start)
    if "optimizer" in state:
        names = [k[len("model."):] for k in arrays if not moe.is_expert_bias(k)]
        shapes = {n: arrays[f"model.{n}"].shape for n in names}
        arrays.update(optimizer_arrays(state["optimizer"], names, shapes, path)[0])
    return arrays


def merge_tensor_parallel(shards, full_shapes, chunks_of=lambda name: 1):
    """Full tensors from the per-TP-rank `shards` (list of name -> array, TP rank order). A
    tensor whose shard is smaller than its full shape was split along that dimension (in
    `chunks_of(name)` blocks, e.g. 2 for SwiGLU's [gate; up]); the others are replicated."""
    merged = {}
    for name, shape in full_shapes.items():
        parts = [s[name] for s in shards]
        split = [axis for axis, (a, b) in enumerate(zip(parts[0].shape, shape)) if a != b]
        if not split:
            merged[name] = parts[0]
            continue
        dim, chunks = split[0], chunks_of(name)
        blocks = [np.concatenate([np.split(part, chunks, axis=dim)[c] for part in parts], axis=dim)
                  for c in range(chunks)]
        merged[name] = np.concatenate(blocks, axis=dim)
    return merged


if __name__ == "__main__":          # imported by train.py, not a script
    raise SystemExit("error: megatron_checkpoint.py is a library: run "
                     "`bash run.sh import-megatron ...` (bash run.sh --help lists the commands)")
