"""Tutorial 6: data parallelism done properly (accumulation, bucketed all-reduce, ZeRO 1/2/3).

Run:  mpiexec -n 2 python tutorials/06_zero.py      (any number of ranks works)

It prints
  1. the ZeRO memory table for GPT-2 124M and 1.5B, from the formulas (refmp.cost.zero);
  2. a tiny model trained 3 steps with each stage and 2 micro-batches, checked against the
     serial model (loss, gathered weights), with the memory each rank measured and the
     bytes its ledger counted, both next to the formulas;
  3. the buckets of one plain data-parallel step: which units each holds, in the order
     backward completes them, and the all-reduces the ledger counted for them.
and exits non-zero if anything disagrees with the serial run or the formulas.
"""

import sys

import numpy as np
from mpi4py import MPI

from refmp.cost.zero import comm_per_step, memory_per_rank, unit_sizes
from refmp.distributed.grid import ProcessGrid
from refmp.nn import GPTConfig
from refmp.training.datasets import Dataset
from refmp.training.trainer import TrainConfig, Trainer

world = MPI.COMM_WORLD
rank0 = world.rank == 0
failures = []


def say(*a):
    if rank0:
        print(*a, flush=True)


# --- 1. the table: what ZeRO saves on a real model ---------------------------------------------
say("1. ZeRO memory per rank, float32 + AdamW: params + grads + optimizer state (GiB)")
for name, cfg in [("GPT-2 124M", GPTConfig(50257, 1024, 12, 12, 768)),
                  ("GPT-2 1.5B", GPTConfig(50257, 1024, 48, 25, 1600))]:
    sizes = unit_sizes(cfg)  # elements of each unit ZeRO shards: wte, wpe, h.{i}, ln_f
    for dp in (8, 64):
        row = []
        for stage in range(4):
            m = memory_per_rank(sizes, dp, stage, itemsize=4)
            row.append(f"{sum(m.values()) / 2**30:7.2f}")
        say(f"   {name}, dp={dp:<3}  stage 0..3: " + "  ".join(row) + " GiB")

# --- 2. a tiny model, every stage, against the serial run ------------------------------------
dp = world.size
cfg0 = dict(n_layer=2, n_head=2, n_embd=6, block_size=6, batch_size=4 * dp, steps=3,
            lr=0.01, warmup_steps=1, grad_clip=0.1, dtype="float64", progress=False,
            microbatches=2, bucket_mb=0.002)
ds = Dataset(np.random.default_rng(0).integers(0, 11, 400), 11, "random digits")
mcfg = GPTConfig(11, 6, 2, 2, 6)  # sizes not divisible by 4: padding shows
sizes = unit_sizes(mcfg)
serial = Trainer(TrainConfig(**{**cfg0, "microbatches": 1}), grid=ProcessGrid(MPI.COMM_SELF),
                 dataset=ds)
want_loss = [serial.step()["loss"] for _ in range(3)]
want = serial.runner.full_params()  # the serial weights after 3 steps
say(f"\n2. {mcfg.n_layer} layers, n_embd {mcfg.n_embd}, {sum(sizes.values())} parameters in units "
    f"{sizes}, dp={dp}, 2 micro-batches, float64 (8 bytes per element)")
say("   stage | max |loss - serial| | params  grads  optim  activ (bytes, measured/formula) "
    "| per step: reduce-scatter all-gather all-reduce (bytes)")
for stage in range(4):
    tr = Trainer(TrainConfig(**cfg0, zero=stage), grid=ProcessGrid(MPI.COMM_WORLD), dataset=ds)
    losses = [tr.step()["loss"] for _ in range(3)]
    led = {op: tr.grid.ledger.bytes(op, "dp") // 3  # before the gathers of full_params
           for op in ("reduce_scatter", "allgather", "allreduce")}
    full = tr.runner.full_params()  # collective (stage 3 gathers the shards); rank 0 gets it
    err = max(abs(a - b) for a, b in zip(losses, want_loss, strict=True))
    if full is not None:
        err = max([err] + [float(np.abs(full[k] - v).max()) for k, v in want.items()])
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

# --- 3. buckets: which gradients each all-reduce carries ------------------------------------
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
say(f"\n3. one plain data-parallel step, 4 layers, n_embd 32, buckets of {bucket_mb} MB "
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
