"""ZeRO-3's weight all-gathers in FP8: each rank's shard as MXFP8 blocks (refmp.runtime.fp8).

Shapes: S elements in a rank's shard of a unit, n ranks in the group, nb = ceil(S / 32)
blocks of 32 elements.

Like ZeRO++'s int8 gathers (refmp.parallel.data.compress.Int8Gather), but in the format the
FP8 GEMMs take: E4M3 values, one power-of-two scale per 32 elements sent as its exponent
(one byte, MXFP8's E8M0). Bytes of a gather: n nb (32 + 1), a little over 1 per parameter,
a quarter of fp32's. A block holds consecutive elements of the rank's shard and starts at the
shard's first element, so the blocks are those of the serial run (one rank, the same codec)
when every shard's size is a multiple of 32; otherwise the blocks at a shard's edges mix
elements the serial run blocks with others, and round differently.
"""

from __future__ import annotations

import numpy as np

from refmp.runtime.backend import array_module
from refmp.runtime.fp8 import E4M3, MX_BLOCK, Quantized, dequantize, quantize_blocks


def gathered(group, buf):
    """Every rank's ``buf`` in rank order (alone: ``buf``, nothing sent)."""
    return group.allgather(buf) if group.size > 1 else buf


class FP8Gather:
    """The (n S,) weights from every rank's (S,) ``shard``, each rank's blocks dequantized."""

    block = MX_BLOCK
    scale_bytes = 1

    def allgather(self, group, shard):
        S = shard.size
        z = quantize_blocks(shard, E4M3, 0)  # q (nb, 32), exp (nb, 1)
        nb = z.q.shape[0]
        qs = gathered(group, z.q.view(np.uint8).reshape(-1))  # (n nb 32,) one byte a value
        exps = gathered(group, z.exp.reshape(-1))  # (n nb,) one byte a block
        q = qs.view(E4M3).reshape(group.size, nb, MX_BLOCK)
        e = exps.reshape(group.size, nb, 1)
        return array_module(shard).concatenate([dequantize(Quantized(q[r], e[r], (S,), 0, shard.dtype))
                               for r in range(group.size)])
