"""What expert parallelism (refmp.parallel.expert) moves on ep in one step, from the routing.

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
