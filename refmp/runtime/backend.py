"""The array module: NumPy on the CPU, CuPy on a GPU (selected once per run).

Layer code never imports numpy for its math. It asks for the module that owns its
input arrays, ``xp = array_module(x)``, so the same code runs on host and device
arrays. Creation of new parameters uses the run's module, ``backend.xp``.
"""

from __future__ import annotations

import types

import numpy as np

from refmp.runtime.cpu import keep_freed_memory

keep_freed_memory()  # reuse freed activation memory step after step (refmp/runtime/cpu.py)

xp: types.ModuleType = np
"""The run's array module (numpy unless :func:`use` selected another)."""


def use(name: str | types.ModuleType) -> types.ModuleType:
    """Select the array module for this process: ``"numpy"`` (default) or ``"cupy"``, or a
    module given itself: a device stand-in with CuPy's API (tests/device/strict.py)."""
    global xp
    if isinstance(name, types.ModuleType):
        xp = name
    elif name == "numpy":
        xp = np
    elif name == "cupy":
        import cupy  # noqa: PLC0415  (optional dependency, imported only when asked for)

        xp = cupy
    else:
        raise ValueError(f"unknown array backend {name!r}; expected 'numpy' or 'cupy'")
    return xp


def is_device_array(a) -> bool:
    """True for arrays in GPU memory (CuPy, or anything exposing __cuda_array_interface__)."""
    return hasattr(a, "__cuda_array_interface__")


class Transfers:
    """Bytes and counts copied between host and device (d2h, h2d) by to_host/from_host.

    Tests use it to prove a training step moves nothing but the batch and MPI's staging.
    (Reading a 0-d device scalar with float() is an implicit copy, not counted here.)
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.bytes = {"d2h": 0, "h2d": 0}
        self.count = {"d2h": 0, "h2d": 0}

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += int(nbytes)
        self.count[kind] += 1


transfers = Transfers()


def array_module(*arrays) -> types.ModuleType:
    """The module (numpy or cupy) that owns ``arrays``; numpy for plain host arrays.

    Device arrays belong to the run's module once one is selected (cupy, or a stand-in)."""
    for a in arrays:
        if type(a).__module__.startswith("cupy"):
            import cupy  # noqa: PLC0415

            return cupy
        if xp is not np and is_device_array(a):
            return xp
    return np


def to_host(a) -> np.ndarray:
    """Copy an array to host memory (a no-op for NumPy arrays)."""
    if is_device_array(a):
        transfers.add("d2h", a.nbytes)
        return a.get()
    return np.asarray(a)


def from_host(a: np.ndarray):
    """Copy a host array into the run's array module (a no-op with NumPy)."""
    if xp is np:
        return np.asarray(a)
    transfers.add("h2d", a.nbytes)
    return xp.asarray(a)


def copy_from_host(dst, src: np.ndarray) -> None:
    """Overwrite the device (or host) array ``dst`` with the host array ``src``."""
    if is_device_array(dst):
        transfers.add("h2d", src.nbytes)
        dst.set(src)
    else:
        dst[...] = src


def scatter_add(a, idx, values) -> None:
    """a[idx[i]] += values[i] for 1-D ``idx``, repeated indices accumulating in the order of i.

    On the CPU this gives bitwise ``np.add.at(a, idx, values)``, faster: add.at visits one
    element at a time (10 ns each), while a fancy-index ``a[j] += v`` is one vectorized
    pass, but correct only if j has no repeats. So the values go in rounds: round r adds
    every index's r-th occurrence, whose indices are distinct. Each index still receives its
    values in the order of i, the order add.at adds them. There are as many rounds as the
    most repeated index has occurrences (docs/speed.md compares the two).
    """
    if is_device_array(a) and xp.__name__ != "cupy":
        xp.scatter_add(a, idx, values)  # a stand-in's cupyx.scatter_add (tests/device)
        return
    if is_device_array(a):
        import cupyx  # noqa: PLC0415

        cupyx.scatter_add(a, idx, values)
        return
    if len(idx) == 0:
        return
    order = np.argsort(idx, kind="stable")  # i grouped by index, each group in the order of i
    grouped = idx[order]
    first = np.flatnonzero(np.r_[True, grouped[1:] != grouped[:-1]])  # each group's start
    occurrence = np.arange(len(idx)) - np.repeat(first, np.diff(np.r_[first, len(idx)]))
    by_round = order[np.argsort(occurrence, kind="stable")]  # round 0's i, then round 1's, ...
    ends = np.cumsum(np.bincount(occurrence))
    for lo, hi in zip(np.r_[0, ends[:-1]], ends, strict=True):
        i = by_round[lo:hi]  # one round: distinct indices
        a[idx[i]] += values[i]


def sync() -> None:
    """Wait for queued device work (needed before MPI touches device memory)."""
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()
