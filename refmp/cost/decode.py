"""What a rank of ``refmp generate`` holds, from the shapes: the prediction its measured
peak is reported beside (refmp.cli.generate; docs/inference.md).

Shapes: C channels, L blocks (Ls on the rank's stage), S rows of the rank's prompts, n
tokens a row's cache holds (prompt and new tokens), w bytes per element of the decoding
dtype, wf of the weights as read; pp, cp, tp, ep group sizes.

    weights   w x the rank's share (refmp.cost.zero.local_shapes: the stage's blocks as the
              Decoder splits them, the tp shards, the E/ep experts)
    kv_cache  2 Ls S (n/cp) (C/tp) w (refmp.inference.cache's formula)
    read      while the rank reads its share, tensor by tensor in the model's order, straight
              into the decoding dtype (refmp.checkpoint.source): what it has read so far, the
              tensor's slice, and the file's pages that read touches (safetensors maps the
              file while one tensor is read: a column slice, tp's c_attn and c_fc, touches
              every row's pages, wf x the whole tensor; a row slice only its rows), plus a
              chunk of rows and its cut columns (2 x refmp.nn.slices.BLOCK_BYTES, as
              training's setup counts them); its largest moment, beyond the weights
    peak      weights + max(read, kv_cache)
"""

from __future__ import annotations

import math

from refmp.cost.zero import local_shapes
from refmp.nn.params import GPTConfig, param_shapes
from refmp.nn.slices import BLOCK_BYTES
from refmp.parallel.pipeline.partition import partition, piece_costs
from refmp.parallel.placement import TP_SPLITS, local_name


def decode_memory(mcfg: GPTConfig, sizes: dict, coords: dict, rows: int, tokens: int,
                  w: int = 4, wf: int = 4) -> dict[str, int]:
    """Bytes the rank at ``coords`` of a grid of ``sizes`` holds to decode ``rows`` prompts
    into caches of ``tokens`` tokens each (the module's table), and their ``peak``."""
    pp, cp, tp, ep, r = sizes["pp"], sizes["cp"], sizes["tp"], sizes["ep"], coords["pp"]
    costs = piece_costs(mcfg.n_embd, mcfg.block_size, mcfg.vocab_size)
    blocks = partition(mcfg.n_layer, pp, costs)[r]  # the Decoder's split
    ep_rank = (coords["dp"] * cp + coords["cp"]) % ep
    shapes = local_shapes(mcfg, tp, list(blocks), r == 0, r == pp - 1, ep, ep_rank)
    whole = param_shapes(mcfg)
    local = {k: s for unit in shapes.values() for k, s in unit.items()}
    weights = w * sum(math.prod(s) for s in local.values())
    held, read = 0, 0  # what is read so far; the largest moment of a read
    for k in (k for k in whole if k in local):
        split = TP_SPLITS.get(local_name(k))
        columns = tp > 1 and split is not None and split[0] == 1  # every row's pages
        pages = wf * math.prod(whole[k] if columns else local[k])
        held += w * math.prod(local[k])
        read = max(read, held + pages + 2 * BLOCK_BYTES - weights)  # a chunk and its cut
    m = {"weights": weights,
         "kv_cache": 2 * len(blocks) * rows * -(-tokens // cp) * (mcfg.n_embd // tp) * w,
         "read": max(read, 0)}
    m["peak"] = m["weights"] + max(m["read"], m["kv_cache"])
    return m
