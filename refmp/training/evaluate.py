"""Evaluation during training: greedy decoding of the model as the runner holds it now, and
the held-out exact match of the task (the figure ``refmp train`` prints at the end).

Decoding goes through refmp.inference's Decoder, split over the run's tp and pp as training
splits the model: the same function splits the pipeline
(refmp.parallel.pipeline.partition.rank_chunks, costed at the run's block size T), one chunk
per rank, balanced, and tp cuts each parameter as training does (placement.tp_shard), so a
stage decodes with the weights it trains, read in place (``held_weights``). Where the
schedule has several chunks per rank (interleaved, the V schedules) or --stage-layers moves
them, the blocks a stage decodes but does not train come point to point, tensor by tensor,
from the pp rank that trains them. ZeRO's units are all-gathered one by one as in a step
and kept for the decoding: the stage's tp share unpartitioned (the dp x cp ranks decode
prompts of their own, a different number of calls each, so they could not gather a unit in
step for each use), which with ZeRO-3 and pp = tp = 1 is the whole model; an MoE block's
experts are all-gathered over ep (the Decoder holds every expert of its blocks). The other
axes (dp, cp) decode prompts of their own. Nothing is broadcast.

Messages of ``held_weights`` on a rank (w the compute dtype's bytes):

    allgather@dp/cp/edp   each unit, Pp w               ZeRO-3 only (a step's gathers)
    allgather@ep          an MoE block's experts        ep > 1
    allgather_obj@pp      the names each stage trains   once
    send / recv @pp       each tensor the decoder's split puts on another stage
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from refmp.distributed.grid import ProcessGrid
from refmp.distributed.waiting import wait
from refmp.inference.decoder import Decoder
from refmp.inference.generate import Greedy
from refmp.nn import GPTConfig, gpt
from refmp.nn import experts as M
from refmp.nn.slices import WHOLE, slice_shape
from refmp.parallel.pipeline.partition import rank_chunks
from refmp.parallel.pipeline.schedules import ChunkPlacement
from refmp.parallel.placement import gather_experts, holds, shard_index
from refmp.runtime.backend import array_module

if TYPE_CHECKING:
    from refmp.training.datasets import AdditionTask
    from refmp.training.trainer import Runner


class Held:
    """The Decoder's Source of shards already cut (``held_weights``): ``read`` gives the
    array itself, whatever the index (it is the tp shard the Decoder asks for)."""

    def __init__(self, shards: dict):
        self.shards = shards

    def read(self, name: str, index=WHOLE, dtype=None):
        v = self.shards[name]
        return v if dtype is None or v.dtype == dtype else v.astype(dtype)


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


def decoder(run: Runner, grid: ProcessGrid, mcfg: GPTConfig, T: int) -> Greedy:
    """Greedy decoding of the model as it is now (collective over the world): a Decoder over
    the grid's tp and pp, split with the run's block size ``T``, on the weights the runner
    holds (``held_weights``: no rank holds the whole model). An MoE model with a capacity
    limit is decoded without the cache: its capacity, counted over a sequence, reroutes the
    earlier tokens as the sequence grows, as GPT.generate recomputes them."""
    dropping = bool(mcfg.n_expert) and mcfg.capacity_factor > 0
    shards = Held(held_weights(run, grid, mcfg, T))
    dec = Decoder(mcfg, shards, grid, axes=("tp", "pp"), capacity=dropping, T=T)
    return Greedy(dec, use_cache=not dropping)


def evaluate(run: Runner, grid: ProcessGrid, mcfg: GPTConfig, T: int,
             task: AdditionTask | None) -> tuple[int, int] | None:
    """Held-out exact-match (correct, total) of ``task`` by greedy decoding (:func:`decoder`),
    the prompts split over dp x cp (collective over the world); None without a task."""
    if task is None:
        return None
    model = decoder(run, grid, mcfg, T)
    comm = grid.group("dp", "cp")  # the ranks that decode prompts of their own
    prompts = np.array_split(task.test_pairs, comm.size)[comm.rank]  # this rank's share
    correct, total = task.score(model, prompts) if len(prompts) else (0, 0)
    return int(comm.allreduce_scalar(correct)), int(comm.allreduce_scalar(total))
