"""refmp: a reference implementation of model parallelism in NumPy and MPI."""

from refmp.cpu import keep_freed_memory

__version__ = "0.1.0"

keep_freed_memory()  # reuse freed activation memory step after step (refmp/cpu.py)
