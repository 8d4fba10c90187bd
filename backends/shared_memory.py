"""An all-reduce through shared memory, for the ranks of one machine on the CPU
(`--cpu-collectives shared_memory`): MindSpore's CPU all-reduce (MCCL) passes every byte through
its cluster's TCP messages, several times slower than the same bytes copied through memory
(docs/performance.md, Collectives). parallel.CpuCollectives builds every collective from one
all-reduce, so this one op carries them all.

A process group holds one segment of /dev/shm: a header (int64: a ready word, then each rank's
arrivals, its tensor's elements and dtype, its pid), then n input slots and one output slot of SLOT
bytes each. An all-reduce goes SLOT bytes at a time, at least once (an empty tensor too, so every
rank keeps step; ranks whose tensors differ in elements or dtype stop at the first barrier, named):

    every rank copies its piece into its slot            then all arrive (a barrier)
    rank i sums part i (of n) of the slots into the output, in rank order   all arrive
    every rank copies the whole output out

The second barrier keeps a rank from writing its next piece before every rank has summed; the
next piece's first barrier keeps the output from being overwritten before every rank has read it.
Every rank receives the same sum, added in the same order. The op is a MindSpore Custom op of type
"pyfunc" (a Python function on the CPU, op by op and inside ms.jit), its gradient the same
all-reduce of the incoming gradient. The first rank removes the segment's name once every rank
has attached (past the first barrier): the memory lives on until the last rank unmaps it, so a job
killed whole leaves nothing in /dev/shm.

Another user of the machine can neither read nor stop a job's sums: a segment's name is a digest
of the launch's secret (MGPT_SHM_TOKEN: run.sh and settings.cli.msrun_command draw one per launch)
and of its group, so it can be neither guessed nor derived from another group's name; its first
rank creates it exclusively, mode 0600, and the others map only a file of this user with that mode
and size. A name that exists already was made by someone who knows the secret: the job stops with
one line, it is not removed. Names left by a killed launch are removed by the next launch's first
rank: only this user's, of this form, that no live process holds (the creator holds a lock on its
segment while the name lives).

The counters are plain stores: another process sees them after the data written before them on
x86 (its stores are seen in program order), which is why settings/config allows this backend only
there, and only when every worker runs on this machine.
"""
import atexit
import contextlib
import fcntl
import hashlib
import mmap
import os
import re
import signal
import stat
import time

import numpy as np
from mindspore import ops

from settings.config import SHM_TOKEN

SLOT = 4 << 20              # bytes of each rank's slot: a larger tensor goes through in pieces
SPINS = 200                 # sched_yield turns before a waiting rank sleeps between looks
NAP = 1e-4                  # seconds of each such sleep
WAIT = float(os.environ.get("MS_CPU_COMM_OP_TIMEOUT", "600"))  # seconds before a peer is late
FOLDER = "/dev/shm"                          # Linux's POSIX shared memory (shm_open's names)
NAME = re.compile(r"mgpt_[0-9a-f]{32}")      # a segment's name (segment_name)
READY = 1                   # the header's first word once the creator has set the segment up
GONE = ("stopped", "ended")  # the states of a late rank that will not arrive by itself


class SegmentError(RuntimeError):
    """A segment this rank must not use, or a wait that cannot end: one line naming the cause
    (train.py reports it as an expected failure, not a bug)."""


class Segment:
    """One group's shared memory (segment_name): the group's first rank creates it, the others
    attach once it is ready."""

    def __init__(self, group, size, index):
        self.size, self.index, self.arrivals = size, index, 0
        self.path = os.path.join(FOLDER, segment_name(group))
        header = 8 * (4 * size + 1)
        nbytes = header + (size + 1) * SLOT
        if index == 0:
            self.fd, self.memory = _create(self.path, nbytes)
        else:
            self.fd, self.memory = _attach(self.path, nbytes, group)
        words = np.ndarray((4 * size + 1,), np.int64, self.memory)
        self.ready = words[:1]
        self.arrived, self.counts, self.dtypes, self.pids = words[1:].reshape(4, size)
        self.slots = np.ndarray((size + 1, SLOT), np.uint8, self.memory, header)
        self.pids[index] = os.getpid()
        if index == 0:
            self.ready[0] = READY                     # the others may attach
        self.named = index == 0                       # the creator removes the name
        atexit.register(self.close)

    def barrier(self, group):
        """Until every rank of the group has arrived as often as this one."""
        self.arrivals += 1
        self.arrived[self.index] = self.arrivals
        turns, deadline = 0, time.monotonic() + WAIT
        while self.arrived.min() < self.arrivals:
            turns += 1
            if turns < SPINS:
                os.sched_yield()
                continue
            if turns % SPINS == 0:
                self._check_wait(group, deadline)
            time.sleep(NAP)
        if self.named:                 # every rank has attached: the memory lives on unnamed
            os.unlink(self.path)       # until the last rank unmaps it, at its end or kill
            self.named = False

    def _check_wait(self, group, deadline):
        """Raises for a wait that cannot end: past the deadline, or SIGTERM received (a Python
        handler's, which runs only after the wait: --exit-signal-handler) while a late rank is
        stopped or has ended. A late rank that runs is waited for: it arrives, and the step ends
        as the handler asks."""
        past = time.monotonic() > deadline
        if not (past or sigterm_received()):
            return
        late = [(r, self.pids[r], _state(self.pids[r]))
                for r in range(self.size) if self.arrived[r] < self.arrivals]
        named = ", ".join(f"rank {r} of the group (pid {pid}, {state})" if pid
                          else f"rank {r} of the group ({state})" for r, pid, state in late)
        if past:
            raise SegmentError(f"shared-memory all-reduce on group {group}: {named} did not "
                               f"arrive within {WAIT:.0f} s")
        if any(state in GONE for _, _, state in late):
            raise SegmentError(f"shared-memory all-reduce on group {group}: SIGTERM received "
                               f"while waiting for {named}, which cannot arrive")

    def all_reduce(self, x, group):
        """The sum of `x` (a numpy array) over the group's ranks, a new array."""
        flat, out = x.reshape(-1).view(np.uint8), np.empty_like(x)
        whole = out.reshape(-1).view(np.uint8)
        step = SLOT - SLOT % x.itemsize
        self.counts[self.index], self.dtypes[self.index] = x.size, ord(x.dtype.char)
        for start in range(0, max(flat.size, 1), step):      # empty: one round, barriers kept
            piece = flat[start:start + step]
            self.slots[self.index, :piece.size] = piece
            self.barrier(group)
            if start == 0:
                self._check_alike(group)
            self._sum_part(piece.size, x.dtype)
            self.barrier(group)
            whole[start:start + piece.size] = self.slots[self.size, :piece.size]
        return out

    def send_recv(self, x, source, group):
        """One step of a ring: `x` (a numpy array) written for the rank that reads this one's
        slot, rank `source`'s array read back, a new array; SLOT bytes at a time, each piece
        between two barriers (written before the first, read before the second)."""
        flat, out = x.reshape(-1).view(np.uint8), np.empty_like(x)
        whole = out.reshape(-1).view(np.uint8)
        step = SLOT - SLOT % x.itemsize
        self.counts[self.index], self.dtypes[self.index] = x.size, ord(x.dtype.char)
        for start in range(0, max(flat.size, 1), step):
            piece = flat[start:start + step]
            self.slots[self.index, :piece.size] = piece
            self.barrier(group)
            if start == 0:
                self._check_alike(group)
            whole[start:start + piece.size] = self.slots[source, :piece.size]
            self.barrier(group)
        return out

    def _check_alike(self, group):
        """Every rank's tensor has the same elements and dtype (each wrote its own before the
        first barrier, so every rank reads the same and all stop here together)."""
        if len(set(self.counts)) > 1 or len(set(self.dtypes)) > 1:
            each = ", ".join(f"{count} {np.dtype(chr(code)).name}"
                             for count, code in zip(self.counts, self.dtypes))
            raise RuntimeError(f"shared-memory all-reduce on group {group}: its ranks' tensors "
                               f"differ (each rank's elements and dtype): {each}")

    def _sum_part(self, nbytes, dtype):
        """Part `index` of n of the slots' first `nbytes`, summed in rank order into the output."""
        count = nbytes // np.dtype(dtype).itemsize
        lo, hi = self.index * count // self.size, (self.index + 1) * count // self.size
        slots = [self.slots[r, :nbytes].view(dtype)[lo:hi] for r in range(self.size + 1)]
        np.add(slots[0], slots[1], out=slots[-1])
        for r in range(2, self.size):
            np.add(slots[-1], slots[r], out=slots[-1])

    def close(self):
        """Unmapped at exit (and the name removed, if no sum ever ran); the lock let go."""
        if self.memory.closed:
            return
        if self.named:
            os.unlink(self.path)
        self.ready = self.arrived = self.counts = self.dtypes = self.pids = self.slots = None
        self.memory.close()
        os.close(self.fd)


def segment_name(group):
    """The name of `group`'s segment in this launch: a digest of the launch's secret, its msrun
    process (every worker's parent; a restart's is another) and the group."""
    token = os.environ.get(SHM_TOKEN)
    if not token:
        raise SegmentError(f"shared-memory all-reduce on group {group}: no {SHM_TOKEN}, the "
                           "launch's secret that names its segments: launch with bash run.sh, "
                           "or use --cpu-collectives mccl")
    digest = hashlib.sha256(f"{token}/{os.getppid()}/{group}".encode()).hexdigest()
    return f"mgpt_{digest[:32]}"


def _create(path, nbytes):
    """(fd, mapping) of a new segment at `path`, this user's alone (mode 0600 whatever the
    umask), locked by this process while it lives (sweep passes it by)."""
    sweep()
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise SegmentError(f"shared-memory segment {path} exists already (owner uid "
                           f"{os.lstat(path).st_uid}): made by someone who knows this launch's "
                           f"{SHM_TOKEN}, it is not removed; launch again") from None
    fcntl.flock(fd, fcntl.LOCK_SH)
    os.fchmod(fd, 0o600)
    os.ftruncate(fd, nbytes)
    return fd, mmap.mmap(fd, nbytes)


def sweep():
    """Remove the segments a killed launch left (its first rank died before a group's first sum):
    this user's regular files of segment_name's form that no live process holds. Anything else
    in /dev/shm is not ours to judge, and is left alone."""
    for name in os.listdir(FOLDER):
        if NAME.fullmatch(name):
            with contextlib.suppress(OSError):   # gone, another's, a link, or held: left alone
                _remove_if_stale(os.path.join(FOLDER, name))


def _remove_if_stale(path):
    """Remove the segment at `path` if it is this user's and no process holds it (OSError
    otherwise: BlockingIOError for one held by its live creator)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid():
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if int.from_bytes(os.pread(fd, 8, 0), "little") == READY:    # set up, then left
                os.unlink(path)
    finally:
        os.close(fd)


def _attach(path, nbytes, group):
    """(fd, mapping) of the segment at `path` once its creator has marked it ready."""
    deadline = time.monotonic() + WAIT
    while (opened := _open_ready(path, nbytes)) is None:
        if time.monotonic() > deadline:
            raise SegmentError(f"shared-memory collectives on group {group}: its first rank "
                               f"made no segment {path} within {WAIT:.0f} s")
        time.sleep(0.01)
    return opened


def _open_ready(path, nbytes):
    """(fd, mapping) of the segment at `path` if its creator has marked it ready, else None (not
    there yet, or not yet sized). A file this launch did not make is refused at once: a link,
    another user's file, or one whose mode or size a creator never gives."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise SegmentError(f"shared-memory segment {path}: {e.strerror}, refused: not this "
                           "launch's") from None
    info = os.fstat(fd)
    mode = stat.S_IMODE(info.st_mode)
    ours = info.st_uid == os.getuid()
    if ours and info.st_size == 0:                    # created, not yet sized (nor its mode set)
        os.close(fd)
        return None
    if not (ours and stat.S_ISREG(info.st_mode) and mode == 0o600 and info.st_size == nbytes):
        os.close(fd)
        raise SegmentError(f"shared-memory segment {path} (owner uid {info.st_uid}, mode "
                           f"{mode:o}, {info.st_size} bytes) refused: not this launch's (uid "
                           f"{os.getuid()}, mode 600, {nbytes} bytes)")
    memory = mmap.mmap(fd, nbytes)
    if int.from_bytes(memory[:8], "little") == READY:
        return fd, memory
    memory.close()
    os.close(fd)
    return None


def _state(pid):
    """What the process `pid` (a rank of this machine) does: running, stopped or ended; a rank
    that has not attached yet has no pid."""
    if not pid:
        return "not attached"
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]      # the field after the command
    except FileNotFoundError:
        return "ended"
    return {"T": "stopped", "t": "stopped", "Z": "ended", "X": "ended"}.get(state, "running")


# A Python signal handler runs in the main thread only, which waits in MindSpore for the op while
# the op's Python runs on another thread: the handler would run after the wait. Python's C-level
# handler writes the number of every signal it handles to the wakeup fd at once.
_WAKEUP = {"fd": None, "sigterm": False}


def watch_sigterm():
    """Let a barrier's wait see a SIGTERM that a Python handler will take (train.py's with
    --exit-signal-handler): call from the main thread, once the handler is installed."""
    read, write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    old = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    if _WAKEUP["fd"] is not None:
        os.close(_WAKEUP["fd"])
        os.close(old)
    _WAKEUP.update(fd=read, sigterm=False)


def sigterm_received():
    """Whether a SIGTERM came since watch_sigterm (other signals' numbers are passed over)."""
    while _WAKEUP["fd"] is not None and not _WAKEUP["sigterm"]:
        try:
            numbers = os.read(_WAKEUP["fd"], 64)
        except BlockingIOError:
            break
        _WAKEUP["sigterm"] = signal.SIGTERM in numbers
    return _WAKEUP["sigterm"]


_SEGMENTS = {}               # group -> its Segment in this process, made at its first use


def _segment(group, size, index):
    if group not in _SEGMENTS:
        _SEGMENTS[group] = Segment(group, size, index)
    return _SEGMENTS[group]


def all_reduce_op(group, size, index):
    """The Custom op summing a tensor over the group (this process is its rank `index` of
    `size`), with the same op as its gradient. The segment is made at the group's first
    collective, which every rank of the group calls."""
    def run(x):
        return _segment(group, size, index).all_reduce(np.ascontiguousarray(x), group)

    def bprop(x, out, dout):
        return (op(dout),)
    op = ops.Custom(run, lambda shape: shape, lambda dtype: dtype, "pyfunc", bprop=bprop)
    return op


def send_recv_op(group, size, index, step):
    """The Custom op of one ring step over the group: a tensor to the rank `step` places on
    (index + step mod size), the one from `step` places back returned; it shares the group's
    segment with the sum. No gradient of its own: context_parallel.RingKernel, its user, passes
    the gradients round the ring in its own backward."""
    source = (index - step) % size

    def run(x):
        return _segment(group, size, index).send_recv(np.ascontiguousarray(x), source, group)
    return ops.Custom(run, lambda shape: shape, lambda dtype: dtype, "pyfunc")
