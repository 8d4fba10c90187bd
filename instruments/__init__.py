"""What observes a run, below train.py: the logs, the ledger, the flight recorder, the memory
planner, metrics, the timeline, the profiler, the sampler. They import the concepts, never train
or tools/. Skip on a first reading."""
