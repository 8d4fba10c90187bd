"""The programs that drive training, above train.py: the tour, the benchmarks, the planted bugs,
the probes; and the reading table (reading.py: README's reading order against the code). Nothing
below them imports them. Skip on a first reading."""
