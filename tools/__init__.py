"""The tools around training: the tour, the benchmarks, the planner (memory.py), the flight
recorder, metrics and profiling, sampling. Skip on a first reading."""
