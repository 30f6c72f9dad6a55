"""What the two-level strategies move per step, by level, from the shapes alone (the
ledger's figures, for tests and the planner): hierarchical context parallelism
(refmp.parallel.context.hybrid) and HSDP (refmp.parallel.data.hsdp).

Hierarchical cp. Shapes: bd rows a dp rank takes in a step (over its micro-batches), Tl = T/cp tokens a rank
holds, C channels, Ls blocks on the rank, M micro-batches, w bytes per element; cp = U x R,
U ranks in a Ulysses group, R groups around the ring.

Per block and micro-batch, a rank's Ulysses group makes four all-to-alls (qkv and y forward,
their gradients backward: 2 (3 + 1) bd Tl C/tp elements over the step), and its ring passes
K/V blocks of 2 bd Tl C/tp elements (U Tl tokens of NH/(tp U) heads) R - 1 times forward,
again backward, and the dK/dV blocks home: 3 (R - 1) sends and as many receives. Full
recomputation repeats the forward's: 6 all-to-alls, 4 (R - 1) sends.

HSDP. Shapes: a unit of P elements, Pp padded to a multiple of the n ranks of a shard group
(dp-shard x cp), S = Pp/n. ZeRO's collectives are refmp.cost.zero's over n, on the shard
group; once a step each unit's owned slice is all-reduced across the replicas, S w bytes;
the memory is ZeRO's over n (memory_per_rank).
"""

from __future__ import annotations

from refmp.cost.zero import padded


def hybrid_cp_ledger(lay, bd: int, Tl: int, C: int, Ls: int, M: int,
                     w: int) -> dict[tuple[str, str], tuple[int, int]]:
    """(op, ledger label) -> (bytes, calls) per step on this rank (module docstring);
    ``lay``: a layout's tp, cp, cp_ulysses (U) and recompute (a Layout, a ParallelConfig)."""
    tp, cp, U = lay.tp, lay.cp, lay.cp_ulysses
    R, full = cp // U, lay.recompute == "full"
    k_a2a, k_ring = (6, 4) if full else (4, 3)
    width = bd * Tl * (C // tp) * w  # one (bd, Tl, C/tp) activation's bytes
    sends = (k_ring * (R - 1) * Ls * 2 * width, k_ring * (R - 1) * Ls * M)
    return {("alltoall", "cp.ulysses"): (2 * k_a2a * Ls * width, k_a2a * Ls * M),
            ("send", "cp.ring"): sends, ("recv", "cp.ring"): sends}


def hsdp_per_step(sizes: dict[str, int], n: int, replicas: int, itemsize: int = 4) -> int:
    """HSDP: ZeRO over shard groups of n ranks (refmp.cost.zero.comm_per_step over n, on
    ``{axis}.shard``; memory_per_rank over n), and ``replicas`` of them: the ledger bytes
    per step of the all-reduce across the replicas (``{axis}.replicate``), each unit's
    owned slice S = Pp/n once (``sizes``: unit -> elements; ``itemsize``: the gradients')."""
    return itemsize * sum(padded(s, n) // n for s in sizes.values()) if replicas > 1 else 0
