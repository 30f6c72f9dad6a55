"""Who holds what on a grid: one row per world rank, from the ownership rules of placement.py
(the parameter table), pipeline/partition.py (which chunks and blocks) and context/chunks.py
(which tokens). The guide's pictures (docs/_hooks/pictures.py) draw it, and
tutorials/09_any_layout.py prints the same table from a running engine.

Shapes: NH heads, Vp the vocabulary padded to a multiple of tp, E experts; pp, dp, cp, tp,
ep group sizes (ep carved from dp x cp).
"""

from __future__ import annotations

import math

from refmp.parallel.context.chunks import SequenceChunks
from refmp.parallel.pipeline.catalog import CATALOG
from refmp.parallel.pipeline.partition import rank_chunks
from refmp.parallel.placement import expert_coords, expert_owner, padded_vocab

GRID_ORDER = ("pp", "dp", "cp", "tp")  # refmp.distributed.grid's, slowest to fastest


def who_holds(mcfg, sizes: dict[str, int], T: int, schedule: str = "1f1b",
              virtual_stages: int = 1, stage_layers: str | None = None,
              cp_balance: str = "zigzag") -> list[dict]:
    """Who holds what on a grid of ``sizes`` (pp, dp, cp, tp, ep) running ``schedule``: one
    row per world rank, in rank order:

        coords      pp, dp, cp, tp (the grid's order: rank = ((pp dp_n + dp) cp_n + cp) tp_n
                    + tp), and ep, edp: f % ep and f // ep of f = dp cp_n + cp (ep is carved
                    from dp x cp); with folding (``sizes["etp"]``) etp, ep and edp refolded
                    from the stage's ranks (placement.expert_coords)
        chunks      chunk -> its blocks (rank_chunks)
        first, last whether it holds the embeddings (wte, wpe) / the head (ln_f, the tied wte)
        tokens      the positions of a sequence it holds (cp's SequenceChunks)
        heads       [lo, hi) of the attention heads (tp: NH/tp each, TP_SPLITS' "heads")
        wte_rows    [lo, hi) of the Vp padded vocabulary rows (tp), None off the two ends
        experts     the experts it holds of each MoE layer (expert_owner)
        expert_cols [lo, hi) of each expert's 4C hidden columns it holds (etp: 4C/etp each)
    """
    rows = []
    NH = mcfg.n_head
    E = mcfg.n_expert
    Vl = padded_vocab(mcfg.vocab_size, sizes["tp"]) // sizes["tp"]  # wte rows per tp rank
    seq = SequenceChunks(T, sizes["cp"], cp_balance)
    placed = CATALOG[schedule].chunk_placement(sizes["pp"], virtual_stages)
    radix = [sizes[a] for a in GRID_ORDER]
    for rank in range(math.prod(radix)):
        coords = {}
        rest = rank
        for a, n in zip(reversed(GRID_ORDER), reversed(radix), strict=True):  # tp fastest
            rest, coords[a] = divmod(rest, n)
        chunks = rank_chunks(mcfg, T, coords["pp"], placed, stage_layers)
        S = sizes["pp"] * placed.v
        first = 0 in chunks
        last = S - 1 in chunks
        tp_i = coords["tp"]
        ex, H = expert_coords(sizes, coords), 4 * mcfg.n_embd  # the experts' grid
        cols = H // (sizes.get("etp") or 1)
        rows.append({
            "rank": rank, **{a: coords[a] for a in GRID_ORDER},
            "ep": ex["ep"], "edp": ex["edp"], "etp": ex["etp"],
            "expert_cols": (ex["etp"] * cols, (ex["etp"] + 1) * cols),
            "chunks": {c: list(b) for c, b in chunks.items()}, "first": first, "last": last,
            "tokens": [int(t) for t in seq.positions(coords["cp"])],
            "heads": (tp_i * NH // sizes["tp"], (tp_i + 1) * NH // sizes["tp"]),
            "wte_rows": (tp_i * Vl, (tp_i + 1) * Vl) if first or last else None,
            "experts": [e for e in range(E) if expert_owner(e, E, sizes["ep"]) == ex["ep"]],
        })
    return rows
