"""The experts of a Mixtral-style MoE layer (Jiang et al. 2024): each runs the Llama MLP,
SwiGLU, on its own consecutive rows.

Shapes: M kept assignments (token, expert), sorted by expert; E' experts held here; C
channels; F the MLP's width.

    expert_e(x) = (silu(x Wgate_e) * (x Wup_e)) Wdown_e      (no biases)

The dispatch object of refmp.nn.moe for these experts is refmp.nn.experts.LocalExperts (under
expert parallelism refmp.parallel.expert.ExpertDispatch), given this module as its ``kind``,
in place of refmp.nn.experts' GPT-2 MLPs: the router, top-k, renormalized gates and
dropping are refmp.nn.moe's, unchanged. As there, expert j's rows are one consecutive
block, so each of its three linears is one matrix product on exactly those rows, and SwiGLU
runs once on all of them.
"""

from __future__ import annotations

from refmp.nn.experts import EXPERT, expert_rows
from refmp.nn.llama_layers import swiglu_backward, swiglu_forward
from refmp.runtime import backend

EXPERT_PARAMS = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def stack_experts(p: dict) -> tuple[list[int], dict]:
    """The experts present in ``p`` (names inside the block), sorted, stacked: (E', ...) each."""
    xp = backend.array_module(p["mlp.router.weight"])
    ids = sorted({int(m.group(1)) for k in p if (m := EXPERT.match(k))})
    return ids, {s: xp.stack([p[f"mlp.experts.{e}.{s}"] for e in ids]) for s in EXPERT_PARAMS}


def experts_forward(w: dict, xs, counts):
    """Run expert j on its counts[j] consecutive rows of ``xs`` (M, C); ``w`` the stacked
    (E', C, F), (E', C, F), (E', F, C). Returns ys (M, C) in the order of xs."""
    xp = backend.array_module(xs)
    rows_of = expert_rows(counts)
    F = w["gate_proj.weight"].shape[2]
    G = xp.empty((xs.shape[0], F), dtype=xs.dtype)  # (M, F) the gate projection
    U = xp.empty_like(G)  # (M, F) the up projection
    for j, r in enumerate(rows_of):
        xp.matmul(xs[r], w["gate_proj.weight"][j], out=G[r])
        xp.matmul(xs[r], w["up_proj.weight"][j], out=U[r])
    S, sw = swiglu_forward(G, U)  # (M, F)
    ys = xp.empty_like(xs)  # (M, C)
    for j, r in enumerate(rows_of):
        xp.matmul(S[r], w["down_proj.weight"][j], out=ys[r])
    return ys, (xs, S, sw, w, rows_of)


def experts_backward(dys, cache):
    """Mirror of experts_forward: dxs (M, C) and the stacked weight gradients (an expert
    with no rows gets zeros)."""
    xs, S, sw, w, rows_of = cache
    xp = backend.array_module(dys)
    g = {s: xp.empty_like(w[s]) for s in EXPERT_PARAMS}
    dS = xp.empty_like(S)  # (M, F)
    for j, r in enumerate(rows_of):  # forward was: Y = S Wdown_j
        xp.matmul(S[r].T, dys[r], out=g["down_proj.weight"][j])  # (F, C)
        xp.matmul(dys[r], w["down_proj.weight"][j].T, out=dS[r])
    dG, dU = swiglu_backward(dS, sw)  # (M, F) each
    dxs = xp.empty_like(xs)  # (M, C)
    for j, r in enumerate(rows_of):  # forward was: G = X Wgate_j, U = X Wup_j
        xp.matmul(xs[r].T, dG[r], out=g["gate_proj.weight"][j])  # (C, F)
        xp.matmul(xs[r].T, dU[r], out=g["up_proj.weight"][j])
        dxs[r] = dG[r] @ w["gate_proj.weight"][j].T + dU[r] @ w["up_proj.weight"][j].T
    return dxs, g


def unstack_grads(ids: list[int], g: dict) -> dict:
    """Stacked expert gradients back to names inside the block."""
    return {f"mlp.experts.{e}.{s}": g[s][j] for s in EXPERT_PARAMS for j, e in enumerate(ids)}
