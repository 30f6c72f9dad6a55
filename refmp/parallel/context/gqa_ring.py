"""Ring attention for grouped-query attention: the K/V blocks travel with NKV heads.

Shapes: B rows, Tl = T/cp tokens on this rank, c chunk length, NH query heads, NKV key/value
heads, R = NH/NKV, HS head size; cp context-parallel ranks.

refmp.parallel.context.ring passes each rank's K/V block around the ring; under grouped-query
attention that block is k and v of NKV heads, R times smaller than the NH heads' the queries
use. So the block travels as it is, and each rank repeats it to NH heads only where it
computes (``repeat_kv``, a view-sized copy per block pair), summing the copies' gradients
back onto the NKV heads (``unrepeat_kv``) before the gradient block travels home. Every
transfer (cp - 1 forward, cp - 1 of K/V again and cp - 1 of their gradients backward) moves

    2 x B x NKV x Tl x HS x itemsize    bytes (R times fewer than repeating before the ring).

Same schedule, masks and merge as RingAttention, whose ring and chunk pairs this reuses.
"""

from __future__ import annotations

import math

from refmp.distributed.waiting import wait
from refmp.nn import blockwise as BW
from refmp.nn.llama_layers import repeat_kv, unrepeat_kv
from refmp.parallel.context.ring import TAG_DKV, TAG_KV, RingAttention
from refmp.runtime import backend


class GQARingAttention(RingAttention):
    """Causal grouped-query attention over a sequence sharded on ``comm`` as ``seq`` says:
    the core of refmp.nn.llama_layers.gqa_forward (forward(q, k, v), backward(dy, cache))."""

    def forward(self, q, k, v):
        """q (B, NH, Tl, HS), k, v (B, NKV, Tl, HS) -> y (B, NH, Tl, HS)."""
        xp = backend.array_module(q)
        B, NH, Tl, HS = q.shape
        r = NH // k.shape[1]
        c = self.seq.c
        scale = 1.0 / math.sqrt(HS)
        q = xp.ascontiguousarray(q)
        kv = xp.ascontiguousarray(xp.stack([k, v]))  # (2, B, NKV, Tl, HS) travels
        y = xp.zeros_like(q)  # (B, NH, Tl, HS) running output
        lse = xp.full(q.shape[:-1], -xp.inf, dtype=q.dtype)  # (B, NH, Tl)
        for _, src, blk in self._ring(kv, TAG_KV):
            for a, b, causal in self.pairs(src):
                qa, kb = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
                kr = repeat_kv(blk[0][:, :, kb], r)  # (B, NH, c, HS) repeated here only
                vr = repeat_kv(blk[1][:, :, kb], r)
                yb, lb = BW.attention_block_forward(q[:, :, qa], kr, vr, scale, causal)
                y[:, :, qa], lse[:, :, qa] = BW.attention_merge(y[:, :, qa], lse[:, :, qa], yb, lb)
                self.flops += 4 * B * NH * c * c * HS
        return y, (q, kv, y, lse, scale, r)

    def backward(self, dy, cache):
        """dy (B, NH, Tl, HS) -> dq (B, NH, Tl, HS), dk, dv (B, NKV, Tl, HS)."""
        q, kv, y, lse, scale, r = cache
        xp = backend.array_module(dy)
        cp, rank = self.comm.size, self.comm.rank
        c = self.seq.c
        dq = xp.zeros_like(q)
        sends = []
        for i, src, blk in self._ring(kv, TAG_KV):
            dkv = xp.zeros_like(blk)  # (2, B, NKV, Tl, HS) my share of src's dK, dV
            for a, b, causal in self.pairs(src):
                qa, kb = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
                dqa, dkb, dvb = BW.attention_block_backward(
                    dy[:, :, qa], q[:, :, qa], repeat_kv(blk[0][:, :, kb], r),
                    repeat_kv(blk[1][:, :, kb], r), y[:, :, qa], lse[:, :, qa], scale, causal)
                dq[:, :, qa] += dqa
                dkv[0][:, :, kb] += unrepeat_kv(dkb, r)  # the copies' gradients, summed
                dkv[1][:, :, kb] += unrepeat_kv(dvb, r)
            if i == 0:
                dkv_own = dkv
                continue
            if i > 1:
                dkv += self.comm.recv(dkv.shape, dkv.dtype, (rank - 1) % cp, TAG_DKV)
            sends.append(self.comm.send(dkv, (rank + 1) % cp, TAG_DKV))
        if cp > 1:
            dkv_own += self.comm.recv(dkv_own.shape, dkv_own.dtype, (rank - 1) % cp, TAG_DKV)
        for s in sends:
            wait(s)
        return dq, dkv_own[0], dkv_own[1]
