"""What context parallelism moves per step, from the shapes alone (the ledger's figures, for
tests and the planner): one level, the ring or Ulysses (:func:`cp_ledger`), and two,
hierarchical cp (refmp.parallel.context.hybrid: :func:`hybrid_cp_ledger`).

Hierarchical cp. Shapes: bd rows a dp rank takes in a step (over its micro-batches), Tl =
T/cp tokens a rank holds, C channels, Ls blocks on the rank, M micro-batches, w bytes per
element; cp = U x R, U ranks in a Ulysses group, R groups around the ring.

Per block and micro-batch, a rank's Ulysses group makes four all-to-alls (qkv and y forward,
their gradients backward: 2 (3 + 1) bd Tl C/tp elements over the step), and its ring passes
K/V blocks of 2 bd Tl C/tp elements (U Tl tokens of NH/(tp U) heads) R - 1 times forward,
again backward, and the dK/dV blocks home: 3 (R - 1) sends and as many receives. Full
recomputation repeats the forward's: 6 all-to-alls, 4 (R - 1) sends.
"""

from __future__ import annotations


def cp_ledger(lay, bd: int, Tl: int, C: int, Ls: int, M: int, c: int,
              kv: float = 1.0) -> tuple:
    """(op, bytes, calls) the ledger records on cp in one step of a rank with Ls blocks and
    bd rows (tests/test_context_parallel.py's want_per_step): the ring sends each block's
    K/V (2 bd Tl C/tp) cp-1 times forward, again backward, and dK/dV back; Ulysses makes
    four all-to-alls per block, qkv and y forward and their gradients backward (8 bd Tl
    C/tp). Full recomputation repeats the forward's: 4 (cp-1) sends, 6 all-to-alls.
    ``kv``: KV / NH, the ring's K/V under grouped-query attention (refmp.cost.family)."""
    full, tp, cp = lay.recompute == "full", lay.tp, lay.cp
    if cp == 1:
        return "send", 0, 0
    if lay.cp_algo == "ulysses":
        k = 6 if full else 4
        return "alltoall", 2 * k * Ls * bd * Tl * (C // tp) * c, k * Ls * M
    k = 4 if full else 3
    return ("send", int(k * (cp - 1) * Ls * 2 * bd * Tl * (C // tp) * c * kv),
            k * (cp - 1) * Ls * M)


def hybrid_cp_ledger(lay, bd: int, Tl: int, C: int, Ls: int, M: int, w: int,
                     kv: float = 1.0) -> dict[tuple[str, str], tuple[int, int]]:
    """(op, ledger label) -> (bytes, calls) per step on this rank (module docstring);
    ``lay``: a layout's tp, cp, cp_ulysses (U) and recompute (a Layout, a ParallelConfig);
    ``kv``: KV / NH, the ring's K/V under grouped-query attention, as :func:`cp_ledger`'s."""
    tp, cp, U = lay.tp, lay.cp, lay.cp_ulysses
    R, full = cp // U, lay.recompute == "full"
    k_a2a, k_ring = (6, 4) if full else (4, 3)
    width = bd * Tl * (C // tp) * w  # one (bd, Tl, C/tp) activation's bytes
    sends = (int(k_ring * (R - 1) * Ls * 2 * width * kv), k_ring * (R - 1) * Ls * M)
    return {("alltoall", "cp.ulysses"): (2 * k_a2a * Ls * width, k_a2a * Ls * M),
            ("send", "cp.ring"): sends, ("recv", "cp.ring"): sends}
