"""Mixture of experts: a router and E expert MLPs in place of a block's MLP (serial reference).

Shapes: B batch, T time, C channels, E experts, K experts per token (top_k), N = B*T tokens
(this rank's), M kept assignments (token, expert) after dropping, cap capacity per expert per
sequence.

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

and two losses added to the model loss, both per-token sums over N_glob (the global token
count, B_glob T), so that every rank's part is a *share* like the cross-entropy's:

    aux = alpha E / N_glob  sum_b sum_t sum_e f_be p[b, t, e],
          f_be = (assignments of sequence b to e, before dropping) / (K T)
    z   = beta / N_glob  sum_n logsumexp(logits_n)^2

The load-balancing loss is per sequence (DeepSeek-V3's sequence-wise balance loss, Megatron's
``seq_aux_loss``): for one sequence, E sum_e f_be P_be with P_be its mean router probability,
averaged over the batch. A global-batch f_e (Switch, eq. 4) cannot be known in a pipeline:
1F1B runs the first micro-batch's backward before the last one's forward. Per sequence, it
depends on nothing but the sequence, so no layout changes it.

Capacity and dropping (``capacity_keep``): each expert takes at most
cap = ceil(CF K T / E) assignments from each sequence (CF = capacity_factor; CF = 0 means no
limit). Counting per sequence makes the rule independent of how the batch is split across
ranks. Within a sequence an expert accepts assignments in this order: every token's FIRST
choice by position t = 0..T-1, then every SECOND choice by position, and so on; once it has
cap of them it drops the rest. The gates are still normalized over all K choices, dropped or
not (as GShard).

Gradients: top-k selection and dropping are piecewise constant in the weights, so no gradient
flows through *which* experts are chosen; it flows through the gate values (into p, the
softmax, the router), through the experts, and through both losses (f_be is a count:
constant; p and the logsumexp are smooth).

A sequence split over ranks (context parallelism, or sequence parallelism over tp): the
dropping rule and f_be need the whole sequence's choices, so ``ctx.seq`` (refmp.parallel.
expert.SequenceSplit) all-gathers the small (B, T, K) index of chosen experts over those
ranks and sums the (B, E) counts; everything else stays per token.

The experts run on the kept assignments sorted by expert (refmp.nn.experts), wherever the
context's *dispatch* puts them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from refmp.nn import layers as L
from refmp.nn.experts import LocalExperts
from refmp.nn.routing import routing_summary
from refmp.runtime import backend
from refmp.runtime.precision import autocast


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


# --- the layer -------------------------------------------------------------------------------


@dataclass
class MoEContext:
    """What an MoE layer needs besides its weights, for one forward call.

    ``denom``: the global token count N_glob of the losses (None: no losses, e.g. decoding);
    ``dispatch``: where the experts run (LocalExperts, or expert parallelism's all-to-all);
    ``seq``: the ranks a sequence is split over (refmp.parallel.expert.SequenceSplit), or
    None when each rank holds whole sequences.
    """

    n_expert: int
    top_k: int
    capacity_factor: float
    aux_loss_coef: float
    z_loss_coef: float
    denom: int | None = None
    dispatch: object = field(default_factory=LocalExperts)
    seq: object = None


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
    f: Any  # (B, E) f_be of each sequence, None without losses
    loss: Any  # this rank's share of aux + z (0.0 without losses)
    stats: dict  # this rank's routing figures; "raw": [assigned (E), kept (E), aux, z]


@autocast
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
    top_bt = top.reshape(B, T, K)  # (B, T, K) my tokens' choices
    full = top_bt if ctx.seq is None else ctx.seq.gather(top_bt)  # (B, T_seq, K) whole sequences
    Ts = full.shape[1]  # the sequence's length (T, or T * ranks when split)
    keep = capacity_keep(full, E, capacity(ctx.capacity_factor, K, Ts, E))  # (B, T_seq, K)
    keep = (keep if ctx.seq is None else ctx.seq.mine(keep)).reshape(B * T * K)  # (N*K,)
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
    # --- losses: shares of per-token sums over the global token count (module docstring)
    f, loss, aux, z = None, 0.0, 0.0, 0.0
    if ctx.denom is not None:
        onehot = (top_bt[..., None] == xp.arange(E)).sum(axis=2)  # (B, T, E) my assignments
        per_seq = onehot.sum(axis=1).astype(h.dtype)  # (B, E)
        if ctx.seq is not None:
            per_seq = ctx.seq.sum(per_seq)  # the whole sequences' counts
        f = per_seq / (K * Ts)  # (B, E) f_be
        aux = ctx.aux_loss_coef * E * (f * probs.reshape(B, T, E).sum(axis=1)).sum() / ctx.denom
        z = ctx.z_loss_coef * (lse * lse).sum() / ctx.denom  # my share
        loss = aux + z
    # --- this rank's routing figures, for logs (refmp.nn.routing; the engine sums them)
    assigned = backend.to_host(xp.bincount(flat, minlength=E))  # (E,) before dropping
    raw = np.concatenate([assigned, counts, [float(aux), float(z)]]).astype(np.float64)
    stats = routing_summary(raw, E)
    cache = MoECache(router, probs, lse, top, chosen, gates, order, yk, dcache, ctx, f, loss,
                     stats)
    return out.reshape(B, T, C), cache


@autocast
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
        # forward was: aux = alpha E sum_{b,t,e} f_be p[b, t, e] / N_glob (f_be constant)
        Bs = c.f.shape[0]
        dp_aux = (dloss * ctx.aux_loss_coef * ctx.n_expert / ctx.denom) * c.f  # (B, E)
        dprobs += xp.repeat(dp_aux, N // Bs, axis=0)  # (N, E): each token, its sequence's
    # forward was: probs = softmax(logits)
    dlogits = c.probs * (dprobs - (dprobs * c.probs).sum(axis=-1, keepdims=True))  # (N, E)
    if c.f is not None:
        # forward was: z = beta sum_n lse_n^2 / N_glob, and d lse_n / d logits_n = p_n
        dlogits += (dloss * ctx.z_loss_coef * 2.0 / ctx.denom) * c.lse[:, None] * c.probs
    # forward was: logits = x @ W_r
    dxr, g["mlp.router.weight"], _ = L.linear_backward(dlogits, c.router)
    return (dx + dxr).reshape(B, T, C), g
