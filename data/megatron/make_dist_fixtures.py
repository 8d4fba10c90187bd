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
top-2, the allgather dispatcher) in each layer. Its `expected.json` holds a prompt, the
logits after it and the greedy continuation computed by megatron-core's own forward (float32, on
the weights as stored; the seed is the first whose greedy path keeps the top-1/top-2 gap at least
MIN_MARGIN).

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
        use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, num_moe_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        **({k: getattr(args, k) for k in MOE_ARGS if k != "moe_grouped_gemm"}
           if args.num_experts else {}))
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts,
                                    normalization=args.normalization)
    return GPTModel(config, spec, vocab_size=args.padded_vocab_size,
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
    parser.add_argument("--only", nargs="*", default=list(SPECS))
    options = parser.parse_args()
    port = 29500 + os.getpid() % 1000
    if options.check:
        mp.spawn(check, (options.check, options.tp, port), nprocs=options.tp)
        return
    for name in options.only:
        out = os.path.join(HERE, name)
        shutil.rmtree(out, ignore_errors=True)
        mp.spawn(make, (name, port, out), nprocs=SPECS[name]["tp"])
        port += 1


if __name__ == "__main__":
    sys.exit(main())
