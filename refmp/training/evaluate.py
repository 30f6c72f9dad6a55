"""Evaluation during training: greedy decoding of the model as the runner holds it now, and
the held-out exact match of the task (the figure ``refmp train`` prints at the end).

Decoding goes through refmp.inference's Decoder, split over the run's tp and pp as training
splits the model: the same function splits the pipeline
(refmp.parallel.pipeline.partition.rank_chunks, costed at the run's block size T), one chunk
per rank, balanced, so a stage decodes with the blocks it trains unless the schedule has
several chunks per rank or --stage-layers moves them. The other axes (dp, cp) decode prompts
of their own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from refmp.distributed.grid import ProcessGrid
from refmp.inference.decoder import Decoder
from refmp.inference.generate import Greedy
from refmp.nn import GPTConfig, gpt
from refmp.runtime import backend

if TYPE_CHECKING:
    from refmp.training.datasets import AdditionTask
    from refmp.training.trainer import Runner


def decoder(run: Runner, grid: ProcessGrid, mcfg: GPTConfig, T: int) -> Greedy:
    """Greedy decoding of the model as it is now (collective over the world): the whole
    model, gathered by the runner on rank 0 and broadcast, in the runner's compute dtype
    (with --mixed-precision the masters rounded: the copy training computes on), held by a
    Decoder over the grid's tp and pp, split with the run's block size ``T``. An MoE model
    with a capacity limit is decoded without the cache: its capacity, counted over a
    sequence, reroutes the earlier tokens as the sequence grows, as GPT.generate recomputes
    them."""
    world = grid.world
    full = run.full_params()  # the whole model on world rank 0, None elsewhere
    compute = run.compute_dtype
    xp = backend.xp
    whole = {}
    for k, shape in gpt.param_shapes(mcfg).items():
        buf = (xp.ascontiguousarray(full[k]) if full is not None
               else xp.empty(shape, run.weight_dtype))
        buf = world.bcast(buf, root=0)
        whole[k] = buf if buf.dtype == compute else buf.astype(compute)
    dropping = bool(mcfg.n_expert) and mcfg.capacity_factor > 0
    dec = Decoder(mcfg, whole, grid, axes=("tp", "pp"), capacity=dropping, T=T)
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
