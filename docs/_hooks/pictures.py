"""MkDocs hook: who holds what, one picture per strategy page, drawn while the site is built
from the tables the engine itself slices the model with, so a picture cannot drift from the code:

    tensor_parallel  refmp.parallel.placement.tp_shard / tp_unshard on each weight (the column
                     and row shards, q|k|v by heads, wte's padded rows), SP's T/tp slices
    context_parallel refmp.parallel.context.chunks.SequenceChunks (zig-zag and contiguous chunks)
                     and ring_attention_flops (each rank's causal work)
    experts          refmp.parallel.holdings.who_holds (experts over ep, carved from dp x cp)
    zero             refmp.cost.zero.memory_per_rank (what each stage keeps whole) and
                     refmp.parallel.data.zero.Unit (the slice of each unit a rank owns)
    pipeline         refmp.parallel.pipeline.partition.rank_chunks (1F1B, interleaved, ZB-V's V)
    data_parallel    refmp.cost.zero.local_shapes (every rank holds every unit)
    compression      refmp.cost.zero.comm_per_step / compressed_per_step, refmp.cost.memory
                     .codec_bytes (bytes sent, bytes kept)
    architecture     who_holds of tutorial 9's 8 ranks, pp 2 x cp 2 x tp 2, ep 2, ZeRO-1
    hybrid_cp, hsdp, folding  the two-level strategies (docs/_hooks/pictures_levels.py)

Each is an SVG file of the built site, img/holds/<page>.svg, shown by its page.
"""

from __future__ import annotations

import math

import numpy as np
from mkdocs.structure.files import File
from pictures_levels import LEVELS
from svg import INK, SHARED, Svg, cells, colour

from refmp.cost.flops import ring_attention_flops
from refmp.cost.memory import codec_bytes
from refmp.cost.zero import (
    comm_per_step,
    compressed_per_step,
    local_shapes,
    memory_per_rank,
    unit_sizes,
)
from refmp.nn.params import GPTConfig, param_shapes
from refmp.parallel.context.chunks import SequenceChunks
from refmp.parallel.data.zero import Unit
from refmp.parallel.holdings import who_holds
from refmp.parallel.pipeline.catalog import CATALOG
from refmp.parallel.pipeline.partition import rank_chunks
from refmp.parallel.placement import local_name, padded_vocab, place, tp_shard, tp_unshard


def tensor_parallel() -> Svg:
    """A block's four weights and wte over tp 2, each cell in the colour of the rank that
    holds it (tp_shard of every rank, glued back by tp_unshard), and SP's activations."""
    C = 8  # a block of 4 heads of size 2, a vocabulary tp does not divide, 8 tokens
    NH = 4
    V = 11
    tp = 2
    T = 8
    mcfg = GPTConfig(vocab_size=V, block_size=T, n_layer=1, n_head=NH, n_embd=C)
    shapes = param_shapes(mcfg)
    s = Svg(760, 345, "tensor parallelism over 2 ranks: who holds which weights")
    s.text(10, 18, f"tp = {tp}: C = {C}, {NH} heads, V = {V} (padded to "
                   f"{padded_vocab(V, tp)}); each cell one weight, in its rank's colour", 12, bold=True)
    s.legend(10, 38, [(colour(r), f"tp rank {r}") for r in range(tp)] + [(SHARED, "every rank")])
    x = 10
    for name, what, how in (("h.0.attn.c_attn.weight", "c_attn (C, 3C)", "heads of q|k|v"),
                            ("h.0.attn.c_proj.weight", "attn.c_proj (C, C)", "rows"),
                            ("h.0.mlp.c_fc.weight", "c_fc (C, 4C)", "columns"),
                            ("h.0.mlp.c_proj.weight", "mlp.c_proj (4C, C)", "rows"),
                            ("wte.weight", "wte (V, C)", "vocabulary rows")):
        full = np.arange(math.prod(shapes[name])).reshape(shapes[name])
        pieces = [np.full(tp_shard(name, full, r, tp).shape, r) for r in range(tp)]
        owners = tp_unshard(name, pieces, V)  # the rank holding each weight
        s.text(x, 64, what, 10, bold=True)
        s.text(x, 77, how, 10)
        cells(s, x, 84, owners, 5.0, "")
        x += max(owners.shape[1] * 5.0, 110) + 24
    pad = padded_vocab(V, tp) - V
    s.text(x - 134, 84 + V * 5 + 14, f"+{pad} zero row{'s' * (pad > 1)} on rank {tp - 1}", 9)
    replicated = sorted({local_name(n) for n in shapes if place(n, False).tp_split is None})
    s.text(10, 268, "every tp rank holds the rest whole: " + ", ".join(replicated), 10)
    # activations between the linears: (T, C) per sequence; with SP each rank keeps T/tp tokens
    y = 292
    for sp in (False, True):
        owners = np.full((1, T), -1) if not sp else np.repeat(np.arange(tp), T // tp)[None, :]
        cells(s, 10 if not sp else 400, y + 12, owners, 12,
              ("without SP: LayerNorms and residuals on all T tokens, every rank" if not sp
               else "with SP: T/tp tokens each (reduce-scatter along T)"))
    return s


def context_parallel() -> Svg:
    """The tokens each cp rank holds (SequenceChunks), and the causal attention each computes."""
    T = 16
    cp = 4
    s = Svg(760, 300, "context parallelism over 4 ranks: zig-zag and contiguous chunks")
    s.text(10, 18, f"cp = {cp}, T = {T}: a sequence's tokens by rank, and the causal "
                   "attention (query rows, key columns) each rank computes", 12, bold=True)
    for k, balance in enumerate(("zigzag", "contiguous")):
        seq = SequenceChunks(T, cp, balance)
        owner = np.empty(T, int)
        for r in range(cp):
            owner[seq.positions(r)] = r
        x0 = 10 + 380 * k
        cells(s, x0, 50, owner[None, :], 12, f"{balance}: chunks of {seq.c} tokens")
        causal = np.where(np.tri(T, dtype=bool), owner[:, None], -2)
        for i in range(T):
            for j in range(i + 1):
                s.rect(x0 + j * 9, 80 + i * 9, 9, 9, colour(int(causal[i, j])), "#ffffff")
        # each rank's c x c blocks of q k^T (ring_attention_flops / 4 c^2 for one head of size 1)
        blocks = [ring_attention_flops(seq, r, 1, 1, 1) // (4 * seq.c ** 2) for r in range(cp)]
        for r, w in enumerate(blocks):
            s.rect(x0 + 160, 100 + 30 * r, 110 * w / max(blocks), 16, colour(r))
            s.text(x0 + 164 + 110 * w / max(blocks), 112 + 30 * r, f"rank {r}: {w} blocks", 10)
        s.text(x0 + 160, 92, "ring attention's work per rank", 10)
    s.legend(10, 290, [(colour(r), f"cp rank {r}") for r in range(cp)])
    return s


def experts() -> Svg:
    """Experts over ep 2, carved from dp 4: who_holds' experts and ep / edp ranks."""
    sizes = {"pp": 1, "dp": 4, "cp": 1, "tp": 1, "ep": 2}
    mcfg = GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8, n_expert=8)
    rows = who_holds(mcfg, sizes, 8)
    s = Svg(760, 215, "expert parallelism: ep 2 carved from dp 4")
    s.text(10, 18, "8 experts of an MoE layer, dp = 4 ranks, ep = 2: an ep group splits the "
                   "experts, its edp peers hold the same", 12, bold=True)
    for row in rows:
        x = 10 + 185 * row["rank"]
        s.rect(x, 32, 175, 150, "#ffffff", "#999999")
        s.text(x + 6, 50, f"rank {row['rank']}: dp {row['dp']}, ep {row['ep']}, edp "
                          f"{row['edp']}", 11, bold=True)
        s.rect(x + 6, 60, 163, 22, SHARED)
        s.text(x + 10, 75, "attention, router, embeddings", 10)
        for e in range(mcfg.n_expert):
            held = e in row["experts"]
            s.rect(x + 6 + 41 * (e % 4), 92 + 40 * (e // 4), 37, 32,
                   colour(row["ep"]) if held else "#f4f4f4", "#bbbbbb")
            s.text(x + 24 + 41 * (e % 4), 112 + 40 * (e // 4), f"E{e}", 10, "middle",
                   fill=INK if held else "#bbbbbb")
    s.text(10, 205, "tokens go to their expert's rank and back by all-to-all over ep; the "
                    "gradients of an expert are summed over edp (ranks 0 and 2, 1 and 3)", 10)
    return s


def zero() -> Svg:
    """What each ZeRO stage keeps per rank (memory_per_rank) and which slice (Unit.lo, hi)."""
    mcfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
    shapes = local_shapes(mcfg)
    sizes = unit_sizes(mcfg)
    n = 4
    whole = memory_per_rank(sizes, n, 0)
    padded = {u: Unit(u, shapes[u], n, 0).padded for u in shapes}
    scale = 300 / sum(padded.values())
    s = Svg(760, 420, "ZeRO stages 0 to 3 over 4 ranks: what each rank keeps")
    s.text(10, 18, f"a 2-block model's {sum(sizes.values()):,} parameters over dp = {n}: each "
                   "bar the units wte, wpe, h.0, h.1, ln_f end to end, padded to a multiple "
                   f"of {n}", 12, bold=True)
    for stage in range(4):
        held = memory_per_rank(sizes, n, stage)
        y0 = 40 + 95 * stage
        s.text(10, y0 + 12, f"ZeRO-{stage}", 12, bold=True)
        for k, kind in enumerate(("params", "grads", "optimizer")):
            y = y0 + 20 + 22 * k
            s.text(10, y + 11, kind, 10)
            sliced = held[kind] < whole[kind]  # the formula keeps 1/n of it
            for r in range(2):  # ranks 0 and 1; ranks 2 and 3 own the remaining slices
                x = 80 + 340 * r
                off = 0.0
                for u in shapes:
                    unit = Unit(u, shapes[u], n, r)
                    s.rect(x + off, y, unit.padded * scale, 14, "#f4f4f4", "#dddddd")
                    lo, hi = (unit.lo, unit.hi) if sliced else (0, unit.padded)
                    s.rect(x + off + lo * scale, y, (hi - lo) * scale, 14,
                           colour(r) if sliced else SHARED)
                    off += unit.padded * scale
                if k == 0:
                    s.text(x, y0 + 12, f"rank {r}: {held['params'] + held['grads'] + held['optimizer']:,} "
                                       "bytes (fp32, AdamW)", 10)
    s.text(10, 412, "grey: the whole unit, as every rank keeps it; a colour: the 1/4 slice that "
                    "rank owns (refmp.parallel.data.zero.Unit)", 10)
    return s


def pipeline() -> Svg:
    """The pieces of an 8-block model on pp 4: rank_chunks for 1F1B, interleaved and ZB-V."""
    mcfg = GPTConfig(vocab_size=256, block_size=64, n_layer=8, n_head=4, n_embd=64)
    pp = 4
    s = Svg(760, 190, "pipeline parallelism: which rank holds which blocks")
    s.text(10, 18, "8 blocks on pp = 4, as the engine splits them (balanced by FLOPs, the "
                   "embeddings on the first chunk, the head on the last)", 12, bold=True)
    for k, (name, sched, v) in enumerate((("1F1B, GPipe, ZB-H1: a chunk per rank", "1f1b", 1),
                                          ("interleaved, v = 2: chunk c on rank c % pp",
                                           "interleaved", 2),
                                          ("ZB-V, DualPipeV: 2 chunks per rank in a V", "zb-v", 1))):
        placed = CATALOG[sched].chunk_placement(pp, v)
        y = 40 + 48 * k
        s.text(10, y, name, 11)
        owner = {}  # piece -> the rank that holds it
        for r in range(pp):
            for c, blocks in rank_chunks(mcfg, 64, r, placed).items():
                owner.update({f"h{i}": r for i in blocks})
                if c == 0:
                    owner["emb"] = r
                if c == pp * placed.v - 1:
                    owner["head"] = r
        pieces = [("emb", owner["emb"])] + [(f"h{i}", owner[f"h{i}"]) for i in range(8)] \
            + [("head", owner["head"])]
        for j, (label, r) in enumerate(pieces):
            s.rect(10 + 66 * j, y + 6, 62, 24, colour(r), "#ffffff")
            s.text(41 + 66 * j, y + 22, f"{label} r{r}", 10, "middle", fill="#ffffff")
    s.legend(10, 182, [(colour(r), f"pp rank {r}") for r in range(pp)])
    return s


def data_parallel() -> Svg:
    """dp 4: every rank holds every unit (local_shapes of the whole model), and B/dp rows."""
    mcfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
    units = list(local_shapes(mcfg))
    dp = 4
    B = 8
    s = Svg(760, 150, "data parallelism over 4 ranks: a whole model each, its rows of the batch")
    s.text(10, 18, f"dp = {dp}, batch B = {B}: every rank holds every unit whole, and reads "
                   f"rows [r B/dp, (r+1) B/dp) of the batch", 12, bold=True)
    for r in range(dp):
        x = 10 + 185 * r
        s.text(x, 44, f"rank {r}", 11, bold=True)
        for j, u in enumerate(units):
            s.rect(x + 34 * j, 52, 32, 20, SHARED, "#ffffff")
            s.text(x + 16 + 34 * j, 66, u, 9, "middle")
        for i in range(B):
            mine = i // (B // dp) == r
            s.rect(x + 20 * i, 84, 18, 18, colour(r) if mine else "#f4f4f4", "#dddddd")
        s.text(x, 118, f"rows {r * B // dp}-{(r + 1) * B // dp - 1}", 10)
    s.text(10, 142, "after backward the gradients are summed over dp (all-reduce), so every "
                    "copy takes the same step", 10)
    return s


def compression() -> Svg:
    """Bytes a rank sends per step and keeps between steps, by codec, for bench's small model."""
    mcfg = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=8, n_embd=256)
    shapes = local_shapes(mcfg)
    sizes = unit_sizes(mcfg)
    n = 4
    rows = [("none (fp32)", sum(comm_per_step(sizes, n, 0).values()), 0),
            ("bf16", sum(comm_per_step(sizes, n, 0, itemsize=2).values()), 0),
            ("powersgd R=4", sum(compressed_per_step(shapes, n, "powersgd", 4).values()),
             codec_bytes(shapes, "powersgd", 4)),
            ("topk 1%", sum(compressed_per_step(shapes, n, "topk", 4, 0.01).values()),
             codec_bytes(shapes, "topk"))]
    top = max(r[1] for r in rows)
    s = Svg(760, 200, "gradient compression: bytes sent per step and kept between steps")
    s.text(10, 18, f"refmp bench's small model ({sum(sizes.values()):,} parameters) on dp = "
                   f"{n}: what one rank's gradient sums put on the ledger, and keeps", 12, bold=True)
    for k, (name, sent, kept) in enumerate(rows):
        y = 40 + 38 * k
        s.text(10, y + 12, name, 11)
        s.rect(120, y, 400 * sent / top, 14, colour(0))
        s.text(124 + 400 * sent / top, y + 11, f"sent {sent / 1e6:.2f} MB", 10)
        s.rect(120, y + 16, 400 * kept / top, 8, colour(1))
        s.text(124 + 400 * kept / top, y + 24, f"kept {kept / 1e6:.2f} MB" if kept else "kept 0", 9)
    s.legend(10, 192, [(colour(0), "ledger bytes per step (dp group)"),
                       (colour(1), "error feedback and warm start kept")])
    return s


def architecture() -> Svg:
    """Tutorial 8's 8 ranks: who_holds, and ZeRO-1's share of each rank's dense units."""
    mcfg = GPTConfig(vocab_size=17, block_size=8, n_layer=4, n_head=4, n_embd=16, n_expert=4,
                     top_k=2, moe_every=2)
    sizes = {"pp": 2, "dp": 1, "cp": 2, "tp": 2, "ep": 2}
    s = Svg(760, 330, "tutorial 9's layout: pp 2 x cp 2 x tp 2, experts over ep 2, ZeRO-1")
    s.text(10, 18, "8 ranks as pp 2 x cp 2 x tp 2 (experts over ep 2, carved from dp x cp), "
                   "ZeRO-1: what each rank holds", 12, bold=True)
    for row in who_holds(mcfg, sizes, 8):
        blocks = [i for b in row["chunks"].values() for i in b]
        shapes = local_shapes(mcfg, 2, blocks, row["first"], row["last"], 2, row["ep"])
        owned = 0  # as tutorial 9 counts: the elements of the slices it owns, padding left out
        for u, sh in shapes.items():  # dense units over dp x cp, experts over edp = dp cp / ep
            expert = u.endswith("experts")
            unit = Unit(u, sh, 1 if expert else 2, row["edp"] if expert else row["cp"])
            owned += sum(p.size for k, p in unit.pieces(np.zeros(unit.shard)).items()
                         if not k.endswith("padding"))
        local = sum(math.prod(x) for unit in shapes.values() for x in unit.values())
        x = 6 + 376 * row["pp"] + 186 * row["tp"]
        y = 32 + 145 * row["cp"]
        s.rect(x, y, 182, 138, "#ffffff", colour(row["pp"]))
        s.rect(x, y, 182, 18, colour(row["pp"]))
        s.text(x + 6, y + 13, f"rank {row['rank']}  (pp {row['pp']}, cp {row['cp']}, tp "
                              f"{row['tp']}, ep {row['ep']})", 10, bold=True, fill="#ffffff")
        ends = ("wte, wpe" if row["first"] else "") + ("ln_f, wte" if row["last"] else "")
        lines = [f"blocks {blocks[0]}-{blocks[-1]}, {ends}",
                 "tokens " + ",".join(map(str, row["tokens"])),
                 f"heads {row['heads'][0]}-{row['heads'][1] - 1}",
                 f"wte rows {row['wte_rows'][0]}-{row['wte_rows'][1] - 1} of "
                 f"{padded_vocab(17, 2)}",
                 "experts " + ",".join(map(str, row["experts"])) + " of each MoE layer",
                 f"ZeRO-1: owns {owned:,} of {local:,}"]
        for k, line in enumerate(lines):
            s.text(x + 6, y + 36 + 17 * k, line, 10)
    s.text(10, 326, "columns: pipeline stage, then tp; rows: cp. rank = ((pp dp + dp_i) cp + "
                    "cp_i) tp + tp_i (refmp.distributed.grid)", 10)
    return s


PICTURES = {"data_parallel": data_parallel, "pipeline": pipeline, "tensor_parallel": tensor_parallel,
            "experts": experts, "zero": zero, "compression": compression,
            "context_parallel": context_parallel, "architecture": architecture,
            **LEVELS}  # hierarchical cp, HSDP and folding (pictures_levels.py)


def on_files(files, config, **kwargs):
    for page, draw in PICTURES.items():
        files.append(File.generated(config, f"img/holds/{page}.svg", content=str(draw())))
    return files
