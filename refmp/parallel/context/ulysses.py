"""All-to-all context parallelism, DeepSpeed-Ulysses (Jacobs et al. 2023).

Shapes: B batch (this dp rank's rows), T sequence, Tl = T/cp tokens on this rank, NH heads,
HS head size, C = NH*HS; cp context-parallel ranks, NH/cp heads per rank after the exchange.

Attention mixes tokens but not heads, so trade one sharding for the other around it:

    (B, Tl, 3C) sequence-sharded --all-to-all--> (B, T, 3C/cp) head-sharded
    serial causal attention on NH/cp heads over the whole sequence (refmp.nn.layers)
    (B, T, C/cp) head-sharded    --all-to-all--> (B, Tl, C) sequence-sharded

The backward pass is the same two exchanges in reverse (the gradient of an all-to-all is the
opposite all-to-all): four all-to-alls per layer, of b*Tl*3C and b*Tl*C elements per rank.
NH must be divisible by cp. Tokens arrive grouped by rank (rank 0's chunks, rank 1's, ...);
a fixed permutation puts them in sequence order for the causal mask, and back afterwards.
"""

from __future__ import annotations

import numpy as np

from refmp.distributed.comm import Comm
from refmp.nn import fast as L  # refmp.nn.layers' formulas, run fast (refmp.nn.fast)
from refmp.runtime import backend


def to_heads(comm: Comm, a, B, Tl, width):
    """(B, Tl, n*width) my tokens, all n head groups -> (B, n*Tl, width) the tokens of the n
    ranks of ``comm``, in rank order, my head group: one all-to-all."""
    n = comm.size
    send = a.reshape(B, Tl, n, width).transpose(2, 0, 1, 3)  # (n, B, Tl, width) by dest
    got = comm.alltoall(backend.xp.ascontiguousarray(send))  # (n, B, Tl, width) by src
    return got.transpose(1, 0, 2, 3).reshape(B, n * Tl, width)


def to_sequence(comm: Comm, a, B, Tl, width):
    """to_heads' inverse: (B, n*Tl, width) the n ranks' tokens in rank order, my head group ->
    (B, Tl, n*width) my tokens, all head groups."""
    n = comm.size
    send = a.reshape(B, n, Tl, width).transpose(1, 0, 2, 3)  # (n, B, Tl, width) by dest
    got = comm.alltoall(backend.xp.ascontiguousarray(send))  # (n, B, Tl, width) by group
    return got.transpose(1, 2, 0, 3).reshape(B, Tl, n * width)


class UlyssesAttention:
    """``forward(qkv, n_head)`` / ``backward(dout, cache)``, as refmp.nn.layers' attention."""

    def __init__(self, comm: Comm, seq, keep_scores: bool = True):
        self.comm = comm
        self.seq = seq
        self.keep_scores = keep_scores  # False: selective recomputation of the softmax
        rank_major = np.concatenate([seq.positions(j) for j in range(comm.size)])  # (T,)
        self.by_rank = backend.from_host(rank_major)  # natural-order index of each rank-major slot
        self.to_natural = backend.from_host(np.argsort(rank_major))  # and its inverse

    def _to_heads(self, a, B, Tl, width):
        """(B, Tl, cp*width) my tokens, all head groups -> (B, T, width) all tokens in sequence
        order, my group."""
        return to_heads(self.comm, a, B, Tl, width)[:, self.to_natural]

    def _to_sequence(self, a, B, Tl, width):
        """(B, T, width) all tokens in sequence order, my group -> (B, Tl, cp*width) my
        tokens, all groups."""
        return to_sequence(self.comm, a[:, self.by_rank], B, Tl, width)

    def forward(self, qkv, n_head: int):
        cp = self.comm.size
        B, Tl, C3 = qkv.shape
        nh, hs = n_head // cp, C3 // 3 // n_head
        # (B, Tl, 3, NH, HS) -> (B, Tl, cp, 3*NH/cp*HS): group g's q, k, v side by side
        grouped = qkv.reshape(B, Tl, 3, cp, nh * hs).transpose(0, 1, 3, 2, 4)
        full = self._to_heads(grouped, B, Tl, 3 * nh * hs)  # (B, T, 3C/cp) all-to-all #1
        y, cache = L.attention_forward(full, nh, self.keep_scores)  # (B, T, C/cp) the serial layer, my heads
        out = self._to_sequence(y, B, Tl, nh * hs)  # (B, Tl, C) all-to-all #2
        return out, (cache, nh)

    def backward(self, dout, cache):
        cache, nh = cache
        B, Tl, C = dout.shape
        cp, hs = self.comm.size, C // (nh * self.comm.size)
        dy = self._to_heads(dout, B, Tl, nh * hs)  # (B, T, C/cp) all-to-all #3, mirrors #2
        dfull = L.attention_backward(dy, cache)  # (B, T, 3C/cp)
        dgrouped = self._to_sequence(dfull, B, Tl, 3 * nh * hs)  # (B, Tl, cp*3C/cp) #4, mirrors #1
        # forward was: grouped = qkv.reshape(B, Tl, 3, cp, nh*hs).transpose(0, 1, 3, 2, 4)
        dqkv = dgrouped.reshape(B, Tl, cp, 3, nh * hs).transpose(0, 1, 3, 2, 4)  # (B, Tl, 3, cp, .)
        return dqkv.reshape(B, Tl, 3 * C)  # (B, Tl, 3C)
