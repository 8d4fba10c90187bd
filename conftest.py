"""The msrun harness of test_all.py: pytest loads this file beside it.

The work that needs msrun workers, as jobs (JOBS): checks run on every rank of a launch, trainings
of layouts beside one process, resumes, conversions, planted bugs, and calls that launch run.sh
themselves. test_all.py registers its jobs in its concept sections as it is imported (add,
layout, resumed, converted); a test names the jobs it reads with a `reads` mark (reads, reading).
The session's Harness runs the jobs its selected tests read in background threads (the `runs`
fixture), so the one-process tests run while the workers train; the tests that wait for the
workers run after all the others (pytest_collection_modifyitems). On the workers test_all.py is
the program (`python test_all.py JOBS.json`: its import registers the jobs, then run_jobs runs
them). This file imports nothing of test_all.py: test_all.py imports this one.
"""
import concurrent.futures
import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import traceback

import numpy as np
import pytest
from mindspore import Tensor

import data
import parallel
import train
from instruments import flight_recorder
from settings import cli
from tools import bugs

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAM = os.path.join(HERE, "test_all.py")      # the workers' program: its import registers jobs


# ========================================================================================= the jobs
# The tiny GPT every training job trains (2 layers, hidden 64, sequences of 32 bytes, 8 per step),
# op by op: its steps cost less than a compilation, and the proofs are about arithmetic. One
# layout per concept compiles (test_all.py's COMPILED), as production does.
STEPS = 4
PARALLEL_RUN = ["--tokenizer-type", "ByteTokenizer", "--num-layers", "2", "--hidden-size", "64",
                "--ffn-hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "32",
                "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", str(STEPS),
                "--log-interval", "1", "--eval-iters", "0", "--lr", "1e-3",
                "--lr-warmup-iters", "2", "training_config.log_comm_ledger=true", "--no-jit"]
HELD = flight_recorder.STALL + 3     # Job.hold: how late a rank is, its peers idle past STALL
_BYTES, _BYTES_LOCK = {}, threading.Lock()


def byte_tokenized(tmp_path, name, text):
    """The shipped text data/`text` preprocessed with the byte tokenizer to the prefix `name`
    (once per session: the harness's threads and the tests ask at once, and one of them
    tokenizes it)."""
    with _BYTES_LOCK:
        if name in _BYTES:
            return _BYTES[name]
        folder = tmp_path.parent / "bytes"
        folder.mkdir(exist_ok=True)
        _BYTES[name] = data.ensure_preprocessed(os.path.join(HERE, "data", text),
                                                str(folder / name), "ByteTokenizer")
        return _BYTES[name]


def shakespeare_bytes(tmp_path):
    """The shipped corpus preprocessed with the byte tokenizer (once per session)."""
    return byte_tokenized(tmp_path, "shakespeare", "tinyshakespeare.txt")


def mixture_flags(tmp_path):
    """--data-path 0.6 of the shipped corpus and 0.4 of the shipped Alice text, both
    byte-tokenized (once per session): a blend as Megatron-core builds it."""
    return ["--data-path", "0.6", shakespeare_bytes(tmp_path), "0.4",
            byte_tokenized(tmp_path, "alice", "alice_in_wonderland.txt")]


class Job:
    """A unit of the harness's background work, run once per session if a selected test reads it
    (its `reads` mark) or a job it reads needs it (`after`): a training (`flags` after
    PARALLEL_RUN, or a whole train.py argv from `argv(tmp, prefix)`), a check job (`check`:
    (function, argument), function(Checks, argument) on every rank), or a call in the background
    thread (`call(harness)`, for tests that launch run.sh themselves). `workers`: 1, a one-process
    run; 2 or 4, the msrun launch of that many workers (the jobs of a launch run one after another
    on every worker); 0, a call. `concepts`: the pytest marks (pytest.ini) of the tests that may
    read it. `plant`: a function returning the patches of a bug planted for the run (planted);
    `fails`: the training must fail (a planted deadlock; its failure is the job's verdict, not
    its launch's); `sigterm`: the step during which rank 0 alone gets SIGTERM; `hold`: the step
    rank 1 starts HELD seconds late, its peers waiting in their collectives; `busy`: how many
    CPU-bound processes rank 0 runs beside the training (busy_beside); `beside`: a call run
    in a thread of its kind beside the rest: "forked", the forked runs of one-process tests;
    "launch", a launch whose processes take little of the CPU (idle in a collective, asleep,
    failing at load, killed as they start, or a few steps of a tiny model on one worker a
    launch); "restart", "restart_one", "restart_faults" and "restart_compiled", the run.sh jobs
    killed and launched again (four lists, side by side); "exercise", an exercise's checks (the
    tour's layouts of a tiny model, with the learner's function)."""

    def __init__(self, name, workers, concepts, flags=(), argv=None, after=(), plant=None,
                 sigterm=None, hold=None, busy=0, call=None, check=None, beside=None,
                 fails=False):
        self.name, self.workers, self.concepts = name, workers, set(concepts.split())
        self.flags, self.argv_of, self.after = list(flags), argv, tuple(after)
        self.plant, self.sigterm, self.call, self.check = plant, sigterm, call, check
        self.hold, self.busy, self.fails = hold, busy, fails
        self.beside = beside

    def argv(self, tmp, prefix):
        """train.py's argv in the harness's folder `tmp` ("{tmp}" in a flag) on data `prefix`."""
        if self.argv_of is not None:
            return self.argv_of(tmp, prefix)
        alice = mixture_flags(tmp)[-1] if "{alice}" in self.flags else None
        flags = [flag.replace("{tmp}", str(tmp)).replace("{data}", prefix)
                 .replace("{alice}", str(alice)) for flag in self.flags]
        return ["--config", os.path.join(HERE, "config.yaml"), "--data-path", prefix,
                *PARALLEL_RUN, *flags, "--save", str(tmp / self.name)]


JOBS = {}          # name -> Job, in an order where every job comes after the jobs it needs
REFERENCE = {}     # a layout -> the one-process run it equals (float16 against float16)


def add(name, workers, concepts, flags=(), **kwargs):
    """A job (Job's arguments), after the jobs it needs: the sections of test_all.py register
    theirs in the file's order, and a launch runs its jobs in JOBS' order."""
    job = Job(name, workers, concepts, flags, **kwargs)
    missing = [n for n in job.after if n not in JOBS]
    assert not missing, f"job {name} needs {missing}: register them before it"
    JOBS[name] = job


def layout(name, workers, concepts, flags, reference, **kwargs):
    """A layout trained beside its one-process reference."""
    add(name, workers, concepts, flags, **kwargs)
    REFERENCE[name] = reference


def resumed(name, workers, concepts, flags, source, step=STEPS // 2):
    """A run that resumes from step `step` of the checkpoints of job `source`."""
    add(name, workers, concepts, [*flags, "--load", "{tmp}/" + source, "--ckpt-step", str(step)],
        after=[source])


def converted(name, concepts, source, layout_flags, step=STEPS // 2):
    """`bash run.sh convert` of step `step` of job `source` to another layout (one process)."""
    add(name, 1, concepts, after=[source],
        argv=lambda tmp, prefix: ["convert", "--load", str(tmp / source), "--save",
                                  str(tmp / name), "--ckpt-step", str(step), *layout_flags])


# ======================================================================================= the checks
ATOL = 1e-6


class Checks:
    """Prints one line per check, `[rank R] PASS job/family: name` (or FAIL, with the detail), and
    remembers the failures; `family` is set by the caller before each group of checks."""

    def __init__(self, rank, job):
        self.rank, self.job, self.failed, self.family = rank, job, [], "setup"

    def __call__(self, name, ok, detail=""):
        print(f"[rank {self.rank}] {'PASS' if ok else 'FAIL'} {self.job}/{self.family}: {name}"
              + (f": {detail}" if detail and not ok else ""), flush=True)
        if not ok:
            self.failed.append(name)

    def close(self, name, got, want):
        got = got.asnumpy() if isinstance(got, Tensor) else np.asarray(got)
        if got.shape != want.shape:
            return self(name, False, f"shape {got.shape} != {want.shape}")
        err = float(np.abs(got - want).max()) if got.size else 0.0
        return self(name, err <= ATOL, f"max abs error {err:.2e}")


def check_lines(harness, job):
    """Every rank's lines (Checks) of check job `job`: [rank][line]."""
    harness.folder(job)
    label, workers = harness.launch_of[job], JOBS[job].workers
    return [[line for line in (harness.tmp / f"msrun{label}" / f"worker_{r}.log").read_text()
             .splitlines() if line.startswith(f"[rank {r}] ") and f" {job}/" in line]
            for r in range(workers)]


# =============================================================================== the worker program
def run_jobs(jobs_file):
    """The worker program (`python test_all.py JOBS.json`, on every msrun worker or in one
    process): each job of the file, one after another; each writes `ok` or `failed` to
    <status>/<name>.<rank>. Returns how many did not end as they must (Job.fails). msrun's
    scheduler runs this program too and writes nothing: its init() returns only when the
    cluster ends (raising when a worker ended with an error)."""
    rank = int(os.environ.get("RANK_ID", "0"))
    specs = json.loads(open(jobs_file).read())
    if os.environ.get("MS_ROLE") == "MS_SCHED":
        cluster_formed(rank)
        return 0
    if not cluster_formed(rank):
        for spec in specs:
            pathlib.Path(spec["status"], f"{spec['name']}.{rank}").write_text("failed")
        return len(specs)
    failed = 0
    for spec in specs:
        started, cpu = time.time(), time.process_time()
        try:
            ok = run_job(spec, rank)
        except Exception:                          # the next job still runs; the log has it
            traceback.print_exc()
            ok = False
        expected = JOBS[spec["name"]].fails
        failed += ok == expected
        pathlib.Path(spec["status"], f"{spec['name']}.{rank}").write_text("ok" if ok else "failed")
        said = "ok" if ok else ("failed, as it must" if expected else "FAILED")
        print(f"[rank {rank}] job {spec['name']}: {said} in "
              f"{time.time() - started:.1f} s, {time.process_time() - cpu:.1f} CPU-s", flush=True)
    return failed


def cluster_formed(rank):
    """Whether this process joined msrun's cluster (at once when alone), before its first job: a
    rank that gave up waiting for a late peer and ran on would run its jobs out of step with the
    peer's (probed: a second init() then joins), so its launch fails here, every job at once."""
    started = time.time()
    try:
        parallel.world()
    except Exception:
        traceback.print_exc()
        print(f"[rank {rank}] the cluster did not form in {time.time() - started:.0f} s: "
              "no job runs", flush=True)
        return False
    print(f"[rank {rank}] the cluster formed in {time.time() - started:.1f} s", flush=True)
    return True


def run_job(spec, rank):
    """One job of run_jobs (JOBS[name], registered as the program imported test_all.py): its
    checks, or its training (`argv`) with its bug planted, its SIGTERM, its held rank and the
    busy processes beside it."""
    job = JOBS[spec["name"]]
    if job.check:
        function, argument = job.check
        checks = Checks(rank, job.name)
        function(checks, argument)
        return not checks.failed
    step = train.Trainer.train_step
    train.Trainer.train_step = step_of(job, rank, step)
    busy = job.busy if rank == 0 else 0
    record = pathlib.Path(spec["status"], f"{job.name}.busy")
    try:
        with planted(job.plant), busy_beside(busy, record):
            return train.main(spec["argv"]) == 0
    finally:
        train.Trainer.train_step = step


# A CPU-bound loop that ends with the process that started it (a worker killed leaves none)
BUSY_LOOP = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass"


@contextlib.contextmanager
def busy_beside(count, record):
    """`count` CPU-bound processes (BUSY_LOOP, at this worker's priority) for the block's
    duration; the file `record` then holds each one's [seconds of the block, CPU-seconds it got]
    (Harness.busy)."""
    if not count:
        yield
        return
    started = time.monotonic()
    loops = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(count)]
    try:
        yield
    finally:
        seconds = time.monotonic() - started
        used = [cpu_seconds(loop.pid) for loop in loops]
        for loop in loops:
            loop.kill()
            loop.wait()
        record.write_text(json.dumps([[seconds, cpu] for cpu in used]))


def cpu_seconds(pid):
    """The user and system CPU-seconds process `pid` has used (/proc/<pid>/stat's utime, stime:
    the fields 14 and 15, counted after the command's closing parenthesis)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def step_of(job, rank, step):
    """Trainer.train_step for this rank of `job`: `step`, with SIGTERM to rank 0 alone during step
    `sigterm`, or rank 1 asleep HELD s before step `hold`."""
    sigterm = job.sigterm if rank == 0 else None
    hold = job.hold if rank == 1 else None
    if not (sigterm or hold):
        return step

    def train_step(self, micro_batches, calls=[]):
        calls.append(1)
        if len(calls) == sigterm:
            signal.raise_signal(signal.SIGTERM)
        if len(calls) == hold:
            time.sleep(HELD)
        return step(self, micro_batches)
    return train_step


def planted(plant):
    """The bug `plant()` returns (its patches: owner, attribute, replacement) in the code for the
    duration of the block (none for None): tools/bugs.planted."""
    return bugs.planted(plant() if plant else [])


# ====================================================================================== the session
def needed_jobs(names):
    """`names` and every job they need (Job.after), in JOBS' order."""
    wanted, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted.add(name)
            todo += JOBS[name].after
    return [name for name in JOBS if name in wanted]


def needs(job, group):
    """Whether `job` needs (through Job.after) a job of `group`."""
    names = {g.name for g in group}
    return any(n in names for n in needed_jobs(job.after))


def needed_by(candidates, group):
    """The candidates a job of `group` needs."""
    needed = {n for job in group for n in needed_jobs(job.after)}
    return [j for j in candidates if j.name in needed]


def jobs_read(items):
    """The jobs the test items read (their `reads` marks)."""
    return {name for item in items for mark in item.iter_markers("reads") for name in mark.args}


# The harness's threads, and what they start, at a lower priority than the pytest process: its
# own tests are the session's longest stream of work, and once they end the launches left
# (2 workers) take both cores
HARNESS_NICE = 10


def background_priority():
    """The calling thread (Linux keeps a nice value per thread) and the processes it starts from
    now on: HARNESS_NICE."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), HARNESS_NICE)


class Harness:
    """The session's background work: the jobs its selected tests read, and the jobs they need,
    run in a background thread as the session starts, so that the one-process tests run while the
    workers train. Two msrun jobs that compute at once starve each other's collectives on 2
    cores, so the thread runs them in turn, one launch per worker count:
      1. the one-process jobs the launch of 4 workers and the calls need (the runs they
         convert, the conversions), one process;
      2. the calls that need no launch (the tour, which launches run.sh itself), beside the
         one-process jobs that need no launch: a call waits for msrun's start and end, which
         those and the one-process tests fill;
      3. the launch of 4 workers (its ranks wait in collectives for each other, for longer the
         more processes share the 2 cores);
      4. the one-process jobs the launch of 2 workers needs from the first (conversions);
      5. the launch of 2 workers, beside the remaining one-process jobs;
      6. the calls that need a launch's jobs.
    A launch runs test_all.py on its workers (run_jobs), its check jobs first, before any
    training; a selection with no job of a step skips it, so `-m pipeline` launches only pipeline
    runs. Seven more threads run the other calls (Job.beside) beside all this, each its kind in
    turn: the forked runs of one-process tests, the launches that take little of the CPU (the
    planted faults, a launch that fails at load, a killed worker, the guide's script, a run
    killed twice as it starts), the run.sh jobs killed and launched again (four threads:
    call_restarts, call_restart_one, call_restart_faults and call_restart_compiled), and an
    exercise's checks (call_exercise: three short launches of a tiny model), each msrun job on
    its own scheduler port. All of it yields the CPU to the one-process tests
    (HARNESS_NICE)."""

    def __init__(self, tmp, names):
        self.tmp, self.names = tmp, needed_jobs(names)
        self.status = tmp / "status"
        self.status.mkdir()
        self.prefix = shakespeare_bytes(tmp) if self.names else None
        self.done = {name: threading.Event() for name in self.names}
        self.launches, self.launch_of, self.results = {}, {}, {}
        self.seconds = {}                  # a launch or call -> its wall time, for the summary
        self.processes, self.stopped = set(), False
        self.threads = [threading.Thread(target=self._run_all, daemon=True)] + [
            threading.Thread(target=self._run_calls_beside, args=(kind,), daemon=True)
            for kind in ("forked", "launch", "restart", "restart_one", "restart_faults",
                         "restart_compiled", "exercise")]
        for thread in self.threads:
            thread.start()

    def steps(self):
        """The plan above: [(one-process jobs, launch workers or None, its jobs, calls)]."""
        jobs = [JOBS[n] for n in self.names]
        four, two = ([j for j in jobs if j.workers == w and j.check]
                     + [j for j in jobs if j.workers == w and not j.check] for w in (4, 2))
        ones = [j for j in jobs if j.workers == 1]
        calls = [j for j in jobs if j.workers == 0 and not j.beside]
        after_four = [j for j in ones if needs(j, four)]
        before_four = [j for j in needed_by(ones, four + calls) if j not in after_four]
        before_two = needed_by(after_four, two)
        beside_four = [j for j in ones if j not in before_four + after_four]
        beside_two = [j for j in after_four if j not in before_two]
        late = [j for j in calls if needs(j, four + two + after_four)]
        assert not any(needs(j, two) for j in ones + four), "a job needs a later launch"
        return [(before_four, None, [], []),
                (beside_four, None, [], [j for j in calls if j not in late]),
                ([], 4, four, []), (before_two, None, [], []), (beside_two, 2, two, []),
                ([], None, [], late)]

    def _run_all(self):
        background_priority()
        for ones, workers, launched, calls in self.steps():
            with concurrent.futures.ThreadPoolExecutor(
                    1, initializer=background_priority) as beside:
                side = beside.submit(self._launch, ones, None) if ones else None
                if launched:
                    self._launch(launched, workers)
                for job in calls:
                    self._call(job)
                if side is not None:
                    side.result()

    def _run_calls_beside(self, kind):
        """A thread of the calls beside the rest (Job.beside) of `kind`, in turn, each once the
        jobs it needs have ended."""
        background_priority()
        for job in (JOBS[n] for n in self.names):
            if job.beside == kind:
                for name in job.after:
                    self.done[name].wait()
                self._call(job)

    def _call(self, job):
        """Runs the call `job` (its result or error kept for the test that asks)."""
        if not self.stopped:
            start = time.monotonic()
            try:
                self.results[job.name] = job.call(self)
            except Exception as error:                   # raised again in the test that asks
                self.results[job.name] = error
            self.seconds[job.name] = time.monotonic() - start
        self.done[job.name].set()

    def _launch(self, jobs, workers):
        """`jobs` in one process (`workers` None) or one msrun launch; their events set after."""
        label = f"{workers}w" if workers else f"one_{jobs[0].name}"
        specs = [{"name": j.name, "status": str(self.status),
                  **({} if j.check else {"argv": j.argv(self.tmp, self.prefix)})} for j in jobs]
        jobs_file = self.tmp / f"{label}.json"
        jobs_file.write_text(json.dumps(specs))
        program = [PROGRAM, str(jobs_file)]
        if workers:
            cmd, env = cli.msrun_command(workers, str(self.tmp / f"msrun{label}"), program)
        else:
            cmd, env = [sys.executable, *program], None
        start = time.monotonic()
        try:
            self.launches[label] = self.run(cmd, env, self.tmp / f"{label}.console")
        except Exception as error:
            self.launches[label] = error
        self.seconds[label] = time.monotonic() - start
        for job in jobs:
            self.launch_of[job.name] = label
            self.done[job.name].set()

    def run(self, cmd, env, console, timeout=1500):
        """`cmd` in its own process group (so that stop() kills msrun's workers too), its output
        to the file `console`; returns its exit code."""
        if self.stopped:
            raise RuntimeError("the session ended")
        with open(console, "w") as out:
            process = subprocess.Popen(cmd, cwd=HERE, env=env, stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True)
            self.processes.add(process)
            process.wait(timeout=timeout)
        self.processes.discard(process)
        return process.returncode

    def folder(self, name, status="ok"):
        """Job `name`'s folder once it has ended, every one of its processes having said `status`
        (`ok`, or `failed` for a job that must fail; otherwise the test fails here, with its
        launch's log)."""
        self.done[name].wait()
        workers = max(JOBS[name].workers, 1)
        said = [self.status / f"{name}.{rank}" for rank in range(workers)]
        if not all(p.exists() and p.read_text() == status for p in said):
            pytest.fail(f"job {name} did not end {status} on every rank: {self.log_tail(name)}")
        return self.tmp / name

    def busy(self, name):
        """[seconds, CPU-seconds] of each busy process beside job `name` (Job.busy), once it ended
        ok."""
        self.folder(name)
        return json.loads((self.status / f"{name}.busy").read_text())

    def log_tail(self, name, chars=3000):
        """The end of the log of job `name`'s launch (its first worker's, or the process's)."""
        label = self.launch_of.get(name)
        if isinstance(self.launches.get(label), Exception):
            return repr(self.launches[label])
        worker = self.tmp / f"msrun{label}" / "worker_0.log"
        console = self.tmp / f"{label}.console"
        log = worker if worker.exists() else console
        return log.read_text()[-chars:] if log.exists() else f"no log of {label}"

    def result(self, name):
        """What the call `name` returned, once it has run (its error is raised here)."""
        self.done[name].wait()
        if isinstance(self.results.get(name), Exception):
            raise self.results[name]
        return self.results[name]

    def wait(self):
        """Until every job of the session has ended."""
        for event in self.done.values():
            event.wait()

    def stop(self):
        """At the end of the session: a launch still running (the session stopped early) is
        killed with its workers."""
        self.stopped = True
        for process in list(self.processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        for thread in self.threads:
            thread.join()

    def summary(self):
        """One line: each launch's and call's wall time in the order they ran (`2w` the launch
        of 2 workers, `one_<job>` a one-process launch beside the others)."""
        return "msrun harness (s): " + ", ".join(f"{label} {seconds:.0f}"
                                                 for label, seconds in self.seconds.items())


@pytest.fixture(scope="session", autouse=True)
def runs(request, tmp_path_factory):
    """The session's Harness: the jobs the selected tests read, started at once in the
    background (so `-m pipeline` starts only pipeline runs, `-k column` the TP checks)."""
    harness = Harness(tmp_path_factory.mktemp("runs"), jobs_read(request.session.items))
    yield harness
    harness.stop()
    if harness.seconds:                        # what each launch cost, beside pytest's durations
        with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
            request.config.get_terminal_writer().line("\n" + harness.summary())


def reads(*names, concepts=None):
    """The marks of a test (or a parameter) that reads jobs `names`: `reads` and its concepts
    (given, or those every job read shares)."""
    if concepts is None:
        concepts = set.intersection(*(JOBS[n].concepts for n in names))
    return [pytest.mark.reads(*names), *(getattr(pytest.mark, c) for c in sorted(concepts))]


def reading(*names, concepts=None):
    """A test's decorator: the marks of reads(*names, concepts=concepts)."""
    def decorate(test):
        for mark in reads(*names, concepts=concepts):
            test = mark(test)
        return test
    return decorate


def waits_for_workers(item):
    """Whether a test reads a job of the workers: a `reads` mark naming a job other than the runs
    forked for one-process tests (Job.beside "forked"), or naming none (it waits for them all)."""
    return any(not mark.args or any(JOBS[name].beside != "forked" for name in mark.args)
               for mark in item.iter_markers("reads"))


def pytest_collection_modifyitems(items):
    """The tests that wait for the workers run after all the others, each group in the file's
    order: the proofs sit in their concept's section of test_all.py, and the one-process tests
    run while the harness trains. A test that reads only a forked run keeps its place (the
    concept selections' test, early, while the jobs train)."""
    late = [waits_for_workers(item) for item in items]
    items[:] = ([item for item, wait in zip(items, late) if not wait]
                + [item for item, wait in zip(items, late) if wait])
