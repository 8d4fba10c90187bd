"""megatron-core's own training of a run of this project: the peer of `bash run.sh parity --peer
PYTHON` (tools/parity.py), which starts it after the project's run and compares the two step by
step.

PYTHON is another interpreter, one with torch and megatron-core (tools/bench_peer.INSTALL): this
file imports nothing of MindSpore's, and torch and megatron only inside the functions that use
them. Run from the project's folder:

    PYTHON -m tools.parity_peer --config RUN/effective_config.yaml --load SEED --steps N \
        --cache DIR

It trains in one process what the project's run trained, from the same start, each piece
megatron-core's own:
- the model: GPTModel with get_gpt_layer_local_spec, its TransformerConfig from the run's
  model_config (GPT-2 style: LayerNorm, GeLU, biases, learned positions, tied; Llama style:
  RMSNorm, SwiGLU, RoPE, GQA, untied), float32, no dropout;
- the weights: the run's seed checkpoint (iteration 0, --save-initial-checkpoint) converted to one
  process in Megatron-LM's torch format, SEED/iter_0000000/mp_rank_00/model_optim_rng.pt, loaded
  by GPTModel.load_state_dict;
- the data: GPTDataset of the run's data_path, split, seed and sequence length through
  BlendedMegatronDatasetBuilder, its samples in MegatronPretrainingSampler's order;
- the step: DistributedDataParallel, get_forward_backward_func with finalize_model_grads,
  get_megatron_optimizer (Adam with decoupled weight decay, or SGD), OptimizerParamScheduler in
  samples as megatron/training/training.py builds it (its get_optimizer_param_scheduler).

It prints one line a step: `step=K loss=L grad_norm=G lr=R`. The gradient norm is megatron-core's
over the main grads, its per-tensor norms summed in float64 (its torch.norm in float32 drifts by
about 6e-4 on large tensors on this CPU).
"""
import os
import sys

from settings.cli import parse_command

FLAGS = {"--config": (None, str, "the project run's effective_config.yaml"),
         "--load": (None, str, "the seed checkpoint in Megatron-LM's torch format, one process"),
         "--steps": (None, int, "optimizer steps to train"),
         "--cache": (None, str, "GPTDataset's index cache (its default is a folder named as the "
                                "corpus' prefix, beside its files)")}


def main(argv):
    """PYTHON -m tools.parity_peer: the run's steps as megatron-core trains them."""
    import yaml
    options = parse_command("parity_peer", argv, FLAGS)[0]
    with open(options["config"]) as f:
        cfg = yaml.safe_load(f)
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from tools.bench_peer import cpu_patches
    torch.set_num_threads(os.cpu_count() or 1)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29511", rank=0, world_size=1)
    cpu_patches()
    float64_grad_norm()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    model, config = build_model(cfg)
    load_seed(model, options["load"])
    model, optimizer, scheduler = wrap(model, config, cfg)
    dataset = train_dataset(cfg, options["cache"])
    train(model, optimizer, scheduler, dataset, cfg, options["steps"])
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


def float64_grad_norm():
    """megatron-core's gradient norm with each tensor's squared norm summed in float64."""
    import torch
    import megatron.core.optimizer.clip_grads as clip_grads

    def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        total = sum(float((t.double() ** 2).sum()) for tensors in tensor_lists for t in tensors)
        return torch.tensor([total ** 0.5], dtype=torch.float32), None
    clip_grads.l2_norm_impl = l2_norm


def transformer_config(model_cfg):
    """megatron-core's TransformerConfig of the run's model_config (one process, float32)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig
    act = model_cfg["hidden_act"]
    activation = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
                  "swiglu": F.silu}[act]
    return TransformerConfig(
        num_layers=model_cfg["num_layers"], hidden_size=model_cfg["hidden_size"],
        num_attention_heads=model_cfg["num_attention_heads"],
        num_query_groups=model_cfg["num_query_groups"],
        ffn_hidden_size=model_cfg["ffn_hidden_size"], params_dtype=torch.float32,
        pipeline_dtype=torch.float32, normalization=model_cfg["normalization"],
        layernorm_epsilon=model_cfg["norm_epsilon"], add_bias_linear=model_cfg["add_bias_linear"],
        activation_func=activation, gated_linear_unit=act == "swiglu", hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=model_cfg["init_method_std"],
        use_cpu_initialization=True, perform_initialization=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, bias_activation_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        attention_softmax_in_fp32=True, variable_seq_lengths=False)


def build_model(cfg):
    """(GPTModel of the run's model_config, its TransformerConfig)."""
    import megatron.core.transformer.transformer_block as transformer_block
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    model_cfg = cfg["model_config"]
    config = transformer_config(model_cfg)
    spec = get_gpt_layer_local_spec(normalization=model_cfg["normalization"])
    transformer_block.LayerNormImpl = WrappedTorchNorm     # one process: no sequence parallel
    rope = model_cfg["position_embedding_type"] == "rope"
    model = GPTModel(config=config, transformer_layer_spec=spec,
                     vocab_size=model_cfg["padded_vocab_size"],
                     max_sequence_length=model_cfg["max_position_embeddings"],
                     parallel_output=True,
                     share_embeddings_and_output_weights=not model_cfg[
                         "untie_embeddings_and_output_weights"],
                     position_embedding_type="rope" if rope else "learned_absolute",
                     rotary_base=model_cfg["rotary_base"])
    return model, config


def load_seed(model, folder):
    """The seed checkpoint's weights (Megatron-LM's names) into `model`: every parameter from
    the file, nothing left over but extra states."""
    import torch
    path = os.path.join(folder, "iter_0000000", "mp_rank_00", "model_optim_rng.pt")
    state = torch.load(path, map_location="cpu", weights_only=False)["model"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    left = [k for k in missing + unexpected if not k.endswith("_extra_state")]
    if left:
        sys.exit(f"error: parity_peer: {path} does not fit megatron-core's model: {left}")


def schedule_samples(cfg):
    """(warmup, decay, weight-decay increment, WSD decay) in samples, as megatron/training's
    get_optimizer_param_scheduler counts them: from the samples of sample-based training
    (train_samples), else from iterations, and from fractions."""
    training, dataset = cfg["training_config"], cfg["dataset_config"]
    lr = cfg["optimizer_config"]["learning_rate_scheduler_kwargs"]
    if training["train_samples"] is not None:
        total = training["train_samples"]
        decay, warmup = lr["lr_decay_samples"] or total, lr["lr_warmup_samples"]
        wsd = lr["lr_wsd_decay_samples"] or 0
    else:
        gbs = dataset["global_batch_size"]
        decay = (lr["lr_decay_iters"] or training["training_iters"]) * gbs
        warmup, wsd = lr["lr_warmup_iters"] * gbs, (lr["lr_wsd_decay_iters"] or 0) * gbs
        total = training["training_iters"] * gbs
    if lr["lr_warmup_fraction"] is not None:
        warmup = lr["lr_warmup_fraction"] * decay
    return warmup, decay, total, wsd


def wrap(model, config, cfg):
    """(the model in DistributedDataParallel, megatron-core's optimizer of it, its
    OptimizerParamScheduler), from the run's optimizer_config."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    opt, training = cfg["optimizer_config"], cfg["training_config"]
    lr = opt["learning_rate_scheduler_kwargs"]
    model = DistributedDataParallel(config=config, module=model, ddp_config=(
        DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=False)))
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="sgd" if opt["optimizer_type"] == "SGD" else "adam", lr=opt["learning_rate"],
        min_lr=lr["min_lr"], weight_decay=opt["weight_decay"], adam_beta1=opt["betas"][0],
        adam_beta2=opt["betas"][1], adam_eps=opt["eps"], sgd_momentum=opt["momentum"],
        clip_grad=training["grad_clip_kwargs"]["clip_value"], params_dtype=torch.float32),
        [model])
    warmup, decay, wd_incr, wsd = schedule_samples(cfg)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=lr["lr_warmup_init"], max_lr=opt["learning_rate"],
        min_lr=lr["min_lr"], lr_warmup_steps=warmup, lr_decay_steps=decay,
        lr_decay_style=lr["lr_decay_style"], start_wd=opt["start_weight_decay"],
        end_wd=opt["end_weight_decay"], wd_incr_steps=wd_incr,
        wd_incr_style=opt["weight_decay_incr_style"], wsd_decay_steps=wsd,
        lr_wsd_decay_style=lr["lr_wsd_decay_style"])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return model, optimizer, scheduler


class Tokenizer:
    """What GPTDataset asks of a tokenizer: its end-of-document id, vocabulary size and the
    identifiers its cache names."""

    def __init__(self, name, eod, vocab_size):
        self.eod, self.vocab_size = eod, vocab_size
        self.unique_identifiers = {"class": name, "eod": eod, "vocab_size": vocab_size}


def train_dataset(cfg, cache):
    """megatron-core's GPTDataset of the run's training split, sized as Megatron sizes it
    (train_iters x global batch samples)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from tokenizer import build_tokenizer
    dataset, training = cfg["dataset_config"], cfg["training_config"]
    paths = dataset["data_path"]
    tok = build_tokenizer(dataset["tokenizer_type"], dataset["vocab_file"],
                          dataset["merge_file"], dataset["vocab_size"])
    config = GPTDatasetConfig(
        random_seed=training["seed"], sequence_length=cfg["model_config"]["seq_length"],
        blend=(paths if isinstance(paths, list) else [paths], None), split=dataset["split"],
        tokenizer=Tokenizer(dataset["tokenizer_type"], tok.eod, tok.vocab_size),
        reset_position_ids=dataset["reset_position_ids"],
        reset_attention_mask=dataset["reset_attention_mask"],
        eod_mask_loss=dataset["eod_mask_loss"], create_attention_mask=False,
        path_to_cache=cache)
    samples = training["train_samples"] or training["training_iters"] * dataset[
        "global_batch_size"]
    return BlendedMegatronDatasetBuilder(GPTDataset, [samples, 0, 0], lambda: True,
                                         config).build()[0]


def train(model, optimizer, scheduler, dataset, cfg, steps):
    """`steps` steps as megatron training runs them, the batch-size ramp-up's number of
    micro-batches from megatron-core's own calculator; one line printed a step."""
    import torch
    from megatron.core import num_microbatches_calculator as calculator
    from megatron.core.pipeline_parallel import get_forward_backward_func
    dataset_cfg = cfg["dataset_config"]
    micro, seq = dataset_cfg["batch_size"], cfg["model_config"]["seq_length"]
    calculator.init_num_microbatches_calculator(0, dataset_cfg["rampup_batch_size"],
                                                dataset_cfg["global_batch_size"], micro, 1)
    forward_backward = get_forward_backward_func()

    def forward_step(data, model):
        batch = next(data)
        losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return losses, lambda out: loss_func(out, batch["loss_mask"])

    def loss_func(token_losses, mask):
        loss = (token_losses.float() * mask).sum()
        count = mask.sum().to(torch.int)
        return loss, count, {"lm loss": torch.stack([loss.detach(), count.float()])}

    consumed = 0
    for step in range(steps):
        calculator.update_num_microbatches(consumed, consistency_check=True)
        gbs = calculator.get_current_global_batch_size()
        batches = [collate([dataset[consumed + m * micro + i] for i in range(micro)])
                   for m in range(gbs // micro)]
        consumed += gbs
        model.zero_grad_buffer()
        optimizer.zero_grad()
        lr = optimizer.param_groups[0]["lr"]
        reduced = forward_backward(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=len(batches), seq_length=seq, micro_batch_size=micro,
            decoder_seq_length=seq, forward_only=False)
        done, grad_norm, _ = optimizer.step()
        if done:
            scheduler.step(increment=gbs)
        total = torch.stack([r["lm loss"] for r in reduced]).double().sum(0)
        print(f"step={step + 1} loss={float(total[0] / total[1]):.9g} "
              f"grad_norm={float(grad_norm):.9g} lr={lr:.9g} batch_size={gbs}", flush=True)


def collate(samples):
    """GPTDataset's samples stacked: {key: [micro-batch, ...]} as torch's default collate."""
    import torch
    return {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in samples[0]
            if k in ("tokens", "labels", "loss_mask", "position_ids")}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
