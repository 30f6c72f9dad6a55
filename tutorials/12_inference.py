"""Tutorial 12: inference with the model split -- a KV cache split by tp and pp.

Run:  mpiexec -n 4 python tutorials/12_inference.py      (tp 2 x pp 2)

What it shows, each part checked (exit status 1 on a mismatch):
  1. prefill and decode with tp x pp: each rank keeps the k, v of its stage's layers and its
     heads; its cache bytes against the formula 2 x layers x B x tokens x C/tp x itemsize;
  2. the cached decoding's logits against the uncached forward of the same tokens, and its
     tokens against the serial model's (float64);
  3. what the cache saves: the same tokens without it (the whole sequence every step).
"""

import sys
import time

import numpy as np
from mpi4py import MPI

from refmp.distributed.grid import ProcessGrid
from refmp.inference.cache import cache_bytes
from refmp.inference.decoder import Decoder
from refmp.inference.generate import generate
from refmp.inference.sampling import Sampler
from refmp.nn.gpt import GPT, GPTConfig

world = MPI.COMM_WORLD
if world.size != 4:
    sys.exit("run with mpiexec -n 4 (tp 2 x pp 2)")
say = print if world.rank == 0 else (lambda *a, **k: None)

cfg = GPTConfig(vocab_size=64, block_size=64, n_layer=4, n_head=4, n_embd=64)
model = GPT.create(cfg, seed=0, dtype="float64")  # the same weights on every rank
B, T0, N = 4, 16, 24
prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T0))

# --- 1. prefill and decode on tp 2 x pp 2 ------------------------------------------------------
grid = ProcessGrid(tp=2, pp=2)
dec = Decoder(cfg, model.params, grid)  # keeps its stage's blocks, its tp shard of each
out = generate(dec, prompts, N, Sampler())
want = cache_bytes(len(dec.blocks), B, T0 + N - 1, cfg.n_embd, 2, 8)
rows = grid.world.allgather_obj((grid.coords, list(dec.blocks), out.kv_cache_bytes, want))
say(f"1. {B} prompts of {T0} tokens, {N} new; the cache of each rank "
    f"(2 x layers x B x {T0 + N - 1} tokens x C/tp x 8 bytes):")
for c, blocks, got, formula in rows:
    say(f"   pp {c['pp']} tp {c['tp']}: layers {blocks}, {got:,} bytes (formula {formula:,})")
ok = all(got == formula for _, _, got, formula in rows)

# --- 2. against the uncached forward and the serial model ---------------------------------
if dec.last and grid.coords["tp"] == 0:
    full, _ = model.forward(out.tokens[:, :-1])  # every position at once: no cache
    err = np.abs(out.logits - full[:, T0 - 1 :]).max()
    same = bool((out.tokens == model.generate(prompts, N)).all())
    print(f"2. last stage: logits vs the uncached forward, max |diff| {err:.1e}; tokens "
          f"equal to the serial model's: {same}", flush=True)
    ok &= err < 1e-12 and same
world.barrier()

# --- 3. what the cache saves -----------------------------------------------------------------
times = {}
for use_cache in (True, False):
    t0 = time.perf_counter()
    again = generate(Decoder(cfg, model.params, grid), prompts, N, Sampler(), use_cache=use_cache)
    times[use_cache] = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    if dec.last:
        ok &= bool((again.tokens == out.tokens).all())
say(f"3. {B * N} new tokens: {times[True]:.3f} s with the cache, {times[False]:.3f} s "
    f"recomputing the prefix every step ({times[False] / times[True]:.1f}x)")

ok = world.allreduce(int(not ok)) == 0
say("OK: the split cache decodes like the serial model" if ok else "MISMATCH")
sys.exit(0 if ok else 1)
