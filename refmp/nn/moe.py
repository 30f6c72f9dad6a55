"""Mixture of experts: a router and E expert MLPs in place of a block's MLP (serial reference).

Shapes: B batch, T time, C channels, E experts, K experts per token (top_k), N = B*T tokens
(this rank's), M kept assignments (token, expert) after dropping, cap capacity per expert per
sequence, Emax the largest number of assignments any expert got (the padded batch size).

References: Shazeer et al. 2017 (sparsely-gated MoE); Lepikhin et al. 2020 (GShard: capacity,
dispatch by all-to-all); Fedus et al. 2021 (Switch: K = 1, load-balancing loss, eq. 4);
Zoph et al. 2022 (ST-MoE: router z-loss, eq. 5); Jiang et al. 2024 (Mixtral: top-2, gates
renormalized over the chosen experts).

The layer, for x (N, C) the output of ln_2:

    logits = x W_r                                   (N, E)   W_r = mlp.router.weight
    p      = softmax(logits)                         (N, E)
    e_n1.. e_nK = the K largest logits of token n    (ties: the lower expert index first)
    g_nk   = p[n, e_nk] / sum_j p[n, e_nj]  if K > 1 (Mixtral);  p[n, e_n1] if K = 1 (Switch)
    y_n    = sum_k keep_nk g_nk expert_{e_nk}(x_n)   (a dropped assignment adds 0: the
                                                      residual connection carries the token)
    expert_e(x) = gelu(x W1_e + b1_e) W2_e + b2_e    (GPT-2's MLP, one per expert)

and two losses added to the model loss (means over the GLOBAL batch of N_glob tokens):

    aux = alpha E sum_e f_e P_e,   f_e = (assignments to e, before dropping) / (K N_glob),
                                   P_e = sum_n p[n, e] / N_glob
    z   = beta sum_n logsumexp(logits_n)^2 / N_glob

Capacity and dropping (``capacity_keep``): each expert takes at most
cap = ceil(CF K T / E) assignments from each sequence (CF = capacity_factor; CF = 0 means no
limit). Counting per sequence makes the rule independent of how the batch is split across
ranks. Within a sequence an expert accepts assignments in this order: every token's FIRST
choice by position t = 0..T-1, then every SECOND choice by position, and so on; once it has
cap of them it drops the rest. The gates are still normalized over all K choices, dropped or
not (as GShard).

Gradients: top-k selection and dropping are piecewise constant in the weights, so no gradient
flows through *which* experts are chosen; it flows through the gate values (into p, the
softmax, the router), through the experts, and through both losses (f_e is a count:
constant; P_e and the logsumexp are smooth).

Data parallelism: f_e is a statistic of the whole global batch, so an MoE layer sums its
per-expert counts over the data-parallel ranks (one all-reduce of a (3E + 1,) buffer per
layer, ``stats_comm``) before using them. Everything else is a per-token sum divided by
N_glob, so each rank's losses are *shares* that add up over ranks to the serial value, like
the cross-entropy (refmp.parallel.data). The same buffer gives global statistics for logs.

Experts run batched: the kept assignments are sorted by expert and padded into one
(E, Emax, C) array, so each layer of the experts is one batched matmul (no loop over tokens
or experts). Padding rows compute garbage that is never read, and get zero gradient.
Where the experts live is the job of a *dispatch* object: :class:`LocalExperts` here (all of
them, no communication); refmp.parallel.expert sends tokens to sharded experts by all-to-all.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from refmp import backend
from refmp.nn import layers as L

EXPERT = re.compile(r"mlp\.experts\.(\d+)\.")
EXPERT_PARAMS = ("c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias")


def moe_param_shapes(C: int, E: int) -> dict[str, tuple[int, ...]]:
    """An MoE MLP's parameters, by their name inside the block."""
    shapes = {"mlp.router.weight": (C, E)}
    for e in range(E):
        shapes[f"mlp.experts.{e}.c_fc.weight"] = (C, 4 * C)
        shapes[f"mlp.experts.{e}.c_fc.bias"] = (4 * C,)
        shapes[f"mlp.experts.{e}.c_proj.weight"] = (4 * C, C)
        shapes[f"mlp.experts.{e}.c_proj.bias"] = (C,)
    return shapes


def capacity(capacity_factor: float, K: int, T: int, E: int) -> int:
    """Slots per expert per sequence: ceil(CF K T / E); CF = 0: no limit (K T is enough)."""
    if capacity_factor <= 0:
        return K * T
    return math.ceil(capacity_factor * K * T / E)


def capacity_keep(top, E: int, cap: int):
    """keep[b, t, k]: is the assignment of token t's k-th choice (to expert top[b, t, k]) kept?

    Within each sequence b an expert takes assignments first choices first, then by position:
    the order (k, t). Its i-th assignment in that order (i = 0, 1, ...) is kept when i < cap.
    """
    xp = backend.array_module(top)
    B, T, K = top.shape
    kt = top.transpose(0, 2, 1).reshape(B, K * T)  # (B, K*T) assignments in (k, t) order
    onehot = kt[..., None] == xp.arange(E)  # (B, K*T, E)
    seat = (xp.cumsum(onehot, axis=1) * onehot).sum(axis=-1) - 1  # (B, K*T) place in its queue
    return (seat < cap).reshape(B, K, T).transpose(0, 2, 1)  # (B, T, K)


# --- the experts, batched: (E', Emax, C) padded groups -----------------------------------------


def stack_experts(p: dict) -> tuple[list[int], dict]:
    """The experts present in ``p`` (names inside the block), sorted, stacked: (E', ...) each."""
    xp = backend.array_module(p["mlp.router.weight"])
    ids = sorted({int(m.group(1)) for k in p if (m := EXPERT.match(k))})
    w = {s: xp.stack([p[f"mlp.experts.{e}.{s}"] for e in ids]) for s in EXPERT_PARAMS}
    return ids, w


def experts_forward(w: dict, xs, counts):
    """Run expert j on its counts[j] consecutive rows of ``xs`` (M, C), all experts at once.

    ``w`` holds the stacked weights (E', C, 4C), (E', 4C), (E', 4C, C), (E', C); ``counts``
    (E',) host ints with sum M. Returns ys (M, C) in the order of xs.
    """
    xp = backend.array_module(xs)
    Ep, M, C = len(counts), xs.shape[0], xs.shape[1]
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    grp = np.repeat(np.arange(Ep), counts)  # (M,) expert of each row
    row = np.arange(M) - starts[grp]  # (M,) its place in that expert's group
    grp, row = backend.from_host(grp), backend.from_host(row)
    X = xp.zeros((Ep, max(1, int(max(counts, default=0))), C), dtype=xs.dtype)  # (E', Emax, C)
    X[grp, row] = xs
    H = X @ w["c_fc.weight"] + w["c_fc.bias"][:, None, :]  # (E', Emax, 4C)
    G, gelu = L.gelu_forward(H)  # (E', Emax, 4C)
    Y = G @ w["c_proj.weight"] + w["c_proj.bias"][:, None, :]  # (E', Emax, C)
    return Y[grp, row], (X, G, gelu, w, grp, row)  # ys (M, C)


def experts_backward(dys, cache):
    """Mirror of experts_forward: dxs (M, C) and the stacked weight gradients."""
    X, G, gelu, w, grp, row = cache
    xp = backend.array_module(dys)
    dY = xp.zeros((X.shape[0], X.shape[1], dys.shape[1]), dtype=dys.dtype)  # (E', Emax, C)
    dY[grp, row] = dys  # padding rows stay 0, so they add nothing to any gradient
    g = {}
    # forward was: Y = G @ W2 + b2
    g["c_proj.weight"] = G.transpose(0, 2, 1) @ dY  # (E', 4C, C)
    g["c_proj.bias"] = dY.sum(axis=1)  # (E', C)
    dG = dY @ w["c_proj.weight"].transpose(0, 2, 1)  # (E', Emax, 4C)
    dH = L.gelu_backward(dG, gelu)
    # forward was: H = X @ W1 + b1
    g["c_fc.weight"] = X.transpose(0, 2, 1) @ dH  # (E', C, 4C)
    g["c_fc.bias"] = dH.sum(axis=1)  # (E', 4C)
    dX = dH @ w["c_fc.weight"].transpose(0, 2, 1)  # (E', Emax, C)
    return dX[grp, row], g  # dxs (M, C)


class LocalExperts:
    """Every expert on this rank (the serial reference): no communication."""

    def forward(self, p: dict, xs, counts):
        ids, w = stack_experts(p)
        ys, cache = experts_forward(w, xs, counts)
        return ys, (ids, cache)

    def backward(self, dys, cache):
        ids, ecache = cache
        dxs, g = experts_backward(dys, ecache)
        return dxs, unstack_grads(ids, g)


def unstack_grads(ids: list[int], g: dict) -> dict:
    """Stacked expert gradients back to names inside the block."""
    return {f"mlp.experts.{e}.{s}": g[s][j] for s in EXPERT_PARAMS for j, e in enumerate(ids)}


# --- the layer -------------------------------------------------------------------------------


@dataclass
class MoEContext:
    """What an MoE layer needs besides its weights, for one forward call.

    ``denom``: the global token count N_glob of the losses (None: no losses, e.g. decoding);
    ``stats_comm``: the ranks whose tokens make up the global batch (dp), or None (serial);
    ``dispatch``: where the experts run (LocalExperts, or expert parallelism's all-to-all).
    """

    n_expert: int
    top_k: int
    capacity_factor: float
    aux_loss_coef: float
    z_loss_coef: float
    denom: int | None = None
    stats_comm: object = None
    dispatch: object = field(default_factory=LocalExperts)


class MoECache(NamedTuple):
    """What moe_backward needs, plus this rank's loss share and the layer's global stats.

    A tuple, so that code walking caches (e.g. to count activation bytes) sees inside it.
    """

    router: tuple
    probs: Any
    lse: Any
    top: Any
    chosen: Any
    gates: Any
    order: Any
    yk: Any
    dispatch_cache: Any
    ctx: MoEContext
    f: Any  # (E,) global f_e, None without losses
    loss: Any  # this rank's share of aux + z (0.0 without losses)
    stats: dict


def moe_forward(p: dict, h, ctx: MoEContext):
    """The MoE MLP on h (B, T, C); returns (out (B, T, C), MoECache). See the module doc."""
    xp = backend.array_module(h)
    B, T, C = h.shape
    E, K = ctx.n_expert, ctx.top_k
    x = h.reshape(B * T, C)  # (N, C)
    # --- router: logits, softmax, top-k, gates
    logits, router = L.linear_forward(x, p["mlp.router.weight"])  # (N, E)
    mx = logits.max(axis=-1, keepdims=True)  # (N, 1)
    lse = (mx + xp.log(xp.exp(logits - mx).sum(axis=-1, keepdims=True)))[:, 0]  # (N,)
    probs = xp.exp(logits - lse[:, None])  # (N, E)
    top = xp.argsort(-logits, axis=-1, kind="stable")[:, :K]  # (N, K) chosen experts, best first
    chosen = xp.take_along_axis(probs, top, axis=-1)  # (N, K)
    gates = chosen / chosen.sum(axis=-1, keepdims=True) if K > 1 else chosen  # (N, K)
    # --- capacity: which assignments are kept (the rule is capacity_keep's docstring)
    cap = capacity(ctx.capacity_factor, K, T, E)
    keep = capacity_keep(top.reshape(B, T, K), E, cap).reshape(B * T * K)  # (N*K,)
    # --- dispatch: kept assignments sorted by expert (then by token), run the experts
    flat = top.reshape(B * T * K)  # (N*K,) expert of assignment a = n*K + k
    kept = xp.flatnonzero(keep)  # (M,)
    order = kept[xp.argsort(flat[kept], kind="stable")]  # (M,) assignments, grouped by expert
    counts = backend.to_host(xp.bincount(flat[kept], minlength=E))  # (E,) kept per expert
    xs = x[order // K]  # (M, C) the tokens, in expert order
    ys, dcache = ctx.dispatch.forward(p, xs, counts)  # (M, C)
    # --- combine: y_n = sum_k g_nk y_nk (dropped assignments: y_nk = 0)
    yk = xp.zeros((B * T * K, C), dtype=h.dtype)  # (N*K, C)
    yk[order] = ys
    yk = yk.reshape(B * T, K, C)  # (N, K, C)
    out = (gates[..., None] * yk).sum(axis=1)  # (N, C)
    # --- statistics and losses over the global batch
    assigned = xp.bincount(flat, minlength=E)  # (E,) before dropping
    stats = xp.concatenate([assigned, xp.asarray(counts), probs.sum(axis=0),
                            (lse * lse).sum()[None]]).astype(xp.float64)  # (3E + 1,)
    if ctx.denom is not None and ctx.stats_comm is not None:
        ctx.stats_comm.allreduce(stats)  # sum over dp: the global batch's counts (exact)
    stats = backend.to_host(stats)
    g_assigned, g_kept, g_psum, g_zsum = stats[:E], stats[E:2 * E], stats[2 * E:3 * E], stats[-1]
    n_glob = ctx.denom if ctx.denom is not None else B * T
    summary = {
        "tokens_per_expert": [int(v) for v in g_kept],
        "dropped": float(1.0 - g_kept.sum() / max(1.0, g_assigned.sum())),
        "aux_loss": float(ctx.aux_loss_coef * E * (g_assigned / (K * n_glob) * g_psum).sum()
                          / n_glob),
        "z_loss": float(ctx.z_loss_coef * g_zsum / n_glob),
    }
    f, loss = None, 0.0
    if ctx.denom is not None:
        f = xp.asarray(g_assigned / (K * ctx.denom), dtype=h.dtype)  # (E,) global f_e
        aux = ctx.aux_loss_coef * E * (f * probs.sum(axis=0)).sum() / ctx.denom  # my share
        z = ctx.z_loss_coef * (lse * lse).sum() / ctx.denom  # my share
        loss = aux + z
    cache = MoECache(router, probs, lse, top, chosen, gates, order, yk, dcache, ctx, f, loss,
                     summary)
    return out.reshape(B, T, C), cache


def moe_backward(dout, cache: MoECache, dloss: float = 1.0):
    """Mirror of moe_forward: dh (B, T, C) and the layer's gradients (names inside the block).

    ``dloss`` is the gradient of the total loss with respect to itself (the aux and z losses
    enter the total with weight 1, so their gradients are scaled by it).
    """
    c = cache
    ctx = c.ctx
    xp = backend.array_module(dout)
    B, T, C = dout.shape
    N, K = B * T, ctx.top_k
    dout = dout.reshape(N, C)  # (N, C)
    # forward was: out = sum_k g_nk y_nk
    dyk = c.gates[..., None] * dout[:, None, :]  # (N, K, C)
    dgates = (c.yk * dout[:, None, :]).sum(axis=-1)  # (N, K); 0 where dropped (y_nk = 0)
    # forward was: ys = experts(xs), xs = x[order // K]
    dxs, g = ctx.dispatch.backward(dyk.reshape(N * K, C)[c.order], c.dispatch_cache)  # (M, C)
    dxk = xp.zeros((N * K, C), dtype=dout.dtype)  # (N*K, C)
    dxk[c.order] = dxs
    dx = dxk.reshape(N, K, C).sum(axis=1)  # (N, C)
    # forward was: g = chosen / sum(chosen) (K > 1), or g = chosen (K = 1)
    if K > 1:
        dchosen = (dgates - (dgates * c.gates).sum(axis=-1, keepdims=True)) / c.chosen.sum(
            axis=-1, keepdims=True)  # (N, K)
    else:
        dchosen = dgates
    # forward was: chosen = probs[n, top[n, k]] (top is constant: no gradient through it)
    dprobs = xp.zeros_like(c.probs)  # (N, E)
    dprobs[xp.arange(N)[:, None], c.top] = dchosen  # the K experts of a token are distinct
    if c.f is not None:
        # forward was: aux = alpha E sum_e f_e sum_n p[n, e] / N_glob (f_e constant)
        dprobs += dloss * ctx.aux_loss_coef * ctx.n_expert * c.f / ctx.denom  # (E,) broadcast
    # forward was: probs = softmax(logits)
    dlogits = c.probs * (dprobs - (dprobs * c.probs).sum(axis=-1, keepdims=True))  # (N, E)
    if c.f is not None:
        # forward was: z = beta sum_n lse_n^2 / N_glob, and d lse_n / d logits_n = p_n
        dlogits += (dloss * ctx.z_loss_coef * 2.0 / ctx.denom) * c.lse[:, None] * c.probs
    # forward was: logits = x @ W_r
    dxr, g["mlp.router.weight"], _ = L.linear_backward(dlogits, c.router)
    return (dx + dxr).reshape(B, T, C), g
