"""The attention core of a decoder call, and the Ops that run a call's linears row by row.

Shapes: B rows (requests) on this rank, t tokens of one call (the prompt's Tl = T0/cp in a
prefill, 1 in a decode step), NH heads here (n_head/tp), NKV the key/value heads the cache
keeps (NH for GPT-2; fewer under grouped-query attention), HS head size, C channels.

A Decoder call (refmp.inference.decoder) runs its stage's blocks through the Ops training
builds, with one piece swapped: the attention core, :class:`CachedAttention`, which appends
the new keys and values to the KV cache and attends over everything this rank holds. What it
needs of the call comes in a :class:`Call`, a frozen record the Decoder makes once per call;
the core reads nothing else of the Decoder.

With cp, a decode step's new query attends on every cp rank over the keys that rank holds,
and the partial results merge by log-sum-exp (refmp.nn.blockwise.attention_merge, as ring
attention merges its blocks): one all-gather of (B, NH, 1, HS + 1) per layer.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from refmp.distributed.comm import Comm
from refmp.nn import blockwise as BW
from refmp.nn import fast as L  # refmp.nn.layers' formulas, run fast (refmp.nn.fast)
from refmp.nn.llama_layers import repeat_kv
from refmp.parallel.context.ring import RingAttention
from refmp.runtime.backend import array_module


class Call(NamedTuple):
    """One decoder call, as its attention cores see it."""

    cache: object  # this rank's KV cache (refmp.inference.cache: KVCache or PagedKVCache)
    cp: Comm  # the cp ranks whose partial attentions a decode step merges (size 1: none)
    slots: list[int]  # each row's cache slot (-1: a free slot, skipped)
    prefill: bool  # the prompts (t tokens a row), else one decode step (1 token a row)
    ring: RingAttention | None  # prefill over cp: ring attention of the prompts' chunks
    owns: np.ndarray | None  # decode: (B,) whether this cp rank keeps each row's new token


class CachedAttention:
    """The attention core of one decoder call on layer ``layer`` (the Ops' ``attn``,
    refmp.parallel.ops: ``forward(qkv, n_head)`` like refmp.nn.layers.attention_forward)."""

    def __init__(self, call: Call, layer: int):
        self.call = call
        self.layer = layer

    def forward(self, qkv, n_head: int):
        call = self.call
        B, t, C3 = qkv.shape
        hs = C3 // 3 // n_head
        if call.prefill:
            if call.ring is None:  # the serial core on the whole prompt, as training runs it
                out, attn = L.attention_forward(qkv, n_head)
                k, v = attn.k, attn.v  # (B, NH, t, HS)
            else:  # ring attention over the cp ranks' chunks; kv (2, B, NH, Tl, HS)
                out, (_, kv, _, _, _) = call.ring.forward(qkv, n_head)
                k, v = kv[0], kv[1]
            call.cache.append_rows(self.layer, call.slots, k, v)
            return out, None
        q, k, v = qkv.reshape(B, 1, 3, n_head, hs).transpose(2, 0, 3, 1, 4)  # (B, NH, 1, HS)
        y = self.decode(q, k, v)  # (B, NH, 1, HS)
        return y.transpose(0, 2, 1, 3).reshape(B, 1, n_head * hs), None  # (B, 1, C/tp)

    def decode(self, q, k, v):
        """One decode step on heads: the new token's q (B, NH, 1, HS) over every cached key,
        its k, v (B, NKV, 1, HS) appended where this cp rank keeps them. NKV = NH, or fewer
        (grouped-query attention: query head h reads cached head h // (NH/NKV)). Returns
        y (B, NH, 1, HS), the cp ranks' partial attentions merged."""
        call = self.call
        B, n_head, _, hs = q.shape
        together = min(call.slots) >= 0 and len(set(call.owns.tolist())) == 1 and \
            call.cache.equal(call.slots)  # a batch of equal prompts
        y, lse = self._rows(q, k, v) if together else self._row_by_row(q, k, v)
        cp = call.cp
        if cp.size > 1:  # merge the cp ranks' partial attentions, in rank order
            xp = array_module(y)
            got = cp.allgather(xp.concatenate([y, lse[..., None]], axis=-1))
            got = got.reshape(cp.size, B, n_head, 1, hs + 1)
            y, lse = got[0, ..., :hs], got[0, ..., hs]
            for r in range(1, cp.size):
                y, lse = BW.attention_merge(y, lse, got[r, ..., :hs], got[r, ..., hs])
        return y

    def _rows(self, q, k, v):
        """Every row at once (rows of equal lengths, all kept here or none): y (B, NH, 1, HS)
        and lse (B, NH, 1), each (row, head) the same product as row by row."""
        call, i = self.call, self.layer
        own = bool(call.owns[0])
        if own:  # this rank keeps the new tokens' k, v (round robin over cp)
            call.cache.append_rows(i, call.slots, k, v)
        kc, vc = call.cache.view_rows(i, call.slots, extra=int(own))  # (B, NKV, n, HS)
        r = q.shape[1] // kc.shape[1]
        return BW.attention_block_forward(q, grouped(kc, r), grouped(vc, r),
                                          1.0 / math.sqrt(q.shape[-1]))

    def _row_by_row(self, q, k, v):
        """One row at a time: rows of other lengths, free slots (-1) skipped."""
        call, i = self.call, self.layer
        xp = array_module(q)
        B, n_head, _, hs = q.shape
        y = xp.zeros((B, n_head, 1, hs), q.dtype)
        lse = xp.full((B, n_head, 1), -np.inf, q.dtype)
        for b, slot in enumerate(call.slots):
            if slot < 0:  # a free slot of a continuous batch: nothing to attend over
                continue
            own = bool(call.owns[b])
            if own:  # this rank keeps the new token's k, v (round robin over cp)
                call.cache.append(i, slot, k[b], v[b])
            kc, vc = call.cache.view(i, slot, extra=int(own))  # (NKV, n, HS)
            r = n_head // kc.shape[0]
            y[b], lse[b] = BW.attention_block_forward(q[b : b + 1], grouped(kc[None], r),
                                                      grouped(vc[None], r), 1.0 / math.sqrt(hs))
        return y, lse


def grouped(kv, r: int):
    """Cached keys or values (B, NKV, n, HS) for NH = NKV r query heads: each head r times
    (refmp.nn.llama_layers.repeat_kv); as they are when r is 1 (multi-head attention)."""
    return kv if r == 1 else repeat_kv(kv, r)


class RowByRow:
    """A decoder call's Ops (what refmp.nn.gpt.block_forward calls of them) with linears that
    run one row at a time: a row's product is then the same BLAS call whatever rows share
    its batch (continuous batching's bitwise promise; BLAS may round a row of a larger
    product by its place in a tile)."""

    def __init__(self, ops):
        self.ops = ops

    def column(self, x, w, b):
        return self._rows(self.ops.column, x, w, b)

    def row(self, x, w, b):
        return self._rows(self.ops.row, x, w, b)

    def attention(self, qkv):
        return self.ops.attention(qkv)

    def _rows(self, linear, x, w, b):
        if x.shape[0] == 1:
            return linear(x, w, b)
        rows = [linear(x[i : i + 1], w, b)[0] for i in range(len(x))]
        return array_module(x).concatenate(rows), None
