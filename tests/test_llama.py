"""The Llama family's layers and model, serially (refmp.nn.llama_layers, refmp.nn.llama).

* every layer's backward against central finite differences (RMSNorm, the rotary rotation,
  SwiGLU, grouped-query attention with its repeated key/value heads), and the whole model's
  gradient, tied and untied;
* shapes refmp cannot compute are refused with the reason.
Parity with transformers' LlamaForCausalLM is tests/test_llama_hf.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import assert_grad_close, numeric_grad

from refmp.errors import ConfigError
from refmp.nn import llama_layers as LL
from refmp.nn.llama import Llama, LlamaConfig, Ops
from refmp.nn.llama_layers import SerialCore

RNG = np.random.default_rng(0)


def weighted(out_fn, shape):
    """A scalar loss sum(out * W) with a fixed random W: every output element matters."""
    w = np.random.default_rng(1).normal(size=shape)
    return lambda: float((out_fn() * w).sum()), w


def test_rmsnorm_grad():
    x = RNG.normal(size=(2, 3, 8))
    w = RNG.normal(size=(8,))
    loss, dout = weighted(lambda: LL.rmsnorm_forward(x, w, 1e-6)[0], x.shape)
    dx, dw = LL.rmsnorm_backward(dout, LL.rmsnorm_forward(x, w, 1e-6)[1])
    assert_grad_close("x", dx, numeric_grad(loss, x))
    assert_grad_close("w", dw, numeric_grad(loss, w))


def test_swiglu_grad():
    g = RNG.normal(size=(2, 3, 5))
    u = RNG.normal(size=(2, 3, 5))
    loss, dout = weighted(lambda: LL.swiglu_forward(g, u)[0], g.shape)
    dg, du = LL.swiglu_backward(dout, LL.swiglu_forward(g, u)[1])
    assert_grad_close("g", dg, numeric_grad(loss, g))
    assert_grad_close("u", du, numeric_grad(loss, u))


def test_rope_is_a_rotation_and_its_transpose_is_backward():
    cos, sin = LL.rope_tables(np.arange(5) + 3, 6, 10000.0, "float64")
    x = RNG.normal(size=(2, 3, 5, 6))
    y = LL.rope_forward(x, cos, sin)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1))
    loss, dout = weighted(lambda: LL.rope_forward(x, cos, sin), x.shape)
    assert_grad_close("x", LL.rope_backward(dout, cos, sin), numeric_grad(loss, x))


@pytest.mark.parametrize("n_kv_head", [1, 2])  # (4, plain multi-head: test_llama_hf.py)
def test_gqa_grad(n_kv_head):
    B, T, NH, HS = 1, 4, 4, 4
    q = RNG.normal(size=(B, T, NH * HS))
    k = RNG.normal(size=(B, T, n_kv_head * HS))
    v = RNG.normal(size=(B, T, n_kv_head * HS))
    cos, sin = LL.rope_tables(np.arange(T), HS, 100.0, "float64")

    def fwd():
        return LL.gqa_forward(q, k, v, NH, n_kv_head, cos, sin)

    loss, dout = weighted(lambda: fwd()[0], (B, T, NH * HS))
    dq, dk, dv = LL.gqa_backward(dout, fwd()[1])
    for name, a, t in (("q", dq, q), ("k", dk, k), ("v", dv, v)):
        assert_grad_close(name, a, numeric_grad(loss, t))


def test_gqa_is_multi_head_attention_on_repeated_heads():
    """n_kv_head < n_head is the same as n_head heads whose k, v are copies (Ainslie et al.)."""
    B, T, NH, HS = 1, 4, 4, 2
    q = RNG.normal(size=(B, T, NH * HS))
    k = RNG.normal(size=(B, T, 2 * HS))
    v = RNG.normal(size=(B, T, 2 * HS))
    cos, sin = LL.rope_tables(np.arange(T), HS, 100.0, "float64")
    rep = [np.repeat(a.reshape(B, T, 2, HS), 2, axis=2).reshape(B, T, NH * HS) for a in (k, v)]
    np.testing.assert_array_equal(LL.gqa_forward(q, k, v, NH, 2, cos, sin)[0],
                                  LL.gqa_forward(q, *rep, NH, NH, cos, sin)[0])


@pytest.mark.parametrize("tied", [False, True])
def test_model_grad(tied):
    cfg = LlamaConfig(vocab_size=11, block_size=8, n_layer=2, n_head=4, n_kv_head=2, n_embd=8,
                      n_inner=12, tied=tied, rope_theta=50.0)
    rng = np.random.default_rng(2)
    params = {k: rng.normal(0, 0.5, v.shape) for k, v in Llama.create(cfg, 0, "float64").params.items()}
    model = Llama(cfg, params)
    idx = rng.integers(0, 11, (2, 5))
    tgt = rng.integers(0, 11, (2, 5))
    loss, cache = model.forward(idx, tgt)
    model.zero_grad()
    model.backward(cache)
    assert ("lm_head.weight" in params) != tied
    f = lambda: float(model.forward(idx, tgt)[0])  # noqa: E731
    for name, p in params.items():  # a few elements of each (transformers checks them all)
        for i in map(tuple, rng.integers(0, p.shape, (3, p.ndim))):
            old = p[i]
            p[i] = old + 1e-6
            up = f()
            p[i] = old - 1e-6
            down = f()
            p[i] = old
            assert_grad_close(f"{name}{list(i)}", model.grads[name][i], np.array((up - down) / 2e-6))


@pytest.mark.parametrize("shape,says", [
    (dict(n_head=4, n_kv_head=3, n_embd=16), "must divide n_head"),
    (dict(n_head=4, n_kv_head=2, n_embd=12), "must be even"),  # head size 3
    (dict(n_head=5, n_kv_head=5, n_embd=16), "divisible by n_head"),
])
def test_bad_shapes_refused(shape, says):
    with pytest.raises(ConfigError, match=says):
        LlamaConfig(**shape).check()


def test_selective_recomputation_is_bitwise():
    """Without the kept softmax (SerialCore(keep_scores=False)) backward recomputes it by the
    same operations: the same gradients, bitwise."""
    cfg = LlamaConfig(vocab_size=11, block_size=8, n_layer=1, n_head=4, n_kv_head=2, n_embd=8,
                      n_inner=12)
    idx = np.random.default_rng(3).integers(0, 11, (2, 6))
    got = []
    for keep in (True, False):
        model = Llama.create(cfg, 0, "float64")
        loss, cache = model.forward(idx, idx, ops=Ops(4, 2, SerialCore(keep)))
        model.backward(cache)
        got.append(model.grads)
    for k in got[0]:
        np.testing.assert_array_equal(got[0][k], got[1][k], err_msg=k)
