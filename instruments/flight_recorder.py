"""A flight recorder of each rank's collectives, and the reading that lines the ranks' records up.

Every collective the project runs (parallel.py: the Collectives ops, broadcast, the pipeline's
exchange, barrier, any_rank) is an event in a ring buffer of the last EVENTS: its sequence number,
op, group (name and ranks), its index among the group's collectives on this rank, shape, dtype and
the line of the project's code that asked for it. A compiled graph's call is one event that holds
the collectives recorded while it was compiled (as the ledger counts them). PyTorch's
flight recorder (torch/csrc/distributed/c10d/FlightRecorder.hpp) keeps the same entries per NCCL
call; here the CPU's collectives are MindSpore's, so the recorder lives in Python.

A thread writes the record to <folder>/flight_recorder_rank_N.json every WRITE_EVERY seconds (and
on an error, SIGUSR1 = "dump now", and at exit), so every rank's record is on disk when a job
fails, a rank killed (SIGTERM, SIGKILL) included up to its last second. When this rank has waited
STALL seconds without a new collective, the thread reads its peers' records (the same folder) and
stops the job only for a fault that waiting cannot end: ranks that disagree on a collective, a
cycle of ranks each waiting in a group another has not reached (groups entered in another order),
or a peer that ended without it. A peer that is only slow (compiling, sleeping, sharing the CPU)
waits for nothing: it is waited for, up to MS_CPU_COMM_OP_TIMEOUT (docs/when-a-run-hangs.md).

`python flight_recorder.py LOG_DIR` (`bash run.sh diagnose LOG_DIR`) prints one `error:` line
naming the first event where the ranks' records disagree, then each failing rank's own error.
"""
import atexit
import collections
import glob
import json
import os
import re
import signal
import sys
import threading
import time

import parallel
from data import write_atomic
from settings.cli import PROJECT

EVENTS = 128              # the ring buffer: enough for a step's collectives of a small model
WRITE_EVERY = 1.0         # seconds between writes of the record
STALL = 5.0               # seconds without a new collective before the peers' records are read
# the project's code: the files of its folder and of its folders of modules
CODE = {PROJECT, *(os.path.join(PROJECT, folder)
                   for folder in ("settings", "formats", "instruments", "tools"))}
NOT_CALLERS = (os.path.join(PROJECT, "parallel.py"), os.path.abspath(__file__))
FILE = "flight_recorder_rank_{}.json"
# a launch: msrun's scheduler port and the msrun process that started the worker (one node's)
JOB = f"{os.environ.get('MS_SCHED_PORT', '')}-{os.getppid()}"


class Recorder:
    """One rank's ring buffer of events, and the groups' counts of collectives."""

    def __init__(self):
        self.events = collections.deque(maxlen=EVENTS)
        self.counts = collections.Counter()           # group name -> collectives recorded
        self.seq, self.last = 0, time.time()
        self.capture = None          # a graph's list of held collectives while it compiles
        self.graphs = {}             # (graph, its inputs' key) -> its held collectives
        self.path, self.rank, self.reason, self.ended = None, 0, None, False

    def add(self, op, groups, shape=None, dtype=None, holds=None, code=None):
        """Append one event; `groups` maps each group it runs on to that group's ranks."""
        at = {}
        for group in groups:
            at[group] = self.counts[group]
            self.counts[group] += 1
        self.seq += 1
        self.last = time.time()
        event = {"seq": self.seq, "op": op, "at": at, "ranks": groups, "time": self.last,
                 "code": code or caller()}
        if shape is not None:
            event.update(shape=list(shape), dtype=str(dtype))
        if holds is not None:
            event["holds"] = holds
        self.events.append(event)
        return event

    def state(self):
        return {"rank": self.rank, "job": JOB, "pid": os.getpid(), "written": time.time(),
                "last": self.last, "ended": self.ended, "reason": self.reason,
                "events": list(self.events)}


RECORDER = Recorder()


def caller():
    """`file.py:line (function)` of the first frame of the project's code outside parallel.py
    and this module (the code that asked for the collective); inside a backward MindSpore calls,
    the parallel.py line."""
    frame, fallback = sys._getframe(1), None
    while frame is not None:
        code = frame.f_code
        kind = KINDS.get(code.co_filename)
        if kind is None:
            kind = KINDS[code.co_filename] = file_kind(code.co_filename)
        if kind == "caller":
            return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} ({code.co_name})"
        if kind == "parallel" and fallback is None and code.co_name != "_record":
            fallback = f"parallel.py:{frame.f_lineno} ({code.co_name})"
        frame = frame.f_back
    return fallback or "?"


KINDS = {}                # a frame's file name -> file_kind (the stack is walked per collective)


def file_kind(name):
    """"caller" for a module of the project other than parallel.py and this one, "parallel" for
    parallel.py, "" for any other file."""
    if os.path.dirname(name) not in CODE or name == NOT_CALLERS[1]:
        return ""
    return "parallel" if name == NOT_CALLERS[0] else "caller"


def collective(kind, op, group, ranks, shape, dtype):
    """One collective on `group` (its global `ranks`), told by parallel.py (parallel.observe): an
    event, or while a graph compiles, one of the collectives the graph holds."""
    if RECORDER.capture is not None:
        RECORDER.capture.append({"op": op, "group": group, "ranks": list(ranks),
                                 "shape": list(shape), "dtype": str(dtype)})
    else:
        RECORDER.add(op, {group: list(ranks)}, shape, dtype)


def graph_call(graph, key, run):
    """run() calls a compiled graph (parallel.compiled_call): one event, holding the collectives
    recorded when the graph compiled; a first call fills them while it compiles, and counts
    them on their groups once it has run."""
    held = RECORDER.graphs.get((graph, key))
    if held is None:
        RECORDER.capture = []
        event = RECORDER.add("graph", {}, holds=RECORDER.capture)
    else:
        event = RECORDER.add("graph", {h["group"]: h["ranks"] for h in held}, holds=held)
    try:
        return run()
    finally:
        if RECORDER.capture is not None and (graph, key) not in RECORDER.graphs:
            _hold(graph, key, event)
        RECORDER.capture = None


def _hold(graph, key, event):
    """A graph's first call done: the collectives it holds, now known, kept for its next calls
    and counted on their groups."""
    held, RECORDER.capture = RECORDER.capture, None
    RECORDER.graphs[(graph, key)] = held
    for h in held:
        event["ranks"][h["group"]] = h["ranks"]
    for group in event["ranks"]:
        event["at"][group] = RECORDER.counts[group]
        RECORDER.counts[group] += 1


WRITING = threading.Lock()    # one write at a time: the writer thread, errors, exit


def dump(reason=None, ended=False):
    """Write this rank's record now (atomically); `reason` (an error) is kept in it. The write at
    exit (`ended`) is the last: no later write of the writer thread is cut off half-way."""
    with WRITING:
        RECORDER.reason = reason or RECORDER.reason
        if RECORDER.path and not RECORDER.ended:
            RECORDER.ended = ended
            write_atomic(RECORDER.path, json.dumps(RECORDER.state()), durable=False)


def start(folder, rank, world):
    """Record to <folder>/flight_recorder_rank_N.json: its writer and watchdog thread, SIGUSR1
    (dump now) and the write at exit. Several workers only; again in the same process, the
    folder changes."""
    if world < 2 or os.environ.get("MS_ROLE") == "MS_SCHED":   # msrun's scheduler runs none
        return
    os.makedirs(folder, exist_ok=True)
    first = RECORDER.path is None
    RECORDER.path, RECORDER.rank = os.path.join(folder, FILE.format(rank)), rank
    # a new run in the same process (the tour's, a test's jobs): its own graphs
    RECORDER.reason, RECORDER.capture = None, None
    RECORDER.graphs.clear()
    if not first:
        return
    parallel.observe(sys.modules[__name__])          # collective() and graph_call() above
    watcher = threading.Thread(target=_watch, args=(world,), daemon=True)
    watcher.start()
    atexit.register(_end, watcher)
    if threading.current_thread() is threading.main_thread():
        # SIGTERM keeps its default, an exit at once even in a collective's wait (a Python
        # handler would run only after it): the writer's record is at most WRITE_EVERY s old
        signal.signal(signal.SIGUSR1, dump_soon)


WAKE = threading.Event()      # SIGUSR1 ("dump now") or the exit: the writer thread wakes at once
ENDING = threading.Event()    # set at exit: the writer thread returns


def dump_soon(signum, frame):
    """SIGUSR1's handler: the writer thread writes the record at once. A handler runs in the main
    thread between two bytecodes, maybe in the middle of that thread's own dump (an error's, the
    exit's): a write here would start the file that dump is writing over."""
    WAKE.set()


def _end(watcher):
    """At exit: the writer thread ended and joined, then the last write. A daemon thread still
    running (or waking) while the interpreter and MindSpore's libraries are torn down could crash
    the exit (a SIGSEGV after the last write was seen, its stack: the writer asleep in _watch)."""
    ENDING.set()
    WAKE.set()
    watcher.join(timeout=2 * WRITE_EVERY)
    dump(ended=True)


def _watch(world):
    """The thread: the record written every WRITE_EVERY seconds (at once on SIGUSR1) until
    ENDING, and the watchdog."""
    while True:
        WAKE.wait(WRITE_EVERY)
        WAKE.clear()
        if ENDING.is_set():
            return
        watchdog(world)


def watchdog(world):
    """One turn of the writer thread: the record written; after STALL seconds without a new
    collective, a fault that waiting cannot end (definite) in the peers' records stops this
    worker with one line."""
    try:
        dump()
    except (RuntimeError, OSError):           # an event changed while written: the next write
        return
    if time.time() - RECORDER.last < STALL or RECORDER.reason or RECORDER.ended:
        return                         # busy, or failed itself: msrun ends the job as it exits
    finding = diagnose(load(os.path.dirname(RECORDER.path), JOB), world, live=True)
    if finding is not None and finding[1]:
        message = f"error: {finding[0]}{WATCHDOG}"
        dump(message)
        print(f"[rank {RECORDER.rank}] {message}", file=sys.stderr, flush=True)
        os._exit(1)


def load(folder, job=None):
    """{rank: record} of the records in `folder`, of the launch `job` only when given (an earlier
    job's records may lie in the same folder). A record is written whole (write_atomic): one that
    is not JSON, or not as this module writes it (malformed), was truncated or crafted: named in
    one warning line (once per file) and skipped. One gone since listed (a new launch's) too."""
    records = {}
    for path in glob.glob(os.path.join(folder, FILE.format("*"))):
        try:
            with open(path) as f:
                record_ = json.load(f)
        except OSError:
            continue
        except ValueError as e:
            warn_once(path, f"not JSON ({e})")
            continue
        problem = malformed(record_)
        if problem:
            warn_once(path, problem)
        elif job is None or record_["job"] == job:
            records[record_["rank"]] = record_
    return records


def ended_cleanly(folder, ranks):
    """Whether `ranks` records in `folder` were each written at its process's exit with no error
    in it: every rank's training had returned, its work saved, when a signal ended it."""
    records = load(folder)
    return len(records) == ranks and all(r["ended"] and not r["reason"] for r in records.values())


WARNED = set()            # the records named by warn_once (the watchdog reads them every second)


def warn_once(path, problem):
    """One line naming the record at `path` and what is wrong with it, skipped (once a file)."""
    if path not in WARNED:
        WARNED.add(path)
        print(f"warning: flight record {path}: {problem}; skipped", file=sys.stderr, flush=True)


# The fields of a record, of each of its events and of each collective a graph's event holds,
# with their JSON types: diagnose reads only records that have them
NUMBER = (int, float)
RECORD = {"rank": int, "job": str, "pid": int, "written": NUMBER, "last": NUMBER, "ended": bool,
          "reason": (str, type(None)), "events": list}
EVENT = {"seq": int, "op": str, "at": dict, "ranks": dict, "time": NUMBER, "code": str}
EVENT_OPTIONAL = {"shape": list, "dtype": str, "holds": list}
HELD = {"op": str, "group": str, "ranks": list, "shape": list, "dtype": str}


def malformed(record_):
    """What makes `record_` (parsed JSON) unlike the records this module writes, named; or None."""
    problem = wrong_fields(record_, RECORD, "the record")
    if problem:
        return problem
    for n, event in enumerate(record_["events"]):
        problem = wrong_event(event, f"events[{n}]")
        if problem:
            return problem
    return None


def wrong_event(event, where):
    """What makes `event` unlike an event of Recorder.add, named; or None."""
    problem = (wrong_fields(event, EVENT, where)
               or wrong_fields(event, EVENT_OPTIONAL, where, optional=True))
    if problem:
        return problem
    if ("shape" in event) != ("dtype" in event):
        return f"{where} has a 'shape' without a 'dtype', or a 'dtype' without a 'shape'"
    for group, ranks in event["ranks"].items():
        if not isinstance(ranks, list) or not all(isinstance(r, int) for r in ranks):
            return f"{where}['ranks'][{group!r}] is not a list of ranks"
    for group, index in event["at"].items():
        if not isinstance(index, int) or group not in event["ranks"]:
            return f"{where}['at'][{group!r}] is not an index in a group of its 'ranks'"
    for k, held in enumerate(event.get("holds", [])):
        problem = wrong_fields(held, HELD, f"{where}['holds'][{k}]")
        if problem:
            return problem
    return None


def wrong_fields(value, fields, where, optional=False):
    """The first of `fields` (name: type) that `value` lacks or holds with another type, named;
    or None (`optional`: only the fields it has are checked)."""
    if not isinstance(value, dict):
        return f"{where} is a {type(value).__name__}, not an object"
    for name, kind in fields.items():
        if name not in value and not optional:
            return f"{where} has no {name!r}"
        if name in value and not isinstance(value[name], kind):
            return f"{where}[{name!r}] is a {type(value[name]).__name__}"
    return None


def held_on(event, group):
    """The collectives a graph's event holds on `group`, in order."""
    return [h for h in event.get("holds") or [] if h["group"] == group]


def signature(event, group):
    """What the ranks of `group` must agree on at this event, or the collective fails or hangs:
    the op, shape and dtype; of a compiled graph, those of each collective it holds on `group`.
    Its collectives on a rank's other groups are compared in those groups: their names differ
    between the ranks of this one (tp-0-1's rank 0 holds cp-0-2, its rank 1 cp-1-3)."""
    held = [(h["op"], h["shape"], h["dtype"]) for h in held_on(event, group)]
    return (event["op"], str(event.get("shape")), event.get("dtype"), str(held))


def describe(rank, event, group=None, numbered=True):
    """`rank R all_reduce [4] Float32 at file:line (function)` (rank None: without `rank R`); when
    `group` is given, a graph's collectives on it alone and, `numbered`, `(#3 of group tp-0-1)`."""
    what = event["op"]
    if "shape" in event:
        what += f" {event['shape']} {event['dtype']}"
    held = held_on(event, group) if group in event["at"] else event.get("holds")
    if held:
        what += " holding " + ", ".join(f"{h['op']} {h['shape']} on {h['group']}" for h in held)
    numbered = numbered and group in event["at"]
    where = f" (#{event['at'][group]} of group {group})" if numbered else ""
    return f"{'' if rank is None else f'rank {rank} '}{what}{where} at {event['code']}"


def by_group(records):
    """{group: (its ranks, {rank: {index in the group: event}})} over every rank's record."""
    groups = {}
    for rank, record_ in records.items():
        for event in record_["events"]:
            for group, index in event["at"].items():
                _, seen = groups.setdefault(group, (event["ranks"][group], {}))
                seen.setdefault(rank, {})[index] = event
    return groups


def reached(rank, group_seen, records):
    """The last index of the group this rank reached: -1 if it recorded none (or left no record)
    and its ring buffer still holds all it did; None if the ring lost it."""
    if group_seen.get(rank):
        return max(group_seen[rank])
    full = rank in records and len(records[rank]["events"]) >= EVENTS
    return None if full else -1


def findings(records):
    """Per group, the first index where its ranks disagree: (kind "differs" or "missing", group,
    index, {rank: event} of the ranks there, the ranks missing)."""
    found = []
    for group, (ranks, seen) in by_group(records).items():
        last = {r: reached(r, seen, records) for r in ranks}
        # the indices its ranks reached (a crafted record may name other ranks for the group)
        for index in sorted({i for r in ranks for i in seen.get(r, {})}):
            here = {r: seen[r][index] for r in ranks if index in seen.get(r, {})}
            missing = [r for r in ranks if r not in here and last[r] is not None
                       and last[r] < index]
            if len({signature(e, group) for e in here.values()}) > 1:
                found.append(("differs", group, index, here, []))
            elif missing:
                found.append(("missing", group, index, here, missing))
            elif len({e["code"] for e in here.values()}) > 1:    # pairs up, but out of step
                found.append(("elsewhere", group, index, here, []))
            else:
                continue
            break
    return sorted(found, key=lambda f: min(e["time"] for e in f[3].values()))


def waits(records):
    """{rank: {the ranks it waits for}}: a rank waits for each rank of a group that has not
    reached the group's collective it has (of every group's first disagreement)."""
    edges = {}
    for kind, _, _, here, missing in findings(records):
        for rank in here if kind == "missing" else ():
            edges.setdefault(rank, set()).update(missing)
    return edges


def cycle_through(rank, edges, ranks_ok):
    """Whether `rank` is on a cycle of the wait-for graph among `ranks_ok`."""
    todo, seen = list(edges.get(rank, ())), set()
    while todo:
        r = todo.pop()
        if r == rank:
            return True
        if r in seen or r not in ranks_ok:
            continue
        seen.add(r)
        todo += edges.get(r, ())
    return False


def diagnose(records, world, live=False):
    """(one line naming the first event where the ranks' records disagree, whether waiting cannot
    end it), or None when they agree. `live`: read while the job runs, the first disagreement
    that waiting cannot end, where a rank without a record may still be starting and a wait
    counts only between ranks idle for STALL seconds."""
    found = lowest_rank_first_on_a_cycle(findings(records), records)
    # the first rank without a record (`world` comes from the records' ranks, maybe crafted)
    absent = next((r for r in range(world) if r not in records), None)
    if not found and absent is not None and not live:
        return f"rank {absent} left no flight record (it ended before a collective)", True
    idle = {r for r, rec in records.items() if rec["written"] - rec["last"] >= STALL}
    for finding in found:
        message, definite = explain(finding, found, records, idle if live else set(records))
        if definite or not live:
            return message, definite or not live
    return None


def lowest_rank_first_on_a_cycle(found, records):
    """`found` (in time order), but when its first finding is a deadlock (ranks waiting on each
    other in a cycle) that cycle's findings first, by their lowest waiting rank: a cycle has no
    first event (which side's wait began first is a race), so every run names it alike."""
    edges, ranks = waits(records), set(records)
    on_cycle = [f for f in found if f[0] == "missing"
                and any(cycle_through(r, edges, ranks) for r in f[3])]
    if not found or found[0] not in on_cycle:
        return found
    return (sorted(on_cycle, key=lambda f: min(f[3]))
            + [f for f in found if f not in on_cycle])


OUT_OF_STEP = "a collective skipped, or the groups entered in another order"
WATCHDOG = " (flight recorder)"        # the end of an error the watchdog stopped its rank with


def explain(finding, found, records, waiting):
    """(the line of one finding, whether waiting cannot end it); `waiting`: the ranks whose
    waits count."""
    kind, group, index, here, missing = finding
    ranks = next(iter(here.values()))["ranks"][group]
    head = f"collective #{index} of group {group} (ranks {', '.join(map(str, ranks))})"
    if kind != "missing":
        sides = "; ".join(describe(r, e, group, numbered=False) for r, e in sorted(here.items()))
        return (f"{head} differs: {sides}" if kind == "differs" else
                f"{head} is called from different lines (one rank skipped or added one): "
                f"{sides}"), kind == "differs"
    late, (first, event) = missing[0], sorted(here.items())[0]
    message = (f"rank {late} did not arrive at {head}, where "
               f"{describe(first, event, group, numbered=False)} waits")
    if late not in records:
        return f"{message}; rank {late} left no record (killed?)", False
    reason = records[late]["reason"]
    ended = (f"; rank {late} ended: {own_error(reason or 'its work done')}"
             if records[late]["ended"] else f"; rank {late} failed: {own_error(reason)}"
             if reason else "")
    pending = [(g, h[late]) for k, g, _, h, m in found if k == "missing" and late in h
               and first in m]
    if pending and cycle_through(late, waits(records), waiting):
        g, e = pending[0]
        return (f"{message}; rank {late} went to {describe(None, e, g)} instead, which rank "
                f"{first} has not reached: {OUT_OF_STEP}{ended}"), True
    events = records[late]["events"]
    last = describe(None, events[-1], next(iter(events[-1]["at"]), None)) if events else "none"
    # a peer that failed ends the job as it exits (msrun); one whose work is done never comes
    return (f"{message}; rank {late}'s last: {last}{ended}",
            records[late]["ended"] and not reason)


def own_error(reason):
    """The line of a rank's error that says what failed: a traceback's exception line (the
    last), else its first line."""
    lines = [l.strip() for l in reason.splitlines() if l.strip()]
    raised = [l for l in lines if re.match(r"\w+(Error|Exception): ", l)]
    line = raised[-1] if raised else lines[0]
    return line[len("error: "):] if line.startswith("error: ") else line


def main(argv):
    """`python flight_recorder.py LOG_DIR`: the diagnosis of the records in LOG_DIR; exit 1 when
    the ranks disagree, 0 when they agree, 2 when there is nothing to read. `--ended N LOG_DIR`
    (run.sh): exit 0 when N ranks' records ended cleanly (ended_cleanly), else 1."""
    if len(argv) == 3 and argv[0] == "--ended":
        return 0 if ended_cleanly(argv[2], int(argv[1])) else 1
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        print("error: usage: bash run.sh diagnose LOG_DIR: give the folder of a job's worker logs "
              "(msrun's --log_dir, output/msrun_log by default)", file=sys.stderr)
        return 2
    records = load(argv[0])
    if not records:
        print(f"error: {argv[0]} holds no {FILE.format('N')}: give the --log_dir of a job of "
              "several workers launched by run.sh", file=sys.stderr)
        return 2
    world = 1 + max([r for rec in records.values() for e in rec["events"]
                     for ranks in e["ranks"].values() for r in ranks] + list(records))
    finding = diagnose(records, world)
    if finding is None:
        print(f"flight recorder: the {len(records)} ranks' last collectives agree")
        return 0
    print(f"error: {finding[0]}", file=sys.stderr)
    for rank, record_ in sorted(records.items()):
        if record_["reason"] and not record_["reason"].endswith(WATCHDOG):
            print(f"rank {rank}'s own error: {own_error(record_['reason'])}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
