"""Central finite differences in float64, with messages that name the tensor and the index."""

from __future__ import annotations

import numpy as np


def numeric_grad(f, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """d f() / d x by central differences, perturbing ``x`` in place (restored after)."""
    g = np.zeros_like(x, dtype=np.float64)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + eps
        fp = f()
        x[i] = old - eps
        fm = f()
        x[i] = old
        g[i] = (fp - fm) / (2 * eps)
    return g


def assert_grad_close(name: str, analytic, numeric, rtol: float = 1e-5, atol: float = 1e-8):
    """Fail with the tensor's name, the worst index and both values."""
    analytic = np.asarray(analytic, dtype=np.float64)
    assert analytic.shape == numeric.shape, f"{name}: shape {analytic.shape} != {numeric.shape}"
    err = np.abs(analytic - numeric) - (atol + rtol * np.abs(numeric))
    if (err > 0).any():
        i = np.unravel_index(np.argmax(err), err.shape)
        raise AssertionError(
            f"gradient of {name} wrong at index {tuple(int(j) for j in i)}: "
            f"backward {analytic[i]:.10g}, finite difference {numeric[i]:.10g}"
        )
