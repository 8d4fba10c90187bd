"""The command line: Megatron-LM's flags mapped onto the YAML keys (the MindSpeed-Core-MS table,
`MEGATRON_FLAGS`) and dotted `section.key=value` overrides for training (`load_config`), and one
mechanism for every other command's flags with --help (`parse_command`).

Every bad flag or value raises ConfigError with one line naming it and the fix.
"""
import os

import yaml

from config import (SCHEMA, ConfigError, all_keys, finalize, merge, schema_default, suggest,
                    to_namespace)

_LR = "optimizer_config.learning_rate_scheduler_kwargs."
# Megatron-LM flag -> YAML key, or (key, value) for a switch, or a list of those.
MEGATRON_FLAGS = {
    "--num-layers": "model_config.num_layers",
    "--hidden-size": "model_config.hidden_size",
    "--ffn-hidden-size": "model_config.ffn_hidden_size",
    "--num-attention-heads": "model_config.num_attention_heads",
    "--group-query-attention": ("model_config.group_query_attention", True),
    "--num-query-groups": "model_config.num_query_groups",
    "--seq-length": "model_config.seq_length",
    "--max-position-embeddings": "model_config.max_position_embeddings",
    "--make-vocab-size-divisible-by": "model_config.make_vocab_size_divisible_by",
    "--position-embedding-type": "model_config.position_embedding_type",
    "--use-rotary-position-embeddings": ("model_config.position_embedding_type", "rope"),
    "--rotary-base": "model_config.rotary_base",
    "--normalization": "model_config.normalization",
    "--norm-epsilon": "model_config.norm_epsilon",
    "--swiglu": ("model_config.hidden_act", "swiglu"),
    "--openai-gelu": ("model_config.hidden_act", "gelu_tanh"),
    "--add-qkv-bias": ("model_config.qkv_has_bias", True),
    "--disable-bias-linear": [("model_config.add_bias_linear", False),
                              ("model_config.qkv_has_bias", False),
                              ("model_config.out_proj_has_bias", False)],
    "--untie-embeddings-and-output-weights": ("model_config.untie_embeddings_and_output_weights", True),
    "--use-sandwich-norm": ("model_config.use_sandwich_norm", True),
    "--attn-post-norm-scale": "model_config.attn_post_norm_scale",
    "--ffn-post-norm-scale": "model_config.ffn_post_norm_scale",
    "--attention-dropout": "model_config.attention_dropout_rate",
    "--hidden-dropout": "model_config.hidden_dropout_rate",
    "--init-method-std": "model_config.init_method_std",
    "--attention-softmax-in-fp32": ("model_config.attention_softmax_in_fp32", True),
    "--no-attention-softmax-in-fp32": ("model_config.attention_softmax_in_fp32", False),
    "--apply-query-key-layer-scaling": ("model_config.apply_query_key_layer_scaling", True),
    "--fp16-lm-cross-entropy": ("model_config.fp16_lm_cross_entropy", True),
    "--fp32-residual-connection": ("model_config.fp32_residual_connection", True),
    "--recompute-granularity": "model_config.recompute_granularity",
    "--recompute-method": "model_config.recompute_method",
    "--recompute-num-layers": "model_config.recompute_num_layers",
    "--recompute-activations": ("model_config.recompute_granularity", "selective"),   # Megatron's shorthand
    "--micro-batch-size": "dataset_config.batch_size",
    "--global-batch-size": "dataset_config.global_batch_size",
    "--data-path": "dataset_config.data_path",
    "--split": "dataset_config.split",
    "--mock-data": ("dataset_config.mock_data", True),
    "--tokenizer-type": "dataset_config.tokenizer_type",
    "--vocab-file": "dataset_config.vocab_file",
    "--merge-file": "dataset_config.merge_file",
    "--vocab-size": "dataset_config.vocab_size",
    "--reset-position-ids": ("dataset_config.reset_position_ids", True),
    "--reset-attention-mask": ("dataset_config.reset_attention_mask", True),
    "--eod-mask-loss": ("dataset_config.eod_mask_loss", True),
    "--data-cache-path": "dataset_config.data_cache_path",
    "--train-iters": "training_config.training_iters",
    "--seed": "training_config.seed",
    "--log-interval": "training_config.log_interval",
    "--eval-interval": "training_config.eval_interval",
    "--eval-iters": "training_config.eval_iters",
    "--save": "training_config.output_dir",
    "--load": "training_config.load_checkpoint",
    "--save-interval": "training_config.save_interval",
    "--ckpt-format": "training_config.ckpt_format",
    "--no-load-optim": ("training_config.no_load_optim", True),
    "--no-load-rng": ("training_config.no_load_rng", True),
    "--finetune": ("training_config.finetune", True),
    "--exit-interval": "training_config.exit_interval",
    "--exit-duration-in-mins": "training_config.exit_duration_in_mins",
    "--exit-signal-handler": ("training_config.exit_signal_handler", True),
    "--use-checkpoint-opt_param-scheduler": ("optimizer_config.use_checkpoint_opt_param_scheduler", True),
    "--override-opt_param-scheduler": ("optimizer_config.override_opt_param_scheduler", True),
    "--fp16": ("training_config.fp16", True),
    "--no-jit": ("training_config.use_jit", False),
    "--bf16": ("training_config.bf16", True),
    "--accumulate-allreduce-grads-in-fp32": ("training_config.accumulate_allreduce_grads_in_fp32", True),
    "--loss-scale": "training_config.loss_scale",
    "--initial-loss-scale": "training_config.loss_scale_value",
    "--min-loss-scale": "training_config.min_loss_scale",
    "--loss-scale-window": "training_config.loss_scale_window",
    "--hysteresis": "training_config.hysteresis",
    "--clip-grad": "training_config.grad_clip_kwargs.clip_value",
    "--lr": "optimizer_config.learning_rate",
    "--min-lr": _LR + "min_lr",
    "--lr-decay-style": _LR + "lr_decay_style",
    "--lr-warmup-iters": _LR + "lr_warmup_iters",
    "--lr-warmup-fraction": _LR + "lr_warmup_fraction",
    "--lr-decay-iters": _LR + "lr_decay_iters",
    "--weight-decay": "optimizer_config.weight_decay",
    "--start-weight-decay": "optimizer_config.start_weight_decay",
    "--end-weight-decay": "optimizer_config.end_weight_decay",
    "--weight-decay-incr-style": "optimizer_config.weight_decay_incr_style",
    "--optimizer": "optimizer_config.optimizer_type",
    "--adam-beta1": "optimizer_config.betas.0",
    "--adam-beta2": "optimizer_config.betas.1",
    "--adam-eps": "optimizer_config.eps",
    "--sgd-momentum": "optimizer_config.momentum",
    "--tensor-model-parallel-size": "parallel_config.tensor_model_parallel_size",
    "--pipeline-model-parallel-size": "parallel_config.pipeline_model_parallel_size",
    "--context-parallel-size": "parallel_config.context_parallel_size",
    "--context-parallel-algo": "parallel_config.context_parallel_algo",       # MindSpeed
    "--ulysses-degree-in-cp": "parallel_config.ulysses_degree_in_cp",         # MindSpeed
    "--cp-comm-type": "parallel_config.context_parallel_algo",                # Megatron-core, mapped below
    "--num-layers-per-virtual-pipeline-stage": "parallel_config.num_layers_per_virtual_pipeline_stage",
    "--virtual-pipeline-model-parallel-size": "parallel_config.virtual_pipeline_model_parallel_size",
    "--sequence-parallel": ("parallel_config.sequence_parallel", True),
    "--use-distributed-optimizer": ("training_config.use_distributed_optimizer", True),
    "--ddp-bucket-size": "training_config.bucket_size",
    "--profile": ("training_config.profile", True),
    "--profile-step-start": "training_config.profile_step_start",
    "--profile-step-end": "training_config.profile_step_end",
    "--profile-ranks": "training_config.profile_ranks",
}
_MEGATRON_OPTIMIZER = {"adam": "AdamW", "sgd": "SGD"}   # Megatron's "adam" is AdamW
# Megatron-core's --cp-comm-type -> MindSpeed's algorithm: p2p and all_gather are both ring attention
_CP_COMM_TYPES = {"p2p": "megatron_cp_algo", "all_gather": "megatron_cp_algo", "a2a": "ulysses_cp_algo",
                  "a2a+p2p": "hybrid_cp_algo"}

# MindFormers' parallel keys (the GPT2-13B guide's run_gpt2_13b.yaml) -> this project's key, or
# (the one value that needs nothing here, a pointer to what to use instead). In a YAML or as
# section.key=value.
MINDFORMERS_KEYS = {
    "parallel_config.data_parallel": "parallel_config.data_parallel_size",
    "parallel_config.model_parallel": "parallel_config.tensor_model_parallel_size",
    "parallel_config.pipeline_stage": "parallel_config.pipeline_model_parallel_size",
    "parallel_config.micro_batch_num": "dataset_config.micro_batch_num",
    "parallel_config.optimizer_shard": "training_config.use_distributed_optimizer",
    "parallel_config.use_seq_parallel": "parallel_config.sequence_parallel",
    "recompute_config.recompute": "parallel_config.recompute",
    "recompute_config.select_recompute": "parallel_config.select_recompute",
    "parallel_config.vocab_emb_dp": (False, "the embedding is always split over the vocabulary by tensor "
                                            "parallelism (Megatron's VocabParallelEmbedding); remove the key"),
    "parallel_config.gradient_aggregation_group": (None, "gradients are reduced in buckets of "
                                                         "training_config.bucket_size elements (--ddp-bucket-size); "
                                                         "use that instead"),
    "recompute_config.mp_comm_recompute": (False, "communication is not recomputed here; remove the key"),
    "recompute_config.parallel_optimizer_comm_recompute": (False, "communication is not recomputed here; "
                                                                  "remove the key"),
    "recompute_config.recompute_slice_activation": (False, "a recomputed layer keeps its input as it receives "
                                                           "it, [s/tp, b, h] under sequence parallelism "
                                                           "(--sequence-parallel); remove the key"),
}


def _set(tree, dotted, value):
    *parents, leaf = dotted.split(".")
    node = tree
    for p in parents:
        node = node.setdefault(p, {})
        if isinstance(node, list):                     # betas.0: an element of a list
            break
    if isinstance(node, list):
        node[int(leaf)] = value
    else:
        node[leaf] = value


def _mindformers_target(dotted, value, where):
    """This project's key for MindFormers' key `dotted`, or None when nothing is to be set (e.g.
    vocab_emb_dp: false, which is what this project does); any other value of a key without a
    counterpart is refused with its pointer, `where` naming the file or the command line."""
    target = MINDFORMERS_KEYS[dotted]
    if isinstance(target, str):
        return target
    if value is target[0]:
        return None
    raise ConfigError(f"{where}: {dotted}={value} (MindFormers) is not a key here: {target[1]}")


def mindformers_keys(raw, where):
    """Move MindFormers' keys in the raw YAML tree `raw` onto this project's (MINDFORMERS_KEYS)."""
    for dotted in MINDFORMERS_KEYS:
        section, key = dotted.split(".")
        values = raw.get(section)
        if not isinstance(values, dict) or key not in values:
            continue
        value = values.pop(key)
        if section not in SCHEMA and not values:
            raw.pop(section)                              # recompute_config: MindFormers' own section
        target = _mindformers_target(dotted, value, where)
        if target:
            _set(raw, target, value)
    return raw


def parse_overrides(args, raw):
    """Apply Megatron flags (`--hidden-size 128`, `--fp16`) and dotted overrides
    (`model_config.hidden_size=128`) to the raw YAML tree `raw`, in order."""
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg.startswith("--"):
            flag, _, inline = arg.partition("=")
            if flag not in MEGATRON_FLAGS:
                raise ConfigError(f"unknown flag {flag}{suggest(flag, MEGATRON_FLAGS)}")
            target = MEGATRON_FLAGS[flag]
            if isinstance(target, (tuple, list)):      # a switch: sets fixed values
                for key, value in (target if isinstance(target, list) else [target]):
                    _set(raw, key, value)
                continue
            if inline == "" and "=" not in arg:
                if i >= len(args):
                    raise ConfigError(f"flag {flag} needs a value")
                inline = args[i]
                i += 1
            value = yaml.safe_load(inline) if inline != "" else ""
            if flag == "--profile-ranks" and isinstance(value, int):     # Megatron: --profile-ranks 0 1 ...
                value = [value]
                while i < len(args) and args[i].isdigit():
                    value.append(int(args[i]))
                    i += 1
            if flag == "--optimizer":
                value = _MEGATRON_OPTIMIZER.get(str(value).lower(), value)
            if flag == "--cp-comm-type":
                if value not in _CP_COMM_TYPES:
                    raise ConfigError(f"--cp-comm-type {value}: use one of {', '.join(_CP_COMM_TYPES)}")
                value = _CP_COMM_TYPES[value]
            if flag in ("--data-path", "--split", "--save", "--load", "--vocab-file", "--merge-file"):
                value = str(inline)
            if target.endswith((".betas.0", ".betas.1")):
                section = raw.setdefault("optimizer_config", {})
                section.setdefault("betas", list(SCHEMA["optimizer_config"]["betas"][0]))
            _set(raw, target, value)
        elif "=" in arg:
            key, _, text = arg.partition("=")
            if key in MINDFORMERS_KEYS:
                key = _mindformers_target(key, yaml.safe_load(text), "command line")
                if key is None:
                    continue
            keys = set(all_keys())
            if key not in keys:
                raise ConfigError(f"unknown key {key}{suggest(key, keys)}")
            spec = schema_default(key)
            _set(raw, key, text if spec[1] is str else yaml.safe_load(text))
        else:
            raise ConfigError(f"unexpected argument {arg!r}: use --megatron-flag VALUE or section.key=VALUE")
    return raw


def _override_warmup(yaml_schedule, raw):
    """Warmup is given in iterations or as a fraction; a command-line choice replaces the YAML's."""
    schedule = raw.get("optimizer_config", {}).get("learning_rate_scheduler_kwargs", {})
    for chosen, other, cleared in (("lr_warmup_iters", "lr_warmup_fraction", None),
                                   ("lr_warmup_fraction", "lr_warmup_iters", 0)):
        changed = schedule.get(chosen) != yaml_schedule.get(chosen)
        if changed and schedule.get(other) == yaml_schedule.get(other) and other in schedule:
            schedule[other] = cleared


def _known(values, schema):
    """The keys of a saved config tree that the schema has (derived values dropped)."""
    return {k: _known(v, schema[k]) if isinstance(schema[k], dict) else v
            for k, v in (values or {}).items() if k in schema}


def from_saved(saved, args=(), world_size=1):
    """The config a checkpoint stored (to_dict), in a new layout: the parallel sizes, recompute and
    the distributed optimizer back to their defaults, then `args` applied, derived and validated."""
    raw = {section: _known(saved.get(section), schema) for section, schema in SCHEMA.items()}
    raw["parallel_config"] = {}
    for key in ("recompute_granularity", "recompute_method", "recompute_num_layers"):
        raw["model_config"].pop(key, None)              # the run's choice for its layout, not the model's
    raw["training_config"].pop("use_distributed_optimizer", None)
    if not raw["model_config"].get("group_query_attention"):
        raw["model_config"].pop("num_query_groups", None)       # derived: one group per head
    schedule = raw["optimizer_config"].get("learning_rate_scheduler_kwargs", {})
    if schedule.get("lr_warmup_fraction") is not None:          # lr_warmup_iters was derived from it
        schedule.pop("lr_warmup_iters", None)
    tree = {s: merge(SCHEMA[s], raw.get(s), s) for s in SCHEMA}
    raw = parse_overrides(list(args), tree)
    cfg = to_namespace({s: merge(SCHEMA[s], raw.get(s), s) for s in SCHEMA})
    finalize(cfg, world_size)
    return cfg


# ----------------------------------------------------------------------------- command lines
REQUIRED = object()


class HelpRequested(Exception):
    """--help or -h: the message is the command's usage; the caller prints it and exits 0."""


def parse_command(command, argv, flags, positional=(), passthrough=None, about=""):
    """Every command's flags through one mechanism. flags: {"--name": (default, type, help)}, the
    default REQUIRED for a flag that must be given, type bool for a switch, list for one or more
    values; positional: names of leading arguments. Returns ({name: value} with "--load" ->
    "load", the arguments left for `passthrough`), refusing an unknown flag with a suggestion
    unless `passthrough` (a text naming what takes them, e.g. "training flags") is given."""
    if "--help" in argv or "-h" in argv:
        words = [command, *positional] + [f"{f} VALUE" for f, spec in flags.items() if spec[0] is REQUIRED]
        lines = [f"usage: bash run.sh {' '.join(words)} [flags]" + (f" [{passthrough}]" if passthrough else "")]
        lines += [about] if about else []
        for flag, (default, typ, text) in flags.items():
            shown = "required" if default is REQUIRED else f"default {default!r}"
            lines.append(f"  {flag:22s} {text} ({shown})")
        raise HelpRequested("\n".join(lines))
    argv, values, rest = list(argv), {}, []
    for name in positional:
        if not argv or argv[0].startswith("-"):
            raise ConfigError(f"{command} needs {name} first (bash run.sh {command} --help)")
        values[name.lower()] = argv.pop(0)
    while argv:
        arg = argv.pop(0)
        flag, eq, inline = arg.partition("=")
        if flag not in flags:
            if passthrough:
                rest.append(arg)
                continue
            raise ConfigError(f"{command}: unknown argument {arg!r}{suggest(flag, flags)} (bash run.sh {command} --help)")
        typ = flags[flag][1]
        if typ is bool:
            values[flag[2:].replace("-", "_")] = True
            continue
        if typ is list:
            items = [inline] if eq else []
            while not eq and argv and not argv[0].startswith("--"):
                items.append(argv.pop(0))
            value = items
        else:
            if not eq and not argv:
                raise ConfigError(f"{command}: {flag} needs a value")
            text = inline if eq else argv.pop(0)
            try:
                value = typ(text)
            except ValueError:
                raise ConfigError(f"{command}: {flag} expects {typ.__name__}, got {text!r}") from None
        values[flag[2:].replace("-", "_")] = value
    for flag, (default, typ, _) in flags.items():
        key = flag[2:].replace("-", "_")
        if key not in values:
            if default is REQUIRED:
                raise ConfigError(f"{command} needs {flag} (bash run.sh {command} --help)")
            values[key] = False if typ is bool and default is None else default
    return values, rest


def training_help():
    """`bash run.sh --help`: the commands, then every Megatron flag with its YAML key and default."""
    lines = ["usage: bash run.sh [--nproc N] [--config FILE] [Megatron flags] [section.key=VALUE ...]   train",
             "       bash run.sh COMMAND [flags]   COMMAND: test, bench, preprocess, generate, convert, import-hf,",
             "                                     export-hf, import-megatron, plan (bash run.sh COMMAND --help)",
             "--config FILE is layered over the project's config.yaml (FILE's keys replace config.yaml's); the",
             "defaults below are the schema's (config.py), which config.yaml overrides; every key can also be",
             "set as section.key=VALUE.",
             f"  {'flag':40s} {'YAML key':58s} default"]
    for flag, target in MEGATRON_FLAGS.items():
        if isinstance(target, str):
            key = target
            default = schema_default(key)[0] if not key.endswith((".0", ".1")) else "(from betas)"
        else:
            pairs = target if isinstance(target, list) else [target]
            key = ", ".join(f"{k}={v}" for k, v in pairs)
            default = "switch"
        lines.append(f"  {flag:40s} {key:58s} {default}")
    return "\n".join(lines)


PROJECT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config.yaml")


def read_yaml(path):
    """The sections of the YAML file at `path`, or one line naming the file and what is wrong."""
    if not os.path.isfile(path):
        problem = "is a directory" if os.path.isdir(path) else "not found"
        raise ConfigError(f"config file {path} {problem}: pass --config FILE (a YAML file) or run from the project folder")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of the sections {', '.join(SCHEMA)}, got {raw!r:.40}")
    mindformers_keys(raw, path)
    for section in raw:
        if section not in SCHEMA:
            raise ConfigError(f"{path}: unknown section {section}{suggest(section, SCHEMA)}")
    _check_sections(path, raw, SCHEMA, "")
    return raw


def _check_sections(path, tree, schema, where):
    """Every section and sub-section given is a mapping (or empty): parse_overrides writes into them."""
    for key, spec in schema.items():
        value = tree.get(key)
        if isinstance(spec, dict) and value is not None:
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: section {where}{key} must be a mapping of keys, got {value!r:.40}")
            _check_sections(path, value, spec, f"{where}{key}.")


def _layer(base, over):
    """`base` with `over`'s keys replacing its own, sub-section by sub-section (lists and values whole)."""
    out = dict(base)
    for key, value in over.items():
        nested = isinstance(base.get(key), dict) and isinstance(value, (dict, type(None)))
        out[key] = _layer(base[key], value or {}) if nested else value
    return out


def _schedule(raw):
    return (raw.get("optimizer_config") or {}).get("learning_rate_scheduler_kwargs") or {}


def load_config(path="config.yaml", args=(), world_size=1):
    """The project's config.yaml with the YAML at `path` layered over it (its keys replace
    config.yaml's, so a partial file keeps the rest), then `args` applied, derived values filled
    and validated. Returns a namespace with one attribute per section (cfg.model_config.hidden_size, ...)."""
    base = read_yaml(PROJECT_CONFIG)
    raw = _layer(base, read_yaml(path))
    _override_warmup(_schedule(base), raw)             # the file's warmup choice replaces config.yaml's
    yaml_schedule = dict(_schedule(raw))
    raw = parse_overrides(list(args), raw)
    _override_warmup(yaml_schedule, raw)
    tree = {s: merge(SCHEMA[s], raw.get(s), s) for s in SCHEMA}
    cfg = to_namespace(tree)
    finalize(cfg, world_size)
    return cfg
