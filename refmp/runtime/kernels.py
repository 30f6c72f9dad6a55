"""Elementwise formulas evaluated in one pass over memory, on every core: numexpr.

NumPy evaluates ``0.5 * x * (1 + th)`` one operator at a time, each a pass over the whole
array and a fresh temporary, on one core. numexpr (a well-kept library made for exactly
this) compiles the same expression and runs it over cache-sized blocks in several threads,
so a chain of elementwise operations costs one read of its inputs and one write of its
output. :func:`evaluate` is the one entry: the expression is the formula as written in the
plain form beside it (refmp.nn.layers, refmp.training.optim), and every scalar is handed in
as a name in the arrays' own dtype, so float32 arrays are computed in float32 as NumPy does
(a bare ``0.5`` would make numexpr compute in float64).

Results agree with NumPy's to float rounding, not always bitwise (numexpr's tanh, exp and
powers come from its own vectorised loops). Each element is computed by the same operations
wherever it is and however many threads run, so a shard of an array gets bitwise what the
whole array gets there. Only host NumPy arrays of float32 or float64 go through numexpr
(:func:`fits`); the callers keep their plain NumPy form for the rest (CuPy arrays, bf16).
"""

from __future__ import annotations

import numexpr
import numpy as np

from refmp.runtime import cpu

_threads: int | None = None  # numexpr's threads, set from cpu.threads() at first use


def fits(*arrays) -> bool:
    """Whether numexpr can run on these arrays: host NumPy arrays, float32 or float64."""
    return all(type(a) is np.ndarray and a.dtype in (np.float32, np.float64) for a in arrays)


def evaluate(expr: str, out, **names) -> None:
    """out[...] = expr over ``names`` (arrays and Python numbers; numbers are cast to
    ``out``'s dtype), in one threaded pass. ``out`` may be one of the inputs."""
    global _threads
    if _threads != cpu.threads():
        _threads = cpu.threads()
        numexpr.set_num_threads(_threads)
    scalar = out.dtype.type
    local = {k: (scalar(v) if isinstance(v, (int, float)) else v) for k, v in names.items()}
    numexpr.evaluate(expr, local_dict=local, out=out, casting="same_kind")
