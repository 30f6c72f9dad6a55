"""Tutorial 6: context parallelism -- ring attention, zig-zag balance, and Ulysses.

Run:  mpiexec -n 4 python tutorials/06_context_parallel.py      (cp = the number of ranks)

What it shows, each part checked against the serial model (exit status 1 on a mismatch):
  1. context parallelism by hand: one layer's ring attention written out (send the K/V block
     on, receive the next, merge by log-sum-exp) against serial attention; then each rank
     takes its tokens of every row (SequenceChunks), runs
     the serial model (refmp.nn.gpt.GPT) with ring attention as its attention core and its
     tokens' global positions (ContextOps), and sums the gradients over cp; the loss and
     gradients equal the serial model's, and the ring's bytes the formula;
  2. the ring, step by step: which K/V block each rank holds and which chunk pairs it computes;
  3. the online-softmax merge of two blocks, on numbers;
  4. why causal attention needs balancing: attention FLOPs and time per rank, measured,
     contiguous vs zig-zag;
  5. ring and Ulysses attention equal serial attention (outputs and gradients), and the bytes
     each moved equal the formulas;
  6. when Ulysses beats the ring: bytes per rank per layer as cp grows;
  7. whole training steps through the engine (what `refmp train --cp` runs) equal the serial
     steps: cp alone, and composed with dp (ZeRO-1), tp (sequence parallel) and a pipeline.
"""

import math
import sys
import time

import numpy as np
from mpi4py import MPI

from refmp.cost.flops import ring_attention_flops
from refmp.distributed.comm import Comm
from refmp.distributed.grid import ProcessGrid
from refmp.distributed.ledger import Ledger
from refmp.distributed.waiting import wait
from refmp.nn import GPT, GPTConfig
from refmp.nn import blockwise as BW
from refmp.nn import fast as F
from refmp.nn import layers as L
from refmp.nn.params import init_params
from refmp.parallel.context.chunks import SequenceChunks
from refmp.parallel.context.ring import RingAttention
from refmp.parallel.context.ulysses import UlyssesAttention
from refmp.parallel.data.accumulate import allreduce_grads
from refmp.parallel.ops import ContextOps
from refmp.runtime.arrays import nbytes_of
from refmp.training.datasets import Dataset, get_batch
from refmp.training.trainer import TrainConfig, Trainer

world = MPI.COMM_WORLD
cp, rank = world.size, world.rank
failures = []


def say(*a):
    if rank == 0:
        print(*a, flush=True)


def check(ok: bool, what: str):
    if not ok:
        failures.append(f"rank {rank}: {what}")


# --- 1. context parallelism by hand: one layer's ring, written out ---------------------------
# My queries stay; the keys and values travel: at step i I hold rank (r - i)'s K/V block, send
# it on to rank r+1, receive the next from rank r-1, and merge my queries' attention over the
# block into a running (y, lse) by log-sum-exp. After cp steps every query has seen every key.
B, NH, HS, T = 2, 2, 4, 4 * cp
lay = SequenceChunks(T, cp, "zigzag")
mine = lay.positions(rank)  # (Tl,) my tokens' global positions: chunks r and 2cp-1-r
qkv = np.random.default_rng(5).standard_normal((B, T, 3 * NH * HS))  # the same on every rank
q, k, v = qkv[:, mine].reshape(B, -1, 3, NH, HS).transpose(2, 0, 3, 1, 4)  # (B, NH, Tl, HS)
kv = np.ascontiguousarray(np.stack([k, v]))  # (2, B, NH, Tl, HS): the block that travels
y = np.zeros_like(q)  # (B, NH, Tl, HS) the running output
lse = np.full(q.shape[:-1], -np.inf)  # (B, NH, Tl) the running log-sum-exp: nothing seen yet
ring = Comm(world, "cp", Ledger())
for i in range(cp):
    src = (rank - i) % cp  # whose keys I hold this step
    if i < cp - 1:  # pass the block on while I compute with it
        sent = ring.send(kv, (rank + 1) % cp, tag=7)
    s = q @ kv[0].swapaxes(-1, -2) / math.sqrt(HS)  # (B, NH, Tl, Tl) my queries x src's keys
    s[..., lay.positions(src)[None, :] > mine[:, None]] = -np.inf  # causal: keys after me
    lb = np.logaddexp.reduce(s, axis=-1)  # (B, NH, Tl); -inf where a row sees none of them
    yb = np.exp(s - np.where(np.isfinite(lb), lb, 0)[..., None]) @ kv[1]  # (B, NH, Tl, HS)
    new = np.logaddexp(lse, lb)  # merge: lse = log(e^lse + e^lb)
    y = np.exp(lse - new)[..., None] * y + np.exp(lb - new)[..., None] * yb
    lse = new
    if i < cp - 1:
        kv = ring.recv(kv.shape, kv.dtype, (rank - 1) % cp, tag=7)  # rank r-1's block, next
        wait(sent)
out = y.transpose(0, 2, 1, 3).reshape(B, -1, NH * HS)  # (B, Tl, C) my tokens' attention
want = L.attention_forward(qkv, NH)[0][:, mine]  # serial attention over the whole sequence
err = float(abs(out - want).max())
say(f"== 1. by hand: cp = {cp}, one layer's ring written out (T = {T}, zig-zag): largest "
    f"|output - serial attention| {max(world.allgather(err)):.1e}; each rank sent "
    f"{ring.ledger.bytes('send', 'cp')} bytes = (cp-1) K/V blocks of 2 B NH Tl HS 8 bytes")
check(err < 1e-12 and ring.ledger.bytes("send", "cp") == (cp - 1) * kv.nbytes, "ring by hand")

# then the whole model, its attention core the library's RingAttention (forward and backward)
V = 11
ds = Dataset(np.random.default_rng(3).integers(0, V, 200), V, "random")
B, T = 2, 4 * cp
mcfg = GPTConfig(vocab_size=V, block_size=T, n_layer=2, n_head=2, n_embd=8)
full = init_params(mcfg, seed=0, dtype="float64")  # the whole model, drawn on every rank
x, y = get_batch(ds.tokens, 0, B, T)  # (B, T)
serial = GPT(mcfg, full)
loss_ref, cache = serial.forward(x, y)
serial.backward(cache)

cpc = Comm(world, "cp", Ledger())
lay = SequenceChunks(T, cp, "zigzag")
mine = lay.positions(rank)  # (Tl,) my tokens' global positions: chunks r and 2cp-1-r
model = GPT(mcfg, {k: v.copy() for k, v in full.items()})  # every weight whole on every rank
# every layer but attention works token by token, on my Tl tokens; attention is the ring:
# cp steps, in each of which I send the K/V block I hold to rank r+1 and receive rank r-1's
# while computing my queries against the block (refmp.parallel.context.ring), merging as I go
ops = ContextOps(mcfg.n_head, attn=RingAttention(cpc, lay), positions=mine)  # serial linears
loss, cache = model.forward(x[:, mine], y[:, mine], denom=B * T, ops=ops)  # my tokens' share
# backward: the K/V blocks go round once more, and with each its gradient dK, dV, which
# collects every rank's share on its way home
model.backward(cache, ops=ops)
allreduce_grads(model.grads, cpc)  # one all-reduce over cp of the ranks' shares, as dp's
loss = cpc.allreduce_scalar(float(loss))  # the sum of the shares: the serial loss
err = max(float(np.abs(model.grads[k] - serial.grads[k]).max()) for k in full)
err = max(err, abs(loss - float(loss_ref)))
sent = cpc.ledger.bytes("send", "cp")
want = mcfg.n_layer * 3 * (cp - 1) * 2 * B * (T // cp) * mcfg.n_embd * 8
say(f"   the whole model through RingAttention, B = {B}, T = {T}: largest |loss or gradient - serial| "
    f"{err:.1e}; each rank sent {sent} bytes around the ring = L x 3 (cp-1) K/V blocks of "
    f"2 B Tl C 8 bytes ({want})")
check(err < 1e-12 and sent == want, "cp by hand")

# --- 2. the ring, step by step ---------------------------------------------------------------
say(f"\n== 2. the ring on cp={cp} ranks (T = {4 * cp}: zig-zag cuts 2cp chunks) ==")
for balance in ("contiguous", "zigzag"):
    lay = SequenceChunks(4 * cp, cp, balance)
    say(f"\n{balance}: rank r holds chunks " +
        ", ".join(f"r{r}={lay.chunks(r)}" for r in range(cp)))
    say("step | " + " | ".join(f"rank {r}: K/V of (pairs q<-k)" for r in range(cp)))
    for i in range(cp):
        cells = []
        for r in range(cp):
            ring = RingAttention(Comm(MPI.COMM_SELF), lay)
            ring.own_chunks = lay.chunks(r)  # draw rank r's view without its communicator
            src = (r - i) % cp
            pairs = [f"{lay.chunks(r)[a]}<-{lay.chunks(src)[b]}{'*' if c else ''}"
                     for a, b, c in ring.pairs(src)]
            cells.append(f"r{src} ({' '.join(pairs) or 'skip'})")
        say(f"{i:>4} | " + " | ".join(cells))
say("(a<-b: query chunk a attends key chunk b in full; * causal diagonal; skip: all masked.\n"
    " Each step the block moves one rank on, while the pairs above are computed.)")

# --- 3. the online-softmax merge -------------------------------------------------------------
say("\n== 3. merging two blocks: lse = log(e^lse1 + e^lse2), "
    "y = e^(lse1-lse) y1 + e^(lse2-lse) y2 ==")
rng = np.random.default_rng(0)
q, k, v = rng.standard_normal((3, 1, 1, 1, 6, 2)).reshape(3, 1, 1, 6, 2)  # 6 keys, HS 2
q = q[:, :, :1]  # one query row
y_full, lse_full = BW.attention_block_forward(q, k, v, 1.0)
y1, lse1 = BW.attention_block_forward(q, k[:, :, :3], v[:, :, :3], 1.0)  # keys 0-2
y2, lse2 = BW.attention_block_forward(q, k[:, :, 3:], v[:, :, 3:], 1.0)  # keys 3-5
y, lse = BW.attention_merge(y1, lse1, y2, lse2)
say(f"block 1: lse {lse1.item():.4f}  y {y1.ravel().round(4)}")
say(f"block 2: lse {lse2.item():.4f}  y {y2.ravel().round(4)}")
say(f"merged : lse {lse.item():.4f}  y {y.ravel().round(4)}")
say(f"all six: lse {lse_full.item():.4f}  y {y_full.ravel().round(4)}")
check(np.allclose(y, y_full, rtol=1e-12) and np.allclose(lse, lse_full), "merge")

# --- 4. balance, measured --------------------------------------------------------------------
B, NH, HS, T = 2, 4, 16, 64 * cp
say(f"\n== 4. causal work per rank: ring attention, B={B} NH={NH} HS={HS} T={T} ==")
qkv = np.random.default_rng(1).standard_normal((B, T, 3 * NH * HS))
for balance in ("contiguous", "zigzag"):
    lay = SequenceChunks(T, cp, balance)
    ring = RingAttention(Comm(world, "cp", Ledger()), lay)
    world.Barrier()
    t0 = time.perf_counter()
    for _ in range(3):
        ring.forward(qkv[:, lay.positions(rank)], NH)
    ms = (time.perf_counter() - t0) / 3 * 1e3
    # the block products alone, no waiting: the work itself (best of 3, against noise)
    q, k, v = qkv[:, lay.positions(rank)].reshape(B, -1, 3, NH, HS).transpose(2, 0, 3, 1, 4)
    busy = []
    for _ in range(3):
        t0 = time.perf_counter()
        for src in range(cp):
            for a, b, causal in ring.pairs(src):  # (k, v of src: the same shapes as mine)
                qa, kb = slice(a * lay.c, (a + 1) * lay.c), slice(b * lay.c, (b + 1) * lay.c)
                BW.attention_block_forward(q[:, :, qa], k[:, :, kb], v[:, :, kb], 0.25, causal)
        busy.append((time.perf_counter() - t0) * 1e3)
    flops, times = world.allgather(ring.flops // 3), world.allgather(ms)
    busy = world.allgather(min(busy))
    check(ring.flops // 3 == ring_attention_flops(lay, rank, B, NH, HS), "flops formula")
    say(f"{balance:>10}: MFLOP per rank {[round(f / 1e6, 2) for f in flops]}, "
        f"max/mean {max(flops) / np.mean(flops):.2f}\n{'':>12}compute ms per rank "
        f"{[round(t, 1) for t in busy]}; ring forward ms (with waiting) "
        f"{[round(t, 1) for t in times]}")
    if balance == "zigzag":
        check(len(set(flops)) == 1, "zig-zag balance")

# --- 5. ring and Ulysses equal serial attention ----------------------------------------------
B, NH, HS, T = 2, 2 * cp, 3, 4 * cp
C, Tl = NH * HS, T // cp
say(f"\n== 5. parity with serial attention (B={B} NH={NH} HS={HS} T={T}, float64) ==")
rng = np.random.default_rng(2)
qkv, dout = rng.standard_normal((B, T, 3 * C)), rng.standard_normal((B, T, C))
y_ref, cache = L.attention_forward(qkv, NH)
dqkv_ref = L.attention_backward(dout, cache)
for algo, cls in (("ring", RingAttention), ("ulysses", UlyssesAttention)):
    lay = SequenceChunks(T, cp, "zigzag")
    mine = lay.positions(rank)
    comm = Comm(world, "cp", Ledger())
    attn = cls(comm, lay)
    y, c = attn.forward(qkv[:, mine], NH)
    dqkv = attn.backward(dout[:, mine], c)
    err = max(abs(y - y_ref[:, mine]).max(), abs(dqkv - dqkv_ref[:, mine]).max())
    errs = world.allgather(err)
    if algo == "ring":
        op, want = "send", 3 * (cp - 1) * 2 * B * Tl * C * 8
        formula = "3 (cp-1) K/V blocks of 2 b Tl C"
    else:
        op, want = "alltoall", 2 * (B * Tl * 3 * C + B * Tl * C) * 8
        formula = "2 x (b Tl 3C + b Tl C)"
    got = comm.ledger.bytes(op, "cp")
    say(f"{algo:>8}: max |error| over ranks {max(errs):.1e}; {op}@cp {got} B per layer "
        f"(formula {formula} = {want})")
    check(err < 1e-12 and got == want, f"{algo} parity / ledger")
    # activation memory the attention keeps for backward, this rank vs the whole sequence
    if algo == "ring":  # q, k, v, y and lse of the whole sequence, were it on one rank
        whole = (4 * B * NH * T * HS + B * NH * T) * 8
        what = "q, k, v, y (b, NH, Tl, HS) + lse (b, NH, Tl)"
    else:  # the attention the model runs (refmp.nn.flash): q, k, v, y and lse, no (T, T)
        whole = nbytes_of(F.attention_forward(qkv, NH)[1])
        what = "the model's attention cache, q, k, v, y + lse; here NH/cp heads"
    say(f"{'':>8}  attention cache per rank {nbytes_of(c)} B = 1/{whole // nbytes_of(c)} of "
        f"{whole} B  ({what})")
    check(cp * nbytes_of(c) == whole, f"{algo} memory / cp")

# --- 6. when Ulysses beats the ring ------------------------------------------------------------
say("\n== 6. bytes each rank puts on the wire per layer (forward + backward), b=1, T=8192, "
    "C=4096, bf16 ==")
b, T, C, isz = 1, 8192, 4096, 2
say(" cp |       ring |    ulysses")
for n in (2, 4, 8, 16):
    Tl = T // n
    ring_wire = 3 * (n - 1) * 2 * b * Tl * C * isz  # every block crosses one link, whole
    uly_wire = 2 * (b * Tl * 4 * C) * isz * (n - 1) / n  # all-to-all keeps 1/cp at home
    say(f"{n:>3} | {ring_wire / 2**20:>7.0f} MiB | {uly_wire / 2**20:>7.0f} MiB")
say("Ulysses' volume per rank falls as 1/cp while the ring's stays ~6 b T C; but Ulysses needs "
    "cp | NH, and the ring hides its transfers behind block products that grow as Tl^2.")

# --- 7. whole training steps -------------------------------------------------------------------
# One engine (refmp.parallel.engine) runs every layout: context parallelism is the tokens each
# rank takes from a row (SequenceChunks) and the attention core of its Ops; it composes with dp,
# tp (and sequence parallelism), pipelines and ZeRO unchanged.
say("\n== 7. three AdamW steps with --cp, alone and composed, against the serial run ==")
base = dict(n_layer=2, n_head=cp, n_embd=2 * cp, block_size=2 * cp, batch_size=2, steps=3,
            lr=0.01, warmup_steps=1, grad_clip=0.05, dtype="float64", progress=False)
layouts = [dict(cp=cp), dict(cp=cp, cp_algo="ulysses")]
if cp % 4 == 0:  # half the ranks' worth of cp, times 2 of dp, tp or pp
    half = cp // 2
    layouts += [dict(cp=half, dp=2, zero=1), dict(cp=half, tp=2, sequence_parallel=True),
                dict(pp=2, cp=half, microbatches=2, cp_balance="contiguous")]
for lay in layouts:
    cfg = TrainConfig(**base, **lay)
    par = Trainer(cfg, dataset=ds)  # the grid from cfg: pp x dp x cp x tp = the world
    # the serial run on rank 0 alone: the same config, every layout field at its default
    ref = (Trainer(TrainConfig(**base), grid=ProcessGrid(MPI.COMM_SELF), dataset=ds)
           if rank == 0 else None)
    for s in range(cfg.steps):
        p = par.step()
        if ref is not None:
            a = ref.step()
            check(math.isclose(a["loss"], p["loss"], rel_tol=1e-9), f"{lay} loss step {s}")
    got = par.runner.full_params()  # collective: the whole model, gathered on rank 0
    led, dp_ = par.grid.ledger, par.grid.sizes["dp"]
    group = "dp+cp" if dp_ > 1 else "cp"  # the dense gradients: ONE reduction over dp x cp
    op = "allreduce" if cfg.zero == 0 else "reduce_scatter"
    calls = led.count(op, group) // cfg.steps
    check(cfg.zero > 0 or calls == 1, f"{lay}: one all-reduce of the gradients per step")
    check(led.bytes(op, "dp") == 0 and (dp_ == 1 or led.bytes(op, "cp") == 0),
          f"{lay}: no reduction over dp or cp alone")
    if ref is not None:
        want = ref.runner.full_params()
        err = max(abs(got[k] - want[k]).max() for k in want)
        check(err < 1e-12, f"{lay} weights")
        name = " x ".join(f"{k}={v}" for k, v in par.grid.sizes.items() if v > 1)
        extra = ([cfg.cp_algo, cfg.cp_balance] + ["SP"] * cfg.sequence_parallel
                 + [f"ZeRO-{cfg.zero}"] * (cfg.zero > 0))
        say(f"{name} ({', '.join(extra)}): final loss {p['loss']:.6f} (serial {a['loss']:.6f}), "
            f"max |weight difference| {err:.1e}\n{'':>4}dense gradients: {op}@{group}, "
            f"{calls} call(s) per step" + (" (one per unit)" if cfg.zero else ""))

bad = [f for fs in world.allgather(failures) for f in fs]
if bad:
    say("FAILED:\n" + "\n".join(bad))
    sys.exit(1)
say("\nall checks passed")
