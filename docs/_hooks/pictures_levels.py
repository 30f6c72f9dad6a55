"""Who holds what in the two-level strategies, drawn by docs/_hooks/pictures.py (img/holds/) from
the code's own tables:

    hybrid_cp  refmp.parallel.context.chunks.SequenceChunks (the tokens a cp rank holds) and
               refmp.parallel.context.hybrid.GroupChunks (the tokens its Ulysses group holds
               after the all-to-all, which the ring sees as one rank's), with its heads
    hsdp       refmp.parallel.data.zero.Unit over a shard group (the slice each rank owns,
               the same on each replica) and refmp.cost.zero.memory_per_rank
    folding    refmp.parallel.placement's expert_coords, expert_owner and expert_split (the
               experts and hidden columns each rank holds, with and without MoE folding)
"""

from __future__ import annotations

import numpy as np
from svg import Svg, cells, colour

from refmp.cost.zero import local_shapes, memory_per_rank, unit_sizes
from refmp.nn.params import GPTConfig
from refmp.parallel.context.chunks import SequenceChunks
from refmp.parallel.context.hybrid import GroupChunks
from refmp.parallel.data.zero import Unit
from refmp.parallel.placement import expert_coords, expert_owner, expert_split


def hybrid_cp() -> Svg:
    """cp 4 = Ulysses 2 x ring 2: each rank's tokens (zig-zag), then, inside attention, its
    group's tokens and its half of the heads; the ring passes K/V between the two groups."""
    T, cp, U, NH = 16, 4, 2, 4
    seq = SequenceChunks(T, cp, "zigzag")
    group = GroupChunks(seq, U)
    owner = np.empty(T, int)
    for r in range(cp):
        owner[seq.positions(r)] = r
    s = Svg(760, 255, "hierarchical context parallelism: Ulysses 2 inside, the ring across 2")
    s.text(10, 18, f"cp = {cp} = Ulysses {U} x ring {cp // U}, T = {T}, {NH} heads: cp rank "
                   "g U + i is rank i of Ulysses group g", 12, bold=True)
    cells(s, 10, 50, owner[None, :], 14, "the tokens each cp rank holds (zig-zag chunks of "
                                         f"{seq.c}): embeddings, MLPs, the loss")
    s.text(10, 94, "inside attention, after the all-to-all in each group: rows the heads, "
                   "columns the tokens a rank holds", 10)
    nh = NH // U
    for r in range(cp):
        g, i = divmod(r, U)
        mine = np.full((NH, T), -2)
        held = [t for k in group.chunks(g) for t in range(k * seq.c, (k + 1) * seq.c)]
        mine[i * nh : (i + 1) * nh, held] = r
        x = 10 + 185 * r
        s.text(x, 114, f"rank {r}: group {g}, heads {i * nh}-{(i + 1) * nh - 1}", 10)
        for h in range(NH):
            for t in range(T):
                o = mine[h, t]
                s.rect(x + 10 * t, 122 + 12 * h, 10, 12, colour(o) if o >= 0 else "#f4f4f4",
                       "#ffffff")
    s.text(10, 196, f"group g holds the chunks of cp ranks gU .. gU+U-1 ({group.chunks(0)} "
                    f"and {group.chunks(1)}): U early and U late chunks, equal causal work", 10)
    s.text(10, 214, "the ring (ranks 0 and 2, ranks 1 and 3) passes K/V blocks of those tokens "
                    "and heads; the reverse all-to-all returns each rank its tokens, all heads", 10)
    s.legend(10, 240, [(colour(r), f"cp rank {r}") for r in range(cp)])
    return s


def hsdp() -> Svg:
    """dp 4 = 2 replicas x shard groups of 2: the slice of every unit each rank owns."""
    mcfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
    shapes, sizes = local_shapes(mcfg), unit_sizes(mcfg)
    n, dp = 2, 4
    padded = {u: Unit(u, shapes[u], n, 0).padded for u in shapes}
    scale = 560 / sum(padded.values())
    held = memory_per_rank(sizes, n, 3)
    s = Svg(760, 250, "HSDP: ZeRO-3 over shard groups of 2, replicated across 2")
    s.text(10, 18, f"dp = {dp} = 2 replicas x shard groups of {n}: the units wte, wpe, h.0, "
                   "h.1, ln_f end to end; each rank's colour the slice it owns", 12, bold=True)
    for r in range(dp):
        k, i = divmod(r, n)
        y = 40 + 40 * r
        s.text(10, y + 11, f"rank {r}: replica {k}, shard {i}", 10)
        off = 0.0
        for u in shapes:
            unit = Unit(u, shapes[u], n, i)
            s.rect(170 + off, y, unit.padded * scale, 16, "#f4f4f4", "#dddddd")
            s.rect(170 + off + unit.lo * scale, y, unit.shard * scale, 16, colour(i))
            off += unit.padded * scale
    s.text(10, 212, f"each rank keeps {held['params']:,} bytes of weights, as many of gradients "
                    f"and {held['optimizer']:,} of AdamW's moments (fp32): ZeRO-3's over {n}", 10)
    s.text(10, 230, "reduce-scatter and all-gather inside a shard group (ranks 0 and 1, 2 and 3); "
                    "once a step an all-reduce of the slice across the replicas (0 and 2, 1 and 3)", 10)
    return s


def folding() -> Svg:
    """4 ranks (dp 2 x tp 2), 4 experts of H hidden columns: what each rank holds of every
    expert's c_fc (its columns; c_proj's rows alike) without folding and in two foldings."""
    E, H, n = 4, 8, 4
    cases = [("--tp 2 --ep 2", 2, 0), ("--tp 2 --ep 4 --etp 1", 4, 1),
             ("--tp 2 --ep 2 --etp 2", 2, 2)]
    w, gap = 5, 6  # a hidden column's width, the gap between experts
    panel = E * (H * w + gap) + 20
    s = Svg(760, 200, "MoE parallel folding: the experts' own grid over the same 4 ranks")
    s.text(10, 18, f"dp 2 x tp 2, {E} experts of {H} hidden columns (c_fc's; c_proj's rows "
                   "alike): the part of each expert a rank holds", 12, bold=True)
    for j, (flags, ep, etp) in enumerate(cases):
        x0 = 110 + j * panel
        s.text(x0, 40, flags, 11, bold=True)
        for e in range(E):
            s.text(x0 + e * (H * w + gap), 53, f"expert {e}", 9)
        sizes = {"dp": 2, "cp": 1, "tp": 2, "ep": ep, **({"etp": etp} if etp else {})}
        for r in range(n):
            d, t = divmod(r, 2)
            ex = expert_coords(sizes, {"dp": d, "cp": 0, "tp": t})
            dim, _ = expert_split("experts.0.c_fc.weight")
            cut = max(etp, 1)  # without folding an expert is whole (copied over tp)
            lo, hi = ex["etp"] * H // cut, (ex["etp"] + 1) * H // cut
            y = 58 + 22 * r
            if j == 0:
                s.text(10, y + 11, f"rank {r} (dp {d}, tp {t})", 10)
            for e in range(E):
                mine = expert_owner(e, E, ep) == ex["ep"]
                for h in range(H):
                    held = mine and lo <= h < hi
                    s.rect(x0 + e * (H * w + gap) + h * w, y, w, 14,
                           colour(r) if held else "#f4f4f4", "#ffffff")
            assert dim == 1  # c_fc's columns are what etp splits
    s.text(10, 158, "without folding ep is carved from dp: the tp ranks hold the same experts "
                    "whole; folded, ep (and etp) take the tp ranks too", 10)
    s.text(10, 176, "expert weights a rank: / ep without folding, / (etp ep) folded; tokens "
                    "reach their experts by all-to-all over ep, then all-gather over etp", 10)
    return s


LEVELS = {"hybrid_cp": hybrid_cp, "hsdp": hsdp, "folding": folding}
