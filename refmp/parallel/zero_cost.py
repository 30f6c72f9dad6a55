"""What data parallelism and ZeRO cost per rank, from the model's shapes alone (the formulas).

Rajbhandari et al. 2020, sec. 5 and 7: with N parameters, dp ranks, b bytes per element and
AdamW (two moments, no master copy since refmp keeps one precision), per rank

    stage 0 (plain DP):  params b N      grads b N      optimizer 2 b N
    stage 1:             params b N'     grads b N'     optimizer 2 b N'/dp
    stage 2:             params b N'     grads b N'/dp  optimizer 2 b N'/dp
    stage 3:             params b N'/dp  grads b N'/dp  optimizer 2 b N'/dp

where N' = sum over units (embeddings, each block, ln_f) of the unit's size rounded up to a
multiple of dp: refmp shards each unit separately (refmp.parallel.zero), so that stage 3 can
gather one unit at a time. Communication per step (the ledger's convention, refmp.comm: an
all-reduce or reduce-scatter counts its input, an all-gather its output), M micro-batches:

    stage 0: all-reduce b N (in buckets)
    stage 1: reduce-scatter b N' + all-gather b N'
    stage 2: reduce-scatter M b N' (each micro-batch, unit by unit) + all-gather b N'
    stage 3: reduce-scatter M b N' + all-gather M b (2 N'_embed + 2 N'_blocks + N'_ln_f)
             (embeddings twice: for the embedding and for the tied head; each block before
             its forward and again before its backward; ln_f once, the head's forward and
             backward running back to back)

The wire traffic of a ring is (dp-1)/dp of these per reduce-scatter or all-gather, and twice
that per all-reduce: so stages 1 and 2 move what plain DP moves, stage 3 1.5 times that.
"""

from __future__ import annotations

import math

from refmp.nn.gpt import GPTConfig, param_shapes


def unit_sizes(cfg: GPTConfig) -> dict[str, int]:
    """Elements per unit: ``embed`` (wte, wpe), ``h.{i}``, ``ln_f``."""
    sizes = {"embed": 0, **{f"h.{i}": 0 for i in range(cfg.n_layer)}, "ln_f": 0}
    for k, s in param_shapes(cfg).items():
        unit = "embed" if k.startswith(("wte", "wpe")) else ".".join(k.split(".")[:2])
        unit = "ln_f" if k.startswith("ln_f") else unit
        sizes[unit] += math.prod(s)
    return sizes


def padded(n: int, dp: int) -> int:
    return -(-n // dp) * dp


def memory_per_rank(cfg: GPTConfig, dp: int, stage: int, itemsize: int = 4) -> dict[str, int]:
    """Bytes of parameters, gradients and AdamW state per rank (the table above)."""
    n = sum(unit_sizes(cfg).values())
    n_pad = sum(padded(s, dp) for s in unit_sizes(cfg).values())
    if stage == 0:
        return {"params": itemsize * n, "grads": itemsize * n, "optimizer": 2 * itemsize * n}
    shard = n_pad // dp
    return {"params": itemsize * (n_pad if stage < 3 else shard),
            "grads": itemsize * (n_pad if stage < 2 else shard),
            "optimizer": 2 * itemsize * shard}


def comm_per_step(cfg: GPTConfig, dp: int, stage: int, microbatches: int = 1,
                  itemsize: int = 4) -> dict[str, int]:
    """Ledger bytes per step by operation (the list above)."""
    sizes = {u: padded(s, dp) for u, s in unit_sizes(cfg).items()}
    n_pad, M = sum(sizes.values()), microbatches
    if stage == 0:
        return {"allreduce": itemsize * sum(unit_sizes(cfg).values())}
    if stage == 1:
        return {"reduce_scatter": itemsize * n_pad, "allgather": itemsize * n_pad}
    if stage == 2:
        return {"reduce_scatter": M * itemsize * n_pad, "allgather": itemsize * n_pad}
    return stage3_comm_per_step(unit_sizes(cfg), dp, M, itemsize)


def stage3_comm_per_step(sizes: dict[str, int], dp: int, microbatches: int = 1,
                         itemsize: int = 4) -> dict[str, int]:
    """Stage 3's ledger bytes per step over dp, from the (unpadded) unit sizes a rank shards:
    the whole model's (unit_sizes), or one tp rank's shards' (tp_unit_sizes)."""
    sizes = {u: padded(s, dp) for u, s in sizes.items()}
    n_pad, M = sum(sizes.values()), microbatches
    blocks = sum(s for u, s in sizes.items() if u.startswith("h."))
    gathered = 2 * sizes["embed"] + 2 * blocks + sizes["ln_f"]
    return {"reduce_scatter": M * itemsize * n_pad, "allgather": M * itemsize * gathered}


# --- ZeRO 1/2 over a tp or pp runner (refmp.parallel.zero_compose) --------------------------
# One unit: the n elements a rank holds (its tp shards, or its pipeline stage's parameters),
# padded to n' = a multiple of dp. Per rank: params b n', grads b n' (stage 1) or b n'/dp
# (stage 2), optimizer 2 b n'/dp; per step, over dp: reduce-scatter b n' + all-gather b n'
# (replacing the runner's all-reduce of b n), once per step at either stage.


def tp_unit_sizes(cfg: GPTConfig, tp: int) -> dict[str, int]:
    """Elements per unit one tensor-parallel rank holds (tensor_runner's splits)."""
    C, V = cfg.n_embd, cfg.vocab_size
    Vp = -(-V // tp) * tp  # the vocabulary padded to a multiple of tp (vocab.padded_vocab)
    block = (3 * C * C + 3 * C + C * C + 4 * C * C + 4 * C + 4 * C * C) // tp  # split ones
    block += 2 * C + 2 * C + C + C  # replicated: ln_1, ln_2, the two c_proj biases
    return {"embed": Vp * C // tp + cfg.block_size * C,
            **{f"h.{i}": block for i in range(cfg.n_layer)}, "ln_f": 2 * C}


def tp_local_numel(cfg: GPTConfig, tp: int) -> int:
    """Elements one tensor-parallel rank holds."""
    return sum(tp_unit_sizes(cfg, tp).values())


def sharded_memory_per_rank(n_local: int, dp: int, stage: int, itemsize: int = 4) -> dict:
    """Bytes of params, grads and AdamW state per rank, ZeRO 1/2 over a runner's n_local."""
    n_pad = padded(n_local, dp)
    return {"params": itemsize * n_pad,
            "grads": itemsize * (n_pad if stage == 1 else n_pad // dp),
            "optimizer": 2 * itemsize * n_pad // dp}


def sharded_comm_per_step(n_local: int, dp: int, itemsize: int = 4) -> dict[str, int]:
    """Ledger bytes per step over dp, ZeRO 1/2 over a runner's n_local (no all-reduce)."""
    n_pad = padded(n_local, dp)
    return {"reduce_scatter": itemsize * n_pad, "allgather": itemsize * n_pad, "allreduce": 0}


def stage3_memory_per_rank(sizes: dict[str, int], dp: int, itemsize: int = 4) -> dict:
    """Stage 3 over tp (refmp.parallel.zero3_tensor): each unit of a tp rank's shards
    (tp_unit_sizes) padded to a multiple of dp, then 1/dp of params, grads and AdamW state."""
    shard = sum(padded(s, dp) for s in sizes.values()) // dp
    return {"params": itemsize * shard, "grads": itemsize * shard, "optimizer": 2 * itemsize * shard}
