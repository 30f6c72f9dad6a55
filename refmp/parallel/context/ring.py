"""Ring attention: key/value blocks travel around the cp ranks (Liu et al. 2023).

Shapes: B batch (this dp rank's rows), T sequence, Tl = T/cp tokens on this rank, c chunk
length, NH heads, HS head size, C = NH*HS; cp context-parallel ranks.

Every rank keeps its queries and, step by step, sees every other rank's keys and values:

    step i:  rank r holds the K/V block of rank (r - i) mod cp,
             starts sending it on to rank r+1 and receiving the next from rank r-1,
             computes its queries' attention over the block it holds (overlapped),
             merges the result into its running (y, lse) with the online-softmax rule.

After cp steps (cp-1 transfers) every query has attended over the whole sequence. The merge
(``refmp.nn.blockwise.attention_merge``) is exact: with lse the log-sum-exp of a row's scores,

    lse = log(e^lse1 + e^lse2),   y = e^(lse1 - lse) y1 + e^(lse2 - lse) y2.

Causal masking works chunk by chunk (SequenceChunks): query chunk a sees key chunk b in full
when b < a, with the causal triangle when b == a, and not at all when b > a (skipped).

Backward (FlashAttention-2's block gradient, ``attention_block_backward``) needs the merged
y and lse of each query row, kept from the forward. The K/V blocks travel the ring once more
(cp-1 transfers; keeping them from the forward would cost the memory ring attention saves),
and the gradient dK/dV of each block travels with it, collecting every rank's share, until
it arrives home (cp-1 more transfers): rank r's own share is added last.
"""

from __future__ import annotations

import math

from refmp.distributed.comm import Comm
from refmp.distributed.waiting import wait, wait_all
from refmp.nn import blockwise as BW
from refmp.parallel.context.chunks import SequenceChunks
from refmp.runtime import backend

TAG_KV, TAG_DKV = 11, 12


class RingAttention:
    """Causal attention over a sequence sharded on ``comm`` (the cp axis) as ``seq`` says.

    ``forward(qkv, n_head)`` / ``backward(dout, cache)`` have the signatures of
    ``refmp.nn.layers.attention_forward`` / ``attention_backward``, on this rank's tokens.
    ``flops`` counts the attention FLOPs this rank executes in the forward (4 B NH Tq Tk HS
    per block: q k^T and p v).
    """

    def __init__(self, comm: Comm, seq: SequenceChunks):
        self.comm = comm
        self.seq = seq
        self.own_chunks = seq.chunks(comm.rank)  # my chunk ids, in the order my tokens are held
        self.flops = 0

    def pairs(self, src: int):
        """(query slot, key slot, causal) for the chunk pairs that are not fully masked."""
        for a_slot, a in enumerate(self.own_chunks):
            for b_slot, b in enumerate(self.seq.chunks(src)):
                if b <= a:  # b > a: the whole block lies above the diagonal, skipped
                    yield a_slot, b_slot, a == b

    def _ring(self, kv, tag):
        """Yield (step, source rank, K/V block), passing each block on to rank r+1 while the
        caller computes with it. cp-1 transfers: the last block stays where it is."""
        cp, r = self.comm.size, self.comm.rank
        for i in range(cp):
            if i < cp - 1:  # send what I hold on, receive the next block (nonblocking)
                send = self.comm.send(kv, (r + 1) % cp, tag)
                nxt, recv = self.comm.recv_start(kv.shape, kv.dtype, (r - 1) % cp, tag)
            yield i, (r - i) % cp, kv  # compute with kv while it travels
            if i < cp - 1:
                wait_all([send, recv])
                kv = nxt  # a new buffer each step: nothing aliases a buffer in flight

    def forward(self, qkv, n_head: int):
        xp = backend.array_module(qkv)
        B, Tl, C3 = qkv.shape
        hs = C3 // 3 // n_head
        c = self.seq.c
        scale = 1.0 / math.sqrt(hs)
        qkv = qkv.reshape(B, Tl, 3, n_head, hs).transpose(2, 0, 3, 1, 4)  # (3, B, NH, Tl, HS)
        q = xp.ascontiguousarray(qkv[0])  # (B, NH, Tl, HS) stays here
        kv = xp.ascontiguousarray(qkv[1:])  # (2, B, NH, Tl, HS) travels around the ring
        y = xp.zeros_like(q)  # (B, NH, Tl, HS) running output
        lse = xp.full(q.shape[:-1], -xp.inf, dtype=q.dtype)  # (B, NH, Tl) nothing seen yet
        for _, src, blk in self._ring(kv, TAG_KV):
            for a, b, causal in self.pairs(src):
                qa, kb = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
                yb, lb = BW.attention_block_forward(q[:, :, qa], blk[0][:, :, kb], blk[1][:, :, kb],
                                                   scale, causal)  # (B, NH, c, HS), (B, NH, c)
                # the online-softmax merge of this block into the rows' running result
                y[:, :, qa], lse[:, :, qa] = BW.attention_merge(y[:, :, qa], lse[:, :, qa], yb, lb)
                self.flops += 4 * B * n_head * c * c * hs
        out = y.transpose(0, 2, 1, 3).reshape(B, Tl, n_head * hs)  # (B, Tl, C)
        return out, (q, kv, y, lse, scale)

    def backward(self, dout, cache):
        q, kv, y, lse, scale = cache
        xp = backend.array_module(dout)
        cp, r = self.comm.size, self.comm.rank
        B, NH, Tl, HS = q.shape
        c = self.seq.c
        dy = dout.reshape(B, Tl, NH, HS).transpose(0, 2, 1, 3)  # (B, NH, Tl, HS)
        dq = xp.zeros_like(q)  # (B, NH, Tl, HS)
        sends = []  # dK/dV sends stay in flight (their buffers alive) until the end
        for i, src, blk in self._ring(kv, TAG_KV):
            dkv = xp.zeros_like(blk)  # (2, B, NH, Tl, HS) my share of src's dK, dV
            for a, b, causal in self.pairs(src):
                qa, kb = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
                dqa, dkb, dvb = BW.attention_block_backward(
                    dy[:, :, qa], q[:, :, qa], blk[0][:, :, kb], blk[1][:, :, kb],
                    y[:, :, qa], lse[:, :, qa], scale, causal)
                dq[:, :, qa] += dqa
                dkv[0][:, :, kb] += dkb
                dkv[1][:, :, kb] += dvb
            if i == 0:
                dkv_own = dkv  # my own block's share: added when the rest comes home
                continue
            if i > 1:  # the shares of ranks src+1 .. r-1, from rank r-1
                dkv += self.comm.recv(dkv.shape, dkv.dtype, (r - 1) % cp, TAG_DKV)
            sends.append(self.comm.send(dkv, (r + 1) % cp, TAG_DKV))  # on towards src
        if cp > 1:  # every other rank's share of my block's gradient, home at last
            dkv_own += self.comm.recv(dkv_own.shape, dkv_own.dtype, (r - 1) % cp, TAG_DKV)
        for s in sends:
            wait(s)
        dqkv = xp.concatenate([dq[None], dkv_own])  # (3, B, NH, Tl, HS)
        return dqkv.transpose(1, 3, 0, 2, 4).reshape(B, Tl, 3 * NH * HS)  # (B, Tl, 3C)
