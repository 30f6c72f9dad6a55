"""MoE parallel folding: the experts on a grid of their own, each split over etp like the MLP.

Shapes: C channels, H = 4C an expert's hidden width, E experts, El = E/ep experts per rank;
M the kept assignments (token, expert) of a rank's tokens, sorted by expert; Mt the share
this rank dispatches (M, or about M/tp, below); R the rows this rank's experts receive over
ep; Rg = the sum of R over the etp group (every row its experts run on).

Attention's layout cuts a stage's n = tp cp dp ranks one way; the experts' cuts them again,
etp x ep x edp (Liu et al. 2025, "MoE Parallel Folding"; refmp.distributed.grid numbers the
three groups). A rank holds the El experts of its ep rank, each cut over etp as GPT-2's MLP
is over tp (Shoeybi et al. 2019, sec. 3): c_fc's columns (C, H/etp) and bias (H/etp), c_proj's
rows (H/etp, C), and c_proj's bias whole. ep may take ranks from tp and cp, so tp 2 x ep 4 on
4 ranks gives every rank a different expert, none copied over tp.

One MoE layer, forward (refmp.nn.moe routes and combines; :class:`FoldedDispatch` moves):
  0. without sequence parallelism the tp ranks hold the same tokens: tp rank j dispatches
     only rows [j M/tp, (j+1) M/tp) of the sorted assignments (Mt), so each token is
     dispatched once (with SP, or tp 1, each rank dispatches all its M: Mt = M);
  1. all-to-all of the (E,) counts and all-to-all(v) of the rows over ep (as
     refmp.parallel.expert): R rows arrive, from the ep peers of my etp rank;
  2. all-gather(v) over etp: every etp shard of an expert needs every row sent to it (the
     column-parallel c_fc): Rg rows, grouped by local expert;
  3. the expert shards: h = gelu(x W1[:, shard] + b1[shard]) (Rg, H/etp), y = h W2[shard, :]
     (Rg, C) partial over etp; etp rank 0 adds c_proj's bias (once);
  4. reduce-scatter(v) over etp: the sum, each rank its own R rows (the row-parallel c_proj);
  5. all-to-all(v) back over ep (Mt rows), then (step 0's mirror) all-gather(v) over tp of
     the dispatched shares: every tp rank has all M results again.
Backward mirrors it: a slice of the output gradients (0), all-to-all(v) over ep, all-gather
over etp (4's mirror: the gradient of y is whole on every shard), the shards' backward (the
gradient of x partial over etp), reduce-scatter over etp (2's mirror), all-to-all(v) back,
all-gather over tp (0's mirror: every tp rank's LayerNorm backward needs all of dx).

Gradients: every token reaches each expert once, on one edp replica, and every etp shard of
that expert sees all its rows, so a shard's gradient is the edp sum of the replicas' (no sum
over tp, with or without SP); c_proj's bias gradient is whole on every etp rank (its rows'
output gradients, all-gathered, are the same there). Bytes per MoE layer and micro-batch, one
rank, itemsize s (refmp.cost.expert.folded_bytes over the world):

    ep    alltoall E 8 (counts), alltoallv 2 (Mt + R) C s
    etp   allgather etp E 8 (counts), allgatherv 2 Rg C s, reduce_scatterv 2 Rg C s
    tp    allgatherv 2 M C s (without SP)
"""

from __future__ import annotations

import numpy as np

from refmp.nn import experts
from refmp.parallel.expert import ExpertDispatch
from refmp.runtime import backend


def dispatch_for(grid, n_expert: int, sp: bool, wire=None, kind=None):
    """An MoE layer's dispatch on ``grid``: FoldedDispatch with folding (--etp), else expert
    parallelism's ExpertDispatch over ep, or None (the experts local). ``kind``: the
    experts' module (default refmp.nn.experts; refmp.nn.swiglu_experts for Mixtral's, which
    folding does not split)."""
    ep, kind = grid.comm["ep"], experts if kind is None else kind
    if grid.folded:
        return FoldedDispatch(grid.comm["tp"], ep, grid.comm["etp"], n_expert, not sp, wire)
    return ExpertDispatch(ep, n_expert, wire, kind) if ep.size > 1 else None


def share(counts, lo: int, hi: int):
    """(E,) how many of rows [lo, hi) of the expert-sorted assignments go to each expert,
    when expert e's rows are ``counts[e]`` consecutive ones (host ints)."""
    ends = np.cumsum(np.asarray(counts, dtype=np.int64))  # (E,)
    return np.clip(np.minimum(ends, hi) - np.maximum(ends - counts, lo), 0, None)


class FoldedDispatch(ExpertDispatch):
    """The experts of refmp.nn.moe on the folded grid (module docstring): ``tp`` attention's
    tensor-parallel group, of which each rank dispatches 1/tp of the rows when ``split_tp``
    (no SP: the tp ranks hold the same tokens); ``ep`` and ``etp`` the experts' groups;
    ``wire`` mixed precision's compute dtype, for the all-to-alls (as ExpertDispatch)."""

    def __init__(self, tp, ep, etp, n_expert: int, split_tp: bool, wire=None):
        super().__init__(ep, n_expert, wire, experts)  # GPT-2's experts: c_fc, c_proj split
        self.tp = tp
        self.etp = etp
        self.split_tp = split_tp and tp.size > 1

    def _rows(self, M: int) -> list[int]:
        """The rows each tp rank dispatches: [j M/tp, (j+1) M/tp) for tp rank j."""
        n = self.tp.size
        return [(j + 1) * M // n - j * M // n for j in range(n)]

    def forward(self, p: dict, xs, counts):
        """xs (M, C) sorted by expert, counts (E,) host ints -> ys (M, C), cache."""
        ep, etp, El = self.ep, self.etp, self.El
        M, j = xs.shape[0], self.tp.rank
        lo, hi = (j * M // self.tp.size, (j + 1) * M // self.tp.size) if self.split_tp else (0, M)
        mine = share(counts, lo, hi).reshape(ep.size, El)  # (ep, El) my rows, by owner
        recv = ep.alltoall(mine)  # (ep, El): rows each ep peer sends to my local experts
        send_rows, recv_rows = mine.sum(axis=1), recv.sum(axis=1)  # (ep,), (ep,)
        xr = self._a2a(xs[lo:hi], send_rows, recv_rows)  # (R, C) by (source, local expert)
        # every etp shard of my experts needs every row sent to them: all-gather over etp
        got = etp.allgather(recv.reshape(1, -1)) if etp.size > 1 else recv.reshape(1, -1)
        got = got.reshape(etp.size, ep.size, El)  # (etp, ep, El) rows by (peer, source, expert)
        peer_rows = got.sum(axis=(1, 2))  # (etp,)
        xg = etp.allgatherv(xr, peer_rows) if etp.size > 1 else xr  # (Rg, C)
        # regroup by local expert (then peer, source), so each expert's rows are consecutive
        label = np.repeat(np.arange(got.size), got.reshape(-1))  # (Rg,) = (q ep + s) El + l
        perm = backend.from_host(np.argsort((label % El) * (got.size // El) + label // El,
                                            kind="stable"))
        ids, w = self.kind.stack_experts(p)  # my El experts' etp shards
        if etp.rank > 0:  # the row-parallel c_proj's bias is added once, by etp rank 0
            w = {**w, "c_proj.bias": backend.xp.zeros_like(w["c_proj.bias"])}
        yl, ecache = self.kind.experts_forward(w, xg[perm], got.sum(axis=(0, 1)))  # (Rg, C)
        yg = backend.xp.empty_like(yl)
        yg[perm] = yl  # (Rg, C) partial over etp, back in (peer, source, expert) order
        yr = etp.reduce_scatterv(yg, peer_rows) if etp.size > 1 else yg  # (R, C) summed
        ys = self._a2a(yr, recv_rows, send_rows)  # (Mt, C) my dispatched rows' results
        if self.split_tp:  # every tp rank has all M results again
            ys = self.tp.allgatherv(backend.xp.ascontiguousarray(ys), self._rows(M))  # (M, C)
        return ys, (ids, ecache, perm, send_rows, recv_rows, peer_rows, lo, hi)

    def backward(self, dys, cache):
        """dys (M, C) -> dxs (M, C) and the local expert shards' gradients (names in the
        block). Without SP dys is the same on every tp rank (a replicated region's gradient)."""
        ids, ecache, perm, send_rows, recv_rows, peer_rows, lo, hi = cache
        etp, M = self.etp, dys.shape[0]
        # mirror of the return trip: my dispatched rows' output gradients go to the experts
        dyr = self._a2a(backend.xp.ascontiguousarray(dys[lo:hi]), send_rows, recv_rows)  # (R, C)
        dyg = etp.allgatherv(dyr, peer_rows) if etp.size > 1 else dyr  # (Rg, C) whole per shard
        dxl, g = self.kind.experts_backward(dyg[perm], ecache)  # (Rg, C) partial over etp
        dxg = backend.xp.empty_like(dxl)
        dxg[perm] = dxl
        dxr = etp.reduce_scatterv(dxg, peer_rows) if etp.size > 1 else dxg  # (R, C) summed
        dxs = self._a2a(dxr, recv_rows, send_rows)  # (Mt, C)
        if self.split_tp:  # every tp rank's LayerNorm backward needs all of dx
            dxs = self.tp.allgatherv(backend.xp.ascontiguousarray(dxs), self._rows(M))
        return dxs, self.kind.unstack_grads(ids, g)
