"""Tutorial 9: one engine, any layout -- a model split five ways at once.

Run:  mpiexec -n 8 python tutorials/09_any_layout.py

A GPT with mixture-of-experts layers on 8 ranks as pp 2 x cp 2 x tp 2, experts over ep 2
(carved from the dp x cp ranks), ZeRO stage 1, 2 micro-batches per step, the 1F1B schedule.
What it shows, checked against the serial model (exit status 1 on a mismatch):
  1. where each rank sits on the grid, and which shards it holds: pipeline blocks, tokens of
     each sequence, attention heads, vocabulary rows, experts, and its ZeRO slice;
  2. the walk of one step through the pieces: which communication each axis did;
  3. three training steps: loss, every gradient and every weight equal to the serial run's.
"""

import sys

import numpy as np
from mpi4py import MPI

from refmp.distributed.grid import ProcessGrid
from refmp.parallel.expert import expert_index, is_expert
from refmp.parallel.holdings import who_holds
from refmp.training.datasets import Dataset
from refmp.training.trainer import TrainConfig, Trainer

world = MPI.COMM_WORLD
if world.size != 8:
    if world.rank == 0:
        print("run me with: mpiexec -n 8 python tutorials/09_any_layout.py", file=sys.stderr)
    sys.exit(2)


def say(*a):
    if world.rank == 0:
        print(*a, flush=True)


cfg = TrainConfig(n_layer=4, n_head=4, n_embd=16, block_size=8, n_expert=4, top_k=2,
                  moe_every=2, capacity_factor=1.0, batch_size=4, steps=3, lr=0.01,
                  warmup_steps=1, grad_clip=0.5, dtype="float64", progress=False,
                  pp=2, cp=2, tp=2, ep=2, zero=1, microbatches=2, schedule="1f1b")
rng = np.random.default_rng(0)
ds = Dataset(rng.integers(0, 17, 400), 17, "random")  # V = 17: tp 2 pads wte to 18 rows
tr = Trainer(cfg, dataset=ds)
run, grid = tr.runner, tr.grid

# --- 1. who holds what ------------------------------------------------------------------------
say(f"Part 1. {grid.describe()}: rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i\n")
V, NH, T = run.mcfg.vocab_size, run.mcfg.n_head, run.mcfg.block_size
c, tp_r = grid.coords, grid.coords["tp"]
blocks = sorted(i for ch in run.stage.chunks.values() for i in ch)
rows = -(-V // 2)  # wte rows per tp rank: the vocabulary padded to a multiple of tp
experts = sorted({expert_index(k) for k in run.params if is_expert(k)})
owned = sum(int(p.size) for k, p in run.params.items() if not k.endswith("padding"))
local = sum(U.numel for U in run.sharder.units.values())
mine = {
    "rank": world.rank, "pp dp cp tp": f"{c['pp']}  {c['dp']}  {c['cp']}  {tp_r}",
    "blocks": ",".join(map(str, blocks)),
    "tokens (cp)": ",".join(map(str, np.asarray(run.positions).tolist())),
    "heads (tp)": f"{tp_r * NH // 2}-{(tp_r + 1) * NH // 2 - 1}",
    "wte rows": (f"{tp_r * rows}-{(tp_r + 1) * rows - 1}" if "wte" in run.sharder.units
                 else "-"),
    "experts (ep)": ",".join(map(str, experts)),
    "ZeRO-1 owns": f"{owned}/{local}",
}
table = world.allgather(mine)
drawn = who_holds(run.mcfg, grid.sizes, T)[world.rank]  # the table docs/architecture.md draws
same = world.allgather(sorted(i for c in drawn["chunks"].values() for i in c) == blocks
                       and drawn["tokens"] == np.asarray(run.positions).tolist()
                       and drawn["experts"] == experts)
if world.rank == 0:
    cols = list(table[0])
    width = {k: max(len(k), *(len(str(r[k])) for r in table)) for k in cols}
    print("  ".join(k.ljust(width[k]) for k in cols))
    for r in table:
        print("  ".join(str(r[k]).ljust(width[k]) for k in cols))
say(f"\nThe guide's picture of this layout (refmp.parallel.holdings.who_holds) matches the "
    f"running engine on {sum(same)} of {len(same)} ranks.")
say("The last stage holds wte too (the tied head); ranks with the same tp coordinate hold\n"
    "the same heads for other tokens (cp) and other blocks (pp); the two ranks of each ep\n"
    "group split the 4 experts of each MoE layer; ZeRO-1 splits each rank's optimizer state\n"
    "over its dp x cp group (here the 2 cp ranks), the experts' over edp (1 rank).")

# --- 2. one step, and what it moved -----------------------------------------------------------
grid.ledger.reset()
rec = tr.step()
led = grid.ledger
say(f"\nPart 2. one step: loss {rec['loss']:.6f}. This rank's traffic, by what it is for:")
what = {"tp": "f/g of the column/row linears, vocab-parallel embedding, head and loss",
        "cp": "ring attention's K/V blocks (forward, backward, dK/dV); MoE routing index",
        "pp": "activations and their gradients between the stages, the tied wte",
        "ep": "tokens to their experts and back (all-to-all), with the counts"}
for axis in ("tp", "cp", "pp", "ep"):
    b = led.bytes(axis=axis)
    say(f"  {axis:>6}: {b:>9,} B in {led.count(axis=axis):>4} calls   {what[axis]}")
dense = run.grid.group("dp", "cp").axis  # the group dense units are reduced over
zero = led.bytes("reduce_scatter", dense) + led.bytes("allgather", dense)
say(f"  dense gradients: reduce-scatter + all-gather over dp x cp (ZeRO-1), label {dense!r}:"
    f" {zero:,} B")

# --- 3. the same run, serially ----------------------------------------------------------------
from dataclasses import replace  # noqa: E402

serial = None
if world.rank == 0:
    serial = Trainer(replace(cfg, pp=1, cp=1, tp=1, ep=1, zero=0, microbatches=1),
                     grid=ProcessGrid(MPI.COMM_SELF), dataset=ds)
    serial.step()
worst = 0.0
for s in range(1, cfg.steps):
    b = tr.step()
    grads, params = run.full_grads(), run.full_params()  # collective: gathered to rank 0
    if serial is not None:
        a = serial.step()
        sg, sp = serial.runner.full_grads(), serial.runner.full_params()
        worst = max(worst, abs(a["loss"] - b["loss"]),
                    *(float(np.abs(grads[k] - sg[k]).max()) for k in sp),
                    *(float(np.abs(params[k] - sp[k]).max()) for k in sp))
        say(f"  step {s}: loss {b['loss']:.10f} (serial {a['loss']:.10f})")
ok = world.bcast(worst < 1e-10 and all(same) if world.rank == 0 else None)
say(f"\nPart 3. largest difference from the serial run (loss, gradients, weights): {worst:.1e}")
say("OK: any layout == serial" if ok else "MISMATCH")
sys.exit(0 if ok else 1)
