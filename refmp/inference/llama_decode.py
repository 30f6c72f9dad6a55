"""Greedy decoding of a Llama-family model with a grouped-query KV cache (refmp.nn.llama).

Shapes: B rows, t new tokens this call, n tokens cached (these included), NH query heads,
NKV key/value heads, HS head size, R = NH/NKV, L layers, V vocabulary.

The cache is refmp.inference.cache.KVCache with NKV heads: it keeps each layer's keys (after
their rotation: a cached key is never rotated again) and values once per key/value head, not
once per query head, so it is R times smaller than multi-head attention's:

    bytes = 2 (k and v) x L x B x tokens x NKV x HS x itemsize

A decode step runs refmp.nn.llama.block_forward with the Ops :class:`CachedGQA`:
the new tokens' q, k, v at their global positions (their own rotary tables), k and v
appended, and q attending over every cached token (query j of the t new ones sits at
position n - t + j and sees the keys up to it).
"""

from __future__ import annotations

import math

from refmp.inference.cache import KVCache
from refmp.nn import llama as LM
from refmp.nn import llama_layers as LL
from refmp.nn.params import block_params
from refmp.runtime import backend


def gqa_cache_bytes(cfg: LM.LlamaConfig, B: int, tokens: int, itemsize: int) -> int:
    """2 L B T NKV HS w: what a KVCache for ``tokens`` positions of B rows holds."""
    return 2 * cfg.n_layer * B * tokens * cfg.n_kv_head * cfg.head_size * itemsize


class CachedGQA(LM.Ops):
    """The serial Ops whose grouped-query attention reads layer ``layer``'s cache (forward
    only): appends this call's k, v and attends over all the cached tokens."""

    def __init__(self, cfg: LM.LlamaConfig, cache: KVCache, layer: int, slots: list[int]):
        super().__init__(cfg.n_head, cfg.n_kv_head)
        self.cache = cache
        self.layer = layer
        self.slots = slots

    def attention(self, q, k, v, cos, sin):
        xp = backend.array_module(q)
        n_head, n_kv_head = self.n_head, self.n_kv_head
        t = q.shape[1]
        r = n_head // n_kv_head
        qh = LL.rope_forward(LL.heads(q, n_head), cos, sin)  # (B, NH, t, HS)
        kh = LL.rope_forward(LL.heads(k, n_kv_head), cos, sin)  # (B, NKV, t, HS)
        self.cache.append_rows(self.layer, self.slots, kh, LL.heads(v, n_kv_head))
        K, V = self.cache.view_rows(self.layer, self.slots, extra=t)  # (B, NKV, n, HS)
        n = K.shape[2]
        s = qh @ LL.repeat_kv(K, r).transpose(0, 1, 3, 2)  # (B, NH, t, n)
        s *= 1.0 / math.sqrt(qh.shape[-1])
        # query j is at position n - t + j: it sees keys 0 .. n - t + j
        s += xp.triu(xp.full((t, n), -xp.inf, dtype=s.dtype), k=n - t + 1)
        s -= s.max(axis=-1, keepdims=True)
        att = xp.exp(s)
        att /= att.sum(axis=-1, keepdims=True)  # (B, NH, t, n)
        return LL.merge_heads(att @ LL.repeat_kv(V, r)), None  # (B, t, NH HS)


def forward_cached(model: LM.Llama, idx, cache: KVCache):
    """The logits (B, t, V) of the new tokens ``idx`` (B, t) after the cached ones, every
    layer's k, v appended to ``cache`` (which then counts them)."""
    xp = backend.array_module(model.params["wte.weight"])
    B, t = idx.shape
    slots = list(range(B))
    n = int(cache.length[0])
    cos, sin = model.rope(xp.arange(n, n + t))  # (t, HS): global positions
    x = model.params["wte.weight"][idx]  # (B, t, C)
    for i in range(model.cfg.n_layer):
        x, _ = LM.block_forward(block_params(model.params, i), x, model.cfg, cos, sin,
                                CachedGQA(model.cfg, cache, i, slots))
    for s in slots:
        cache.advance(s, t)
    logits, _ = LM.head_forward(model.params, x, model.cfg)
    return logits


def generate(model: LM.Llama, idx, max_new_tokens: int, use_cache: bool = True):
    """Greedy decoding: (tokens (B, T0 + max_new_tokens), the logits of each step's last
    position, a list of (B, V)), with the GQA cache or (``use_cache`` False) recomputing the
    whole prefix each step (the teaching baseline the cache must equal)."""
    xp = backend.array_module(model.params["wte.weight"])
    B, T0 = idx.shape
    cfg = model.cfg
    dtype = model.params["wte.weight"].dtype
    # the tokens it will hold: the prompt and every new token but the last (never fed back)
    cache = KVCache(range(cfg.n_layer), B, cfg.n_kv_head, T0 + max_new_tokens - 1,
                    cfg.head_size, dtype)
    steps = []
    new = idx
    for _ in range(max_new_tokens):
        if use_cache:
            logits = forward_cached(model, new, cache)[:, -1]  # (B, V)
        else:
            logits = model.forward(idx)[0][:, -1]
        steps.append(logits)
        new = logits.argmax(axis=-1)[:, None].astype(idx.dtype)  # (B, 1)
        idx = xp.concatenate([idx, new], axis=1)
    return idx, steps, cache
