"""MoE parallel folding's grid: the experts' etp x ep x edp over a pipeline stage's ranks.

Shapes: n = tp cp dp the ranks of a stage; etp, ep, edp = n / (etp ep) the experts' groups.

Attention's grid (refmp.distributed.grid) numbers a stage's ranks l = (dp_i cp + cp_i) tp +
tp_i. The experts' grid (Liu et al. 2025, "MoE Parallel Folding"; Megatron-core's expert
tensor parallelism) cuts the same n ranks again, etp fastest, then ep, then edp:

    etp rank = l % etp,   ep rank = (l // etp) % ep,   edp rank = l // (etp ep)

so ep may take ranks from tp and cp (tp 2 x ep 4 on 4 ranks: four ranks, four different
experts), each expert is split over its etp ranks (refmp.parallel.folding), and the edp
ranks hold the same expert shards and sum their gradients. Without folding the grid carves
ep from dp x cp alone and an expert is whole on every tp rank.
"""

from __future__ import annotations

from mpi4py import MPI


def fold(grid, etp: int) -> dict[str, MPI.Comm]:
    """The MPI communicators of ``grid``'s rank's etp, ep and edp groups (collective over
    the grid's world: every rank calls it once): each Split's colour is the world rank of the
    group's member at index 0, its key the rank's index in the group."""
    ep, r = grid.sizes["ep"], grid.rank
    first = grid.rank_of(pp=grid.coords["pp"])  # the stage's first rank: l = r - first
    steps = {"etp": 1, "ep": etp, "edp": etp * ep}  # l between neighbours of each group
    index = {"etp": (r - first) % etp, "ep": (r - first) // etp % ep,
             "edp": (r - first) // (etp * ep)}
    return {a: grid.mpi.Split(r - index[a] * steps[a], index[a]) for a in ("etp", "ep", "edp")}
