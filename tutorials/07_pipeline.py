"""Tutorial 7: pipeline parallelism, schedules as data, checked against the serial model.

    mpiexec -n 2 python tutorials/07_pipeline.py      (or -n 4)

The model's blocks are cut into one stage per rank. Part 1 runs a 1F1B pipeline by hand:
each rank holds its blocks (and the embedding on the first stage, the tied head on the
last), runs the serial model's pieces (refmp.nn.gpt) on micro-batches in the order its 1F1B
action list gives, and sends activations forward and gradients back itself; the gradients
must equal the serial model's; part 1b runs the same list through the library's Stage and
Executor (the core's pipeline files), which must give the same gradients bit for bit. A
schedule is a plain list of actions per rank (F: forward of a micro-batch, B: its backward,
W: a deferred weight gradient); part 2 prints the lists and the timelines the simulator draws
from them without MPI. Part 3 trains a few steps with every schedule through the engine (what
`refmp train --pp` runs), which executes the very same lists, and compares the weights with
the serial run. Exits non-zero on a mismatch.
"""

import dataclasses
import sys

import numpy as np
from mpi4py import MPI

from refmp.distributed.comm import Comm
from refmp.distributed.grid import ProcessGrid
from refmp.distributed.waiting import wait, wait_all
from refmp.nn import gpt
from refmp.parallel.data.accumulate import split_microbatches
from refmp.parallel.data.sharder import Sharder
from refmp.parallel.pipeline.catalog import schedule
from refmp.parallel.pipeline.executor import Executor
from refmp.parallel.pipeline.schedules import one_f_one_b
from refmp.parallel.pipeline.simulate import bubble_formula, simulate_schedule
from refmp.parallel.pipeline.stage import Stage
from refmp.parallel.placement import holds, units_of
from refmp.training.datasets import AdditionTask, get_batch
from refmp.training.trainer import TrainConfig, Trainer

world = MPI.COMM_WORLD
pp, M, rank = world.size, 4, world.rank
say = print if rank == 0 else (lambda *a, **k: None)
task = AdditionTask(digits=3, seed=0, n_train=500, n_test=10)
ds = task.dataset()

# --- 1. a 1F1B pipeline by hand ---------------------------------------------------------------
T, B, C = task.line_len, 8, 16
mcfg = gpt.GPTConfig(vocab_size=ds.vocab_size, block_size=T, n_layer=2 * pp, n_head=2, n_embd=C)
full = gpt.init_params(mcfg, seed=0, dtype="float64")  # the whole model, drawn on every rank
x, y = get_batch(ds.tokens, 0, B, T)  # (B, T)
serial = gpt.GPT(mcfg, full)
_, cache = serial.forward(x, y)
serial.backward(cache)

pipe = Comm(world, "pp")
first, last = rank == 0, rank == pp - 1
mine = range(2 * rank, 2 * rank + 2)  # my two blocks
stage = gpt.GPT(mcfg, {k: v for k, v in full.items() if holds(k, mine, first, last)})
ops = gpt.Ops(mcfg.n_head)
mbs = split_microbatches(x, y, M)  # micro-batch i: rows [i b, (i+1) b) of the batch, b = B/M
shape = (B // M, T, C)  # (b, T, C): one micro-batch's activation, what crosses a boundary
held = {}  # micro-batch -> its caches by piece ("embed", "h.{j}", "head"), from F(i) to B(i)
sends = []  # sends in flight, waited on at the end (their buffers stay alive until then)


def forward(i: int) -> None:
    """F(i): micro-batch i's activation from stage r-1 (or its tokens), my blocks, on to r+1."""
    xi, yi = mbs[i]  # (b, T)
    cache = {}
    if first:
        h, cache["embed"] = gpt.embed_forward(stage.params, xi)  # (b, T, C)
    else:
        h = pipe.recv(shape, np.float64, rank - 1, tag=i)  # (b, T, C): stage r-1's output
    for j in mine:
        h, cache[f"h.{j}"] = gpt.block_forward(gpt.block_params(stage.params, j), h, ops)
    if last:  # my share of the loss: the micro-batch's loss sum over the batch's B T tokens
        _, cache["head"] = gpt.head_forward(stage.params, h, yi, denom=B * T)
    else:
        sends.append(pipe.send(h, rank + 1, tag=i))  # (b, T, C): stage r+1's input
    held[i] = cache


def backward(i: int) -> None:
    """B(i): the gradient of my output from stage r+1 (or the loss), my blocks, back to r-1."""
    cache = held.pop(i)
    if last:
        dh, g = gpt.head_backward(1.0, cache["head"])  # (b, T, C)
        stage.accumulate(g)
    else:
        dh = pipe.recv(shape, np.float64, rank + 1, tag=i)  # (b, T, C): d my output
    for j in reversed(mine):
        dh, g = gpt.block_backward(dh, cache[f"h.{j}"], ops)  # (b, T, C)
        stage.accumulate(g, prefix=f"h.{j}.")  # gradients add up over the micro-batches
    if first:
        stage.accumulate(gpt.embed_backward(dh, cache["embed"]))
    else:
        sends.append(pipe.send(dh, rank - 1, tag=i))  # (b, T, C): d stage r-1's output


actions = one_f_one_b(pp, M, rank)  # warm-up: pp - r - 1 F's; steady state: F, B; cool-down: B's
for a in actions:
    if a.kind == "F":
        forward(a.mb)
    else:
        backward(a.mb)
wait_all(sends)
if first != last:  # the tied wte: the embedding's share (first stage) + the head's (last)
    other = pp - 1 if first else 0
    req = pipe.send(stage.grads["wte.weight"], other, tag=M)
    there = pipe.recv(full["wte.weight"].shape, np.float64, other, tag=M)  # (V, C)
    wait(req)
    stage.grads["wte.weight"] += there

err = max(float(np.abs(stage.grads[k] - serial.grads[k]).max()) for k in stage.params)
err = pipe.allreduce_scalar(err, op="max")
say(f"1. by hand: pp = {pp}, {M} micro-batches of {B // M} rows; rank 0's 1F1B actions: "
    + " ".join(map(str, actions)))
say(f"   largest |gradient - serial| over every stage: {err:.1e}; rank 0 sent "
    f"{pipe.ledger.bytes('send', 'pp'):,} bytes (M b T C 8 of activations, V C 8 of wte)")
ok_hand = err < 1e-12

# --- 1b. the same 1F1B with the core's Stage and Executor -----------------------------------
# Stage (refmp.parallel.pipeline.stage) is forward() and backward() above, for any chunks;
# Executor (.executor) is the loop above: it walks the same action list and posts the same
# sends and receives. The Stage takes its weights unit by unit from a Sharder (one rank per
# group here: plain weights, no data parallelism), which also holds the gradients.
grid = ProcessGrid(world, pp=pp)
local = {k: v.copy() for k, v in full.items() if holds(k, mine, first, last)}
units = units_of(local)
sharder = Sharder(local, units, {u: grid.group("dp", "cp") for u in units}, 0)
core = Stage({rank: mine}, pp, mcfg, ops, sharder)  # chunk r: my two blocks
Executor(core, grid.comm["pp"], np.float64).step(actions, [mb[0] for mb in mbs],
                                                 [mb[1] for mb in mbs], denom=B * T, m=M)
sharder.finish()  # the gradients, complete (no sums over dp here)
mine_g = sharder.full_local(grads=True)
if first != last:  # the tied wte's two shares, added as in part 1
    other = pp - 1 if first else 0
    req = grid.comm["pp"].send(mine_g["wte.weight"], other, tag=M)
    there = grid.comm["pp"].recv(full["wte.weight"].shape, np.float64, other, tag=M)
    wait(req)
    mine_g["wte.weight"] += there
same = all(np.array_equal(mine_g[k], stage.grads[k]) for k in local)  # bitwise, as by hand
same = bool(pipe.allreduce_scalar(float(not same), op="max") == 0)
verdict = "bitwise equal to" if same else "DIFFER from"
say(f"   the same with Stage and Executor: gradients {verdict} part 1's")
ok_hand = ok_hand and same

# --- 2. schedules are data ------------------------------------------------------------------
for name in ("gpipe", "1f1b", "zb-h1", "zb-v"):  # zb-v: two chunks per rank, in a V
    say(f"\n{name}: rank 0's actions: " + " ".join(map(str, schedule(name, pp, M, 0))))
    tl = simulate_schedule(name, pp, M)  # raises if the lists could deadlock
    say(tl.ascii())
    say(f"bubble {tl.bubble():.3f} (formula {bubble_formula(name, pp, M):.3f}); "
        f"peak micro-batches held per rank {tl.peak_held}")

# --- 3. the same lists through the engine, against the serial model -------------------------
# Every layout runs on the one engine (refmp.parallel.engine): the serial run below is a
# one-stage pipeline (pp = 1, one micro-batch), the others cut the blocks into pp stages.
base = TrainConfig(n_layer=2 * pp, n_head=2, n_embd=16, batch_size=8, steps=3, grad_clip=0.5,
                   dtype="float64", progress=False)
ref = Trainer(base, grid=ProcessGrid(MPI.COMM_SELF), dataset=ds)  # every rank runs it
for _ in range(base.steps):
    ref.step()
want = ref.runner.full_params()  # the whole model (rank 0 of COMM_SELF: every rank)

worst_all = 0.0
for name in ("naive", "gpipe", "1f1b", "zb-h1", "zb-v", "dualpipev"):
    cfg = dataclasses.replace(base, pp=pp, microbatches=M, schedule=name)
    tr = Trainer(cfg, grid=ProcessGrid(world, pp=pp), dataset=ds)
    losses = [tr.step()["loss"] for _ in range(cfg.steps)]
    run = tr.runner
    got = run.full_params()  # gathered from every stage onto rank 0 (collective)
    worst = 0.0 if got is None else max(float(np.abs(v - want[k]).max()) for k, v in got.items())
    worst = tr.grid.world.allreduce_scalar(worst, op="max")
    worst_all = max(worst_all, worst)
    say(f"{name:>6}: losses {' '.join(f'{v:.6f}' for v in losses)}; largest weight "
        f"difference from serial {worst:.1e}; rank 0 held at most {run.executor.peak_held} "
        f"micro-batches; "
        f"{tr.grid.ledger.bytes('send', 'pp'):,} B sent over pp")

ok = ok_hand and worst_all < 1e-10
say("\nOK: by hand and through the engine, every schedule matches the serial run" if ok
    else "\nFAILED: a pipeline differs from the serial run")
sys.exit(0 if ok else 1)
