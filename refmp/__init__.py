"""refmp: a reference implementation of model parallelism in NumPy and MPI."""

import os

# Idle OpenBLAS threads spin for ~0.1 s after each product, and on the cores refmp's row
# threads need (refmp/runtime/cpu.py, item 4). OpenBLAS reads this once, when NumPy loads it: set it
# here, before any refmp module imports NumPy; a value the user set wins.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

__version__ = "0.1.0"
