"""Expert parallelism: the experts of every MoE layer sharded over ep ranks, tokens sent to them.

Shapes: C channels, E experts, El = E/ep experts per rank, M this rank's kept assignments
(token, expert), R the assignments this rank's experts receive from the whole ep group.

Layout (Lepikhin et al. 2020, GShard; Fedus et al. 2021, Switch; Megatron's MoE parallel
folding): ep is carved from the dp x cp ranks (refmp.distributed.grid). Every rank holds the non-expert
weights of its stage and tp shard (replicated over dp x cp) and the El experts e in
[ep_rank El, (ep_rank + 1) El) of each of its MoE layers. The ranks in one ep group hold
different experts; the ranks of an edp group (same ep_rank, different ep groups) hold the
same ones and sum their gradients (refmp.parallel.placement). Experts are not split over tp:
every tp rank runs them (on the same tokens, or with sequence parallelism on its T/tp).

One MoE layer, forward (refmp.nn.moe routes and combines; :class:`ExpertDispatch` moves):
  1. each rank routes its own tokens: kept assignments sorted by expert, counts (E,);
  2. all-to-all of the counts: rank j learns how many rows each peer sends to each of its
     experts (it needs them to size its receive buffer);
  3. all-to-all(v) of the token rows, M x C out, R x C in;
  4. the local experts run (refmp.nn.experts.experts_forward) on the rows regrouped by expert;
  5. all-to-all(v) of the results back to the ranks that own the tokens, R x C out;
  6. the owners combine them with their gates (refmp.nn.moe).
Backward mirrors it: the output gradients go to the experts (M x C), the input gradients come
back (R x C). So the ledger holds, per MoE layer and step, on each rank: one "alltoall" of
E int64 counts and four "alltoallv" calls moving 2 (M + R) C itemsize bytes (send side).

A sequence split over cp (or SP) ranks keeps the per-sequence capacity rule and f_be exact:
:class:`SequenceSplit` gathers the (B, T, K) routing index over those ranks.
"""

from __future__ import annotations

import numpy as np

from refmp.nn import experts
from refmp.runtime import backend


def is_expert(name: str) -> bool:
    return experts.EXPERT.search(name) is not None


def expert_index(name: str) -> int:
    return int(experts.EXPERT.search(name).group(1))


class ExpertDispatch:
    """Run the experts of refmp.nn.moe on their owners, by all-to-all over ``ep``.

    ``wire``: mixed precision's compute dtype. The MoE layer runs in fp32 inside
    (refmp.runtime.precision.autocast), but its rows travel in the compute dtype, as every other
    activation does: the tokens were rounded to it before the layer widened them (so their
    trip is exact); the experts' outputs and the gradients are rounded for theirs.
    ``kind``: the experts' module (refmp.nn.experts, or refmp.nn.swiglu_experts).
    """

    def __init__(self, ep, n_expert: int, wire=None, kind=experts):
        self.ep = ep
        self.kind = kind
        self.E = n_expert
        self.wire = wire
        self.El = n_expert // ep.size

    def _a2a(self, rows, send_rows, recv_rows):
        """all-to-all(v) of rows (in the ``wire`` dtype if one is set)."""
        if self.wire is None or rows.dtype == self.wire:
            return self.ep.alltoallv(rows, send_rows, recv_rows)
        return self.ep.alltoallv(rows.astype(self.wire), send_rows, recv_rows).astype(rows.dtype)

    def forward(self, p: dict, xs, counts):
        """xs (M, C) sorted by expert, counts (E,) host ints -> ys (M, C), cache."""
        ep, El = self.ep, self.El
        counts = np.asarray(counts, dtype=np.int64).reshape(ep.size, El)  # (ep, El) by owner
        # all-to-all of counts: recv[s, l] = rows peer s sends to my local expert l
        recv = ep.alltoall(counts)  # (ep, El)
        send_rows, recv_rows = counts.sum(axis=1), recv.sum(axis=1)  # (ep,), (ep,)
        # the tokens go to their experts' ranks: rows ordered by (source rank, local expert)
        xr = self._a2a(xs, send_rows, recv_rows)  # (R, C)
        # regroup by (local expert, source rank), so each expert's rows are consecutive
        label = np.repeat(np.arange(ep.size * El), recv.reshape(-1))  # (R,) = s * El + l
        perm = backend.from_host(np.argsort((label % El) * ep.size + label // El, kind="stable"))
        ids, w = self.kind.stack_experts(p)  # the El experts held here
        yl, ecache = self.kind.experts_forward(w, xr[perm], recv.sum(axis=0))  # (R, C)
        yr = backend.xp.empty_like(yl)
        yr[perm] = yl  # back to (source rank, local expert) order
        # the results go back to the tokens' ranks, in the order they were sent
        ys = self._a2a(yr, recv_rows, send_rows)  # (M, C)
        return ys, (ids, ecache, perm, send_rows, recv_rows)

    def backward(self, dys, cache):
        """dys (M, C) -> dxs (M, C) and the local experts' gradients (names in the block)."""
        ids, ecache, perm, send_rows, recv_rows = cache
        # mirror of the return trip: output gradients go to the experts
        dyr = self._a2a(dys, send_rows, recv_rows)  # (R, C)
        dxl, g = self.kind.experts_backward(dyr[perm], ecache)  # (R, C)
        dxr = backend.xp.empty_like(dxl)
        dxr[perm] = dxl
        # mirror of the dispatch: input gradients go back to the tokens' ranks
        dxs = self._a2a(dxr, recv_rows, send_rows)  # (M, C)
        return dxs, self.kind.unstack_grads(ids, g)


class SequenceSplit:
    """The ranks one sequence is split over (cp, and tp with sequence parallelism), for the
    MoE layer's per-sequence rules (refmp.nn.moe): ``positions[j]`` are the global positions of
    the tokens group rank j holds, in the order it holds them."""

    def __init__(self, comm, positions: list):
        self.comm = comm
        order = np.concatenate(positions)  # rank-major slots -> natural positions
        self.to_natural = backend.from_host(np.argsort(order))
        self.here = backend.from_host(positions[comm.rank])  # my tokens' positions

    def gather(self, top):
        """(B, Tl, K) my tokens' chosen experts -> (B, T, K) the whole sequences', in order:
        an all-gather of the small routing index, never the activations."""
        xp = backend.array_module(top)
        got = self.comm.allgather(xp.ascontiguousarray(top.transpose(1, 0, 2)))  # (T, B, K)
        return got[self.to_natural].transpose(1, 0, 2)

    def mine(self, a):
        """(B, T, ...) over whole sequences -> (B, Tl, ...) at my tokens."""
        return a[:, self.here]

    def sum(self, a):
        """Sum a per-sequence statistic (B, E) over the ranks holding the sequence's parts."""
        return self.comm.allreduce(backend.array_module(a).ascontiguousarray(a))
