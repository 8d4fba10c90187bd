"""megatron-core's own GPTModel trained on this CPU (torch, gloo) in the layouts it shares with this
project: the peer of `bash run.sh bench --peer PYTHON`, which alternates it with the project's runs.

torch and megatron-core are not dependencies of this project: PYTHON is another interpreter, one
with torch 2.13, megatron-core 0.16.1, numpy, psutil and pyyaml
(`python3 -m venv /tmp/mc && /tmp/mc/bin/pip install torch==2.13.0 megatron-core==0.16.1 numpy
psutil pyyaml`), so this file imports nothing of MindSpore's, and torch and megatron only inside
the functions that use them.

    PYTHON -m tools.bench_peer [--layouts one tp2 tp2_sp dp2 pp2] [--steps 12] [--tiny]

run from the project's folder, launches each layout with torchrun, one after another, and prints
one line per layout (rank 0's):

    layout=NAME workers=W tokens_per_s=T ms_per_step=M losses=L1,L2,... grad_norms=G1,G2,...

tokens_per_s is the global batch's tokens over the wall time of the second half of the steps (the
first half warms up), from a barrier before the first timed step to one after the last. losses
are each step's loss over the whole global batch, grad_norms megatron's global gradient norm
before clipping: every layout trains the same model on the same batch, so they agree across
layouts. --tiny trains a tiny model instead of the benchmark's (a smoke test).

The model: the benchmark's shape (bench_torch.SHAPE, the one bench.py trains), GPTModel with
get_gpt_layer_local_spec (megatron's ColumnParallel/RowParallelLinear, DotProductAttention with
its unfused softmax, VocabParallelEmbedding, vocab-parallel cross-entropy), learned absolute
positions, LayerNorm, GeLU, biases, tied embeddings, no dropout, float32; init std 0.02 on the CPU
from one seed on every rank. The step is megatron training's: DistributedDataParallel (one bucket,
gradients all-reduced), get_forward_backward_func() with finalize_model_grads,
get_megatron_optimizer (torch's AdamW without Apex: lr 1e-4, weight decay 0.01, clip 1.0). The
data: one fixed random global batch, every step.

    one      1 process, micro-batch 8, 2 torch threads
    tp2      2 processes, tensor parallel 2, micro-batch 8, 1 thread each
    tp2_sp   tp2 with sequence parallelism
    dp2      2 processes, data parallel 2, micro-batch 4 each
    pp2      2 processes, pipeline parallel 2, 1F1B, 4 micro-batches of 2

megatron-core assumes CUDA in a few corners; cpu_patches replaces them in the workers (the
installed files are untouched, the model's arithmetic is unchanged). torch 2.13's gloo has every
collective megatron-core calls (all_gather_into_tensor, reduce_scatter_tensor, batch_isend_irecv).
"""
import os
import subprocess
import sys
import time

from settings.cli import PROJECT, parse_command, parse_layouts_command
from tools.bench_torch import SHAPE

# name: (workers, tensor parallel, pipeline parallel, sequence parallel, micro-batch, torch threads
# a worker: the machine's 2 cores shared by the workers)
LAYOUTS = {
    "one": (1, 1, 1, False, 8, 2),
    "tp2": (2, 2, 1, False, 8, 1),
    "tp2_sp": (2, 2, 1, True, 8, 1),
    "dp2": (2, 1, 1, False, 4, 1),
    "pp2": (2, 1, 2, False, 2, 1),
}
TINY = {"layers": 2, "hidden": 64, "heads": 4, "ffn": 256, "seq": 32, "vocab": 256, "batch": 8}
SEED = 1234
INSTALL = ("python3 -m venv /tmp/mc && /tmp/mc/bin/pip install torch==2.13.0 "
           "megatron-core==0.16.1 numpy psutil pyyaml")                # a PYTHON for this file
FLAGS = {"--layouts": (list(LAYOUTS), list, "layouts to run, one after another"),
         "--steps": (12, int, "training steps a layout (the second half is timed)"),
         "--tiny": (None, bool, "a tiny model instead of the benchmark's (a smoke test)")}


def main(argv):
    """PYTHON -m tools.bench_peer: each layout in turn, its line printed as it ends."""
    options, code = parse_layouts_command(
        "bench_peer", argv, FLAGS, LAYOUTS,
        about="megatron-core's GPT in each layout (--peer's python)")
    if options is None:
        return code
    for name in options["layouts"]:
        launch(name, options["steps"], options["tiny"])
    return 0


def launch(name, steps, tiny):
    """Layout `name` on its workers (torchrun, this python): prints rank 0's line, or ends with
    the workers' output if they failed."""
    workers, threads = LAYOUTS[name][0], LAYOUTS[name][5]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(workers), "-m", "tools.bench_peer", "worker", name, "--steps", str(steps),
           *(["--tiny"] if tiny else [])]
    # torchrun would set OMP_NUM_THREADS=1 itself (with a warning); megatron-core warns in every
    # worker that Apex and Transformer Engine are absent, which is expected on a CPU
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
    done = subprocess.run(cmd, cwd=PROJECT, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("layout=")]
    if done.returncode or not lines:
        sys.exit(f"{done.stdout}{done.stderr}error: bench_peer: layout {name} failed "
                 f"(exit {done.returncode}), its workers' output above")
    print(lines[0], flush=True)


def worker(argv):
    """One torchrun worker of layout LAYOUT: builds megatron-core's model and optimizer, trains
    --steps steps and (rank 0) prints the layout's line."""
    options = parse_command("bench_peer worker", argv, FLAGS, positional=("LAYOUT",))[0]
    name, steps = options["layout"], options["steps"]
    shape = TINY if options["tiny"] else SHAPE
    workers, tp, pp, sp, micro, threads = LAYOUTS[name]
    import torch                      # only here: the project's own venv has neither
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    torch.set_num_threads(threads)
    dist.init_process_group("gloo")
    assert dist.get_world_size() == workers, f"{name} takes {workers} workers"
    cpu_patches()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model, optimizer = build(shape, tp, pp, sp)
    batches = micro_batches(shape, micro, ps.get_data_parallel_world_size(),
                            ps.get_data_parallel_rank())
    sums, grad_norms, seconds = train(model, optimizer, batches, shape, steps)
    # each step's loss over the global batch: the token-loss sums and counts of the last stage's
    # first tensor-parallel rank of every data-parallel rank (the others hold copies or none)
    if not (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0):
        sums.zero_()
    dist.all_reduce(sums)
    losses = (sums[:, 0] / sums[:, 1]).tolist()
    timed = steps - steps // 2
    if dist.get_rank() == 0:
        print(f"layout={name} workers={workers} "
              f"tokens_per_s={shape['batch'] * shape['seq'] * timed / seconds:.0f} "
              f"ms_per_step={1000 * seconds / timed:.1f} "
              f"losses={','.join(f'{x:.6f}' for x in losses)} "
              f"grad_norms={','.join(f'{x:.6f}' for x in grad_norms)}", flush=True)
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _on_cpu(kwargs):
    """A tensor factory's keyword arguments with a CUDA device (or a device index) made the CPU
    and no pinned memory."""
    device = kwargs.get("device")
    if isinstance(device, int) or str(getattr(device, "type", device)).startswith("cuda"):
        kwargs["device"] = "cpu"
    kwargs.pop("pin_memory", None)
    return kwargs


def _torch_on_cpu():
    """A module that is torch but for its tensor factories, which put device='cuda' tensors on
    the CPU: the `torch` of megatron-core's modules that build their small tensors on the device
    (the number of tokens, the grad norm's buffers, the optimizer's loss scale)."""
    import types
    import torch

    class TorchOnCPU(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

    view = TorchOnCPU("torch")
    for name in ("zeros", "ones", "empty", "tensor", "full"):
        factory = getattr(torch, name)
        setattr(view, name, (lambda f: lambda *a, **kw: f(*a, **_on_cpu(kw)))(factory))
    return view


class CPULayerNorm:
    """torch.nn.LayerNorm whose weight and bias carry megatron's `sequence_parallel` mark, as
    FusedLayerNorm and TENorm set it, so that finalize_model_grads all-reduces their grads over
    the tensor-parallel group under sequence parallelism (the local spec's WrappedTorchNorm,
    the LayerNorm without Apex, refuses sequence parallelism)."""

    def __new__(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False,
                zero_centered_gamma=False, normalization="LayerNorm"):
        import torch
        assert config.normalization == "LayerNorm" and not config.layernorm_zero_centered_gamma
        norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        for p in (norm.weight, norm.bias):
            p.sequence_parallel = config.sequence_parallel
        return norm


def cpu_patches():
    """megatron-core's CUDA-only corners, replaced for the CPU: the device of its buffers
    (GlobalMemoryBuffer, the DDP grad buffers, the pipeline's receive buffers), the pipeline's
    synchronize and the tied embedding's .cuda(), the CUDA RNG tracker's fork (no dropout here;
    initialization on the CPU uses torch's RNG), the causal mask (built on the CPU), small tensors
    made on the device (_torch_on_cpu), the final LayerNorm (CPULayerNorm) and gradient clipping
    (clip_grads_on_cpu)."""
    import contextlib
    import functools
    import importlib
    import torch
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.tensor_parallel.random as tensor_random
    import megatron.core.transformer.transformer_block as transformer_block
    import megatron.core.transformer.utils as transformer_utils
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    tensor_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    mask = functools.lru_cache(
        lambda sq, skv=None: torch.triu(torch.ones(sq, skv or sq), diagonal=1).bool())
    transformer_utils.get_default_causal_mask = mask
    fused_softmax.get_default_causal_mask = mask         # bound there at import
    view = _torch_on_cpu()
    for module in ("pipeline_parallel.schedules", "optimizer.clip_grads", "optimizer.optimizer",
                   "optimizer.distrib_optimizer", "optimizer.grad_scaler"):
        importlib.import_module(f"megatron.core.{module}").torch = view
    transformer_block.LayerNormImpl = CPULayerNorm
    clip_grads_on_cpu()


def clip_grads_on_cpu():
    """megatron-core's clipping without Apex: the same scaling of the grads by
    max_norm / (total_norm + 1e-6) when under 1, without its assert that grads are
    torch.cuda.FloatTensor; and its norm of the per-tensor norms returned on the CPU."""
    import torch
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [clip_grads.to_local_if_dtensor(getattr(p, attr)).detach() for p in parameters
                 if getattr(p, attr, None) is not None]
        coefficient = max_norm / (total_norm + 1.0e-6)
        if coefficient < 1.0:
            clip_grads.multi_tensor_applier(clip_grads.multi_tensor_scale_impl,
                                            torch.zeros(1, dtype=torch.int), [grads, grads],
                                            coefficient)

    def local_multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        norms = [[torch.norm(t) for t in tensors] for tensors in tensor_lists]
        return torch.norm(torch.tensor(norms)).reshape(1).float(), None

    assert clip_grads.l2_norm_impl.__name__ == "local_multi_tensor_l2_norm", "Apex is installed"
    clip_grads.l2_norm_impl = local_multi_tensor_l2_norm
    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32    # bound at import


def build_gpt(config, shape, pre_process=True, post_process=True):
    """megatron-core's GPTModel of `shape` (this stage's share under pipeline parallelism)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    spec = get_gpt_layer_local_spec(normalization="LayerNorm")
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = CPULayerNorm
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=shape["vocab"],
                    max_sequence_length=shape["seq"], pre_process=pre_process,
                    post_process=post_process, parallel_output=True,
                    share_embeddings_and_output_weights=True,
                    position_embedding_type="learned_absolute")


def transformer_config(shape, tp, pp, sp):
    """The TransformerConfig of the benchmark's model in float32, every CUDA fusion off."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig(
        num_layers=shape["layers"], hidden_size=shape["hidden"],
        num_attention_heads=shape["heads"], ffn_hidden_size=shape["ffn"],
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp,
        pipeline_dtype=torch.float32, params_dtype=torch.float32, normalization="LayerNorm",
        layernorm_epsilon=1e-5, add_bias_linear=True, activation_func=torch.nn.functional.gelu,
        gated_linear_unit=False, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        use_cpu_initialization=True, perform_initialization=True, bias_dropout_fusion=False,
        masked_softmax_fusion=False, bias_activation_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        attention_softmax_in_fp32=True, deallocate_pipeline_outputs=True, batch_p2p_comm=True,
        variable_seq_lengths=False)


def build(shape, tp, pp, sp):
    """(the model in megatron-core's DistributedDataParallel, its optimizer), the model starting
    from the one-process model's weights in every layout: tensor-parallel ranks take their shards
    of the same full weights (one seed, initialized on the CPU); a pipeline stage copies its
    share (copy_one_process_init)."""
    import dataclasses
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    config = transformer_config(shape, tp, pp, sp)
    torch.manual_seed(SEED)
    model = build_gpt(config, shape, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
    if pp > 1:
        torch.manual_seed(SEED)
        whole = build_gpt(dataclasses.replace(config, pipeline_model_parallel_size=1), shape)
        copy_one_process_init(model, whole)
    model = DistributedDataParallel(config=config, module=model, ddp_config=(
        DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=False)))
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-4, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999,
        adam_eps=1e-8, clip_grad=1.0, params_dtype=torch.float32), [model])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return model, optimizer


def copy_one_process_init(stage, whole):
    """Gives pipeline stage `stage` the weights of `whole`, the one-process model built from the
    same seed: its layers by their global layer number, the tied output layer of the last stage
    from the word embedding."""
    import torch
    source = dict(whole.named_parameters())
    offset = stage.decoder.layers[0].layer_number - 1 if len(stage.decoder.layers) else 0
    with torch.no_grad():
        for name, p in stage.named_parameters():
            key = name
            if name.startswith("decoder.layers."):
                index, rest = name[len("decoder.layers."):].split(".", 1)
                key = f"decoder.layers.{int(index) + offset}.{rest}"
            elif name == "output_layer.weight":
                key = "embedding.word_embeddings.weight"
            p.copy_(source[key])


def micro_batches(shape, micro, dp, dp_rank):
    """This data-parallel rank's slice of one fixed random global batch (a seed of its own), as
    (tokens, labels) micro-batches of `micro` sequences."""
    import torch
    data = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"] + 1),
                         generator=torch.Generator().manual_seed(SEED + 1))
    count = shape["batch"] // (dp * micro)
    mine = data[dp_rank * count * micro:(dp_rank + 1) * count * micro]
    return [(mine[i * micro:(i + 1) * micro, :-1].contiguous(),
             mine[i * micro:(i + 1) * micro, 1:].contiguous()) for i in range(count)]


def train(model, optimizer, batches, shape, steps):
    """Trains `steps` steps as megatron training does. Returns (each step's [sum of token
    losses, tokens] on this rank, a tensor; each step's grad norm; the seconds of the timed
    second half, between barriers)."""
    import torch
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func
    micro, seq = batches[0][0].shape
    positions = torch.arange(seq).expand(micro, -1).contiguous()
    forward_backward = get_forward_backward_func()

    def forward_step(data, model):
        tokens, labels = next(data)
        return model(tokens, positions, None, labels=labels), loss_func

    def loss_func(token_losses):
        loss = token_losses.float().sum()
        count = torch.tensor(token_losses.numel(), dtype=torch.int)
        return loss, count, {"lm loss": torch.stack([loss.detach(), count.float()])}

    sums, grad_norms = [], []
    for step in range(steps):
        if step == steps // 2:
            dist.barrier()
            start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reduced = forward_backward(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=len(batches), seq_length=seq, micro_batch_size=micro,
            decoder_seq_length=seq, forward_only=False)
        done, grad_norm, _ = optimizer.step()
        assert done
        grad_norms.append(float(grad_norm))
        # the loss is on the last stage only; the others add zeros
        sums.append(torch.stack([r["lm loss"] for r in reduced]).sum(0) if reduced
                    else torch.zeros(2))
    dist.barrier()
    return torch.stack(sums).double(), grad_norms, time.perf_counter() - start


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2:])
    else:
        sys.exit(main(sys.argv[1:]))
