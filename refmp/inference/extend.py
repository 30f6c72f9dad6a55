"""Extending cached requests by several tokens in one call: the pass that serving's additions
share (docs/serving.md). A prefix-cache hit prefills only the tokens after the cached blocks,
a chunk of a prompt joins a batch of decodes, and speculative decoding verifies gamma draft
tokens at once: each appends t tokens to a request that already holds n in its cache, and
the t queries attend over the n cached keys and, causally, over each other.

Shapes: N tokens of one call (every request's new tokens, one after another: a ragged batch
laid flat, as Sarathi-Serve and vLLM batch their prefill chunks with decodes), t a request's
new tokens in it, n the tokens its cache held before, NH heads here (n_head/tp), HS head
size, C channels, V vocabulary.

A call is a list of :class:`Segment`: a request's cache slot, where its tokens start in the
flat batch, and how many. The linears, the norms and the MLP act on each token alone, so the
flat batch (1, N, C) runs through the same Ops (tp, pp, ep) as any call; only attention is per
segment (:class:`ExtendAttention`): token i of a segment, at position n + i, attends over the
cached keys 0..n-1 and the segment's keys 0..i:

    y_i = softmax(q_i [K_cache; K_0..i]^T / sqrt(HS)) [V_cache; V_0..i]

The call is collective over the Decoder's tp, pp and ep ranks, which agree on the segments
(they depend on counts, never on token values); cp is not supported (each cp rank holds a
share of every request's tokens: refused where serving is asked for).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from refmp.distributed.waiting import wait
from refmp.inference.decoder import TAG_ACT, Decoder
from refmp.nn import gpt
from refmp.runtime import backend
from refmp.runtime.backend import array_module


class Segment(NamedTuple):
    """One request's tokens in a flat call: cache ``slot``, tokens ``start:start + t``."""

    slot: int
    start: int
    t: int


class ExtendAttention:
    """The attention core of one extend call on layer ``layer`` (the Ops' ``attn``)."""

    def __init__(self, cache, segments: list[Segment], layer: int):
        self.cache = cache
        self.segments = segments
        self.layer = layer

    def forward(self, qkv, n_head: int):
        _, N, C3 = qkv.shape  # (1, N, 3C/tp)
        hs = C3 // 3 // n_head
        q, k, v = qkv[0].reshape(N, 3, n_head, hs).transpose(1, 2, 0, 3)  # (NH, N, HS) each
        xp = array_module(qkv)
        segs, cache = self.segments, self.cache
        slots = [s.slot for s in segs]
        t = segs[0].t
        if all(s.t == t and s.start == b * t for b, s in enumerate(segs)) and cache.equal(slots):
            # equal rows, one after another: all at once
            at = xp.asarray([[s.start + j for j in range(s.t)] for s in segs])  # (B, t)
            qb, kb, vb = (a[:, at].transpose(1, 0, 2, 3) for a in (q, k, v))  # (B, NH, t, HS)
            cache.append_rows(self.layer, slots, kb, vb)
            kc, vc = cache.view_rows(self.layer, slots, extra=t)  # (B, NH, n + t, HS)
            y = causal_after(qb, kc, vc).transpose(0, 2, 1, 3)  # (B, t, NH, HS)
            return y.reshape(1, N, n_head * hs), None  # (1, N, C/tp): segments in order
        y = xp.zeros((n_head, N, hs), qkv.dtype)  # (NH, N, HS)
        for s in segs:
            new = slice(s.start, s.start + s.t)
            self.cache.append(self.layer, s.slot, k[:, new], v[:, new])
            kc, vc = self.cache.view(self.layer, s.slot, extra=s.t)  # (NH, n + t, HS)
            y[:, new] = causal_after(q[:, new], kc, vc)
        return y.transpose(1, 0, 2).reshape(1, N, n_head * hs), None  # (1, N, C/tp)


def causal_after(q, k, v):
    """q (..., NH, t, HS) of the last t of the n + t tokens of k, v (..., NH, n + t, HS):
    query i sees keys 0..n + i. Returns (..., NH, t, HS)."""
    xp = array_module(q)
    t, n = q.shape[-2], k.shape[-2] - q.shape[-2]
    s = (q @ k.swapaxes(-1, -2)) / math.sqrt(q.shape[-1])  # (..., NH, t, n + t)
    s += xp.triu(xp.full((t, n + t), -xp.inf, dtype=s.dtype), k=n + 1)  # key j > n + i hidden
    m = s.max(axis=-1, keepdims=True)  # (..., NH, t, 1)
    p = xp.exp(s - m)  # (..., NH, t, n + t)
    return (p @ v) / p.sum(axis=-1, keepdims=True)  # (..., NH, t, HS)


def extend(dec: Decoder, ids, positions, segments: list[Segment], at) -> object:
    """Run the flat batch through this rank's stage: ``ids`` (1, N) token ids (first stage;
    None elsewhere), ``positions`` (N,) their positions in their requests, ``segments`` the
    requests, ``at`` the flat indices whose logits are wanted. Appends every segment's keys
    and values to its slot and counts them. Returns the logits (len(at), V) on the last stage,
    None elsewhere (collective over tp, pp and ep)."""
    N = len(positions)
    where = backend.from_host(np.asarray(positions))
    last_chunk = dec.placed.pp * dec.placed.v - 1
    x = None
    for c, blocks in dec.chunks.items():  # in model order, as Decoder.forward runs them
        if c == 0:
            p = {k: dec.params[k] for k in ("wte.weight", "wpe.weight")}
            x, _ = dec._ops(where).embed(p, ids)  # (1, N, C)
        elif c - 1 not in dec.chunks:  # the chunk before ran on another rank
            x = dec.pp.recv((1, N, dec.mcfg.n_embd), dec.dtype, dec.placed.rank(c - 1), TAG_ACT)
        for i in blocks:
            ops = dec._ops(where, ExtendAttention(dec.cache, segments, i))
            x, _ = gpt.block_forward(gpt.block_params(dec.params, i), x, ops,
                                     dec.moe if dec.mcfg.is_moe(i) else None)
        if c + 1 not in dec.chunks and c != last_chunk:  # the next chunk is another rank's
            x = array_module(x).ascontiguousarray(x)
            wait(dec.pp.send(x, dec.placed.rank(c + 1), TAG_ACT))
    for s in segments:
        dec.cache.advance(s.slot, s.t)
    if not dec.last:
        return None
    rows = x[0, list(at)][:, None]  # (len(at), 1, C): each wanted token a row of the head
    return dec._logits(dec._ops(where), rows)  # (len(at), V)


def flat(requests: list[tuple[int, list[int], int]]):
    """The flat batch of ``requests``, each (slot, its new tokens, the position of the
    first): ids (1, N), positions (N,), the segments, the flat index of each one's last
    token."""
    ids, positions, segments, last = [], [], [], []
    for slot, tokens, pos in requests:
        segments.append(Segment(slot, len(ids), len(tokens)))
        ids += tokens
        positions += range(pos, pos + len(tokens))
        last.append(len(ids) - 1)
    return np.array([ids], dtype=np.int64), np.array(positions), segments, last
