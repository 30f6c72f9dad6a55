"""Mixed precision: the compute dtypes, and the one place that decides how a layer runs in them.

Micikevicius et al. 2018, "Mixed Precision Training": the weights the model computes with,
its activations and (by default) its gradients are held in a 16-bit dtype, bf16 or fp16; the
optimizer keeps fp32 *master* weights and its moments (refmp.parallel.data.sharder), and fp16
scales the loss so that small gradients do not flush to zero (refmp.training.optim.LossScaler).

On the CPU there is no bf16 (and no useful fp16) matrix multiply in BLAS. So a layer given
16-bit arrays runs the way tensor cores do: its inputs are already rounded to the compute
dtype; :func:`autocast` widens them to fp32, the layer's own code multiplies, normalizes and
reduces in fp32 (LayerNorm statistics, softmax, cross-entropy included), and every array it
returns (its output, its gradients, the arrays in its cache) is rounded to the compute dtype.
The numerics are those of mixed precision, and the memory ledger counts what a 16-bit run
holds: 2 bytes per cached element. NumPy has bf16 through the ``ml_dtypes`` package.

With fp32 or fp64 arrays :func:`autocast` calls the layer unchanged: runs without
``--mixed-precision`` are bitwise those of the plain layers.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

from refmp.runtime.arrays import leaves, map_leaves

BF16 = np.dtype(ml_dtypes.bfloat16)
FP16 = np.dtype(np.float16)
LOW = (BF16, FP16)
_LOW_SET = frozenset(LOW)
COMPUTE = {"bf16": BF16, "fp16": FP16}  # --mixed-precision -> the compute dtype


def mixed_dtypes(cfg):
    """(compute dtype, gradient dtype) of a TrainConfig: (None, None) without mixed precision;
    the gradients in the compute dtype, or fp32 with ``--grad-dtype fp32``."""
    if cfg.mixed_precision == "none":
        return None, None
    compute = COMPUTE[cfg.mixed_precision]
    return compute, (compute if cfg.grad_dtype == "compute" else np.dtype(np.float32))


def _low_of(obj):
    """The first 16-bit dtype among the arrays in ``obj`` (its leaves), or None.

    Called on every layer's arguments: dtype membership in a set (a dtype's == converts its
    operand, which is slow)."""
    for o in leaves(obj):
        dt = getattr(o, "dtype", None)
        if dt is not None and dt in _LOW_SET and hasattr(o, "shape"):
            return dt
    return None


def _is_array(obj) -> bool:
    """An array of at least one dimension (0-d results, a loss, are not cast)."""
    return (hasattr(obj, "shape") and hasattr(obj, "astype") and not np.isscalar(obj)
            and getattr(obj, "ndim", 0) > 0)


def autocast(layer):
    """Run ``layer`` in fp32 when its array arguments are bf16 or fp16, rounding the arrays it
    returns (outputs, gradients, caches) back to that dtype. 0-d results (a loss) stay fp32.

    Identity (map_leaves' contract, refmp.runtime.arrays): an argument handed back as it came
    (a weight a cache keeps) is returned as the caller's own array, not a rounded copy, and
    with no 16-bit argument the layer's results are returned as they are: ZeRO-3 finds its
    weights in caches by ``id``, and the activation ledger leaves them out by ``id``.
    """

    @functools.wraps(layer)
    def run(*args, **kwargs):
        low = _low_of(args) or _low_of(kwargs)
        if low is None:
            return layer(*args, **kwargs)  # fp32 / fp64: the layer itself, bitwise
        wide: dict[int, tuple] = {}  # id(fp32 copy) -> (the copy, the caller's array)

        def up(a):
            if not _is_array(a) or a.dtype != low:
                return a
            w = a.astype(np.float32)
            wide[id(w)] = (w, a)  # the copy stays alive: its id cannot be reused meanwhile
            return w

        out = layer(*map_leaves(args, up), **map_leaves(kwargs, up))

        narrow: dict[int, object] = {}  # id(fp32 result) -> its rounded copy, made once

        def down(a):
            if not _is_array(a):
                return a
            if id(a) in wide:
                return wide[id(a)][1]
            if a.dtype != np.float32:
                return a
            if id(a) not in narrow:  # an array returned twice (an output its cache keeps too)
                narrow[id(a)] = a.astype(low)  # is rounded once: one array, as in fp32
            return narrow[id(a)]

        return map_leaves(out, down)

    return run
