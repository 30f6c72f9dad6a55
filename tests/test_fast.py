"""refmp.nn.fast against refmp.nn.layers: each fast form gives its plain formula's results.

The plain layers are checked against finite differences (tests/test_layers.py); the fast
forms, which the model and every layout run, must agree with them: every output, every
gradient, in float32 and float64, on odd shapes (rows that do not divide into blocks, a
sequence that is not a multiple of the attention block, a vocabulary that is not a multiple
of the chunk). Where the fast form runs other operations (fused, reordered, in blocks) the
agreement is to float rounding; ``BITWISE`` names the ones that run the same operations.
"""

from __future__ import annotations

import numpy as np
import pytest

from refmp.nn import fast as F
from refmp.nn import flash
from refmp.nn import layers as L

pytestmark = pytest.mark.nn

TOL = {np.float32: dict(rtol=2e-5, atol=2e-6), np.float64: dict(rtol=1e-11, atol=1e-13)}
DTYPES = [np.float32, np.float64]


def close(name, fast, plain, dtype):
    fast, plain = np.asarray(fast), np.asarray(plain)
    assert fast.shape == plain.shape and fast.dtype == plain.dtype, (name, fast.shape, plain.shape)
    np.testing.assert_allclose(fast, plain, err_msg=name, **TOL[dtype])


def both(name, args_f, dout, dtype):
    """Forward and backward of layer ``name`` in both modules; every result compared."""
    fwd, bwd = f"{name}_forward", f"{name}_backward"
    y_p, c_p = getattr(L, fwd)(*args_f)
    y_f, c_f = getattr(F, fwd)(*args_f)
    close(f"{name} forward", y_f, y_p, dtype)
    g_p, g_f = getattr(L, bwd)(dout, c_p), getattr(F, bwd)(dout, c_f)
    g_p, g_f = (g if isinstance(g, tuple) else (g,) for g in (g_p, g_f))
    for i, (a, b) in enumerate(zip(g_f, g_p, strict=True)):
        close(f"{name} backward, gradient {i}", a, b, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layernorm_and_gelu_agree(dtype):
    rng = np.random.default_rng(0)
    B, T, C = 3, 7, 24
    x, d = (rng.standard_normal((B, T, C)).astype(dtype) for _ in range(2))
    w, b = (rng.standard_normal(C).astype(dtype) for _ in range(2))
    both("layernorm", (x, w, b), d, dtype)
    both("gelu", (2 * x,), d, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("block", [4, 128])  # several query blocks (the last one short), or one
def test_attention_agrees(dtype, keep, block, monkeypatch):
    monkeypatch.setattr(flash, "BLOCK", block)
    rng = np.random.default_rng(1)
    B, T, C, NH = 2, 13, 24, 4
    qkv = rng.standard_normal((B, T, 3 * C)).astype(dtype)
    d = rng.standard_normal((B, T, C)).astype(dtype)
    both("attention", (qkv, NH, keep), d, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [8, 8192])  # several vocabulary chunks (the last one short), or one
def test_cross_entropy_and_tied_head_agree(dtype, chunk, monkeypatch):
    monkeypatch.setattr(F, "VOCAB_CHUNK", chunk)
    rng = np.random.default_rng(2)
    B, T, C, V = 2, 5, 6, 37
    h = rng.standard_normal((B, T, C)).astype(dtype)
    wte = rng.standard_normal((V, C)).astype(dtype)
    targets = rng.integers(0, V, (B, T))
    targets[0, :3] = [0, 8, V - 1]  # targets at the chunks' edges
    logits = 3 * h @ wte.T  # (B, T, V)
    l_p, c_p = L.cross_entropy_forward(logits, targets, 17)
    l_f, c_f = F.cross_entropy_forward(logits, targets, 17)
    close("cross-entropy loss", l_f, l_p, dtype)
    close("cross-entropy dlogits", F.cross_entropy_backward(0.5, c_f),
          L.cross_entropy_backward(0.5, c_p), dtype)
    for i, (a, b) in enumerate(zip(F.tied_head_backward(0.5, c_f, h, wte),
                                   L.tied_head_backward(0.5, c_p, h, wte), strict=True)):
        close(f"tied head gradient {i}", a, b, dtype)

def test_attention_keeps_no_scores():
    """The fast attention's cache holds nothing of size T x T: q, k, v, its output, the lse."""
    B, T, C, NH = 1, 64, 16, 2
    qkv = np.random.default_rng(3).standard_normal((B, T, 3 * C))
    _, cache = F.attention_forward(qkv, NH)
    assert all(getattr(a, "size", 0) < T * T for a in cache), [getattr(a, "shape", a) for a in cache]
