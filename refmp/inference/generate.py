"""Generation of a batch of equal-length prompts: one prefill, then one decode step per new
token (or, without the cache, the whole sequence again for every token: the baseline that
nanoGPT's and llm.c's ``generate`` run).

Shapes: B prompts on this dp rank, T0 prompt tokens, N new tokens, V vocabulary.

Cost, per new token and layer (Pope et al. 2022): with the cache the step computes one token's
linears (24 C^2 FLOPs a row) and attends over t cached keys (4 t C); without it, the whole
prefix's linears again (24 t C^2) and its attention (4 t^2 C): the cache turns a step's work
from O(t) tokens to one, for 2 L t C (per tp, per cp) cached numbers a row.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from refmp.errors import ConfigError
from refmp.inference.decoder import Decoder
from refmp.inference.sampling import Sampler
from refmp.runtime import backend
from refmp.runtime.backend import array_module


class Generated(NamedTuple):
    """What one rank returns: tokens (B, T0 + N) and logits (B, N, V) on the last stage
    (None elsewhere), its seconds of prefill and of decoding, its cache's bytes."""

    tokens: np.ndarray | None
    logits: np.ndarray | None
    prefill_s: float
    decode_s: float
    kv_cache_bytes: int


def generate(dec: Decoder, prompts: np.ndarray, n_new: int, sampler: Sampler,
             requests=None, use_cache: bool = True, block_size: int | None = None) -> Generated:
    """Decode ``n_new`` tokens after each of this rank's ``prompts`` (B, T0) (collective over
    the pipeline, tp, cp and ep). ``requests`` (B,): the rows' global ids (for sampling)."""
    B, T0 = prompts.shape
    xp = array_module(prompts)
    if n_new < 1:
        raise ConfigError(f"--max-new-tokens must be at least 1, got {n_new}")
    if T0 + n_new - 1 > dec.mcfg.block_size:
        raise ConfigError(f"a prompt of {T0} tokens and {n_new} new ones need "
                          f"{T0 + n_new - 1} positions; the model has {dec.mcfg.block_size}")
    requests = np.arange(B) if requests is None else np.asarray(requests)
    slots = list(range(B))
    # the cache holds every token run through the model: the prompt and n_new - 1 more
    tokens = dec.kv_tokens(T0, n_new - 1) if use_cache else T0 + n_new - 1
    dec.new_cache(B, tokens, block_size)
    seq = prompts  # the first stage's copy of every row's tokens so far
    t0 = time.perf_counter()
    logits = dec.forward(prompts if dec.first else None, slots, np.arange(T0), prefill=True)
    t1 = time.perf_counter()
    picked, kept = [], []
    for j in range(n_new):
        if dec.last:
            tok = sampler.pick(logits, requests, j)  # (B,)
            picked.append(tok)
            kept.append(logits)
        if j == n_new - 1:
            break
        got = dec.token_to_first(tok if dec.last else None, B)
        if dec.first:
            seq = xp.concatenate([seq, got[:, None]], axis=1)  # (B, T0 + j + 1)
        if use_cache:
            logits = dec.forward(got[:, None] if dec.first else None, slots, np.array([T0 + j]),
                                 prefill=False, decoded=np.full(B, j))
        else:  # the baseline: the whole sequence again, from an empty cache
            for s in slots:
                dec.cache.free(s)
            logits = dec.forward(seq if dec.first else None, slots, np.arange(T0 + j + 1),
                                 prefill=True)
    t2 = time.perf_counter()
    if not dec.last:
        return Generated(None, None, t1 - t0, t2 - t1, dec.cache.nbytes)
    out = xp.concatenate([prompts, xp.stack(picked, axis=1)], axis=1)  # (B, T0 + N)
    return Generated(out, xp.stack(kept, axis=1), t1 - t0, t2 - t1, dec.cache.nbytes)


class Greedy:
    """The serial model's ``generate(idx, n)`` (refmp.nn.gpt.GPT.generate) on a Decoder:
    greedy tokens (B, T0 + n) of the prompts ``idx`` (B, T0), through the KV cache (or
    without it: ``use_cache``), on every rank of the pipeline (the last stage broadcasts
    them over pp). What training's evaluation decodes with
    (refmp.training.datasets.AdditionTask.score)."""

    def __init__(self, dec: Decoder, use_cache: bool = True):
        self.dec = dec
        self.use_cache = use_cache

    def generate(self, idx, n: int):
        """Collective over the Decoder's axes."""
        dec = self.dec
        tokens = generate(dec, idx, n, Sampler(), use_cache=self.use_cache).tokens  # last stage's
        if dec.pp.size == 1:
            return tokens
        if not dec.last:
            tokens = backend.xp.empty((idx.shape[0], idx.shape[1] + n), dtype=np.int64)
        return dec.pp.bcast(tokens, root=dec.last_rank)
