"""The key table: every setting of a run, one row each.

A row names the canonical key (the MindSpore Transformers sections: training_config,
parallel_config, model_config, dataset_config, optimizer_config), its default, type and allowed
values, its Megatron-LM flags, a one-line meaning, and every other spelling the guides use
(MindSpeed-Core-MS's mapping-table paths and its PanGu files' sections, MindFormers' keys and
sections, MindSpore Transformers' scheduler keys). Three kinds of row:

- `key`:   honoured; the run does what it says.
- `fixed`: accepted at the one value that is this project's only behaviour (transformer_impl
           local, moe_permute_fusion false, ...); any other value is refused with the row's reason.
- `inert`: a graph-mode, Ascend-only or launcher setting that means nothing in PyNative here
           (context.mode, parallel.parallel_mode, ...): accepted with one warning saying why.

Everything that reads keys reads this table: cli.py (flags, dotted overrides, the YAML files,
--help), config.py (SCHEMA: defaults, types, values) and the guides' files in configs/guides/.
A default is the guide's stated default; config.yaml holds the demo run's values.
"""
from typing import NamedTuple


class Key(NamedTuple):
    path: str                 # section.key (or section.sub.key)
    default: object
    type: object              # a type, or a tuple of types the key takes
    flags: tuple              # Megatron flags that take a value (a list key: one per element)
    help: str
    kind: str = "key"         # key, fixed or inert
    choices: tuple = None     # allowed values (a fixed key: its one value)
    switches: dict = None     # Megatron switches: flag -> the value it sets
    aliases: dict = None      # the guides' other paths -> None, or a function translating the value
    values: dict = None       # other spellings of values -> this project's (e.g. adam -> AdamW)


def _flags(flag):
    return () if flag is None else (flag,) if isinstance(flag, str) else tuple(flag)


def key(path, default, typ, flag, help, choices=None, switch=None, aliases=None, values=None):
    """An honoured key."""
    return Key(path, default, typ, _flags(flag), help, "key", choices, switch, aliases, values)


def fixed(path, value, why, flag=None, switch=None, aliases=None, values=None):
    """A key accepted only at `value`, what this project always does; `why` says why no other."""
    return Key(path, value, type(value), _flags(flag), why, "fixed", (value,), switch, aliases,
               values)


def inert(path, why, flag=None, switch=None, aliases=None):
    """A key that has no effect in PyNative on this machine: accepted with one warning, `why`."""
    return Key(path, None, object, _flags(flag), why, "inert", None, switch, aliases)


def _not(value):
    return not value


def _is_float32(value):
    return str(value) in ("float32", "fp32")


def _cosine(use_cosine):
    return "cosine" if use_cosine else "linear"


def _gqa(attention_type):
    return str(attention_type).upper() == "GQA"


# The learning-rate decay and weight-decay increment styles, written once: the choices of their
# keys below and what optimizer.OptimizerParamScheduler accepts.
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
LR_WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")
# Megatron-FSDP's sharding strategies (--data-parallel-sharding-strategy), ZeRO's stages 0-3.
FSDP_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
_LR = "optimizer_config.learning_rate_scheduler_kwargs."
_ACC = "accelerate_config.parallelization."
_PRECISION = "accelerate_config.precision."
_LLM = "model_config.llm."
_MS_TRAIN = "train_config.ms_training_config."
_GRAPH = "a graph-mode setting: this project runs PyNative (ms.jit compiles the model's step)"
_DEVICE_PROFILER = "collected by the Ascend/GPU profiler only (on CPU: one warning, op times only)"
_FUSIONS = "this project builds unfused operators only"
_FUSED_OPS = ("each fused form has its own key here (apply_rope_fusion, apply_swiglu_fusion, "
              "use_fused_rmsnorm, masked_softmax_fusion, ...; docs/performance.md#fusions)")
_FUSED_FA = ("a setting of Ascend's fused FlashAttentionScore kernel, not used on CPU "
             "(--use-flash-attn runs gpt.FlashAttention, written out)")

TRAINING = [
    key("training_config.seed", 1234, int, "--seed",
        "the random seed: initial weights, data order, dropout"),
    key("training_config.device_target", "CPU", str, None, "where the model runs",
        choices=("CPU", "GPU", "Ascend"), aliases={"context.device_target": None}),
    key("training_config.output_dir", "./output", str, "--save",
        "checkpoints, logs (output_dir/log/rank_N), metrics.jsonl, loss.svg"),
    key("training_config.training_iters", 200, int, "--train-iters", "optimizer steps to train"),
    key("training_config.train_samples", None, int, "--train-samples",
        "sample-based training: samples to train on (training_iters follows, Megatron's "
        "update_train_iters; schedules in samples)"),
    key("training_config.log_interval", 10, int, "--log-interval",
        "steps between train lines (the loss is their mean)"),
    key("training_config.tensorboard_dir", None, str, "--tensorboard-dir",
        "TensorBoard event files of the logged scalars here; null = none"),
    key("training_config.eval_interval", 100, int, "--eval-interval",
        "steps between validation losses"),
    key("training_config.eval_iters", 10, int, "--eval-iters", "batches per evaluation"),
    key("training_config.save_interval", None, int, "--save-interval",
        "steps between checkpoints; null or 0 = only at the end"),
    key("training_config.save_initial_checkpoint", False, bool, None,
        "write iteration 0 (the initial weights: a seed checkpoint) before the first step of "
        "a run that does not --load",
        switch={"--save-initial-checkpoint": True}),
    key("training_config.keep_checkpoint_max", 5, int, "--keep-checkpoint-max",
        "iter_* folders kept (the oldest are deleted)"),
    key("training_config.ckpt_format", "ckpt", str, "--ckpt-format",
        "ckpt, safetensors, torch (Megatron-LM's model_optim_rng.pt per rank) or torch_dist "
        "(Megatron-LM's default: one layout-free .metadata index and .distcp files)",
        choices=("ckpt", "safetensors", "torch", "torch_dist")),
    key("training_config.load_checkpoint", "", str, "--load",
        "a checkpoint folder to resume (or, with finetune, to start) from"),
    key("training_config.ckpt_step", None, int, "--ckpt-step",
        "the iteration of --load to start from; null: the latest (its tracker file)"),
    key("training_config.resume_training", None, bool, None,
        "null: --load resumes (Megatron); true: needs --load; false: --load is refused",
        aliases={_MS_TRAIN + "resume_training": None}),
    key("training_config.no_load_optim", False, bool, None,
        "resuming: fresh optimizer state", switch={"--no-load-optim": True}),
    key("training_config.no_load_rng", True, bool, None,
        "resuming: fresh random streams", switch={"--no-load-rng": True}),
    key("training_config.max_restarts", 0, int, "--max-restarts",
        "run.sh launches a failed job again from the last checkpoint in output_dir, up to this "
        "many times (torchrun's --max-restarts)"),
    key("training_config.finetune", False, bool, None,
        "--load takes the weights only: step 0, fresh optimizer", switch={"--finetune": True}),
    key("training_config.exit_interval", None, int, "--exit-interval",
        "save and stop when the step is a multiple of N"),
    key("training_config.exit_duration_in_mins", None, float, "--exit-duration-in-mins",
        "save and stop after this much wall time"),
    key("training_config.exit_signal_handler", False, bool, None,
        "save and stop on SIGTERM (a job's time limit)", switch={"--exit-signal-handler": True}),
    key("training_config.fp16", False, bool, None,
        "float16 parameters and compute, float32 main params in the optimizer",
        switch={"--fp16": True}),
    key("training_config.bf16", False, bool, None,
        "bfloat16 parameters and compute (no bfloat16 matmul on this CPU)",
        switch={"--bf16": True}),
    key("training_config.accumulate_allreduce_grads_in_fp32", False, bool, None,
        "sum and reduce half-precision gradients in float32 (forced by bf16)",
        switch={"--accumulate-allreduce-grads-in-fp32": True},
        aliases={_PRECISION + "grad_accumulation_dtype": _is_float32}),
    key("training_config.loss_scale", None, float, "--loss-scale",
        "a static loss scale; null = dynamic under float16"),
    key("training_config.loss_scale_value", 2.0 ** 32, float, "--initial-loss-scale",
        "the dynamic loss scale's first value"),
    key("training_config.min_loss_scale", 1.0, float, "--min-loss-scale",
        "the dynamic loss scale's floor"),
    key("training_config.loss_scale_window", 1000, int, "--loss-scale-window",
        "steps without overflow before the scale doubles"),
    key("training_config.hysteresis", 2, int, "--hysteresis",
        "overflows tolerated before the scale halves"),
    fixed("training_config.loss_scale_factor", 2,
          "the dynamic loss scale grows and backs off by a factor of 2, as Megatron's"),
    key("training_config.grad_clip_kwargs.grad_clip_type", "ClipGlobalNorm", str, None,
        "clip by the global norm, or each value", choices=("ClipGlobalNorm", "GradClipByValue")),
    key("training_config.grad_clip_kwargs.clip_value", 0.0, float, "--clip-grad",
        "the clipping threshold; 0 disables clipping",
        aliases={"optimizer_config.clip_grad": None}),
    fixed("training_config.loss_reduction", "mean",
          "the loss is the mean over the tokens of the global batch, as Megatron's"),
    fixed("training_config.loss_func_kwargs.loss_func_type", "VocabParallelCrossEntropy",
          "the loss is the vocabulary-parallel cross-entropy (equal to CrossEntropyLoss at TP 1)",
          values={"CrossEntropyLoss": "VocabParallelCrossEntropy"}),
    key("training_config.use_distributed_optimizer", False, bool, None,
        "ZeRO-1: optimizer state and main params sharded over DP",
        switch={"--use-distributed-optimizer": True},
        aliases={_ACC + "use_distributed_optimizer": None, "parallel.enable_parallel_optimizer":
                 None, "parallel_config.optimizer_shard": None}),
    key("training_config.use_megatron_fsdp", False, bool, None,
        "Megatron-FSDP: data parallelism sharding what data_parallel_sharding_strategy names",
        switch={"--use-megatron-fsdp": True}),
    key("training_config.data_parallel_sharding_strategy", None, str,
        "--data-parallel-sharding-strategy",
        "with use_megatron_fsdp, what is sharded over DP: optimizer state (optim, ZeRO-1), and "
        "gradients (optim_grads, ZeRO-2), and parameters (optim_grads_params, ZeRO-3, the "
        "default); no_shard: none", choices=FSDP_STRATEGIES,
        aliases={"parallel.parallel_optimizer_config.optimizer_level": None},
        values={"level1": "optim", "level2": "optim_grads", "level3": "optim_grads_params"}),
    fixed("training_config.optimizer_weight_shard_size", -1,
          "the distributed optimizer and FSDP shard over every DP x CP rank (-1); a smaller "
          "group (MindSpore's, hybrid sharding) is not built",
          aliases={"parallel.parallel_optimizer_config.optimizer_weight_shard_size": None}),
    key("training_config.bucket_size", None, int, ("--ddp-bucket-size", "--bucket-size"),
        "gradient buffer bucket in elements; null = one bucket",
        aliases={_MS_TRAIN + "bucket_size": None}),
    key("training_config.overlap_grad_reduce", False, bool, None,
        "each bucket's reduction starts during the last micro-batch's backward, once its "
        "gradients are final", switch={"--overlap-grad-reduce": True}),
    key("training_config.delay_grad_reduce", False, bool, None,
        "with overlap_grad_reduce, pipeline stages after the first reduce after the schedule",
        switch={"--delay-grad-reduce": True, "--no-delay-grad-reduce": False}),
    fixed("training_config.crc_check", True,
          "every checkpoint file carries a CRC-32 that loading checks",
          switch={"--resume-crc-check": True}),
    fixed("training_config.new_dataset", False,
          "resuming continues the data where it stopped (consumed samples)"),
    inert("training_config.wrap_with_ddp",
          "data parallelism always reduces gradients by buckets (distributed.BucketLayout)",
          aliases={_MS_TRAIN + "wrap_with_ddp": None}),
    inert("training_config.distributed_backend",
          "msrun's workers talk through MindSpore's own collectives on CPU (HCCL on Ascend)",
          flag="--distributed-backend"),
    inert("training_config.enable_mem_align", "a device-memory setting: nothing to align on CPU"),
    inert("training_config.prefix",
          "checkpoint files are named as Megatron's (model_optim_rng, the layout's shards)",
          flag="--ckpt-prefix"),
    key("training_config.cpu_collectives", "auto", str, "--cpu-collectives",
        "the CPU's all-reduce: MindSpore's (mccl), or through shared memory between the workers "
        "of one x86 machine (shared_memory, several times faster: backends/); auto: "
        "shared_memory where it can run", choices=("auto", "mccl", "shared_memory")),
    key("training_config.threads_num", None, int, None,
        "CPU kernel threads per worker; null = cores / workers"),
    key("training_config.bind_core", True, bool, None,
        "keep each of several workers on one machine to its own share of the CPU's cores "
        "(msrun's --bind_core)", switch={"--no-bind-core": False}),
    key("training_config.use_jit", True, bool, None,
        "compile the model with ms.jit when it has no dropout", switch={"--no-jit": False}),
    key("training_config.log_comm_ledger", False, bool, None,
        "log each step's collectives per group: calls, bytes"),
    key("training_config.pipeline_trace", False, bool, None,
        "time the last step's pipeline passes: timeline and bubble (without a pipeline, "
        "with --overlap-grad-reduce: the pieces and the buckets)"),
    key("training_config.profile", False, bool, None,
        "the MindSpore profiler over profile_step_start..end", switch={"--profile": True}),
    key("training_config.profile_save_path", None, str, None,
        "null = <output_dir>/profile; traces in rank_N/"),
    key("training_config.profile_step_start", 1, int, "--profile-step-start",
        "the first profiled step"),
    key("training_config.profile_step_end", 5, int, "--profile-step-end",
        "profiling stops before this step"),
    key("training_config.profile_ranks", [0], list, "--profile-ranks",
        "the profiled global ranks; null = every rank"),
    key("training_config.profile_level", "level0", str, None, _DEVICE_PROFILER,
        choices=("level0", "level1", "level2")),
    *(key(f"training_config.{name}", default, type(default), None, _DEVICE_PROFILER)
      for name, default in (
          ("profile_with_stack", False), ("profile_memory", False),
          ("profile_framework", False), ("profile_communication", False),
          ("profile_data_process", False), ("profile_parallel_strategy", False),
          ("profile_hbm_ddr", False), ("profile_pcie", False), ("profile_aicore_metrics", 0),
          ("profile_l2_cache", False), ("profile_data_simplification", False),
          ("profile_op_time", False), ("profile_offline_analyse", False))),
    key("training_config.profile_dynamic_profiler_config_path", None, str, None,
        _DEVICE_PROFILER),
]

PARALLEL = [
    key("parallel_config.tensor_model_parallel_size", 1, int, "--tensor-model-parallel-size",
        "TP: each layer's weights split over this many ranks",
        aliases={_ACC + "tensor_parallel": None, "parallel_config.model_parallel": None}),
    key("parallel_config.pipeline_model_parallel_size", 1, int, "--pipeline-model-parallel-size",
        "PP: the layers cut into this many stages",
        aliases={_ACC + "pipeline.num_stages": None, "parallel_config.pipeline_stage": None}),
    key("parallel_config.context_parallel_size", 1, int, "--context-parallel-size",
        "CP: each sequence split over this many ranks"),
    key("parallel_config.context_parallel_algo", "ulysses_cp_algo", str,
        "--context-parallel-algo",
        "ulysses_cp_algo (all-to-all), megatron_cp_algo (ring) or hybrid_cp_algo",
        choices=("ulysses_cp_algo", "megatron_cp_algo", "hybrid_cp_algo")),
    key("model_config.cp_comm_type", None, str, "--cp-comm-type",
        "Megatron's CP communication: p2p (a ring passing key/value blocks), all_gather, a2a "
        "(Ulysses) or a2a+p2p (hybrid); null = context_parallel_algo's (p2p for the ring)",
        choices=("p2p", "all_gather", "a2a", "a2a+p2p")),
    key("parallel_config.ulysses_degree_in_cp", None, int, "--ulysses-degree-in-cp",
        "hybrid_cp_algo: the Ulysses group size within cp"),
    key("parallel_config.expert_model_parallel_size", 1, int, "--expert-model-parallel-size",
        "EP: the MoE experts split over this many ranks, carved out of DP x CP"),
    key("parallel_config.virtual_pipeline_model_parallel_size", None, int,
        "--virtual-pipeline-model-parallel-size", "model chunks per pipeline stage (interleaved)",
        aliases={_ACC + "pipeline.virtual_pipeline_model_parallel_size": None}),
    key("parallel_config.num_layers_per_virtual_pipeline_stage", None, int,
        "--num-layers-per-virtual-pipeline-stage", "layers per model chunk (gives the chunks)",
        aliases={_ACC + "pipeline.num_layers_per_vpp": None}),
    key("parallel_config.num_layer_list", None, list, "--num-layer-list",
        "layers per stage (or per stage and chunk); null = even, the last stage the rest",
        aliases={_ACC + "pipeline.layer_list": None}),
    # Megatron's split flags (TransformerConfig), written as the num_layer_list they give
    # (config.megatron_layer_counts)
    key("parallel_config.decoder_first_pipeline_num_layers", None, int,
        "--decoder-first-pipeline-num-layers",
        "layers on the first stage; the rest even over the middle stages"),
    key("parallel_config.decoder_last_pipeline_num_layers", None, int,
        "--decoder-last-pipeline-num-layers",
        "layers on the last stage; the rest even over the middle stages"),
    key("parallel_config.account_for_embedding_in_pipeline_split", False, bool, None,
        "the embedding counts as a layer in the even split: the first stage one layer fewer",
        switch={"--account-for-embedding-in-pipeline-split": True}),
    key("parallel_config.account_for_loss_in_pipeline_split", False, bool, None,
        "the loss counts as a layer in the even split: the last stage one layer fewer",
        switch={"--account-for-loss-in-pipeline-split": True}),
    key("parallel_config.pipeline_model_parallel_layout", None, str,
        "--pipeline-model-parallel-layout",
        "virtual stages split by |: E embedding, t layer, L loss, e.g. Et|(tt|)*2,tL"),
    fixed("parallel_config.noop_layers", None, "every layer computes (no no-op layers)",
          aliases={_ACC + "pipeline.noop_layers": None}),
    key("parallel_config.sequence_parallel", False, bool, None,
        "SP: the activations between TP regions split over the sequence",
        switch={"--sequence-parallel": True},
        aliases={_ACC + "use_sequence_parallel": None,
                 "parallel_config.use_seq_parallel": None}),
    key("parallel_config.pipeline_schedule", "1f1b", str, None,
        "1f1b, or afab (all forward, all backward: GPipe)", choices=("1f1b", "afab")),
    key("parallel_config.data_parallel_size", None, int, None,
        "null = workers / (tp x cp x pp); if given, checked against it",
        aliases={"parallel_config.data_parallel": None}),
    key("parallel_config.recompute", None, (bool, int, list), None,
        "full recompute: true = every layer, N = the first N of each stage, or a list per stage",
        aliases={"recompute_config.recompute": None}),
    key("parallel_config.select_recompute", None, (bool, list), None,
        "true = selective recompute: the core attention of every layer",
        aliases={"recompute_config.select_recompute": None}),
    fixed("parallel_config.select_comm_recompute", None, "communication is not recomputed",
          aliases={"train_config.recompute_config.select_comm_recompute": None}),
    inert("recompute_config.parallel_optimizer_comm_recompute", "communication is not recomputed"),
    inert("recompute_config.mp_comm_recompute", "communication is not recomputed"),
    inert("recompute_config.recompute_slice_activation",
          "a recomputed layer keeps its input as it receives it, [s/tp, b, h] under SP"),
    inert("parallel_config.vocab_emb_dp",
          "the embedding is always split over the vocabulary by TP (VocabParallelEmbedding)"),
    inert("parallel_config.gradient_aggregation_group",
          "gradients are reduced in buckets of training_config.bucket_size elements"),
    inert("parallel.parallel_mode", _GRAPH + "; the layout is parallel_config's sizes"),
    inert("parallel.full_batch", _GRAPH + "; each DP rank reads its own micro-batches"),
    inert("parallel.gradients_mean", _GRAPH + "; gradients are averaged over DP"),
    inert("context.mode", _GRAPH),
    inert("context.max_device_memory", "an Ascend/GPU memory cap: nothing to cap on CPU"),
    inert("context.device_id", "msrun gives each worker its device"),
]

# Mixture of experts (moe.py): Megatron-core's TransformerConfig fields and their flags, with its
# defaults (megatron/core/transformer/transformer_config.py at d98e8a64, arguments.py)
_MOE = "model_config."
MOE = [
    key(_MOE + "num_moe_experts", None, int, "--num-experts",
        "routed experts of each MoE layer; null = no MoE (a dense MLP in every layer)"),
    key(_MOE + "moe_layer_freq", 1, (int, list), "--moe-layer-freq",
        "MoE layers: N = layer i when i % N == 0, or a 0/1 list, one per layer"),
    key(_MOE + "moe_ffn_hidden_size", None, int, "--moe-ffn-hidden-size",
        "each routed expert's FFN width; null = ffn_hidden_size"),
    key(_MOE + "moe_shared_expert_intermediate_size", None, int,
        "--moe-shared-expert-intermediate-size",
        "the shared expert's FFN width (on every token); null = none"),
    key(_MOE + "moe_shared_expert_gate", False, bool, None,
        "a sigmoid gate on the shared expert's output", switch={"--moe-shared-expert-gate": True}),
    key(_MOE + "moe_router_topk", 2, int, "--moe-router-topk", "experts per token (k)"),
    key(_MOE + "moe_router_load_balancing_type", "aux_loss", str,
        "--moe-router-load-balancing-type",
        "aux_loss (per micro-batch), seq_aux_loss (per sequence) or none",
        choices=("aux_loss", "seq_aux_loss", "none")),
    key(_MOE + "moe_aux_loss_coeff", 0.0, float, "--moe-aux-loss-coeff",
        "the load-balancing loss' coefficient; 0 = none"),
    key(_MOE + "moe_z_loss_coeff", None, float, "--moe-z-loss-coeff",
        "the router z-loss' coefficient (ST-MoE); null = none"),
    key(_MOE + "moe_router_score_function", "softmax", str, "--moe-router-score-function",
        "the router's scores: softmax or sigmoid", choices=("softmax", "sigmoid")),
    key(_MOE + "moe_router_pre_softmax", False, bool, None,
        "softmax over all experts before the top-k (else over the k chosen)",
        switch={"--moe-router-pre-softmax": True}),
    key(_MOE + "moe_router_topk_scaling_factor", None, float,
        "--moe-router-topk-scaling-factor", "the routing probabilities times this; null = 1"),
    key(_MOE + "moe_router_dtype", None, str, "--moe-router-dtype",
        "the router's matmul and probabilities in float32; null = the compute dtype",
        choices=("fp32",)),
    key(_MOE + "moe_grouped_gemm", False, bool, None,
        "the experts as batched matmuls (same weights and names)",
        switch={"--moe-grouped-gemm": True}),
    key(_MOE + "moe_token_dispatcher_type", "allgather", str, "--moe-token-dispatcher-type",
        "allgather or alltoall (fixed capacity slots)", choices=("allgather", "alltoall")),
    key(_MOE + "moe_expert_capacity_factor", None, float, "--moe-expert-capacity-factor",
        "tokens per expert at most ceil(n k / E * factor); null or < 0 = dropless"),
    key(_MOE + "moe_pad_expert_input_to_capacity", False, bool, None,
        "every expert gets exactly its capacity (padding of probability 0)",
        switch={"--moe-pad-expert-input-to-capacity": True}),
    key(_MOE + "moe_token_drop_policy", "probs", str, "--moe-token-drop-policy",
        "over capacity, drop the lowest probabilities or the latest tokens",
        choices=("probs", "position")),
    key(_MOE + "moe_router_enable_expert_bias", False, bool, None,
        "aux-loss-free balancing: a per-expert bias on the sigmoid scores chooses the top-k "
        "(not the weights), moved each step toward even loads",
        switch={"--moe-router-enable-expert-bias": True}),
    key(_MOE + "moe_router_bias_update_rate", 1e-3, float, "--moe-router-bias-update-rate",
        "the expert bias' step: rate * sign(mean tokens - the expert's tokens) per step"),
    # Megatron's MoE options this project does not build (moe.py), each refused in one line
    fixed(_MOE + "moe_input_jitter_eps", None, "the router's input is not jittered",
          flag="--moe-input-jitter-eps"),
    fixed(_MOE + "moe_permute_fusion", False, _FUSIONS + ": tokens are permuted by gathers",
          switch={"--moe-permute-fusion": True}),
    fixed(_MOE + "moe_enable_deepep", False,
          "the dispatchers are allgather and alltoall (DeepEP is a GPU library)",
          switch={"--moe-enable-deepep": True}),
    fixed(_MOE + "moe_shared_expert_overlap", False,
          "the shared expert runs before the dispatch, not overlapped with it",
          switch={"--moe-shared-expert-overlap": True}),
    fixed(_MOE + "overlap_moe_expert_parallel_comm", False,
          "the dispatchers' collectives are not overlapped with computation",
          switch={"--overlap-moe-expert-parallel-comm": True}),
]


MODEL = [
    key("model_config.num_layers", 4, int, "--num-layers", "transformer layers",
        aliases={_LLM + "blocks.num_layers": None}),
    key("model_config.hidden_size", 256, int, "--hidden-size", "the hidden (model) width h",
        aliases={_LLM + "embedding.hidden_size": None}),
    key("model_config.ffn_hidden_size", None, int, "--ffn-hidden-size",
        "the MLP's inner width; null = 4h", aliases={_LLM + "blocks.ffn.hidden_size": None}),
    key("model_config.num_attention_heads", 8, int, "--num-attention-heads", "attention heads",
        aliases={_LLM + "blocks.attention.head_num": None}),
    key("model_config.group_query_attention", False, bool, None,
        "grouped-query attention: num_query_groups key/value heads",
        switch={"--group-query-attention": True},
        aliases={_LLM + "blocks.attention.attention_type": _gqa}),
    key("model_config.num_query_groups", None, int, "--num-query-groups",
        "key/value heads with group_query_attention; null = one per head",
        aliases={_LLM + "blocks.attention.kv_group_size": None}),
    key("model_config.seq_length", 256, int, "--seq-length", "tokens per sample"),
    key("model_config.max_position_embeddings", None, int, "--max-position-embeddings",
        "positions the model holds; null = seq_length",
        aliases={_LLM + "position.max_size": None}),
    key("model_config.vocab_size", None, int, "--padded-vocab-size",
        "the padded vocabulary; null = the tokenizer's, padded",
        aliases={_LLM + "tokenizer.padded_size": None}),
    key("model_config.make_vocab_size_divisible_by", 128, int, "--make-vocab-size-divisible-by",
        "pad the tokenizer's vocabulary to a multiple of this",
        aliases={_LLM + "tokenizer.divided_by": None}),
    inert("model_config.llm.tokenizer.use_fast", "the GPT-2 BPE tokenizer is this project's own"),
    key("model_config.position_embedding_type", "absolute", str, "--position-embedding-type",
        "absolute (learned) or rope", choices=("absolute", "rope"),
        switch={"--use-rotary-position-embeddings": "rope"},
        aliases={_LLM + "position.type": None},
        values={"RoPE": "rope", "learned_absolute": "absolute"}),
    key("model_config.rotary_base", 10000, int, "--rotary-base", "RoPE's base period",
        aliases={_LLM + "position.rope_base": None}),
    key("model_config.normalization", "LayerNorm", str, "--normalization",
        "LayerNorm or RMSNorm", choices=("LayerNorm", "RMSNorm"),
        aliases={_LLM + "blocks.layernorm.norm_type": None}),
    key("model_config.norm_epsilon", 1e-5, float, "--norm-epsilon", "the norms' epsilon",
        aliases={_LLM + "blocks.layernorm.epsilon": None}),
    key("model_config.hidden_act", "gelu", str, "--hidden-act",
        "gelu, gelu_tanh (GPT-2's) or swiglu", choices=("gelu", "gelu_tanh", "swiglu"),
        switch={"--swiglu": "swiglu", "--openai-gelu": "gelu_tanh"},
        aliases={_LLM + "blocks.ffn.activation": None}),
    key("model_config.qkv_has_bias", True, bool, None, "biases on the query/key/value projection",
        switch={"--add-qkv-bias": True, "--disable-bias-linear": False},
        aliases={_LLM + "blocks.attention.qkv_bias": None}),
    key("model_config.out_proj_has_bias", True, bool, None,
        "a bias on the attention's output projection",
        switch={"--add-dense-bias": True, "--disable-bias-linear": False},
        aliases={_LLM + "blocks.attention.projection_bias": None}),
    key("model_config.add_bias_linear", False, bool, None, "biases on the MLP's two linears",
        switch={"--add-bias-linear": True, "--disable-bias-linear": False},
        aliases={_LLM + "blocks.ffn.mlp_bias": None}),
    key("model_config.untie_embeddings_and_output_weights", False, bool, None,
        "an output layer of its own (else the word embedding's transpose)",
        switch={"--untie-embeddings-and-output-weights": True},
        aliases={_LLM + "head.shared_embedding": _not}),
    key("model_config.use_sandwich_norm", False, bool, None,
        "a norm after the attention and after the MLP too", switch={"--use-sandwich-norm": True},
        aliases={_LLM + "blocks.sandwich_norm": None}),
    key("model_config.attn_post_norm_scale", 1.0, float, "--attn-post-norm-scale",
        "sandwich norm: the post-attention norm's initial weight",
        aliases={_LLM + "blocks.attention.post_norm_scale": None}),
    key("model_config.ffn_post_norm_scale", 1.0, float, "--ffn-post-norm-scale",
        "sandwich norm: the post-MLP norm's initial weight",
        aliases={_LLM + "blocks.ffn.post_norm_scale": None}),
    key("model_config.attention_dropout_rate", 0.0, float, "--attention-dropout",
        "dropout on the attention probabilities",
        aliases={_LLM + "blocks.attention.dropout_rate": None}),
    key("model_config.hidden_dropout_rate", 0.0, float, "--hidden-dropout",
        "dropout on the embedding and each block's output",
        aliases={_LLM + "blocks.ffn.dropout_rate": None}),
    key("model_config.init_method_std", 0.01, float, "--init-method-std",
        "the standard deviation of the initial weights",
        aliases={_LLM + "blocks.init_std": None}),
    key("model_config.embedding_init_method_std", None, float, "--embedding-init-method-std",
        "the embeddings' initial standard deviation; null = init_method_std",
        aliases={_LLM + "embedding.init_std": None}),
    key("model_config.attention_softmax_in_fp32", True, bool, None,
        "the attention softmax in float32 under half precision",
        switch={"--attention-softmax-in-fp32": True, "--no-attention-softmax-in-fp32": False},
        aliases={_PRECISION + "softmax_compute_dtype": _is_float32}),
    key("model_config.apply_query_key_layer_scaling", False, bool, None,
        "half precision: scores divided by the layer number, multiplied back in the softmax",
        switch={"--apply-query-key-layer-scaling": True}),
    key("model_config.fp16_lm_cross_entropy", False, bool, None,
        "the loss on float16 logits (with --fp16)", switch={"--fp16-lm-cross-entropy": True},
        aliases={_PRECISION + "logits_compute_dtype": lambda dtype: str(dtype) == "float16"}),
    key("model_config.fp32_residual_connection", False, bool, None,
        "the residual stream in float32 under half precision",
        switch={"--fp32-residual-connection": True},
        aliases={_PRECISION + "residual-connection": _is_float32}),
    key("model_config.params_dtype", None, str, "--params-dtype",
        "the parameters' dtype; null = what --fp16/--bf16 give, else float32",
        choices=("float32", "float16", "bfloat16"),
        aliases={_PRECISION + "param_init_dtype": None}),
    key("model_config.compute_dtype", None, str, "--compute-dtype",
        "the matmuls' dtype; null = what --fp16/--bf16 give, else float32",
        choices=("float32", "float16", "bfloat16"), aliases={_PRECISION + "compute_dtype": None}),
    fixed("model_config.embedding_init_dtype", "float32",
          "weights are drawn in float32, then cast to params_dtype", flag="--embedding-dtype"),
    key("model_config.recompute_granularity", None, str, "--recompute-granularity",
        "full (whole layers) or selective (the core attention)",
        choices=("full", "selective"), switch={"--recompute-activations": "selective"}),
    key("model_config.recompute_method", None, str, "--recompute-method",
        "full: uniform (groups of N) or block (the first N of each stage)",
        choices=("uniform", "block")),
    key("model_config.recompute_num_layers", None, (int, list), "--recompute-num-layers",
        "full: N (block also takes a list per stage)"),
    fixed("model_config.transformer_impl", "local",
          "the layers are this project's own (Megatron's local implementation)",
          flag="--transformer-impl"),
    key("model_config.use_flash_attention", False, bool, None,
        "core attention in key/value blocks with an online softmax and a recomputing backward "
        "(gpt.FlashAttention): no [b, n, s, s] scores kept", switch={"--use-flash-attn": True}),
    inert("model_config.fa_config.pre_tokens", _FUSED_FA, flag="--pre-tockens"),
    inert("model_config.fa_config.next_tokens", _FUSED_FA, flag="--next-tockens"),
    inert("model_config.fa_config.input_layout", _FUSED_FA, flag="--shape-order"),
    # the fused forms (fused.py): off by default, so that what runs is the plain forms the
    # reading order lists (docs/performance.md#fusions: what they gain here); --fusions opts in,
    # as Megatron's transformer_engine spec against its local one, and each form's key below
    # (on, as Megatron's fusions are) then picks that form
    key("model_config.fusions", False, bool, None,
        "the fast forms of fused.py where their keys below ask (gpt.layer_spec); false: every "
        "operator in its plain form, those keys too",
        switch={"--fusions": True, "--no-fusions": False}),
    key("model_config.apply_swiglu_fusion", True, bool, None,
        "SwiGLU with a hand backward reusing its sigmoid (fused.SwiGLU)",
        switch={"--use-fused-swiglu": True, "--no-bias-swiglu-fusion": False}),
    key("model_config.apply_rope_fusion", True, bool, None,
        "RoPE with its backward written out (fused.FusedRotary)",
        switch={"--apply-rope-fusion": True, "--no-rope-fusion": False}),
    key("model_config.use_fused_rmsnorm", True, bool, None,
        "RMSNorm with its mean as a matmul and a hand backward (fused.FusedRMSNorm)",
        switch={"--use-fused-rmsnorm": True}),
    key("model_config.persist_layer_norm", True, bool, None,
        "LayerNorm with its means as matmuls and a hand backward (fused.FusedLayerNorm); false: "
        "the LayerNorm kernel", switch={"--no-persist-layer-norm": False}),
    key("model_config.bias_gelu_fusion", True, bool, None,
        "fc1's bias added inside the GELU, one hand backward (fused.BiasGelu)",
        switch={"--no-bias-gelu-fusion": False}),
    key("model_config.masked_softmax_fusion", True, bool, None,
        "the attention's scale, mask and softmax with row sums as a matmul "
        "(fused.FusedScaleMaskSoftmax)", switch={"--no-masked-softmax-fusion": False}),
    key("model_config.bias_dropout_fusion", True, bool, None,
        "the output linears' biases added with the dropout and residual "
        "(fused.FusedBiasDropoutAdd)", switch={"--no-bias-dropout-fusion": False}),
    key("model_config.cross_entropy_loss_fusion", True, bool, None,
        "the loss from one softmax with a hand backward (fused.FusedCrossEntropy; Megatron's "
        "default is off, measured 2.7x faster here)",
        switch={"--cross-entropy-loss-fusion": True, "--no-cross-entropy-loss-fusion": False}),
    inert("accelerate_config.precision.fused_operators", _FUSED_OPS),
    inert("accelerate_config.precision.nofused_operators", _FUSED_OPS),
    fixed("model_config.encoder_attn_mask_type", "causal",
          "a GPT's attention is causal (a document mask: dataset_config.reset_attention_mask)"),
    *MOE,
]

DATASET = [
    key("dataset_config.data_path", None, (str, list), "--data-path",
        "the .bin/.idx prefix of the tokenized corpus (bash run.sh preprocess), or a blend: "
        "weights and prefixes (0.3 web 0.7 books; the guides' YAML list ['0.3', web, '0.7', "
        "books]); a folder: every corpus in it, weighed by its samples; null = "
        "data/tinyshakespeare_text_document", aliases={"dataset_config.dataset_dir": None}),
    key("dataset_config.split", None, str, "--split",
        "train, validation, test weights of each corpus's documents; null = 949,50,1"),
    key("dataset_config.train_data_path", None, (str, list), "--train-data-path",
        "the training split's corpus or blend, instead of --data-path and --split"),
    key("dataset_config.valid_data_path", None, (str, list), "--valid-data-path",
        "the validation split's corpus or blend (with --train-data-path)"),
    key("dataset_config.test_data_path", None, (str, list), "--test-data-path",
        "the test split's corpus or blend (with --train-data-path)"),
    key("dataset_config.dataloader_type", "single", str, "--dataloader-type",
        "single: samples in order from consumed_samples (MegatronPretrainingSampler); cyclic: "
        "each rank's bucket reshuffled every epoch, torch.randperm seeded by the epoch "
        "(MegatronPretrainingRandomSampler)",
        choices=("single", "cyclic")),
    key("dataset_config.data_sharding", True, bool, None,
        "cyclic: each rank shuffles its own bucket; false = one permutation of the whole set "
        "an epoch, dealt to the ranks in turn (Megatron's data_sharding)",
        switch={"--no-data-sharding": False}),
    key("dataset_config.shuffle", True, bool, None,
        "shuffle the samples (Megatron's GPTDataset); false = in corpus order"),
    key("dataset_config.mock_data", False, bool, None, "random tokens instead of a corpus",
        switch={"--mock-data": True}),
    key("dataset_config.tokenizer_type", "GPT2BPETokenizer", str, "--tokenizer-type",
        "GPT2BPETokenizer, NullTokenizer (ids) or ByteTokenizer",
        choices=("GPT2BPETokenizer", "NullTokenizer", "ByteTokenizer")),
    key("dataset_config.vocab_file", "data/gpt2-vocab.json", str, "--vocab-file",
        "GPT-2's vocab.json"),
    key("dataset_config.merge_file", "data/gpt2-merges.txt", str, "--merge-file",
        "GPT-2's merges.txt"),
    key("dataset_config.vocab_size", None, int, "--vocab-size",
        "NullTokenizer, mock data: ids below it"),
    key("dataset_config.batch_size", 1, int, "--micro-batch-size",
        "sequences per micro-batch", aliases={_ACC + "pipeline.micro_batch_size": None}),
    key("dataset_config.micro_batch_num", None, int, "--micro-batch-num",
        "micro-batches per step; null = global_batch_size / (batch_size x dp), else 1",
        aliases={"parallel_config.micro_batch_num": None}),
    key("dataset_config.global_batch_size", None, int, "--global-batch-size",
        "sequences per step; null = batch_size x micro_batch_num x dp"),
    key("dataset_config.rampup_batch_size", None, list, "--rampup-batch-size",
        "START INCREMENT SAMPLES: the global batch grows from START by INCREMENT over SAMPLES "
        "samples (sample-based training)"),
    key("dataset_config.reset_position_ids", False, bool, None,
        "positions restart after each end-of-document", switch={"--reset-position-ids": True}),
    key("dataset_config.reset_attention_mask", False, bool, None,
        "attention stops at each end-of-document", switch={"--reset-attention-mask": True}),
    key("dataset_config.eod_mask_loss", False, bool, None,
        "no loss on end-of-document tokens", switch={"--eod-mask-loss": True}),
    key("dataset_config.data_cache_path", None, str, "--data-cache-path",
        "where the sample index caches go; null = beside the data"),
    fixed("dataset_config.drop_remainder", True,
          "a step takes whole global batches (the sampler drops the rest)"),
    inert("dataset_config.pad_token_id", "samples are packed, never padded"),
    inert("dataset_config.eos_token_id", "the end-of-document id is the tokenizer's"),
]

OPTIMIZER = [
    key("optimizer_config.optimizer_type", "AdamW", str, "--optimizer", "AdamW, Adam or SGD",
        choices=("AdamW", "Adam", "SGD"),
        values={"adam": "AdamW", "sgd": "SGD", "AdamWeightDecay": "AdamW", "mint.AdamW": "AdamW"}),
    key("optimizer_config.learning_rate", 1e-3, float, "--lr", "the peak learning rate"),
    key("optimizer_config.weight_decay", 0.0, float, "--weight-decay",
        "decoupled weight decay (not on biases and norms)"),
    key("optimizer_config.start_weight_decay", None, float, "--start-weight-decay",
        "linear/cosine weight decay: the first value"),
    key("optimizer_config.end_weight_decay", None, float, "--end-weight-decay",
        "linear/cosine weight decay: the last value"),
    key("optimizer_config.weight_decay_incr_style", "constant", str, "--weight-decay-incr-style",
        "constant, linear or cosine", choices=WD_INCR_STYLES),
    key("optimizer_config.betas", [0.9, 0.95], list, ("--adam-beta1", "--adam-beta2"),
        "Adam's two betas"),
    key("optimizer_config.eps", 1e-8, float, "--adam-eps", "Adam's epsilon"),
    key("optimizer_config.momentum", 0.9, float, "--sgd-momentum", "SGD's momentum"),
    key("optimizer_config.use_checkpoint_opt_param_scheduler", True, bool, None,
        "resuming: the checkpoint's learning-rate schedule",
        switch={"--use-checkpoint-opt_param-scheduler": True,
                "--use-checkpoint-opt-param-scheduler": True}),
    key("optimizer_config.override_opt_param_scheduler", False, bool, None,
        "resuming: this run's learning-rate schedule (wins)",
        switch={"--override-opt_param-scheduler": True, "--override-opt-param-scheduler": True}),
    key("optimizer_config.overlap_param_gather", False, bool, None,
        "the distributed optimizer gathers each bucket's parameters when the next forward "
        "needs them", switch={"--overlap-param-gather": True}),
    key(_LR + "lr_decay_style", "constant", str, "--lr-decay-style",
        "constant, linear, cosine, inverse-square-root or WSD (warmup, stable, decay)",
        choices=LR_DECAY_STYLES,
        aliases={"optimizer_config.lr_decay_style": None, _LR + "use_cosine": _cosine}),
    key(_LR + "lr_warmup_iters", 0, int, "--lr-warmup-iters", "steps of linear warmup",
        aliases={"optimizer_config.lr_warmup_iters": None, _LR + "warmup_steps": None}),
    key(_LR + "lr_warmup_fraction", None, float, "--lr-warmup-fraction",
        "warmup as a fraction of lr_decay_iters, unrounded as Megatron's (instead of "
        "lr_warmup_iters)"),
    key(_LR + "lr_decay_iters", None, int, "--lr-decay-iters",
        "steps over which the learning rate decays; null = training_iters",
        aliases={"optimizer_config.lr_decay_iters": None, _LR + "decay_steps": None}),
    key(_LR + "lr_warmup_samples", 0, int, "--lr-warmup-samples",
        "sample-based training: samples of linear warmup"),
    key(_LR + "lr_decay_samples", None, int, "--lr-decay-samples",
        "sample-based training: samples over which the learning rate decays; null = "
        "train_samples"),
    key(_LR + "lr_wsd_decay_samples", None, int, "--lr-wsd-decay-samples",
        "WSD, sample-based training: the samples of its last decay"),
    key(_LR + "lr_wsd_decay_style", "exponential", str, "--lr-wsd-decay-style",
        "WSD: the shape of its last decay", choices=LR_WSD_DECAY_STYLES),
    key(_LR + "lr_wsd_decay_iters", None, int, "--lr-wsd-decay-iters",
        "WSD: the iterations of its last decay, ending at lr_decay_iters"),
    key(_LR + "lr_warmup_init", 0.0, float, "--lr-warmup-init",
        "the learning rate the warmup starts from"),
    key(_LR + "min_lr", 0.0, float, "--min-lr", "the learning rate's floor",
        aliases={"optimizer_config.min_lr": None, _LR + "end_learning_rate": None}),
]

KEYS = {row.path: row for row in TRAINING + PARALLEL + MODEL + DATASET + OPTIMIZER}
SECTIONS = ("training_config", "parallel_config", "model_config", "dataset_config",
            "optimizer_config")


def _schema():
    """{section: {key: Key}} of the honoured and fixed keys, sub-sections nested."""
    schema = {section: {} for section in SECTIONS}
    for row in KEYS.values():
        if row.kind == "inert":
            continue
        *parents, leaf = row.path.split(".")
        node = schema
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = row
    return schema


def _index():
    """flag -> [(Key, value a switch sets, or VALUE)]; another path -> (Key, value translation)."""
    flags, paths = {}, {}
    for row in KEYS.values():
        for i, flag in enumerate(row.flags):
            element = i if row.type is list and len(row.flags) > 1 else None
            flags.setdefault(flag, []).append((row, VALUE, element))
        for flag, value in (row.switches or {}).items():
            flags.setdefault(flag, []).append((row, value, None))
        for path, translate in (row.aliases or {}).items():
            paths[path] = (row, translate)
    return flags, paths


VALUE = object()                    # a flag that takes a value (not a switch)
SCHEMA = _schema()
FLAGS, ALIASES = _index()
DEVICE_PROFILE_KEYS = tuple(row.path.split(".")[-1] for row in TRAINING
                            if row.help == _DEVICE_PROFILER)


if __name__ == "__main__":          # imported by train.py, not a script
    raise SystemExit("error: keys.py is a library: run `bash run.sh` (bash run.sh --help "
                     "lists the commands)")
