"""What a rank of ``refmp generate`` holds, from the shapes: the prediction its measured
peak is reported beside (refmp.cli.generate; docs/inference.md).

Shapes: C channels, L blocks (Ls on the rank's stage), S rows of the rank's prompts, n
tokens a row's cache holds (prompt and new tokens), w bytes per element of the decoding
dtype, wf of the weights as read; pp, cp, tp, ep group sizes.

    weights   w x the rank's share (refmp.cost.zero.local_shapes: the stage's blocks as the
              Decoder splits them, the tp shards, the E/ep experts)
    kv_cache  2 Ls S (n/cp) (C/tp) w (refmp.inference.cache's formula)
    read      wf x the whole model: every rank reads the weights whole
              (refmp.inference.sources.load_weights) and keeps them while it decodes
    cast      w x the whole model: the copy in the decoding dtype the Decoder takes its
              share from, freed before the cache is made
    peak      read + weights + max(cast, kv_cache)
"""

from __future__ import annotations

import math

from refmp.cost.memory import model_elements
from refmp.cost.zero import local_shapes
from refmp.nn.params import GPTConfig
from refmp.parallel.pipeline.partition import partition, piece_costs


def decode_memory(mcfg: GPTConfig, sizes: dict, coords: dict, rows: int, tokens: int,
                  w: int = 4, wf: int = 4) -> dict[str, int]:
    """Bytes the rank at ``coords`` of a grid of ``sizes`` holds to decode ``rows`` prompts
    into caches of ``tokens`` tokens each (the module's table), and their ``peak``."""
    pp, cp, tp, ep, r = sizes["pp"], sizes["cp"], sizes["tp"], sizes["ep"], coords["pp"]
    costs = piece_costs(mcfg.n_embd, mcfg.block_size, mcfg.vocab_size)
    blocks = partition(mcfg.n_layer, pp, costs)[r]  # the Decoder's split
    ep_rank = (coords["dp"] * cp + coords["cp"]) % ep
    shapes = local_shapes(mcfg, tp, list(blocks), r == 0, r == pp - 1, ep, ep_rank)
    whole = model_elements(mcfg)
    m = {"weights": w * sum(math.prod(s) for unit in shapes.values() for s in unit.values()),
         "kv_cache": 2 * len(blocks) * rows * -(-tokens // cp) * (mcfg.n_embd // tp) * w,
         "read": wf * whole, "cast": w * whole}
    m["peak"] = m["read"] + m["weights"] + max(m["cast"], m["kv_cache"])
    return m
