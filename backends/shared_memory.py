"""An all-reduce through shared memory, for the ranks of one machine on the CPU
(`--cpu-collectives shared_memory`): MindSpore's CPU all-reduce (MCCL) passes every byte through
its cluster's TCP messages, several times slower than the same bytes copied through memory
(docs/performance.md, Collectives). parallel.CpuCollectives builds every collective from one
all-reduce, so this one op carries them all.

A process group holds one segment of /dev/shm: n arrival counters, a ready flag and each rank's
tensor size (int64), then n input slots and one output slot of SLOT bytes each. An all-reduce goes
SLOT bytes at a time (ranks whose tensors differ in size stop at the first barrier, named):

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

The counters are plain stores: another process sees them after the data written before them on
x86 (its stores are seen in program order), which is why settings/config allows this backend only
there, and only when every worker runs on this machine.
"""
import atexit
import contextlib
import glob
import os
import time

import numpy as np
from multiprocessing import resource_tracker, shared_memory
from mindspore import ops

SLOT = 4 << 20              # bytes of each rank's slot: a larger tensor goes through in pieces
SPINS = 200                 # sched_yield turns before a waiting rank sleeps between looks
NAP = 1e-4                  # seconds of each such sleep
WAIT = float(os.environ.get("MS_CPU_COMM_OP_TIMEOUT", "600"))  # seconds before a peer is late


class Segment:
    """One group's shared memory, named after msrun's process (the workers' parent) and the
    group: the group's first rank creates it, the others attach once it is ready."""

    def __init__(self, group, size, index):
        self.size, self.index, self.arrivals = size, index, 0
        name = f"mgpt_{os.getppid()}_{group}"
        header = 8 * (2 * size + 1)                   # counters, ready flag, sizes
        if index == 0:
            self.memory = _create(name, header + (size + 1) * SLOT)
        else:
            self.memory = _attach(name, group, size)
        self.counters = np.ndarray((2 * size + 1,), np.int64, self.memory.buf)
        self.slots = np.ndarray((size + 1, SLOT), np.uint8, self.memory.buf, header)
        if index == 0:
            self.counters[size] = 1                   # ready: the others may attach
        self.named = index == 0                       # the creator removes the name
        atexit.register(self.close)

    def barrier(self, group):
        """Until every rank of the group has arrived as often as this one."""
        self.arrivals += 1
        self.counters[self.index] = self.arrivals
        turns, deadline = 0, time.monotonic() + WAIT
        while self.counters[:self.size].min() < self.arrivals:
            turns += 1
            if turns < SPINS:
                os.sched_yield()
                continue
            if time.monotonic() > deadline:
                late = [r for r in range(self.size) if self.counters[r] < self.arrivals]
                raise RuntimeError(f"shared-memory all-reduce on group {group}: rank(s) "
                                   f"{late} of the group did not arrive within {WAIT:.0f} s")
            time.sleep(NAP)
        if self.named:                 # every rank has attached: the memory lives on unnamed
            self.memory.unlink()       # until the last rank unmaps it, at its end or kill
            self.named = False

    def all_reduce(self, x, group):
        """The sum of `x` (a numpy array) over the group's ranks, a new array."""
        flat, out = x.reshape(-1).view(np.uint8), np.empty_like(x)
        whole = out.reshape(-1).view(np.uint8)
        step = SLOT - SLOT % x.itemsize
        sizes = self.counters[self.size + 1:]
        sizes[self.index] = flat.size
        for start in range(0, flat.size, step):
            piece = flat[start:start + step]
            self.slots[self.index, :piece.size] = piece
            self.barrier(group)
            if start == 0 and sizes.min() != sizes.max():
                raise RuntimeError(f"shared-memory all-reduce on group {group}: its ranks' "
                                   f"tensors differ, {list(sizes)} bytes")
            self._sum_part(piece.size, x.dtype)
            self.barrier(group)
            whole[start:start + piece.size] = self.slots[self.size, :piece.size]
        return out

    def _sum_part(self, nbytes, dtype):
        """Part `index` of n of the slots' first `nbytes`, summed in rank order into the output."""
        count = nbytes // np.dtype(dtype).itemsize
        lo, hi = self.index * count // self.size, (self.index + 1) * count // self.size
        slots = [self.slots[r, :nbytes].view(dtype)[lo:hi] for r in range(self.size + 1)]
        np.add(slots[0], slots[1], out=slots[-1])
        for r in range(2, self.size):
            np.add(slots[-1], slots[r], out=slots[-1])

    def close(self):
        """Unmapped at exit (and the name removed, if no sum ever ran)."""
        self.counters = self.slots = None
        self.memory.close()
        if self.named:
            self.memory.unlink()


def _create(name, nbytes):
    """A new segment `name`. Segments of launches whose msrun has gone are removed first: one
    killed before its first sum leaves its names behind."""
    for path in glob.glob("/dev/shm/mgpt_*_*"):
        if not _alive(int(os.path.basename(path).split("_")[1])):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    try:
        return shared_memory.SharedMemory(name, create=True, size=nbytes)
    except FileExistsError:
        shared_memory.SharedMemory(name).unlink()
        return shared_memory.SharedMemory(name, create=True, size=nbytes)


def _alive(pid):
    """Whether process `pid` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _attach(name, group, size):
    """The segment `name` once its creator has marked it ready."""
    deadline = time.monotonic() + WAIT
    while (memory := _ready(name, size)) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"shared-memory collectives on group {group}: its first rank "
                               f"made no segment {name} within {WAIT:.0f} s")
        time.sleep(0.01)
    return memory


def _ready(name, size):
    """The segment `name` if its creator has marked it ready, else None; not tracked by this
    process (Python's tracker would remove the creator's segment when this process ends)."""
    try:
        memory = shared_memory.SharedMemory(name)
    except (FileNotFoundError, ValueError):            # not there yet, or not yet sized
        return None
    resource_tracker.unregister(memory._name, "shared_memory")
    if int.from_bytes(memory.buf[8 * size:8 * size + 8], "little") == 1:
        return memory
    memory.close()
    return None


def all_reduce_op(group, size, index):
    """The Custom op summing a tensor over the group (this process is its rank `index` of
    `size`), with the same op as its gradient. The segment is made at the first sum, which every
    rank of the group calls."""
    segment = []

    def run(x):
        if not segment:
            segment.append(Segment(group, size, index))
        return segment[0].all_reduce(np.ascontiguousarray(x), group)

    def bprop(x, out, dout):
        return (op(dout),)
    op = ops.Custom(run, lambda shape: shape, lambda dtype: dtype, "pyfunc", bprop=bprop)
    return op
