"""Megatron-LM torch_dist checkpoints saved by megatron-core itself, for the tests of
dist_checkpoint.py.

Run by hand in a scratch venv outside the project (torch and megatron-core are never
dependencies of it; the suite only reads what this wrote):

    python3 -m venv /tmp/mcore && /tmp/mcore/bin/pip install torch==2.13.0 \
        megatron-core==0.16.1 numpy
    /tmp/mcore/bin/python data/megatron/make_dist_fixtures.py          # writes data/megatron/dist_*
    /tmp/mcore/bin/python data/megatron/make_dist_fixtures.py --check DIR --tp 1
        # loads the torch_dist checkpoint DIR (e.g. this project's --ckpt-format torch_dist
        # output) with megatron-core's dist_checkpointing.load into its own GPTModel of `--tp`
        # ranks and prints its logits after the prompt

Each fixture is a tiny megatron-core GPTModel (the local layer spec, gpt_layer_specs.py) built on
the CPU with gloo, TP1 or TP2 ranks in processes of torch.multiprocessing, its weights random
(seeded), saved as megatron/training/checkpointing.py's save_checkpoint saves with the default
--ckpt-format torch_dist: `latest_checkpointed_iteration.txt` and `iter_000000N/` written by
megatron.core.dist_checkpointing.save from {args, checkpoint_version, iteration, model:
GPTModel.sharded_state_dict(), num_floating_point_operations_so_far}: `.metadata`,
`__<rank>_<k>.distcp`, `common.pt`, `metadata.json`. `dist_tp1_moe` has four experts (SequentialMLP,
top-2, the allgather dispatcher) in each layer. `dist_dp2_optim_full` and `dist_dp2_optim_dp`
hold the `dist_tp1_gpt2` model after two Adam steps as DP2 with the distributed optimizer, its
state in the fully_reshardable and the dp_reshardable form, `dist_tp2_dp2_optim_dp` and
`dist_pp2_dp2_optim_dp` the same model as TP2 x DP2 and as PP2 x DP2 (gradients of a random
linear loss of each stage's parameters: no pipeline schedule here) in the dp_reshardable form
(OPTIM_FORMS), their `expected.json` the moments' sums per parameter. Each other fixture's
`expected.json` holds a prompt, the logits after it and the greedy continuation computed by
megatron-core's own forward (float32, on the weights as stored; the seed is the first whose
greedy path keeps the top-1/top-2 gap at least MIN_MARGIN).

megatron-core runs on the CPU once a few CUDA-only corners are replaced (`cpu_corners`), nothing
of the arithmetic: torch.cuda.current_device (RoPE moves its frequencies there, the global
memory buffer allocates there), torch.cuda.synchronize (the checkpoint writer), the default
causal mask's device (transformer/utils.py), the RNG tracker's fork (tensor_parallel/random.py;
dropout is 0 here) and, for experts, the router's transformer_engine gemm (moe/moe_utils.py).
"""
import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT = [3, 141, 59, 26, 200, 97]
NEW_TOKENS = 8
MIN_MARGIN = 0.05
VOCAB = 250                          # --vocab-size of Megatron's NullTokenizer (+1 for its eod)
PADDED = 256                         # padded to make_vocab_size_divisible_by 128 (x TP 2)

SPECS = {
    "dist_tp1_gpt2": dict(tp=1, iteration=10, dtype="float32", num_layers=2, hidden_size=32,
                          num_attention_heads=4, ffn_hidden_size=128, seq_length=16,
                          position_embedding_type="learned_absolute", normalization="LayerNorm",
                          add_bias_linear=True, swiglu=False, num_query_groups=4,
                          untie_embeddings_and_output_weights=False),
    "dist_tp2_llama_bf16": dict(tp=2, iteration=20, dtype="bfloat16", num_layers=2,
                                hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                                seq_length=16, position_embedding_type="rope",
                                normalization="RMSNorm", add_bias_linear=False, swiglu=True,
                                num_query_groups=2, untie_embeddings_and_output_weights=True),
    "dist_tp1_moe": dict(tp=1, iteration=30, dtype="float32", num_layers=2, hidden_size=32,
                         num_attention_heads=4, ffn_hidden_size=64, seq_length=16,
                         position_embedding_type="rope", normalization="RMSNorm",
                         add_bias_linear=False, swiglu=True, num_query_groups=4,
                         untie_embeddings_and_output_weights=True, num_experts=4,
                         moe_router_topk=2, moe_ffn_hidden_size=16)}
# the distributed optimizer's fixtures: the GPT-2 style model trained two Adam steps as DP2
# (two processes a model-parallel rank) and saved in each of Megatron-LM's two forms of its state
# (training/checkpointing.py _build_sharded_state_dict_metadata: dp_reshardable by default,
# fully_reshardable with --dist-ckpt-optim-fully-reshardable): name: (form, TP, PP)
OPTIM_FORMS = {"dist_dp2_optim_full": ("fully_reshardable", 1, 1),
               "dist_dp2_optim_dp": ("dp_reshardable", 1, 1),
               "dist_tp2_dp2_optim_dp": ("dp_reshardable", 2, 1),
               "dist_pp2_dp2_optim_dp": ("dp_reshardable", 1, 2)}
OPTIM_STEPS = 2
MOE_ARGS = dict(moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0,
                moe_router_load_balancing_type="aux_loss", moe_grouped_gemm=False)


def cpu_corners():
    """The four CUDA-only places megatron-core 0.16.1 touches on a CPU forward, pointed at the
    CPU."""
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer import utils as transformer_utils
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *_: None        # the save's writer waits for the device
    transformer_utils.get_default_causal_mask = lambda sq: torch.triu(
        torch.ones(sq, sq), diagonal=1).bool()
    tp_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    from megatron.core.transformer.moe import moe_utils
    moe_utils.te_general_gemm = None        # the router's gemm names it without transformer_engine


def optimizer_corners():
    """The CUDA-only places of megatron-core 0.16.1's DistributedDataParallel and
    DistributedOptimizer, pointed at the CPU: tensors made on device "cuda" (optimizer.py's
    overflow flag), `.cuda()` (the state's all-gather), and `Tensor.type()`, which the optimizer
    asks for "torch.cuda.FloatTensor" (distrib_optimizer.py _build_model_and_main_param_groups)."""
    torch.Tensor.cuda = lambda self, *_, **__: self
    named_type = torch.Tensor.type
    torch.Tensor.type = lambda self, *a, **k: (named_type(self, *a, **k) if a or k else
                                               named_type(self).replace("torch.", "torch.cuda.", 1))
    for name in ("tensor", "zeros", "empty", "ones", "full"):
        def on_cpu(*a, made=getattr(torch, name), **k):
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return made(*a, **k)
        setattr(torch, name, on_cpu)


def megatron_args(spec, tp):
    """Megatron-LM's args (after validate_args) of a fixture, as common.pt stores them."""
    rope = spec["position_embedding_type"] == "rope"
    return argparse.Namespace(
        num_layers=spec["num_layers"], hidden_size=spec["hidden_size"],
        ffn_hidden_size=spec["ffn_hidden_size"], num_attention_heads=spec["num_attention_heads"],
        group_query_attention=spec["num_query_groups"] != spec["num_attention_heads"],
        num_query_groups=spec["num_query_groups"], kv_channels=spec["hidden_size"] // spec[
            "num_attention_heads"], seq_length=spec["seq_length"],
        max_position_embeddings=spec["seq_length"], padded_vocab_size=PADDED,
        make_vocab_size_divisible_by=128 // tp, vocab_size=VOCAB, tokenizer_type="NullTokenizer",
        position_embedding_type=spec["position_embedding_type"],
        use_rotary_position_embeddings=rope, rotary_base=10000, rotary_percent=1.0,
        normalization=spec["normalization"], norm_epsilon=1e-5, swiglu=spec["swiglu"],
        add_bias_linear=spec["add_bias_linear"], add_qkv_bias=spec["add_bias_linear"],
        bias_gelu_fusion=spec["add_bias_linear"],
        untie_embeddings_and_output_weights=spec["untie_embeddings_and_output_weights"],
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.3,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=1,
        fp16=False, bf16=spec["dtype"] == "bfloat16", transformer_impl="local",
        ckpt_format="torch_dist", use_distributed_optimizer=False, iteration=spec["iteration"],
        num_experts=spec.get("num_experts"), moe_router_topk=spec.get("moe_router_topk", 2),
        moe_ffn_hidden_size=spec.get("moe_ffn_hidden_size"),
        **(MOE_ARGS if spec.get("num_experts") else {}))


def build_model(args, dtype=torch.float32):
    """megatron-core's GPTModel of `args` with the local layer spec, gathering its logits."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon, add_bias_linear=args.add_bias_linear,
        gated_linear_unit=args.swiglu, activation_func=F.silu if args.swiglu else F.gelu,
        bias_activation_fusion=args.bias_gelu_fusion, hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, pipeline_dtype=dtype,
        use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, num_moe_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        **({k: getattr(args, k) for k in MOE_ARGS if k != "moe_grouped_gemm"}
           if args.num_experts else {}))
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts,
                                    normalization=args.normalization)
    from megatron.core import parallel_state
    return GPTModel(config, spec, vocab_size=args.padded_vocab_size,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(),
                    max_sequence_length=args.max_position_embeddings,
                    position_embedding_type=args.position_embedding_type,
                    share_embeddings_and_output_weights=not
                    args.untie_embeddings_and_output_weights, parallel_output=False)


def logits(model, ids):
    """[len(ids), padded vocab] float64 logits of megatron-core's forward (causal mask)."""
    tokens = torch.tensor([ids])
    positions = torch.arange(len(ids))[None]
    with torch.no_grad():
        return model(tokens, positions, attention_mask=None)[0].double().numpy()


def greedy(model, vocab):
    """(tokens, smallest top-1/top-2 gap, logits after the prompt) of greedy decoding."""
    ids, margin, first = list(PROMPT), np.inf, None
    for _ in range(NEW_TOKENS):
        row = logits(model, ids)[-1][:vocab]
        first = row if first is None else first
        top = np.sort(row)[-2:]
        margin = min(margin, top[1] - top[0])
        ids.append(int(row.argmax()))
    return ids[len(PROMPT):], float(margin), first


def init(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    cpu_corners()


def make(rank, name, port, out):
    """One rank's part of fixture `name`: the model, its weights rounded to the stored dtype,
    the forward, the save."""
    from megatron.core import dist_checkpointing
    spec = SPECS[name]
    init(rank, spec["tp"], port)
    args = megatron_args(spec, spec["tp"])
    for seed in range(1, 200):
        torch.manual_seed(seed)
        model = build_model(args).eval()
        with torch.no_grad():         # the forward sees exactly the values the file holds
            for p in model.parameters():
                p.copy_(p.to(getattr(torch, spec["dtype"])).float())
        tokens, margin, first = greedy(model, VOCAB + 1)
        if margin >= MIN_MARGIN and len(set(tokens)) >= 4:
            break
    if spec["dtype"] != "float32":
        model = model.to(getattr(torch, spec["dtype"]))
    folder = f"iter_{spec['iteration']:07d}"       # relative: the index records the path
    if rank == 0:
        os.makedirs(os.path.join(out, folder))
    dist.barrier()
    os.chdir(out)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": spec["iteration"],
             "model": model.sharded_state_dict(), "num_floating_point_operations_so_far": 0}
    dist_checkpointing.save(state, folder)
    dist.barrier()
    if rank == 0:
        with open("latest_checkpointed_iteration.txt", "w") as f:
            f.write(str(spec["iteration"]))
        with open("expected.json", "w") as f:
            json.dump({"prompt": PROMPT, "greedy": tokens, "vocab": VOCAB + 1, "seed": seed,
                       "min_margin": margin, "dtype": spec["dtype"],
                       "prompt_logits": [round(float(v), 6) for v in first]}, f, indent=1)
        print(name, "seed", seed, "tokens", tokens, "margin", round(margin, 4))
    dist.barrier()
    os._exit(0)                # the checkpoint writer's helper process would keep it waiting


def train_distributed(model, rank, args):
    """OPTIM_STEPS Adam steps of `model` wrapped in DistributedDataParallel with the distributed
    optimizer (each DP rank its own tokens); the optimizer."""
    import torch.nn.functional as F
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-2, weight_decay=0.01, use_distributed_optimizer=True), [ddp])
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    generator = torch.Generator().manual_seed(100 + parallel_state.get_data_parallel_rank())
    positions = torch.arange(args.seq_length - 1)[None].expand(2, -1)
    for _ in range(OPTIM_STEPS):
        if args.pipeline_model_parallel_size > 1:
            # no pipeline schedule here: a random linear loss of each stage's parameters, the
            # tied embedding's two copies all-reduced (finalize_model_grads)
            sum((p * torch.randn(p.shape, generator=generator)).sum()
                for p in model.parameters()).backward()
            finalize_model_grads([ddp])
        else:
            tokens = torch.randint(0, VOCAB, (2, args.seq_length), generator=generator)
            out = ddp(tokens[:, :-1], positions, None).clone()    # [2, s-1, padded vocab]
            F.cross_entropy(out.reshape(-1, out.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
            ddp.finish_grad_sync()
        optimizer.step()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
    return optimizer


def moments(model, optimizer):
    """{parameter's name: [sum of exp_avg, sum of |exp_avg|, sum of exp_avg_sq]} of the
    distributed optimizer's (the ChainedOptimizer's one) state gathered over DP
    (get_parameter_state_dp_zero), each parameter's range of its buffer (param_index_map); a
    parameter split over TP (tensor_model_parallel) summed over its TP pieces."""
    from megatron.core import parallel_state
    names = {p: n for n, p in model.named_parameters()}
    (optimizer,) = optimizer.chained_optimizers   # one DistributedOptimizer (no experts)
    state = optimizer.get_parameter_state_dp_zero(use_gloo_comm=False, return_on_all_ranks=True)
    out = {}
    for index, buffer in enumerate(optimizer.buffers):
        (world,) = state[index].values()
        for param, (start, end, _) in buffer.param_index_map.items():
            avg, avg_sq = world["exp_avg"][start:end], world["exp_avg_sq"][start:end]
            out[names[param]] = [float(avg.double().sum()), float(avg.double().abs().sum()),
                                 float(avg_sq.double().sum())]
    split = {names[p] for p in names if getattr(p, "tensor_model_parallel", False)}
    pieces = [None] * parallel_state.get_tensor_model_parallel_world_size()
    dist.all_gather_object(pieces, out, group=parallel_state.get_tensor_model_parallel_group())
    out = {name: [sum(piece[name][i] for piece in pieces) if name in split else sums[i]
                  for i in range(3)] for name, sums in out.items()}
    # a stage's layers under their global numbers; the last stage's copy of a tied embedding
    # (output_layer, held as the embedding's) left out
    offset = parallel_state.get_pipeline_model_parallel_rank() * len(model.decoder.layers)
    def numbered(m):
        return f"decoder.layers.{int(m.group(1)) + offset}."
    out = {re.sub(r"^decoder\.layers\.(\d+)\.", numbered, name): sums
           for name, sums in out.items()
           if not (name == "output_layer.weight" and model.share_embeddings_and_output_weights)}
    stages = [None] * parallel_state.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, out, group=parallel_state.get_pipeline_model_parallel_group())
    return dict(sorted(item for stage in stages for item in stage.items()))


def make_optimizer(rank, name, port, out):
    """One DP rank's part of the distributed optimizer's fixture `name` (OPTIM_FORMS): the
    GPT-2 style model trained, saved with its optimizer as Megatron-LM's save_checkpoint saves
    it, the moments recorded."""
    from megatron.core import dist_checkpointing
    form, tp, pp = OPTIM_FORMS[name]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2 * tp * pp)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp)
    cpu_corners()
    optimizer_corners()
    args = megatron_args(SPECS["dist_tp1_gpt2"], tp)
    args.use_distributed_optimizer, args.iteration = True, OPTIM_STEPS
    args.pipeline_model_parallel_size = pp
    torch.manual_seed(1)
    model = build_model(args)
    optimizer = train_distributed(model, rank, args)
    recorded = moments(model, optimizer)
    metadata = {"distrib_optim_sharding_type": form, "singleton_local_shards": False,
                "chained_optim_avoid_prefix": True}
    if form == "fully_reshardable":
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    folder = f"iter_{OPTIM_STEPS:07d}"
    if rank == 0:
        os.makedirs(os.path.join(out, folder))
    dist.barrier()
    os.chdir(out)
    model_state = model.sharded_state_dict(metadata=metadata)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": OPTIM_STEPS,
             "model": model_state, "num_floating_point_operations_so_far": 0,
             "optimizer": optimizer.sharded_state_dict(model_state, metadata=metadata)}
    dist_checkpointing.save(state, folder, content_metadata=metadata)
    dist.barrier()
    if rank == 0:
        with open("latest_checkpointed_iteration.txt", "w") as f:
            f.write(str(OPTIM_STEPS))
        with open("expected.json", "w") as f:
            json.dump({"form": form, "tp": tp, "pp": pp, "step": OPTIM_STEPS,
                       "moments": recorded}, f, indent=1)
        print(name, form, "TP", tp, "PP", pp, len(recorded), "parameters")
    dist.barrier()
    os._exit(0)


def check(rank, folder, tp, port):
    """Load the torch_dist checkpoint `folder` (its latest iteration) into megatron-core's
    GPTModel of `tp` ranks with dist_checkpointing.load and print the logits after the prompt."""
    from megatron.core import dist_checkpointing
    init(rank, tp, port)
    with open(os.path.join(folder, "latest_checkpointed_iteration.txt")) as f:
        iteration = int(f.read())
    path = os.path.join(folder, f"iter_{iteration:07d}")
    common = dist_checkpointing.load_common_state_dict(path)
    args = common["args"]
    args.tensor_model_parallel_size = tp
    model = build_model(args).eval()
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
    model.load_state_dict(state["model"])
    row = logits(model, PROMPT)[-1]
    if rank == 0:
        print(json.dumps({"iteration": iteration, "tp": tp,
                          "prompt_logits": [round(float(v), 6) for v in row]}))
    dist.barrier()
    os._exit(0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", metavar="DIR")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--only", nargs="*", default=list(SPECS) + list(OPTIM_FORMS))
    options = parser.parse_args()
    port = 29500 + os.getpid() % 1000
    if options.check:
        mp.spawn(check, (options.check, options.tp, port), nprocs=options.tp)
        return
    for name in options.only:
        out = os.path.join(HERE, name)
        shutil.rmtree(out, ignore_errors=True)
        if name in OPTIM_FORMS:
            mp.spawn(make_optimizer, (name, port, out),
                     nprocs=2 * OPTIM_FORMS[name][1] * OPTIM_FORMS[name][2])
        else:
            mp.spawn(make, (name, port, out), nprocs=SPECS[name]["tp"])
        port += 1


if __name__ == "__main__":
    sys.exit(main())
