"""Which transformer blocks each pipeline stage holds: a cost model and a balanced split.

Shapes: B batch, T time, C channels, V vocabulary, L layers; pp stages, S = pp * v chunks
(v virtual stages per rank, the interleaved schedule's "model chunks").

The model is cut into S consecutive chunks of blocks. Chunk c lives on pipeline rank c % pp
(so with v > 1 each rank holds v chunks, Narayanan et al. 2021, sec. 2.2), or in a V
(schedules.ChunkPlacement; ``rank_chunks``: a rank's chunks and their blocks). The token and
position embeddings go with chunk 0, the final LayerNorm and the LM head with chunk S - 1.

Cost of a piece, per token, forward (the backward is twice that, so the ratio is the same):
  block: 24 C^2 (four linears: 2 * 12 C^2) + 4 T C (q k^T and att v, full T x T as refmp does)
  head:  2 V C (logits = x wte^T)        embed: 0 (a lookup)
The split minimizes the most expensive chunk (the pipeline runs at its slowest stage's pace),
ties broken by the parameters a chunk holds. ``--stage-layers 2,1,1`` overrides it;
``--stage-layers auto`` splits by the pieces' forward and backward times measured on this
host (measured_costs: the embeddings and the head with its loss timed as pieces, as
Megatron-LM's --account-for-embedding-in-pipeline-split and
--account-for-loss-in-pipeline-split count them as layers).
"""

from __future__ import annotations

from functools import cache

from refmp.errors import ConfigError
from refmp.parallel.pipeline.catalog import CATALOG, NAMES
from refmp.parallel.pipeline.schedules import ChunkPlacement


def piece_costs(n_embd: int, block_size: int, vocab_size: int) -> dict[str, tuple[int, int]]:
    """(forward FLOPs per token, parameters) of a block, the head and the embeddings."""
    C, T, V = n_embd, block_size, vocab_size
    return {
        "block": (24 * C * C + 4 * T * C, 12 * C * C + 13 * C),
        "head": (2 * V * C, 2 * C),  # ln_f; wte is counted with the embeddings
        "embed": (0, V * C + T * C),
    }


def measured_costs(mcfg, rows: int, dtype: str = "float32", reps: int = 3) -> dict:
    """piece_costs with measured nanoseconds for FLOPs: the forward and backward of one
    block, of the embeddings and of the head with its loss, on ``rows`` sequences here (the
    median of ``reps``, after a warm-up). MoE blocks are timed as dense ones."""
    import time
    from dataclasses import replace

    import numpy as np

    from refmp.nn import gpt
    from refmp.nn.params import init_params

    one = replace(mcfg, n_layer=1, n_expert=0, top_k=0) if mcfg.n_expert else replace(mcfg, n_layer=1)
    p, ops = init_params(one, 0, dtype), gpt.Ops(one.n_head)
    idx = np.random.default_rng(0).integers(one.vocab_size, size=(rows, one.block_size))
    x = gpt.embed_forward(p, idx)[0]  # (B, T, C)

    def embed():
        gpt.embed_backward(*gpt.embed_forward(p, idx))

    def block():
        y, cache = gpt.block_forward(gpt.block_params(p, 0), x, ops)
        gpt.block_backward(y, cache, ops)

    def head():
        gpt.head_backward(1.0, gpt.head_forward(p, x, idx)[1])

    def ns(piece) -> int:
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter_ns()
            piece()
            times.append(time.perf_counter_ns() - t0)
        return int(np.median(times[1:]))

    params = piece_costs(one.n_embd, one.block_size, one.vocab_size)
    return {k: (ns(f), params[k][1]) for k, f in (("block", block), ("head", head),
                                                    ("embed", embed))}


def auto_stage_layers(mcfg, chunks: int, rows: int, dtype: str, comm) -> str:
    """``--stage-layers auto`` as counts ("3,2,3"): rank 0 of ``comm`` (an mpi4py
    communicator) measures the pieces (measured_costs) and splits; every rank gets its
    split, so that timings that differ between ranks cannot make them disagree."""
    split = None
    if comm.Get_rank() == 0:
        split = balanced_split(mcfg.n_layer, chunks, measured_costs(mcfg, rows, dtype))
    return ",".join(map(str, comm.bcast(split, root=0)))


def chunk_cost(n_blocks: int, first: bool, last: bool, costs: dict) -> tuple[int, int]:
    """(FLOPs, params) of a chunk of n_blocks blocks, with the embeddings/head if it ends."""
    flops, params = n_blocks * costs["block"][0], n_blocks * costs["block"][1]
    for piece, on in (("embed", first), ("head", last)):
        if on:
            flops, params = flops + costs[piece][0], params + costs[piece][1]
    return flops, params


def balanced_split(n_layer: int, chunks: int, costs: dict) -> list[int]:
    """Blocks per chunk (each >= 1) minimizing the largest (FLOPs, params) over chunks.

    Dynamic programming over (blocks left, chunks left); L and S are small.
    """

    @cache
    def best(start: int, c: int) -> tuple[tuple[int, int], tuple[int, ...]]:
        # chunks c .. S-1 hold blocks start .. L-1
        if c == chunks - 1:
            return chunk_cost(n_layer - start, c == 0, True, costs), (n_layer - start,)
        options = []
        for n in range(1, n_layer - start - (chunks - 1 - c) + 1):
            here = chunk_cost(n, c == 0, False, costs)
            rest, split = best(start + n, c + 1)
            options.append((max(here, rest), (n, *split)))
        return min(options)

    return list(best(0, 0)[1])


def parse_stage_layers(text: str | None) -> list[int] | None:
    """``"2,1,1"`` -> [2, 1, 1] (None stays None); refuses anything but positive integers
    (``auto`` is made counts by auto_stage_layers before the run is built)."""
    if text is None or text == "":
        return None
    if text == "auto":
        raise ConfigError("--stage-layers auto is measured by refmp train and refmp bench; "
                          "give counts like 2,1,1 here")
    try:
        out = [int(t) for t in text.split(",")]
    except ValueError:
        raise ConfigError(f"--stage-layers must be integers like 2,1,1, got {text!r}") from None
    return out


def check_pipeline(n_layer: int, pp: int, microbatches: int, schedule: str, virtual: int,
                   stage_layers: list[int] | None, rows: int) -> None:
    """Refuse a pipeline layout that cannot run (same answer on every rank, no communication).

    ``rows`` is the number of sequences one pipeline (one dp rank) gets per step.
    """
    if schedule not in CATALOG:
        raise ConfigError(f"--schedule must be one of {', '.join(NAMES)}, got {schedule!r}")
    sched = CATALOG[schedule]
    takes = [s.name for s in CATALOG.values() if s.chunks is None]  # chunks per rank: --virtual-stages
    if virtual < 1:
        raise ConfigError(f"--virtual-stages must be at least 1, got {virtual}")
    if virtual > 1 and sched.chunks is not None:
        raise ConfigError(f"--virtual-stages {virtual} needs --schedule {' or '.join(takes)}")
    if microbatches < 1:
        raise ConfigError(f"--microbatches must be at least 1, got {microbatches}")
    if sched.chunks is None and microbatches % pp:
        raise ConfigError(f"--schedule {schedule} needs --microbatches ({microbatches}) to be a "
                          f"multiple of --pp ({pp}): micro-batches go round the ranks in groups "
                          f"of pp (Narayanan et al. 2021)")
    virtual = sched.chunks_per_rank(virtual)  # the V-shaped schedules: 2
    chunks = pp * virtual
    if stage_layers is None and n_layer < chunks:
        raise ConfigError(f"{chunks} pipeline stages (pp {pp} x virtual {virtual}) but only "
                          f"{n_layer} layers: every stage needs at least one layer")
    if stage_layers is not None:
        if len(stage_layers) != chunks:
            raise ConfigError(f"--stage-layers gives {len(stage_layers)} stages, expected "
                              f"{chunks} (pp {pp} x virtual {virtual})")
        if min(stage_layers) < 1:
            raise ConfigError(f"--stage-layers {stage_layers}: every stage needs >= 1 layer")
        if sum(stage_layers) != n_layer:
            raise ConfigError(f"--stage-layers {','.join(map(str, stage_layers))} adds up to "
                              f"{sum(stage_layers)}, but the model has {n_layer} layers")
    if rows < microbatches:
        raise ConfigError(f"{rows} sequences per pipeline cannot make {microbatches} "
                          f"micro-batches; raise --batch-size or lower --microbatches")


def partition(n_layer: int, chunks: int, costs: dict,
              stage_layers: list[int] | None = None) -> list[range]:
    """The block indices of each chunk, in order (chunk c runs on pipeline rank c % pp)."""
    counts = stage_layers if stage_layers is not None else balanced_split(n_layer, chunks, costs)
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out


def rank_chunks(mcfg, T: int, pp_rank: int, placed: ChunkPlacement,
                stage_layers: str | None = None) -> dict[int, range]:
    """The model chunks of pipeline rank ``pp_rank`` (``placed``: where each chunk runs), each
    with its blocks: the balanced partition of the layers over S = pp v chunks, or
    ``--stage-layers``'. What the engine, the memory estimate and the guide's tables hold."""
    blocks = partition(mcfg.n_layer, placed.pp * placed.v,
                       piece_costs(mcfg.n_embd, T, mcfg.vocab_size), parse_stage_layers(stage_layers))
    return {c: blocks[c] for c in placed.chunks(pp_rank)}
