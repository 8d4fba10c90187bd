"""Learn by breaking: the catalogue of named bugs, each a small, exact change to the concept code.

    bash run.sh tour --break list          the catalogue
    bash run.sh tour --break NAME          the bug planted in the layouts it concerns, beside one
                                           process: the row that catches it, then why

A bug is the text `before` replaced by `after` in one function of one file (BUGS). It is planted
in memory only, for one run: the function is compiled anew from its file's text with the change
(linecache holds that text, so ms.jit, which reads a function's source, compiles the changed
one too) and put in place of the original while the run trains (planted); the checkout is never
touched. The suite plants each bug in a short run of each layout it concerns
(test_<concept>_planted_bug_is_caught) and the tour does (--break), from this one list: a bug
that no proof catches would be a hole in the proofs, and the suite fails for it.
"""
import ast
import contextlib
import importlib
import linecache
import os
import textwrap
from collections import namedtuple

from settings.cli import PROJECT

# concept: the suite's concept mark; file, function (Class.method or a module's function):
# where the change is; before, after: the text changed, once in that function; layouts: the
# tour's layouts that catch it (tools/tour.LAYOUTS); proof: what differs from one process ("loss"
# or "grad norm"), or "deadlock" (the run stops, the deadlock named); breaks: the rule broken;
# why: why the proof catches it
Bug = namedtuple("Bug", "concept file function before after layouts proof breaks why")

BUGS = {
    "tp_row_unreduced": Bug(
        "tp", "parallel.py", "RowParallelLinear.construct",
        "y = self.reduce(linear(x, self.weight, None, self.matmul))",
        "y = linear(x, self.weight, None, self.matmul)", ["tp"], "loss",
        "the row-parallel linear (Megatron-LM, Shoeybi et al. 2019, section 3): Y = sum_i X_i A_i, "
        "so each TP rank's partial product X_i A_i is all-reduced (g) before what follows",
        "each TP rank goes on with its own partial sum: the attention's and the MLP's outputs "
        "are wrong from the first layer, and so is the first loss"),
    "sp_norm_unreduced": Bug(
        "tp", "distributed.py", "reduced_over_model_parallel",
        "grad = collectives(state.tp_group).all_reduce(grad)", "pass", ["tp_sp"], "grad norm",
        "sequence parallelism (Korthikanti et al. 2022, section 4.2.2): a norm's weight sees only "
        "this rank's tokens, so its gradient is a sum over the TP ranks",
        "each TP rank steps its norms with its own tokens' share of the gradient: the norm of "
        "the gradient is smaller than one process's"),
    "dp_mean_as_sum": Bug(
        "dp", "distributed.py", "BucketLayout.reduce_bucket",
        "+ padding) * self.gradient_scaling_factor", "+ padding)", ["dp", "dp_distopt"],
        "grad norm",
        "data parallelism: the loss is the mean over the global batch, so the gradient is the "
        "mean of the DP ranks' gradients (Megatron's gradient_scaling_factor = 1 / DP)",
        "the gradient is DP times one process's: Adam hides a constant factor in the loss, the "
        "gradient norm shows it"),
    "dp_same_samples": Bug(
        "dp", "data.py", "MicroBatchIterator.__init__",
        "self.rank, self.dp = data_parallel_rank, data_parallel_size",
        "self.rank, self.dp = 0, data_parallel_size", ["dp"], "loss",
        "data parallelism: each DP rank reads its own slice of the global batch",
        "every DP rank trains on rank 0's micro-batches: the loss is another batch's"),
    "tied_embedding_unreduced": Bug(
        "pipeline", "distributed.py", "reduced_over_model_parallel",
        "grad = collectives(state.embedding_group).all_reduce(grad)", "pass", ["pp"],
        "grad norm",
        "the tied word embedding (Megatron-LM, Shoeybi et al. 2019): the first stage's input "
        "embedding and the last stage's output layer are one matrix, so each copy steps with "
        "the sum of both gradients",
        "each copy steps with its own half of the gradient: the gradient norm differs, then "
        "the copies drift apart"),
    "micro_batch_losses_summed": Bug(
        "pipeline", "train.py", "Trainer.forward_backward",
        "self.loss_weight = self.scaler.scale / len(micro_batches)",
        "self.loss_weight = self.scaler.scale", ["pp"], "grad norm",
        "gradient accumulation: the global batch's loss is the mean over its m micro-batches, so "
        "each micro-batch's gradient is weighted 1 / m",
        "the gradient is m times one process's: Adam hides it in the losses, the gradient norm "
        "shows it"),
    "warmup_reversed": Bug(
        "pipeline", "pipeline.py", "schedule",
        "warmup = min(p - rank - 1, m)", "warmup = min(rank, m)", ["pp"], "deadlock",
        "1F1B (PipeDream-Flush; Narayanan et al. 2021, section 2.2): stage r runs p - r - 1 "
        "warmup forwards before its first backward, the first stage the most, the last none",
        "the first stage, with no warmup, waits for micro-batch 0's gradient before it sends "
        "micro-batch 1, which the last stage needs before it can send that gradient: the plan "
        "of every rank's exchanges (pipeline.simulate) finds no rank able to move and names "
        "what each waits for, on every rank, before any tensor is sent"),
    "grads_not_accumulated": Bug(
        "pipeline", "pipeline.py", "ForwardBackward._backward",
        "grads[i] = g if grads[i] is None else grads[i] + g",
        "grads[i] = g", ["pp"], "grad norm",
        "gradient accumulation: a step's gradient is the sum of its m micro-batches' gradients "
        "(each weighted 1 / m), accumulated as the backwards run",
        "each micro-batch's gradient replaces the one before: the step keeps the last "
        "micro-batch's alone, and the gradient norm differs"),
    "cp_grads_averaged": Bug(
        "cp", "distributed.py", "build_data_parallel",
        "bucket_size, scale = cfg.training_config.bucket_size, 1.0 / state.dp",
        "bucket_size, scale = cfg.training_config.bucket_size, 1.0 / (state.dp * state.cp)",
        ["cp_ulysses"], "grad norm",
        "context parallelism: each CP rank's loss is its tokens' share of the sequence's loss "
        "(gpt.GPTModel), so the CP ranks' gradients are summed and only DP averages (Megatron "
        "averages both: its rank's loss is the mean over its own tokens)",
        "the gradient is 1 / CP of one process's: the gradient norm shows it"),
    "ulysses_head_split": Bug(
        "cp", "parallel.py", "_sequence_to_heads",
        "return comm.all_to_all(x, 2, 0)",
        "return comm.all_to_all(x.reshape(x.shape[0], x.shape[1], -1, comm.size, x.shape[3])"
        ".swapaxes(2, 3).reshape(x.shape), 2, 0)", ["cp_ulysses"], "loss",
        "DeepSpeed-Ulysses (Jacobs et al. 2023): the all-to-all that deals the heads to the CP "
        "ranks and the one that gathers them back must agree on which heads each rank holds "
        "(here contiguous blocks)",
        "the heads are dealt round-robin (rank r: heads r, r + CP, ...) but gathered back in "
        "blocks: the attention's output reaches the projection with its heads permuted (and "
        "under GQA a rank's query heads meet other groups' keys), so the loss differs"),
    "ring_causal_case": Bug(
        "cp", "context_parallel.py", "ring_step",
        "return _halves(block(qh, k, v, bias), half)",
        "return _halves(block(qh, k, v, None), half)", ["cp_ring"], "loss",
        "ring attention (Liu et al. 2023) with causal load balancing: the diagonal block, this "
        "rank's own keys, needs the causal mask",
        "queries attend to later tokens of their own chunk, which one process masks: the "
        "model sees the future, and the loss differs from the first step"),
    "ring_grads_not_carried": Bug(
        "cp", "context_parallel.py", "RingKernel.backward",
        "dk_j, dv_j = dk_j + grads[0], dv_j + grads[1]", "dk_j, dv_j = dk_j, dv_j", ["cp_ring"],
        "grad norm",
        "ring attention's backward (Megatron's AttnFuncWithCPAndKVP2P): a key/value block's "
        "gradient is the sum over every rank whose queries met it, carried round the ring with "
        "the block and added to at each rank",
        "each rank passes on only its own share of the block's dK and dV, dropping what came "
        "with it: the owner's key and value gradients miss the other ranks' queries, so the "
        "gradient norm differs (the first loss does not)"),
    "aux_loss_scaled_twice": Bug(
        "moe", "moe.py", "MoEAuxLossAutoScaler.set_loss_scale",
        "Tensor(float(scale), F32)", "Tensor(float(scale) ** 2, F32)", ["ep"], "grad norm",
        "the load-balancing loss (Switch Transformer, Fedus et al. 2021) takes the main loss's "
        "weight (loss scale / micro-batches) once",
        "the aux and z losses' gradients are scaled twice: the gradient norm differs"),
    "expert_bias_tokens_unsummed": Bug(
        "moe", "moe.py", "update_expert_bias",
        "tokens = parallel.collectives(state.tp_dp_cp_group).all_reduce(",
        "tokens = parallel.collectives(state.tp_group).all_reduce(", ["ep_bias"], "loss",
        "auxiliary-loss-free balancing (DeepSeek-V3, Liu et al. 2024, section 2.1.2): each "
        "expert's bias moves by the step's tokens routed to it over the whole batch, summed over "
        "TP x DP x CP, so every rank moves it alike",
        "each rank moves its biases by its own tokens: the ranks' biases part, and the routing "
        "of the next step, hence its loss, differs from one process's"),
    "ep_chunks_unsorted": Bug(
        "moe", "moe.py", "MoEAlltoAllTokenDispatcher.dispatch",
        "tokens = tokens.transpose(1, 0, 2, 3).reshape(self.num_local_experts, -1, "
        "tokens.shape[-1])",
        "tokens = tokens.reshape(self.num_local_experts, -1, tokens.shape[-1])", ["ep"], "loss",
        "expert parallelism's all-to-all (GShard, Lepikhin et al. 2020): what arrives is in "
        "(source rank, local expert) order and must be sorted into (local expert, source "
        "rank) order before the experts run (Megatron's sort_chunks_by_idxs)",
        "each local expert computes on other experts' tokens, weighted by its own tokens' "
        "probabilities: the MoE layer's output, and the first loss, differ"),
    "fsdp_shard_from_wrong_rank": Bug(
        "dp", "optimizer.py", "DistributedOptimizer.gathered_bucket",
        "return collectives(self.buffer.group).all_gather(self.cast(ops.cat(mine), dtype))",
        "return ops.flip(collectives(self.buffer.group).all_gather(self.cast(ops.cat(mine), "
        "dtype)).reshape(self.buffer.group_size, -1), (0,)).reshape(-1)",
        ["fsdp_zero3"], "grad norm",
        "ZeRO-3 (Rajbhandari et al. 2020, section 5.3; Megatron-FSDP's optim_grads_params): "
        "before a unit's forward and backward each rank's shard of it is all-gathered, rank r's "
        "into the r-th slice of the whole",
        "the shards land in each other's places (rank 1's where rank 0's belongs): the backward "
        "of the first step already runs on the regathered, scrambled weights, so the first "
        "gradient norm differs"),
    "fp16_grads_left_scaled": Bug(
        "fp16", "optimizer.py", "MixedPrecisionOptimizer.main_grads",
        "inv_scale = self.scaler.inv_scale", "inv_scale = 1.0", ["fp16"], "grad norm",
        "mixed precision (Micikevicius et al. 2018): the loss is multiplied by the loss scale so "
        "that small float16 gradients survive, and the gradients are divided by it before the "
        "norm, clipping and the update",
        "the gradients stay loss-scale times too large (4096 here): Adam's update hides the "
        "factor, the gradient norm does not"),
    "expert_grads_unscaled": Bug(
        "moe", "distributed.py", "BucketLayout.reduce_bucket",
        "if not scatter and self.group_size == 1 and self.gradient_scaling_factor == 1.0:",
        "if not scatter and self.group_size == 1:", ["ep"], "grad norm",
        "expert parallelism: an expert's gradient is the sum over the tokens of every DP rank "
        "routed to it, and the loss a mean over the global batch, so it too is divided by DP, "
        "even when its expert-data-parallel group (DP x CP / EP) is one rank",
        "with EP = DP the experts' group is one rank and the shortcut skips their 1 / DP: their "
        "gradients are DP times one process's"),
}


def source_of(bug):
    """(path, the file's text with the bug's change, the changed function's def node) of `bug`;
    ValueError when `before` is not exactly once in that function."""
    path = os.path.join(PROJECT, bug.file)
    text = open(path).read()
    node = function_node(ast.parse(text), bug.function)
    lines = text.splitlines(keepends=True)
    start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
    body = "".join(lines[start - 1:node.end_lineno])
    if body.count(bug.before) != 1:
        raise ValueError(f"{bug.file}: {bug.function} holds {bug.before!r} "
                         f"{body.count(bug.before)} times, not once")
    changed = "".join(lines[:start - 1]) + body.replace(bug.before, bug.after) + "".join(
        lines[node.end_lineno:])
    return path, changed, node


def function_node(tree, function):
    """The def node of `function` ("name" or "Class.name") in a module's ast."""
    scope = tree
    for name in function.split("."):
        scope = next(n for n in scope.body if isinstance(
            n, (ast.ClassDef, ast.FunctionDef)) and n.name == name)
    return scope


def where(bug):
    """(file, line) of the bug's change in the checkout."""
    path, _, node = source_of(bug)
    lines = open(path).read().splitlines()
    line = next(i for i in range(node.lineno, node.end_lineno + 1)
                if bug.before in lines[i - 1])
    return bug.file, line


def patches(plant):
    """The patches [(owner, attribute, replacement)] of `plant`: the bug of that name (BUGS), or
    "COPY::FILE::FUNCTION", the function as a learner wrote it in FILE of the project's copy
    COPY (an exercise: tools/exercises.py), in place of the checkout's."""
    if "::" in plant:
        copy, file, function = plant.split("::")
        path = os.path.join(copy, file)
        return compiled(file, function, open(path).read(), path)
    bug = BUGS[plant]
    path, changed, _ = source_of(bug)
    return compiled(bug.file, bug.function, changed, f"{path} (bug {plant})")


def compiled(file, function, text, filename):
    """[(owner, attribute, replacement)]: `function` of the checkout's module `file` compiled
    from `text`, a whole file's text (under `filename` in linecache, so that ms.jit, which reads
    a function's source, reads this one), in the module's globals."""
    module = importlib.import_module(file[:-3].replace("/", "."))
    owner = module
    for part in function.split(".")[:-1]:
        owner = getattr(owner, part)
    attribute = function.split(".")[-1]
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    definition = function_node(ast.parse(text), function)
    definition.decorator_list = []
    code = compile(ast.Module([definition], []), filename, "exec")
    namespace = {}
    exec(code, module.__dict__, namespace)                                  # noqa: S102
    replacement = namespace[attribute]
    if isinstance(owner.__dict__[attribute], staticmethod):
        replacement = staticmethod(replacement)
    return [(owner, attribute, replacement)]


@contextlib.contextmanager
def planted(patch_list):
    """The patches [(owner, attribute, replacement)] in the code for the duration of the block."""
    saved = [(owner, attribute, owner.__dict__[attribute]) for owner, attribute, _ in patch_list]
    for owner, attribute, replacement in patch_list:
        setattr(owner, attribute, replacement)
    try:
        yield
    finally:
        for owner, attribute, value in saved:
            setattr(owner, attribute, value)


def catalogue():
    """The lines of `--break list`: each bug's name, concept, layouts, change and proof."""
    lines = []
    for name, bug in BUGS.items():
        file, line = where(bug)
        lines.append(f"{name:<26} {bug.concept:<9} {', '.join(bug.layouts):<15} "
                     f"{file}:{line}, {caught(bug)}")
    return lines


def caught(bug):
    """How the proof catches `bug`: "caught on the loss", "caught as a deadlock"."""
    return "caught as a deadlock" if bug.proof == "deadlock" else f"caught on the {bug.proof}"


def explanation(name):
    """The lines printed under a broken tour: what changed (file:line, the whole line before and
    after), the rule it breaks, why the proof caught it; wrapped at 100 characters."""
    bug = BUGS[name]
    file, line = where(bug)
    before = open(os.path.join(PROJECT, file)).read().splitlines()[line - 1].strip()
    lines = [f"bug {name}: {file}:{line}, in {bug.function}",
             f"    before: {before}", f"    after:  {before.replace(bug.before, bug.after)}"]
    for text in (f"it breaks {bug.breaks}", f"{caught(bug)}: {bug.why}"):
        lines += textwrap.wrap(text, 100, initial_indent="    ", subsequent_indent="      ")
    return lines


if __name__ == "__main__":          # imported by tour.py and the suite, not a script
    raise SystemExit("error: bugs.py is a library: run `bash run.sh tour --break list` (bash "
                     "run.sh --help lists the commands)")
