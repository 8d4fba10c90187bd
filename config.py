"""One YAML, validated before any work: the sections of the MindSpore Transformers dynamic-graph
guide (training_config, parallel_config, model_config, dataset_config, optimizer_config), with
Megatron-LM's command-line flags mapped onto its keys (the MindSpeed-Core-MS table, `MEGATRON_FLAGS`)
and dotted `section.key=value` overrides.

Every bad key or value raises ConfigError with one line naming it and the fix; train.py prints that
line and exits non-zero.
"""
import difflib
import os
from types import SimpleNamespace

import yaml


class ConfigError(ValueError):
    pass


# section -> key -> (default, type, allowed values or None). A dict default is a nested section.
SCHEMA = {
    "training_config": {
        "seed": (1234, int, None),
        "device_target": ("CPU", str, ("CPU", "GPU", "Ascend")),
        "output_dir": ("./output", str, None),        # Megatron --save: checkpoints and logs
        "training_iters": (200, int, None),
        "log_interval": (10, int, None),
        "eval_interval": (100, int, None),
        "eval_iters": (10, int, None),
        "save_interval": (None, int, None),
        "keep_checkpoint_max": (5, int, None),
        "ckpt_format": ("ckpt", str, ("ckpt", "safetensors")),
        "load_checkpoint": ("", str, None),           # Megatron --load
        "no_load_optim": (False, bool, None),
        "no_load_rng": (False, bool, None),
        "finetune": (False, bool, None),
        "fp16": (False, bool, None),
        "bf16": (False, bool, None),
        "loss_scale": (None, float, None),            # static scale; null = dynamic under fp16
        "loss_scale_value": (2.0 ** 32, float, None),  # Megatron --initial-loss-scale
        "min_loss_scale": (1.0, float, None),
        "loss_scale_window": (1000, int, None),
        "hysteresis": (2, int, None),
        "grad_clip_kwargs": {
            "grad_clip_type": ("ClipGlobalNorm", str, ("ClipGlobalNorm", "GradClipByValue")),
            "clip_value": (1.0, float, None),         # 0 disables clipping
        },
        "use_distributed_optimizer": (False, bool, None),  # ZeRO-1: optimizer state sharded over DP
        "bucket_size": (None, int, None),             # gradient buffer bucket, elements; null = one bucket
        "threads_num": (None, int, None),             # CPU kernel threads per worker; null = cores / workers
        "use_jit": (True, bool, None),                # compile the model with ms.jit when it has no dropout
        "log_comm_ledger": (False, bool, None),       # log each step's collectives per group: calls, bytes
        "pipeline_trace": (False, bool, None),        # time the last step's pipeline passes: timeline + bubble
        "profile": (False, bool, None),               # MindSpore profiler over the steps below
        "profile_save_path": (None, str, None),       # null = <output_dir>/profile; traces in rank_N/
        "profile_step_start": (1, int, None),         # first profiled step (Step: as logged)
        "profile_step_end": (5, int, None),           # profiling stops before this step
        "profile_ranks": ([0], list, None),           # Megatron --profile-ranks; null = every rank
        "profile_level": ("level0", str, ("level0", "level1", "level2")),
        # collected by the Ascend/GPU profiler only; on CPU a value other than the default is named
        # in one warning line
        "profile_with_stack": (False, bool, None),
        "profile_memory": (False, bool, None),
        "profile_data_process": (False, bool, None),
        "profile_parallel_strategy": (False, bool, None),
        "profile_hbm_ddr": (False, bool, None),
        "profile_pcie": (False, bool, None),
        "profile_aicore_metrics": (0, int, None),
        "profile_l2_cache": (False, bool, None),
        "profile_data_simplification": (True, bool, None),
    },
    "parallel_config": {
        "tensor_model_parallel_size": (1, int, None),
        "pipeline_model_parallel_size": (1, int, None),
        "context_parallel_size": (1, int, None),
        "virtual_pipeline_model_parallel_size": (None, int, None),
        "num_layers_per_virtual_pipeline_stage": (None, int, None),
        "num_layer_list": (None, list, None),
        "sequence_parallel": (False, bool, None),
        "pipeline_schedule": ("1f1b", str, ("1f1b", "afab")),   # afab: all forward, all backward (GPipe)
    },
    "model_config": {
        "num_layers": (4, int, None),
        "hidden_size": (256, int, None),
        "ffn_hidden_size": (None, int, None),         # null = 4 * hidden_size
        "num_attention_heads": (8, int, None),
        "group_query_attention": (False, bool, None),
        "num_query_groups": (None, int, None),        # with group_query_attention; null = one per head
        "seq_length": (256, int, None),
        "max_position_embeddings": (None, int, None),  # null = seq_length
        "vocab_size": (None, int, None),              # padded vocabulary; null = from the tokenizer
        "make_vocab_size_divisible_by": (128, int, None),
        "position_embedding_type": ("absolute", str, ("absolute", "rope")),
        "rotary_base": (10000, int, None),
        "normalization": ("LayerNorm", str, ("LayerNorm", "RMSNorm")),
        "norm_epsilon": (1e-5, float, None),
        "hidden_act": ("gelu", str, ("gelu", "gelu_tanh", "swiglu")),
        "qkv_has_bias": (True, bool, None),           # Megatron --add-qkv-bias
        "out_proj_has_bias": (True, bool, None),      # Megatron add_dense_bias
        "add_bias_linear": (True, bool, None),        # MLP biases
        "untie_embeddings_and_output_weights": (False, bool, None),
        "use_sandwich_norm": (False, bool, None),
        "attn_post_norm_scale": (1.0, float, None),
        "ffn_post_norm_scale": (1.0, float, None),
        "attention_dropout_rate": (0.0, float, None),
        "hidden_dropout_rate": (0.0, float, None),
        "init_method_std": (0.02, float, None),
        "attention_softmax_in_fp32": (True, bool, None),
        "fp32_residual_connection": (False, bool, None),
        "params_dtype": ("float32", str, ("float32", "float16", "bfloat16")),
        "compute_dtype": ("float32", str, ("float32", "float16", "bfloat16")),
    },
    "dataset_config": {
        "data_path": ("data/tinyshakespeare_text_document", str, None),
        "split": ("949,50,1", str, None),
        "mock_data": (False, bool, None),
        "tokenizer_type": ("GPT2BPETokenizer", str, ("GPT2BPETokenizer", "NullTokenizer", "ByteTokenizer")),
        "vocab_file": ("data/gpt2-vocab.json", str, None),
        "merge_file": ("data/gpt2-merges.txt", str, None),
        "vocab_size": (None, int, None),              # NullTokenizer / mock data: ids below it
        "batch_size": (8, int, None),                 # micro-batch size
        "micro_batch_num": (1, int, None),
        "global_batch_size": (None, int, None),       # null = batch_size * micro_batch_num * dp
        "reset_position_ids": (False, bool, None),
        "reset_attention_mask": (False, bool, None),
        "eod_mask_loss": (False, bool, None),
        "data_cache_path": (None, str, None),
    },
    "optimizer_config": {
        "optimizer_type": ("AdamW", str, ("AdamW", "Adam", "SGD")),
        "learning_rate": (1e-3, float, None),
        "weight_decay": (0.1, float, None),
        "start_weight_decay": (None, float, None),    # null = weight_decay
        "end_weight_decay": (None, float, None),
        "weight_decay_incr_style": ("constant", str, ("constant", "linear", "cosine")),
        "betas": ([0.9, 0.95], list, None),
        "eps": (1e-8, float, None),
        "momentum": (0.9, float, None),               # SGD
        "learning_rate_scheduler_kwargs": {
            "lr_decay_style": ("cosine", str, ("constant", "linear", "cosine", "inverse-square-root")),
            "lr_warmup_iters": (0, int, None),
            "lr_warmup_fraction": (None, float, None),
            "lr_decay_iters": (None, int, None),      # null = training_iters
            "min_lr": (1e-4, float, None),
        },
    },
}

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
    "--no-attention-softmax-in-fp32": ("model_config.attention_softmax_in_fp32", False),
    "--fp32-residual-connection": ("model_config.fp32_residual_connection", True),
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
    "--fp16": ("training_config.fp16", True),
    "--no-jit": ("training_config.use_jit", False),
    "--bf16": ("training_config.bf16", True),
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
# Profiler keys that only the Ascend/GPU profiler collects (the guide's names)
DEVICE_PROFILE_KEYS = ("profile_level", "profile_with_stack", "profile_memory", "profile_data_process",
                       "profile_parallel_strategy", "profile_hbm_ddr", "profile_pcie", "profile_aicore_metrics",
                       "profile_l2_cache", "profile_data_simplification")
_MEGATRON_OPTIMIZER = {"adam": "AdamW", "sgd": "SGD"}   # Megatron's "adam" is AdamW


def _suggest(word, candidates):
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _all_keys(schema=SCHEMA, prefix=""):
    for k, v in schema.items():
        if isinstance(v, dict):
            yield from _all_keys(v, prefix + k + ".")
        else:
            yield prefix + k


def _check_value(path, value, spec):
    default, typ, choices = spec
    if value is None:
        return None
    if typ is float and isinstance(value, str):      # YAML 1.1 reads 3e-3 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if typ is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"{path}: expected {typ.__name__}, got {value!r}")
    if choices and value not in choices:
        raise ConfigError(f"{path}: {value!r} is not one of {', '.join(map(str, choices))}"
                          + _suggest(str(value), map(str, choices)))
    return value


def _merge(schema, given, path):
    """Defaults of `schema` overlaid with `given`, every key and value checked."""
    given = given or {}
    if not isinstance(given, dict):
        raise ConfigError(f"{path}: expected a mapping of keys, got {given!r}")
    for k in given:
        if k not in schema:
            raise ConfigError(f"unknown key {path}.{k}{_suggest(k, schema)}")
    out = {}
    for k, spec in schema.items():
        if isinstance(spec, dict):
            out[k] = _merge(spec, given.get(k), f"{path}.{k}")
        else:
            out[k] = _check_value(f"{path}.{k}", given.get(k, spec[0]), spec)
    return out


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


def _lookup_default(dotted):
    node = SCHEMA
    for p in dotted.split("."):
        node = node[p]
    return node


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
                raise ConfigError(f"unknown flag {flag}{_suggest(flag, MEGATRON_FLAGS)}")
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
            if flag in ("--data-path", "--split", "--save", "--load", "--vocab-file", "--merge-file"):
                value = str(inline)
            if target.endswith((".betas.0", ".betas.1")):
                section = raw.setdefault("optimizer_config", {})
                section.setdefault("betas", list(SCHEMA["optimizer_config"]["betas"][0]))
            _set(raw, target, value)
        elif "=" in arg:
            key, _, text = arg.partition("=")
            keys = set(_all_keys())
            if key not in keys:
                raise ConfigError(f"unknown key {key}{_suggest(key, keys)}")
            spec = _lookup_default(key)
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


def to_namespace(tree):
    """Plain dicts -> a namespace per section (the inverse of to_dict)."""
    return SimpleNamespace(**{k: to_namespace(v) if isinstance(v, dict) else v for k, v in tree.items()})


def _known(values, schema):
    """The keys of a saved config tree that the schema has (derived values dropped)."""
    return {k: _known(v, schema[k]) if isinstance(schema[k], dict) else v
            for k, v in (values or {}).items() if k in schema}


def from_saved(saved, args=(), world_size=1):
    """The config a checkpoint stored (to_dict), in a new layout: the parallel sizes and the
    distributed optimizer back to their defaults, then `args` applied, derived and validated."""
    raw = {section: _known(saved.get(section), schema) for section, schema in SCHEMA.items()}
    raw["parallel_config"] = {}
    raw["training_config"].pop("use_distributed_optimizer", None)
    if not raw["model_config"].get("group_query_attention"):
        raw["model_config"].pop("num_query_groups", None)       # derived: one group per head
    schedule = raw["optimizer_config"].get("learning_rate_scheduler_kwargs", {})
    if schedule.get("lr_warmup_fraction") is not None:          # lr_warmup_iters was derived from it
        schedule.pop("lr_warmup_iters", None)
    tree = {s: _merge(SCHEMA[s], raw.get(s), s) for s in SCHEMA}
    raw = parse_overrides(list(args), tree)
    cfg = to_namespace({s: _merge(SCHEMA[s], raw.get(s), s) for s in SCHEMA})
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
            raise ConfigError(f"{command}: unknown argument {arg!r}{_suggest(flag, flags)} (bash run.sh {command} --help)")
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
             "                                     export-hf (bash run.sh COMMAND --help)",
             "--config FILE is config.yaml by default; the defaults below are the schema's (config.py), which",
             "config.yaml overrides; every key can also be set as section.key=VALUE.",
             f"  {'flag':40s} {'YAML key':58s} default"]
    for flag, target in MEGATRON_FLAGS.items():
        if isinstance(target, str):
            key = target
            default = _lookup_default(key)[0] if not key.endswith((".0", ".1")) else "(from betas)"
        else:
            pairs = target if isinstance(target, list) else [target]
            key = ", ".join(f"{k}={v}" for k, v in pairs)
            default = "switch"
        lines.append(f"  {flag:40s} {key:58s} {default}")
    return "\n".join(lines)


def load_config(path="config.yaml", args=(), world_size=1):
    """Read the YAML at `path`, apply `args`, fill derived values and validate. Returns a
    namespace with one attribute per section (cfg.model_config.hidden_size, ...)."""
    if not os.path.exists(path):
        raise ConfigError(f"config file {path} not found: pass --config PATH or run from the project folder")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected the sections {', '.join(SCHEMA)}")
    for section in raw:
        if section not in SCHEMA:
            raise ConfigError(f"unknown section {section}{_suggest(section, SCHEMA)}")
    yaml_schedule = dict((raw.get("optimizer_config") or {}).get("learning_rate_scheduler_kwargs") or {})
    raw = parse_overrides(list(args), raw)
    _override_warmup(yaml_schedule, raw)
    tree = {s: _merge(SCHEMA[s], raw.get(s), s) for s in SCHEMA}
    cfg = to_namespace(tree)
    finalize(cfg, world_size)
    return cfg


def _positive(cfg_section, name, keys):
    for k in keys:
        v = getattr(cfg_section, k)
        if v is not None and v <= 0:
            raise ConfigError(f"{name}.{k} must be positive, got {v}")


def _check_pipeline(p, m):
    """Pipeline and virtual-pipeline sizes against the layers; sets
    p.virtual_pipeline_model_parallel_size (1 without interleaving)."""
    pp, layers, where = p.pipeline_model_parallel_size, m.num_layers, "parallel_config"
    vpp = p.virtual_pipeline_model_parallel_size
    _positive(p, where, ["virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage"])
    if p.num_layers_per_virtual_pipeline_stage is not None:
        per = p.num_layers_per_virtual_pipeline_stage
        if layers % (pp * per):
            raise ConfigError(f"{where}.num_layers_per_virtual_pipeline_stage={per}: model_config.num_layers="
                              f"{layers} is not divisible by pipeline size {pp} x {per}")
        if vpp is not None and vpp != layers // (pp * per):
            raise ConfigError(f"{where}.virtual_pipeline_model_parallel_size={vpp} disagrees with "
                              f"num_layers_per_virtual_pipeline_stage={per} ({layers // (pp * per)} chunks): give one")
        vpp = layers // (pp * per)
    lst = p.num_layer_list
    if lst is not None:
        nested = all(isinstance(c, list) for c in lst)
        counts = [n for c in lst for n in (c if nested else [c])]
        if (len(lst) != pp or not all(isinstance(n, int) and n >= 1 for n in counts)
                or (nested and len({len(c) for c in lst}) != 1)):
            raise ConfigError(f"{where}.num_layer_list={lst}: give {pp} layer counts, one per pipeline stage "
                              "(e.g. [3, 1]), or per stage one per virtual chunk (e.g. [[2, 1], [1, 2]]), each >= 1")
        if sum(counts) != layers:
            raise ConfigError(f"{where}.num_layer_list={lst} sums to {sum(counts)}, not model_config.num_layers={layers}")
        chunks = len(lst[0]) if nested else 1
        if vpp is not None and vpp != chunks:
            raise ConfigError(f"{where}.num_layer_list={lst} gives {chunks} chunk(s) per stage but "
                              f"virtual_pipeline_model_parallel_size is {vpp}: make them agree")
        vpp = chunks
    vpp = vpp or 1
    if vpp > 1 and pp == 1:
        raise ConfigError(f"{where}.virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 1")
    if lst is None and layers % (pp * vpp):
        raise ConfigError(f"model_config.num_layers={layers} is not divisible by pipeline_model_parallel_size={pp}"
                          + (f" x virtual chunks {vpp}" if vpp > 1 else "") + ": change num_layers or give "
                          "parallel_config.num_layer_list")
    p.virtual_pipeline_model_parallel_size = vpp


def _check_profile(t):
    """Profiled steps within the run; sets profile_save_path's default."""
    if t.profile_save_path is None:
        t.profile_save_path = os.path.join(t.output_dir, "profile")
    if not t.profile:
        return
    if not 1 <= t.profile_step_start < t.profile_step_end:
        raise ConfigError(f"training_config.profile_step_end={t.profile_step_end} must be after profile_step_start="
                          f"{t.profile_step_start} (>= 1): profiling stops before step profile_step_end")
    if t.profile_step_end > t.training_iters + 1:
        raise ConfigError(f"training_config.profile_step_end={t.profile_step_end} is past the last step "
                          f"(training_iters={t.training_iters}): lower it to at most {t.training_iters + 1}")
    if t.profile_ranks is not None and not all(isinstance(r, int) and r >= 0 for r in t.profile_ranks):
        raise ConfigError(f"training_config.profile_ranks={t.profile_ranks}: give a list of global ranks, e.g. [0, 1]")


def finalize(cfg, world_size=1):
    """Derived values and the checks that involve several keys, section by section."""
    m, d, t, o, p = (cfg.model_config, cfg.dataset_config, cfg.training_config,
                     cfg.optimizer_config, cfg.parallel_config)
    _positive(m, "model_config", ["num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                  "num_query_groups", "seq_length", "max_position_embeddings",
                                  "make_vocab_size_divisible_by", "norm_epsilon", "init_method_std"])
    _positive(d, "dataset_config", ["batch_size", "micro_batch_num", "global_batch_size", "vocab_size"])
    _positive(t, "training_config", ["training_iters", "log_interval", "eval_interval",
                                     "save_interval", "keep_checkpoint_max", "threads_num"])
    _finalize_model(m, t)
    _finalize_optimizer(o, t)
    _finalize_dataset(d)
    _finalize_parallel(p, m, d, world_size)
    _finalize_training(t)
    return cfg


def _finalize_model(m, t):
    """Defaults derived from other keys (ffn 4h, one query group per head, positions), shapes that
    must divide, dropout ranges, and the compute dtype (--fp16/--bf16)."""
    if m.ffn_hidden_size is None:
        m.ffn_hidden_size = 4 * m.hidden_size
    if m.num_query_groups is not None and not m.group_query_attention:
        raise ConfigError(f"model_config.num_query_groups={m.num_query_groups} needs group_query_attention=true "
                          "(--group-query-attention), as in Megatron")
    if not m.group_query_attention:
        m.num_query_groups = m.num_attention_heads
    elif m.num_query_groups is None:
        raise ConfigError("model_config.group_query_attention=true needs num_query_groups (--num-query-groups)")
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"model_config.hidden_size={m.hidden_size} must be divisible by "
                          f"num_attention_heads={m.num_attention_heads}")
    if m.num_attention_heads % m.num_query_groups:
        raise ConfigError(f"model_config.num_attention_heads={m.num_attention_heads} must be divisible by "
                          f"num_query_groups={m.num_query_groups}")
    if m.position_embedding_type == "rope" and (m.hidden_size // m.num_attention_heads) % 2:
        raise ConfigError("model_config.position_embedding_type=rope needs an even head size "
                          "(hidden_size / num_attention_heads)")
    if m.seq_length > m.max_position_embeddings:
        raise ConfigError(f"model_config.seq_length={m.seq_length} exceeds max_position_embeddings="
                          f"{m.max_position_embeddings}")
    for k in ("attention_dropout_rate", "hidden_dropout_rate"):
        if not 0.0 <= getattr(m, k) < 1.0:
            raise ConfigError(f"model_config.{k} must be in [0, 1), got {getattr(m, k)}")
    if t.fp16 and t.bf16:
        raise ConfigError("training_config.fp16 and bf16 are both set: choose one")
    if t.fp16 or t.bf16:
        m.compute_dtype = "float16" if t.fp16 else "bfloat16"
    if t.device_target == "CPU" and m.compute_dtype != "float32":
        raise ConfigError(f"model_config.compute_dtype={m.compute_dtype} (--fp16/--bf16) has no CPU kernels in "
                          "MindSpore 2.10: use float32 on CPU, or training_config.device_target GPU/Ascend")
    if m.params_dtype != "float32":
        raise ConfigError(f"model_config.params_dtype={m.params_dtype}: parameters are float32 master weights; "
                          "set compute_dtype (or --fp16/--bf16) for half-precision matmuls")


def _finalize_optimizer(o, t):
    """Betas, the weight-decay increment and the lr schedule (warmup in iterations or as a fraction)."""
    if len(o.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in o.betas):
        raise ConfigError(f"optimizer_config.betas must be two numbers in [0, 1), got {o.betas}")
    o.betas = [float(b) for b in o.betas]
    if o.start_weight_decay is None:
        o.start_weight_decay = o.weight_decay
    if o.end_weight_decay is None:
        o.end_weight_decay = o.weight_decay
    if o.weight_decay_incr_style == "constant" and o.start_weight_decay != o.end_weight_decay:
        raise ConfigError("optimizer_config.weight_decay_incr_style=constant needs start_weight_decay == "
                          "end_weight_decay: choose linear or cosine")
    s = o.learning_rate_scheduler_kwargs
    if s.lr_decay_iters is None:
        s.lr_decay_iters = t.training_iters
    if s.lr_warmup_fraction is not None:
        if s.lr_warmup_iters:
            raise ConfigError("set only one of lr_warmup_iters and lr_warmup_fraction "
                              "(optimizer_config.learning_rate_scheduler_kwargs)")
        if not 0.0 <= s.lr_warmup_fraction <= 1.0:
            raise ConfigError("optimizer_config.learning_rate_scheduler_kwargs.lr_warmup_fraction must be in [0, 1]")
        s.lr_warmup_iters = int(s.lr_warmup_fraction * s.lr_decay_iters)
    if s.lr_warmup_iters < 0 or s.lr_warmup_iters >= s.lr_decay_iters:
        raise ConfigError(f"optimizer_config.learning_rate_scheduler_kwargs.lr_warmup_iters={s.lr_warmup_iters} "
                          f"must be at least 0 and below lr_decay_iters={s.lr_decay_iters}")
    if s.min_lr > o.learning_rate:
        raise ConfigError(f"optimizer_config.learning_rate_scheduler_kwargs.min_lr={s.min_lr} exceeds "
                          f"learning_rate={o.learning_rate}")


def _finalize_dataset(d):
    """The split weights, and what the tokenizer and mock data need."""
    parts = d.split.replace("/", ",").split(",")
    try:
        weights = [float(x) for x in parts]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"dataset_config.split={d.split!r}: expected up to three weights like 949,50,1")
    if d.tokenizer_type == "NullTokenizer" and d.vocab_size is None:
        raise ConfigError("dataset_config.tokenizer_type=NullTokenizer needs dataset_config.vocab_size (--vocab-size)")
    if d.mock_data and d.vocab_size is None and d.tokenizer_type != "GPT2BPETokenizer":
        raise ConfigError("dataset_config.mock_data needs dataset_config.vocab_size (--vocab-size)")
    for k in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
        if getattr(d, k) and d.mock_data:
            raise ConfigError(f"dataset_config.{k} needs real data with EOD tokens, not mock_data")


def _finalize_parallel(p, m, d, world_size):
    """The layout against the model and the world size; derives data_parallel_size and micro_batch_num."""
    _positive(p, "parallel_config", ["tensor_model_parallel_size", "pipeline_model_parallel_size",
                                     "context_parallel_size"])
    if p.context_parallel_size != 1:
        raise ConfigError(f"parallel_config.context_parallel_size={p.context_parallel_size}: context "
                          "parallelism is not in this version yet; set it to 1")
    _check_pipeline(p, m)
    tp = p.tensor_model_parallel_size
    for k in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        if getattr(m, k) % tp:
            raise ConfigError(f"model_config.{k}={getattr(m, k)} is not divisible by "
                              f"parallel_config.tensor_model_parallel_size={tp}")
    if p.sequence_parallel and tp == 1:
        raise ConfigError("parallel_config.sequence_parallel needs tensor_model_parallel_size > 1")
    if p.sequence_parallel and m.seq_length % tp:
        raise ConfigError(f"model_config.seq_length={m.seq_length} is not divisible by "
                          f"tensor_model_parallel_size={tp}, as sequence_parallel needs")
    if tp > 1 and m.compute_dtype != "float32":
        raise ConfigError("tensor parallelism computes in float32 in this version: set compute_dtype float32")
    model_parallel = tp * p.pipeline_model_parallel_size * p.context_parallel_size
    if world_size % model_parallel:
        raise ConfigError(f"world size {world_size} is not a multiple of tensor x context x pipeline "
                          f"parallel sizes = {model_parallel}: change --nproc or the parallel sizes")
    dp = world_size // model_parallel
    per_step = d.batch_size * dp
    if d.global_batch_size is not None:
        if d.global_batch_size % per_step:
            raise ConfigError(f"dataset_config.global_batch_size={d.global_batch_size} must be a multiple of "
                              f"batch_size * data-parallel size = {per_step}")
        d.micro_batch_num = d.global_batch_size // per_step
    d.global_batch_size = per_step * d.micro_batch_num
    if p.virtual_pipeline_model_parallel_size > 1 and d.micro_batch_num % p.pipeline_model_parallel_size:
        raise ConfigError(f"dataset_config.micro_batch_num={d.micro_batch_num} is not divisible by "
                          f"pipeline_model_parallel_size={p.pipeline_model_parallel_size}, as the interleaved "
                          "schedule needs: change global_batch_size or batch_size")
    p.data_parallel_size = dp


def _finalize_training(t):
    """Evaluation, profiling window and clipping."""
    if t.eval_iters < 0:
        raise ConfigError("training_config.eval_iters must be >= 0")
    _check_profile(t)
    c = t.grad_clip_kwargs
    if c.clip_value is not None and c.clip_value < 0:
        raise ConfigError("training_config.grad_clip_kwargs.clip_value must be >= 0 (0 disables clipping)")


def to_dict(ns):
    """The namespace back to plain dicts (for checkpoint metadata)."""
    return {k: to_dict(v) if isinstance(v, SimpleNamespace) else v for k, v in vars(ns).items()}
