"""Evaluation during training: greedy decoding of the model as the runner holds it now, and
the held-out exact match of the task (the figure ``refmp train`` prints at the end).

Decoding goes through refmp.inference's Decoder, split exactly as training splits the model:
over the run's tp, pp and ep, with training's chunks (its schedule's placement and
--stage-layers: where a rank runs several chunks, a call's activations go round the ranks
chunk by chunk, as a step's forward does). So every rank decodes with the weights it trains,
read in place, and holds no more: its tp shards, its blocks, its experts (the Decoder sends
tokens to them by all-to-all). With ZeRO-3 each unit is all-gathered as the Decoder reads it
and let go after, as in a step (``Gathered``). The other axes (dp, cp) decode prompts of
their own, in lockstep: every rank decodes the same number of batches (a rank out of prompts
decodes a stand-in batch and counts nothing), so that the dp x cp ranks meet in ZeRO-3's
gathers and ep's all-to-alls. Nothing is broadcast or moved between ranks.

Messages of the weights on a rank (w the compute dtype's bytes), beside the Decoder's own
(refmp.inference.decoder: tp's all-reduces, pp's sends, ep's all-to-alls):

    allgather@dp/cp/edp   each unit as it is read, Pp w     ZeRO-3 only (a step's gathers)
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import numpy as np

from refmp.distributed.grid import ProcessGrid
from refmp.inference.decoder import Decoder
from refmp.inference.generate import Greedy
from refmp.nn import GPTConfig
from refmp.parallel.data.index import UnitAtATime

if TYPE_CHECKING:
    from refmp.training.datasets import AdditionTask
    from refmp.training.trainer import Runner


class Gathered(UnitAtATime):
    """ZeRO-3's weights for the Decoder, one unit at a time, as a step holds them: reading a
    parameter all-gathers its unit (the Sharder's ``weights``, exact) and keeps that unit
    alone, so a rank holds its slices and one unit (two while the embedding reads wte and
    wpe). Collective: every rank of a unit's group reads the same parameters in the same
    order, which evaluation's lockstep gives."""

    def __init__(self, sharder):
        super().__init__({k: u for u, unit in sharder.units.items() for k in unit.shapes})
        self.sharder = sharder

    def load(self, u: str) -> dict:
        return self.sharder.weights(u, exact=True)


def held_weights(run: Runner) -> Mapping:
    """The weights this rank trains, as its Decoder reads them, in the compute dtype (with
    --mixed-precision the rounded copy training computes on): unit by unit with ZeRO-3
    (Gathered, collective), else the runner's own arrays, read-only (a Mapping that is not
    a dict: the Decoder takes it as it is)."""
    sh = run.sharder
    if sh.stage == 3:
        return Gathered(sh)
    return MappingProxyType({k: v for u in sh.units for k, v in sh.weights(u, exact=True).items()})


def decoder(run: Runner, grid: ProcessGrid, mcfg: GPTConfig, T: int) -> Greedy:
    """Greedy decoding of the model as it is now: a Decoder over the grid's tp, pp and ep,
    split as the run splits it (its chunk placement and --stage-layers, costed at its block
    size ``T``), on the weights the runner holds (``held_weights``). Collective over the
    world: the dp x cp ranks must then decode in lockstep (the same calls in the same
    order). An MoE model with a capacity limit is decoded without the cache: its capacity,
    counted over a sequence, reroutes the earlier tokens as the sequence grows, as
    GPT.generate recomputes them."""
    dropping = bool(mcfg.n_expert) and mcfg.capacity_factor > 0
    dec = Decoder(mcfg, held_weights(run), grid, axes=("tp", "pp", "ep"), capacity=dropping,
                  T=T, placed=run.placed, stage_layers=run.stage_layers)
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
    batches = -(-max(len(p) for p in parts) // task.BATCH)  # on every rank, in lockstep
    model = decoder(run, grid, mcfg, T)
    correct = 0
    for i in range(batches):
        mine = prompts[i * task.BATCH : (i + 1) * task.BATCH]
        if len(mine):
            correct += task.score(model, mine, task.BATCH)[0]
        else:  # out of prompts: a stand-in batch, for the others' collectives
            task.score(model, task.test_pairs[:1], task.BATCH)
    total = len(prompts)
    return int(comm.allreduce_scalar(correct)), int(comm.allreduce_scalar(total))
