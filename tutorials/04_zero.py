"""Tutorial 4: data parallelism done properly (accumulation, bucketed all-reduce, ZeRO 1/2/3).

Run:  mpiexec -n 2 python tutorials/04_zero.py      (any number of ranks works)

It prints
  1. one ZeRO step by hand: every rank computes its rows' gradients, reduce-scatters each
     unit's flat gradient so that it holds the sum of its 1/dp slice only, updates that slice
     with AdamW (whose state it alone keeps), and all-gathers the updated slices; the weights
     must equal the serial step's;
  2. the ZeRO memory table for GPT-2 124M and 1.5B, from the formulas (refmp.cost.zero);
  3. a tiny model trained 3 steps with each stage and 2 micro-batches through the engine (what
     `refmp train --zero` runs), checked against the serial model (loss, gathered weights),
     with the memory each rank measured and the bytes its ledger counted, both next to the
     formulas;
  4. the buckets of one plain data-parallel step: which units each holds, in the order
     backward completes them, and the all-reduces the ledger counted for them.
and exits non-zero if anything disagrees with the serial run or the formulas.
"""

import sys

import numpy as np
from mpi4py import MPI

from refmp.cost.zero import comm_per_step, memory_per_rank, unit_sizes
from refmp.distributed.comm import Comm
from refmp.distributed.grid import ProcessGrid
from refmp.nn import GPT, GPTConfig
from refmp.nn.params import init_params
from refmp.parallel.data.accumulate import dp_rows
from refmp.parallel.data.zero import Unit
from refmp.parallel.placement import units_of
from refmp.training.datasets import Dataset, get_batch
from refmp.training.optim import AdamW, clip_grad_norm
from refmp.training.trainer import TrainConfig, Trainer

world = MPI.COMM_WORLD
rank0 = world.rank == 0
failures = []


def say(*a):
    if rank0:
        print(*a, flush=True)


# --- 1. one ZeRO step by hand ------------------------------------------------------------------
dp = world.size
ds = Dataset(np.random.default_rng(0).integers(0, 11, 400), 11, "random digits")
mcfg = GPTConfig(11, 6, 2, 2, 6)  # V 11, T 6, 2 layers, 2 heads, C 6: sizes not divisible by 4
B, T = 4 * dp, mcfg.block_size
full = init_params(mcfg, seed=0, dtype="float64")  # the whole model, drawn on every rank
x, y = get_batch(ds.tokens, 0, B, T)  # (B, T)
serial = GPT(mcfg, {k: v.copy() for k, v in full.items()})
_, cache = serial.forward(x, y)
serial.backward(cache)
clip_grad_norm(serial.grads, 0.1)
AdamW(serial.params, lr=0.01).step(serial.grads)

dpc = Comm(world, "dp")
replica = GPT(mcfg, {k: v.copy() for k, v in full.items()})
rows = dp_rows(B, dp, dpc.rank)
_, cache = replica.forward(x[rows], y[rows], denom=B * T)  # my share of the global mean
replica.backward(cache)
# ZeRO-1 (and ZeRO-2, with one micro-batch): each unit flat, padded to Pp = dp S elements,
# of which rank r owns [r S, (r+1) S); ZeRO-3 would also keep only that slice of the weights
# and all-gather a unit just before its forward and its backward
units = {u: Unit(u, {k: full[k].shape for k in names}, dp, dpc.rank)
         for u, names in units_of(full).items()}  # wte, wpe, h.0, h.1, ln_f
grads = {}  # unit -> my slice of its summed gradient (S,)
params = {}  # unit -> my slice of its weights (S,)
for u, unit in units.items():
    # reduce-scatter: the sum over dp of the unit's flat gradient, of which I keep my slice
    grads[u] = dpc.reduce_scatter(unit.flatten(replica.grads, np, np.float64))  # (S,)
    params[u] = unit.flatten(replica.params, np, np.float64)[unit.lo : unit.hi]  # (S,)
# the optimizer's view: parameter name -> my flat piece of it (views of the slices)
g_mine = {k: v for u, unit in units.items() for k, v in unit.pieces(grads[u]).items()}
p_mine = {k: v for u, unit in units.items() for k, v in unit.pieces(params[u]).items()}
# the global norm: each rank sums the squares of its slices, one all-reduce adds them
clip_grad_norm(g_mine, 0.1, sum_sq=dpc.allreduce_scalar)
opt = AdamW(p_mine, lr=0.01, decay={k for k in p_mine if k in full and full[k].ndim >= 2})
opt.step(g_mine)  # updates my slices in place; m and v exist for them only: 1/dp of them
for u, unit in units.items():
    # all-gather: every rank's updated slice, so that every rank has the whole unit again
    for k, v in unit.views(dpc.allgather(params[u])).items():  # (Pp,)
        replica.params[k][...] = v
err = max(float(np.abs(replica.params[k] - serial.params[k]).max()) for k in full)
err = dpc.allreduce_scalar(err, op="max")
say(f"1. by hand: one ZeRO step on dp = {dp}; largest |weight - serial| {err:.1e}\n"
    f"   reduce-scatter {dpc.ledger.bytes('reduce_scatter', 'dp')} + all-gather "
    f"{dpc.ledger.bytes('allgather', 'dp')} bytes (the two halves of an all-reduce); AdamW "
    f"state here {opt.state_bytes()} bytes, {16 * sum(v.size for v in full.values())} unsharded")
if err > 1e-12:
    failures.append(f"ZeRO by hand differs from serial by {err:.2e}")

# --- 2. the table: what ZeRO saves on a real model ---------------------------------------------
say("\n2. ZeRO memory per rank, float32 + AdamW: params + grads + optimizer state (GiB)")
for name, cfg in [("GPT-2 124M", GPTConfig(50257, 1024, 12, 12, 768)),
                  ("GPT-2 1.5B", GPTConfig(50257, 1024, 48, 25, 1600))]:
    sizes = unit_sizes(cfg)  # elements of each unit ZeRO shards: wte, wpe, h.{i}, ln_f
    for ranks in (8, 64):
        row = []
        for stage in range(4):
            m = memory_per_rank(sizes, ranks, stage, itemsize=4)
            row.append(f"{sum(m.values()) / 2**30:7.2f}")
        say(f"   {name}, dp={ranks:<3}  stage 0..3: " + "  ".join(row) + " GiB")

# --- 3. the same through the engine, every stage, against the serial run --------------------
cfg0 = dict(n_layer=2, n_head=2, n_embd=6, block_size=6, batch_size=4 * dp, steps=3,
            lr=0.01, warmup_steps=1, grad_clip=0.1, dtype="float64", progress=False,
            microbatches=2, bucket_mb=0.002)
sizes = unit_sizes(mcfg)  # the model of part 1
ref = Trainer(TrainConfig(**{**cfg0, "microbatches": 1}), grid=ProcessGrid(MPI.COMM_SELF),
              dataset=ds)
want_loss = [ref.step()["loss"] for _ in range(3)]
want = ref.runner.full_params()  # the serial weights after 3 steps
say(f"\n3. {mcfg.n_layer} layers, n_embd {mcfg.n_embd}, {sum(sizes.values())} parameters in units "
    f"{sizes}, dp={dp}, 2 micro-batches, float64 (8 bytes per element)")
say("   stage | max |loss - serial| | params  grads  optim  activ (bytes, measured/formula) "
    "| per step: reduce-scatter all-gather all-reduce (bytes)")
for stage in range(4):
    tr = Trainer(TrainConfig(**cfg0, zero=stage), grid=ProcessGrid(MPI.COMM_WORLD), dataset=ds)
    losses = [tr.step()["loss"] for _ in range(3)]
    led = {op: tr.grid.ledger.bytes(op, "dp") // 3  # before the gathers of full_params
           for op in ("reduce_scatter", "allgather", "allreduce")}
    got = tr.runner.full_params()  # collective (stage 3 gathers the shards); rank 0 gets it
    err = max(abs(a - b) for a, b in zip(losses, want_loss, strict=True))
    if got is not None:
        err = max([err] + [float(np.abs(got[k] - v).max()) for k, v in want.items()])
    mem, formula = tr.memory(), memory_per_rank(sizes, dp, stage, itemsize=8)
    comm = comm_per_step(sizes, dp, stage, 2, itemsize=8)
    if err > 1e-9:
        failures.append(f"stage {stage}: differs from serial by {err:.2e}")
    if any(mem[k] != formula[k] for k in formula):
        failures.append(f"stage {stage}: memory {mem} != formula {formula}")
    if any(led[op] != comm[op] for op in led):
        failures.append(f"stage {stage}: ledger {led} != formula {comm}")
    cells = " ".join(f"{mem[k]:>6}" for k in ("params", "grads", "optimizer", "activations"))
    cells_f = " ".join(f"{formula[k]:>6}" for k in ("params", "grads", "optimizer"))
    say(f"   {stage:>5} | {err:19.1e} | {cells}\n"
        f"         | {'formula':>19} | {cells_f}        "
        f"| {led['reduce_scatter']:>8} {led['allgather']:>10} {led['allreduce']:>10}")

# --- 4. buckets: which gradients each all-reduce carries ------------------------------------
# Stage 0 all-reduces the gradients in buckets (PyTorch DDP's rule): units join a bucket in
# the order backward completes them (ln_f, the blocks from the last, then wte and wpe: the
# tied wte is complete only after the embedding's backward), and the bucket's all-reduce is
# started (nonblocking) as soon as it holds bucket_mb; what is left goes after backward.
bucket_mb = 0.03
tr = Trainer(TrainConfig(**{**cfg0, "n_layer": 4, "n_embd": 32, "microbatches": 1,
                            "bucket_mb": bucket_mb, "steps": 1}), dataset=ds)
tr.step()
sizes = unit_sizes(tr.runner.mcfg)
order = ["ln_f", *(f"h.{i}" for i in reversed(range(4))), "wte", "wpe"]
buckets, bucket = [], []
for u in order:
    bucket.append(u)
    if sum(8 * sizes[v] for v in bucket) >= int(bucket_mb * 2**20):
        buckets.append(bucket)
        bucket = []
buckets += [bucket] if bucket else []
say(f"\n4. one plain data-parallel step, 4 layers, n_embd 32, buckets of {bucket_mb} MB "
    f"({int(bucket_mb * 2**20)} bytes):")
for j, b in enumerate(buckets):
    when = "after backward" if j == len(buckets) - 1 and bucket else f"when {b[-1]} is complete"
    say(f"   bucket {j}: {' + '.join(b):<12} {sum(8 * sizes[v] for v in b):>7} bytes, "
        f"started {when}")
led = tr.grid.ledger
calls, nbytes = led.count("allreduce", "dp"), led.bytes("allreduce", "dp")
say(f"   the ledger: {calls} all-reduces, {nbytes} bytes" + (
    f" = 8 x {sum(sizes.values())} parameters: every gradient once" if dp > 1
    else " (one rank: nothing to sum)"))
if dp > 1 and (calls != len(buckets) or nbytes != 8 * sum(sizes.values())):
    failures.append(f"buckets: the ledger counted {calls} all-reduces of {nbytes} bytes, "
                    f"not {len(buckets)} of {8 * sum(sizes.values())}")

bad = [f for fs in world.allgather(failures) for f in fs]
if bad:
    say("FAILED:\n  " + "\n  ".join(bad))
    sys.exit(1)
say("all checks passed")
