"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a cheap draft proposes gamma
tokens, the model (the target) scores all of them in one forward, and a rejection rule keeps
exactly the target's distribution.

Shapes: B requests, g = gamma draft tokens a round, n a request's tokens so far, V vocabulary.

A round, per request whose target cache holds its first n - 1 tokens:

  1. the draft proposes d_1..d_g, each drawn from its distribution q_i (greedy: one-hot);
  2. the target extends its cache by [x_{n-1}, d_1, .., d_g] in one call
     (refmp.inference.extend) and gives p_1..p_{g+1}, the sampler's distributions of
     the tokens at n, .., n + g (refmp.inference.sampling.Sampler.probs);
  3. d_i is accepted while u_i < min(1, p_i(d_i) / q_i(d_i)), u_i uniform; at the first
     rejection the token is drawn from norm(max(0, p_i - q_i)) and the round ends; when all
     g are accepted, a last token is drawn from p_{g+1};
  4. the target's cache drops the rejected tokens' keys and values (``truncate``).

Each new token is then distributed as p (Leviathan et al. 2023, appendix A.1): P(token = x) =
q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) max(0, p(x) - q(x)) / sum_y max(0, p(y) -
q(y)) = min(p(x), q(x)) + max(0, p(x) - q(x)) = p(x). Greedy decoding is the limit where p and q
are one-hot: a draft token is kept exactly when it is the target's argmax, and the token after
is the target's argmax: the output is the target's greedy output, token for token.

With acceptance rate a (each draft token kept with probability a, independently), a round
yields (1 - a^(g+1)) / (1 - a) tokens for one target forward (Leviathan et al., eq. 1):
``Speculated`` reports the measured tokens per target pass beside it.

Two drafts: :class:`DraftModel`, a smaller refmp model decoding with its own cache (each rank
runs it whole: it is small, and every rank then holds the same drafts without a message);
:class:`PromptLookup`, no model: the tokens that followed the last earlier occurrence of the
sequence's final n-gram (Saxena 2023, prompt lookup decoding), q one-hot.

Each draw has its own uniform number, from a generator keyed by (seed, request, position of
the token it decides, purpose): the draft's draw, the acceptance test and the resampling never
share one, and as each position is decided once (the tests before it all passed, then it is
accepted or drawn), no number decides two tokens.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from refmp.cost.serving import tokens_per_pass
from refmp.errors import ConfigError
from refmp.inference.decoder import Decoder
from refmp.inference.extend import extend, flat
from refmp.inference.sampling import Sampler

DRAW, ACCEPT, RESAMPLE = 1, 2, 3  # the purposes of a uniform number


def uniform(sampler: Sampler, request: int, position: int, purpose: int) -> float:
    return float(np.random.default_rng([sampler.seed, request, position, purpose]).random())


def draw(p: np.ndarray, u: float) -> int:
    """The token where u falls in the cumulative distribution of p (V,)."""
    cdf = np.cumsum(p)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(p) - 1))


def verify(drafts: list[int], q: np.ndarray, p: np.ndarray, us: list[float],
           rs: list[float]) -> list[int]:
    """The rejection rule (the module docstring) on one request's round: drafts (g,), their
    distributions q (g, V), the target's p (g + 1, V), the uniforms of each position's test
    ``us`` (g,) and of its draw ``rs`` (g + 1,). Returns the k accepted drafts and one more
    token (k + 1 tokens)."""
    out = []
    for i, d in enumerate(drafts):
        if us[i] < min(1.0, p[i, d] / q[i, d]):
            out.append(d)
            continue
        residual = np.maximum(p[i] - q[i], 0.0)  # (V,): where the target wants more than q
        return out + [draw(residual, rs[i])]
    return out + [draw(p[len(drafts)], rs[len(drafts)])]


class PromptLookup:
    """A draft without a model: after the last earlier occurrence of the final ``ngram``
    tokens (down to one token), the tokens that followed it; else the last token again."""

    def __init__(self, V: int, ngram: int = 2):
        self.V = V
        self.ngram = ngram

    def start(self, prompts: list[list[int]], longest: int) -> None:
        pass

    def propose(self, slots, seqs, gs, sampler, requests):
        """Per request its drafts (g,) and their one-hot q (g, V)."""
        out = []
        for seq, g in zip(seqs, gs, strict=True):
            drafts = self._lookup(seq, g)
            q = np.zeros((g, self.V))
            q[np.arange(g), drafts] = 1.0
            out.append((drafts, q))
        return out

    def _lookup(self, seq: list[int], g: int) -> list[int]:
        if g == 0:
            return []
        for n in range(min(self.ngram, len(seq) - 1), 0, -1):
            tail = seq[-n:]
            for at in range(len(seq) - n - 1, -1, -1):  # the last earlier occurrence
                if seq[at : at + n] == tail:
                    got = seq[at + n : at + n + g]
                    return got + [got[-1]] * (g - len(got))
        return [seq[-1]] * g

    def rollback(self, b: int, n: int) -> None:
        pass


class DraftModel:
    """A smaller model as the draft: ``dec`` a Decoder of it on one rank (ProcessGrid of
    COMM_SELF), with a cache of its own; same vocabulary as the target."""

    def __init__(self, dec: Decoder, block_size: int | None = None):
        self.dec = dec
        self.block_size = block_size

    def start(self, prompts: list[list[int]], longest: int) -> None:
        self.dec.new_cache(len(prompts), longest, self.block_size)

    def propose(self, slots, seqs, gs, sampler, requests):
        """Per request (its cache slot, tokens so far, g) its drafts (g,) and their q
        (g, V): g forwards of the draft, each feeding the tokens its cache lacks (the newest,
        and the last round's last draft if every draft was accepted) or the last draft."""
        dec = self.dec
        drafts = [[] for _ in seqs]
        qs = [[] for _ in seqs]
        for step in range(max(gs)):
            rows = [(slots[b], (seq + drafts[b])[int(dec.cache.length[slots[b]]):],
                     int(dec.cache.length[slots[b]])) for b, seq in enumerate(seqs) if gs[b] > step]
            x, positions, segments, last = flat(rows)
            logits = extend(dec, x, positions, segments, last)
            for k, b in enumerate(b for b in range(len(seqs)) if gs[b] > step):
                q = sampler.probs(logits[k])
                pos = len(seqs[b]) + step
                drafts[b].append(draw(q, uniform(sampler, requests[b], pos, DRAW)))
                qs[b].append(q)
        return [(d, np.array(q)) for d, q in zip(drafts, qs, strict=True)]

    def rollback(self, b: int, n: int) -> None:
        """The draft's cache of request b keeps at most its first n tokens."""
        self.dec.cache.truncate(b, min(n, int(self.dec.cache.length[b])))


class Speculated(NamedTuple):
    """Per request tokens (T0 + N,) (every rank) and the target's logits that chose each new
    token (N, V) (last stage; None elsewhere); target passes (request rounds), draft tokens
    proposed and accepted, tokens per pass, (1 - a^(g+1)) / (1 - a) at the measured a."""

    tokens: list
    logits: list | None
    passes: int
    proposed: int
    accepted: int
    tokens_per_pass: float
    predicted_per_pass: float
    seconds: float


def speculate(dec: Decoder, prompts: list[list[int]], n_new: int, sampler: Sampler, draft,
              gamma: int, block_size: int | None = None, requests=None) -> Speculated:
    """Decode ``n_new`` tokens after each prompt, ``gamma`` draft tokens verified per target
    pass (collective over the Decoder's tp, pp and ep ranks)."""
    if gamma < 1:
        raise ConfigError(f"--gamma must be at least 1, got {gamma}")
    if n_new < 1:
        raise ConfigError(f"--max-new-tokens must be at least 1, got {n_new}")
    requests = list(range(len(prompts))) if requests is None else [int(r) for r in requests]
    longest = max(len(p) for p in prompts) + n_new - 1
    if longest > dec.mcfg.block_size:
        raise ConfigError(f"prompts of up to {max(len(p) for p in prompts)} tokens and "
                          f"{n_new} new ones need {longest} positions; the model has "
                          f"{dec.mcfg.block_size}")
    dec.new_cache(len(prompts), longest, block_size)
    draft.start(prompts, longest)
    seqs = [list(p) for p in prompts]
    kept = [[] for _ in prompts]
    passes = proposed = accepted = 0
    t0 = time.perf_counter()
    rows = [(b, p[:-1], 0) for b, p in enumerate(prompts) if len(p) > 1]
    if rows:  # the target's cache takes every prompt but its last token
        x, positions, segments, last = flat(rows)
        extend(dec, x if dec.first else None, positions, segments, last[:1])
    while True:
        going = [b for b, s in enumerate(seqs) if len(s) < len(prompts[b]) + n_new]
        if not going:
            break
        gs = [min(gamma, len(prompts[b]) + n_new - len(seqs[b]) - 1) for b in going]
        proposals = draft.propose(going, [seqs[b] for b in going], gs, sampler,
                                  [requests[b] for b in going])
        rows = [(b, seqs[b][-1:] + d, len(seqs[b]) - 1)
                for b, (d, _) in zip(going, proposals, strict=True)]
        x, positions, segments, _ = flat(rows)
        logits = extend(dec, x if dec.first else None, positions, segments,
                        range(len(positions)))
        new = np.full((len(going), gamma + 1), -1, dtype=np.int64)
        for k, (b, (d, q)) in enumerate(zip(going, proposals, strict=True) if dec.last else ()):
            seg = segments[k]
            p = np.stack([sampler.probs(z) for z in logits[seg.start : seg.start + seg.t]])
            n = len(seqs[b])
            us = [uniform(sampler, requests[b], n + i, ACCEPT) for i in range(len(d))]
            rs = [uniform(sampler, requests[b], n + i, RESAMPLE) for i in range(len(d) + 1)]
            got = verify(d, q, p, us, rs)
            new[k, : len(got)] = got
            kept[b] += list(logits[seg.start : seg.start + len(got)])
        if dec.pp.size > 1:  # every stage learns the round's tokens
            new = dec.pp.bcast(new, root=dec.last_rank)
        for k, b in enumerate(going):
            got = [int(t) for t in new[k] if t >= 0]
            passes += 1
            proposed += gs[k]
            accepted += len(got) - 1
            seqs[b] += got
            dec.cache.truncate(b, len(seqs[b]) - 1)  # the rejected drafts' keys and values
            draft.rollback(b, len(seqs[b]) - 1)
    seconds = time.perf_counter() - t0
    predicted = tokens_per_pass(accepted / proposed if proposed else 0.0, gamma)
    return Speculated([np.array(s, dtype=np.int64) for s in seqs],
                      [np.stack(k) for k in kept] if dec.last else None, passes, proposed,
                      accepted, (accepted + passes) / max(passes, 1), predicted, seconds)
