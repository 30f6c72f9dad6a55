"""Tutorial 15: a model no rank can hold. Each rank makes only its share, and trains on it.

    mpiexec -n 4 python tutorials/15_no_rank_can_hold.py

Model parallelism exists because a model does not fit one device. Part 1 builds the pieces
of a tp 2 x pp 2 grid by hand: each rank asks the initializer (refmp.checkpoint.source's
InitSource, values a function of the seed, the name and the row block) for the tp shard of
each parameter its stage holds, and nothing else; tracemalloc, to which NumPy reports every
allocation, measures the peak while it does. Each piece then equals the same slice of the
whole model, checked one tensor at a time. Part 2 trains a step in that layout and in ZeRO-3
over the four ranks through the engine, whose ranks build exactly so, and compares the
losses with the serial run; each rank prints the bytes it holds beside the whole model's.
Exits non-zero on a mismatch.
"""

import dataclasses
import sys
import tracemalloc

import numpy as np
from mpi4py import MPI

from refmp.checkpoint.source import InitSource
from refmp.distributed.grid import ProcessGrid
from refmp.nn import GPTConfig
from refmp.nn.params import param_shapes
from refmp.nn.slices import take
from refmp.parallel.pipeline.partition import rank_chunks
from refmp.parallel.pipeline.schedules import ChunkPlacement
from refmp.parallel.placement import held_indices
from refmp.training.datasets import AdditionTask
from refmp.training.trainer import TrainConfig, Trainer

world = MPI.COMM_WORLD
rank = world.rank
say = print if rank == 0 else (lambda *a, **k: None)
if world.size != 4:
    say("run with 4 ranks: mpiexec -n 4 python tutorials/15_no_rank_can_hold.py")
    sys.exit(2)
ds = AdditionTask(digits=3, seed=0, n_train=500, n_test=10).dataset()
mcfg = GPTConfig(vocab_size=ds.vocab_size, block_size=13, n_layer=4, n_head=4, n_embd=256)
shapes = param_shapes(mcfg)
whole = sum(int(np.prod(s)) for s in shapes.values()) * 8  # float64 bytes of the whole model

# --- 1. my share, made alone -------------------------------------------------------------------
grid = ProcessGrid(world, pp=2, tp=2)
pp, tp = grid.comm["pp"], grid.comm["tp"]
chunks = rank_chunks(mcfg, 13, pp.rank, ChunkPlacement(pp.size))  # my stage's blocks
blocks = {i for c in chunks.values() for i in c}
first, last = 0 in chunks, pp.size - 1 in chunks  # the embeddings / ln_f and the tied head
mine = held_indices(shapes, blocks, first, last, tp, grid.comm["ep"])  # name -> my tp slice
source = InitSource(mcfg, seed=0)
tracemalloc.start()
share = {k: source.read(k, index) for k, index in mine.items()}  # nothing else is made
peak = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
held = sum(v.nbytes for v in share.values())
ok = all(np.array_equal(v, take(source.read(k), mine[k])) for k, v in share.items())  # the check
peaks = world.gather((held, peak, ok), root=0)
say(f"1. tp 2 x pp 2: the whole model is {whole:,} bytes (float64); each rank made only its share")
for r, (h, p, good) in enumerate(peaks or []):
    say(f"   rank {r}: holds {h:,} B ({h / whole:.0%}); peak while making it {p:,} B; "
        f"equal to the serial model's slices: {good}")
# a quarter of the model and the copies tp keeps (LayerNorms, biases), the peak one block more
ok_share = world.allreduce(ok and held < 0.3 * whole and peak < held + 3 * 2**20, op=MPI.LAND)

# --- 2. the engine builds the same way: train a step, against the serial run --------------------
base = TrainConfig(n_layer=4, n_head=4, n_embd=256, batch_size=8, steps=2, dtype="float64",
                   progress=False)
ref = Trainer(base, grid=ProcessGrid(MPI.COMM_SELF), dataset=ds)  # every rank, one whole model
want = [ref.step()["loss"] for _ in range(base.steps)]
worst = 0.0
for name, layout in (("tp 2 x pp 2", dict(tp=2, pp=2, microbatches=2)), ("ZeRO-3 over 4", dict(zero=3))):
    tr = Trainer(dataclasses.replace(base, **layout), grid=ProcessGrid(world, **{
        k: v for k, v in layout.items() if k in ("tp", "pp")}), dataset=ds)
    got = [tr.step()["loss"] for _ in range(base.steps)]
    held = sum(int(p.nbytes) for p in tr.runner.params.values())  # my parameters, as held
    diff = max(abs(a - b) for a, b in zip(got, want, strict=True))
    worst = max(worst, diff)
    held_all = world.gather(held, root=0)
    say(f"2. {name}: losses {' '.join(f'{x:.6f}' for x in got)}, largest difference from "
        f"serial {diff:.1e}; parameters held per rank " + ", ".join(f"{h:,}" for h in held_all or []))
ok_all = ok_share and world.allreduce(worst, op=MPI.MAX) < 1e-12
say("OK: every rank made and trained only its share, equal to the serial model" if ok_all else
    "FAILED: a share differs from the serial model, or making it held more than its share")
sys.exit(0 if ok_all else 1)
