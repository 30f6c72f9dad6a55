"""The Engine: one runner for every layout, pp x dp x cp x tp with experts, ZeRO 0-3 and SP.

Shapes: B global batch, b = B/dp rows per pipeline, M micro-batches, T sequence, Tl = T/cp
tokens per rank; pp, dp, cp, tp, ep group sizes, S = pp v chunks (v virtual stages).

The Engine composes orthogonal pieces; none of them knows the others' axes:

* **ops** (refmp.parallel.ops): the block's linears, attention core and ends, split over tp
  (with SP) and cp; the MoE MLP gets its dispatch (local, or all-to-all over ep) and the
  ranks its sequences are split over from the MoEContext made here;
* **placement** (refmp.parallel.placement): which slice of each full parameter this rank
  holds, which group sums its gradient, who counts it once in the norm;
* **sharder** (refmp.parallel.data.sharder): DP / ZeRO 0-3 over the local units, dense ones over
  grid.group("dp", "cp"), expert ones over edp;
* **pipeline** (refmp.parallel.pipeline): this rank's chunks (Stage), the schedule's action
  list and the executor. pp = 1 is a one-stage pipeline: its schedule is gradient
  accumulation over the M micro-batches.

One step: take this rank's rows (dp) and tokens (cp), run the schedule (each action runs the
stage's chunk through the ops, gathering / reducing unit by unit through the sharder), then
``reduce_grads``: the sharder's sums over dp x cp and edp, SP's sum over tp of the weights
every tp rank saw a part of, and the tied wte's sum between the pipeline's two ends.
"""

from __future__ import annotations

import math

import numpy as np
from mpi4py import MPI

from refmp.distributed.comm import Comm
from refmp.distributed.waiting import wait
from refmp.nn import gpt
from refmp.parallel.context.chunks import ChunkLayout
from refmp.parallel.context.ring import RingAttention
from refmp.parallel.context.ulysses import UlyssesAttention
from refmp.parallel.data.accumulate import (
    activation_bytes,
    dp_rows,
    flatten,
    split_microbatches,
    unflatten_into,
)
from refmp.parallel.data.sharder import Sharder
from refmp.parallel.expert import ExpertDispatch, SequenceSplit
from refmp.parallel.ops import ParallelOps
from refmp.parallel.pipeline.executor import Executor
from refmp.parallel.pipeline.partition import parse_stage_layers, partition, piece_costs
from refmp.parallel.pipeline.schedules import schedule
from refmp.parallel.pipeline.stage import Stage
from refmp.parallel.pipeline.timeline import Timeline
from refmp.parallel.placement import (
    gather_experts,
    gather_tp,
    holds,
    place,
    stage_chunks,
    tp_shard,
    unit_of,
)
from refmp.runtime import backend
from refmp.runtime.precision import mixed_dtypes

TIED_TAG = 32767  # MPI guarantees tags up to 32767; the executor's stay below (2 m S)


class Engine:
    """The runner (refmp.training.trainer.Runner) for any layout: ``model`` holds the full initial
    weights (layout-independent), which the engine slices and then frees."""

    def __init__(self, model: gpt.GPT, grid, cfg):
        mc, s = model.cfg, grid.sizes
        self.mcfg, self.grid, self.cfg = mc, grid, cfg
        self.tp, self.pp, self.ep = grid.comm["tp"], grid.comm["pp"], grid.comm["ep"]
        self.sp, self.M = cfg.sequence_parallel, cfg.microbatches
        T = cfg.block_size or mc.block_size
        # context parallelism: my tokens of every sequence, and the attention core over cp
        attn, self.positions, held = None, None, [np.arange(T)]
        keep = cfg.recompute == "none"  # selective / full: the softmax is not kept
        if s["cp"] > 1:
            layout = ChunkLayout(T, s["cp"], cfg.cp_balance)
            attn = (RingAttention(grid.comm["cp"], layout) if cfg.cp_algo == "ring"
                    else UlyssesAttention(grid.comm["cp"], layout, keep))
            held = [layout.positions(r) for r in range(s["cp"])]
            self.positions = backend.from_host(held[grid.coords["cp"]])  # (Tl,)
        self.ops = ParallelOps(mc.n_head, mc.vocab_size, self.tp, self.sp, attn, self.positions,
                               keep)
        # pipeline: the chunks of this rank (chunk c on pp rank c % pp)
        P, V = s["pp"], cfg.virtual_stages
        self.S, r = P * V, self.pp.rank
        blocks = partition(mc.n_layer, self.S, piece_costs(mc.n_embd, T, mc.vocab_size),
                           parse_stage_layers(cfg.stage_layers))
        chunks = {c: blocks[c] for c in stage_chunks(r, P, V)}
        self.first, self.last = 0 in chunks, self.S - 1 in chunks
        my_blocks = {i for c in chunks.values() for i in c}
        names = [k for k in model.params if holds(k, my_blocks, self.first, self.last,
                                                   self.ep.rank, mc.n_expert, s["ep"])]
        local = {k: tp_shard(k, model.params[k], self.tp.rank, self.tp.size) for k in names}
        model.params, model.grads = {}, {}  # the full weights are not kept
        # the sharder: units, each over the group its gradient is summed over
        dense, edp = grid.group("dp", "cp"), grid.comm["edp"]
        units: dict[str, list[str]] = {}
        for k in local:
            units.setdefault(unit_of(k), []).append(k)
        groups = {u: edp if u.endswith(".experts") else dense for u in units}
        compute, gdtype = mixed_dtypes(cfg)  # None, None without --mixed-precision
        self.sharder = Sharder(local, units, groups, cfg.zero, cfg.bucket_mb, compute, gdtype)
        # experts: where they run, and the ranks a sequence is split over (its MoE rules)
        self.dispatch = ExpertDispatch(self.ep, mc.n_expert, compute) if s["ep"] > 1 else None
        seq = None
        if s["cp"] > 1 or self.sp:
            n = self.tp.size if self.sp else 1  # with SP each cp part is split again over tp
            parts = [h[j * (len(h) // n) : (j + 1) * (len(h) // n)] for h in held for j in range(n)]
            seq = SequenceSplit(grid.group("cp", "tp") if self.sp else grid.comm["cp"], parts)
        moe = None
        if mc.n_expert:
            def moe(denom):
                return mc.moe_context(denom, self.dispatch, seq if denom is not None else None)
        self.stage = Stage(chunks, self.S, mc, self.ops, self.sharder, moe,
                           self.tp.size if self.sp else 1, cfg.recompute == "full")
        self.exe = Executor(self.stage, self.pp, self.sharder.compute)  # activations' dtype
        self.actions = schedule(cfg.schedule, P, self.M, r, V)
        self.schedule_name, self.v = cfg.schedule, V
        # clipping: a piece counts on the one rank of its copies (placement's "copies" axes
        # minus those the sharder partitions; the tied wte only on the first stage)
        coords = {**grid.coords, "edp": grid.comm["edp"].rank}
        zero_axes = {"dp", "cp", "edp"} if cfg.zero else set()
        self.sp_partial = {k for k in self.sharder.params
                           if k in local and "tp" in place(k, self.sp).reduce}
        self.counts_in_norm = {}
        for k in self.sharder.params:
            full = k.rsplit(".padding", 1)[0] if k.endswith(".padding") else k
            copies = () if full not in local else place(full, self.sp).copies
            self.counts_in_norm[k] = (all(coords[a] == 0 for a in copies if a not in zero_axes)
                                      and not (k == "wte.weight" and self.last and not self.first))
        # evaluation: the ranks that may decode different prompts (ep peers and, with ZeRO-3,
        # every rank of a gather group must run the same forwards)
        self.eval_comm = (Comm(MPI.COMM_SELF, "self", grid.ledger) if cfg.zero == 3
                          else edp if s["ep"] > 1 else dense)
        self.peak_activations, self._loss = 0, (0.0, 0.0)
        self._scale, self._master = 1.0, None  # mixed precision: loss scale, fp32 grad pieces
        self.exe.on_forward = self._measure

    # --- what the optimizer and the trainer see ---------------------------------------------

    @property
    def params(self) -> dict:
        return self.sharder.params  # the owned pieces of this rank's local parameters

    @property
    def grads(self) -> dict:
        """The owned gradient pieces (mixed precision: fp32 and unscaled after reduce_grads)."""
        return self._master if self._master is not None else self.sharder.grads

    @property
    def decay(self) -> set[str]:
        return self.sharder.decay

    def batch_rows(self, B: int) -> slice:
        dp = self.grid.comm["dp"]
        return dp_rows(B, dp.size, dp.rank)

    def zero_grad(self) -> None:
        self.sharder.zero_grad()
        self.stage.reset_stats()

    def forward_backward(self, x, y, denom: int, dloss: float = 1.0) -> None:
        """This rank's rows x, y (b, T): its tokens (cp), M micro-batches, the schedule.
        ``dloss``: the loss scale (fp16), the gradient backward starts from."""
        self._scale, self._master = dloss, None
        if self.positions is not None:
            x, y = x[:, self.positions], y[:, self.positions]  # (b, Tl) my tokens
        xs, ys = zip(*split_microbatches(x, y, self.M), strict=True)
        ce = self.exe.step(self.actions, list(xs), list(ys), denom, dloss)
        self._loss = (ce, self.stage.aux)

    def _measure(self, caches: dict) -> None:
        """After a forward: the live caches' bytes (the peak is the memory report's)."""
        keep = list(self.sharder.pbuf.values()) if self.sharder.stage < 3 else []
        self.peak_activations = max(self.peak_activations, activation_bytes(caches, keep))

    def reduce_grads(self) -> None:
        """Every owned piece becomes the global gradient (the module docstring, last paragraph)."""
        sh = self.sharder
        sh.finish()  # dense over dp x cp, experts over edp
        if self.sp:  # SP: weights every tp rank saw T/tp of have gradients partial over tp
            arrays = [g for k, g in self.grads.items() if k in self.sp_partial]
            if arrays:
                flat = flatten(arrays)
                self.tp.allreduce(flat)
                unflatten_into(flat, arrays)
        if self.pp.size > 1 and (self.first or self.last) and "wte" in sh.units:
            mine = sh.owned_grad("wte")  # the two ends hold wte with the same flat layout
            other = self.pp.size - 1 if self.first else 0
            req = self.pp.send(mine, other, tag=TIED_TAG)
            theirs = self.pp.recv(mine.shape, mine.dtype, other, tag=TIED_TAG)
            wait(req)
            mine += theirs  # a + b == b + a exactly: both ends hold the same sum
        if sh.mixed:  # fp32 and unscaled for the norm, clipping and the optimizer
            self._master = sh.master_grads(self._scale)

    def grad_norm(self) -> float:
        """The global L2 norm: each element counted once over the whole world."""
        # on the device, in float64, in Python's order (a CPU's bits): one read, not one a piece
        local = sum(((g * g).sum().astype(np.float64) for k, g in self.grads.items()
                     if self.counts_in_norm[k]), 0.0)
        return math.sqrt(self.grid.world.allreduce_scalar(float(local)))

    def after_step(self) -> None:
        self.sharder.after_step()  # ZeRO 1/2: all-gather the updated slices

    def loss_total(self) -> float:
        """The step's global loss: cross-entropy shares (whole on every tp rank) and MoE
        shares (partial over tp with SP) summed once each, over the whole world."""
        ce, aux = self._loss
        tp0 = self.tp.rank == 0
        parts = [ce if tp0 else 0.0, aux if (tp0 or self.sp) else 0.0]
        return float(self.grid.world.allreduce_metrics(parts).sum())

    @property
    def stats(self) -> dict:
        """MoE routing figures of the step, summed over every rank that saw other tokens."""
        if not self.mcfg.n_expert:
            return {}
        E, L = self.mcfg.n_expert, self.mcfg.n_layer
        raw = np.zeros((L, 2 * E + 2))
        for i, r in self.stage.moe_raw.items():
            raw[i] = r
        if self.tp.rank != 0 and not self.sp:
            raw[:] = 0  # tp ranks routed the same tokens: count them once
        raw = self.grid.world.allreduce_metrics(raw)
        return gpt.moe_summary([raw[i] for i in range(L) if self.mcfg.is_moe(i)], E)

    # --- decoding and the whole model ---------------------------------------------------------

    def generate(self, idx, n: int):
        """Greedy decoding through the pipeline (collective over pp, tp, ep): the last stage
        picks the token and broadcasts it, every stage appends it. Whole prompts: serial
        attention, no SP; ZeRO-3 gathers the weights once for the call."""
        sh, xp, P = self.sharder, backend.array_module(idx), self.pp.size
        full = {u: sh.weights(u) for u in sh.units}  # views, or gathered (stage 3)
        ops, T = self.ops.for_decoding(), self.mcfg.block_size
        for _ in range(n):
            ctx = idx[:, -T:]  # (B, t)
            shape = (ctx.shape[0], ctx.shape[1], self.mcfg.n_embd)
            x, reqs = None, []
            for c in sorted(self.stage.chunks):
                x = ctx if c == 0 else self.pp.recv(shape, self.exe.dtype, (c - 1) % P, tag=c)
                x, _ = self.stage.forward(c, x, ops=ops, weights=full.__getitem__)
                if c < self.S - 1:
                    reqs.append(self.pp.send(x, (c + 1) % P, tag=c + 1))
            nxt = xp.empty((ctx.shape[0],), dtype=idx.dtype)  # (B,)
            if self.last:
                nxt[...] = ops.next_token(xp.ascontiguousarray(x[:, -1, :]))
            self.pp.bcast(nxt, root=P - 1)
            for req in reqs:
                wait(req)
            idx = xp.concatenate([idx, nxt[:, None]], axis=1)
        return idx

    def piece_index(self) -> dict:
        """For every owned piece (``params``' names): the global flat index of each of its
        elements in its full GPT-2 parameter, -1 for padding. What a sharded checkpoint
        stores beside the values, so that any other layout can find its own elements."""
        shapes, index = gpt.param_shapes(self.mcfg), {}
        for U in self.sharder.units.values():
            for k in U.shapes:
                whole = np.arange(math.prod(shapes[k]), dtype=np.int64).reshape(shapes[k]) + 1
                index[k] = tp_shard(k, whole, self.tp.rank, self.tp.size) - 1  # vocab pad: -1
        return self.sharder.owned_index(index)

    def full_params(self) -> dict | None:
        """The whole model, GPT-2 names, on world rank 0 (collective): gathered over the
        ZeRO groups, then tp, then ep; then each stage sends its part to the first."""
        return self._whole(self.sharder.full_local())

    def full_grads(self) -> dict | None:
        """The whole gradient of the last step (after clipping), like full_params: what a
        test compares with the serial model's, element by element."""
        return self._whole(self.sharder.full_local(grads=True))

    def _whole(self, local: dict) -> dict | None:
        local = gather_tp(local, self.tp, self.mcfg.vocab_size)
        if self.mcfg.n_expert and self.ep.size > 1:
            local = gather_experts(local, self.ep, self.mcfg.n_expert)
        c = self.grid.coords
        if c["dp"] or c["cp"] or c["tp"]:
            return None
        mine = sorted(k for k in local if not (k == "wte.weight" and not self.first))
        owners = self.pp.allgather_obj(mine)
        if not self.first:
            for req in [self.pp.send(local[k], 0, tag=j) for j, k in enumerate(mine)]:
                wait(req)
            return None
        shapes = gpt.param_shapes(self.mcfg)
        for s in range(1, self.pp.size):
            for j, k in enumerate(owners[s]):
                local[k] = self.pp.recv(shapes[k], self.sharder.dtype, s, tag=j)
        return {k: local[k] for k in shapes}

    def timeline(self) -> Timeline:
        """The last step's measured timeline of this pipeline, gathered over pp (collective)."""
        events = [e for evs in self.pp.allgather_obj(self.exe.events) for e in evs]
        peaks = self.pp.allgather_obj(self.exe.peak_held)
        return Timeline(self.schedule_name, self.pp.size, self.M, self.v, events, "s", peaks)

    def memory(self) -> dict[str, int]:
        """Bytes of the parameter (compute copy), gradient and fp32 master buffers kept, and
        the peak live activations."""
        return {**self.sharder.memory(), "activations": self.peak_activations}
