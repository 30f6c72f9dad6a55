"""Tutorial 5: tensor parallelism (Megatron-LM) and sequence parallelism, checked.

    mpiexec -n 2 python tutorials/05_tensor_parallel.py      (or -n 4)

All ranks form one tensor-parallel group. Each holds 1/tp of every big matrix: the q, k and v
columns of its own heads, its rows of the attention and MLP output projections, its columns
of the MLP input, its rows of the (padded) token embedding (refmp.parallel.placement).

Part 1 does it by hand. First one MLP with every collective written out: X A split by
columns, GELU on the columns a rank owns, the product with B split by rows left partial and
completed by an all-reduce (Megatron's g), the backward's all-reduce of dX (f); then the same
MLP with sequence parallelism, whose all-gather and reduce-scatter along T replace them. Then
the whole model: every rank keeps its shard of each parameter (tp_shard) and runs the
serial model's own forward and backward (refmp.nn.gpt.GPT) through ParallelOps
(refmp.parallel.ops), whose linears are column- and row-parallel with Megatron's f and g
around them (refmp.parallel.tensor.linear); the gradients, gathered, must equal the serial
model's, and the bytes on tp the formula's. Part 2 shows who holds what. Part 3 runs the same
layout through the engine (what `refmp train --tp` runs): a few AdamW steps with and without
sequence parallelism next to the serial model, the ledger against the formula, and the
activation memory each rank's caches hold. Exits non-zero if anything differs.
"""

import sys

import numpy as np
from mpi4py import MPI

from refmp.cost.tensor import comm_bytes_per_step
from refmp.distributed.comm import Comm
from refmp.distributed.grid import ProcessGrid
from refmp.nn import GPT, GPTConfig
from refmp.nn import layers as L
from refmp.nn.params import init_params
from refmp.parallel.ops import MEGATRON, ParallelOps
from refmp.parallel.placement import gather_tp, padded_vocab, place, tp_shard
from refmp.parallel.tensor import sequence
from refmp.training.datasets import AdditionTask, get_batch
from refmp.training.trainer import TrainConfig, Trainer

world = MPI.COMM_WORLD
tp, rank = world.size, world.rank
say = print if rank == 0 else (lambda *a, **k: None)
ds = AdditionTask(digits=3, seed=0, n_train=500, n_test=20).dataset()  # vocabulary 13
base = dict(n_layer=2, n_head=4, n_embd=16, block_size=12, batch_size=4, steps=3, lr=1e-2,
            warmup_steps=1, grad_clip=0.5, dtype="float64", progress=False)
B, T, C, L_ = 4, 12, 16, 2
ok = True

# --- 1. tensor parallelism by hand: an MLP with its collectives in sight ---------------------
# Z = GELU(X A) B with A (C, 4C) split by columns and B (4C, C) by rows: rank r holds A_r
# (C, 4C/tp) and B_r (4C/tp, C), GELU acts on the columns it owns, Z = sum_r GELU(X A_r) B_r
tp_comm = Comm(world, "tp")
rng = np.random.default_rng(0)  # the same draws on every rank
X, dZ = rng.standard_normal((2, B, T, C))  # the input and the gradient arriving from above
A, Bw = rng.standard_normal((C, 4 * C)) / 4, rng.standard_normal((4 * C, C)) / 8
mine = slice(rank * 4 * C // tp, (rank + 1) * 4 * C // tp)  # my columns of A, rows of B
A_r, B_r = A[:, mine], Bw[mine, :]  # (C, 4C/tp), (4C/tp, C)
H = X @ A_r  # (B, T, 4C/tp) column-parallel: X is whole here (f forward: identity)
G, gelu = L.gelu_forward(H)  # (B, T, 4C/tp) elementwise, on my columns alone
Z = tp_comm.allreduce(G @ B_r)  # (B, T, C) partial over tp -> summed: g forward, all-reduce
# backward, the mirror: g's backward is the identity, f's an all-reduce
dB_r = G.reshape(-1, 4 * C // tp).T @ dZ.reshape(-1, C)  # (4C/tp, C)
dH = L.gelu_backward(dZ @ B_r.T, gelu)  # (B, T, 4C/tp)
dA_r = X.reshape(-1, C).T @ dH.reshape(-1, 4 * C // tp)  # (C, 4C/tp)
dX = tp_comm.allreduce(dH @ A_r.T)  # (B, T, C) partial over tp -> summed: f backward
# the serial MLP, for the check
h, c_fc = L.linear_forward(X, A)
g, gelu_ref = L.gelu_forward(h)
z, c_proj = L.linear_forward(g, Bw)
dg, dBw, _ = L.linear_backward(dZ, c_proj)
dx, dA, _ = L.linear_backward(L.gelu_backward(dg, gelu_ref), c_fc)
err = max(abs(Z - z).max(), abs(dX - dx).max(), abs(dA_r - dA[:, mine]).max(),
          abs(dB_r - dBw[mine]).max())
# sequence parallelism: outside the MLP each rank keeps T/tp tokens; the all-gather along T
# replaces f's identity and the reduce-scatter along T replaces g's all-reduce (and backward,
# the other way round). Comm's collectives work on axis 0: T is moved there and back.


def to_T(a):  # (tp B, T/tp, C), rank by rank -> (B, T, C)
    return np.concatenate(np.split(a, tp, axis=0), axis=1)


def from_T(a):  # (B, T, C) -> (tp B, T/tp, C): block j holds the tokens of rank j
    return np.concatenate(np.split(a, tp, axis=1), axis=0)


toks = slice(rank * T // tp, (rank + 1) * T // tp)  # my T/tp tokens
Xg = to_T(tp_comm.allgather(np.ascontiguousarray(X[:, toks])))  # (B, T, C) all-gather along T
G, gelu = L.gelu_forward(Xg @ A_r)  # (B, T, 4C/tp)
Z_r = tp_comm.reduce_scatter(from_T(G @ B_r))  # (B, T/tp, C) summed, my tokens: reduce-scatter
dZg = to_T(tp_comm.allgather(np.ascontiguousarray(dZ[:, toks])))  # (B, T, C) backward all-gather
dH = L.gelu_backward(dZg @ B_r.T, gelu)  # (B, T, 4C/tp)
dX_r = tp_comm.reduce_scatter(from_T(dH @ A_r.T))  # (B, T/tp, C): backward reduce-scatter
err = max(err, abs(Z_r - z[:, toks]).max(), abs(dX_r - dx[:, toks]).max())
ok &= err < 1e-12
say(f"1. by hand: tp = {tp}, an MLP with its collectives written out (all-reduce; with SP "
    f"all-gather and reduce-scatter along T): largest |output or gradient - serial| {err:.1e}")

# then the whole GPT, its linears column- and row-parallel in the library's layers
mcfg = GPTConfig(vocab_size=ds.vocab_size, block_size=T, n_layer=L_, n_head=4, n_embd=C)
full = init_params(mcfg, seed=0, dtype="float64")  # the whole model, drawn on every rank
x, y = get_batch(ds.tokens, 0, B, T)  # (B, T): the same rows on every tp rank
serial = GPT(mcfg, full)
loss_ref, cache = serial.forward(x, y)
serial.backward(cache)
say(f"   the whole GPT through ParallelOps: one forward and backward of B = {B} rows against the serial GPT")
for sp in (False, True):
    model = GPT(mcfg, {k: tp_shard(k, v, rank, tp) for k, v in full.items()})  # my shards
    layers = sequence.LAYERS if sp else MEGATRON  # SP: the same layers split along T
    ops = ParallelOps(mcfg.n_head, mcfg.vocab_size, tp_comm, layers)  # NH/tp heads here
    tp_comm.ledger.reset()
    # forward: the embedding's masked lookup is summed over tp (g: all-reduce; with SP a
    # reduce-scatter along T); c_attn and c_fc enter the parallel region with f (identity;
    # SP: all-gather along T), the two c_proj leave it with g (all-reduce of the partial sum;
    # SP: reduce-scatter); the vocab-parallel cross-entropy all-reduces three (B T,) vectors
    loss, cache = model.forward(x, y, ops=ops)  # the loss, the same on every tp rank
    # backward, the mirror: f's backward all-reduces dX (SP: reduce-scatter), g's is the
    # identity (SP: all-gather dZ), and SP all-gathers each column layer's input once more
    model.backward(cache, ops=ops)
    # with SP a rank saw T/tp of the tokens: the gradients of the weights every rank holds
    # whole (wpe, LayerNorms, c_proj biases) are partial over tp, and are summed here
    for k, g in model.grads.items():
        if "tp" in place(k, sp).reduce:
            tp_comm.allreduce(g)  # (shape of k) partial over tp -> summed
    n_repl = sum(int(v.size) for k, v in model.params.items() if place(k, sp).tp_split is None)
    formula = comm_bytes_per_step(B, T, C, L_, sp, 8, n_repl)
    measured = {op: tp_comm.ledger.bytes(op, "tp") for op in formula}
    whole = gather_tp(model.grads, tp_comm, mcfg.vocab_size)  # all-gather the shards, unpadded
    err = max(float(np.abs(whole[k] - serial.grads[k]).max()) for k in full)
    err = max(err, abs(float(loss) - float(loss_ref)))
    ok &= err < 1e-12 and measured == formula
    say(f"   {'SP' if sp else 'no SP'}: largest |gradient - serial| {err:.1e}; bytes on tp "
        + ", ".join(f"{op} {measured[op]:,} (formula {formula[op]:,})" for op in formula))
ok = world.allreduce(int(ok), op=MPI.MIN) == 1

# --- 2. who holds what ----------------------------------------------------------------------
say(f"\n2. tp = {tp} ranks; GPT: {L_} layers, 4 heads, C = {C}, vocabulary 13, T = {T}\n")
say(f"{'parameter':<24} {'full':>10} {'rank 0 holds':>14}")
for k in ["wte.weight", "wpe.weight", "h.0.ln_1.weight", "h.0.attn.c_attn.weight",
          "h.0.attn.c_attn.bias", "h.0.attn.c_proj.weight", "h.0.attn.c_proj.bias",
          "h.0.mlp.c_fc.weight", "h.0.mlp.c_proj.weight"]:
    say(f"{k:<24} {str(full[k].shape):>10} {str(tp_shard(k, full[k], 0, tp).shape):>14}")
say(f"(wte padded from 13 to {padded_vocab(13, tp)} rows; the padded logits are -inf, never "
    f"in the loss)\n")

# --- 3. the same layout through the engine (`refmp train --tp`), next to the serial model ---
say("3. the engine")
serial = Trainer(TrainConfig(**base), grid=ProcessGrid(MPI.COMM_SELF), dataset=ds)  # per rank
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
    got = run.runner.full_params()  # gathered to rank 0, unpadded
    worst = 0.0 if got is None else max(float(np.abs(got[k] - want[k]).max()) for k in want)
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
