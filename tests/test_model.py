"""Level 1 for the whole model: GPT-2's names and shapes, init, and the full gradient."""

import numpy as np
import pytest
from gradcheck import assert_grad_close, numeric_grad
from hypothesis import given, settings
from hypothesis import strategies as st

from refmp.nn import GPT, GPTConfig, param_shapes
from refmp.nn.gpt import init_param

pytestmark = pytest.mark.nn


def test_gpt2_names_and_shapes():
    cfg = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    shapes = param_shapes(cfg)
    assert shapes["wte.weight"] == (50257, 768) and shapes["wpe.weight"] == (1024, 768)
    assert shapes["h.11.attn.c_attn.weight"] == (768, 2304)
    assert shapes["h.0.mlp.c_proj.weight"] == (3072, 768)
    assert "lm_head.weight" not in shapes  # tied to wte
    # GPT-2 small has 124,439,808 parameters (tied head counted once)
    assert sum(int(np.prod(s)) for s in shapes.values()) == 124_439_808


def test_init_is_layout_independent_and_gpt2_like():
    cfg = GPTConfig(vocab_size=300, block_size=16, n_layer=3, n_head=2, n_embd=32)
    w = init_param("h.1.mlp.c_fc.weight", (32, 128), cfg, seed=5)
    np.testing.assert_array_equal(w, init_param("h.1.mlp.c_fc.weight", (32, 128), cfg, seed=5))
    assert not np.array_equal(w, init_param("h.2.mlp.c_fc.weight", (32, 128), cfg, seed=5))
    assert abs(w.std() - 0.02) < 0.002
    proj = init_param("h.0.attn.c_proj.weight", (128, 32), cfg, seed=5)
    assert abs(proj.std() - 0.02 / np.sqrt(6)) < 0.001  # residual projections: 1/sqrt(2L)
    assert (init_param("ln_f.weight", (32,), cfg, 5) == 1).all()
    assert (init_param("h.0.ln_1.bias", (32,), cfg, 5) == 0).all()
    m = GPT.create(cfg, seed=5, dtype="float32")
    assert all(p.dtype == np.float32 for p in m.params.values())


@settings(max_examples=4)
@given(n_layer=st.integers(1, 2), n_head=st.integers(1, 2), hs=st.integers(1, 3),
       V=st.integers(2, 6), T=st.integers(1, 4), B=st.integers(1, 2), seed=st.integers(0, 99))
def test_whole_model_gradient(n_layer, n_head, hs, V, T, B, seed):
    cfg = GPTConfig(vocab_size=V, block_size=T, n_layer=n_layer, n_head=n_head, n_embd=n_head * hs)
    m = GPT.create(cfg, seed=seed, dtype="float64")
    rng = np.random.default_rng(seed)
    for p in m.params.values():  # move off the init point (zero biases hide mistakes)
        p += 0.3 * rng.standard_normal(p.shape)
    idx, tg = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))
    loss, cache = m.forward(idx, tg)
    m.backward(cache)
    for name, p in m.params.items():
        assert_grad_close(name, m.grads[name],
                          numeric_grad(lambda: float(m.forward(idx, tg)[0]), p))


def test_float32_matches_float64():
    cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16)
    rng = np.random.default_rng(0)
    idx, tg = rng.integers(0, 11, (2, 8)), rng.integers(0, 11, (2, 8))
    m64, m32 = GPT.create(cfg, 1, "float64"), GPT.create(cfg, 1, "float32")
    l64, c64 = m64.forward(idx, tg)
    l32, c32 = m32.forward(idx, tg)
    assert l32.dtype == np.float32
    np.testing.assert_allclose(l32, l64, rtol=1e-5)
    m64.backward(c64)
    m32.backward(c32)
    for k in m64.grads:
        assert m32.grads[k].dtype == np.float32, k
        np.testing.assert_allclose(m32.grads[k], m64.grads[k], rtol=1e-3, atol=1e-6, err_msg=k)


def test_generate_is_greedy():
    cfg = GPTConfig(vocab_size=7, block_size=6, n_layer=1, n_head=1, n_embd=8)
    m = GPT.create(cfg, seed=3, dtype="float64")
    out = m.generate(np.array([[1, 2]]), 3)
    assert out.shape == (1, 5)
    logits, _ = m.forward(out[:, :4])
    assert out[0, 4] == logits[0, -1].argmax()
