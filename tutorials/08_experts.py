"""Tutorial 8: mixture of experts and expert parallelism, checked against the serial model.

    mpiexec -n 2 python tutorials/08_experts.py        (or -n 4)

Part 1 does expert parallelism by hand: each rank holds the dense weights and its E/ep
experts of every MoE layer, runs the serial model (refmp.nn.gpt.GPT) on its rows with the
experts reached through a dispatch written out here (ByHand: an all-to-all of the counts per
expert, then of the token rows, the local experts, and the results sent back; the backward
the same two trips the other way), and sums the dense gradients over the ranks; every
gradient must equal the serial model's. The engine's ExpertDispatch
(refmp.parallel.expert) does the same with one permutation in place of the loop. Part 2 routes
one sequence through an MoE layer and draws where each token goes: its top-2 experts, the
gates, and which assignments the capacity limit drops. Part 3 shows the two router losses,
recomputed by hand. Part 4 trains the same MoE model serially and through the engine with
its experts sharded over all ranks (`refmp train --ep`, carved from the data-parallel
ranks), compares the weights, and holds the all-to-all bytes in the ledger against what the
routing implies. Exits non-zero on a mismatch.
"""

import sys

import numpy as np
from mpi4py import MPI

from refmp.cost.expert import alltoallv_bytes
from refmp.distributed.comm import Comm
from refmp.distributed.grid import ProcessGrid
from refmp.nn import gpt
from refmp.nn import moe as M
from refmp.nn.experts import experts_backward, experts_forward, stack_experts, unstack_grads
from refmp.parallel.data.accumulate import allreduce_grads, dp_rows
from refmp.parallel.expert import is_expert
from refmp.parallel.placement import holds
from refmp.training.datasets import ADD_CHARS, AdditionTask, get_batch
from refmp.training.trainer import TrainConfig, Trainer

world = MPI.COMM_WORLD
say = print if world.rank == 0 else (lambda *a, **k: None)
ok = True

task = AdditionTask(digits=3, seed=0, n_train=2000, n_test=8)
ds = task.dataset()
E, K, CF = 4, 2, 1.0
cfg = TrainConfig(n_layer=2, n_head=2, n_embd=16, batch_size=4 * world.size, steps=4, lr=1e-2,
                  warmup_steps=1, grad_clip=1.0, dtype="float64", n_expert=E, top_k=K,
                  moe_every=2, capacity_factor=CF, aux_loss_coef=0.01, z_loss_coef=0.001,
                  progress=False)

# --- Part 1: expert parallelism by hand ----------------------------------------------------
B, T = cfg.batch_size, task.line_len
mcfg = gpt.GPTConfig(vocab_size=ds.vocab_size, block_size=T, n_layer=2, n_head=2, n_embd=16,
                     n_expert=E, top_k=K, moe_every=2, capacity_factor=CF)
full = gpt.init_params(mcfg, seed=0, dtype="float64")  # the whole model, drawn on every rank
x, y = get_batch(ds.tokens, 0, B, T)  # (B, T)
serial = gpt.GPT(mcfg, full)
loss_ref, cache = serial.forward(x, y)  # every expert here (refmp.nn.experts.LocalExperts)
serial.backward(cache)

ep_comm = Comm(world, "ep")
ep, rank = ep_comm.size, ep_comm.rank
# the dense weights (replicated) and experts [r E/ep, (r+1) E/ep) of each MoE layer
model = gpt.GPT(mcfg, {k: v for k, v in full.items()
                       if holds(k, range(mcfg.n_layer), True, True, rank, E, ep)})
rows = dp_rows(B, ep, rank)  # my rows of the batch (ep is carved from dp: here all of it)
El = E // ep  # experts per rank: rank j holds experts [j El, (j+1) El)


class ByHand:
    """Where one MoE layer's experts run (refmp.nn.moe routes and combines; this moves): the
    router hands over xs (M, C), my kept assignments' tokens sorted by expert, and counts (E,)."""

    def forward(self, p, xs, counts):
        counts = np.asarray(counts).reshape(ep, El)  # [j, l]: rows for rank j's expert l
        # all-to-all of the counts: got[s, l] = rows peer s sends to my local expert l
        got = ep_comm.alltoall(counts)  # (ep, El)
        send, recv = counts.sum(axis=1), got.sum(axis=1)  # rows to / from each rank (ep,)
        # all-to-all(v) of the token rows: my rows for rank j's experts go to rank j
        xr = ep_comm.alltoallv(xs, send, recv)  # (R, C): block s from rank s, by my expert
        ids, w = stack_experts(p)  # my El experts, stacked
        ends = np.cumsum([0, *recv])  # rank s's block is xr[ends[s]:ends[s+1]]
        ys, caches = [], []
        for s in range(ep):  # each block is sorted by my local expert: got[s] rows each
            ys_s, cache_s = experts_forward(w, xr[ends[s]:ends[s + 1]], got[s])
            ys.append(ys_s)
            caches.append(cache_s)
        # all-to-all(v) of the results back to the ranks that own the tokens
        out = ep_comm.alltoallv(np.concatenate(ys), recv, send)  # (M, C), in xs's order
        return out, (ids, caches, ends, send, recv)

    def backward(self, dys, cache):
        ids, caches, ends, send, recv = cache
        dyr = ep_comm.alltoallv(dys, send, recv)  # (R, C) the output gradients to the experts
        dxr, g = [], {}
        for s in range(ep):
            dx, gs = experts_backward(dyr[ends[s]:ends[s + 1]], caches[s])
            dxr.append(dx)
            g = {k: g.get(k, 0) + v for k, v in gs.items()}  # summed over the blocks
        dxs = ep_comm.alltoallv(np.concatenate(dxr), recv, send)  # (M, C) back to the tokens
        return dxs, unstack_grads(ids, g)


dispatch = ByHand()
loss, cache = model.forward(x[rows], y[rows], denom=B * T, dispatch=dispatch)  # my share
model.backward(cache)  # each expert's gradient is complete on its one rank
dense = {k: g for k, g in model.grads.items() if not is_expert(k)}
allreduce_grads(dense, ep_comm)  # the dense weights' gradients: the sum of the ranks' shares
err = max(float(np.abs(g - serial.grads[k]).max()) for k, g in model.grads.items())
err = ep_comm.allreduce_scalar(err, op="max")
loss = ep_comm.allreduce_scalar(float(loss))  # the sum of the shares: the serial loss
err = max(err, abs(loss - float(loss_ref)))
say(f"Part 1. by hand: ep = {ep}, rank r holds experts [{E // ep}r, {E // ep}(r+1)); largest "
    f"|loss or gradient - serial| {err:.1e}; all-to-all(v) calls here "
    f"{ep_comm.ledger.count('alltoallv', 'ep')} (4 per MoE layer)\n")
ok &= err < 1e-12

# --- Part 2: routing one sequence ------------------------------------------------------------
ref = Trainer(cfg, grid=ProcessGrid(MPI.COMM_SELF), dataset=ds)  # every rank runs it
T = ref.T
# the engine keeps only the pieces it updates; full_params() is the whole model (on rank 0
# of the trainer's grid: COMM_SELF here, so every rank)
model = gpt.GPT(ref.mcfg, ref.runner.full_params())
x, y = get_batch(ds.tokens, 0, cfg.batch_size, T)  # (B, T)
_, cache = model.forward(x[:1], y[:1])  # one sequence
emb_cache, block_caches, head_cache = cache  # refmp.nn.gpt.GPT.forward's three parts
mc = block_caches[0].mlp  # block 0's MLP is MoE (moe_every = 2: blocks 0, 2, ...): an MoECache
cap = M.capacity(CF, K, T, E)
keep = M.capacity_keep(mc.top.reshape(1, T, K), E, cap)[0]  # (T, K)
say(f"Part 2. One sequence, T = {T} tokens, E = {E} experts, top-{K}, capacity "
    f"ceil({CF} * {K} * {T} / {E}) = {cap} slots per expert (per sequence)\n")
say("   t tok   1st choice (gate)   2nd choice (gate)")
for t in range(T):
    ch = repr(ADD_CHARS[x[0, t]])
    cells = [f"-> e{mc.top[t, k]} ({mc.gates[t, k]:.2f}){'' if keep[t, k] else ' DROP'}"
             for k in range(K)]
    say(f"  {t:2d} {ch:5} " + "".join(f"{c:<20}" for c in cells))
say("\nexpert queues, filled first choices first, then by position (x = dropped):")
for e in range(E):
    seats = [f"t{t}{chr(39) * k}" for k in range(K) for t in range(T) if mc.top[t, k] == e]
    kept = sum(1 for k in range(K) for t in range(T) if mc.top[t, k] == e and keep[t, k])
    shown = [s if i < cap else f"x{s}" for i, s in enumerate(seats)]
    say(f"  e{e}: [{' '.join(shown)}]  {kept}/{cap} slots used")
say("  (t' marks a second choice; a dropped assignment adds 0, the residual carries the token)")

# --- Part 3: the two router losses -----------------------------------------------------------
# The load-balancing loss is counted per sequence (DeepSeek-V3's sequence-wise balance loss,
# Megatron's seq_aux_loss), not over the global batch as in Switch: in a 1F1B pipeline the
# first micro-batch's backward runs before the last micro-batch's forward, so a batch-wide
# f_e is not known yet when its gradient is needed. Per sequence, it depends on nothing else.
st = mc.stats
f = np.bincount(mc.top.reshape(-1), minlength=E) / (K * T)  # (E,) f_be of this sequence
P = mc.probs.mean(axis=0)  # (E,) P_be: its mean router probability
aux = cfg.aux_loss_coef * E * float((f * P).sum())  # one sequence: N_glob = T
x_in, w_router, _ = mc.router  # the router's linear_forward cache: its input and weight
lse = np.log(np.exp(x_in @ w_router).sum(axis=-1))  # (T,) logsumexp of the logits
z = cfg.z_loss_coef * float((lse**2).mean())
say(f"\nPart 3. load-balancing loss, per sequence b (DeepSeek-V3's sequence-wise loss):\n"
    f"        aux = alpha E / N_glob sum_b sum_t sum_e f_be p[b, t, e], f_be = assignments of "
    f"b to e / (K T)\n        this sequence: f_be = {np.round(f, 3).tolist()}, "
    f"aux = {st['aux_loss']:.6f} (by hand {aux:.6f})\n"
    f"        (alpha = {cfg.aux_loss_coef}; balance within each sequence, f_be = P_be = 1/E, "
    f"gives exactly alpha)")
say(f"        router z-loss beta mean(logsumexp^2) = {st['z_loss']:.3e} (by hand {z:.3e}; "
    f"beta = {cfg.z_loss_coef}; keeps the logits small)")
ok &= abs(aux - st["aux_loss"]) <= 1e-12 and abs(z - st["z_loss"]) <= 1e-12

# --- Part 4: the same through the engine, against the serial run ----------------------------
par = Trainer(TrainConfig(**{**cfg.__dict__, "ep": ep}), grid=ProcessGrid(world, ep=ep),
              dataset=ds)
grid = par.grid
dp, dp_rank = grid.sizes["dp"], grid.coords["dp"]
say(f"\nPart 4. {dp} data-parallel ranks, experts sharded over ep = {ep}: rank r holds "
    f"experts [{E // ep}r, {E // ep}(r+1)) of each MoE layer")
owner = np.empty(cfg.batch_size, dtype=int)
for r in range(dp):
    owner[dp_rows(cfg.batch_size, dp, r)] = r
want = 0
for step in range(cfg.steps):
    # what this step's routing implies for my all-to-all bytes (from the serial model, on the
    # weights this step starts from)
    xs, ys = get_batch(ds.tokens, step, cfg.batch_size, T)
    _, c = gpt.GPT(ref.mcfg, ref.runner.full_params()).forward(xs, ys)
    for b in c[1]:
        if isinstance(b[-1], M.MoECache):
            order = b[-1].order
            want += alltoallv_bytes(owner[order // K // T], b[-1].top.reshape(-1)[order],
                                    dp_rank, ep, E, cfg.n_embd, 8)
    a, b = ref.step(), par.step()
    say(f"step {step}: expert-parallel loss {b['loss']:.10f}   serial loss {a['loss']:.10f}   "
        f"tokens per expert {b['moe']['tokens_per_expert'][0]}")
    ok &= abs(a["loss"] - b["loss"]) <= 1e-9 * abs(a["loss"])
full, ref = par.runner.full_params(), ref.runner.full_params()  # collective; rank 0's
worst = 0.0 if full is None else max(float(np.abs(v - ref[k]).max()) for k, v in full.items())
got = grid.ledger.bytes("alltoallv", "ep")
rows = world.gather((dp_rank, got, want, grid.ledger.count("alltoallv", "ep")))
say("\nall-to-all(v) bytes sent per rank: measured (ledger) vs 2 (M + R) C 8 from the routing")
for r, g, w, n in rows or []:
    say(f"  rank {r}: {g:>8,} B measured   {w:>8,} B formula   ({n} calls)")
ok &= got == want and worst < 1e-10
ok = world.allreduce(int(ok), op=MPI.MIN) == 1
say(f"largest weight difference from the serial run after {cfg.steps} AdamW steps: "
    f"{world.allreduce(worst, op=MPI.MAX):.2e}")
say("OK: expert parallel == serial" if ok else "FAILED: expert parallel != serial")
sys.exit(0 if ok else 1)
