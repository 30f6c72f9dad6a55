"""What expert parallelism (refmp.parallel.expert) and MoE parallel folding
(refmp.parallel.folding) move in one step, from the routing.

Shapes: A kept assignments (token, expert) over the global batch, C channels, E experts on ep
ranks (E/ep each). Checked exactly against the ledger by tests/test_expert_parity.py.
"""

from __future__ import annotations

import numpy as np


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


def folded_bytes(A: int, C: int, itemsize: int, E: int, calls: int, sizes: dict,
                 sp: bool) -> dict[tuple[str, str], int]:
    """The bytes MoE parallel folding (refmp.parallel.folding) moves over the whole world, by
    (op, axis), for ``calls`` dispatches (MoE layers x micro-batches x steps, each on every
    rank of its stage) of A kept assignments in all (over those calls and the global batch).

    Each assignment is dispatched once (split over tp without SP): summed over ranks, the
    rows sent (Mt) and received (R) are A each, the rows an etp group's ranks run on (Rg) are
    etp A, and without SP each tp rank gathers its tp group's M: tp A.

        ep    alltoall  n E 8 per call        alltoallv        2 (A + A) C s
        etp   allgather n etp E 8 per call    allgatherv and reduce_scatterv  2 etp A C s each
        tp    allgatherv 2 tp A C s (without SP)

    with n the ranks of a stage (tp cp dp) and s the itemsize; the etp rows only with
    etp > 1, the tp rows only with tp > 1 and no SP.
    """
    tp, etp = sizes["tp"], sizes["etp"]
    n = tp * sizes["cp"] * sizes["dp"]
    out = {("alltoall", "ep"): calls * n * E * 8, ("alltoallv", "ep"): 4 * A * C * itemsize}
    if etp > 1:
        out[("allgather", "etp")] = calls * n * etp * E * 8
        out[("allgatherv", "etp")] = 2 * etp * A * C * itemsize
        out[("reduce_scatterv", "etp")] = 2 * etp * A * C * itemsize
    if tp > 1 and not sp:
        out[("allgatherv", "tp")] = 2 * tp * A * C * itemsize
    return out


def folded_per_step(tp: int, etp: int, sp: bool, calls: int, rows: float) -> dict[str, dict]:
    """The planner's bytes of MoE parallel folding, one rank, one step, by axis and op, for
    ``calls`` all-to-alls (4 per MoE layer and micro-batch, 6 with full recomputation) and
    ``rows`` the bytes of a rank's tokens' assignments (K b Tl C c), with no dropping and
    every rank receiving what it sends (R = Mt): folded_bytes' terms, per rank.

        ep    alltoall         calls Mt,         Mt = rows / tp (tp's share, or SP's tokens)
        etp   allgather        calls/2 etp Mt,   and reduce_scatter the same (etp > 1)
        tp    allgather        calls/2 tp Mt     (without SP: the results and dx, whole again)
    """
    Mt = rows / tp
    out = {"ep": {"alltoall": calls * Mt}}
    if etp > 1:
        out["etp"] = {"allgather": calls / 2 * etp * Mt, "reduce_scatter": calls / 2 * etp * Mt}
    if tp > 1 and not sp:
        out["tp"] = {"allgather": calls / 2 * tp * Mt}
    return out
