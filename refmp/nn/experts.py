"""The experts of an MoE layer: each runs GPT-2's MLP on its own consecutive rows.

Shapes: M kept assignments (token, expert), sorted by expert; E' experts held here; C channels.

    expert_e(x) = gelu(x W1_e + b1_e) W2_e + b2_e    (GPT-2's MLP, one per expert)

The router (refmp.nn.moe) sorts the kept assignments by expert, so expert j's rows are one
consecutive block and each of its two linears is one matrix product on exactly those rows
(a loop over the experts, never over tokens, and no padding to the busiest expert's count,
whose products would be wasted), and GELU runs once on every expert's rows together. Where
the experts live is the job of a *dispatch* object: :class:`LocalExperts` here (all of them,
no communication); refmp.parallel.expert sends tokens to sharded experts by all-to-all.
"""

from __future__ import annotations

import itertools
import re
import sys

from refmp.nn import fast as L  # refmp.nn.layers' formulas, run fast (refmp.nn.fast)
from refmp.runtime import backend

EXPERT = re.compile(r"mlp\.experts\.(\d+)\.")
EXPERT_PARAMS = ("c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias")


def stack_experts(p: dict) -> tuple[list[int], dict]:
    """The experts present in ``p`` (names inside the block), sorted, stacked: (E', ...) each."""
    xp = backend.array_module(p["mlp.router.weight"])
    ids = sorted({int(m.group(1)) for k in p if (m := EXPERT.match(k))})
    w = {s: xp.stack([p[f"mlp.experts.{e}.{s}"] for e in ids]) for s in EXPERT_PARAMS}
    return ids, w


def expert_rows(counts) -> list[slice]:
    """Expert j's rows of the sorted assignments: slice j, counts[j] long (host ints)."""
    ends = [0, *itertools.accumulate(int(c) for c in counts)]
    return [slice(lo, hi) for lo, hi in zip(ends[:-1], ends[1:], strict=True)]


def experts_forward(w: dict, xs, counts):
    """Run expert j on its counts[j] consecutive rows of ``xs`` (M, C).

    ``w`` holds the stacked weights (E', C, 4C), (E', 4C), (E', 4C, C), (E', C); ``counts``
    (E',) host ints with sum M. Returns ys (M, C) in the order of xs. Each expert's two
    products run on exactly its rows (no padding to the busiest expert's count), GELU once on
    all of them.
    """
    xp = backend.array_module(xs)
    rows_of = expert_rows(counts)
    H = xp.empty((xs.shape[0], w["c_fc.weight"].shape[2]), dtype=xs.dtype)  # (M, 4C)
    for j, r in enumerate(rows_of):  # H = X W1_j + b1_j on expert j's rows, in place
        xp.matmul(xs[r], w["c_fc.weight"][j], out=H[r])
        H[r] += w["c_fc.bias"][j]
    G, gelu = L.gelu_forward(H)  # (M, 4C)
    ys = xp.empty_like(xs)  # (M, C)
    for j, r in enumerate(rows_of):  # Y = G W2_j + b2_j
        xp.matmul(G[r], w["c_proj.weight"][j], out=ys[r])
        ys[r] += w["c_proj.bias"][j]
    return ys, (xs, G, gelu, w, rows_of)


def experts_backward(dys, cache):
    """Mirror of experts_forward: dxs (M, C) and the stacked weight gradients.

    An expert that got no rows gets zero gradients (a product over no rows is zero)."""
    xs, G, gelu, w, rows_of = cache
    xp = backend.array_module(dys)
    g = {s: xp.empty_like(w[s]) for s in EXPERT_PARAMS}
    dG = xp.empty_like(G)  # (M, 4C)
    for j, r in enumerate(rows_of):  # forward was: Y = G W2_j + b2_j
        xp.matmul(G[r].T, dys[r], out=g["c_proj.weight"][j])  # (4C, C)
        g["c_proj.bias"][j] = dys[r].sum(axis=0)
        xp.matmul(dys[r], w["c_proj.weight"][j].T, out=dG[r])
    dH = L.gelu_backward(dG, gelu)  # (M, 4C)
    dxs = xp.empty_like(xs)  # (M, C)
    for j, r in enumerate(rows_of):  # forward was: H = X W1_j + b1_j
        xp.matmul(xs[r].T, dH[r], out=g["c_fc.weight"][j])  # (C, 4C)
        g["c_fc.bias"][j] = dH[r].sum(axis=0)
        xp.matmul(dH[r], w["c_fc.weight"][j].T, out=dxs[r])
    return dxs, g


class LocalExperts:
    """Every expert on this rank (the serial reference): no communication. ``kind``: the
    module of the experts' functions (stack_experts, experts_forward, experts_backward,
    unstack_grads): this one's GELU MLPs, or refmp.nn.swiglu_experts."""

    def __init__(self, kind=None):
        self.kind = kind if kind is not None else sys.modules[__name__]

    def forward(self, p: dict, xs, counts):
        ids, w = self.kind.stack_experts(p)
        ys, cache = self.kind.experts_forward(w, xs, counts)
        return ys, (ids, cache)

    def backward(self, dys, cache):
        ids, ecache = cache
        dxs, g = self.kind.experts_backward(dys, ecache)
        return dxs, self.kind.unstack_grads(ids, g)


def unstack_grads(ids: list[int], g: dict) -> dict:
    """Stacked expert gradients back to names inside the block."""
    return {f"mlp.experts.{e}.{s}": g[s][j] for s in EXPERT_PARAMS for j, e in enumerate(ids)}
