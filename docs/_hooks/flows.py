"""MkDocs hook: how the data flows, one picture per collective pattern, drawn while the site is
built with numbers from refmp's own code (the who-holds-what pictures are docs/_hooks/pictures.py):

    ring_allreduce  a ring all-reduce step by step: which chunk each rank sends and what each
                    holds after; the gradient's bytes from refmp.cost.zero.unit_sizes, the
                    share a rank sends from refmp.cost.terms.collective's ring
    megatron        Megatron's MLP with f and g, and with SP's all-gather and reduce-scatter:
                    the shards' shapes from refmp.parallel.placement.tp_shard, the bytes from
                    refmp.cost.tensor.comm_bytes_per_step
    zero_flat       ZeRO's flat buffers (refmp.parallel.data.zero.Unit: padding, each rank's
                    slice) through reduce-scatter and all-gather, the bytes from
                    refmp.cost.zero.comm_per_step
    ulysses         Ulysses' all-to-all: tokens (SequenceChunks) for heads and back
    moe             MoE dispatch and combine: the routing refmp.nn.moe.moe_forward makes of
                    two ranks' tokens, the counts exchanged, the rows sent each way

Each is an SVG file of the built site, img/flow/<name>.svg, shown by the page that teaches it.
"""

from __future__ import annotations

import numpy as np
from mkdocs.structure.files import File
from svg import INK, SHARED, Svg, cells, colour

from refmp.cost.tensor import comm_bytes_per_step
from refmp.cost.zero import comm_per_step, local_shapes, unit_sizes
from refmp.nn import moe as M
from refmp.nn.params import GPTConfig, param_shapes
from refmp.parallel.context.chunks import SequenceChunks
from refmp.parallel.data.zero import Unit
from refmp.parallel.placement import tp_shard

TINY = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)  # bench's tiny


def arrow(s: Svg, x1, y1, x2, y2, label: str = "", stroke="#555555") -> None:
    s.line(x1, y1, x2, y2, stroke, 1.4)
    dx, dy = x2 - x1, y2 - y1
    n = max((dx * dx + dy * dy) ** 0.5, 1e-9)
    ux, uy = dx / n, dy / n
    s.polyline([(x2 - 6 * ux - 3 * uy, y2 - 6 * uy + 3 * ux), (x2, y2),
                (x2 - 6 * ux + 3 * uy, y2 - 6 * uy - 3 * ux)], stroke, 1.4)
    if label:
        s.text((x1 + x2) / 2, (y1 + y2) / 2 - 4, label, 9, "middle")


def ring_allreduce() -> Svg:
    """N = 4 ranks, each buffer in N chunks: N-1 reduce-scatter steps, then N-1 all-gather steps.
    Step s: rank r sends chunk (r - s) mod N (then (r + 1 - s) mod N) to rank r + 1."""
    N = 4
    held = [[{r} for _ in range(N)] for r in range(N)]  # held[r][c]: whose parts rank r summed
    rows = [("each rank: its own gradient", [[set(x) for x in h] for h in held], None)]
    for s in range(N - 1):
        sent = [(r - s) % N for r in range(N)]
        for r in range(N):
            held[(r + 1) % N][sent[r]] |= held[r][sent[r]]
        rows.append((f"reduce-scatter step {s + 1}", [[set(x) for x in h] for h in held], sent))
    for s in range(N - 1):
        sent = [(r + 1 - s) % N for r in range(N)]
        for r in range(N):
            held[(r + 1) % N][sent[r]] = set(held[r][sent[r]])
        rows.append((f"all-gather step {s + 1}", [[set(x) for x in h] for h in held], sent))
    X = 4 * sum(unit_sizes(TINY).values())  # bench's tiny model's fp32 gradient, bytes
    share = 2 * (N - 1) / N  # refmp.cost.terms.collective: 2 (n-1)/n of the buffer per rank
    s = Svg(760, 60 + 44 * len(rows) + 30, "a ring all-reduce over 4 ranks, step by step")
    s.text(10, 18, f"ring all-reduce, N = {N}: each buffer in {N} chunks; a cell shows the "
                   "ranks whose parts it holds summed", 12, bold=True)
    s.text(10, 36, f"bench's tiny model: X = {X:,} bytes of fp32 gradient; each rank sends "
                   f"2 (N-1)/N X = {int(share * X):,} bytes in {2 * (N - 1)} steps of X/N", 10)
    for r in range(N):
        s.text(190 + 140 * r, 56, f"rank {r}", 11, bold=True)
    for k, (label, state, sent) in enumerate(rows):
        y = 66 + 44 * k
        s.text(10, y + 20, label, 10)
        for r in range(N):
            for c in range(N):
                parts = state[r][c]
                x = 190 + 140 * r + 31 * c
                full = len(parts) == N
                s.rect(x, y, 29, 28, colour(c) if full else "#ffffff", colour(c) if not full else
                       "#ffffff", f"rank {r}, chunk {c}: " + "+".join(map(str, sorted(parts))))
                s.text(x + 14.5, y + 17, "all" if full else "+".join(map(str, sorted(parts))),
                       8, "middle", fill="#ffffff" if full else INK)
                if sent is not None and sent[r] == c:  # the chunk this rank sent this step
                    s.rect(x - 1, y - 1, 31, 30, "none", INK)
    s.text(10, 66 + 44 * len(rows) + 8, "outlined: the chunk each rank sent to rank r + 1 "
                                        "in that step (the receiver adds it, then copies it)", 10)
    return s


def megatron() -> Svg:
    """GPT-2 small's MLP over tp 4: X A_r, GELU, Y_r B_r, with f and g; then with SP."""
    mcfg = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    tp, b, T, C, isz = 4, 1, 1024, 768, 2  # bf16 activations
    shapes = param_shapes(mcfg)
    a = tp_shard("h.0.mlp.c_fc.weight", np.empty(shapes["h.0.mlp.c_fc.weight"]), 0, tp).shape
    w = tp_shard("h.0.mlp.c_proj.weight", np.empty(shapes["h.0.mlp.c_proj.weight"]), 0, tp).shape
    act = b * T * C * isz
    s = Svg(760, 330, "Megatron's MLP with f and g, and with sequence parallelism")
    s.text(10, 18, f"GPT-2 small's MLP on tp = {tp} (b = {b}, T = {T}, C = {C}, bf16): rank r "
                   "holds A_r and B_r; one all-reduce forward, one backward", 12, bold=True)
    for k, sp in enumerate((False, True)):
        y = 50 + 140 * k
        s.text(10, y, "with sequence parallelism (SP)" if sp else "tensor parallelism", 11,
               bold=True)
        T_in = f"T/{tp}" if sp else "T"
        boxes = [(f"X (b, {T_in}, C)", SHARED if not sp else colour(0)),
                 ("all-gather T" if sp else "f", "#ffffff"),
                 (f"X A_r: A_r {a}", colour(0)), ("GELU", colour(0)),
                 (f"Y_r B_r: B_r {w}", colour(0)),
                 ("reduce-scatter T" if sp else "g", "#ffffff"),
                 (f"Z (b, {T_in}, C)", SHARED if not sp else colour(0))]
        x = 10
        for j, (label, fill) in enumerate(boxes):
            wd = 88 if j in (1, 5) else 100
            s.rect(x, y + 12, wd, 40, fill, "#888888")
            s.text(x + wd / 2, y + 36, label, 9, "middle",
                   fill="#ffffff" if fill == colour(0) else INK)
            if j < len(boxes) - 1:
                arrow(s, x + wd, y + 32, x + wd + 10, y + 32)
            x += wd + 10
        fwd = ("all-gather", "reduce-scatter") if sp else ("identity", "all-reduce")
        bwd = ("reduce-scatter", "all-gather") if sp else ("all-reduce", "identity")
        s.text(10, y + 72, f"forward: {fwd[0]} in, {fwd[1]} out; backward: {bwd[0]} of dX, "
                           f"{bwd[1]} of dZ; each moves one (b, T, C) activation, "
                           f"{act:,} bytes", 10)
        per = comm_bytes_per_step(b, T, C, mcfg.n_layer, sp, isz)
        s.text(10, y + 90, "a whole step on tp, by the ledger's formula: " + ", ".join(
            f"{op} {v / 2**20:.1f} MiB" if v >= 2**20 else f"{op} {v / 2**10:.1f} KiB"
            for op, v in per.items() if v), 10)
        s.text(10, y + 106, ("between the blocks each rank keeps T/tp tokens: LayerNorm, "
                             "dropout and residual on 1/tp of the activations" if sp else
                             "X, Z and the LayerNorms around them are whole on every rank"), 10)
    s.legend(10, 322, [(colour(0), "this rank's share (1/tp)"), (SHARED, "whole on every rank")])
    return s


def zero_flat() -> Svg:
    """Bench's tiny model over dp 4: each unit flattened and padded, its slices, the two
    collectives of ZeRO-1/2 (reduce-scatter of gradients, all-gather of parameters)."""
    shapes = local_shapes(TINY)
    n = 4
    units = {u: [Unit(u, shapes[u], n, r) for r in range(n)] for u in shapes}
    total = sum(us[0].padded for us in units.values())
    scale = 560 / total
    by = comm_per_step(unit_sizes(TINY), n, 1)
    s = Svg(760, 318, "ZeRO's flat buffers through reduce-scatter and all-gather")
    s.text(10, 18, f"bench's tiny model on dp = {n}: each unit one flat buffer, padded to a "
                   f"multiple of {n}, rank r owning slice [lo, hi)", 12, bold=True)
    stages = [("1. backward: every rank a whole gradient", None, "#f2b880"),
              ("2. reduce-scatter: rank r, the sum of its slice", "mine", "#e07b39"),
              ("3. AdamW on the slice (fp32 masters, moments)", "mine", colour(0)),
              ("4. all-gather: every rank the whole parameters", None, colour(0))]
    for k, (label, who, fill) in enumerate(stages):
        y = 40 + 56 * k
        s.text(10, y + 12, label, 10, bold=True)
        for r in range(2):  # ranks 0 and 1 shown; 2 and 3 alike
            yy = y + 18 + 14 * r
            s.text(10, yy + 9, f"rank {r}", 9)
            x = 60
            for u, us in units.items():
                unit = us[r]
                s.rect(x, yy, unit.padded * scale, 11, "#f4f4f4", "#cccccc")
                lo, hi = (unit.lo, unit.hi) if who else (0, unit.numel)
                s.rect(x + lo * scale, yy, (hi - lo) * scale, 11, fill, "none",
                       f"{u}: elements {lo}-{hi} of {unit.padded} ({unit.numel} + padding)")
                x += unit.padded * scale
        if k < len(stages) - 1:
            arrow(s, 630, y + 38, 630, y + 62)
    x = 60
    for u, us in units.items():  # the units' names under the last bar
        s.text(x + us[0].padded * scale / 2, 40 + 56 * 4 + 4, u, 9, "middle")
        x += us[0].padded * scale
    s.text(10, 288, f"per step and rank (refmp.cost.zero.comm_per_step, fp32): reduce-scatter "
                    f"{by['reduce_scatter']:,} bytes, all-gather {by['allgather']:,} bytes; "
                    f"the all-reduce of ZeRO-0 is the two", 10)
    s.text(10, 306, "grey: padding and the slices other ranks own; ZeRO-3 gathers each unit "
                    "again before its forward and backward, and frees it after", 10)
    return s


def ulysses() -> Svg:
    """cp 2: tokens (zig-zag chunks) x heads before, all tokens x my heads after."""
    T, NH, cp, b, C, isz = 8, 4, 2, 1, 64, 4
    seq = SequenceChunks(T, cp, "zigzag")
    by_token = np.empty((NH, T), int)
    for r in range(cp):
        by_token[:, seq.positions(r)] = r
    by_head = np.repeat(np.arange(cp), NH // cp)[:, None] * np.ones((1, T), int)
    Tl = T // cp
    s = Svg(760, 230, "Ulysses' all-to-all: tokens for heads, and back")
    s.text(10, 18, f"DeepSpeed-Ulysses, cp = {cp}, T = {T} (zig-zag chunks), {NH} heads: rows "
                   "heads, columns positions, each cell in the colour of its rank", 12, bold=True)
    cells(s, 10, 60, by_token, 16, f"q, k, v: rank r holds its {Tl} tokens, every head "
                                   f"(b, T/cp, 3C)")
    arrow(s, 150, 92, 290, 92, "all-to-all #1")
    cells(s, 300, 60, by_head, 16, f"rank r: every token, heads [{NH // cp}r, {NH // cp}(r+1)) "
                                   f"(b, T, 3C/cp)")
    s.text(440, 92, "causal attention", 10)
    s.text(440, 106, "over the whole sequence", 10)
    arrow(s, 590, 92, 640, 92, "#2")
    cells(s, 650, 60, by_token[:, :], 12, "out (b, T/cp, C)")
    qkv, out = b * Tl * 3 * C * isz, b * Tl * C * isz
    s.text(10, 160, f"per rank and layer (b = {b}, C = {C}, fp32): all-to-all #1 sends "
                    f"{qkv:,} bytes of q, k, v, #2 {out:,} bytes of the output; backward the two "
                    "in reverse", 10)
    s.text(10, 178, f"(cp-1)/cp of each stays off the rank's wire: {qkv * (cp - 1) // cp:,} and "
                    f"{out * (cp - 1) // cp:,} bytes leave it; cp must divide NH", 10)
    s.legend(10, 210, [(colour(r), f"cp rank {r}") for r in range(cp)])
    return s


def moe() -> Svg:
    """Two ranks' tokens routed by moe_forward (E 4, top-2, capacity 1.0), experts over ep 2."""
    E, K, C, T, ep = 4, 2, 8, 6, 2
    rng = np.random.default_rng(4)
    p = {k: rng.standard_normal(sh) * 0.5 for k, sh in M.moe_param_shapes(C, E).items()}
    ctx = M.MoEContext(n_expert=E, top_k=K, capacity_factor=1.0, aux_loss_coef=0.0,
                       z_loss_coef=0.0)
    routes = []
    for _ in range(ep):
        _, c = M.moe_forward(p, rng.standard_normal((1, T, C)), ctx)
        kept = np.zeros(T * K, bool)
        kept[c.order] = True
        routes.append((c.top, kept.reshape(T, K)))
    El = E // ep
    counts = np.array([[int((top[kp] // El == j).sum()) for j in range(ep)]
                       for top, kp in routes])  # [src, dst] rows sent
    s = Svg(760, 330, "MoE dispatch and combine over ep 2")
    s.text(10, 18, f"{E} experts, top-{K}, capacity factor 1 (cap = {M.capacity(1.0, K, T, E)} "
                   f"per sequence), ep = {ep}: rank r holds experts [{El}r, {El}(r+1))",
           12, bold=True)
    tok_y = {(r, t): 48 + 130 * r + 18 * t for r in range(ep) for t in range(T)}
    exp_y = {e: 60 + 62 * e for e in range(E)}
    for r, (top, kp) in enumerate(routes):
        for t in range(T):
            y = tok_y[(r, t)]
            s.rect(20, y, 60, 14, colour(r), "#ffffff")
            s.text(50, y + 10, f"r{r} t{t}", 9, "middle", fill="#ffffff")
            for k in range(K):
                e = int(top[t, k])
                s.line(80, y + 7, 300, exp_y[e] + 14, colour(e // El) if kp[t, k] else "#cccccc",
                       1.2, None if kp[t, k] else "3,3")
    for e in range(E):
        s.rect(300, exp_y[e], 90, 28, colour(e // El), "#ffffff")
        s.text(345, exp_y[e] + 18, f"E{e} on rank {e // El}", 9, "middle", fill="#ffffff")
    s.text(20, 44 + 130 * ep + 8, "dashed: dropped (over capacity): the residual carries it", 9)
    x0 = 420
    s.text(x0, 60, "1. all-to-all of the counts (E,) per rank:", 10, bold=True)
    for r in range(ep):
        s.text(x0, 78 + 16 * r, f"rank {r} sends rows " + ", ".join(
            f"{counts[r, j]} to rank {j}" for j in range(ep)), 10)
    s.text(x0, 124, "2. all-to-all(v) of the token rows (M, C):", 10, bold=True)
    for j in range(ep):
        s.text(x0, 142 + 16 * j, f"rank {j} receives {counts[:, j].sum()} rows, "
                                 f"{counts[:, j].sum() * C * 4:,} bytes (C = {C}, fp32)", 10)
    s.text(x0, 188, "3. each expert runs on its rows", 10, bold=True)
    s.text(x0, 212, "4. all-to-all(v) of the results back;", 10, bold=True)
    s.text(x0, 228, "   the owner sums them with the gates", 10)
    s.text(x0, 252, "backward: the same two trips the other way", 10)
    s.text(x0, 270, "(the output gradients to the experts,", 10)
    s.text(x0, 286, " the input gradients back)", 10)
    return s


FLOWS = {"ring_allreduce": ring_allreduce, "megatron": megatron, "zero_flat": zero_flat,
         "ulysses": ulysses, "moe": moe}


def on_files(files, config, **kwargs):
    for name, draw in FLOWS.items():
        files.append(File.generated(config, f"img/flow/{name}.svg", content=str(draw())))
    return files
