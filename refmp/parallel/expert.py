"""Expert parallelism: the experts of every MoE layer sharded over ep ranks, tokens sent to them.

Shapes: C channels, E experts, El = E/ep experts per rank, M this rank's kept assignments
(token, expert), R the assignments this rank's experts receive from the whole ep group.

Layout (Lepikhin et al. 2020, GShard; Fedus et al. 2021, Switch): ep is carved from the
data-parallel ranks (refmp.grid). Every rank holds all non-expert weights (data parallel over
all of dp, as refmp.parallel.data) and the El experts e in [ep_rank El, (ep_rank + 1) El) of
each MoE layer. The ranks in one ep group hold different experts; the ranks of an edp group
(same ep_rank, different ep groups) hold the same ones and sum their gradients.

One MoE layer, forward (refmp.nn.moe routes and combines; :class:`ExpertDispatch` moves):
  1. each rank routes its own tokens: kept assignments sorted by expert, counts (E,);
  2. all-to-all of the counts: rank j learns how many rows each peer sends to each of its
     experts (it needs them to size its receive buffer);
  3. all-to-all(v) of the token rows, M x C out, R x C in;
  4. the local experts run batched (refmp.nn.moe.experts_forward) on the rows regrouped by
     expert;
  5. all-to-all(v) of the results back to the ranks that own the tokens, R x C out;
  6. the owners combine them with their gates (refmp.nn.moe).
Backward mirrors it: the output gradients go to the experts (M x C), the input gradients come
back (R x C). So the ledger holds, per MoE layer and step, on each rank: one "alltoall" of
E int64 counts and four "alltoallv" calls moving 2 (M + R) C itemsize bytes (send side).

Gradients: non-expert weights are summed over dp (all-reduce, refmp.parallel.data); expert
weights over edp. The routing statistics of the aux loss are summed over dp (refmp.nn.moe).
"""

from __future__ import annotations

import numpy as np

from refmp import backend
from refmp.data import dp_rows
from refmp.errors import ConfigError
from refmp.nn import GPT
from refmp.nn import moe as M
from refmp.parallel.data import allreduce_grads


def check_expert_layout(n_expert: int, ep: int) -> None:
    """Refuse an expert layout that cannot work (same message on every rank, no communication)."""
    if ep > 1 and n_expert == 0:
        raise ConfigError(f"--ep {ep} needs a mixture-of-experts model (--n-expert > 0)")
    if n_expert % ep:
        raise ConfigError(f"--n-expert ({n_expert}) must be divisible by --ep ({ep}): "
                          f"every expert-parallel rank holds E/ep experts")


def is_expert(name: str) -> bool:
    return M.EXPERT.search(name) is not None


def expert_index(name: str) -> int:
    return int(M.EXPERT.search(name).group(1))


def alltoallv_bytes(owner, expert, dp_rank: int, ep: int, n_expert: int, C: int,
                    itemsize: int) -> int:
    """The all-to-all(v) bytes one MoE layer's forward + backward sends from ``dp_rank``.

    ``owner`` (A,): the dp rank holding each kept assignment's token, ``expert`` (A,): its
    expert, over the global batch. 2 (M + R) C itemsize, with M the kept assignments of this
    rank's tokens and R those of its ep group's tokens to the experts it holds.
    """
    owner, expert = np.asarray(owner), np.asarray(expert)
    group = owner // ep == dp_rank // ep  # tokens of my ep group
    M = int((owner == dp_rank).sum())
    R = int((group & (expert // (n_expert // ep) == dp_rank % ep)).sum())
    return 2 * (M + R) * C * itemsize


class ExpertDispatch:
    """Run the experts of refmp.nn.moe on their owners, by all-to-all over ``ep``."""

    def __init__(self, ep, n_expert: int):
        self.ep, self.E = ep, n_expert
        self.El = n_expert // ep.size

    def forward(self, p: dict, xs, counts):
        """xs (M, C) sorted by expert, counts (E,) host ints -> ys (M, C), cache."""
        ep, El = self.ep, self.El
        counts = np.asarray(counts, dtype=np.int64).reshape(ep.size, El)  # (ep, El) by owner
        # all-to-all of counts: recv[s, l] = rows peer s sends to my local expert l
        recv = ep.alltoall(counts)  # (ep, El)
        send_rows, recv_rows = counts.sum(axis=1), recv.sum(axis=1)  # (ep,), (ep,)
        # the tokens go to their experts' ranks: rows ordered by (source rank, local expert)
        xr = ep.alltoallv(xs, send_rows, recv_rows)  # (R, C)
        # regroup by (local expert, source rank), so each expert's rows are consecutive
        label = np.repeat(np.arange(ep.size * El), recv.reshape(-1))  # (R,) = s * El + l
        perm = backend.from_host(np.argsort((label % El) * ep.size + label // El, kind="stable"))
        ids, w = M.stack_experts(p)  # the El experts held here
        yl, ecache = M.experts_forward(w, xr[perm], recv.sum(axis=0))  # (R, C)
        yr = backend.xp.empty_like(yl)
        yr[perm] = yl  # back to (source rank, local expert) order
        # the results go back to the tokens' ranks, in the order they were sent
        ys = ep.alltoallv(yr, recv_rows, send_rows)  # (M, C)
        return ys, (ids, ecache, perm, send_rows, recv_rows)

    def backward(self, dys, cache):
        """dys (M, C) -> dxs (M, C) and the local experts' gradients (names in the block)."""
        ids, ecache, perm, send_rows, recv_rows = cache
        # mirror of the return trip: output gradients go to the experts
        dyr = self.ep.alltoallv(dys, send_rows, recv_rows)  # (R, C)
        dxl, g = M.experts_backward(dyr[perm], ecache)  # (R, C)
        dxr = backend.xp.empty_like(dxl)
        dxr[perm] = dxl
        # mirror of the dispatch: input gradients go back to the tokens' ranks
        dxs = self.ep.alltoallv(dxr, recv_rows, send_rows)  # (M, C)
        return dxs, M.unstack_grads(ids, g)


class ExpertParallel:
    """Data parallelism for the dense weights, expert parallelism (ep) for the experts.

    Implements the runner interface of refmp.parallel.data.DataParallel (read its docstring).
    """

    def __init__(self, model: GPT, grid):
        check_expert_layout(model.cfg.n_expert, grid.ep)
        self.grid, self.full_model = grid, model
        self.dp, self.ep, self.edp = grid.comm["dp"], grid.comm["ep"], grid.comm["edp"]
        # the generator of the evaluation must run the same prompts on all peers of an ep
        # group (its forward is collective over ep): split prompts over edp, not dp
        self.eval_comm = self.edp
        El = model.cfg.n_expert // self.ep.size
        mine = range(self.ep.rank * El, (self.ep.rank + 1) * El)
        # slice the full model (init is layout-independent): dense weights and my experts
        local = {k: v for k, v in model.params.items()
                 if not is_expert(k) or expert_index(k) in mine}
        self.model = GPT(model.cfg, local)
        self.dispatch = ExpertDispatch(self.ep, model.cfg.n_expert)
        self.stats = {}

    @property
    def params(self) -> dict:
        return self.model.params  # dense weights and my experts

    @property
    def grads(self) -> dict:
        return self.model.grads

    def batch_rows(self, B: int) -> slice:
        return dp_rows(B, self.dp.size, self.dp.rank)  # every rank reads its own rows

    def zero_grad(self) -> None:
        self.model.zero_grad()

    def forward_backward(self, x, y, denom: int) -> float:
        loss, cache = self.model.forward(x, y, denom, stats_comm=self.dp, dispatch=self.dispatch)
        self.model.backward(cache)
        self.stats = self.model.moe_stats(cache)
        return float(loss)

    def reduce_grads(self) -> None:
        g = self.model.grads
        allreduce_grads({k: v for k, v in g.items() if not is_expert(k)}, self.dp)
        allreduce_grads({k: v for k, v in g.items() if is_expert(k)}, self.edp)

    def grad_sum_sq(self, local: float) -> float:
        # dense gradients are replicated over dp: count once; experts differ over ep: add up
        # (``local`` mixes both, so the two parts are recomputed here)
        dense = sum(float((v * v).sum()) for k, v in self.grads.items() if not is_expert(k))
        experts = sum(float((v * v).sum()) for k, v in self.grads.items() if is_expert(k))
        return dense + self.ep.allreduce_scalar(experts)

    def loss_total(self, share: float) -> float:
        return self.dp.allreduce_scalar(share)  # sum of shares = the global mean loss

    def generate(self, idx, n: int):
        return self.model.generate(idx, n, dispatch=self.dispatch)

    def full_params(self) -> dict | None:
        """Gather every expert over ep (collective: all ranks call it); rank 0 gets the model."""
        xp, p, E = backend.xp, self.model.params, self.model.cfg.n_expert
        full = dict(p)
        for i in range(self.model.cfg.n_layer):
            if not self.model.cfg.is_moe(i):
                continue
            pre = f"h.{i}.mlp.experts."
            ids = sorted({expert_index(k) for k in p if k.startswith(pre)})
            for s in M.EXPERT_PARAMS:
                stacked = self.ep.allgather(xp.stack([p[f"{pre}{e}.{s}"] for e in ids]))  # (E,.)
                full.update({f"{pre}{e}.{s}": stacked[e] for e in range(E)})
        if self.grid.rank != 0:
            return None
        return {k: full[k] for k in self.full_model.params}  # GPT-2 order
