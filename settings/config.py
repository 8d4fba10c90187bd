"""A run's config, validated before any work: every value checked against the key table
(keys.py: defaults, types, allowed values), then the values derived from others and the rules
that involve several keys (`finalize`, section by section, Megatron's rules where it has them).

Every bad key or value raises ConfigError with one line naming it and the fix; train.py prints that
line and exits non-zero. Reading the YAML files and the command line is cli.py.
"""
import difflib
import math
import os
import platform
import re
import shutil
from types import SimpleNamespace


class ConfigError(ValueError):
    """A config, data, checkpoint or launch input refused: its one-line message names the
    field and the fix."""


def suggest(word, candidates):
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _check_value(path, value, spec):
    typ, choices = spec.type, spec.choices
    if spec.kind == "fixed" and value not in choices:
        raise ConfigError(f"{path}={value!r}: only {spec.default!r} here: {spec.help}")
    if value is None:
        return None
    if typ is float and isinstance(value, str):      # YAML 1.1 reads 3e-3 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass                          # not a number: the type check below names it
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if typ is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    kinds = typ if isinstance(typ, tuple) else (typ,)          # a key may take several types
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        expected = " or ".join(k.__name__ for k in kinds)
        raise ConfigError(f"{path}: expected {expected}, got {value!r}")
    if choices and value not in choices:
        spellings = list(map(str, choices)) + list(spec.values or ())
        raise ConfigError(f"{path}: {value!r} is not one of {', '.join(spellings)}"
                          + suggest(str(value), spellings))
    return value


def merge(schema, given, path):
    """Defaults of `schema` overlaid with `given`, every key and value checked."""
    given = given or {}
    if not isinstance(given, dict):
        raise ConfigError(f"{path}: expected a mapping of keys, got {given!r}")
    for k in given:
        if k not in schema:
            raise ConfigError(f"unknown key {path}.{k}{suggest(k, schema)}")
    out = {}
    for k, spec in schema.items():
        if isinstance(spec, dict):
            out[k] = merge(spec, given.get(k), f"{path}.{k}")
        else:
            out[k] = _check_value(f"{path}.{k}", given.get(k, spec.default), spec)
    return out


def to_namespace(tree):
    """Plain dicts -> a namespace per section (the inverse of to_dict)."""
    return SimpleNamespace(**{k: to_namespace(v) if isinstance(v, dict) else v
                              for k, v in tree.items()})


def _positive(cfg_section, name, keys):
    for k in keys:
        v = getattr(cfg_section, k)
        if v is not None and v <= 0:
            raise ConfigError(f"{name}.{k} must be positive, got {v}")


def _check_pipeline(parallel_cfg, model_cfg):
    """Pipeline and virtual-pipeline sizes against the layers; Megatron's split flags written as
    the num_layer_list they give (megatron_layer_counts); sets
    parallel_cfg.virtual_pipeline_model_parallel_size (1 without interleaving)."""
    pp, layers = parallel_cfg.pipeline_model_parallel_size, model_cfg.num_layers
    where = "parallel_config"
    vpp = parallel_cfg.virtual_pipeline_model_parallel_size
    _positive(parallel_cfg, where, ["virtual_pipeline_model_parallel_size",
                                    "num_layers_per_virtual_pipeline_stage"])
    _check_split_combinations(parallel_cfg)
    if parallel_cfg.num_layers_per_virtual_pipeline_stage is not None:
        vpp = _chunks_of_layers_per_stage(parallel_cfg, layers, vpp)
    counts = megatron_layer_counts(parallel_cfg, layers, vpp)
    if counts is not None:
        parallel_cfg.num_layer_list = counts
    if parallel_cfg.num_layer_list is not None:
        vpp = _check_num_layer_list(parallel_cfg, layers, vpp)
    vpp = vpp or 1
    if vpp > 1 and pp == 1:
        raise ConfigError(f"{where}.virtual_pipeline_model_parallel_size={vpp} needs "
                          "pipeline_model_parallel_size > 1")
    per = -(-layers // pp)                           # MindSpeed's automatic cut: [16, 16, 16, 14]
    lst = parallel_cfg.num_layer_list
    if lst is None and vpp == 1 and layers % pp and layers - per * (pp - 1) >= 1:
        parallel_cfg.num_layer_list = [per] * (pp - 1) + [layers - per * (pp - 1)]
    elif lst is None and layers % (pp * vpp):
        chunks = f" x virtual chunks {vpp}" if vpp > 1 else ""
        raise ConfigError(f"model_config.num_layers={layers} is not divisible by "
                          f"pipeline_model_parallel_size={pp}{chunks}: change num_layers or give "
                          "parallel_config.num_layer_list")
    parallel_cfg.virtual_pipeline_model_parallel_size = vpp


def _chunks_of_layers_per_stage(parallel_cfg, layers, vpp):
    """The chunks per stage num_layers_per_virtual_pipeline_stage gives (Megatron's
    arguments.py: the layers, with an accounted embedding and loss one each, over pp x it)."""
    where, pp = "parallel_config", parallel_cfg.pipeline_model_parallel_size
    per = parallel_cfg.num_layers_per_virtual_pipeline_stage
    accounted = _accounted(parallel_cfg)
    counted = layers + accounted
    plus = f" + {accounted} (the accounted embedding / loss)" if accounted else ""
    if counted % (pp * per):
        raise ConfigError(f"{where}.num_layers_per_virtual_pipeline_stage={per}: "
                          f"model_config.num_layers={layers}{plus} is not divisible by "
                          f"pipeline size {pp} x {per}")
    if vpp is not None and vpp != counted // (pp * per):
        raise ConfigError(f"{where}.virtual_pipeline_model_parallel_size={vpp} disagrees with "
                          f"num_layers_per_virtual_pipeline_stage={per} "
                          f"({counted // (pp * per)} chunks): give one")
    return counted // (pp * per)


def _check_num_layer_list(parallel_cfg, layers, vpp):
    """num_layer_list (MindSpeed's) against the pipeline size, the layers and vpp; returns the
    chunks per stage it gives."""
    where, pp, lst = "parallel_config", parallel_cfg.pipeline_model_parallel_size, \
        parallel_cfg.num_layer_list
    nested = all(isinstance(c, list) for c in lst)
    counts = [n for c in lst for n in (c if nested else [c])]
    if (len(lst) != pp or not all(isinstance(n, int) and n >= 1 for n in counts)
            or (nested and len({len(c) for c in lst}) != 1)):
        raise ConfigError(f"{where}.num_layer_list={lst}: give {pp} layer counts, one per "
                          "pipeline stage (e.g. [3, 1]), or per stage one per virtual chunk "
                          "(e.g. [[2, 1], [1, 2]]), each >= 1")
    if sum(counts) != layers:
        raise ConfigError(f"{where}.num_layer_list={lst} sums to {sum(counts)}, not "
                          f"model_config.num_layers={layers}")
    chunks = len(lst[0]) if nested else 1
    if vpp is not None and vpp != chunks:
        raise ConfigError(f"{where}.num_layer_list={lst} gives {chunks} chunk(s) per stage but "
                          f"virtual_pipeline_model_parallel_size is {vpp}: make them agree")
    return chunks


# ------------------------------------------------------------ Megatron's pipeline split flags
# Each key of parallel_config that Megatron splits the layers by, with its flag.
SPLIT_FLAGS = {
    "decoder_first_pipeline_num_layers": "--decoder-first-pipeline-num-layers",
    "decoder_last_pipeline_num_layers": "--decoder-last-pipeline-num-layers",
    "account_for_embedding_in_pipeline_split": "--account-for-embedding-in-pipeline-split",
    "account_for_loss_in_pipeline_split": "--account-for-loss-in-pipeline-split",
    "pipeline_model_parallel_layout": "--pipeline-model-parallel-layout"}
_UNEVEN = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
_ACCOUNT = ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
# A stage or chunk of no decoder layer: a PP2 run of num_layer_list [0, 2] (the >= 1 rule lifted)
# fails at its start, in instruments/memory.stage_activations, so none is made here.
_NO_EMPTY_STAGE = ("not run here (a PP2 probe with a stage of 0 layers fails at its start, in "
                   "instruments/memory.stage_activations)")


def _named(key, value=None):
    """A split key as an error names it: parallel_config.key=value (--flag)."""
    shown = "" if value is None else f"={value}"
    return f"parallel_config.{key}{shown} ({SPLIT_FLAGS[key]})"


def _given(parallel_cfg, keys):
    """The keys of `keys` set: a count (0 too, refused later) or a switch on."""
    return [k for k in keys if getattr(parallel_cfg, k) is not None
            and getattr(parallel_cfg, k) is not False]


def _accounted(parallel_cfg):
    """How many of the embedding and the loss count as layers in the even split."""
    return len(_given(parallel_cfg, _ACCOUNT))


def _check_split_combinations(parallel_cfg):
    """The split flags Megatron refuses together (TransformerConfig.__post_init__,
    training/arguments.py), and any of them beside num_layer_list (MindSpeed's)."""
    uneven, account = _given(parallel_cfg, _UNEVEN), _given(parallel_cfg, _ACCOUNT)
    layout = _given(parallel_cfg, ("pipeline_model_parallel_layout",))
    if layout and (uneven or account):
        raise ConfigError(f"{_named(layout[0])} cannot be set with other pipeline layout "
                          f"arguments ({_named((uneven + account)[0])}): give one")
    if uneven and account:
        raise ConfigError(f"{_named(uneven[0])} cannot be set at the same time with "
                          f"{_named(account[0])}: give one")
    given = layout + uneven + account
    if given and parallel_cfg.num_layer_list is not None:
        raise ConfigError(f"{_named(given[0])} and parallel_config.num_layer_list "
                          "(--num-layer-list) both split the layers: give one")
    per = parallel_cfg.num_layers_per_virtual_pipeline_stage
    if per is not None and (layout or uneven):
        fix = ("the layout gives the chunks" if layout else
               "give the chunks by --virtual-pipeline-model-parallel-size")
        raise ConfigError(f"{_named((layout + uneven)[0])} with "
                          f"parallel_config.num_layers_per_virtual_pipeline_stage={per} "
                          f"(--num-layers-per-virtual-pipeline-stage): {fix}")


def megatron_layer_counts(parallel_cfg, layers, vpp=None):
    """num_layer_list as Megatron's split flags give it (None without them): per stage ([3, 1]),
    or with virtual chunks per stage and chunk ([[2, 1], [1, 2]]), so that stage_layer_counts
    and pipeline.layer_split deal them out as any other num_layer_list. A stage or chunk left
    with no decoder layer is refused (_NO_EMPTY_STAGE)."""
    pp = parallel_cfg.pipeline_model_parallel_size
    if parallel_cfg.pipeline_model_parallel_layout is not None:
        key = "pipeline_model_parallel_layout"
        counts = layout_counts(parallel_cfg.pipeline_model_parallel_layout, layers, pp, vpp)
    elif _given(parallel_cfg, _UNEVEN):
        key = _given(parallel_cfg, _UNEVEN)[0]
        counts = uneven_counts(layers, pp, vpp or 1,
                               parallel_cfg.decoder_first_pipeline_num_layers,
                               parallel_cfg.decoder_last_pipeline_num_layers)
    elif _given(parallel_cfg, _ACCOUNT):
        key = _given(parallel_cfg, _ACCOUNT)[0]
        counts = accounted_counts(layers, pp, vpp or 1,
                                  parallel_cfg.account_for_embedding_in_pipeline_split,
                                  parallel_cfg.account_for_loss_in_pipeline_split)
    else:
        return None
    for stage, chunks in enumerate(counts):
        for chunk, n in enumerate(chunks):
            if n == 0:
                raise ConfigError(f"{_named(key, getattr(parallel_cfg, key))} leaves stage "
                                  f"{stage} chunk {chunk} with no decoder layer: "
                                  f"{_NO_EMPTY_STAGE}; change the split")
    return counts if len(counts[0]) > 1 else [c[0] for c in counts]


def uneven_counts(layers, pp, vpp, first, last):
    """Per stage, per chunk: Megatron's uneven split (transformer_block.get_num_layers_to_build,
    its checks in TransformerConfig.__post_init__): the first / last stage `first` / `last`
    layers (each > 0, divisible by vpp), the rest split evenly over the other (middle) stages,
    which must divide them, each stage's layers even over its vpp chunks."""
    for key, n in zip(_UNEVEN, (first, last)):
        if n is not None and n <= 0:
            raise ConfigError(f"{_named(key, n)} must be larger than 0")
        if n is not None and n % vpp:
            raise ConfigError(f"{_named(key, n)} must be divisible by virtual pipeline parallel "
                              f"degree {vpp}")
    middle_stages = pp - (first is not None) - (last is not None)
    middle_layers = layers - (first or 0) - (last or 0)
    named = _named(_UNEVEN[0] if first is not None else _UNEVEN[1], first or last)
    if middle_stages < 0 or middle_layers < 0 or bool(middle_layers) != bool(middle_stages):
        raise ConfigError(f"{named}: mismatch: {middle_layers} middle layers remaining but "
                          f"{max(middle_stages, 0)} middle PP stages available (num_layers="
                          f"{layers}, pipeline_model_parallel_size={pp}): change the counts")
    per = middle_layers // middle_stages if middle_stages else 0
    if middle_stages and (middle_layers % middle_stages or per % vpp):
        raise ConfigError(f"{named}: number of layers at middle stage: {middle_layers} must be "
                          f"divisible by the middle pipeline model parallel size {middle_stages}"
                          f" x virtual pipeline parallel degree {vpp}")
    stages = [per] * pp
    if first is not None:
        stages[0] = first
    if last is not None:
        stages[-1] = last
    return [[n // vpp] * vpp for n in stages]


def accounted_counts(layers, pp, vpp, embedding, loss):
    """Per stage, per chunk: Megatron's split with the embedding and / or the loss counted as a
    layer (transformer_block.get_num_layers_to_build): layers + 1 for each, split evenly over
    pp x vpp chunks, then the first chunk of the first stage one decoder layer fewer (embedding)
    and the last chunk of the last stage one fewer (loss)."""
    counted = layers + bool(embedding) + bool(loss)
    named = _named(_ACCOUNT[0] if embedding else _ACCOUNT[1])
    if counted % pp or (counted // pp) % vpp:
        raise ConfigError(f"{named}: num_layers {layers} + {counted - layers} (the accounted "
                          f"embedding / loss) = {counted} must be divisible by "
                          f"pipeline_model_parallel_size {pp} x virtual chunks {vpp}")
    counts = [[counted // (pp * vpp)] * vpp for _ in range(pp)]
    counts[0][0] -= bool(embedding)
    counts[-1][-1] -= bool(loss)
    return counts


def parse_layout(text):
    """Megatron's layout string -> its virtual stages, in order (PipelineParallelLayerLayout.
    parse_str_to_list): commas dropped, "(..)*n" then "x*n" unrolled, split at "|"; e.g.
    "Et|(tt|)*2,tL" -> ["Et", "tt", "tt", "tL"]."""
    text = text.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    unknown = sorted(set(text) - set("ELtm|"))
    if unknown:
        raise ConfigError(f"{_named('pipeline_model_parallel_layout', text)}: invalid layer "
                          f"character {unknown[0]!r}: known E (embedding), t (decoder layer), "
                          "L (loss), m (MTP), | between stages")
    return text.split("|")


def layout_counts(text, layers, pp, vpp=None):
    """Per stage, per chunk, the decoder layers of Megatron's layout string (pipeline_parallel_
    layer_layout.py): virtual stage i = chunk * pp + stage (its 1D-to-2D mapping), so its stages
    divide by pp and give the chunks; validate_layer_layout's rules: E first and once, L last and
    once, num_layers t's. m (MTP) is not built here."""
    named = _named("pipeline_model_parallel_layout", text)
    stages = parse_layout(text)
    flat = "".join(stages)
    if "m" in flat:
        raise ConfigError(f"{named}: m (multi-token prediction) is not built here: remove it")
    if len(stages) % pp:
        raise ConfigError(f"{named}: its {len(stages)} stages must be divisible by "
                          f"pipeline_model_parallel_size {pp}")
    chunks = len(stages) // pp
    if vpp is not None and vpp != chunks:
        raise ConfigError(f"{named} gives {chunks} chunk(s) per stage: it conflicts with "
                          f"parallel_config.virtual_pipeline_model_parallel_size={vpp}")
    if not flat.startswith("E") or flat.count("E") != 1:
        raise ConfigError(f"{named}: the first layer must be embedding (E), given exactly once")
    if not flat.endswith("L") or flat.count("L") != 1:
        raise ConfigError(f"{named}: the last layer must be loss (L), given exactly once")
    if flat.count("t") != layers:
        raise ConfigError(f"{named}: number of decoder layers {flat.count('t')} must match "
                          f"model_config.num_layers {layers}")
    return [[stages[chunk * pp + stage].count("t") for chunk in range(chunks)]
            for stage in range(pp)]


def _check_profile(training_cfg):
    """Profiled steps within the run; sets profile_save_path's default."""
    if training_cfg.profile_save_path is None:
        training_cfg.profile_save_path = os.path.join(training_cfg.output_dir, "profile")
    if not training_cfg.profile:
        return
    start, end = training_cfg.profile_step_start, training_cfg.profile_step_end
    if not 1 <= start < end:
        raise ConfigError(f"training_config.profile_step_end={end} must be after "
                          f"profile_step_start={start} (>= 1): profiling stops "
                          "before step profile_step_end")
    if end > training_cfg.training_iters + 1:
        raise ConfigError(f"training_config.profile_step_end={end} is past the "
                          f"last step (training_iters={training_cfg.training_iters}): lower it to "
                          f"at most {training_cfg.training_iters + 1}")
    ranks = training_cfg.profile_ranks
    if ranks is not None and not all(isinstance(r, int) and r >= 0 for r in ranks):
        raise ConfigError(f"training_config.profile_ranks={ranks}: give a list of global ranks, "
                          "e.g. [0, 1]")


def finalize(cfg, world_size=1):
    """Derived values and the checks that involve several keys, section by section."""
    model_cfg, dataset_cfg, training_cfg = (cfg.model_config, cfg.dataset_config,
                                            cfg.training_config)
    optimizer_cfg, parallel_cfg = cfg.optimizer_config, cfg.parallel_config
    _positive(model_cfg, "model_config", ["num_layers", "hidden_size", "ffn_hidden_size",
                                          "num_attention_heads", "num_query_groups", "seq_length",
                                          "max_position_embeddings",
                                          "make_vocab_size_divisible_by", "norm_epsilon",
                                          "init_method_std"])
    _positive(dataset_cfg, "dataset_config", ["batch_size", "micro_batch_num",
                                              "global_batch_size", "vocab_size"])
    _positive(training_cfg, "training_config", ["training_iters", "log_interval",
                                                "eval_interval", "keep_checkpoint_max",
                                                "threads_num"])
    if training_cfg.save_interval is not None and training_cfg.save_interval < 0:
        raise ConfigError("training_config.save_interval must be >= 0 (0: no periodic saves), "
                          f"got {training_cfg.save_interval}")
    _finalize_model(model_cfg)
    _finalize_precision(model_cfg, training_cfg)
    _finalize_dataset(dataset_cfg)
    _finalize_parallel(parallel_cfg, model_cfg, dataset_cfg, world_size)
    _finalize_samples(training_cfg, dataset_cfg, optimizer_cfg.learning_rate_scheduler_kwargs,
                      parallel_cfg)
    _finalize_optimizer(optimizer_cfg, training_cfg)
    _finalize_moe(model_cfg, parallel_cfg)
    _finalize_training(training_cfg)
    _resolve_fsdp(training_cfg)
    _check_overlap(training_cfg, optimizer_cfg)
    _finalize_cpu_collectives(training_cfg, world_size)
    _check_torch_format(training_cfg, model_cfg, parallel_cfg)
    return cfg


def _resolve_fsdp(training_cfg):
    """Megatron-FSDP's rules: its sharding strategy (optim_grads_params unless given) takes effect
    with use_megatron_fsdp only; every strategy but no_shard runs the distributed optimizer
    (Megatron sets it, warning)."""
    strategy = training_cfg.data_parallel_sharding_strategy
    if not training_cfg.use_megatron_fsdp:
        if strategy is not None:
            raise ConfigError(f"training_config.data_parallel_sharding_strategy={strategy} "
                              "(--data-parallel-sharding-strategy) takes effect with "
                              "Megatron-FSDP only: add --use-megatron-fsdp "
                              "(training_config.use_megatron_fsdp)")
        return
    strategy = strategy or "optim_grads_params"
    training_cfg.data_parallel_sharding_strategy = strategy
    training_cfg.use_distributed_optimizer = strategy != "no_shard"


def sharded_by_fsdp(training_cfg):
    """What Megatron-FSDP shards beyond the distributed optimizer's state: (gradients,
    parameters), each a bool."""
    strategy = training_cfg.use_megatron_fsdp and training_cfg.data_parallel_sharding_strategy
    return strategy in ("optim_grads", "optim_grads_params"), strategy == "optim_grads_params"


def _check_overlap(training_cfg, optimizer_cfg):
    """Megatron's rules: the parameter gather overlaps only the distributed optimizer's, and
    only beside the gradient reduction's overlap."""
    if optimizer_cfg.overlap_param_gather and not training_cfg.use_distributed_optimizer:
        raise ConfigError("optimizer_config.overlap_param_gather (--overlap-param-gather) needs "
                          "the distributed optimizer: add --use-distributed-optimizer")
    if optimizer_cfg.overlap_param_gather and not training_cfg.overlap_grad_reduce:
        raise ConfigError("optimizer_config.overlap_param_gather (--overlap-param-gather) needs "
                          "--overlap-grad-reduce (training_config.overlap_grad_reduce)")


def local_worker_num():
    """How many workers share this machine (a string): run.sh's MS_LOCAL_WORKER_NUM, or
    LOCAL_WORKER_NUM, else all of msrun's (MS_WORKER_NUM: msrun names no local count, and a job
    of several nodes comes through run.sh); "1" alone."""
    for name in ("MS_LOCAL_WORKER_NUM", "LOCAL_WORKER_NUM", "MS_WORKER_NUM"):
        if os.environ.get(name):
            return os.environ[name]
    return "1"


SHARED_MEMORY = 1 << 30     # bytes of /dev/shm the shared-memory all-reduce may map: its groups'
                            # segments, (ranks + 1) x 4 MB each (a container's default is 64 MB)
SHM_TOKEN = "MGPT_SHM_TOKEN"    # a launch's secret, which names its segments (run.sh and
                                # cli.msrun_command draw one for each launch)


def _finalize_cpu_collectives(training_cfg, world_size):
    """The shared-memory all-reduce (backends/shared_memory.py) joins the workers of one machine
    whose stores others see in program order (x86): a CPU run, every worker on this machine
    (run.sh names how many, MS_LOCAL_WORKER_NUM), an msrun worker given its launch's secret.
    `auto` takes it where it can run, else MindSpore's own (mccl)."""
    machine = platform.machine().lower()
    local = int(os.environ.get("MS_LOCAL_WORKER_NUM") or world_size)
    free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    secretless = os.environ.get("MS_ROLE") == "MS_WORKER" and not os.environ.get(SHM_TOKEN)
    unfit = ("runs on the CPU only" if training_cfg.device_target != "CPU" else
             f"needs an x86 CPU (this is {machine})" if machine not in ("x86_64", "amd64") else
             f"joins the workers of one machine, not {world_size // local} nodes"
             if local < world_size else
             f"needs {SHARED_MEMORY >> 20} MiB free in /dev/shm ({free >> 20} MiB here)"
             if free < SHARED_MEMORY else
             f"needs the launch's secret {SHM_TOKEN}, which bash run.sh gives every launch"
             if secretless else None)
    if training_cfg.cpu_collectives == "auto":
        training_cfg.cpu_collectives = "mccl" if unfit else "shared_memory"
    elif training_cfg.cpu_collectives == "shared_memory" and unfit:
        raise ConfigError(f"training_config.cpu_collectives shared_memory (--cpu-collectives) "
                          f"{unfit}: use mccl (MindSpore's own) or auto")


# the keys of the fused forms (fused.py), each on by default; model_config.fusions false (the
# default; --fusions sets it) turns them all off (gpt.layer_spec: the plain model)
FUSION_KEYS = ("apply_swiglu_fusion", "apply_rope_fusion", "use_fused_rmsnorm",
               "persist_layer_norm", "bias_gelu_fusion", "masked_softmax_fusion",
               "bias_dropout_fusion", "cross_entropy_loss_fusion")


def _finalize_model(model_cfg):
    """Defaults derived from other keys (ffn 4h, one query group per head, positions), shapes that
    must divide, dropout ranges; no fused form without model_config.fusions."""
    if not model_cfg.fusions:
        for key in FUSION_KEYS:
            setattr(model_cfg, key, False)
    if model_cfg.ffn_hidden_size is None:
        model_cfg.ffn_hidden_size = 4 * model_cfg.hidden_size
    if model_cfg.num_query_groups is not None and not model_cfg.group_query_attention:
        raise ConfigError(f"model_config.num_query_groups={model_cfg.num_query_groups} needs "
                          "group_query_attention=true (--group-query-attention), as in Megatron")
    if not model_cfg.group_query_attention:
        model_cfg.num_query_groups = model_cfg.num_attention_heads
    elif model_cfg.num_query_groups is None:
        raise ConfigError("model_config.group_query_attention=true needs num_query_groups "
                          "(--num-query-groups)")
    if model_cfg.max_position_embeddings is None:
        model_cfg.max_position_embeddings = model_cfg.seq_length
    if model_cfg.hidden_size % model_cfg.num_attention_heads:
        raise ConfigError(f"model_config.hidden_size={model_cfg.hidden_size} must be divisible by "
                          f"num_attention_heads={model_cfg.num_attention_heads}")
    if model_cfg.num_attention_heads % model_cfg.num_query_groups:
        raise ConfigError("model_config.num_attention_heads="
                          f"{model_cfg.num_attention_heads} must be "
                          f"divisible by num_query_groups={model_cfg.num_query_groups}")
    head_dim = model_cfg.hidden_size // model_cfg.num_attention_heads
    if model_cfg.position_embedding_type == "rope" and head_dim % 2:
        raise ConfigError("model_config.position_embedding_type=rope needs an even head size "
                          "(hidden_size / num_attention_heads)")
    if model_cfg.seq_length > model_cfg.max_position_embeddings:
        raise ConfigError(f"model_config.seq_length={model_cfg.seq_length} exceeds "
                          f"max_position_embeddings={model_cfg.max_position_embeddings}")
    for k in ("attention_dropout_rate", "hidden_dropout_rate"):
        if not 0.0 <= getattr(model_cfg, k) < 1.0:
            raise ConfigError(f"model_config.{k} must be in [0, 1), got {getattr(model_cfg, k)}")


def _finalize_precision(model_cfg, training_cfg):
    """The dtypes of a run. Megatron's --fp16/--bf16 (training_config.fp16/bf16) compute in half
    precision with half-precision parameters (Megatron's Float16Module), the optimizer updating
    float32 copies of them (optimizer.MixedPrecisionOptimizer). The guides' MindSpore keys can also
    keep float32 parameters and compute in half precision (params_dtype float32, compute_dtype
    float16): each matmul casts its weights. Half-precision parameters compute in their own dtype;
    bfloat16 accumulates and reduces gradients in float32 (Megatron's rule)."""
    if training_cfg.fp16 and training_cfg.bf16:
        raise ConfigError("training_config.fp16 and bf16 are both set: choose one")
    flag = "float16" if training_cfg.fp16 else "bfloat16" if training_cfg.bf16 else None
    if flag and model_cfg.compute_dtype not in (None, flag):
        raise ConfigError(f"training_config.{'fp16' if training_cfg.fp16 else 'bf16'} computes in "
                          f"{flag}, but model_config.compute_dtype is {model_cfg.compute_dtype}: "
                          "give one of them")
    model_cfg.compute_dtype = model_cfg.compute_dtype or flag or "float32"
    model_cfg.params_dtype = model_cfg.params_dtype or flag or "float32"
    if model_cfg.params_dtype not in ("float32", model_cfg.compute_dtype):
        raise ConfigError(f"model_config.params_dtype={model_cfg.params_dtype} with "
                          f"compute_dtype={model_cfg.compute_dtype}: half-precision parameters "
                          "compute in their own dtype; set compute_dtype to it (--fp16/--bf16), or "
                          "params_dtype float32")
    if model_cfg.compute_dtype == "bfloat16":
        training_cfg.accumulate_allreduce_grads_in_fp32 = True
    if model_cfg.fp16_lm_cross_entropy and model_cfg.compute_dtype != "float16":
        raise ConfigError("model_config.fp16_lm_cross_entropy (--fp16-lm-cross-entropy) needs "
                          "float16 compute (--fp16), as in Megatron")
    if model_cfg.apply_query_key_layer_scaling and not model_cfg.attention_softmax_in_fp32:
        raise ConfigError("model_config.apply_query_key_layer_scaling scales the scores back "
                          "inside a float32 softmax: remove --no-attention-softmax-in-fp32 "
                          "(Megatron forces it)")


def _finalize_optimizer(optimizer_cfg, training_cfg):
    """Betas, the weight-decay increment and the lr schedule (warmup in iterations or as a
    fraction)."""
    betas = optimizer_cfg.betas
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
        raise ConfigError(f"optimizer_config.betas must be two numbers in [0, 1), got {betas}")
    optimizer_cfg.betas = [float(b) for b in betas]
    for k in ("learning_rate", "weight_decay", "eps"):
        if not math.isfinite(getattr(optimizer_cfg, k)) or getattr(optimizer_cfg, k) < 0:
            raise ConfigError(f"optimizer_config.{k} must be a finite number >= 0, "
                              f"got {getattr(optimizer_cfg, k)}")
    _finalize_weight_decay(optimizer_cfg)
    schedule = optimizer_cfg.learning_rate_scheduler_kwargs
    unit = "samples" if sample_based(training_cfg) else "iters"         # the keys' suffix
    words = "samples" if unit == "samples" else "iterations"
    if schedule.lr_decay_iters is None and unit == "iters":
        schedule.lr_decay_iters = training_cfg.training_iters
    if schedule.lr_warmup_fraction is not None:
        if getattr(schedule, f"lr_warmup_{unit}"):
            raise ConfigError(f"set only one of lr_warmup_{unit} and lr_warmup_fraction "
                              "(optimizer_config.learning_rate_scheduler_kwargs)")
        if not 0.0 <= schedule.lr_warmup_fraction <= 1.0:
            raise ConfigError("optimizer_config.learning_rate_scheduler_kwargs."
                              "lr_warmup_fraction must be in [0, 1]")
    warmup, decay, _, wsd = lr_schedule_steps(schedule, training_cfg)
    if warmup < 0 or warmup >= decay:
        given = (f"lr_warmup_fraction={schedule.lr_warmup_fraction} (a warmup of {warmup:g} "
                 f"{words})" if schedule.lr_warmup_fraction is not None
                 else f"lr_warmup_{unit}={warmup}")
        raise ConfigError(f"optimizer_config.learning_rate_scheduler_kwargs.{given} must be at "
                          f"least 0 and below lr_decay_{unit}={decay}")
    if schedule.lr_decay_style == "WSD" and not (wsd and 0 < wsd <= decay):
        raise ConfigError(f"optimizer_config.learning_rate_scheduler_kwargs.lr_wsd_decay_{unit}="
                          f"{wsd}: lr_decay_style=WSD needs its last decay's {words}, from 1 "
                          f"to lr_decay_{unit}={decay} (--lr-wsd-decay-{unit})")
    if not 0.0 <= schedule.lr_warmup_init <= optimizer_cfg.learning_rate:
        raise ConfigError("optimizer_config.learning_rate_scheduler_kwargs.lr_warmup_init="
                          f"{schedule.lr_warmup_init} must be from 0 to learning_rate="
                          f"{optimizer_cfg.learning_rate}")
    if schedule.min_lr > optimizer_cfg.learning_rate:
        raise ConfigError("optimizer_config.learning_rate_scheduler_kwargs.min_lr="
                          f"{schedule.min_lr} exceeds learning_rate={optimizer_cfg.learning_rate}")


def lr_schedule_steps(schedule, training_cfg):
    """(lr_warmup_steps, lr_decay_steps, wd_incr_steps, wsd_decay_steps) of the learning-rate and
    weight-decay schedules, as Megatron's get_optimizer_param_scheduler counts them, a
    fractional warmup unrounded (lr_warmup_fraction x lr_decay_steps): in samples with
    train_samples (sample-based training; the scheduler steps by each step's samples), else in
    iterations. Megatron counts samples there too, an iteration being global_batch_size of
    them: with a constant global batch the learning rate and weight decay at every step are
    those of these counts (the same ratios)."""
    if sample_based(training_cfg):
        decay, wsd = schedule.lr_decay_samples, schedule.lr_wsd_decay_samples
        warmup, total = schedule.lr_warmup_samples, training_cfg.train_samples
    else:
        decay, wsd = schedule.lr_decay_iters, schedule.lr_wsd_decay_iters
        warmup, total = schedule.lr_warmup_iters, training_cfg.training_iters
    if schedule.lr_warmup_fraction is not None:
        warmup = schedule.lr_warmup_fraction * decay
    return warmup, decay, total, wsd


# ============================================================================ counting samples
def sample_based(training_cfg):
    """Whether training counts samples (Megatron's --train-samples), not iterations."""
    return training_cfg.train_samples is not None


def _finalize_samples(training_cfg, dataset_cfg, schedule, parallel_cfg):
    """Megatron's two ways of counting a run (arguments.py): iterations (--train-iters), the
    schedules in iterations; or samples (--train-samples), the schedules and the batch-size
    ramp-up in samples, the iterations following (update_train_iters)."""
    where = "optimizer_config.learning_rate_scheduler_kwargs."
    ramp = dataset_cfg.rampup_batch_size
    if not sample_based(training_cfg):
        given = [where + k for k in ("lr_warmup_samples", "lr_decay_samples",
                                     "lr_wsd_decay_samples") if getattr(schedule, k)]
        given += ["dataset_config.rampup_batch_size"] if ramp else []
        if given:
            raise ConfigError(f"{given[0]} counts samples: give --train-samples (sample-based "
                              "training), as Megatron asks")
        return
    if training_cfg.train_samples < 1:
        raise ConfigError("training_config.train_samples must be positive, got "
                          f"{training_cfg.train_samples}")
    given = [k for k in ("lr_warmup_iters", "lr_decay_iters", "lr_wsd_decay_iters")
             if getattr(schedule, k)]
    if given:
        raise ConfigError(f"{where}{given[0]} counts iterations: with --train-samples give "
                          f"--{given[0].replace('_', '-').replace('iters', 'samples')}, "
                          "as Megatron asks")
    if schedule.lr_decay_samples is None:
        schedule.lr_decay_samples = training_cfg.train_samples
    if ramp is not None:
        _check_rampup(ramp, dataset_cfg, parallel_cfg)
    training_cfg.training_iters = train_iterations(training_cfg.train_samples,
                                                   dataset_cfg.global_batch_size, ramp)
    if training_cfg.training_iters < 1:
        raise ConfigError(f"training_config.train_samples={training_cfg.train_samples} is less "
                          "than one global batch: nothing to train")


def global_batch_size_at(consumed, global_batch_size, rampup):
    """The global batch after `consumed` samples: Megatron's
    RampupBatchsizeNumMicroBatchesCalculator.update, from rampup = [start, increment, samples]
    (start + increment x the increments those samples allow, then global_batch_size), or
    global_batch_size without a ramp-up."""
    if rampup is None or consumed > rampup[2]:
        return global_batch_size
    start, increment, samples = rampup
    per_increment = samples / ((global_batch_size - start) // increment)
    return start + int(consumed / per_increment) * increment


def train_iterations(train_samples, global_batch_size, rampup):
    """The iterations of sample-based training: Megatron's update_train_iters (the ramp-up's
    steps while its samples last, then whole global batches; a partial last one dropped)."""
    if rampup is None:
        return train_samples // global_batch_size
    iterations = consumed = 0
    while consumed <= rampup[2] and consumed <= train_samples:
        consumed += global_batch_size_at(consumed, global_batch_size, rampup)
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // global_batch_size
    return iterations


def _check_rampup(ramp, dataset_cfg, parallel_cfg):
    """Megatron's rules of --rampup-batch-size START INCREMENT SAMPLES: three numbers, START
    below the global batch by a multiple of INCREMENT, and every batch of the ramp a whole
    number of micro-batches on each DP rank (its consistency check; the interleaved schedule
    also needs them a multiple of PP)."""
    gbs, per_step = dataset_cfg.global_batch_size, dataset_cfg.batch_size * (
        parallel_cfg.data_parallel_size)
    flag = "dataset_config.rampup_batch_size (--rampup-batch-size START INCREMENT SAMPLES)"
    if len(ramp) != 3 or not all(isinstance(v, int) for v in ramp):
        raise ConfigError(f"{flag}: three whole numbers, got {ramp}")
    start, increment, samples = ramp
    if not (0 < start < gbs and increment > 0 and samples >= 0 and (gbs - start) % increment == 0):
        raise ConfigError(f"{flag}={ramp}: START from 1 to below global_batch_size={gbs}, which "
                          "it reaches by INCREMENTs, and SAMPLES >= 0")
    pp = parallel_cfg.pipeline_model_parallel_size
    whole = per_step * (pp if parallel_cfg.virtual_pipeline_model_parallel_size > 1 else 1)
    odd = [b for b in range(start, gbs, increment) if b % whole]
    if odd:
        raise ConfigError(f"{flag}={ramp}: a global batch of {odd[0]} is not a multiple of "
                          f"{whole} (batch_size x data-parallel size"
                          + (" x pipeline stages, interleaved" if whole != per_step else "")
                          + "): choose START and INCREMENT multiples of it")


def _finalize_weight_decay(optimizer_cfg):
    """Megatron's rule: a constant weight decay is weight_decay (start and end unset, or equal to
    it); linear and cosine go from start_weight_decay to end_weight_decay, both given."""
    where = "optimizer_config."
    start, end = optimizer_cfg.start_weight_decay, optimizer_cfg.end_weight_decay
    decay, style = optimizer_cfg.weight_decay, optimizer_cfg.weight_decay_incr_style
    if style == "constant":
        if {start, end} - {None, decay}:
            raise ConfigError(f"{where}start_weight_decay={start}, end_weight_decay={end} with "
                              f"weight_decay_incr_style=constant: a constant decay is weight_decay="
                              f"{decay}; remove them or choose linear or cosine")
        optimizer_cfg.start_weight_decay = optimizer_cfg.end_weight_decay = decay
    elif start is None or end is None:
        raise ConfigError(f"{where}weight_decay_incr_style={style} needs "
                          "start_weight_decay and end_weight_decay (--start-weight-decay, "
                          "--end-weight-decay), as in Megatron")


def parse_split(split):
    """Megatron's parse_and_normalize_split: --split "949,50,1" (or "0.8/0.1/0.1") -> the train,
    validation and test fractions of the documents, summing to 1 (missing weights are 0). Up to
    three non-negative numbers, not all 0, separated by commas or slashes."""
    try:
        weights = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"dataset_config.split={split!r}: expected up to three weights "
                          "like 949,50,1")
    weights += [0.0] * (3 - len(weights))
    return [w / sum(weights) for w in weights]


# the shipped text and the prefix `bash run.sh` tokenizes it to on first use (the default data)
SHIPPED_CORPUS = ("data/tinyshakespeare.txt", "data/tinyshakespeare")
DEFAULT_SPLIT = "949,50,1"
PER_SPLIT_PATHS = ("train_data_path", "valid_data_path", "test_data_path")


def _number(word):
    """float(word), or None for a word that is not a number (a prefix)."""
    try:
        return float(word)
    except (TypeError, ValueError):
        return None


def parse_blend(words, key="dataset_config.data_path"):
    """Megatron's get_blend_from_list: ["30", "web", "70", "books"] -> (["web", "books"],
    [30.0, 70.0]) (data.py normalises the weights where Megatron does); a list of prefixes (or
    one prefix) -> (prefixes, None), each weighed by its samples. A blend is weighted when its
    first word is a number; then every other word must be one."""
    words = [words] if isinstance(words, str) else list(words or [])
    shown = f"{key}={' '.join(map(str, words))}"
    if not words:
        raise ConfigError(f"{key} is empty: give a prefix, or weights and prefixes "
                          "(--data-path 0.3 web 0.7 books)")
    if _number(words[0]) is None:
        bad = [w for w in words if _number(w) is not None or not isinstance(w, str)]
        if bad:
            raise ConfigError(f"{shown}: {bad[0]!r} is a weight among prefixes: give a weight "
                              "before every prefix (0.3 web 0.7 books) or none")
        return [w.strip() for w in words], None
    weights, prefixes = words[0::2], words[1::2]
    if len(words) % 2 or any(_number(w) is None for w in weights) or any(
            _number(p) is not None or not isinstance(p, str) for p in prefixes):
        raise ConfigError(f"{shown}: {len(words)} words; a weighted blend is pairs of a weight "
                          "and a prefix (0.3 web 0.7 books)")
    weights = [_number(w) for w in weights]
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise ConfigError(f"{shown}: every weight must be a number above 0 (Megatron's "
                          "BlendedDataset); drop a corpus rather than give it weight 0")
    return [p.strip() for p in prefixes], weights


def samples_per_split(cfg):
    """(train, valid, test) samples a run asks of its data, Megatron's
    train_valid_test_datasets_provider sizes: every step's global batch, eval_iters batches at
    each evaluation and at the end, and eval_iters batches of test."""
    training_cfg, gbs = cfg.training_config, cfg.dataset_config.global_batch_size
    iters, eval_iters = training_cfg.training_iters, training_cfg.eval_iters
    train = training_cfg.train_samples if sample_based(training_cfg) else iters * gbs
    return (train, (iters // training_cfg.eval_interval + 1) * eval_iters * gbs,
            eval_iters * gbs)


def _finalize_dataset(dataset_cfg):
    """The blend (or per-split blends) and split, and what the tokenizer and mock data need.
    Megatron's BlendedMegatronDatasetConfig: a blend with --split, or a blend per split without
    it ("split and blend_per_split are incompatible")."""
    per_split = [k for k in PER_SPLIT_PATHS if getattr(dataset_cfg, k) is not None]
    if per_split and not dataset_cfg.mock_data:
        given = [k for k in ("data_path", "split") if getattr(dataset_cfg, k) is not None]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise ConfigError(f"dataset_config.{given[0]} ({flag}) with {per_split[0]}: the "
                              "per-split paths name each split's corpus; remove "
                              f"{flag}, as Megatron does")
        if "train_data_path" not in per_split:
            raise ConfigError(f"dataset_config.{per_split[0]} without train_data_path: give "
                              "--train-data-path too (or --data-path and --split for all three)")
        for k in per_split:
            parse_blend(getattr(dataset_cfg, k), "dataset_config." + k)
    else:
        if dataset_cfg.data_path is None:
            dataset_cfg.data_path = SHIPPED_CORPUS[1] + "_text_document"
        if dataset_cfg.split is None:
            dataset_cfg.split = DEFAULT_SPLIT
        parse_split(dataset_cfg.split)
        parse_blend(dataset_cfg.data_path)
    _finalize_tokens(dataset_cfg)


def _finalize_tokens(dataset_cfg):
    """What the tokenizer, mock data and the document masks need."""
    if dataset_cfg.tokenizer_type == "NullTokenizer" and dataset_cfg.vocab_size is None:
        raise ConfigError("dataset_config.tokenizer_type=NullTokenizer needs "
                          "dataset_config.vocab_size (--vocab-size)")
    needs_vocab_size = dataset_cfg.tokenizer_type != "GPT2BPETokenizer"
    if dataset_cfg.mock_data and dataset_cfg.vocab_size is None and needs_vocab_size:
        raise ConfigError("dataset_config.mock_data needs dataset_config.vocab_size (--vocab-size)")
    for k in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
        if getattr(dataset_cfg, k) and dataset_cfg.mock_data:
            raise ConfigError(f"dataset_config.{k} needs real data with EOD tokens, not mock_data")


def _finalize_parallel(parallel_cfg, model_cfg, dataset_cfg, world_size):
    """The layout against the model and the world size; derives data_parallel_size and
    micro_batch_num."""
    _positive(parallel_cfg, "parallel_config", ["tensor_model_parallel_size",
                                                "pipeline_model_parallel_size",
                                                "context_parallel_size"])
    _check_context_parallel(parallel_cfg, model_cfg, dataset_cfg)
    _check_pipeline(parallel_cfg, model_cfg)
    _check_flash_attention(model_cfg, parallel_cfg)
    _finalize_recompute(model_cfg, parallel_cfg)
    tp = parallel_cfg.tensor_model_parallel_size
    for k in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        if getattr(model_cfg, k) % tp:
            raise ConfigError(f"model_config.{k}={getattr(model_cfg, k)} is not divisible by "
                              f"parallel_config.tensor_model_parallel_size={tp}")
    if model_cfg.vocab_size is not None and model_cfg.vocab_size % tp:
        raise ConfigError(f"model_config.vocab_size={model_cfg.vocab_size} is not divisible by "
                          f"tensor_model_parallel_size={tp}: leave it null to pad automatically")
    if model_cfg.vocab_size is None and model_cfg.make_vocab_size_divisible_by % tp:
        raise ConfigError("model_config.make_vocab_size_divisible_by="
                          f"{model_cfg.make_vocab_size_divisible_by} is not a multiple of "
                          f"tensor_model_parallel_size={tp}: the padded vocabulary must split "
                          "into equal shards; use a multiple of it (e.g. 128)")
    if parallel_cfg.sequence_parallel and tp == 1:
        raise ConfigError("parallel_config.sequence_parallel needs tensor_model_parallel_size > 1")
    if parallel_cfg.sequence_parallel and model_cfg.seq_length % tp:
        raise ConfigError(f"model_config.seq_length={model_cfg.seq_length} is not divisible by "
                          f"tensor_model_parallel_size={tp}, as sequence_parallel needs")
    pp, cp = parallel_cfg.pipeline_model_parallel_size, parallel_cfg.context_parallel_size
    dp = data_parallel_size(world_size, tp, cp, pp)
    if parallel_cfg.data_parallel_size not in (None, dp):
        raise ConfigError("parallel_config.data_parallel_size="
                          f"{parallel_cfg.data_parallel_size}, but world "
                          f"size {world_size} / (tensor x context x pipeline parallel sizes "
                          f"{tp * cp * pp}) = {dp}: the data-parallel size follows from the "
                          "number of workers; change --nproc or leave it null")
    _finalize_batch(dataset_cfg, dp)
    if parallel_cfg.virtual_pipeline_model_parallel_size > 1 and dataset_cfg.micro_batch_num % pp:
        raise ConfigError(f"dataset_config.micro_batch_num={dataset_cfg.micro_batch_num} is not "
                          f"divisible by pipeline_model_parallel_size={pp}, as the interleaved "
                          "schedule needs: change global_batch_size or batch_size")
    parallel_cfg.data_parallel_size = dp


def data_parallel_size(world_size, tp, cp, pp):
    """The layout's first divisibility rule (Megatron's initialize_model_parallel): tp x cp x pp
    divides the world size, and the data-parallel size is what is left."""
    if world_size % (tp * cp * pp):
        raise ConfigError(f"world size {world_size} is not a multiple of tensor x context x "
                          f"pipeline parallel sizes = {tp * cp * pp}: change --nproc or the "
                          "parallel sizes")
    return world_size // (tp * cp * pp)


def check_expert_parallel_size(ep, dp_cp):
    """The layout's second divisibility rule: EP is carved out of DP x CP (Megatron's
    parallel_state.py), so it divides dp x cp."""
    if dp_cp % ep:
        raise ConfigError(f"parallel_config.expert_model_parallel_size={ep} does not divide data "
                          f"x context parallel sizes = {dp_cp}: change --nproc or the sizes")


def _finalize_batch(dataset_cfg, dp):
    """The global batch = micro-batch size x micro-batches x DP; given two, the third follows,
    and all three must agree (no value is silently replaced)."""
    per_step = dataset_cfg.batch_size * dp
    if dataset_cfg.global_batch_size is not None:
        if dataset_cfg.global_batch_size % per_step:
            raise ConfigError("dataset_config.global_batch_size="
                              f"{dataset_cfg.global_batch_size} must be a "
                              f"multiple of batch_size x data-parallel size = {per_step}")
        derived = dataset_cfg.global_batch_size // per_step
        if dataset_cfg.micro_batch_num not in (None, derived):
            raise ConfigError("dataset_config.micro_batch_num="
                              f"{dataset_cfg.micro_batch_num} contradicts "
                              f"global_batch_size={dataset_cfg.global_batch_size} = batch_size "
                              f"{dataset_cfg.batch_size} x data-parallel size {dp} x {derived} "
                              "micro-batches: give one of them")
        dataset_cfg.micro_batch_num = derived
    dataset_cfg.micro_batch_num = dataset_cfg.micro_batch_num or 1
    dataset_cfg.global_batch_size = per_step * dataset_cfg.micro_batch_num


def cp_ring_size(cp, ulysses):
    """The ring's size in context parallelism, the one place it is worked out: cp = ring x ulysses,
    the cp ranks as `ring` groups of `ulysses` adjacent ranks (context_parallel.py)."""
    return cp // ulysses


# Megatron's --cp-comm-type -> the algorithm (MindSpeed's name) it runs
CP_COMM_TYPES = {"a2a": "ulysses_cp_algo", "p2p": "megatron_cp_algo",
                 "all_gather": "megatron_cp_algo", "a2a+p2p": "hybrid_cp_algo"}
ALGO_COMM_TYPES = {"ulysses_cp_algo": "a2a", "megatron_cp_algo": "p2p", "hybrid_cp_algo": "a2a+p2p"}


def _resolve_cp_comm_type(parallel_cfg, model_cfg):
    """context_parallel_algo (MindSpeed's) and cp_comm_type (Megatron's) made to agree: one
    given decides the other; the algorithm's default gives way to a comm type."""
    algo, comm = parallel_cfg.context_parallel_algo, model_cfg.cp_comm_type
    if comm is None:
        model_cfg.cp_comm_type = ALGO_COMM_TYPES[algo]
    elif algo in ("ulysses_cp_algo", CP_COMM_TYPES[comm]):
        parallel_cfg.context_parallel_algo = CP_COMM_TYPES[comm]
    else:
        raise ConfigError(f"model_config.cp_comm_type={comm} (--cp-comm-type) runs "
                          f"{CP_COMM_TYPES[comm]}, not parallel_config.context_parallel_algo="
                          f"{algo}: give one of the two")


def _check_context_parallel(parallel_cfg, model_cfg, dataset_cfg):
    """Context parallelism (context_parallel.py): cp = ring x ulysses; sets ulysses_degree_in_cp
    and the comm type."""
    _resolve_cp_comm_type(parallel_cfg, model_cfg)
    cp, tp = parallel_cfg.context_parallel_size, parallel_cfg.tensor_model_parallel_size
    algo, u = parallel_cfg.context_parallel_algo, parallel_cfg.ulysses_degree_in_cp
    if algo == "hybrid_cp_algo" and (u is None or u < 1 or cp % u):
        raise ConfigError(f"parallel_config.ulysses_degree_in_cp={u}: hybrid_cp_algo needs a "
                          f"divisor of context_parallel_size={cp} (--ulysses-degree-in-cp)")
    # Ulysses alone spans the whole cp group; the ring alone has no Ulysses part.
    if algo == "hybrid_cp_algo":
        ulysses = u
    elif algo == "ulysses_cp_algo":
        ulysses = cp
    else:
        ulysses = 1
    if u not in (None, ulysses):
        raise ConfigError(f"parallel_config.ulysses_degree_in_cp={u} is for "
                          f"context_parallel_algo=hybrid_cp_algo; leave it null with {algo}")
    parallel_cfg.ulysses_degree_in_cp = ulysses
    ring = cp_ring_size(cp, ulysses)
    for k in ("num_attention_heads", "num_query_groups"):
        if cp > 1 and getattr(model_cfg, k) % (tp * ulysses):
            raise ConfigError(f"model_config.{k}={getattr(model_cfg, k)} is not divisible by "
                              f"tensor_model_parallel_size x Ulysses degree = {tp} x {ulysses}: "
                              "Ulysses splits the heads over both (or use megatron_cp_algo)")
    if ring > 1:
        pieces = 2 * cp
        how = "cuts it into 2 x context_parallel_size chunks (the ring's load balancing)"
    else:
        pieces, how = cp, "splits it over context_parallel_size ranks"
    if model_cfg.seq_length % pieces:
        raise ConfigError(f"model_config.seq_length={model_cfg.seq_length} is not divisible by "
                          f"{pieces}: context parallelism {how}")
    if parallel_cfg.sequence_parallel and (model_cfg.seq_length // cp) % tp:
        raise ConfigError(f"model_config.seq_length={model_cfg.seq_length}: a cp rank's "
                          f"{model_cfg.seq_length // cp} tokens are not divisible by "
                          f"tensor_model_parallel_size={tp}, as sequence_parallel needs")
    if ring > 1 and model_cfg.cp_comm_type != "all_gather":
        _check_ring(model_cfg)
    if ring > 1 and dataset_cfg.reset_attention_mask:
        raise ConfigError("dataset_config.reset_attention_mask does not work with ring attention "
                          f"({algo}): use context_parallel_algo=ulysses_cp_algo, or "
                          "reset_position_ids alone")


def _check_ring(model_cfg):
    """What context_parallel.RingAttention (a ring passing blocks) does not build, refused: like
    flash attention its backward recomputes each block's probabilities, so it has no attention
    dropout (the masks would have to be replayed) and needs no selective recompute."""
    fix = f"or --cp-comm-type all_gather (model_config.cp_comm_type={model_cfg.cp_comm_type})"
    if model_cfg.attention_dropout_rate > 0:
        raise ConfigError("model_config.attention_dropout_rate="
                          f"{model_cfg.attention_dropout_rate} with ring attention: its backward "
                          "recomputes the blocks without dropout; set --attention-dropout 0, "
                          + fix)
    if model_cfg.recompute_granularity == "selective":
        raise ConfigError("model_config.recompute_granularity=selective with ring attention: its "
                          "backward already recomputes its blocks; remove --recompute-activations, "
                          + fix)


def _check_flash_attention(model_cfg, parallel_cfg):
    """What gpt.FlashAttention does not build, refused: attention dropout (its backward would have
    to replay each block's mask), a half-precision softmax (its blocks' softmax is float32, as
    Megatron's flash kernels'), selective recompute (its backward already recomputes the
    s x s part) and ring attention (it attends in its own blocks); Ulysses runs the flash core
    over the whole sequence with its share of the heads."""
    if not model_cfg.use_flash_attention:
        return
    fix = "or drop --use-flash-attn (model_config.use_flash_attention)"
    if model_cfg.attention_dropout_rate > 0:
        raise ConfigError("model_config.attention_dropout_rate="
                          f"{model_cfg.attention_dropout_rate} with use_flash_attention: flash "
                          f"attention has no dropout here; set --attention-dropout 0, {fix}")
    if not model_cfg.attention_softmax_in_fp32:
        raise ConfigError("model_config.attention_softmax_in_fp32=false with use_flash_attention: "
                          "its softmax is float32; remove --no-attention-softmax-in-fp32, " + fix)
    if model_cfg.recompute_granularity == "selective":
        raise ConfigError("model_config.recompute_granularity=selective with use_flash_attention:"
                          " flash attention already recomputes its blocks in the backward; "
                          "remove --recompute-activations, " + fix)
    cp = parallel_cfg.context_parallel_size
    if cp_ring_size(cp, parallel_cfg.ulysses_degree_in_cp) > 1:
        raise ConfigError(f"parallel_config.context_parallel_algo="
                          f"{parallel_cfg.context_parallel_algo} (a ring of "
                          f"{cp_ring_size(cp, parallel_cfg.ulysses_degree_in_cp)}) with "
                          "use_flash_attention: not built (the ring attends in its own blocks); "
                          "use context_parallel_algo=ulysses_cp_algo, " + fix)


def per_stage_and_chunk(values):
    """A per-stage list of numbers ([3, 1]) or of per-chunk lists ([[2, 1], [1, 2]]), as
    num_layer_list and recompute_num_layers take it -> per stage, per chunk ([[3], [1]])."""
    return [entry if isinstance(entry, list) else [entry] for entry in values]


def stage_layer_counts(num_layers, pp, vpp=1, num_layer_list=None):
    """Per pipeline stage, the layers of each of its vpp model chunks, the one place they are
    worked out (pipeline.layer_split deals them out): num_layer_list as given or as Megatron's
    split flags gave it (_check_pipeline, megatron_layer_counts), else num_layers / (pp * vpp)
    each; e.g. [[2, 2], [2, 2]] for 8 layers, pp 2, vpp 2; [[3], [1]] for num_layer_list [3, 1]."""
    if num_layer_list is None:
        return [[num_layers // (pp * vpp)] * vpp for _ in range(pp)]
    return per_stage_and_chunk(num_layer_list)


def _stage_layer_counts(parallel_cfg, model_cfg):
    """stage_layer_counts of a config's parallel_config and model_config."""
    return stage_layer_counts(model_cfg.num_layers, parallel_cfg.pipeline_model_parallel_size,
                              parallel_cfg.virtual_pipeline_model_parallel_size,
                              parallel_cfg.num_layer_list)


def recompute_counts(parallel_cfg, model_cfg):
    """Per pipeline stage, for each of its model chunks, how many layers full recompute rebuilds
    (after _finalize_recompute): uniform, all of them (in groups of recompute_num_layers); block,
    the first recompute_num_layers (a number, or a list per stage or per stage and chunk); none
    without full recompute. E.g. [[2, 0], [1, 1]] for block [[2, 0], [1, 1]] over 2 stages x 2
    chunks."""
    counts, n = _stage_layer_counts(parallel_cfg, model_cfg), model_cfg.recompute_num_layers
    if model_cfg.recompute_granularity != "full":
        return [[0] * len(c) for c in counts]
    if model_cfg.recompute_method == "uniform":
        return counts
    if isinstance(n, list):
        return per_stage_and_chunk(n)
    return [[n] * len(c) for c in counts]


def _finalize_recompute(model_cfg, parallel_cfg):
    """The guide's parallel_config.recompute / select_recompute mapped onto Megatron's
    model_config.recompute_granularity, recompute_method and recompute_num_layers, then Megatron's
    rules for them (megatron/core/transformer/transformer_config.py, training/arguments.py):
    selective takes no method and no count; full needs a method and recompute_num_layers, which
    for uniform divides the layers of every stage (and chunk) and for block is at most their
    number."""
    megatron = _map_guide_recompute(model_cfg, parallel_cfg)
    where = "model_config.recompute_"
    if model_cfg.recompute_granularity is None:
        if megatron:
            raise ConfigError(f"model_config.{megatron[0]} needs {where}granularity=full "
                              "(--recompute-granularity)")
        return
    if model_cfg.recompute_granularity == "selective":
        if model_cfg.recompute_method is not None or model_cfg.recompute_num_layers is not None:
            raise ConfigError(f"{where}granularity=selective takes no recompute_method or "
                              "recompute_num_layers (Megatron): it recomputes the core attention "
                              "of every layer; remove them")
        return
    _check_full_recompute(model_cfg, parallel_cfg)


def _map_guide_recompute(model_cfg, parallel_cfg):
    """The guide's parallel_config.recompute (true: every layer; N: the first N layers of each
    stage) or select_recompute (true) written as Megatron's model_config.recompute_* keys, the
    guide's keys then cleared. Returns the recompute_* keys the config set itself; giving both
    kinds, or both guide keys, is refused."""
    guide = [k for k in ("recompute", "select_recompute")
             if getattr(parallel_cfg, k) not in (None, False)]
    megatron = [k for k in ("recompute_granularity", "recompute_method", "recompute_num_layers")
                if getattr(model_cfg, k) is not None]
    if guide and megatron:
        raise ConfigError(f"parallel_config.{guide[0]} and model_config.{megatron[0]} both set "
                          "recompute: give the guide's parallel_config keys or Megatron's "
                          "model_config.recompute_* keys, not both")
    if len(guide) == 2:
        raise ConfigError("parallel_config.recompute and select_recompute are both set: a run "
                          "has one granularity, full (recompute) or selective (select_recompute)")
    if parallel_cfg.select_recompute not in (None, False):
        if parallel_cfg.select_recompute is not True:
            raise ConfigError("parallel_config.select_recompute="
                              f"{parallel_cfg.select_recompute}: per-stage "
                              "lists are not supported; give true (the core attention of every "
                              "layer is recomputed)")
        model_cfg.recompute_granularity = "selective"
    elif parallel_cfg.recompute not in (None, False):
        model_cfg.recompute_granularity = "full"
        if parallel_cfg.recompute is True:
            model_cfg.recompute_method, model_cfg.recompute_num_layers = "uniform", 1
        else:
            model_cfg.recompute_method = "block"
            model_cfg.recompute_num_layers = parallel_cfg.recompute
    # mapped: the run's config holds Megatron's keys alone
    parallel_cfg.recompute = parallel_cfg.select_recompute = None
    return megatron


def _check_full_recompute(model_cfg, parallel_cfg):
    """Full recompute's method and recompute_num_layers against the layers of every pipeline
    stage (and chunk): uniform's group size divides them, block's count is at most their number;
    a list (block only) gives the count per stage, or per stage and chunk."""
    where = "model_config.recompute_"
    n, counts = model_cfg.recompute_num_layers, _stage_layer_counts(parallel_cfg, model_cfg)
    if model_cfg.recompute_method is None:
        raise ConfigError(f"{where}granularity=full needs {where}method uniform or block "
                          "(--recompute-method)")
    if n is None:
        raise ConfigError(f"{where}granularity=full needs {where}num_layers "
                          "(--recompute-num-layers), between 1 and the "
                          f"{min(min(c) for c in counts)} layers of a pipeline stage")
    if isinstance(n, list):
        nested = all(isinstance(c, list) for c in n)
        shaped = [c if nested else [c] for c in n]
        if (model_cfg.recompute_method != "block"
                or [len(c) for c in shaped] != [len(c) for c in counts]
                or not all(isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= total
                           for c, cc in zip(shaped, counts) for k, total in zip(c, cc))):
            raise ConfigError(f"{where}num_layers={n}: a list takes recompute_method=block and "
                              "gives per pipeline stage (or per stage and chunk) at most its "
                              f"layers {counts}")
        return
    if n < 1:
        raise ConfigError(f"{where}num_layers={n} must be at least 1")
    for stage, chunk_counts in enumerate(counts):
        for layers in chunk_counts:
            if model_cfg.recompute_method == "uniform" and layers % n:
                raise ConfigError(f"{where}num_layers={n} does not divide the {layers} layers of "
                                  f"pipeline stage {stage}: uniform recomputes them in groups "
                                  f"of {n}")
            if model_cfg.recompute_method == "block" and n > layers:
                raise ConfigError(f"{where}num_layers={n} exceeds the {layers} layers of "
                                  f"pipeline stage {stage}: block recomputes the first N layers "
                                  "of each stage")


def _check_torch_format(training_cfg, model_cfg, parallel_cfg):
    """--ckpt-format torch and torch_dist write Megatron-core's GPT: a model it has no
    counterpart for is refused, and so is the distributed optimizer with torch (Megatron's
    distrib_optim.pt is not written here; torch_dist holds its state gathered per parameter)."""
    fmt = training_cfg.ckpt_format
    if fmt not in ("torch", "torch_dist"):
        return
    where = f"training_config.ckpt_format={fmt} (Megatron's " + (
        "model_optim_rng.pt)" if fmt == "torch" else ".distcp files)")
    shards = parallel_cfg.data_parallel_size * parallel_cfg.context_parallel_size
    if fmt == "torch" and training_cfg.use_distributed_optimizer and shards > 1:
        raise ConfigError(f"{where} is not written with the distributed optimizer here: use "
                          "--ckpt-format torch_dist, ckpt or safetensors")
    biases = model_cfg.add_bias_linear
    differences = [f"model_config.{k}={v}" for k, v, bad in (
        ("use_sandwich_norm", model_cfg.use_sandwich_norm, model_cfg.use_sandwich_norm),
        ("out_proj_has_bias", model_cfg.out_proj_has_bias, model_cfg.out_proj_has_bias != biases),
        ("qkv_has_bias", model_cfg.qkv_has_bias, biases and not model_cfg.qkv_has_bias),
        ("hidden_act", model_cfg.hidden_act,
         model_cfg.hidden_act == "gelu_tanh" and not biases)) if bad]
    if differences:
        raise ConfigError(f"{where}: Megatron-core's GPT has no counterpart for "
                          f"{', '.join(differences)} (add_bias_linear={biases}): "
                          "use --ckpt-format ckpt")


def fc1_chunks(model_cfg):
    """The blocks of an MLP's fc1 output (dense, expert or shared expert): SwiGLU's [gate; up]
    are two, each split over TP on its own (Megatron's apply_swiglu_sharded_factory); else one."""
    return 2 if model_cfg.hidden_act == "swiglu" else 1


def moe_layer_pattern(model_cfg):
    """Megatron's moe_layer_freq (gpt_layer_specs.py:643-671) as one 0/1 per layer (global,
    0-based): N selects the layers i with i % N == 0, a list is the pattern itself; no experts,
    all 0."""
    layers, freq = model_cfg.num_layers, model_cfg.moe_layer_freq
    if model_cfg.num_moe_experts is None:
        return [0] * layers
    if isinstance(freq, int):
        return [int(i % freq == 0) for i in range(layers)]
    return list(freq)


def _finalize_moe(model_cfg, parallel_cfg):
    """Megatron's rules for MoE (arguments.py, transformer_config.py, moe_layer.py), and this
    project's: the layers in one process or over TP (+ SP) and DP; experts not split over EP."""
    m, where = model_cfg, "model_config."
    if m.num_moe_experts == 0:                     # arguments.py:1648: 0 means no MoE
        m.num_moe_experts = None
    if m.moe_expert_capacity_factor is not None and m.moe_expert_capacity_factor < 0:
        m.moe_expert_capacity_factor = None        # transformer_config.py:1836: dropless
    if m.num_moe_experts is None:
        if parallel_cfg.expert_model_parallel_size != 1:            # arguments.py:1098-1099
            raise ConfigError(f"parallel_config.expert_model_parallel_size="
                              f"{parallel_cfg.expert_model_parallel_size} needs experts: give "
                              "--num-experts (model_config.num_moe_experts)")
        return
    _positive(parallel_cfg, "parallel_config", ["expert_model_parallel_size"])
    _positive(m, "model_config", ["num_moe_experts", "moe_ffn_hidden_size",
                                  "moe_shared_expert_intermediate_size", "moe_router_topk"])
    freq = m.moe_layer_freq
    if isinstance(freq, int) and freq < 1 or isinstance(freq, list) and (
            len(freq) != m.num_layers or set(freq) - {0, 1}):
        raise ConfigError(f"{where}moe_layer_freq={freq}: give N >= 1 (every N-th layer) or a "
                          f"list of {m.num_layers} zeros and ones, one per layer")
    if m.moe_ffn_hidden_size is None:              # transformer_config.py:1685-1687
        m.moe_ffn_hidden_size = m.ffn_hidden_size
    if m.moe_router_topk > m.num_moe_experts:
        raise ConfigError(f"{where}moe_router_topk={m.moe_router_topk} exceeds num_moe_experts="
                          f"{m.num_moe_experts}")
    p = parallel_cfg
    check_moe_rules(m, p.tensor_model_parallel_size, p.sequence_parallel,
                    p.expert_model_parallel_size)
    check_expert_parallel_size(p.expert_model_parallel_size,
                               p.data_parallel_size * p.context_parallel_size)
    if m.recompute_granularity == "full":          # Megatron: --recompute-modules moe
        raise ConfigError("model_config.num_moe_experts with recompute_granularity=full: a "
                          "recomputed router would record its aux and z losses twice; use "
                          "selective or none")


def check_moe_rules(model_cfg, tp, sequence_parallel, ep):
    """Megatron's rules for an MoE model that moe.MoELayer computes (transformer_config.py,
    moe_layer.py, arguments.py), in one process or over TP (+ SP) and EP, checked when the
    config is finalized."""
    m, where = model_cfg, "model_config.num_moe_experts"
    if (m.moe_router_topk == 1 and m.moe_router_score_function == "softmax"
            and not m.moe_router_pre_softmax):     # transformer_config.py:2662-2669
        raise ConfigError("model_config.moe_router_topk=1 with softmax needs "
                          "--moe-router-pre-softmax (a softmax over one expert is 1: the router "
                          "would get no gradient)")
    if (m.moe_router_enable_expert_bias                     # transformer_config.py:2617-2625
            and m.moe_router_score_function != "sigmoid"):
        raise ConfigError("model_config.moe_router_enable_expert_bias needs "
                          "--moe-router-score-function sigmoid (Megatron adds the expert bias to "
                          "sigmoid scores, never to a softmax)")
    if m.moe_pad_expert_input_to_capacity and m.moe_expert_capacity_factor is None:
        raise ConfigError("model_config.moe_pad_expert_input_to_capacity needs "
                          "moe_expert_capacity_factor (--moe-expert-capacity-factor)")
    if m.moe_shared_expert_intermediate_size and m.add_bias_linear:
        raise ConfigError("model_config.moe_shared_expert_intermediate_size: a shared expert has "
                          "no bias (Megatron shared_experts.py:124): add --disable-bias-linear")
    if tp > 1 and not sequence_parallel:                    # moe_layer.py:637-640
        raise ConfigError(f"{where} with tensor_model_parallel_size={tp} needs "
                          "--sequence-parallel, as Megatron's MoELayer")
    if tp > 1 and m.add_bias_linear:                        # transformer_config.py:2612-2615
        raise ConfigError(f"{where} with tensor_model_parallel_size={tp}: experts split over TP "
                          "have no bias; add --disable-bias-linear")
    for k in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        if (getattr(m, k) or 0) % tp:
            raise ConfigError(f"model_config.{k}={getattr(m, k)} is not divisible by "
                              f"tensor_model_parallel_size={tp}")
    if m.num_moe_experts % ep:                              # arguments.py:1100-1102
        raise ConfigError(f"{where}={m.num_moe_experts} is not divisible by "
                          f"expert_model_parallel_size={ep}")


def _finalize_training(training_cfg):
    """Resuming, evaluation, profiling window and clipping."""
    if training_cfg.resume_training and not training_cfg.load_checkpoint:
        raise ConfigError("training_config.resume_training=true needs the checkpoint to resume: "
                          "give --load DIR (training_config.load_checkpoint)")
    if training_cfg.resume_training is False and training_cfg.load_checkpoint:
        raise ConfigError("training_config.resume_training=false: MindSpeed then does not read "
                          f"load_checkpoint={training_cfg.load_checkpoint}; remove one of them "
                          "(--finetune loads the weights alone)")
    if training_cfg.max_restarts < 0:
        raise ConfigError(f"training_config.max_restarts {training_cfg.max_restarts} "
                          "(--max-restarts): give 0 (none) or more")
    if training_cfg.max_restarts and training_cfg.finetune:
        raise ConfigError("--max-restarts with --finetune: a restart would load the last "
                          "checkpoint as a new run's weights, at iteration 0 again; finetune "
                          "first, then resume with --load and --max-restarts")
    for k in ("seed", "training_iters", "log_interval", "eval_interval"):
        if getattr(training_cfg, k) is None:
            raise ConfigError(f"training_config.{k} is null: give a number (the run needs one)")
    if training_cfg.exit_interval is not None and training_cfg.exit_interval <= 0:
        raise ConfigError("training_config.exit_interval must be positive, "
                          f"got {training_cfg.exit_interval}")
    minutes = training_cfg.exit_duration_in_mins
    if minutes is not None and not minutes > 0:
        raise ConfigError(f"training_config.exit_duration_in_mins must be positive, got {minutes}")
    if training_cfg.eval_iters < 0:
        raise ConfigError("training_config.eval_iters must be >= 0")
    _check_profile(training_cfg)
    clip = training_cfg.grad_clip_kwargs
    if clip.clip_value is not None and clip.clip_value < 0:
        raise ConfigError("training_config.grad_clip_kwargs.clip_value must be >= 0 "
                          "(0 disables clipping)")


def main_grad_dtype(cfg):
    """The dtype in which a step's gradients are summed over micro-batches and reduced over DP
    (Megatron's main_grad): float32 with accumulate_allreduce_grads_in_fp32 (forced by bfloat16),
    else the parameters' dtype (so float32 for float32 parameters)."""
    model_cfg, training_cfg = cfg.model_config, cfg.training_config
    return "float32" if training_cfg.accumulate_allreduce_grads_in_fp32 else model_cfg.params_dtype


def padded_vocab_size(model_cfg, tokenizer_vocab_size):
    """The model's vocabulary rows: model_config.vocab_size if given, else the tokenizer's size
    rounded up to make_vocab_size_divisible_by (GPT-2's 50,257 -> 50,304). A property of the model,
    the same in every layout, so a checkpoint converts between layouts and every layout computes the
    same losses; Megatron rounds up to divisible_by x TP instead, so its padding changes with TP.
    _finalize_parallel has checked that TP divides the result."""
    if model_cfg.vocab_size is None:
        multiple = model_cfg.make_vocab_size_divisible_by
        return -(-tokenizer_vocab_size // multiple) * multiple
    if model_cfg.vocab_size < tokenizer_vocab_size:
        raise ConfigError(f"model_config.vocab_size={model_cfg.vocab_size} is smaller than the "
                          f"tokenizer's {tokenizer_vocab_size}: raise it or leave it null")
    return model_cfg.vocab_size


def to_dict(ns):
    """The namespace back to plain dicts (for checkpoint metadata)."""
    return {k: to_dict(v) if isinstance(v, SimpleNamespace) else v for k, v in vars(ns).items()}


if __name__ == "__main__":          # imported by train.py, not a script
    raise SystemExit("error: config.py is a library: run `bash run.sh` (bash run.sh --help "
                     "lists the commands)")
