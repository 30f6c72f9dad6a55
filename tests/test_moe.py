"""Level 1 for mixture of experts: the routing rules, and finite-difference gradients (float64).

Top-k selection and capacity dropping are piecewise constant, so finite differences are only
valid away from their switching points: every example checks that the router's logits are
far (> 1e-3) from a tie between the K-th and the (K+1)-th expert, so that no perturbation
(1e-6) changes the routing.
"""

import numpy as np
import pytest
from gradcheck import assert_grad_close, numeric_grad
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from refmp.nn import GPT, GPTConfig, param_shapes
from refmp.nn import moe as M
from refmp.nn.gpt import init_param
from refmp.nn.routing import forward_summary

pytestmark = pytest.mark.nn


def layer_params(C, E, rng, scale=0.5):
    shapes = M.moe_param_shapes(C, E)
    return {k: scale * rng.standard_normal(s) for k, s in shapes.items()}


def ctx(E, K, cf, denom=None):
    return M.MoEContext(E, K, cf, aux_loss_coef=0.1, z_loss_coef=0.01, denom=denom)


def routing_margin(p, h, K):
    """The smallest gap between a token's K-th and (K+1)-th logit (inf when K = E)."""
    logits = np.sort(h.reshape(-1, h.shape[-1]) @ p["mlp.router.weight"], axis=-1)[:, ::-1]
    if K == logits.shape[1]:
        return np.inf
    return float((logits[:, K - 1] - logits[:, K]).min())


def test_capacity_rule_first_choices_first_then_by_position():
    # one sequence, T = 4 tokens, K = 2, E = 2, cap 3: expert 0 is everyone's first choice
    top = np.array([[[0, 1], [0, 1], [0, 1], [1, 0]]])  # (B, T, K)
    keep = M.capacity_keep(top, E=2, cap=3)
    # expert 0 takes first choices at t = 0, 1, 2, then is full: t = 3's second choice drops
    # expert 1 takes t = 3's first choice, then second choices at t = 0, 1; t = 2's drops
    np.testing.assert_array_equal(keep[0], [[1, 1], [1, 1], [1, 0], [1, 0]])
    assert M.capacity(1.0, 2, 4, 2) == 4 and M.capacity(1.25, 1, 5, 4) == 2
    assert M.capacity(0.0, 2, 4, 2) == 8  # no limit


def test_capacity_is_counted_per_sequence():
    """Each sequence of a batch has cap seats per expert, its own: B = 2, T = 3, K = 1,
    cap 2. Sequence 0 sends 2 tokens to expert 0, which keeps both; sequence 1 sends it 3,
    which keeps its first 2, whatever sequence 0 took (a queue over the whole batch would
    drop all of sequence 1's)."""
    top = np.array([[[0], [0], [1]], [[0], [0], [0]]])  # (B, T, K)
    keep = M.capacity_keep(top, E=2, cap=2)
    np.testing.assert_array_equal(keep[..., 0], [[1, 1, 1], [1, 1, 0]])
    # K = 2, first choices first within each sequence: the two rows are the rule's example
    # and its mirror (experts swapped), each taken as if alone
    one = np.array([[[0, 1], [0, 1], [0, 1], [1, 0]]])
    both = M.capacity_keep(np.concatenate([one, 1 - one]), E=2, cap=3)
    np.testing.assert_array_equal(both, np.concatenate([M.capacity_keep(one, 2, 3)] * 2))


@pytest.mark.parametrize("K", [1, 2])
def test_a_batch_routes_each_sequence_as_if_alone(K):
    """B = 3 sequences through the layer with drops (cf 0.5): each one's output, kept
    assignments and loss share are those of the same sequence run alone (the capacity is
    ceil(CF K T / E) per sequence; DeepSeek-V3's balance loss per sequence too)."""
    rng = np.random.default_rng(10 + K)
    C, E, T, B = 4, 3, 6, 3
    p = layer_params(C, E, rng)
    h = rng.standard_normal((B, T, C))
    out, cache = M.moe_forward(p, h, ctx(E, K, cf=0.5, denom=B * T))
    keep = M.capacity_keep(cache.top.reshape(B, T, K), E, M.capacity(0.5, K, T, E))
    assert not keep.all() and keep.any()
    shares = []
    for b in range(B):
        alone, one = M.moe_forward(p, h[b:b + 1], ctx(E, K, cf=0.5, denom=B * T))
        np.testing.assert_allclose(out[b], alone[0], rtol=1e-12, atol=1e-12, err_msg=f"{b}")
        assert keep[b].mean() == pytest.approx(1 - one.stats["dropped"]), b
        shares.append(float(one.loss))
    assert float(cache.loss) == pytest.approx(sum(shares), rel=1e-12)


@pytest.mark.parametrize("K", [1, 2])
def test_gates_and_dropped_tokens(K):
    rng = np.random.default_rng(K)
    C, E, T = 4, 3, 6
    p = layer_params(C, E, rng)
    h = rng.standard_normal((1, T, C))
    out, cache = M.moe_forward(p, h, ctx(E, K, cf=0.5))  # cap = ceil(0.5 K T / E): drops
    gsum = cache.gates.sum(axis=-1)
    if K == 2:
        np.testing.assert_allclose(gsum, 1.0)  # renormalized (Mixtral)
    else:
        np.testing.assert_allclose(cache.gates[:, 0], cache.probs.max(axis=-1))  # raw (Switch)
    keep = M.capacity_keep(cache.top.reshape(1, T, K), E, M.capacity(0.5, K, T, E))
    assert not keep.all()
    # a token whose every assignment dropped gets exactly 0 from the layer
    x = h.reshape(T, C)
    for n in range(T):
        expect = np.zeros(C)
        for k in range(K):
            if keep[0, n, k]:
                e = cache.top[n, k]
                hid = M.L.gelu_forward(x[n] @ p[f"mlp.experts.{e}.c_fc.weight"]
                                       + p[f"mlp.experts.{e}.c_fc.bias"])[0]
                y = hid @ p[f"mlp.experts.{e}.c_proj.weight"] + p[f"mlp.experts.{e}.c_proj.bias"]
                expect += cache.gates[n, k] * y
        np.testing.assert_allclose(out[0, n], expect, rtol=1e-12, atol=1e-12)
    assert cache.stats["dropped"] == pytest.approx(1 - keep.sum() / keep.size)
    assert sum(cache.stats["tokens_per_expert"]) == keep.sum()


@settings(max_examples=5)
@given(E=st.integers(1, 4), K=st.integers(1, 2), cf=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
       B=st.integers(1, 2), T=st.integers(1, 4), seed=st.integers(0, 1000))
def test_moe_layer_gradient(E, K, cf, B, T, seed):
    assume(K <= E)
    rng = np.random.default_rng(seed)
    C = 3
    p = layer_params(C, E, rng)
    h = rng.standard_normal((B, T, C))
    assume(routing_margin(p, h, K) > 1e-3)
    R = rng.standard_normal((B, T, C))  # a random linear read-out of the output
    denom = B * T + 3  # as on a data-parallel rank: the global count exceeds ours

    def f():
        out, cache = M.moe_forward(p, h, ctx(E, K, cf, denom))
        return float((out * R).sum() + cache.loss)

    out, cache = M.moe_forward(p, h, ctx(E, K, cf, denom))
    dh, g = M.moe_backward(R, cache, dloss=1.0)
    assert_grad_close("h", dh, numeric_grad(f, h))
    for name in p:
        assert_grad_close(name, g[name], numeric_grad(f, p[name]))


def test_aux_losses_values():
    rng = np.random.default_rng(0)
    C, E, K, T = 4, 4, 2, 5
    p = layer_params(C, E, rng)
    h = rng.standard_normal((2, T, C))
    _, cache = M.moe_forward(p, h, ctx(E, K, 1.0, denom=2 * T))
    logits = h.reshape(-1, C) @ p["mlp.router.weight"]
    lse = np.log(np.exp(logits).sum(axis=-1))
    probs = np.exp(logits - lse[:, None])
    top = np.argsort(-logits, axis=-1)[:, :K].reshape(2, T, K)
    # per sequence (DeepSeek-V3's sequence-wise balance loss), averaged over the 2 sequences
    f = np.stack([np.bincount(top[b].ravel(), minlength=E) / (K * T) for b in range(2)])
    P = probs.reshape(2, T, E).mean(axis=1)  # (2, E)
    aux = 0.1 * E * (f * P).sum(axis=1).mean()
    z = 0.01 * (lse**2).mean()
    assert cache.loss == pytest.approx(aux + z, rel=1e-12)
    assert cache.stats["aux_loss"] == pytest.approx(aux, rel=1e-12)
    assert cache.stats["z_loss"] == pytest.approx(z, rel=1e-12)
    # perfectly balanced routing and uniform probabilities give aux = alpha (its minimum)
    assert 0.1 * E * (np.full(E, 1 / E) * np.full(E, 1 / E)).sum() == pytest.approx(0.1)


def test_moe_names_shapes_and_init():
    cfg = GPTConfig(vocab_size=10, block_size=8, n_layer=3, n_head=2, n_embd=8, n_expert=4,
                    top_k=2, moe_every=2)
    shapes = param_shapes(cfg)
    assert shapes["h.0.mlp.router.weight"] == (8, 4)
    assert shapes["h.0.mlp.experts.3.c_fc.weight"] == (8, 32)
    assert shapes["h.2.mlp.experts.0.c_proj.bias"] == (8,)
    assert "h.1.mlp.c_fc.weight" in shapes and "h.1.mlp.router.weight" not in shapes
    assert "h.0.mlp.c_fc.weight" not in shapes
    big = GPTConfig(vocab_size=10, block_size=8, n_layer=3, n_head=2, n_embd=64, n_expert=4)
    w = init_param("h.0.mlp.experts.1.c_proj.weight", (256, 64), big, seed=1)
    assert abs(w.std() - 0.02 / np.sqrt(6)) < 0.001  # scaled like GPT-2's c_proj
    w2 = init_param("h.0.mlp.experts.2.c_proj.weight", (256, 64), big, seed=1)
    assert not np.array_equal(w, w2)  # every expert its own draw


@settings(max_examples=3)
@given(E=st.integers(2, 4), K=st.integers(1, 2), cf=st.sampled_from([0.0, 0.7, 1.5]),
       moe_every=st.integers(1, 2), seed=st.integers(0, 99))
def test_moe_model_gradient(E, K, cf, moe_every, seed):
    cfg = GPTConfig(vocab_size=5, block_size=4, n_layer=2, n_head=1, n_embd=3, n_expert=E,
                    top_k=K, moe_every=moe_every, capacity_factor=cf, aux_loss_coef=0.1,
                    z_loss_coef=0.01)
    m = GPT.create(cfg, seed=seed, dtype="float64")
    rng = np.random.default_rng(seed)
    for p in m.params.values():
        p += 0.3 * rng.standard_normal(p.shape)
    idx, tg = rng.integers(0, 5, (2, 4)), rng.integers(0, 5, (2, 4))
    loss, cache = m.forward(idx, tg)
    for c in cache[1]:
        if isinstance(c[-1], M.MoECache):
            gap = np.sort(c[-1].router[0] @ c[-1].router[1], axis=-1)
            assume(K == E or (gap[:, -K] - gap[:, -K - 1]).min() > 1e-3)
    m.backward(cache)
    assert loss > 0 and forward_summary(cache)["moe"]["aux_loss"] > 0
    for name, p in m.params.items():
        assert_grad_close(name, m.grads[name],
                          numeric_grad(lambda: float(m.forward(idx, tg)[0]), p))
