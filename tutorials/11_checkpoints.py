"""Tutorial 11: sharded checkpoints -- save on one layout, resume on another.

Run:  mpiexec -n 4 python tutorials/11_checkpoints.py

A GPT trained 4 steps (float64, AdamW, a cosine learning rate), stopped after step 2:
  1. on tp 2 x pp 2 with ZeRO-1, every rank writes the pieces it owns (weights and AdamW's
     two moments) to its own file, and rank 0 the manifest, then renames the directory;
  2. what the manifest says, and who holds which slice of each tensor; each file's size
     against the formula: counted elements x 8 bytes x (1 weight + 2 moments) + the runs;
  3. a new run on dp 2 x cp 2 with ZeRO-2 resumes it: each rank reads the slices it needs;
  4. its losses and final weights against a serial run that never stopped (rank 0), and the
     checkpoint as one GPT-2 file (`refmp convert`) against the weights it holds.
Exit status 1 on any mismatch.
"""

import json
import os
import struct
import sys
import tempfile
from dataclasses import replace

import numpy as np
from mpi4py import MPI

from refmp.checkpoint import convert
from refmp.checkpoint.format import read_manifest
from refmp.distributed.grid import ProcessGrid
from refmp.training.datasets import Dataset
from refmp.training.trainer import TrainConfig, Trainer

world = MPI.COMM_WORLD
if world.size != 4:
    if world.rank == 0:
        print("run me with: mpiexec -n 4 python tutorials/11_checkpoints.py", file=sys.stderr)
    sys.exit(2)
rank0, failures = world.rank == 0, []


def say(*a):
    if rank0:
        print(*a, flush=True)


cfg = TrainConfig(n_layer=2, n_head=4, n_embd=16, block_size=8, batch_size=4, steps=4,
                  lr=0.01, warmup_steps=1, grad_clip=0.5, dtype="float64", seed=1,
                  progress=False)
ds = Dataset(np.random.default_rng(0).integers(0, 17, 400), 17, "random")  # V 17: tp pads wte
root = world.bcast(tempfile.mkdtemp(prefix="refmp-tutorial-11-") if rank0 else None)

# --- 1. train 2 of 4 steps on tp 2 x pp 2, then save -------------------------------------------
first = Trainer(replace(cfg, tp=2, pp=2, zero=1), dataset=ds)
losses = [first.step()["loss"] for _ in range(2)]
ckpt = first.save_checkpoint(root)  # collective: every rank its file, rank 0 the manifest
say(f"Part 1. {first.grid.describe()}, ZeRO-1: 2 steps (loss {losses[-1]:.6f}), saved to\n"
    f"  {ckpt}/: {', '.join(sorted(os.listdir(ckpt)))}\n")

# --- 2. the manifest, who holds which slice, and the size formula -------------------------------
man = read_manifest(ckpt)
say("Part 2. the manifest (abridged):")
for key in ("step", "dtype", "layout", "optimizer", "data", "lr", "rng"):
    say(f"  {key:>9}: {json.dumps(man[key])}")
say(f"  {'model':>9}: {json.dumps(man['model'])}")
say(f"  {'tensors':>9}: {len(man['tensors'])} global shapes, e.g. wte.weight "
    f"{man['tensors']['wte.weight']}")
say("\n" + "\n".join(line for line in convert.info(ckpt).splitlines()[5:]
                     if "h.1" not in line and "ln_2" not in line and "mlp" not in line))
say("  (first..last are global flat indices; runs: how many contiguous pieces. tp splits\n"
    "  c_attn by heads, q|k|v, so each of its 16 rows gives 3 runs per rank; wte's last rank\n"
    "  holds rows 9-16 of 17, the padding row is not written; the last stage's copy of the\n"
    "  tied wte is not written either: rank 0 and rank 1 hold it.)\n")
say("  each file, against the formula: payload = counted elements x 8 B x (1 + 2 moments)"
    " + 16 B per run")
for name, f in sorted(man["files"].items()):
    with open(os.path.join(ckpt, name), "rb") as fh:
        header = struct.unpack("<Q", fh.read(8))[0]  # safetensors: 8-byte header length
    payload = f["bytes"] - 8 - header
    n = sum(p["numel"] for p in f["pieces"].values())
    runs = sum(p["runs"] for p in f["pieces"].values())
    want = n * 8 * 3 + 16 * runs
    say(f"  {name}: {n:>5} elements, {runs:>3} runs: payload {payload:>7,} B, formula "
        f"{want:>7,} B")
    if payload != want:
        failures.append(f"{name}: payload {payload} != formula {want}")
total = sum(sum(p["numel"] for p in f["pieces"].values()) for f in man["files"].values())
params = sum(int(np.prod(s)) for s in man["tensors"].values())
say(f"  every element once: {total} elements written, the model has {params}")
if total != params:
    failures.append(f"{total} elements written, {params} in the model")

# --- 3. resume on dp 2 x cp 2 with ZeRO-2 ------------------------------------------------------
second = Trainer(replace(cfg, dp=2, cp=2, zero=2, resume=root), dataset=ds)
say(f"\nPart 3. {second.grid.describe()}, ZeRO-2 resumes at step {second.step_num}: rank "
    f"{world.rank} holds {sum(p.size for p in second.runner.params.values())} elements now")
losses += [second.step()["loss"] for _ in range(2)]
got = second.runner.full_params()  # collective: the whole model on rank 0

# --- 4. against the run that never stopped --------------------------------------------------------
if rank0:
    serial = Trainer(cfg, grid=ProcessGrid(MPI.COMM_SELF), dataset=ds)
    want = [serial.step()["loss"] for _ in range(4)]
    ref = serial.runner.full_params()
    print("\nPart 4. step  resumed run      serial, never stopped")
    for s, (a, b) in enumerate(zip(losses, want, strict=True)):
        print(f"  {s:>10}  {a:.12f}  {b:.12f}")
    worst = max(float(np.abs(got[k] - ref[k]).max()) for k in ref)
    print(f"  largest weight difference after step 4: {worst:.1e} (float64 rounding: sums in"
          f" other orders)")
    if worst > 1e-12 or not np.allclose(losses, want, rtol=1e-12, atol=0):
        failures.append(f"resumed run differs from the serial one by {worst:.1e}")
    out = os.path.join(root, "model.safetensors")  # refmp convert DIR OUT.safetensors
    convert.to_gpt2(root, out)  # the latest: step 2, from tp 2 x pp 2's files
    from safetensors.numpy import load_file

    one = load_file(out)
    check = Trainer(cfg, grid=ProcessGrid(MPI.COMM_SELF), dataset=ds)
    for _ in range(2):
        check.step()
    two = check.runner.full_params()
    diff = max(float(np.abs(one[k] - two[k]).max()) for k in two)
    print(f"  refmp convert {root} {out}: step 2's weights, {diff:.1e} from serial step 2")
    if diff > 1e-12:
        failures.append(f"converted checkpoint differs by {diff:.1e}")

ok = world.bcast(not failures if rank0 else None)
if rank0:
    import shutil

    shutil.rmtree(root)
    for f in failures:
        print("MISMATCH:", f)
say("OK: resumed on another layout == the uninterrupted run" if ok else "FAILED")
sys.exit(0 if ok else 1)
