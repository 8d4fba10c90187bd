"""Learn by writing: an exercise blanks a concept's key lines in a copy of the project, and the
proofs that catch that function's bugs (tools/bugs.py) grade what the learner writes there.

    bash run.sh exercise list                  the exercises, in README's reading order
    bash run.sh exercise NAME [--dir DIR]      a copy of the project in DIR (exercises/NAME), the
                                               function's key lines replaced by the task and a
                                               raise
    bash run.sh exercise NAME --check [DIR]    the proofs on the learner's lines, each pass or fail
    bash run.sh exercise NAME --hint           a second hint
    bash run.sh exercise NAME --solution       the project's own lines

An exercise stands beside a bug of the catalogue (tools/bugs.BUGS): the same function, proved by
the same layouts of the tour. The copy holds the checkout's files (not its outputs and caches;
.venv is a link to the checkout's), that one function's key lines replaced by a comment that
states the task (the shapes in and out, the collective, the rule and its paper) and `raise
NotImplementedError`; the checkout is never changed, and every `bash run.sh` command runs in the
copy. `--check` grades that function alone: the unit tests of it (if any) run in the copy, then
the exercise's layouts train beside one process, op by op and then compiled, with the learner's
function planted in their workers (bugs.patches), as `tour --break` plants a bug: the one-process
references run the checkout's code (a wrong function in both would agree with itself). The first
proof that fails ends the check, with a hint drawn from what differs (the blank still there, the
loss from the first step, the gradient norm alone and by what factor, a deadlock the schedule's
simulation names). Exit 0 when every proof passes, 1 when one fails, 2 for bad input.
"""
import ast
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections import namedtuple
from xml.etree import ElementTree

from settings.cli import PROJECT, answered, parse_command
from settings.config import ConfigError
from tools import bugs, tour

# bug: the catalogue's bug in the same function (bugs.BUGS: its file, function, concept, and the
# rule it breaks with its paper); first, count: the key lines blanked, the first one's text (once
# in the function) and how many; task: one line; shapes: what goes in and what comes out;
# collective: what to call; hint: the second hint (--hint); units: test_all.py's one-process
# tests of the function (pytest in the copy); layouts: the tour's layouts that prove it (the
# bug's, and more)
Exercise = namedtuple("Exercise", "bug first count task shapes collective hint units layouts")

EXERCISES = {
    "tp_row_parallel": Exercise(
        "tp_row_unreduced", "y = self.reduce(linear(x, self.weight, None, self.matmul))", 1,
        "the row-parallel linear's output: this rank's partial product, summed over the TP ranks",
        "x [s, b, in/tp] (this rank's columns of the input), self.weight [out, in/tp] -> "
        "y [s, b, out], or [s/tp, b, out] under sequence parallelism",
        "linear(x, w, None, self.matmul) is x w^T; self.reduce sums over the TP group "
        "(parallel.reduce_from_tensor_model_parallel_region, or the reduce-scatter to the "
        "sequence-parallel region under SP)",
        "Y = X A with A split by rows and X by columns is Y = X_1 A_1 + X_2 A_2: each rank holds "
        "one term. The sum's backward hands every rank the whole dY, as each term needs.",
        [], ["tp", "tp_sp"]),
    "sp_norm_grad": Exercise(
        "sp_norm_unreduced", 'if getattr(param, "sequence_parallel", False):', 4,
        "a gradient before the DP reduction: summed over TP for a parameter that saw this "
        "rank's sequence shard alone, over the embedding group for a tied embedding's copy",
        "grad: the parameter's shape -> the same shape",
        "collectives(state.tp_group).all_reduce, collectives(state.embedding_group).all_reduce; "
        "the marks param.sequence_parallel and param.shared_embedding",
        "Under sequence parallelism a norm's weight is on every TP rank but each rank saw s/tp "
        "of the tokens: one process's gradient sums over all of them. The tied embedding: the "
        "first stage's word embedding and the last stage's output layer are one matrix.",
        [], ["tp_sp", "pp"]),
    "dp_bucket_reduce": Exercise(
        "dp_mean_as_sum", "(b0, b1), params = self.buckets[b], self.bucket_params(b)", 12,
        "a bucket's gradients scaled by 1 / DP and summed over the DP ranks: all-reduced, or "
        "reduce-scattered to this rank's pieces",
        "grads: one per bucket_params(b), each its parameter's shape -> the same list reduced; "
        "with scatter, this rank's pieces of bucket b (pieces(rank)), flat",
        "collectives(self.group).all_reduce or .reduce_scatter of one flat [b1 - b0] tensor, "
        "its padding zeros; offsets[i] and sizes[i] place parameter i in the buffer",
        "The loss is the mean over the global batch, each rank's gradient its micro-batches' "
        "mean: average them (gradient_scaling_factor, before the sum as Megatron). A "
        "reduce-scatter returns shard_ranges(rank)[b] of the bucket; the pieces lie in it.",
        [], ["dp", "dp_distopt"]),
    "distopt_gather": Exercise(
        "fsdp_shard_from_wrong_rank", "s0, s1 = self.shards[b]", 6,
        "bucket b's parameters whole again, all-gathered from every rank's shard",
        "pieces: this rank's flat pieces (one per self.pieces) -> [b1 - b0], in `dtype`",
        "collectives(self.buffer.group).all_gather of this rank's shard [s1 - s0]: rank r's "
        "lands in the r-th slice",
        "self.shards[b] = (s0, s1) is this rank's range of bucket b; its pieces with piece.bucket "
        "== b fill it in order, and the shard of the bucket's end may need zeros to be s1 - s0 "
        "long, as every rank's must be.",
        [], ["dp_distopt", "fsdp_zero3"]),
    "pipeline_1f1b": Exercise(
        "warmup_reversed", "if v == 1:", 12,
        "the order of this rank's passes: warmup forwards, then one forward and one backward "
        "alternately, then the backwards left",
        "p stages, rank, m micro-batches, v chunks -> [(\"F\" or \"B\", micro-batch, chunk)]; "
        "total = m v; the k-th forward: (\"F\", _microbatch(k, p, v), _chunk(k, p, v, True)), "
        "the k-th backward the same with \"B\" and False",
        "none: the sends and receives follow this order (pipeline.simulate pairs them)",
        "Stage r can run p - r - 1 forwards before the first backward reaches it (at most m); "
        "interleaved: (p - r - 1) * 2 + (v - 1) * p, all of them when m == p, at most m v.",
        ["test_1f1b_and_interleaved_orders_follow_megatrons_rules",
         "test_plan_pairs_every_exchange_and_bubble_matches_theory"], ["pp", "pp_vpp"]),
    "grad_accumulation": Exercise(
        "grads_not_accumulated",
        "for i, g in zip(self.positions[piece] + self.tied_at[piece], g_params):", 3,
        "each parameter's gradient of this micro-batch added to the step's, in grad_dtype",
        "g_params: one per parameter of the piece (then the tied weight's) -> grads[i], "
        "parameter i's sum over the micro-batches so far (None before the first)",
        "none; self.cast(g, self.grad_dtype)",
        "The step's gradient is the sum over its m micro-batches (each weighted 1 / m by the "
        "loss): self.positions[piece] + self.tied_at[piece] are where each goes in grads.",
        [], ["pp"]),
    "loss_average": Exercise(
        "micro_batch_losses_summed", "self.loss_weight = self.scaler.scale / len(micro_batches)",
        1, "the weight of each micro-batch's loss in the step's backward",
        "micro_batches: the step's m micro-batches on this rank -> self.loss_weight, a float",
        "none; self.scaler.scale is the loss scale (1.0 in float32)",
        "The global batch's loss is the mean over its micro-batches, so each micro-batch's "
        "gradient counts 1 / m, times the loss scale that keeps float16 gradients in range.",
        [], ["pp"]),
    "ulysses_all_to_all": Exercise(
        "ulysses_head_split", "return comm.all_to_all(x, 2, 0)", 1,
        "trade this rank's shard of the sequence for a shard of the heads: every rank's tokens "
        "of heads block j go to rank j",
        "x [s/n, b, heads, d] -> [s, b, heads/n, d] (n: the CP size)",
        "comm.all_to_all(x, split_axis, concat_axis): x split in n along split_axis, piece j "
        "sent to rank j, the pieces received concatenated along concat_axis",
        "Split the heads, gather the sequence. The way back (_heads_to_sequence) gives rank j's "
        "heads the j-th contiguous block: the two must agree.",
        [], ["cp_ulysses"]),
    "ring_step": Exercise(
        "ring_causal_case", "half = qh.shape[2] // 2", 8,
        "this rank's two query chunks' partial attention merged with the attention over ring "
        "rank j's K/V block, the causal case chosen by where j is",
        "parts: ((out, lse), (out, lse)) of query chunks r and 2R-1-r, or None at the first "
        "block; qh [b, n, S, d], k, v [b, n, S, d] -> the two merged (out, lse)",
        "none here (RingKernel passes the blocks round); block(q, k, v, bias) -> (out, lse), "
        "merge_partial_attention(a, b), _halves(result, half)",
        "j == rank: this rank's own block, causal (bias); j < rank: both query chunks see the "
        "first half of j's keys (chunk j) unmasked; j > rank: only the second query chunk "
        "(2R-1-r) comes after j's keys, and sees them all.",
        [], ["cp_ring"]),
    "ring_backward": Exercise(
        "ring_grads_not_carried",
        "block, grads = (self.comm.send_recv(k, -1), self.comm.send_recv(v, -1)), None", 14,
        "the ring's backward: each block in hand adds its dQ to this rank's and its dK, dV to "
        "the partial sums that travel with it, passed on to the next rank",
        "query = (qh, do, lse, D); k, v [b, n, S, d] -> dq [b, n, S, d], grads = (dK, dV) "
        "[b, n, S, d] of this rank's own block once the ring has closed",
        "self.comm.send_recv(t, -1): t to the next ring rank, the previous rank's back; "
        "self.block_grads(query, block, j, bias) -> (dq_j, dk_j, dv_j)",
        "A K/V block's gradient is a sum over every rank whose queries met it: it travels with "
        "the block, each rank adding its share, and reaches the owner last (this rank's own "
        "block is the last step's).",
        [], ["cp_ring"]),
    "moe_dispatch_sort": Exercise(
        "ep_chunks_unsorted",
        "tokens = tokens.reshape(-1, self.num_local_experts, capacity, tokens.shape[-1])", 3,
        "what the all-to-all brought, in (source rank, local expert) order, sorted into "
        "(local expert, source rank) order for the experts",
        "tokens [tp*ep * E_l * C, h], slot_probs [tp*ep * E_l * C] -> tokens [E_l, tp*ep*C, h], "
        "slot_probs [E_l, tp*ep, C]",
        "none (the all-to-all ran above); reshape and transpose",
        "Rank s sent its slots expert by expert: block s holds [E_l, C] for this rank's local "
        "experts. Each local expert wants its slots from every source rank together "
        "(Megatron's sort_chunks_by_idxs).",
        ["test_both_dispatchers_give_the_same_layer"], ["ep"]),
    "expert_bias": Exercise(
        "expert_bias_tokens_unsummed",
        "tokens = parallel.collectives(state.tp_dp_cp_group).all_reduce(", 7,
        "each router's expert biases moved by the step's tokens per expert, summed over "
        "TP x DP x CP, and its counts started again",
        "found: the routers; each r.local_tokens_per_expert[0] [E] -> r.expert_bias[0] [E] "
        "moved by rate * sign(mean - tokens), r.tokens_per_expert (numpy) for the log",
        "parallel.collectives(state.tp_dp_cp_group).all_reduce of the stacked counts [L, E]; "
        "ops.assign for the biases and counts",
        "Every rank of the stage must move a bias alike, so the count is the whole batch's; "
        "a busy expert (count above the mean) moves down. DeepSeek-V3, section 2.1.2.",
        ["test_update_expert_bias_moves_each_bias_against_its_load"], ["ep_bias"]),
    "fp16_unscale": Exercise(
        "fp16_grads_left_scaled", "inv_scale = self.scaler.inv_scale", 3,
        "the reduced gradients as float32 main gradients, the loss scale divided out",
        "grads: the reduced gradients (float16 or float32) -> float32 tensors, each its own",
        "none; self.cast(g, F32), self.scaler.inv_scale (1 / the loss scale)",
        "The loss was multiplied by the loss scale so that small float16 gradients survive: "
        "divide before the norm, the clipping and the update see them.",
        [], ["fp16"]),
}
MARK = ".exercise"                   # a copy's record: {"exercise": NAME, "checkout": folder}
# the checkout's files a copy leaves out: history, outputs, caches, what runs generate (data/'s
# tokenized corpora with their sidecars, GPTDataset's indices: made again where needed); .venv
# becomes a link
SKIPPED = {".git", ".venv", "output", "exercises", "__pycache__", ".pytest_cache", "cache"}
SKIPPED_ENDINGS = (".pyc", ".bin", ".idx", ".src.json")
# rough seconds of a check's parts here (2 cores): pytest with the unit tests; for each one-process
# reference a form runs, that reference's run and each of its layouts' (per 2 workers): float16
# runs slowly on this CPU, the experts' runs route and exchange tokens
UNIT_SECONDS = 5
SECONDS = {"one": (8, 9), "one_moe": (14, 17), "one_moe_bias": (16, 18), "one_fp16": (30, 25)}
FORMS = {"op by op": ["--no-jit"], "compiled": []}


def key_lines(name):
    """(file, first line number, the key lines of exercise `name` in the checkout, each with its
    newline); ValueError when its first line is not once in its function."""
    exercise = EXERCISES[name]
    bug = bugs.BUGS[exercise.bug]
    text = open(os.path.join(PROJECT, bug.file)).read()
    node = bugs.function_node(ast.parse(text), bug.function)
    lines = text.splitlines(keepends=True)
    found = [i for i in range(node.lineno - 1, node.end_lineno) if exercise.first in lines[i]]
    if len(found) != 1:
        raise ValueError(f"{bug.file}: {bug.function} holds {exercise.first!r} {len(found)} "
                         "times, not once")
    return bug.file, found[0] + 1, lines[found[0]:found[0] + exercise.count]


def blank(name):
    """The lines that stand for the key lines in the copy: the task in a comment (the shapes,
    the collective, the rule and its paper, how to check), then the raise."""
    exercise = EXERCISES[name]
    _, _, key = key_lines(name)
    indent = key[0][:len(key[0]) - len(key[0].lstrip())]
    said = [f"Exercise {name}: {exercise.task}.", f"In and out: {exercise.shapes}.",
            f"Call: {exercise.collective}.", f"The rule: {bugs.BUGS[exercise.bug].breaks}.",
            f"Check: bash run.sh exercise {name} --check (a hint: --hint; the answer: "
            "--solution)."]
    lines = []
    for text in said:
        lines += textwrap.wrap(text, 99 - len(indent), initial_indent="# ",
                               subsequent_indent="#   ")
    lines.append(f'raise NotImplementedError("exercise {name}: write the lines of the task '
                 'above")')
    return [f"{indent}{line}\n" for line in lines]


def blanked(name):
    """(file, the text of the exercise's file in the copy: its key lines replaced by blank)."""
    file, first, key = key_lines(name)
    lines = open(os.path.join(PROJECT, file)).read().splitlines(keepends=True)
    return file, "".join(lines[:first - 1] + blank(name) + lines[first - 1 + len(key):])


def catalogue():
    """The lines of `exercise list`: each exercise's name, concept, place and check's time, and
    under it its task."""
    lines = []
    for name, exercise in EXERCISES.items():
        bug = bugs.BUGS[exercise.bug]
        file, first, _ = key_lines(name)
        place = f"{file}:{first}, {bug.function}"
        lines.append(f"{name:<19} {bug.concept:<9} {place:<55} check ~{check_seconds(name)} s")
        lines += textwrap.wrap(exercise.task, 99, initial_indent="    ",
                               subsequent_indent="    ")
    return lines


def check_seconds(name):
    """A check's rough time (SECONDS): the unit tests, then each form's references and layouts."""
    exercise = EXERCISES[name]
    layouts = [tour.LAYOUTS[layout] for layout in exercise.layouts]
    form = (sum(SECONDS[reference][0] for reference in {lay.reference for lay in layouts})
            + sum(SECONDS[lay.reference][1] * lay.workers // 2 for lay in layouts))
    return (UNIT_SECONDS if exercise.units else 0) + len(FORMS) * form


def solution(name):
    """The lines of `--solution`: where the key lines are, then the lines themselves."""
    file, first, key = key_lines(name)
    return [f"{file}:{first}-{first + len(key) - 1}, in {bugs.BUGS[EXERCISES[name].bug].function}:",
            *(line.rstrip("\n") for line in key)]


# ----------------------------------------------------------------------------- the copy
def make_copy(name, folder):
    """The learner's copy of the project in `folder` (a new folder): the checkout's files but the
    skipped ones, the exercise's file blanked, .venv linked to the checkout's, MARK written; made
    in a sibling folder first and renamed, so that nothing half-made is left."""
    partial = f"{folder}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        shutil.copytree(PROJECT, partial, ignore=lambda _, names: skipped(names))
        file, text = blanked(name)
        with open(os.path.join(partial, file), "w") as f:
            f.write(text)
        if os.path.isdir(os.path.join(PROJECT, ".venv")):
            os.symlink(os.path.join(PROJECT, ".venv"), os.path.join(partial, ".venv"))
        with open(os.path.join(partial, MARK), "w") as f:
            json.dump({"exercise": name, "checkout": PROJECT}, f)
        os.rename(partial, folder)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def skipped(names):
    """Of a folder's entries `names`, those a copy leaves out (SKIPPED, SKIPPED_ENDINGS, a
    rank's folder of MindSpore's files, rank_*, and a file being written: data's temporary
    files, NAME.tmp<pid>.<random>)."""
    return [n for n in names if n in SKIPPED or n.endswith(SKIPPED_ENDINGS)
            or n.startswith("rank_") or ".tmp" in n]


def copy_of(name, folder):
    """The checkout a copy of exercise `name` in `folder` was made from; ConfigError, naming the
    fix, when `folder` is not one."""
    path = os.path.join(folder, MARK)
    try:
        mark = json.loads(open(path).read())
    except (OSError, ValueError):                     # no record, or not JSON (UTF-8 included)
        raise ConfigError(f"exercise {name}: {folder} is not an exercise's copy: make one with "
                          f"bash run.sh exercise {name}") from None
    checkout = mark.get("checkout") if isinstance(mark, dict) else None
    if not isinstance(checkout, str) or not os.path.isfile(os.path.join(checkout, "run.sh")):
        raise ConfigError(f"exercise {name}: {path} names no checkout with a run.sh: make a new "
                          f"copy with bash run.sh exercise {name}")
    if mark.get("exercise") != name:
        raise ConfigError(f"exercise {name}: {folder} is the copy of exercise "
                          f"{mark.get('exercise')}: check it with bash run.sh exercise "
                          f"{mark.get('exercise')} --check {folder}")
    return checkout


# ----------------------------------------------------------------------------- the check
# a proof's outcome: its name, "pass", "FAIL" or "-" (not run), what it says, and the hint drawn
# from what differed ("" when it passed)
Proof = namedtuple("Proof", "name verdict said hint")


def unit_proofs(name, folder):
    """The exercise's unit tests run by pytest in the copy: one Proof each (from pytest's
    junit report: a parametrized test passes when each of its cases does)."""
    exercise = EXERCISES[name]
    report_file = os.path.join(folder, "output", "exercise_check", "units.xml")
    os.makedirs(os.path.dirname(report_file), exist_ok=True)
    if os.path.exists(report_file):                   # an earlier check's
        os.remove(report_file)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--junitxml={report_file}",
                           *(f"test_all.py::{test}" for test in exercise.units)],
                          cwd=folder, capture_output=True, text=True)
    cases = (ElementTree.parse(report_file).getroot().iter("testcase")
             if os.path.exists(report_file) else [])
    # a case's <failure> or <error>, None when it passed (an Element with no children is false)
    outcomes = [(case.get("name").split("[")[0],
                 next((e for e in (case.find("failure"), case.find("error")) if e is not None),
                      None)) for case in cases]
    proofs = []
    for test in exercise.units:
        mine = [problem for found, problem in outcomes if found == test]
        failed = [problem for problem in mine if problem is not None]
        if mine and not failed:
            proofs.append(Proof(f"unit {test}", "pass", "", ""))
            continue
        said = (failed[0].get("message", "").splitlines() or [""])[0] if failed else (
            f"pytest did not run it: {(done.stdout.strip().splitlines() or [''])[-1]}")
        hint = (f"the test's assertion compares your function's result with the rule's, "
                f"written out: read test_all.py's {test}")
        if "NotImplementedError" in said or "deadlocks" in said:
            hint = hint_of_error(name, said)
        proofs.append(Proof(f"unit {test}", "FAIL", said[:300], hint))
    return proofs


def layout_proofs(name, folder, form, output):
    """The exercise's layouts in `form` (FORMS) beside one process, the learner's function
    planted in their workers: one Proof each (the tour stops at the first that fails; the
    rest are not run)."""
    exercise = EXERCISES[name]
    bug = bugs.BUGS[exercise.bug]
    plant = f"{folder}::{bug.file}::{bug.function}"
    runs = [tour.Run(layout, layout, plant) for layout in exercise.layouts]
    tour.tour(runs, output, FORMS[form])
    proofs = []
    for layout in exercise.layouts:
        proof = f"{form} {layout}"
        if proofs and proofs[-1].verdict != "pass":
            proofs.append(Proof(proof, "-", "not run: a proof before it failed", ""))
            continue
        proofs.append(layout_outcome(name, proof, os.path.join(output, layout),
                                     tour.LAYOUTS[layout], output))
    return proofs


def layout_outcome(name, proof, folder, layout, output):
    """The Proof of one layout's run in `folder` beside its reference in `output`."""
    reference = os.path.join(output, layout.reference)
    if not os.path.exists(os.path.join(reference, "tour_done.0")):
        return Proof(proof, "FAIL", f"one process did not finish: see {reference}/log", "")
    finished = all(os.path.exists(os.path.join(folder, f"tour_done.{rank}"))
                   for rank in range(layout.workers))
    if not finished:
        error = tour.error_of(folder, layout.workers).lstrip(": ")
        return Proof(proof, "FAIL", f"did not finish: {error or 'see its log'}",
                     hint_of_error(name, error))
    said = tour.verdict(tour.differences(folder, reference), tour.RTOL[layout.reference])
    if said == "equal":
        return Proof(proof, "pass", f"{layout.title}: equal to one process", "")
    return Proof(proof, "FAIL", f"{layout.title}: {said}",
                 hint_of_difference(folder, reference, tour.RTOL[layout.reference]))


def hint_of_error(name, error):
    """The hint for a proof that stopped on `error` (its last line)."""
    file, first, _ = key_lines(name)
    if "NotImplementedError" in error:
        return (f"the blank still raises: write your lines in place of the raise ({file}, "
                f"near line {first})")
    if "deadlocks" in error:
        return ("the schedule deadlocks (pipeline.simulate plays every rank's passes before any "
                "tensor moves and names who waits for what): a stage waits for a gradient "
                "before it has sent the forwards that gradient needs")
    return "the function raised: its error above, the whole traceback in the run's log"


def hint_of_difference(folder, reference, rtol):
    """The hint for a run that finished but differs from one process: the first step that
    differs, whether the loss does, the gradient norm's ratio."""
    run, one = tour.train_records(folder), tour.train_records(reference)
    for step, (mine, its) in enumerate(zip(run, one), 1):
        loss = abs(mine["loss"] - its["loss"]) > rtol["loss"] * abs(its["loss"])
        ratio = mine["grad_norm"] / its["grad_norm"]
        if loss and step == 1:
            return ("the loss differs from the first step: the forward does not compute what "
                    "one process does (which tokens, heads or experts meet; a sum left partial)")
        if loss:
            return (f"the first {step - 1} step(s) equal one process, step {step}'s loss "
                    "differs: what a step leaves for the next (the update, a state kept "
                    "between steps) is off")
        if abs(ratio - 1) > rtol["grad norm"]:
            return (f"step {step}'s loss is one process's but its gradient norm is {ratio:.4g} "
                    "times one process's: the forward is right and the gradients are not: a "
                    "constant factor (a sum where a mean belongs, or the reverse), a sum "
                    "missing, or one over the wrong ranks")
    return "the runs differ in a way the steps do not show: compare their metrics.jsonl"


def check(name, folder):
    """`--check`: every proof of exercise `name` on the copy in `folder`, printed as it ends;
    the first failure ends the check: 0 when every proof passes, else 1."""
    started = time.time()
    bug = bugs.BUGS[EXERCISES[name].bug]
    print(f"exercise {name}: the proofs of {bug.function} ({bug.file}) as written in "
          f"{tour.shown(folder)}", flush=True)
    proofs = parse_proofs(name, folder)
    if not proofs and EXERCISES[name].units:
        proofs = unit_proofs(name, folder)
    report(proofs)
    for form in FORMS:
        if any(proof.verdict != "pass" for proof in proofs):
            break
        output = os.path.join(folder, "output", "exercise_check", form.replace(" ", "_"))
        print(f"exercise {name}: {form}: {', '.join(EXERCISES[name].layouts)} beside one "
              "process", flush=True)
        found = layout_proofs(name, folder, form, output)
        report(found)
        proofs += found
    failed = [proof for proof in proofs if proof.verdict == "FAIL"]
    if failed:
        if failed[0].hint:
            print(f"hint: {failed[0].hint}", flush=True)
        print(f"exercise {name}: {failed[0].name} fails (a second hint: bash run.sh exercise "
              f"{name} --hint)")
        return 1
    seconds = round(time.time() - started)
    print(f"exercise {name}: every proof passes ({len(proofs)}, in {seconds} s): your lines do "
          "what one process does")
    return 0


def parse_proofs(name, folder):
    """[] when the learner's file parses and holds the function, else its failed Proof."""
    bug = bugs.BUGS[EXERCISES[name].bug]
    path = os.path.join(folder, bug.file)
    try:
        bugs.function_node(ast.parse(open(path).read(), path), bug.function)
    except SyntaxError as e:
        return [Proof("parse", "FAIL", f"{bug.file}:{e.lineno}: {e.msg}", "fix the syntax")]
    except ValueError as e:                   # not UTF-8, or a null byte (Python 3.11's ast)
        return [Proof("parse", "FAIL", f"{bug.file}: {e}", "save it as UTF-8 text")]
    except (OSError, StopIteration):
        return [Proof("parse", "FAIL", f"{bug.file} has no {bug.function}",
                      f"the function {bug.function} must stay in {bug.file}")]
    return []


def report(proofs):
    """A line per proof: pass, FAIL or - (not run), its name, what it says."""
    for proof in proofs:
        print(f"  {proof.verdict:<4}  {proof.name:<30} {proof.said}", flush=True)


# ----------------------------------------------------------------------------- bash run.sh exercise
EXERCISE_FLAGS = {"--dir": (None, str, "the copy's folder (default exercises/NAME; --check: "
                            "this folder when it is the copy)"),
                  "--check": (False, bool, "run the proofs on the learner's lines in the copy "
                              "(`--check DIR`: the copy in DIR)"),
                  "--hint": (False, bool, "a second hint"),
                  "--solution": (False, bool, "the project's own lines")}


def parse(argv):
    """(NAME or "list", the options of `bash run.sh exercise`): `--check DIR` is --check --dir
    DIR; an unknown exercise is a ConfigError naming them all."""
    argv = list(argv)
    if "--check" in argv:
        at = argv.index("--check") + 1
        if at < len(argv) and not argv[at].startswith("-"):
            argv[at:at] = ["--dir"]
    options, _ = parse_command("exercise", argv, EXERCISE_FLAGS, positional=("NAME",),
                               about="Learn by writing: a concept's key lines blanked in a copy, "
                                     "the proofs grade yours (`exercise list`: the exercises).")
    name = options["name"]
    if name != "list" and name not in EXERCISES:
        raise ConfigError(f"exercise {name}: choose from list, {', '.join(EXERCISES)}")
    if sum(bool(options[key]) for key in ("check", "hint", "solution")) > 1:
        raise ConfigError("exercise: one of --check, --hint, --solution at a time")
    return name, options


@answered
def main(argv):
    """bash run.sh exercise: see the module docstring."""
    name, options = parse(argv)
    if name == "list":
        print("\n".join(catalogue()))
        return 0
    if options["hint"]:
        print("\n".join(textwrap.wrap(EXERCISES[name].hint, 99)))
        return 0
    if options["solution"]:
        print("\n".join(solution(name)))
        return 0
    return checked(name, options["dir"]) if options["check"] else made(name, options["dir"])


def made(name, folder):
    """`exercise NAME [--dir DIR]`: the copy made, where it is and what to do next."""
    if os.path.exists(os.path.join(PROJECT, MARK)):
        raise ConfigError(f"exercise {name}: this folder is an exercise's copy: make a new one "
                          "from the checkout it came from")
    folder = os.path.abspath(folder or os.path.join(PROJECT, "exercises", name))
    if os.path.exists(folder):
        raise ConfigError(f"exercise {name}: {folder} exists: check it (bash run.sh exercise "
                          f"{name} --check {folder}) or remove it")
    make_copy(name, folder)
    file, first, _ = key_lines(name)
    print(f"exercise {name}: your task is at {tour.shown(folder)}/{file}, line {first}")
    print(f"then: bash run.sh exercise {name} --check {tour.shown(folder)}")
    return 0


def checked(name, folder):
    """`exercise NAME --check [DIR]`, run from the checkout the copy came from (its one-process
    references run the checkout's code): 0 when every proof passes, 1 when one fails."""
    here = os.path.exists(os.path.join(PROJECT, MARK))
    folder = os.path.abspath(folder or (PROJECT if here else os.path.join(PROJECT, "exercises",
                                                                          name)))
    checkout = copy_of(name, folder)
    if os.path.abspath(checkout) != PROJECT:
        return subprocess.run(["bash", os.path.join(checkout, "run.sh"), "exercise", name,
                               "--check", folder]).returncode
    return check(name, folder)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
