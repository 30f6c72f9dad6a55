"""AdamW, SGD and clipping against straightforward per-element versions of torch's algorithms."""

import importlib.util
import math

import numpy as np
import pytest
from extras import reason

from refmp.runtime.arrays import global_grad_norm
from refmp.training.optim import SGD, AdamW, clip_grad_norm, decay_names


def params_and_grads(seed=0):
    rng = np.random.default_rng(seed)
    p = {"w": rng.standard_normal((3, 4)), "b": rng.standard_normal(4)}
    gs = [{k: rng.standard_normal(v.shape) for k, v in p.items()} for _ in range(3)]
    return p, gs


def test_adamw_matches_torch_algorithm():
    """torch.optim.AdamW, written out for one scalar at a time (its documented algorithm)."""
    p, gs = params_and_grads()
    ref = {k: v.copy() for k, v in p.items()}
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.95, 1e-8, 0.1
    opt = AdamW(p, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    assert opt.decay == {"w"}  # ndim >= 2 only
    m = {k: np.zeros_like(v) for k, v in ref.items()}
    v = {k: np.zeros_like(x) for k, x in ref.items()}
    for t, g in enumerate(gs, start=1):
        opt.step(g)
        for k in ref:
            for i in np.ndindex(ref[k].shape):
                if k == "w":
                    ref[k][i] *= 1 - lr * wd
                m[k][i] = b1 * m[k][i] + (1 - b1) * g[k][i]
                v[k][i] = b2 * v[k][i] + (1 - b2) * g[k][i] ** 2
                mhat = m[k][i] / (1 - b1**t)
                vhat = v[k][i] / (1 - b2**t)
                ref[k][i] -= lr * mhat / (math.sqrt(vhat) + eps)
        for k in ref:
            np.testing.assert_allclose(p[k], ref[k], rtol=1e-12, err_msg=f"{k} at step {t}")


def test_sgd_momentum_and_decay():
    p, gs = params_and_grads(1)
    ref = {k: v.copy() for k, v in p.items()}
    opt = SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01)
    buf = {}
    for g in gs:
        opt.step(g)
        for k in ref:
            d = g[k] + (0.01 * ref[k] if k == "w" else 0)
            buf[k] = d if k not in buf else 0.9 * buf[k] + d
            ref[k] = ref[k] - 0.1 * buf[k]
    for k in ref:
        np.testing.assert_allclose(p[k], ref[k], rtol=1e-12)


def test_clip_grad_norm():
    g = {"a": np.array([3.0, 0.0]), "b": np.array([[4.0]])}
    assert global_grad_norm(g) == pytest.approx(5.0)
    norm = clip_grad_norm(g, 1.0)
    assert norm == pytest.approx(5.0)
    np.testing.assert_allclose(g["a"], [3 / (5 + 1e-6), 0])
    assert global_grad_norm(g) == pytest.approx(1.0, rel=1e-6)
    g2 = {"a": np.array([0.3, 0.4])}
    clip_grad_norm(g2, 1.0)  # below the limit: untouched
    np.testing.assert_array_equal(g2["a"], [0.3, 0.4])


def test_sharded_norm_counts_each_element_once():
    """Split a gradient in two 'ranks': the partial sums of squares, added, give the norm."""
    full = {"w": np.arange(12.0).reshape(3, 4)}
    shards = [{"w": full["w"][:, :2]}, {"w": full["w"][:, 2:]}]
    partial = [sum(float((g * g).sum()) for g in s.values()) for s in shards]
    for s, mine in zip(shards, partial, strict=True):
        others = sum(partial) - mine
        n = global_grad_norm(s, sum_sq=lambda x, o=others: x + o)
        assert n == pytest.approx(global_grad_norm(full))


def test_decay_names():
    assert decay_names({"w": np.zeros((2, 2)), "b": np.zeros(2), "e": np.zeros((3, 2))}) == {"w", "e"}


@pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                    reason=reason("torch", "hf"))
def test_adamw_and_clip_against_torch():
    import torch

    p, gs = params_and_grads(2)
    opt = AdamW(p, lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
    tp = {k: torch.tensor(v.copy(), requires_grad=True) for k, v in p.items()}
    topt = torch.optim.AdamW([{"params": [tp["w"]], "weight_decay": 0.1},
                              {"params": [tp["b"]], "weight_decay": 0.0}], lr=0.01, betas=(0.9, 0.99))
    for g in gs:
        g = {k: 10 * v for k, v in g.items()}
        for k in tp:
            tp[k].grad = torch.tensor(g[k].copy())
        tn = torch.nn.utils.clip_grad_norm_(list(tp.values()), 1.0)
        n = clip_grad_norm(g, 1.0)
        assert n == pytest.approx(float(tn), rel=1e-12)
        opt.step(g)
        topt.step()
    for k in p:
        np.testing.assert_allclose(p[k], tp[k].detach().numpy(), rtol=1e-10)
