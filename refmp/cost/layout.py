"""The planner's layout: the ParallelConfig fields ``refmp plan`` searches (refmp.config marks
them), with a micro-batch stated as its rows, b = microbatch_size, where a run states the
count, M = B / (dp b); the TrainConfig that runs a layout; the blocks of each pipeline chunk.
"""

from __future__ import annotations

from dataclasses import Field, field, fields, make_dataclass
from functools import cache

from refmp.config import ParallelConfig, TrainConfig
from refmp.nn.params import GPTConfig
from refmp.parallel.pipeline.partition import partition, piece_costs

SEARCHED = tuple(f.name for f in fields(ParallelConfig) if f.metadata["plan"] is not None)
# a plan's defaults where they are not a run's: dp a number, and bf16 (a GPU plan runs in
# mixed precision, as Narayanan et al. 2021 and Korthikanti et al. 2022 do)
PLAN_DEFAULTS = {"dp": 1, "mixed_precision": "bf16"}


def _planned(f: Field) -> tuple:
    if f.name == "microbatches":
        return "microbatch_size", "int", field(default=1, metadata=f.metadata)
    return f.name, f.type, field(default=PLAN_DEFAULTS.get(f.name, f.default), metadata=f.metadata)


Layout = make_dataclass(
    "Layout", [_planned(f) for f in fields(ParallelConfig) if f.name in SEARCHED], frozen=True,
    namespace={"__module__": __name__, "__doc__": "One choice of every axis and option the "
               "planner searches (``--json``'s keys); microbatch_size is b, rows per "
               "micro-batch on a dp rank, so M = B / (dp b)."})


def parallel_fields(lay: dict, batch: int) -> dict:
    """The ParallelConfig fields of a planned layout (a Layout's fields, or a row of the
    search): the searched ones, with M = B / (dp b) micro-batches."""
    chosen = {k: lay[k] for k in SEARCHED if k != "microbatches"}
    return {**chosen, "microbatches": batch // (lay["dp"] * lay["microbatch_size"])}


@cache
def split(mcfg: GPTConfig, chunks: int) -> tuple[tuple[int, ...], ...]:
    """The blocks of each chunk, as the engine splits them (partition's balanced split)."""
    C, T, V = mcfg.n_embd, mcfg.block_size, mcfg.vocab_size
    return tuple(tuple(c) for c in partition(mcfg.n_layer, chunks, piece_costs(C, T, V)))


def train_config(lay: Layout, mcfg: GPTConfig, batch: int, dtype: str = "float32",
                 stage_layers: bool = True) -> TrainConfig:
    """The TrainConfig that runs this layout (what check_layout and estimate_memory read);
    ``stage_layers``: spell out the balanced split (the same blocks; saves recomputing it)."""
    S = lay.pp * lay.virtual_stages
    chunks = split(mcfg, S) if stage_layers and 1 < S <= mcfg.n_layer else None
    return TrainConfig(stage_layers=",".join(str(len(c)) for c in chunks) if chunks else None,
                       n_layer=mcfg.n_layer, n_head=mcfg.n_head, n_embd=mcfg.n_embd,
                       block_size=mcfg.block_size, batch_size=batch, dtype=dtype,
                       **parallel_fields(vars(lay), batch), n_expert=mcfg.n_expert,
                       top_k=mcfg.top_k if mcfg.n_expert else None)
