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
Memory held between uses: S + N S = S (1 + n/G) elements a unit, against ZeRO-3's S. A
weight version that a pipeline without a flush keeps (2BW's W(t-1), PipeDream's stashes;
Sharder.snapshot) copies the secondary slice, so its gathers stay inside the block too.

G is given (``--hpz-size``, as DeepSpeed's ``zero_hpz_partition_size``), not inferred: the
ranks of a ZeRO group on one node, so that each block is on one node (with Megatron's rank
order and tp inside a node: the ranks per node over tp); where the grid knows its nodes and a
block spans two, refmp train warns (:func:`block_notes`).
"""

from __future__ import annotations

from refmp.distributed import topology
from refmp.distributed.comm import Comm
from refmp.parallel.data.hierarchical import two_levels


def blocks(flat: Comm, G: int, nodes: tuple[int, ...]) -> tuple[Comm, Comm]:
    """(inner, outer): the G consecutive ranks of my block of ``flat``, and the n/G ranks
    with my index in theirs. Ledger labels ``{axis}.hpz`` and ``{axis}.hpz-cross`` (with
    ``[intra]`` / ``[inter]`` where the grid spans several ``nodes``)."""
    k, i = divmod(flat.rank, G)
    return two_levels(flat, k, i, ("hpz", "hpz-cross"), nodes)


def block_notes(sizes: dict[str, int], nodes: tuple[int, ...], G: int) -> list[str]:
    """A warning when a block of G consecutive ranks of a dp x cp group spans nodes (pure,
    the grid's rank order): its gathers of every use would cross the link that hpZ is there
    to keep them off. Empty when every block stays on one node, or hpZ is off."""
    if G == 1:
        return []
    for r in range(len(nodes)):
        group = topology.members(r, sizes, ("dp", "cp"))  # in the ZeRO group's rank order
        k = group.index(r) // G
        block = group[k * G : (k + 1) * G]
        if topology.span(block, nodes) == "inter":
            here = sum(nodes[m] == nodes[r] for m in group)
            fix = (f"give the ranks of a ZeRO group on one node (here {here}) or a divisor"
                   if here > 1 else "no two ranks of a ZeRO group share a node here: leave "
                   "--hpz-size 1")
            return [f"--hpz-size {G}: the block of world ranks {', '.join(map(str, block))} "
                    f"spans nodes ({len(set(nodes))} nodes of {nodes.count(0)} ranks here), so "
                    f"ZeRO-3's weight all-gathers of every use cross the link between nodes, "
                    f"which hpZ is there to keep them off; {fix} (docs/zero_at_scale.md)"]
    return []


def secondary(full, G: int, i: int, shard: int):
    """My secondary slice (N S,) of the whole unit ``full`` (Pp,): the primaries of the ranks
    k G + i, k = 0..N-1."""
    return full.reshape(-1, G, shard)[:, i, :].reshape(-1).copy()  # (N, G, S) -> (N S,)


def block_gather(inner: Comm, mine, shard: int):
    """The whole unit (Pp,) from the inner group's secondaries ``mine`` (N S,), the current
    ones or a weight version's (module docstring)."""
    got = inner.allgather(mine)  # (G N S,) in the order (i, k)
    G = inner.size
    return got.reshape(G, -1, shard).transpose(1, 0, 2).reshape(-1)  # (k, i): rank order
