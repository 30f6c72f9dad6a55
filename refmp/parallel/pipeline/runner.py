"""Pipeline parallelism (--pp): the runner the Trainer drives (interface: parallel/data.py).

Shapes: B global batch, b = B/dp rows per pipeline, m micro-batches, T time, C channels,
V vocabulary; pp stages, v virtual stages, S = pp v chunks.

Each pipeline rank holds the blocks of its chunks (partition.py): rank 0 also wte and wpe,
rank pp-1 also ln_f and wte (the head is tied to wte, so both ends hold it). A step splits
this pipeline's b rows into m micro-batches and runs the schedule's actions (schedules.py)
with the executor (executor.py). Each micro-batch's loss is a share of the global mean (its
tokens' loss sum / (B T)), so the gradients summed over micro-batches, then over dp, are
exactly the serial gradient (GPipe, Huang et al. 2019, sec. 2.2: synchronous updates).

Communication per step, besides the activations and gradients the executor moves:
  * tied wte: ranks 0 and pp-1 swap their wte gradients (V, C) and add them, so both hold
    d(loss)/d(wte) = head share + embedding share, and update wte identically (send/recv@pp);
  * data parallelism: one all-reduce of this rank's gradients over dp (parallel/data.py).

With --tp (tp x pp) every stage is tensor parallel (pieces.TensorPieces): its parameters are
tp shards as in tensor_runner.py (wte split by vocabulary rows, Vp/tp each, on both ends), and
its blocks, embedding and head communicate over tp inside each pass. grid.comm["pp"] joins
the stages of one tp coordinate, so the tied swap above moves each end's (Vp/tp, C) shard to
its peer of the same shard. With SP, the replicated parameters' gradients are partial over tp
(each rank saw T/tp positions): one all-reduce over tp sums them, as in tensor_runner.py.
"""

from __future__ import annotations

import numpy as np

from refmp import backend
from refmp.comm import wait
from refmp.data import dp_rows
from refmp.nn import gpt
from refmp.parallel.data import allreduce_grads, flatten, unflatten_into
from refmp.parallel.pipeline.executor import Executor
from refmp.parallel.pipeline.partition import (
    check_pipeline,
    parse_stage_layers,
    partition,
    piece_costs,
)
from refmp.parallel.pipeline.pieces import SerialPieces, TensorPieces
from refmp.parallel.pipeline.schedules import schedule
from refmp.parallel.pipeline.stage import Stage
from refmp.parallel.pipeline.timeline import Timeline
from refmp.parallel.tensor_runner import check_tensor_parallel, gather_shards, shard, split_of
from refmp.parallel.vocab import padded_vocab

WTE = "wte.weight"
TIED_TAG = 32767  # MPI guarantees tags up to 32767; the executor's stay below (2 m S)


class PipelineParallel:
    """Pipeline parallelism over grid.comm["pp"], data parallelism over grid.comm["dp"],
    and tensor parallelism (optionally sequence parallel) inside each stage over grid.comm["tp"]."""

    def __init__(self, model: gpt.GPT, grid, cfg):
        m = model.cfg
        self.pp, self.dp, self.grid, self.cfg = grid.comm["pp"], grid.comm["dp"], grid, m
        self.tp, self.sp = grid.comm["tp"], cfg.sequence_parallel
        self.eval_comm = self.dp  # the pp (and tp) ranks of one pipeline decode the same prompts
        P, V, M = self.pp.size, cfg.virtual_stages, cfg.microbatches
        self.m, self.v, self.name = M, V, cfg.schedule
        split = parse_stage_layers(cfg.stage_layers)
        check_pipeline(m.n_layer, P, M, cfg.schedule, V, split, cfg.batch_size // grid.dp)
        check_tensor_parallel(m.n_head, self.tp.size, cfg.block_size or m.block_size, self.sp)
        self.S = P * V
        blocks = partition(m.n_layer, self.S, piece_costs(m.n_embd, m.block_size, m.vocab_size),
                           split)
        r = self.pp.rank
        self.first, self.last = r == 0, r == P - 1
        chunks = {c: blocks[c] for c in range(r, self.S, P)}  # chunk c lives on rank c % pp
        names = [k for c in chunks for i in chunks[c] for k in model.params
                 if k.startswith(f"h.{i}.")]
        if self.first:
            names += [WTE, "wpe.weight"]
        if self.last:
            names += ["ln_f.weight", "ln_f.bias", WTE]  # the head is tied to wte: a copy
        self.blocks = blocks  # every chunk's block indices (chunk c on rank c % pp)
        n, Vp = self.tp.size, padded_vocab(m.vocab_size, self.tp.size)
        params = {k: model.params[k] for k in names}
        pieces, self.decode = SerialPieces(), SerialPieces()
        if n > 1 or self.sp:  # tp x pp: this rank's tp shard of its stage's parameters
            params = {k: shard(k, v, self.tp.rank, n, Vp) for k, v in params.items()}
            pieces = TensorPieces(self.tp, m.vocab_size, self.sp)
            self.decode = TensorPieces(self.tp, m.vocab_size)  # prompts of any length: no SP
        self.replicated = [k for k in params if split_of(k) is None]  # same on every tp rank
        self.stage = Stage(params, chunks, self.S, m.n_head, pieces)
        self.exe = Executor(self.stage, self.pp, m.n_embd, model.params[WTE].dtype)
        self.actions = schedule(cfg.schedule, P, M, r, V)
        self.reduce_dp = True  # False under ZeRO (zero_compose.py): it reduce-scatters over dp

    @property
    def params(self) -> dict:
        return self.stage.params

    @property
    def grads(self) -> dict:
        return self.stage.grads

    def batch_rows(self, B: int) -> slice:
        return dp_rows(B, self.dp.size, self.dp.rank)

    def zero_grad(self) -> None:
        self.stage.zero_grad()

    def forward_backward(self, x, y, denom: int) -> float:
        rows = np.array_split(np.arange(x.shape[0]), self.m)  # m micro-batches of ~b/m rows
        xs = [x[r[0] : r[-1] + 1] for r in rows]  # (b_i, T) each
        ys = [y[r[0] : r[-1] + 1] for r in rows]
        return self.exe.step(self.actions, xs, ys, denom)

    def reduce_grads(self) -> None:
        if self.first or self.last:  # tied wte: the two ends add each other's share
            other = self.pp.size - 1 if self.first else 0
            mine = self.grads[WTE]
            req = self.pp.send(mine, other, tag=TIED_TAG)
            theirs = self.pp.recv(mine.shape, mine.dtype, other, tag=TIED_TAG)
            wait(req)
            mine += theirs  # a + b == b + a exactly: both ends hold the same sum
        if self.sp and self.tp.size > 1:  # SP: replicated gradients are partial over tp
            arrays = [self.grads[k] for k in self.replicated]
            flat = flatten(arrays)  # (replicated parameters of this stage,)
            self.tp.allreduce(flat)
            unflatten_into(flat, arrays)
        if self.reduce_dp:  # (ZeRO over this runner reduce-scatters over dp instead)
            allreduce_grads(self.grads, self.dp)  # sum over dp: now the global gradient

    def grad_sum_sq(self, local: float, grads: dict | None = None) -> float:
        """Sum the stages' squares over pp; wte counts once (not again on the last stage).

        ``grads``: what ``local`` summed (default: this rank's; ZeRO: its dp shard's pieces).
        With tp: shards' squares summed over tp, replicated ones (the same on every tp rank)
        counted once; ``local`` mixes the two, so the split is recomputed here (ZeRO over
        tp x pp is refused, so ``grads`` is this rank's whole stage then).
        """
        grads = self.grads if grads is None else grads
        if self.tp.size > 1:
            sq = {k: float((g * g).sum()) for k, g in grads.items()}
            sharded = sum(v for k, v in sq.items()
                          if split_of(k) and not (self.last and k == WTE))
            local = self.tp.allreduce_scalar(sharded) + sum(sq[k] for k in self.replicated)
        elif self.last and WTE in grads:
            g = grads[WTE]
            local -= float((g * g).sum())
        return self.pp.allreduce_scalar(local)  # dp ranks hold replicas: not summed

    def loss_total(self, share: float) -> float:
        return self.dp.allreduce_scalar(self.pp.allreduce_scalar(share))  # only the last stage's

    def timeline(self) -> Timeline:
        """The last step's measured timeline of this pipeline, gathered over pp (collective)."""
        events = [e for evs in self.pp.allgather_obj(self.exe.events) for e in evs]
        peaks = self.pp.allgather_obj(self.exe.peak_held)
        return Timeline(self.name, self.pp.size, self.m, self.v, events, "s", peaks)

    def generate(self, idx, n: int):
        """Greedy decoding through the pipeline (collective over pp): the last stage picks the
        token and broadcasts it, every stage appends it."""
        xp, P, T = backend.array_module(idx), self.pp.size, self.cfg.block_size
        for _ in range(n):
            ctx = idx[:, -T:]  # (B, t)
            shape = (ctx.shape[0], ctx.shape[1], self.cfg.n_embd)
            x, reqs = None, []
            for c in sorted(self.stage.chunks):
                x = ctx if c == 0 else self.pp.recv(shape, self.exe.dtype, (c - 1) % P, tag=c)
                x, _ = self.stage.forward(c, x, pieces=self.decode)  # (B, t, C); at the end
                if c < self.S - 1:  # logits (B, t, V), or (B, t, Vp/tp) with tp
                    reqs.append((self.pp.send(x, (c + 1) % P, tag=c + 1), x))
            nxt = xp.empty((ctx.shape[0],), dtype=idx.dtype)  # (B,)
            if self.last:
                nxt[...] = self.decode.next_token(x[:, -1, :])  # with tp: all-gather over tp
            self.pp.bcast(nxt, root=P - 1)
            for req, _ in reqs:
                wait(req)
            idx = xp.concatenate([idx, nxt[:, None]], axis=1)
        return idx

    def full_params(self) -> dict | None:
        """The whole model on world rank 0 (pp 0, dp 0, tp 0): each stage gathers its tp
        shards (unpadded), then the other stages send their params to the first."""
        if self.dp.rank != 0:
            return None
        params = self.params
        if self.tp.size > 1 or self.sp:
            params = gather_shards(params, self.tp, self.cfg.vocab_size)  # collective over tp
            if self.tp.rank != 0:
                return None
        mine = sorted(k for k in params if not (self.last and k == WTE and not self.first))
        owners = self.pp.allgather_obj(mine)
        if not self.first:
            reqs = [(self.pp.send(params[k], 0, tag=j), None) for j, k in enumerate(mine)]
            for req, _ in reqs:
                wait(req)
            return None
        full, shapes = dict(params), gpt.param_shapes(self.cfg)
        for s in range(1, self.pp.size):
            for j, k in enumerate(owners[s]):
                full[k] = self.pp.recv(shapes[k], self.exe.dtype, s, tag=j)
        return {k: full[k] for k in gpt.param_shapes(self.cfg)}
