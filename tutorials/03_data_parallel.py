"""Tutorial 3: data parallelism by hand, checked against the serial model.

    mpiexec -n 2 python tutorials/03_data_parallel.py

Every rank holds the whole model and reads its own rows of the global batch. Each rank's
loss is its *share* of the global mean (its tokens' loss sum divided by the global token
count), so one all-reduce (sum) of the gradients gives every rank exactly the serial gradient,
and identical optimizer steps keep the copies identical. At the end every rank runs the serial
model on the whole batch itself and compares. Last, refmp's engine (what `refmp train --dp`
runs) trains the same steps; its weights, gathered, must equal the serial model's too.
Exits non-zero on a mismatch.
"""

import sys

import numpy as np
from mpi4py import MPI

from refmp.distributed.comm import Comm
from refmp.nn import GPT, GPTConfig
from refmp.parallel.data.accumulate import allreduce_grads, dp_rows
from refmp.training.datasets import AdditionTask, get_batch
from refmp.training.optim import AdamW, clip_grad_norm
from refmp.training.trainer import TrainConfig, Trainer

world = Comm(MPI.COMM_WORLD, "dp")
rank, dp = world.rank, world.size
say = print if rank == 0 else (lambda *a, **k: None)

task = AdditionTask(digits=3, seed=0, n_train=2000, n_test=10)
ds = task.dataset()
T, B, steps = task.line_len, 8 * dp, 5
cfg = GPTConfig(vocab_size=ds.vocab_size, block_size=T, n_layer=2, n_head=2, n_embd=16)

# Same seed on every rank: the replicas start identical (and equal to the serial model).
replica = GPT.create(cfg, seed=0, dtype="float64")
serial = GPT.create(cfg, seed=0, dtype="float64")
opt_r, opt_s = AdamW(replica.params, lr=1e-2), AdamW(serial.params, lr=1e-2)
rows = dp_rows(B, dp, rank)
say(f"{dp} ranks, global batch {B} sequences of {T} tokens; rank r reads rows "
    f"[r*{B // dp}, (r+1)*{B // dp})")

for step in range(steps):
    # --- data parallel: my rows, my share of the mean, one all-reduce -------------------
    x, y = get_batch(ds.tokens, step, B, T, rows)  # (B/dp, T)
    replica.zero_grad()
    share, cache = replica.forward(x, y, denom=B * T)  # my tokens' loss sum / (B*T)
    replica.backward(cache)
    allreduce_grads(replica.grads, world)  # sum over ranks = the global gradient
    loss = world.allreduce_scalar(float(share))  # sum of shares = the global mean loss
    clip_grad_norm(replica.grads, 1.0)
    opt_r.step(replica.grads)

    # --- the serial reference, on the whole batch (every rank computes it) -------------
    xs, ys = get_batch(ds.tokens, step, B, T)  # (B, T)
    serial.zero_grad()
    ref_loss, cache = serial.forward(xs, ys)
    serial.backward(cache)
    clip_grad_norm(serial.grads, 1.0)
    opt_s.step(serial.grads)
    say(f"step {step}: data-parallel loss {loss:.10f}   serial loss {float(ref_loss):.10f}")

worst = max(float(np.abs(replica.params[k] - serial.params[k]).max()) for k in serial.params)
worst = world.allreduce_scalar(worst, op="max")
led = world.ledger
say(f"\nall-reduce traffic: {led.count('allreduce')} calls, {led.bytes('allreduce'):,} bytes "
    f"= {steps} steps x {replica.num_params():,} params x 8 bytes")
say(f"largest weight difference from the serial run after {steps} AdamW steps: {worst:.2e}")

# --- the same steps with refmp's engine (buckets of gradients all-reduced during backward) ---
engine = Trainer(TrainConfig(n_layer=2, n_head=2, n_embd=16, batch_size=B, steps=steps, lr=1e-2,
                             lr_schedule="constant", beta2=0.999, weight_decay=0.01,
                             grad_clip=1.0, dtype="float64", seed=0, progress=False), dataset=ds)
for _ in range(steps):
    engine.step()
full = engine.runner.full_params()  # collective: the whole model on rank 0, None elsewhere
diff = 0.0 if full is None else max(float(np.abs(full[k] - serial.params[k]).max())
                                    for k in serial.params)
diff = world.allreduce_scalar(diff, op="max")
say(f"the engine on {dp} ranks, same steps: largest weight difference {diff:.2e}")
ok = worst < 1e-10 and diff < 1e-10
say("OK: data parallel == serial" if ok else "FAILED: data parallel != serial")
sys.exit(0 if ok else 1)
