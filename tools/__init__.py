"""The programs that drive training, above train.py: the tour, the benchmarks, the planted bugs,
the probes. Nothing below them imports them. Skip on a first reading."""
