"""Continuous batching (Orca, Yu et al. 2022): requests join the decode batch as slots free
up, and each leaves at its own ``max_new_tokens``, instead of a batch waiting for its longest;
with pp stages, one group of requests in flight per stage (as vLLM's pipeline engine keeps
one batch per virtual engine), so no stage waits for the tokens of the group before it.

Shapes: S slots (``--max-batch``), G groups, P pipeline stages, T0 a request's prompt tokens,
V vocabulary.

The schedule is data (:func:`plan`), the same on every rank: it depends on arrivals and
counts only, never on token values. The S slots are cut into G = min(P, S) groups. At tick
t, group g = t mod G takes a turn (a :class:`Step`) if its tokens are back, i.e. its last
turn started at t - P or before; a turn

  1. decodes one token for each of the group's busy slots (its newest token in, the next out),
  2. admits every request that has arrived, while one of the group's slots is free: each is
     prefilled alone (B = 1) into its slot and picks its first token,
  3. frees the slots of the requests that now have all their tokens (paged: their blocks).

Stage s runs the turn that stage 0 started at tick t - s, so at tick t the P stages work on
P different groups; the last stage sends the group's new tokens to the first, which uses
them in the group's next turn (only the tokens of requests that go on: nothing is left
unreceived when the last request ends). A group is never scheduled twice while it is in flight
(tests/test_inference.py holds the plan to that, and the stages to the plan).

A request's tokens do not depend on which requests shared its batch: its attention reads
its own cache only, and the linears run row by row (BLAS may round a row differently for
another number of rows, never for other rows beside it), so its logits are bitwise those of
the same request decoded alone (tests/test_inference.py).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from refmp.distributed.waiting import wait
from refmp.errors import ConfigError
from refmp.inference.decoder import TAG_TOKEN, Decoder
from refmp.inference.sampling import Sampler


class Request(NamedTuple):
    prompt: list[int]
    max_new_tokens: int
    arrival: int = 0  # the tick it arrives at


class Step(NamedTuple):
    """One group's turn: stage 0 runs it at ``tick``, stage s at ``tick + s``."""

    tick: int
    group: int
    decode: list  # (request, slot, j): feeds the request's new token j, picks j + 1
    admit: list  # (request, slot): prefilled alone, picks its token 0
    done: list  # slots freed after the turn


class Served(NamedTuple):
    """Per request: tokens (T0 + N,) and logits (N, V) (last stage; None elsewhere); the
    plan that was run (its Steps); the seconds; the cache's bytes."""

    tokens: list | None
    logits: list | None
    trace: list
    seconds: float
    kv_cache_bytes: int


def plan(requests: list[Request], slots: int, stages: int) -> list[Step]:
    """The turns of every group until every request has its tokens (pure: see the module)."""
    G = min(stages, slots)
    groups = [range(g * slots // G, (g + 1) * slots // G) for g in range(G)]
    waiting = sorted(range(len(requests)), key=lambda i: (requests[i].arrival, i))
    where: list[int | None] = [None] * slots  # slot -> request
    made = [0] * len(requests)  # tokens picked so far, per request
    back = [0] * G  # the tick a group's tokens are back on the first stage
    steps = []
    t = 0
    while waiting or any(w is not None for w in where):
        g = t % G
        if t >= back[g]:
            decode = [(where[s], s, made[where[s]] - 1) for s in groups[g] if where[s] is not None]
            admit = []
            for s in groups[g]:
                if where[s] is None and waiting and requests[waiting[0]].arrival <= t:
                    where[s] = waiting.pop(0)
                    admit.append((where[s], s))
            if decode or admit:
                for i, _ in admit + [(i, s) for i, s, _ in decode]:
                    made[i] += 1
                done = [s for s in groups[g]
                        if where[s] is not None and made[where[s]] == requests[where[s]].max_new_tokens]
                for s in done:
                    where[s] = None
                steps.append(Step(t, g, decode, admit, done))
                back[g] = t + stages
        t += 1
    return steps


def check_requests(requests: list[Request], positions: int) -> None:
    for r in requests:
        if r.max_new_tokens < 1:
            raise ConfigError(f"a request's max_new_tokens must be at least 1, got "
                              f"{r.max_new_tokens}")
        if len(r.prompt) + r.max_new_tokens - 1 > positions:
            raise ConfigError(f"a request of {len(r.prompt)} prompt tokens and {r.max_new_tokens}"
                              f" new ones needs more than the model's {positions} positions")


def serve(dec: Decoder, requests: list[Request], sampler: Sampler, slots: int,
          block_size: int | None = None, ids=None) -> Served:
    """Run ``requests`` through ``slots`` slots (collective over the pipeline and tp).
    ``ids``: the requests' global ids (for sampling; default 0, 1, ...)."""
    ids = list(range(len(requests))) if ids is None else list(ids)
    check_requests(requests, dec.mcfg.block_size)
    if len(dec.chunks) != 1:  # the turns below pipeline one chunk a rank, in order
        raise ConfigError("continuous batching decodes one chunk per pipeline rank; this "
                          f"Decoder runs {len(dec.chunks)} on rank {dec.pp.rank}")
    P, stage = dec.pp.size, dec.pp.rank
    steps = plan(requests, slots, P)
    at = {st.tick: st for st in steps}
    dec.new_cache(slots, max(len(r.prompt) + r.max_new_tokens - 1 for r in requests), block_size)
    new, kept = [[] for _ in requests], [[] for _ in requests]
    last = np.zeros(slots, dtype=np.int64)  # each slot's newest token (first and last stage)
    sent = []  # the sends of the tick before, waited a tick later
    t0 = time.perf_counter()

    def going_on(st: Step) -> list[int]:
        """The slots of a turn whose requests want more tokens: the first stage needs their
        newest token for the group's next turn (tick + P or later)."""
        return [s for s in [s for _, s, _ in st.decode] + [s for _, s in st.admit]
                if s not in st.done]

    def pick(i: int, slot: int, j: int, logits) -> None:
        tok = int(sampler.pick(logits[None], [ids[i]], j)[0])
        new[i].append(tok)
        kept[i].append(logits)
        last[slot] = tok

    for t in range(steps[-1].tick + P if steps else 0):
        sending = []
        back = at.get(t - P) if P > 1 and dec.first else None
        if back is not None and going_on(back):  # the group's tokens, from the last stage
            last[going_on(back)] = dec.pp.recv((len(going_on(back)),), np.int64, P - 1,
                                               TAG_TOKEN)
        st = at.get(t - stage)
        if st is not None:
            if st.decode:
                rows = [s for _, s, _ in st.decode]
                pos = np.array([[len(requests[i].prompt) + j] for i, _, j in st.decode])
                logits = dec.forward(last[rows][:, None] if dec.first else None, rows, pos,
                                     prefill=False, decoded=np.array([j for *_, j in st.decode]),
                                     sends=sending, rows_apart=True)
                for row, (i, s, j) in enumerate(st.decode if dec.last else ()):
                    pick(i, s, j + 1, logits[row])
            for i, s in st.admit:
                prompt = np.array([requests[i].prompt], dtype=np.int64)
                logits = dec.forward(prompt if dec.first else None, [s],
                                     np.arange(len(requests[i].prompt)), prefill=True,
                                     sends=sending, rows_apart=True)
                if dec.last:
                    pick(i, s, 0, logits[0])
            if dec.last and P > 1 and going_on(st):  # the new tokens to the first stage
                out = last[going_on(st)]
                sending.append((dec.pp.send(out, 0, TAG_TOKEN), out))
            for s in st.done:
                dec.cache.free(s)
        for req, _ in sent:
            wait(req)
        sent = sending
    for req, _ in sent:
        wait(req)
    seconds = time.perf_counter() - t0
    if not dec.last:
        return Served(None, None, steps, seconds, dec.cache.nbytes)
    tokens = [np.array(r.prompt + n, dtype=np.int64) for r, n in zip(requests, new, strict=True)]
    return Served(tokens, [np.stack(k) for k in kept], steps, seconds, dec.cache.nbytes)
