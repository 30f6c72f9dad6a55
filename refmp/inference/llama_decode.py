"""Greedy decoding of a Llama-family model with a grouped-query KV cache (refmp.nn.llama).

Shapes: B rows, t new tokens this call, n tokens cached (these included), NH query heads,
NKV key/value heads, HS head size, R = NH/NKV, L layers, V vocabulary.

The cache is refmp.inference.cache.KVCache with NKV heads: it keeps each layer's keys (after
their rotation: a cached key is never rotated again) and values once per key/value head, not
once per query head, so it is R times smaller than multi-head attention's:

    bytes = 2 (k and v) x L x B x tokens x NKV x HS x itemsize

Under tensor parallelism (refmp.parallel.tensor.llama) a rank caches the key/value heads it
holds: NKV/tp of them, or, when tp > NKV, the one head its query heads read (replicated on
tp/NKV ranks, so a rank's cache stops shrinking at one head).

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


def gqa_cache_bytes(cfg: LM.LlamaConfig, B: int, tokens: int, itemsize: int, tp: int = 1) -> int:
    """2 L B T NKV HS w: what a KVCache for ``tokens`` positions of B rows holds; on a tp
    rank, its max(NKV/tp, 1) heads."""
    kv = max(cfg.n_kv_head // tp, 1)
    return 2 * cfg.n_layer * B * tokens * kv * cfg.head_size * itemsize


class CachedGQA(LM.Ops):
    """The Ops ``base`` (the serial Ops, or tp's: its heads, its f and g) whose grouped-query
    attention reads layer ``layer``'s cache (forward only): appends this call's k, v and
    attends over all the cached tokens."""

    def __init__(self, base: LM.Ops, cache: KVCache, layer: int, slots: list[int]):
        super().__init__(base.n_head, base.n_kv_head)
        self.base = base
        self.cache = cache
        self.layer = layer
        self.slots = slots

    def enter(self, h):
        return self.base.enter(h)

    def leave(self, z):
        return self.base.leave(z)  # tp: the row-parallel sum

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


def forward_cached(model: LM.Llama, idx, cache: KVCache, ops: LM.Ops):
    """The logits (B, t, V) of the new tokens ``idx`` (B, t) after the cached ones, every
    layer's k, v appended to ``cache`` (which then counts them); ``ops``: the layout's."""
    xp = backend.array_module(model.params["wte.weight"])
    B, t = idx.shape
    slots = list(range(B))
    n = int(cache.length[0])
    cos, sin = model.rope(xp.arange(n, n + t))  # (t, HS): global positions
    x = model.params["wte.weight"][idx]  # (B, t, C)
    for i in range(model.cfg.n_layer):
        x, _ = LM.block_forward(block_params(model.params, i), x, model.cfg, cos, sin,
                                CachedGQA(ops, cache, i, slots), model.cfg.moe())
    for s in slots:
        cache.advance(s, t)
    logits, _ = LM.head_forward(model.params, x, model.cfg)
    return logits


def generate(model: LM.Llama, idx, max_new_tokens: int, use_cache: bool = True,
             ops: LM.Ops | None = None):
    """Greedy decoding: (tokens (B, T0 + max_new_tokens), the logits of each step's last
    position, a list of (B, V)), with the GQA cache or (``use_cache`` False) recomputing the
    whole prefix each step (the teaching baseline the cache must equal). ``ops``: the
    layout's (default serial; tp's TensorOps with ``model`` holding this rank's shards:
    the cache then holds this rank's key/value heads, or the one it replicates)."""
    xp = backend.array_module(model.params["wte.weight"])
    B, T0 = idx.shape
    cfg = model.cfg
    ops = model.ops() if ops is None else ops
    dtype = model.params["wte.weight"].dtype
    # the tokens it will hold: the prompt and every new token but the last (never fed back);
    # the key/value heads the Ops hold (all, or this tp rank's)
    cache = KVCache(range(cfg.n_layer), B, ops.n_kv_head, T0 + max_new_tokens - 1,
                    cfg.head_size, dtype)
    steps = []
    new = idx
    for _ in range(max_new_tokens):
        if use_cache:
            logits = forward_cached(model, new, cache, ops)[:, -1]  # (B, V)
        else:
            logits = model.forward(idx, ops=ops)[0][:, -1]
        steps.append(logits)
        new = logits.argmax(axis=-1)[:, None].astype(idx.dtype)  # (B, 1)
        idx = xp.concatenate([idx, new], axis=1)
    return idx, steps, cache
