"""The array module: NumPy on the CPU, CuPy on a GPU (selected once per run).

Layer code never imports numpy for its math. It asks for the module that owns its
input arrays, ``xp = array_module(x)``, so the same code runs on host and device
arrays. Creation of new parameters uses the run's module, ``backend.xp``.
"""

from __future__ import annotations

import types

import numpy as np

xp: types.ModuleType = np
"""The run's array module (numpy unless :func:`use` selected another)."""


def use(name: str) -> types.ModuleType:
    """Select the array module for this process: ``"numpy"`` (default) or ``"cupy"``."""
    global xp
    if name == "numpy":
        xp = np
    elif name == "cupy":
        import cupy  # noqa: PLC0415  (optional dependency, imported only when asked for)

        xp = cupy
    else:
        raise ValueError(f"unknown array backend {name!r}; expected 'numpy' or 'cupy'")
    return xp


def array_module(*arrays) -> types.ModuleType:
    """The module (numpy or cupy) that owns ``arrays``; numpy for plain host arrays."""
    for a in arrays:
        mod = type(a).__module__
        if mod.startswith("cupy"):
            import cupy  # noqa: PLC0415

            return cupy
    return np


def to_host(a) -> np.ndarray:
    """Copy an array to host memory (a no-op for NumPy arrays)."""
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def from_host(a: np.ndarray):
    """Copy a host array into the run's array module."""
    return xp.asarray(a)


def sync() -> None:
    """Wait for queued device work (needed before MPI touches device memory)."""
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()
