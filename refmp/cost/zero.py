"""What data parallelism and ZeRO cost per rank, from the model's shapes alone (the formulas).

Rajbhandari et al. 2020, sec. 5 and 7: with N parameters on a rank, n ranks in its ZeRO
group (dp x cp for dense weights, edp for experts), b bytes per element and AdamW (two
moments; no master copy when one precision is kept: mixed precision below), per rank

    stage 0 (plain DP):  params b N      grads b N      optimizer 2 b N
    stage 1:             params b N'     grads b N'     optimizer 2 b N'/n
    stage 2:             params b N'     grads b N'/n   optimizer 2 b N'/n
    stage 3:             params b N'/n   grads b N'/n   optimizer 2 b N'/n

where N' = sum over the rank's units of the unit's size rounded up to a multiple of n: the
Sharder (refmp.parallel.data.sharder) shards each unit separately (``wte``, ``wpe``, each block
``h.{i}`` and its experts, ``ln_f``: refmp.parallel.placement.unit_of), so that stage 3 can
gather one unit at a time. N is what the rank holds: its tp shards of its pipeline stage's
units (``unit_sizes``). Communication per step on the group (the ledger's convention,
refmp.distributed.comm: an all-reduce or reduce-scatter counts its input, an all-gather its output), M
micro-batches:

    stage 0: all-reduce b N (in buckets)
    stage 1: reduce-scatter b N' + all-gather b N'
    stage 2: reduce-scatter M b N' (each micro-batch, unit by unit) + all-gather b N'
    stage 3: reduce-scatter M b N' + all-gather M b (g_wte wte' + wpe' + 2 blocks' + 2 ln_f')

Stage 3 gathers each unit just before each forward and each backward that needs its weights:
a block twice, ln_f twice (the head's forward and backward), wpe once (the embedding's
backward needs only the token ids), and wte g_wte times: for the embedding's forward (on the
first stage) and for the head's forward and backward (on the last): 3 without a pipeline.

The wire traffic of a ring is (n-1)/n of these per reduce-scatter or all-gather, and twice
that per all-reduce: so stages 1 and 2 move what plain DP moves, stage 3 1.5 times that.

Mixed precision (refmp.parallel.data.sharder; the ZeRO paper's own accounting, sec. 3.1): the
weights held for compute take c bytes per element (2 for bf16 / fp16), the gradients g (the
compute dtype's c, or 4 with ``--grad-dtype fp32``), and the optimizer 3 b (two moments and
the master copy, b = 4 for fp32 masters) per owned element. With c = g = 2, b = 4 and N
parameters on one unit, per rank:

    stage 0:  2 N + 2 N + 12 N  = 16 N      stage 2:  2 N' + 14 N'/n
    stage 1:  4 N' + 12 N'/n                stage 3:  16 N'/n

and every collective above moves c (all-gathers of weights) or g (gradient reductions)
bytes per element instead of b: half of fp32's with 16-bit gradients.

Compression (refmp.parallel.data.compress, ``compressed_per_step``): bf16 is the table above
with g = 2; PowerSGD all-reduces g R (n_r + m) per compressed matrix and g nm per other
tensor; top-k all-gathers n k (g + 4), k = ceil(F nm) per tensor. ``--weight-gather int8``
makes each stage-3 gather of a unit of Pp elements n (Sb + 4 Sb / block) bytes, Sb = Pp/n
rounded up to a block.

HSDP (refmp.parallel.data.hsdp, ``--dp-shard``): the tables above with n a shard group's
ranks, and once a step an all-reduce of each unit's owned slice across the replicas
(``hsdp_per_step``).
"""

from __future__ import annotations

import math
from functools import cache

from refmp.cost.family import shapes as family_shapes
from refmp.cost.family import tied
from refmp.nn.gpt import GPTConfig
from refmp.parallel.data.compress import compresses
from refmp.parallel.expert import is_expert
from refmp.parallel.placement import (
    TP_SPLITS,
    expert_split,
    holds,
    local_name,
    padded_vocab,
    unit_of,
)


def local_shapes(cfg: GPTConfig, tp: int = 1, blocks=None, first: bool = True,
                 last: bool = True, ep: int = 1, ep_rank: int = 0, etp: int = 1) -> dict[str, dict]:
    """unit -> {parameter: shape} one rank holds: its tp shards of ``blocks`` (default: all),
    wte and wpe if ``first``, ln_f and wte if ``last``, and its E/ep experts (with folding
    each cut over ``etp``: placement.ETP_SPLITS). Remembered (the planner and the site's
    explorer ask for the same rank's units many times); a fresh dict."""
    blocks = frozenset(range(cfg.n_layer) if blocks is None else blocks)
    return {u: dict(unit) for u, unit in _local_shapes(cfg, tp, blocks, first, last, ep,
                                                        ep_rank, etp).items()}


@cache
def _local_shapes(cfg: GPTConfig, tp: int, blocks: frozenset, first: bool, last: bool, ep: int,
                  ep_rank: int, etp: int = 1) -> dict[str, dict]:
    shapes: dict[str, dict] = {}
    for k, s in family_shapes(cfg).items():
        head = k.startswith("lm_head")  # an untied head: the last stage's, split as wte is
        held = last if head else holds(k, blocks, first, last, ep_rank, cfg.n_expert, ep)
        if not held or (k.startswith("wte") and not first and not tied(cfg)):
            continue  # (untied, wte is the first stage's alone)
        s, split = list(s), TP_SPLITS["wte.weight"] if head else TP_SPLITS.get(local_name(k))
        if split is not None:
            s[split[0]] = (padded_vocab(s[0], tp) if k.startswith(("wte", "lm_head"))
                           else s[split[0]]) // tp
        if etp > 1 and (cut := expert_split(k) if is_expert(k) else None) is not None:
            s[cut[0]] //= etp  # an expert's etp shard (folding)
        shapes.setdefault("lm_head" if head else unit_of(k), {})[k] = tuple(s)
    return shapes


def unit_sizes(cfg: GPTConfig, tp: int = 1, blocks=None, first: bool = True,
               last: bool = True, ep: int = 1, ep_rank: int = 0, etp: int = 1) -> dict[str, int]:
    """Elements per unit one rank holds (``local_shapes``' units)."""
    return {u: sum(math.prod(s) for s in unit.values())
            for u, unit in local_shapes(cfg, tp, blocks, first, last, ep, ep_rank, etp).items()}


def compressed_per_step(shapes: dict[str, dict], n: int, codec: str, rank: int = 4,
                        ratio: float = 0.01, itemsize: int = 4) -> dict[str, int]:
    """Ledger bytes per step of the gradient sums over a group of n under PowerSGD or top-k,
    on ``local_shapes``' units (the module docstring; refmp.parallel.data.compress)."""
    tensors = [s for unit in shapes.values() for s in unit.values()]
    if n == 1:
        return {"allreduce": 0, "allgather": 0}
    if codec == "powersgd":
        elems = sum(rank * (s[0] + math.prod(s[1:])) if compresses(s, rank) else math.prod(s)
                    for s in tensors)
        return {"allreduce": itemsize * elems, "allgather": 0}
    kept = sum(math.ceil(ratio * math.prod(s)) for s in tensors)
    return {"allreduce": 0, "allgather": n * kept * (itemsize + 4)}


def int8_gather_bytes(padded_elems: int, n: int, block: int, scale_bytes: int = 4) -> int:
    """Ledger bytes of one int8 all-gather of a unit of ``padded_elems`` (Pp) elements
    (``scale_bytes`` 1: the FP8 gather, MXFP8's one-byte scales, block 32)."""
    blocks = -(-(padded_elems // n) // block)
    return n * blocks * (block + scale_bytes)


def padded(n: int, group: int) -> int:
    return -(-n // group) * group


def memory_per_rank(sizes: dict[str, int], n: int, stage: int, itemsize: int = 4,
                    compute: int | None = None, grad: int | None = None) -> dict:
    """Bytes of parameters, gradients and AdamW state per rank (the tables above).

    ``itemsize``: the masters' (``--dtype``); ``compute``: the compute copy's with mixed
    precision (None: no mixed precision, one copy in ``itemsize``); ``grad``: the gradients'
    (default: the compute dtype's). With mixed precision the optimizer holds the masters too.
    """
    c = itemsize if compute is None else compute
    g = c if grad is None else grad
    opt = (2 if compute is None else 3) * itemsize  # moments (+ masters) per owned element
    if stage == 0:
        total = sum(sizes.values())
        return {"params": c * total, "grads": g * total, "optimizer": opt * total}
    n_pad = sum(padded(s, n) for s in sizes.values())
    shard = n_pad // n
    return {"params": c * (n_pad if stage < 3 else shard),
            "grads": g * (n_pad if stage < 2 else shard),
            "optimizer": opt * shard}


def comm_per_step(sizes: dict[str, int], n: int, stage: int, microbatches: int = 1,
                  itemsize: int = 4, first: bool = True, last: bool = True,
                  param_itemsize: int | None = None, quant_block: int = 0,
                  scale_bytes: int = 4) -> dict[str, int]:
    """Ledger bytes per step on the ZeRO group, by operation (the list above). ``itemsize``:
    the gradients' bytes per element (reductions); ``param_itemsize``: the weights' (the
    all-gathers; default the same: with mixed precision, the compute dtype's); ``quant_block``
    (stage 3, not 0): the weights gathered in int8 blocks (FP8's: 32, ``scale_bytes`` 1)."""
    w = itemsize if param_itemsize is None else param_itemsize
    if n == 1:
        return {"allreduce": 0, "reduce_scatter": 0, "allgather": 0}
    pad = {u: padded(s, n) for u, s in sizes.items()}
    n_pad, M = sum(pad.values()), microbatches
    if stage == 0:
        return {"allreduce": itemsize * sum(sizes.values()), "reduce_scatter": 0, "allgather": 0}
    if stage in (1, 2):
        return {"allreduce": 0, "reduce_scatter": (1 if stage == 1 else M) * itemsize * n_pad,
                "allgather": w * n_pad}
    # wte: the embedding's gather, and the tied head's two; an untied head gathers lm_head twice
    g_wte = (1 if first else 0) + (2 if last and "lm_head" not in sizes else 0)
    if quant_block:  # int8_gather_bytes per gather, counted in elements of 1 byte
        pad, w = {u: int8_gather_bytes(p, n, quant_block, scale_bytes) for u, p in pad.items()}, 1
    blocks = sum(s for u, s in pad.items() if u.startswith("h."))
    gathered = (g_wte * pad.get("wte", 0) + pad.get("wpe", 0) + 2 * blocks
                + 2 * pad.get("ln_f", 0) + 2 * pad.get("lm_head", 0))
    return {"allreduce": 0, "reduce_scatter": M * itemsize * n_pad,
            "allgather": M * w * gathered}


def hsdp_per_step(sizes: dict[str, int], n: int, replicas: int, itemsize: int = 4) -> int:
    """HSDP: ZeRO over shard groups of n ranks (refmp.cost.zero.comm_per_step over n, on
    ``{axis}.shard``; memory_per_rank over n), and ``replicas`` of them: the ledger bytes
    per step of the all-reduce across the replicas (``{axis}.replicate``), each unit's
    owned slice S = Pp/n once (``sizes``: unit -> elements; ``itemsize``: the gradients')."""
    return itemsize * sum(padded(s, n) // n for s in sizes.values()) if replicas > 1 else 0


def hpz_per_step(sizes: dict[str, int], n: int, G: int, itemsize: int = 4) -> dict[str, int]:
    """ZeRO++'s hpZ beside ZeRO-3 (refmp.parallel.data.hpz), blocks of G of the n ranks:
    ``refresh`` the ledger bytes of the once-a-step all-gather across blocks, Pp w / G a unit
    (on ``{axis}.hpz-cross``; the gathers of every use keep comm_per_step's bytes, on
    ``{axis}.hpz``); ``params`` the weight bytes a rank holds, S (1 + n/G) a unit: its
    primary slice S and its ``secondary`` one, N S = Pp/G (what a weight version copies)."""
    n_pad = sum(padded(s, n) for s in sizes.values())
    return {"refresh": itemsize * n_pad // G, "params": itemsize * n_pad // n * (1 + n // G),
            "secondary": itemsize * n_pad // G}


LINEARS = (3, 1, 4, 4)  # a block's weights in C^2 / tp: qkv, the projection, fc, fc2


def prefetched(uses: list[tuple[float, float, float]], slowdown: float) -> float:
    """Seconds of ZeRO-3 as DeepSpeed runs it: the weights' uses in order, each (compute,
    gather, reduce) seconds, on a compute stream and one communication stream.

    A weight is gathered for every use (the forward, the recomputed forward, the backward;
    DeepSpeed releases it after each) and its gradient reduce-scattered after the backward's.
    The gather of use i+1 is issued when use i starts computing (DeepSpeed's prefetch goes
    at least one weight ahead; its 5e7-element bucket holds no more than one of a large
    model's), and use i computes once its own gather is done and use i-1 has. While the
    communication stream is busy the compute runs ``slowdown`` times slower (the collective's
    kernels hold some of the GPU's SMs)."""
    comm, comp = uses[0][1], 0.0
    ready = comm  # when the gather of the current use is done
    for i, (c, _, reduce) in enumerate(uses):
        start = max(comp, ready)
        if i + 1 < len(uses):
            comm = max(comm, start) + uses[i + 1][1]
            ready_next = comm
        beside = max(0.0, min(comm - start, c * slowdown))  # compute time beside the stream
        comp = start + beside + c - beside / slowdown
        if reduce:
            comm = max(comm, comp) + reduce
        if i + 1 < len(uses):
            ready = ready_next
    return max(comp, comm)


def ring_pass(elements: float, n: int, c: int, bw: float, hop: float) -> float:
    """Seconds of one all-gather or reduce-scatter of a weight on a ring of n ranks."""
    return (n - 1) / n * c * elements / bw + (n - 1) * hop


def zero3_uses(units: dict, blocks: list, block_t: list, head_t: float, full: bool,
               ring) -> list[tuple[float, float, float]]:
    """One micro-batch's weight uses, in order, as zero.prefetched takes them: the
    embeddings, each block's four linears, the head (forward and backward), then each block
    in reverse, its forward again (full recomputation) and its linears' backward. A block's
    seconds ``block_t`` are split over its uses by FLOPs (forward 1, again 1, backward 2),
    and over its linears by size; ``ring(elements)``: one gather or reduce-scatter."""
    fwd, bwd, w = [], [], 3 + full
    for i, t in zip(blocks, block_t, strict=True):
        parts = [(x / 12 * t / w, ring(x / 12 * units[f"h.{i}"])) for x in LINEARS]
        again = [(c, g, 0.0) for c, g in parts] if full else []
        bwd = again + [(2 * c, g, g) for c, g in parts[::-1]] + bwd
        fwd += [(c, g, 0.0) for c, g in parts]
    first, last = "wpe" in units, "ln_f" in units
    emb = units.get("wte", 0) * first + units.get("wpe", 0)
    head = units.get("lm_head", units.get("wte", 0)) + units.get("ln_f", 0)
    return ([(0.0, ring(emb), 0.0)] * first + fwd
            + [(head_t, 2 * ring(head), ring(head))] * last + bwd
            + [(0.0, 0.0, ring(units.get("wpe", 0)))] * first)
