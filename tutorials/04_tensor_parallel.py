"""Tutorial 4: tensor parallelism (Megatron-LM) and sequence parallelism, checked.

    mpiexec -n 2 python tutorials/04_tensor_parallel.py      (or -n 4)

All ranks form one tensor-parallel group. Each holds 1/tp of every big matrix: the q, k and v
columns of its own heads, its rows of the attention and MLP output projections, its columns
of the MLP input, its rows of the (padded) token embedding (refmp.parallel.placement). The
one engine runs the layout: the serial block of refmp.nn.gpt, through ParallelOps
(refmp.parallel.ops), whose linears are column- and row-parallel (refmp.parallel.tensor.linear).
The script shows the shards, trains a few AdamW steps with and without sequence parallelism
next to the serial model, holds the ledger's bytes against the formula, and reports the
activation memory each rank's caches hold. Exits non-zero if anything differs.
"""

import sys

import numpy as np
from mpi4py import MPI

from refmp.cost.tensor import comm_bytes_per_step
from refmp.distributed.grid import ProcessGrid
from refmp.parallel.placement import padded_vocab, place, tp_shard
from refmp.training.datasets import AdditionTask
from refmp.training.trainer import TrainConfig, Trainer

world = MPI.COMM_WORLD
tp = world.size
say = print if world.rank == 0 else (lambda *a, **k: None)
ds = AdditionTask(digits=3, seed=0, n_train=500, n_test=20).dataset()  # vocabulary 13
base = dict(n_layer=2, n_head=4, n_embd=16, block_size=12, batch_size=4, steps=3, lr=1e-2,
            warmup_steps=1, grad_clip=0.5, dtype="float64", progress=False)
B, T, C, L_ = 4, 12, 16, 2
ok = True

# --- 1. who holds what ----------------------------------------------------------------------
serial = Trainer(TrainConfig(**base), grid=ProcessGrid(MPI.COMM_SELF), dataset=ds)  # per rank
init = serial.runner.full_params()  # the whole model (the engine keeps only what it holds)
say(f"tp = {tp} ranks; GPT: {L_} layers, 4 heads, C = {C}, vocabulary 13, T = {T}\n")
say(f"{'parameter':<24} {'full':>10} {'rank 0 holds':>14}")
for k in ["wte.weight", "wpe.weight", "h.0.ln_1.weight", "h.0.attn.c_attn.weight",
          "h.0.attn.c_attn.bias", "h.0.attn.c_proj.weight", "h.0.attn.c_proj.bias",
          "h.0.mlp.c_fc.weight", "h.0.mlp.c_proj.weight"]:
    say(f"{k:<24} {str(init[k].shape):>10} {str(tp_shard(k, init[k], 0, tp).shape):>14}")
say(f"(wte padded from 13 to {padded_vocab(13, tp)} rows; the padded logits are -inf, never "
    f"in the loss)\n")

# --- 2. train next to the serial model, with and without sequence parallelism ---------------
serial_steps = [serial.step()["loss"] for _ in range(base["steps"])]
want = serial.runner.full_params()
for sp in (False, True):
    run = Trainer(TrainConfig(**base, tp=tp, sequence_parallel=sp), dataset=ds)
    led = run.grid.ledger
    led.reset()
    losses = [run.step()["loss"] for _ in range(base["steps"])]
    measured = {op: led.bytes(op, "tp") // base["steps"]
                for op in ("allreduce", "allgather", "reduce_scatter")}
    # the replicated parameters (wpe, LayerNorms, c_proj biases): SP sums their gradients
    n_repl = sum(int(v.size) for k, v in run.runner.params.items()
                 if place(k, sp).tp_split is None)
    formula = comm_bytes_per_step(B, T, C, L_, sp, 8, n_repl)
    full = run.runner.full_params()  # gathered to rank 0, unpadded
    worst = 0.0 if full is None else max(float(np.abs(full[k] - want[k]).max()) for k in want)
    worst = world.allreduce(worst, op=MPI.MAX)
    same = worst < 1e-10 and np.allclose(losses, serial_steps, rtol=1e-10)
    ok &= same and measured == formula
    say(f"--- tensor parallel{' + sequence parallel' if sp else ''} ---")
    for s, (a, b) in enumerate(zip(losses, serial_steps, strict=True)):
        say(f"step {s}: loss {a:.12f}   serial {b:.12f}")
    say(f"largest weight difference from serial after {base['steps']} steps: {worst:.1e}")
    say(f"{'bytes/step on tp':<18} {'formula':>10} {'ledger':>10}")
    for op in formula:
        say(f"  {op:<16} {formula[op]:>10,} {measured[op]:>10,}")
    # activation memory: the peak bytes of the forward caches (parameters left out)
    mine, ref = run.runner.memory()["activations"], serial.runner.memory()["activations"]
    say(f"activation memory per rank: {mine:,} bytes (serial model: {ref:,}; ratio "
        f"{ref / mine:.2f})\n")

say("OK: tensor parallel == serial, ledger == formula" if ok else "FAILED")
sys.exit(0 if ok else 1)
