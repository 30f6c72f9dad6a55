"""Continuous batching with chunked prefill and prefix caching (docs/serving.md).

Shapes: S slots (``--max-batch``), c tokens per prefill chunk, T0 a request's prompt tokens,
N tokens of one turn (every busy slot's new tokens, laid flat: refmp.inference.extend), V
vocabulary.

Each turn runs one flat batch through the model: every decoding slot's newest token and, for
every slot still prefilling, the next c tokens of its prompt (Sarathi-Serve, Agrawal et al.
2024: a long prompt no longer holds the decodes up for a whole prefill; c = None prefills a
prompt in one piece). A slot picks a token when its row's last token is its prompt's last or a
decoded one. Before its first chunk, a request admitted into a free slot takes the cached
blocks of its longest cached prefix (``prefix``: refmp.inference.prefix) and prefills only the
rest; a prompt's blocks are keyed as soon as a chunk fills them, so a request may share the
prefix of one still prefilling. What a turn runs depends on the arrivals, the counts and the
prompts, all known on every rank, never on the tokens picked: the ranks agree on every turn
without talking.

Every turn is one pass through all the stages, the picked tokens broadcast back over pp (B
int64): with pp > 1 the stages take turns (a bubble that refmp.inference.scheduler's groups
in flight avoid; chunking and prefix matching are independent of it).

A request's tokens are those of the same request prefilled in one piece, whatever c and
whatever the cache matched: chunk i of a prompt attends over the cached keys of chunks 0..i-1
and causally over its own, the same sums as the whole prompt's causal attention in another
order (the logits agree to rounding, tests/test_serving.py).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from refmp.errors import ConfigError
from refmp.inference.decoder import Decoder
from refmp.inference.extend import extend, flat
from refmp.inference.prefix import PrefixCache
from refmp.inference.sampling import Sampler
from refmp.inference.scheduler import Request, check_requests


class Turns(NamedTuple):
    """What :func:`serve_chunked` returns: per request tokens (T0 + N,) and logits (N, V)
    (every rank has the tokens; the logits on the last stage, None elsewhere), the turns
    run, the prompt tokens prefilled and those the prefix cache saved, the seconds."""

    tokens: list
    logits: list | None
    turns: int
    prefilled: int
    saved: int
    seconds: float


def serve_chunked(dec: Decoder, requests: list[Request], sampler: Sampler, slots: int,
                  block_size: int | None = None, chunk: int | None = None,
                  prefix: bool = False, ids=None) -> Turns:
    """Serve ``requests`` in ``slots`` slots, prefilling in chunks of ``chunk`` tokens (None:
    whole prompts), sharing cached prompt blocks if ``prefix`` (a paged cache of
    ``block_size``-token blocks). Collective over the Decoder's tp, pp and ep ranks."""
    ids = list(range(len(requests))) if ids is None else list(ids)
    check_requests(requests, dec.mcfg.block_size)
    if chunk is not None and chunk < 1:
        raise ConfigError(f"--prefill-chunk must be at least 1, got {chunk}")
    if prefix and block_size is None:
        raise ConfigError("--prefix-cache shares blocks of a paged cache: give --kv-block-size")
    longest = max(len(r.prompt) + r.max_new_tokens - 1 for r in requests)
    if prefix:  # room for every slot at once, and the evicted blocks of finished requests
        n_blocks = slots * -(-longest // block_size)
        dec.use_cache(PrefixCache(dec.blocks, slots, dec.nh, n_blocks, block_size,
                                  dec.mcfg.n_embd // dec.mcfg.n_head, dec.dtype))
    else:
        dec.new_cache(slots, longest, block_size)
    waiting = sorted(range(len(requests)), key=lambda i: (requests[i].arrival, i))
    where: list[int | None] = [None] * slots  # slot -> request
    fed = [0] * slots  # prompt tokens in the slot's cache
    tokens = [list(r.prompt) for r in requests]
    kept = [[] for _ in requests]
    prefilled, turn = 0, 0
    t0 = time.perf_counter()
    while waiting or any(w is not None for w in where):
        for s in range(slots):  # admit, matching cached prefixes
            if where[s] is None and waiting and requests[waiting[0]].arrival <= turn:
                where[s] = waiting.pop(0)
                prompt = requests[where[s]].prompt
                fed[s] = dec.cache.match(s, prompt) if prefix else 0
        rows, picking = [], []  # (slot, new tokens, first position); (slot, request)
        for s in range(slots):
            i = where[s]
            if i is None:
                continue
            prompt = requests[i].prompt
            if fed[s] < len(prompt):  # prefilling: the next chunk
                n = len(prompt) - fed[s] if chunk is None else min(chunk, len(prompt) - fed[s])
                rows.append((s, prompt[fed[s] : fed[s] + n], fed[s]))
                fed[s] += n
                prefilled += n
                if fed[s] == len(prompt):
                    picking.append((s, i))
            else:  # decoding: the newest token in
                rows.append((s, tokens[i][-1:], len(tokens[i]) - 1))
                picking.append((s, i))
        turn += 1
        if not rows:
            continue
        x, positions, segments, last = flat(rows)
        at = [last[k] for k, (s, *_) in enumerate(rows) if any(s == p for p, _ in picking)]
        logits = extend(dec, x if dec.first else None, positions, segments, at)
        if prefix:  # the prompt blocks this turn filled: later requests may share them
            for s, _, _ in rows:
                if where[s] is not None:
                    dec.cache.register(s, requests[where[s]].prompt[: fed[s]])
        picked = np.zeros(len(picking), dtype=np.int64)
        for k, (_, i) in enumerate(picking if dec.last else ()):
            j = len(tokens[i]) - len(requests[i].prompt)
            picked[k] = sampler.pick(logits[k][None], [ids[i]], j)[0]
            kept[i].append(logits[k])
        if dec.pp.size > 1:  # every stage learns the tokens (the first feeds them next turn)
            picked = dec.pp.bcast(picked, root=dec.last_rank)
        for (s, i), tok in zip(picking, picked.tolist(), strict=True):
            tokens[i].append(tok)
            if len(tokens[i]) == len(requests[i].prompt) + requests[i].max_new_tokens:
                dec.cache.free(s)
                where[s] = None
    seconds = time.perf_counter() - t0
    saved = dec.cache.saved if prefix else 0
    out = [np.array(t, dtype=np.int64) for t in tokens]
    return Turns(out, [np.stack(k) for k in kept] if dec.last else None, turn, prefilled,
                 saved, seconds)
