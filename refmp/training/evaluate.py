"""Evaluation during training: greedy decoding of the model as the runner holds it now, and
the held-out exact match of the task (the figure ``refmp train`` prints at the end).

Decoding goes through refmp.inference's Decoder, split over the run's tp and pp as training
splits the model: the same function splits the pipeline
(refmp.parallel.pipeline.partition.rank_chunks, costed at the run's block size T), one chunk
per rank, balanced, and tp cuts each parameter as training does (placement.tp_shard), so a
stage decodes with the weights it trains, read in place (``held_weights``). Where the
schedule has several chunks per rank (interleaved, the V schedules) or --stage-layers moves
them, the blocks a stage decodes but does not train come point to point, tensor by tensor,
from the pp rank that trains them. With ZeRO-3, where every dp x cp rank decodes its
prompts in one batch (the same calls in the same order) and a stage decodes what it trains,
each unit is all-gathered as the Decoder reads it and let go after, as in a step
(``Gathered``); elsewhere ZeRO's units are all-gathered once and kept for the decoding (the
stage's tp share, unpartitioned). An MoE block's experts are all-gathered over ep (the
Decoder holds every expert of its blocks). The other axes (dp, cp) decode prompts of their
own. Nothing is broadcast.

Messages of ``held_weights`` on a rank (w the compute dtype's bytes):

    allgather@dp/cp/edp   each unit, Pp w               ZeRO-3 only (a step's gathers)
    allgather@ep          an MoE block's experts        ep > 1
    allgather_obj@pp      the names each stage trains   once
    send / recv @pp       each tensor the decoder's split puts on another stage
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import numpy as np

from refmp.distributed.grid import ProcessGrid
from refmp.distributed.waiting import wait
from refmp.inference.decoder import Decoder
from refmp.inference.generate import Greedy
from refmp.nn import GPTConfig, gpt
from refmp.nn import experts as M
from refmp.nn.slices import slice_shape
from refmp.parallel.pipeline.partition import rank_chunks
from refmp.parallel.pipeline.schedules import ChunkPlacement
from refmp.parallel.placement import gather_experts, holds, shard_index
from refmp.runtime.backend import array_module

if TYPE_CHECKING:
    from refmp.training.datasets import AdditionTask
    from refmp.training.trainer import Runner


class Gathered(Mapping):
    """ZeRO-3's weights for the Decoder, one unit at a time, as a step holds them: reading a
    parameter all-gathers its unit (the Sharder's ``weights``, exact) and keeps that unit
    alone, so a rank holds its slices and one unit (two while the embedding reads wte and
    wpe). Collective: every rank of a unit's group reads the same parameters in the same
    order, which evaluation's lockstep gives (``decoder``)."""

    def __init__(self, sharder, names: list[str]):
        self.sharder = sharder
        self.names = names
        self.unit_of = {k: u for u, unit in sharder.units.items() for k in unit.shapes}
        self.unit = None  # the unit gathered now, and its parameters
        self.held: dict = {}

    def __getitem__(self, k: str):
        u = self.unit_of[k]
        if u != self.unit:
            self.held = {}  # the last unit goes before the next is gathered
            self.held = self.sharder.weights(u, exact=True)
            self.unit = u
        return self.held[k]

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def gathered(run: Runner, grid: ProcessGrid, mcfg: GPTConfig, T: int) -> Gathered | None:
    """With ZeRO-3, the Decoder's weights gathered unit by unit (Gathered) where every pp
    rank decodes exactly the parameters it trains (one chunk per rank, no --stage-layers)
    and experts are not split over ep; None elsewhere (collective over pp, ZeRO-3 only)."""
    sh, pp = run.sharder, grid.comm["pp"]
    shapes = gpt.param_shapes(mcfg)
    blocks = rank_chunks(mcfg, T, pp.rank, ChunkPlacement(pp.size))[pp.rank]
    need = [k for k in shapes if holds(k, blocks, pp.rank == 0, pp.rank == pp.size - 1, 0,
                                        mcfg.n_expert)]
    same = set(need) == {k for unit in sh.units.values() for k in unit.shapes}
    if not all(pp.allgather_obj(same and grid.comm["ep"].size == 1)):
        return None
    return Gathered(sh, need)


def held_weights(run: Runner, grid: ProcessGrid, mcfg: GPTConfig, T: int) -> dict:
    """The tp shards of every parameter this rank's Decoder stage needs (the module
    docstring), in the compute dtype (with --mixed-precision the rounded copy training
    computes on), from the runner's own pieces; collective over the world."""
    sh, pp, ep = run.sharder, grid.comm["pp"], grid.comm["ep"]
    P, me = pp.size, pp.rank
    shapes = gpt.param_shapes(mcfg)

    def needs(q: int) -> set[str]:  # what decoder stage q holds (every expert of its blocks)
        blocks = rank_chunks(mcfg, T, q, ChunkPlacement(P))[q]
        return {k for k in shapes if holds(k, blocks, q == 0, q == P - 1, 0, mcfg.n_expert)}

    names = [k for unit in sh.units.values() for k in unit.shapes]
    blocks = {int(k.split(".")[1]) for k in names if k.startswith("h.")}
    first, last = "wpe.weight" in names, "ln_f.weight" in names
    trains = {k for k in shapes if holds(k, blocks, first, last, 0, mcfg.n_expert)}
    trainers: dict[str, list[int]] = {}  # name -> the pp ranks that train it
    for q, theirs in enumerate(pp.allgather_obj(sorted(trains))):
        for k in theirs:
            trainers.setdefault(k, []).append(q)

    def source(k: str, q: int) -> int:  # the pp rank stage q takes k from: itself if it can
        return q if q in trainers[k] else trainers[k][0]

    need = [needs(q) for q in range(P)]
    moved = {(s, q): [k for k in shapes if k in need[q] and source(k, q) == s]
             for s in range(P) for q in range(P) if s != q}
    out, sends = {}, []
    for u in sh.units:
        w = sh.weights(u, exact=True)  # stage 3: all-gathered now, as in a step
        if ep.size > 1 and any(M.EXPERT.search(k) for k in w):
            w = gather_experts(w, ep, mcfg.n_expert)  # every expert of the block
        for k, v in w.items():
            for q in (q for q in range(P) if k in need[q] and source(k, q) == me):
                if q == me:
                    out[k] = v  # read in place: the buffer training computes on
                    continue
                x = array_module(v).ascontiguousarray(v)
                sends.append((pp.send(x, q, tag=moved[me, q].index(k)), x))
    tp = grid.comm["tp"]
    for s in range(P):
        for j, k in enumerate(moved.get((s, me), [])):
            shape = slice_shape(shapes[k], shard_index(k, shapes[k], tp.rank, tp.size))
            out[k] = pp.recv(shape, sh.compute, s, tag=j)
    for req, _ in sends:
        wait(req)
    return out


def decoder(run: Runner, grid: ProcessGrid, mcfg: GPTConfig, T: int,
            lockstep: bool = False) -> Greedy:
    """Greedy decoding of the model as it is now (collective over the world): a Decoder over
    the grid's tp and pp, split with the run's block size ``T``, on the weights the runner
    holds (``held_weights``; with ZeRO-3 and ``lockstep``, the dp x cp ranks making the same
    calls in the same order, gathered unit by unit as they are read: ``gathered``). An MoE
    model with a capacity limit is decoded without the cache: its capacity, counted over a
    sequence, reroutes the earlier tokens as the sequence grows, as GPT.generate recomputes
    them."""
    dropping = bool(mcfg.n_expert) and mcfg.capacity_factor > 0
    live = gathered(run, grid, mcfg, T) if run.sharder.stage == 3 and lockstep else None
    # the rank's own shards (a Mapping that is not a dict: the Decoder takes it as it is)
    shards = live if live is not None else MappingProxyType(held_weights(run, grid, mcfg, T))
    dec = Decoder(mcfg, shards, grid, axes=("tp", "pp"), capacity=dropping, T=T)
    return Greedy(dec, use_cache=not dropping)


def evaluate(run: Runner, grid: ProcessGrid, mcfg: GPTConfig, T: int,
             task: AdditionTask | None) -> tuple[int, int] | None:
    """Held-out exact-match (correct, total) of ``task`` by greedy decoding (:func:`decoder`),
    the prompts split over dp x cp (collective over the world); None without a task."""
    if task is None:
        return None
    comm = grid.group("dp", "cp")  # the ranks that decode prompts of their own
    parts = np.array_split(task.test_pairs, comm.size)
    prompts = parts[comm.rank]  # this rank's share
    # one batch of prompts on every rank (task.score's): the same calls, in the same order
    lockstep = all(0 < len(p) <= task.BATCH for p in parts)
    model = decoder(run, grid, mcfg, T, lockstep)
    correct, total = task.score(model, prompts, task.BATCH) if len(prompts) else (0, 0)
    return int(comm.allreduce_scalar(correct)), int(comm.allreduce_scalar(total))
