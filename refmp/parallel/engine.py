"""The Engine: one runner for every layout, pp x dp x cp x tp with experts, ZeRO 0-3 and SP.

Shapes: B global batch, b = B/dp rows per pipeline, M micro-batches, T sequence, Tl = T/cp tokens
per rank; pp, dp, cp, tp, ep; n_chunks = pp v chunks (v virtual stages); n prompts of length t.

The Engine composes orthogonal pieces, none of which knows the others' axes, built in named
steps below (docs/architecture.md): the cp core, the rank's chunks, its parameters, the
Sharder's units and groups, the MoE context, the Stage and Executor, the norm's counts.

One step: take this rank's rows (dp) and tokens (cp), run the schedule (each action runs the
stage's chunk through the ops, gathering / reducing unit by unit through the sharder), then
``reduce_grads``: the sharder's sums over dp x cp and edp, SP's sum over tp of the weights
every tp rank saw a part of, and the tied wte's sum between the pipeline's two ends.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import numpy as np

from refmp.config import ParallelConfig
from refmp.distributed.waiting import wait
from refmp.nn import gpt
from refmp.nn.routing import moe_summary
from refmp.nn.slices import positions
from refmp.parallel.context.chunks import SequenceChunks
from refmp.parallel.context.hybrid import HybridAttention, split_cp
from refmp.parallel.data import hpz
from refmp.parallel.data.accumulate import (
    dp_rows,
    flatten,
    split_microbatches,
    unflatten_into,
)
from refmp.parallel.data.compress import make_codecs
from refmp.parallel.data.hierarchical import HierarchicalComm, check_nodes
from refmp.parallel.data.hsdp import shard_groups
from refmp.parallel.data.sharder import Sharder
from refmp.parallel.expert import SequenceSplit
from refmp.parallel.family import family_of
from refmp.parallel.folding import dispatch_for
from refmp.parallel.fp8 import apply_fp8
from refmp.parallel.pipeline.asynchronous import ASYNC_EXECUTORS
from refmp.parallel.pipeline.catalog import CATALOG, Schedule
from refmp.parallel.pipeline.executor import Executor
from refmp.parallel.pipeline.partition import rank_chunks
from refmp.parallel.pipeline.schedules import ChunkPlacement
from refmp.parallel.pipeline.stage import Stage
from refmp.parallel.pipeline.timeline import Timeline
from refmp.parallel.placement import (
    ShardReader,
    counts_in_norm,
    gather_etp,
    gather_experts,
    units_of,
)
from refmp.runtime import backend
from refmp.runtime.arrays import activation_bytes, global_grad_norm
from refmp.runtime.precision import mixed_dtypes

TIED_TAG = 32767  # MPI guarantees tags up to 32767; the executor's are below 2 x chunks


# --- the build steps -------------------------------------------------------------------------


def context_parallel(grid, layout: ParallelConfig, T: int, keep_scores: bool, family):
    """(the attention core over cp for the ``family``'s block, or None; the global positions
    (Tl,) of each cp rank's tokens, in cp rank order). Without cp: no core, and one rank
    holding 0..T-1."""
    cp = grid.sizes["cp"]
    if cp == 1:
        return None, [np.arange(T)]
    chunks = SequenceChunks(T, cp, layout.cp_balance)
    if layout.cp_ulysses > 1:  # hierarchical: Ulysses in groups, the ring across them
        attn = HybridAttention(*split_cp(grid.comm["cp"], layout.cp_ulysses, grid.nodes), chunks)
    else:
        attn = (family.ring(grid.comm["cp"], chunks) if layout.cp_algo == "ring"
                else family.ulysses(grid.comm["cp"], chunks, keep_scores))
    return attn, [chunks.positions(r) for r in range(cp)]


def build_sharder(local: ShardReader, grid, layout: ParallelConfig, seed: int,
                  family) -> Sharder:
    """The Sharder over ``local``: its units (placement.units_of), each over the group
    its gradient is summed over (placement's "reduce": dp x cp, or edp for experts), each
    read from the source as it is built."""
    dense, edp = grid.group("dp", "cp"), grid.comm["edp"]
    if layout.dp_reduce == "hierarchical":  # sums inside each node first (data/hierarchical.py)
        check_nodes(grid.sizes, grid.nodes, ("dp", "cp"))
        dense = HierarchicalComm(dense, grid.nodes)
    units = units_of(local.shapes)
    groups = {u: edp if "edp" in family.place(names[0], False).reduce else dense
              for u, names in units.items()}
    compute, grad_dtype = mixed_dtypes(layout)  # None, None without --mixed-precision
    codec, gather = make_codecs(layout, seed)
    secondary = {}  # hpZ: the dense units' gathers inside blocks of --hpz-size ranks
    if layout.hpz_size > 1:
        pair = hpz.blocks(dense, layout.hpz_size, grid.nodes)
        secondary = {u: pair for u, g in groups.items() if g is dense}
    replicas = {}  # HSDP: the dense units sharded over --dp-shard x cp ranks, replicated across
    if layout.dp_shard not in (0, grid.sizes["dp"]):
        shard, across = shard_groups(dense, layout.dp_shard * grid.sizes["cp"], grid.nodes)
        replicas = {u: across for u, g in groups.items() if g is dense}
        groups = {u: shard if g is dense else g for u, g in groups.items()}
    return Sharder(local, units, groups, layout.zero, bucket_mb=layout.bucket_mb,
                   compute=compute, grad_dtype=grad_dtype, codec=codec, gather=gather,
                   hpz=secondary, replicas=replicas)


def moe_context(mcfg: gpt.GPTConfig, grid, sp: bool, compute, cp_positions: list, experts=None):
    """``moe(denom)``, the MoEContext of one forward (None for a dense model): the family's
    ``experts``' dispatch (all-to-all over ep, or local) and, when a sequence is split over
    cp (and over tp with SP), the ranks its MoE rules gather over (SequenceSplit)."""
    if not mcfg.n_expert:
        return None
    tp = grid.comm["tp"]
    dispatch = dispatch_for(grid, mcfg.n_expert, sp, compute, experts)  # folding's, or ep's
    seq = None
    if grid.sizes["cp"] > 1 or sp:
        n = tp.size if sp else 1  # with SP each cp part is split again over tp
        parts = [pos[j * (len(pos) // n) : (j + 1) * (len(pos) // n)]
                 for pos in cp_positions for j in range(n)]
        seq = SequenceSplit(grid.group("cp", "tp") if sp else grid.comm["cp"], parts)

    def moe(denom):
        return mcfg.moe_context(denom, dispatch, seq if denom is not None else None)
    return moe


def build_executor(sched: Schedule, stage: Stage, pp, dtype, measure,
                   placed: ChunkPlacement) -> Executor:
    """The synchronous executor for a flush schedule, or 2bw's / pipedream's
    (refmp.parallel.pipeline.asynchronous); ``dtype``: the activations'."""
    make = Executor if sched.flushes else ASYNC_EXECUTORS[sched.name]
    return make(stage, pp, dtype, on_forward=measure, placed=placed)


class Engine:
    """The runner (refmp.training.trainer.Runner) for any layout: ``mcfg`` the model's shape
    (GPT-2 or Llama: ``family``, refmp.parallel.family, says what differs), ``source`` its
    initial weights (refmp.checkpoint.source: a fresh init, a file), of which each rank
    reads only its share, in ``dtype``; ``layout`` how the ranks split the work; ``T`` the
    block size the run trains on; ``seed`` the run's."""

    def __init__(self, mcfg: gpt.GPTConfig, source, grid, layout: ParallelConfig, T: int,
                 seed: int = 0, dtype="float32"):
        mc = self.mcfg = mcfg
        fam = self.family = family_of(mcfg, grid.folded)
        self.grid = grid
        self.tp = grid.comm["tp"]
        self.pp = grid.comm["pp"]
        self.ep = grid.comm["ep"]
        self.etp = grid.comm["etp"]  # this rank alone without folding
        self.sp = layout.sequence_parallel
        self.microbatches = layout.microbatches
        keep_scores = layout.recompute == "none"  # selective / full: the softmax is not kept
        attn, cp_positions = context_parallel(grid, layout, T, keep_scores, fam)
        self.positions = (None if attn is None  # (Tl,) the global positions of my tokens
                          else backend.from_host(cp_positions[grid.coords["cp"]]))
        self.ops = fam.ops(self.tp, self.sp, attn, self.positions, keep_scores)
        self.schedule = CATALOG[layout.schedule]
        placed = self.schedule.chunk_placement(self.pp.size, layout.virtual_stages)
        self.placed = placed  # where each chunk runs: the Decoder of evaluation splits as this
        self.stage_layers = layout.stage_layers
        self.v = placed.v  # chunks per rank
        self.n_chunks = self.pp.size * self.v
        chunks = rank_chunks(mc, T, self.pp.rank, placed, layout.stage_layers)
        self.first = 0 in chunks  # embeds the tokens
        self.last = self.n_chunks - 1 in chunks  # the head and the loss
        local = fam.held_shards(source, chunks, self.first, self.last, grid, dtype)
        self.fp8 = (None if layout.fp8 == "none"  # FP8 linears (refmp.parallel.fp8)
                    else apply_fp8(self.ops, layout.fp8, grid, self.sp, mc, chunks))
        self.ops = self.ops if self.fp8 is None else self.fp8
        self.sharder = build_sharder(local, grid, layout, seed, fam)
        moe = moe_context(mc, grid, self.sp, self.sharder.compute, cp_positions, fam.experts)
        self.stage = fam.stage(chunks, self.n_chunks, self.ops, self.sharder, moe,
                               self.tp.size if self.sp else 1, layout.recompute == "full")
        self.executor = build_executor(self.schedule, self.stage, self.pp, self.sharder.compute,
                                       self._measure, placed)
        self.actions = partial(self.schedule.actions, self.pp.size, self.microbatches,
                               self.pp.rank, self.v)
        # SP: the pieces every tp rank saw a part of the tokens for (their gradients are partial)
        self.partial_over_tp = {k for k in self.sharder.params
                                if k in local.shapes and "tp" in fam.place(k, self.sp).reduce}
        own = fam.bind(grid)  # the family's own groups (Llama: tp-kv), collective over tp
        coords = {**grid.coords, "edp": grid.comm["edp"].rank, "etp": self.etp.rank, **own}
        self.counts_in_norm = counts_in_norm(self.sharder.params, local.shapes, coords, self.sp,
                                             self.sharder.partitions, self.first, self.last,
                                             fam.place, self.sharder.replicas)  # HSDP: once
        self.peak_activations = 0
        self._loss = (0.0, 0.0)  # the last step's (cross-entropy, MoE) loss shares here
        self._scale = 1.0  # mixed precision: the loss scale
        self._master = None  # and the fp32 gradient pieces

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

    @property
    def weight_dtype(self) -> np.dtype:
        return self.sharder.dtype  # --dtype: the masters' with mixed precision

    @property
    def compute_dtype(self) -> np.dtype:
        return self.sharder.compute  # what the model computes on

    def batch_rows(self, B: int) -> slice:
        dp = self.grid.comm["dp"]
        return dp_rows(B, dp.size, dp.rank)

    def ahead(self) -> int:
        """How many later batches' forwards run in each step (``forward_backward``'s
        ``ahead``): the schedule catalog's (2bw 1, pipedream pp - 1, a flush schedule 0)."""
        return self.schedule.ahead(self.pp.size)

    def state(self) -> dict:
        """What later steps depend on, of this runner's own (a checkpoint saves it rank by
        rank): the data-parallel sums' codec state (Sharder.state)."""
        return self.sharder.state()

    def load_state(self, state: dict) -> None:
        self.sharder.load_state(state)

    def zero_grad(self) -> None:
        self.sharder.zero_grad()

    def forward_backward(self, x, y, denom: int, dloss: float = 1.0, ahead=()) -> None:
        """This rank's rows x, y (b, T): its tokens (cp), M micro-batches, the schedule;
        ``dloss`` the loss scale (fp16), which backward starts from; ``ahead`` [(x, y), ...]:
        the later batches whose forwards run in this step (2bw, pipedream; else empty)."""
        self._scale = dloss
        self._master = None
        self.stage.begin_step(dloss)
        rows = [(x, y), *ahead]
        if self.positions is not None:  # (b, Tl) my tokens
            rows = [(x[:, self.positions], y[:, self.positions]) for x, y in rows]
        mbs = [mb for x, y in rows for mb in split_microbatches(x, y, self.microbatches)]
        xs = [x for x, _ in mbs]
        ys = [y for _, y in mbs]
        acts = self.actions(fill=self.executor.fills, ahead=len(rows) - 1)
        ce = self.executor.step(acts, xs, ys, denom, self.microbatches)
        if self.fp8 is not None:
            self.fp8.end_step()  # delayed scaling: this step's amaxes join the history
        self._loss = (ce, self.stage.aux)

    def _measure(self, caches: dict) -> None:
        """After a forward: the live caches' bytes (the peak is the memory report's)."""
        params = self.sharder.resident(self.executor.resident())
        self.peak_activations = max(self.peak_activations, activation_bytes(caches, params))

    def reduce_grads(self) -> None:
        """Every owned piece becomes the global gradient (the module docstring's three sums,
        as Megatron's finalize_model_grads); mixed precision: then fp32 and unscaled."""
        self._reduce_data_parallel()
        self._reduce_sp_partial()
        self._reduce_tied_embedding()
        self.family.reduce_copies(self.grads)  # Llama's replicated key/value heads
        if self.sharder.mixed:
            self._master = self.sharder.master_grads(self._scale)

    def _reduce_data_parallel(self) -> None:
        self._reduce_tied_embedding(before_sums=True)
        self.sharder.finish()  # dense units over dp x cp, expert units over edp

    def _reduce_sp_partial(self) -> None:
        """SP: weights every tp rank saw T/tp tokens for have gradients partial over tp."""
        arrays = [g for k, g in self.grads.items() if k in self.partial_over_tp]
        if arrays:  # none without SP
            flat = flatten(arrays)
            self.tp.allreduce(flat)
            unflatten_into(flat, arrays)

    def _reduce_tied_embedding(self, before_sums: bool = False) -> None:
        """wte's copies on the first stage (embedding) and the last (head) add each other's
        share: the same flat layout at both ends, and a + b == b + a exactly; pp 1 or a V: one
        rank. PowerSGD and top-k (``coding``) compress wte's whole gradient: there the ends add
        theirs first."""
        if (self.first == self.last or not self.family.tied_ends or "wte" not in self.sharder.units
                or before_sums != self.sharder.coding):
            return
        here = self.sharder.gbuf["wte"] if before_sums else self.sharder.owned_grad("wte")
        other = self.pp.size - 1 if self.first else 0
        req = self.pp.send(here, other, tag=TIED_TAG)
        there = self.pp.recv(here.shape, here.dtype, other, tag=TIED_TAG)
        wait(req)
        here += there

    def grad_norm(self) -> float:
        """The global L2 norm: each element counted once over the whole world."""
        pieces = {k: g for k, g in self.grads.items() if self.counts_in_norm[k]}
        return global_grad_norm(pieces, self.grid.world.allreduce_scalar)

    def after_step(self) -> None:
        self.sharder.after_step()  # ZeRO 1/2: all-gather the updated slices

    def loss_total(self) -> float:
        """The step's global loss: cross-entropy shares (whole on every tp rank, or with SP
        a family's T/tp tokens' share) and MoE shares (partial over tp with SP) summed once
        each, over the whole world."""
        ce, aux = self._loss
        tp0 = self.tp.rank == 0
        parts = [ce if (tp0 or self.sp and self.family.sp_loss_shares) else 0.0,
                 aux if (tp0 or self.sp) else 0.0]
        return float(self.grid.world.allreduce_metrics(parts).sum())

    @property
    def stats(self) -> dict:
        """MoE routing figures of the step, summed over every rank that saw other tokens."""
        if not self.mcfg.n_expert:
            return {}
        E, L = self.mcfg.n_expert, self.mcfg.n_layer
        raw = np.zeros((L, 2 * E + 2))
        for i, r in self.stage.figures.raw.items():
            raw[i] = r
        if self.tp.rank != 0 and not self.sp:
            raw[:] = 0  # tp ranks routed the same tokens: count them once
        raw = self.grid.world.allreduce_metrics(raw)
        return moe_summary([raw[i] for i in range(L) if self.mcfg.is_moe(i)], E)

    # --- the whole model --------------------------------------------------------------------------

    def piece_index(self) -> Mapping:
        """For every owned piece (``params``' names): the global flat index of each of its
        elements in its full GPT-2 parameter, -1 for padding. What a sharded checkpoint
        stores beside the values, so that any other layout can find its own elements."""
        shapes, fam = self.family.shapes(), self.family

        def index(k: str):  # the shard's positions alone, never the whole tensor's
            return positions(shapes[k], fam.shard_index(k, shapes[k], self.tp.rank, self.tp.size,
                                                        self.etp.rank, self.etp.size))

        return self.sharder.owned_index(index)  # computed a unit at a time, as read

    def full_params(self) -> dict | None:
        """The whole model, GPT-2 names, on world rank 0 (collective): gathered over the
        ZeRO groups, then tp, then ep; then each stage sends its part to the first."""
        return self._whole(self.sharder.full_local())

    def param_gatherer(self):
        """``gather(name)``: one whole parameter on world rank 0, None elsewhere (collective
        over the world): refmp.parallel.whole.ParamGatherer, what --save streams."""
        from refmp.parallel.whole import ParamGatherer

        return ParamGatherer(self)

    def full_grads(self) -> dict | None:
        """The whole gradient of the last step (after clipping), like full_params: what a
        test compares with the serial model's, element by element."""
        return self._whole(self.sharder.full_local(grads=True))

    def _whole(self, local: dict) -> dict | None:
        local = gather_etp(self.family.gather_tp(local, self.tp), self.etp)
        if self.mcfg.n_expert and self.ep.size > 1:
            local = gather_experts(local, self.ep, self.mcfg.n_expert)
        coords = self.grid.coords
        if coords["dp"] or coords["cp"] or coords["tp"]:
            return None
        names = sorted(k for k in local if not (k == "wte.weight" and not self.first))
        owners = self.pp.allgather_obj(names)  # pp rank -> the names it sends
        if not self.first:
            for req in [self.pp.send(local[k], 0, tag=j) for j, k in enumerate(names)]:
                wait(req)
            return None
        shapes = self.family.shapes()
        for src in range(1, self.pp.size):
            for j, k in enumerate(owners[src]):
                local[k] = self.pp.recv(shapes[k], self.sharder.dtype, src, tag=j)
        return {k: local[k] for k in shapes}

    def timeline(self) -> Timeline:
        """The last step's measured timeline of this pipeline, gathered over pp (collective)."""
        events = [e for evs in self.pp.allgather_obj(self.executor.events) for e in evs]
        peaks = self.pp.allgather_obj(self.executor.peak_held)
        return Timeline(self.schedule.name, self.pp.size, self.microbatches, self.v, events, "s",
                        peaks)

    def memory(self) -> dict[str, int]:
        """Bytes of the parameter (compute copy), gradient and fp32 master buffers kept, the
        peak live activations, and what the executor keeps (2bw's W(t-1) and GradStash
        peak, pipedream's stashed weight versions)."""
        return {**self.sharder.memory(), "activations": self.peak_activations,
                **self.executor.memory()}
