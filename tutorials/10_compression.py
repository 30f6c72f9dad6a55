"""Tutorial 10: communication compression (bf16, PowerSGD, top-k) with exact ledgers.

Run:  mpiexec -n 2 python tutorials/10_compression.py

It prints
  1. a tiny model trained 3 steps on 2 data-parallel ranks with each codec: the bytes the
     ledger counted on dp next to refmp.cost.zero's formula, and the final loss;
  2. PowerSGD on 2 ranks against the same compressor on one rank (rank 0, serially): the
     same weights to rounding, because P = sum_i M_i Q and Q = sum_i M_i^T P^ are linear.
and exits non-zero if a ledger differs from its formula or the runs differ.
"""

import sys

import numpy as np
from mpi4py import MPI

from refmp.cost.zero import comm_per_step, compressed_per_step, local_shapes, unit_sizes
from refmp.distributed.grid import ProcessGrid
from refmp.training.datasets import Dataset
from refmp.training.trainer import TrainConfig, Trainer

world = MPI.COMM_WORLD
rank0, n = world.rank == 0, world.size
failures = []
ds = Dataset(np.random.default_rng(0).integers(0, 11, 400), 11, "random")


def config(codec: str) -> TrainConfig:
    return TrainConfig(n_layer=2, n_head=2, n_embd=32, block_size=8, batch_size=4 * n, steps=3,
                       dtype="float64", progress=False, grad_compress=codec, compress_rank=2,
                       compress_ratio=0.05)


def formula(codec: str, tr: Trainer) -> int:
    """Bytes per step on dp: the plain all-reduce (8 bytes an element; bf16: 2), PowerSGD's
    R (n_r + m) per compressed matrix, top-k's n k (8 + 4)."""
    m = tr.mcfg
    if codec in ("none", "bf16"):
        return comm_per_step(unit_sizes(m), n, 0, itemsize=2 if codec == "bf16" else 8)["allreduce"]
    return sum(compressed_per_step(local_shapes(m), n, codec, 2, 0.05, 8).values())


# --- 1. the ledger shrinks by the formula ---------------------------------------------------
if rank0:
    print(f"1. {n} dp ranks, 3 steps: bytes per step on dp (ledger = formula), final loss")
runs = {}
for codec in ("none", "bf16", "powersgd", "topk"):
    tr = runs[codec] = Trainer(config(codec), dataset=ds)
    loss = [tr.step()["loss"] for _ in range(3)][-1]
    led = tr.grid.ledger
    got = (led.bytes("allreduce", "dp") + led.bytes("allgather", "dp")) // 3
    want = formula(codec, tr)
    if got != want:
        failures.append(f"{codec}: ledger {got} B/step, formula {want}")
    if rank0:
        print(f"   {codec:<9} {got:>8,} B/step (formula {want:>8,})  loss {loss:.6f}")

# --- 2. PowerSGD on n ranks is PowerSGD on one ----------------------------------------------
serial = None
if rank0:  # the same compressor on one rank, the whole batch
    serial = Trainer(config("powersgd"), grid=ProcessGrid(MPI.COMM_SELF), dataset=ds)
    for _ in range(3):
        serial.step()
got = runs["powersgd"].runner.full_params()  # collective; the whole model on rank 0
if rank0:
    want = serial.runner.full_params()
    worst = max(float(np.abs(got[k] - want[k]).max()) for k in want)
    print(f"2. PowerSGD on {n} ranks vs one: largest weight difference {worst:.1e}")
    if worst > 1e-12:
        failures.append(f"PowerSGD differs from the serial run by {worst}")

failures = sorted(set(sum(world.allgather(failures), [])))
if rank0:
    print("all checks passed" if not failures else "\n".join(failures))
sys.exit(1 if failures else 0)
