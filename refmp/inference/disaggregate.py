"""Prefill/decode disaggregation (DistServe, Zhong et al. 2024; Splitwise, Patel et al. 2024):
one group of ranks prefills the prompts, another decodes them, each with its own layout; the
prefill group sends the KV cache to the decode group, block by block.

Shapes: B prompts of T0 tokens, L layers, C channels, NH heads, HS head size, bs tokens per
block sent, w bytes per element; tp_p, pp_p the prefill group's sizes, tp_d, pp_d the
decode group's.

The world's first tp_p x pp_p ranks prefill, the next tp_d x pp_d decode. After the prefill
(refmp.inference.decoder, prefill=True), every prefill rank holds the keys and values of its
stage's layers and its NH/tp_p heads; every decode rank needs those of its own stage's layers
and NH/tp_d heads. For each layer, request and block of bs tokens, each prefill rank sends
each decode rank that holds the layer the heads both hold: (2, heads in common, bs, HS), k
and v together. When tp_p and tp_d differ this is the resharding: a decode rank receives its
heads from every prefill rank whose heads overlap them (tp 2 -> 1: both halves; 1 -> 2: one
slice each). Each (layer, head, token) of k and of v crosses once, so a request sends

    2 L T0 C w bytes  (refmp.cost.serving.kv_transfer_bytes; the ledger's send@kv,
                       tests/test_serving_parallel.py)

The last prefill stage also sends the first new token (B int64) to every decode rank; the
decode group then runs plain decode steps from its cache. Messages between one pair of ranks
go in (layer, request, block) order on one tag: MPI keeps their order, so the receiver needs
no tag per block. Refused: cp, dp and ep (a group is one replica of the model, split over tp
and pp).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from refmp.distributed.comm import Comm
from refmp.distributed.grid import ProcessGrid
from refmp.distributed.waiting import wait
from refmp.errors import ConfigError
from refmp.inference.decoder import Decoder
from refmp.inference.sampling import Sampler

TAG_KV = 31  # a block of the KV cache, prefill rank to decode rank
TAG_FIRST = 32  # the first new tokens, last prefill stage to every decode rank


class Disaggregated(NamedTuple):
    """tokens (B, T0 + N) and the logits of new tokens 1..N-1 (B, N - 1, V) on the decode
    group's last stage (None elsewhere); this rank's KV bytes sent; which group it is in."""

    tokens: np.ndarray | None
    logits: np.ndarray | None
    kv_bytes_sent: int
    prefill: bool
    seconds: float


def check_groups(world_size: int, prefill: dict, decode: dict, mcfg) -> None:
    """Refuse layouts the two groups cannot run (pure: the same answer on every rank)."""
    for name, lay in (("prefill", prefill), ("decode", decode)):
        if set(lay) - {"tp", "pp"}:
            raise ConfigError(f"disaggregation splits each group over tp and pp only; the "
                              f"{name} group asks for {sorted(set(lay) - {'tp', 'pp'})}")
        if mcfg.n_head % lay.get("tp", 1) or mcfg.n_layer < lay.get("pp", 1):
            raise ConfigError(f"the {name} group's {lay} does not divide the model's "
                              f"{mcfg.n_head} heads and {mcfg.n_layer} layers")
    n = size(prefill) + size(decode)
    if world_size != n:
        raise ConfigError(f"prefill {prefill} and decode {decode} need {n} ranks; the world "
                          f"has {world_size}")


def size(layout: dict) -> int:
    return layout.get("tp", 1) * layout.get("pp", 1)


def disaggregated(world: MPI.Comm, prefill: dict, decode: dict, mcfg, weights, prompts,
                  n_new: int, sampler: Sampler, block: int = 16, dtype=None) -> Disaggregated:
    """Prefill ``prompts`` (B, T0) on the world's first ranks (layout ``prefill``), decode
    ``n_new`` tokens on the others (layout ``decode``), the cache sent in blocks of
    ``block`` tokens (collective over the world)."""
    check_groups(world.size, prefill, decode, mcfg)
    B, T0 = prompts.shape
    if n_new < 1 or T0 + n_new - 1 > mcfg.block_size:
        raise ConfigError(f"{T0} prompt tokens and {n_new} new ones do not fit the model's "
                          f"{mcfg.block_size} positions")
    mine = world.rank < size(prefill)
    group = world.Split(0 if mine else 1, world.rank)
    grid = ProcessGrid(group, **(prefill if mine else decode))
    dec = Decoder(mcfg, weights, grid, dtype=dtype)
    kv = Comm(world, "kv", grid.ledger, grid.recorder)  # the transfer, in this group's ledger
    token = Comm(world, "kv-token", grid.ledger, grid.recorder)  # the first new tokens
    hs = mcfg.n_embd // mcfg.n_head
    # who holds what: (prefill?, layers, first head, heads) of every world rank
    held = world.allgather((mine, list(dec.blocks), dec.tp.rank * dec.nh, dec.nh))
    slots = list(range(B))
    t0 = time.perf_counter()
    if mine:
        dec.new_cache(B, T0)
        logits = dec.forward(prompts if dec.first else None, slots, np.arange(T0), prefill=True)
        sends = []
        for b in slots:
            for j in range(0, T0, block):
                for i in dec.blocks:
                    k, v = dec.cache.view(i, b)  # (NH/tp_p, T0, HS) each
                    for dest, (other, layers, h0, nh) in enumerate(held):
                        both = _common(held[world.rank], (h0, nh))
                        if other or i not in layers or both is None:
                            continue
                        lo, hi = both[0] - held[world.rank][2], both[1] - held[world.rank][2]
                        buf = np.ascontiguousarray(np.stack([k[lo:hi, j : j + block],
                                                             v[lo:hi, j : j + block]]))
                        sends.append((kv.send(buf, dest, TAG_KV), buf))  # (2, heads, bs, HS)
        if dec.last and dec.tp.rank == 0:  # the first new tokens, to every decode rank
            first = sampler.pick(logits, slots, 0).astype(np.int64)
            for dest in range(size(prefill), world.size):
                sends.append((token.send(first, dest, TAG_FIRST), first))
        for req, _ in sends:
            wait(req)
        sent = grid.ledger.entries.get(("send", "kv"), [0])[0]
        return Disaggregated(None, None, sent, True, time.perf_counter() - t0)
    dec.new_cache(B, T0 + n_new - 1)
    for b in slots:  # the cache, block by block, from the prefill ranks that hold it
        for j in range(0, T0, block):
            t = min(block, T0 - j)
            for i in dec.blocks:
                k = np.empty((dec.nh, t, hs), dec.dtype)  # (NH/tp_d, t, HS)
                v = np.empty_like(k)
                for src, (other, layers, h0, nh) in enumerate(held):
                    both = _common(held[world.rank], (h0, nh))
                    if not other or i not in layers or both is None:
                        continue
                    got = kv.recv((2, both[1] - both[0], t, hs), dec.dtype, src, TAG_KV)
                    lo, hi = both[0] - held[world.rank][2], both[1] - held[world.rank][2]
                    k[lo:hi], v[lo:hi] = got[0], got[1]
                dec.cache.append(i, b, k, v)
            dec.cache.advance(b, t)  # every layer has the block
    root = next(r for r, (other, layers, h0, _) in enumerate(held)
                if other and mcfg.n_layer - 1 in layers and h0 == 0)
    tok = token.recv((B,), np.int64, root, TAG_FIRST)
    picked, kept = [tok], []
    for j in range(1, n_new):
        logits = dec.forward(tok[:, None] if dec.first else None, slots, np.array([T0 + j - 1]),
                             prefill=False, decoded=np.full(B, j - 1))
        if dec.last:
            tok = sampler.pick(logits, slots, j)
            picked.append(tok)
            kept.append(logits)
        if j < n_new - 1:
            got = dec.token_to_first(tok if dec.last else None, B)
            tok = got if dec.first else tok
    seconds = time.perf_counter() - t0
    if not dec.last:
        return Disaggregated(None, None, 0, False, seconds)
    tokens = np.concatenate([prompts, np.stack(picked, axis=1)], axis=1)  # (B, T0 + N)
    logits = np.stack(kept, axis=1) if kept else None
    return Disaggregated(tokens, logits, 0, False, seconds)


def _common(a, b):
    """The global heads [lo, hi) two ranks' (..., first head, heads) both hold, or None."""
    lo, hi = max(a[2], b[0]), min(a[2] + a[3], b[0] + b[1])
    return (lo, hi) if lo < hi else None
