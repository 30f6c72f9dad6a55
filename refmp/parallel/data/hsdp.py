"""HSDP, hybrid sharded data parallelism (PyTorch FSDP's HYBRID_SHARD, torchtitan's
dp_replicate x dp_shard): ZeRO's stages inside shard groups, replicas across them.

Shapes: a unit of Pp elements (padded) over a shard group of n = N cp ranks (``--dp-shard``
N dp ranks, with every cp rank of each), S = Pp/n the slice a rank owns; dp/N replicas.

The dp x cp ranks of a ZeRO group (rank f = dp_i cp + cp_i, the grid's order) are cut into
dp/N blocks of n consecutive ranks: the shard group (``{axis}.shard``, my block) and the
replicas (``{axis}.replicate``, the ranks with my index in theirs). ZeRO runs on the shard
group unchanged (refmp.parallel.data.sharder), and the gradient is summed over the replicas
once a step:

    reduce-scatter inside   (Pp,) -> (S,): my slice of my shard group's sum (each micro-batch
                            at stages 2 and 3; once a step at stage 1)
    all-reduce across       (S,): my slice of the whole dp x cp sum, once a step (the only
                            gradient traffic between replicas)
    all-gather inside       (S,) -> (Pp,): the updated weights (stages 1-2, after the step),
                            a unit's weights before each use (stage 3)

Every replica updates the same slice with the same summed gradient, so the replicas stay
equal, and the run equals plain data parallelism (and the serial model) to rounding: each
element is a sum of shard groups' sums, in another order. Per rank: the optimizer state,
the gradient (stages 2-3) and the weights (stage 3) of S = Pp/n elements, ZeRO's formulas
with n the shard group (refmp.cost.zero). Bytes per step: ZeRO's over n on the shard group,
and an all-reduce of S w per unit across (refmp.cost.zero.hsdp_per_step).

With Megatron's rank order the shard group is N cp tp-spaced ranks that are neighbours, so
on nodes of N cp tp ranks (or a multiple) it stays inside a node and only the all-reduce of
the slice crosses between nodes: Pp/n per rank, 1/n of what a flat all-reduce carries.
"""

from __future__ import annotations

from refmp.distributed import topology
from refmp.distributed.comm import Comm
from refmp.parallel.data.hierarchical import two_levels


def shard_groups(flat: Comm, n: int, nodes: tuple[int, ...]) -> tuple[Comm, Comm]:
    """(shard, replicate): the n consecutive ranks of my block of ``flat`` (a dp x cp
    group), and the ranks with my index in the other blocks. Ledger labels ``{axis}.shard``
    and ``{axis}.replicate``, with ``[intra]`` / ``[inter]`` where the grid spans several
    ``nodes``."""
    block, index = divmod(flat.rank, n)
    return two_levels(flat, block, index, ("shard", "replicate"), nodes)


def shard_notes(sizes: dict[str, int], nodes: tuple[int, ...], N: int) -> list[str]:
    """A warning when a shard group (N cp consecutive ranks of a dp x cp group, the grid's
    rank order) spans nodes: its reduce-scatters and all-gathers, every micro-batch at
    stages 2-3, would cross the link that HSDP keeps them off. Pure; empty when every shard
    group stays on one node, or HSDP is off (N 0 or dp)."""
    if N in (0, sizes["dp"]):
        return []
    n = N * sizes["cp"]
    for r in range(len(nodes)):
        group = topology.members(r, sizes, ("dp", "cp"))  # in the ZeRO group's rank order
        k = group.index(r) // n
        block = group[k * n : (k + 1) * n]
        if topology.span(block, nodes) == "inter":
            return [f"--dp-shard {N}: the shard group of world ranks {', '.join(map(str, block))} "
                    f"spans nodes, so ZeRO's reduce-scatters and all-gathers cross the link "
                    f"between them, which HSDP is there to keep them off: give --dp-shard the "
                    f"dp ranks of one node or a divisor of them (docs/frontier.md)"]
    return []
