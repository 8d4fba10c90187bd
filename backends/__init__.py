"""Collectives of our own where the device's are slow: an all-reduce through shared memory for
the workers of one machine on the CPU (shared_memory.py). Skip on a first reading."""
