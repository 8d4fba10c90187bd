"""The ledger: calls and payload bytes of a step's collectives, per (group kind, op), as an
observer of parallel.py's collectives (parallel.observe). The log's `comm:` line
(training_config.log_comm_ledger), the tour's comm column and the suite's checks read it;
instruments/memory.py's `communication` is its formula, from the config alone.

Op by op a collective is counted as it runs. Inside ms.jit it is seen once, while MindSpore
compiles the graph (shapes are known then): the ledger keeps what each graph holds and counts it
on every call of the graph (graph_call), so the counts stay exact.
"""
import numpy as np
import mindspore as ms

# a job's control, not a step's data: barrier and any_rank (parallel.py) are not counted
NOT_COUNTED = ("barrier", "any_rank")


class Ledger:
    """Calls and payload bytes (of the input tensor) per (group kind, op)."""

    def __init__(self):
        self.entries = {}
        self.capture = None           # a list while a graph is being compiled
        self.graphs = {}              # (graph, its inputs' key) -> the entries it holds

    def reset(self):
        self.entries = {}

    def add(self, kind, op, nbytes, calls=1):
        old_calls, old_bytes = self.entries.get((kind, op), (0, 0))
        self.entries[(kind, op)] = (old_calls + calls, old_bytes + nbytes * calls)

    def collective(self, kind, op, group, ranks, shape, dtype):
        """One collective (parallel.observe): counted now, or held by the graph compiling."""
        if op in NOT_COUNTED:
            return
        entry = (kind, op, int(np.prod(shape)) * np.dtype(ms.dtype_to_nptype(dtype)).itemsize)
        if self.capture is not None:
            self.capture.append(entry)
        else:
            self.add(*entry)

    def graph_call(self, graph, key, run):
        """run() calls compiled `graph` (parallel.compiled_call): the collectives recorded while
        it compiles are kept under (graph, key), and counted on every call."""
        self.capture = []
        try:
            out = run()
        finally:
            captured, self.capture = self.capture, None
        if captured or (graph, key) not in self.graphs:    # compiled now (maybe without any)
            self.graphs[(graph, key)] = captured
        for entry in self.graphs[(graph, key)]:
            self.add(*entry)
        return out

    def counts(self):
        return dict(self.entries)

    def line(self):
        """`kind op calls bytes` per (group kind, op), for the log; "none" when empty."""
        return ", ".join(f"{kind} {op} {calls} {nbytes}"
                         for (kind, op), (calls, nbytes) in sorted(self.entries.items())) or "none"

    def table(self):
        """The entries as a table, one row per (group kind, op)."""
        lines = [f"{'group':>10} {'op':>15} {'calls':>7} {'bytes':>12}"]
        for (kind, op), (calls, nbytes) in sorted(self.entries.items()):
            lines.append(f"{kind:>10} {op:>15} {calls:7d} {nbytes:12d}")
        return "\n".join(lines)


LEDGER = Ledger()


if __name__ == "__main__":          # imported by train.py, not a script
    raise SystemExit("error: ledger.py is a library: run `bash run.sh` (bash run.sh --help "
                     "lists the commands)")
