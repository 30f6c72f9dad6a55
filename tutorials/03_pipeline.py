"""Tutorial 3: pipeline parallelism, schedules as data, checked against the serial model.

    mpiexec -n 2 python tutorials/03_pipeline.py      (or -n 4)

The model's blocks are cut into one stage per rank. A schedule is a plain list of actions
per rank (F: forward of a micro-batch, B: its backward, W: a deferred weight gradient); the
simulator runs those lists without MPI and draws them, and the executor runs the very same
lists over MPI. We print the lists and their timelines, then train a few steps with every
schedule and compare the weights with the serial run. Exits non-zero on a mismatch.
"""

import dataclasses
import sys

import numpy as np
from mpi4py import MPI

from refmp.distributed.grid import ProcessGrid
from refmp.parallel.pipeline.schedules import schedule
from refmp.parallel.pipeline.simulate import bubble_formula, simulate_schedule
from refmp.training.datasets import AdditionTask
from refmp.training.trainer import TrainConfig, Trainer

world = MPI.COMM_WORLD
pp, M = world.size, 4
say = print if world.rank == 0 else (lambda *a, **k: None)

# --- 1. schedules are data ------------------------------------------------------------------
for name in ("gpipe", "1f1b", "zb-h1", "zb-v"):  # zb-v: two chunks per rank, in a V
    say(f"\n{name}: rank 0's actions: " + " ".join(map(str, schedule(name, pp, M, 0))))
    tl = simulate_schedule(name, pp, M)  # raises if the lists could deadlock
    say(tl.ascii())
    say(f"bubble {tl.bubble():.3f} (formula {bubble_formula(name, pp, M):.3f}); "
        f"peak micro-batches held per rank {tl.peak_held}")

# --- 2. the same lists, executed over MPI, against the serial model -------------------------
# Every layout runs on the one engine (refmp.parallel.engine): the serial run below is a
# one-stage pipeline (pp = 1, one micro-batch), the others cut the blocks into pp stages.
ds = AdditionTask(digits=3, seed=0, n_train=500, n_test=10).dataset()
base = TrainConfig(n_layer=2 * pp, n_head=2, n_embd=16, batch_size=8, steps=3, grad_clip=0.5,
                   dtype="float64", progress=False)
serial = Trainer(base, grid=ProcessGrid(MPI.COMM_SELF), dataset=ds)  # every rank runs it
for _ in range(base.steps):
    serial.step()
want = serial.runner.full_params()  # the whole model (rank 0 of COMM_SELF: every rank)

worst_all = 0.0
for name in ("naive", "gpipe", "1f1b", "zb-h1", "zb-v", "dualpipev"):
    cfg = dataclasses.replace(base, pp=pp, microbatches=M, schedule=name)
    pipe = Trainer(cfg, grid=ProcessGrid(world, pp=pp), dataset=ds)
    losses = [pipe.step()["loss"] for _ in range(cfg.steps)]
    run = pipe.runner
    full = run.full_params()  # gathered from every stage onto rank 0 (collective)
    worst = 0.0 if full is None else max(float(np.abs(v - want[k]).max()) for k, v in full.items())
    worst = pipe.grid.world.allreduce_scalar(worst, op="max")
    worst_all = max(worst_all, worst)
    say(f"{name:>6}: losses {' '.join(f'{x:.6f}' for x in losses)}; largest weight "
        f"difference from serial {worst:.1e}; rank 0 held at most {run.executor.peak_held} "
        f"micro-batches; "
        f"{pipe.grid.ledger.bytes('send', 'pp'):,} B sent over pp")

ok = worst_all < 1e-10
say("\nOK: every schedule matches the serial run" if ok else "\nFAILED: a schedule differs")
sys.exit(0 if ok else 1)
