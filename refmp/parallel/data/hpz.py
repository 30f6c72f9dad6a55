"""ZeRO++'s hierarchical partition (hpZ; Wang et al. 2023, sec. 3.2): ZeRO-3 whose weight
all-gathers stay inside groups of G consecutive data-parallel ranks (a node's).

Shapes: a unit of Pp elements (padded) over a ZeRO group of n = N G ranks, S = Pp/n the
primary slice a rank owns (updates, and reduces the gradient of: ZeRO-3 unchanged). Rank
r = k G + i is rank i of its block k (inner: the G ranks of its block) and rank k of the N
ranks with index i in theirs (outer).

    primary    (S,)     the slice r owns: elements [r S, (r+1) S) of the unit
    secondary  (N S,)   the primary slices of its outer group (ranks i, G + i, ..., (N-1) G + i),
                        in outer order: every block's ranks together hold the whole unit
    gather     inner all-gather of the secondaries: (G N S,) in the order (i, k), transposed
               to (k, i), which is rank order k G + i: the unit (Pp,), the same as ZeRO-3's
               all-gather over the n ranks gives
    refresh    after each optimizer step, the outer all-gather of the updated primaries:
               (S,) -> (N S,), the only weight traffic that leaves a block

Bytes (the ledger's convention, the all-gather's output): a gather Pp w on the inner group,
as ZeRO-3's on the whole group; a refresh N S w = Pp w / G on the outer group, once a step.
Memory held between uses: S + N S = S (1 + n/G) elements a unit, against ZeRO-3's S.
"""

from __future__ import annotations

from refmp.distributed import topology
from refmp.distributed.comm import Comm


def blocks(flat: Comm, G: int, nodes: tuple[int, ...]) -> tuple[Comm, Comm]:
    """(inner, outer): the G consecutive ranks of my block of ``flat``, and the n/G ranks
    with my index in theirs. Ledger labels ``{axis}.hpz`` and ``{axis}.hpz-cross`` (with
    ``[intra]`` / ``[inter]`` where the grid spans several ``nodes``)."""
    k, i = divmod(flat.rank, G)
    inner = Comm(flat.mpi.Split(k, i), f"{flat.axis}.hpz", flat.ledger, flat.recorder)
    outer = Comm(flat.mpi.Split(i, k), f"{flat.axis}.hpz-cross", flat.ledger, flat.recorder)
    for c in (inner, outer):
        c.cuda_aware = flat.cuda_aware
        if len(set(nodes)) > 1:
            flat.ledger.spans[c.axis] = topology.span(c.world_ranks, nodes)
    return inner, outer


def secondary(full, G: int, i: int, shard: int):
    """My secondary slice (N S,) of the whole unit ``full`` (Pp,): the primaries of the ranks
    k G + i, k = 0..N-1."""
    return full.reshape(-1, G, shard)[:, i, :].reshape(-1).copy()  # (N, G, S) -> (N S,)


def block_gather(inner: Comm, mine, shard: int):
    """The whole unit (Pp,) from the inner group's secondaries (module docstring)."""
    got = inner.allgather(mine)  # (G N S,) in the order (i, k)
    G = inner.size
    return got.reshape(G, -1, shard).transpose(1, 0, 2).reshape(-1)  # (k, i): rank order
