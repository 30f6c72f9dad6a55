"""refmp: a reference implementation of model parallelism in NumPy and MPI."""

__version__ = "0.1.0"
