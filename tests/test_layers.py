"""Level 1: every backward function against central finite differences (float64).

Each check builds loss = sum(forward(...) * R) for a fixed random R, so dout = R, and compares
the backward's gradients with finite differences of that loss. Shapes come from hypothesis.
"""

import numpy as np
import pytest
from gradcheck import assert_grad_close, numeric_grad
from hypothesis import given
from hypothesis import strategies as st

from refmp.nn import layers as L

pytestmark = pytest.mark.nn

small = st.integers(1, 4)


def rand(rng, *shape):
    return rng.standard_normal(shape)


@given(B=small, T=small, cin=small, cout=small, bias=st.booleans(), seed=st.integers(0, 99))
def test_linear(B, T, cin, cout, bias, seed):
    rng = np.random.default_rng(seed)
    x, w, b = rand(rng, B, T, cin), rand(rng, cin, cout), rand(rng, cout) if bias else None
    R = rand(rng, B, T, cout)

    def loss():
        return float((L.linear_forward(x, w, b)[0] * R).sum())

    dx, dw, db = L.linear_backward(R, L.linear_forward(x, w, b)[1])
    assert_grad_close("x", dx, numeric_grad(loss, x))
    assert_grad_close("w", dw, numeric_grad(loss, w))
    if bias:
        assert_grad_close("b", db, numeric_grad(loss, b))
    else:
        assert db is None


@given(B=small, T=small, C=st.integers(2, 6), seed=st.integers(0, 99))
def test_layernorm(B, T, C, seed):
    rng = np.random.default_rng(seed)
    x, w, b, R = rand(rng, B, T, C), rand(rng, C), rand(rng, C), rand(rng, B, T, C)

    def loss():
        return float((L.layernorm_forward(x, w, b)[0] * R).sum())

    out, cache = L.layernorm_forward(x, w, b)
    np.testing.assert_allclose(((out - b) / w).mean(-1), 0, atol=1e-10)  # normalized
    dx, dw, db = L.layernorm_backward(R, cache)
    for name, a, t in (("x", dx, x), ("w", dw, w), ("b", db, b)):
        assert_grad_close(name, a, numeric_grad(loss, t))


@given(shape=st.lists(small, min_size=1, max_size=3), seed=st.integers(0, 99))
def test_gelu(shape, seed):
    rng = np.random.default_rng(seed)
    x = 2 * rand(rng, *shape)
    R = rand(rng, *shape)
    out, cache = L.gelu_forward(x)
    ref = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(out, ref, rtol=1e-14)
    assert_grad_close("x", L.gelu_backward(R, cache),
                      numeric_grad(lambda: float((L.gelu_forward(x)[0] * R).sum()), x))


@given(B=small, T=small, V=st.integers(2, 7), C=small, seed=st.integers(0, 99))
def test_embedding(B, T, V, C, seed):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, V, (B, T))  # repeated ids must accumulate
    w, R = rand(rng, V, C), rand(rng, B, T, C)
    out, cache = L.embedding_forward(idx, w)
    np.testing.assert_array_equal(out, w[idx])
    assert_grad_close("w", L.embedding_backward(R, cache),
                      numeric_grad(lambda: float((L.embedding_forward(idx, w)[0] * R).sum()), w))


@given(B=small, T=st.integers(1, 5), NH=st.integers(1, 3), HS=st.integers(1, 3),
       seed=st.integers(0, 99))
def test_attention(B, T, NH, HS, seed):
    rng = np.random.default_rng(seed)
    C = NH * HS
    qkv, R = rand(rng, B, T, 3 * C), rand(rng, B, T, C)

    def loss():
        return float((L.attention_forward(qkv, NH)[0] * R).sum())

    out, cache = L.attention_forward(qkv, NH)
    # an independent, loop-based reference: one head and one query position at a time
    q, k, v = np.split(qkv, 3, axis=-1)
    ref = np.zeros((B, T, C))
    for h in range(NH):
        s = slice(h * HS, (h + 1) * HS)
        for t in range(T):
            sc = np.einsum("bc,bjc->bj", q[:, t, s], k[:, : t + 1, s]) / np.sqrt(HS)
            p = np.exp(sc - sc.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            ref[:, t, s] = np.einsum("bj,bjc->bc", p, v[:, : t + 1, s])
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-14)
    assert_grad_close("qkv", L.attention_backward(R, cache), numeric_grad(loss, qkv))


@given(N=st.integers(1, 6), V=st.integers(2, 7), scale=st.sampled_from([1.0, 30.0]),
       denom=st.sampled_from([None, 17]), seed=st.integers(0, 99))
def test_cross_entropy(N, V, scale, denom, seed):
    rng = np.random.default_rng(seed)
    logits = scale * rand(rng, 2, N, V)  # scale 30: large logits must stay finite (stable)
    tg = rng.integers(0, V, (2, N))

    def loss():
        return float(L.cross_entropy_forward(logits, tg, denom)[0])

    value, cache = L.cross_entropy_forward(logits, tg, denom)
    lp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    ref = -np.take_along_axis(lp, tg[..., None], -1).sum() / (denom or 2 * N)
    np.testing.assert_allclose(value, ref, rtol=1e-12)
    assert_grad_close("logits", L.cross_entropy_backward(1.0, cache), numeric_grad(loss, logits))


def test_tied_head():
    """dh and dwte of loss(h wte^T) against finite differences."""
    rng = np.random.default_rng(0)
    h, wte, tg = rand(rng, 2, 3, 4), rand(rng, 5, 4), rng.integers(0, 5, (2, 3))

    def loss():
        return float(L.cross_entropy_forward(h @ wte.T, tg)[0])

    dh, dwte = L.tied_head_backward(1.0, L.cross_entropy_forward(h @ wte.T, tg)[1], h, wte)
    assert_grad_close("h", dh, numeric_grad(loss, h))
    assert_grad_close("wte", dwte, numeric_grad(loss, wte))
