"""Continuous batching (Orca, Yu et al. 2022): requests join the decode batch as slots free
up, and each leaves at its own ``max_new_tokens``, instead of a batch waiting for its longest.

Shapes: S slots (``--max-batch``), T0 a request's prompt tokens, V vocabulary.

One iteration, the same decisions on every rank (they depend on arrivals and counts only,
never on token values):

  1. admit: every request that has arrived, while a slot is free, is prefilled alone (B = 1)
     into its slot and picks its first token;
  2. decode: one step for every slot whose request wants more, as one batch of all S slots
     (a free slot is a row the attention skips);
  3. a request with all its tokens gives its slot (and, paged, its blocks) back.

A request's tokens do not depend on which requests shared its batch: its attention reads
its own cache only, and the linears always run on S rows (BLAS may round a row differently
for another number of rows, never for other rows beside it), so its logits are bitwise
those of the same request decoded alone (tests/test_inference.py).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from refmp.errors import ConfigError
from refmp.inference.decoder import Decoder
from refmp.inference.generate import make_cache
from refmp.inference.sampling import Sampler


class Request(NamedTuple):
    prompt: list[int]
    max_new_tokens: int
    arrival: int = 0  # the iteration it arrives at


class Served(NamedTuple):
    """Per request: tokens (T0 + N,) and logits (N, V) (last stage; None elsewhere); the
    trace of (iteration, "prefill" or "decode", request ids); the cache's bytes."""

    tokens: list | None
    logits: list | None
    trace: list
    seconds: float
    kv_cache_bytes: int


def serve(dec: Decoder, requests: list[Request], sampler: Sampler, slots: int,
          block_size: int | None = None, ids=None) -> Served:
    """Run ``requests`` through ``slots`` slots (collective over the pipeline and tp).
    ``ids``: the requests' global ids (for sampling; default 0, 1, ...)."""
    ids = list(range(len(requests))) if ids is None else list(ids)
    for r in requests:
        if r.max_new_tokens < 1:
            raise ConfigError(f"a request's max_new_tokens must be at least 1, got "
                              f"{r.max_new_tokens}")
        if len(r.prompt) + r.max_new_tokens - 1 > dec.mcfg.block_size:
            raise ConfigError(f"a request of {len(r.prompt)} prompt tokens and {r.max_new_tokens}"
                              f" new ones needs more than the model's {dec.mcfg.block_size} "
                              f"positions")
    cap = max(len(r.prompt) + r.max_new_tokens - 1 for r in requests)
    dec.cache = make_cache(dec, slots, cap, block_size)
    dec.ops.row_by_row = True  # a request's numbers must not depend on its batch
    waiting = sorted(range(len(requests)), key=lambda i: (requests[i].arrival, i))
    where: list[int | None] = [None] * slots  # slot -> request index
    made = [0] * len(requests)  # tokens chosen so far, per request
    new = [[] for _ in requests]
    kept = [[] for _ in requests]
    last = np.zeros(slots, dtype=np.int64)  # each slot's newest token (last stage)
    trace, it, t0 = [], 0, time.perf_counter()

    def picked(slot_rows, logits):
        """The last stage chooses each row's token; a finished request frees its slot."""
        for row, s in enumerate(slot_rows):
            i = where[s]
            if dec.last:
                tok = sampler.pick(logits[row : row + 1], [ids[i]], made[i])[0]
                new[i].append(int(tok))
                kept[i].append(logits[row])
                last[s] = tok
            made[i] += 1
            if made[i] == requests[i].max_new_tokens:
                where[s] = None
                dec.cache.free(s)

    while waiting or any(w is not None for w in where):
        while waiting and requests[waiting[0]].arrival <= it and None in where:
            i, s = waiting.pop(0), where.index(None)
            where[s] = i
            r = requests[i]
            prompt = np.array([r.prompt], dtype=np.int64)
            logits = dec.forward(prompt if dec.first else None, [s], np.arange(len(r.prompt)),
                                 prefill=True)
            trace.append((it, "prefill", [i]))
            picked([s], logits)
        busy = [s for s in range(slots) if where[s] is not None]
        got = dec.token_to_first(last, slots)
        if busy:
            rows = [s if where[s] is not None else -1 for s in range(slots)]
            pos = np.array([[len(requests[where[s]].prompt) + made[where[s]] - 1]
                            if where[s] is not None else [0] for s in range(slots)])
            step = np.array([made[w] - 1 if w is not None else 0 for w in where])
            logits = dec.forward(got[:, None] if dec.first else None, rows, pos, prefill=False,
                                 decoded=step)
            trace.append((it, "decode", [where[s] for s in busy]))
            picked(busy, logits[busy] if dec.last else None)
        it += 1
    seconds = time.perf_counter() - t0
    dec.ops.row_by_row = False
    if not dec.last:
        return Served(None, None, trace, seconds, dec.cache.nbytes)
    tokens = [np.array(r.prompt + n, dtype=np.int64) for r, n in zip(requests, new, strict=True)]
    return Served(tokens, [np.stack(k) for k in kept], trace, seconds, dec.cache.nbytes)
