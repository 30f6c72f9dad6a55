"""Choosing the next token from the logits: greedy, or sampled with temperature, top-k and
top-p (nucleus, Holtzman et al. 2020).

Shapes: B rows, V vocabulary.

Sampling draws one uniform number u per (seed, request, step) from its own generator, and
takes the token where u falls in the cumulative distribution of the kept tokens, in order of
decreasing logit (ties: the lower id first). Nothing depends on the batch a request shares,
on the rank that samples or on the layout: the same seed gives the same tokens everywhere
(the logits agree across layouts to rounding, and u is almost never that close to a boundary).
"""

from __future__ import annotations

import numpy as np

from refmp.errors import ConfigError
from refmp.runtime import backend


class Sampler:
    """``temperature`` 0: greedy (argmax, ties to the lower id); else softmax(logits / T)
    restricted to the ``top_k`` most likely tokens (0: all) and to the smallest set of them
    whose probability reaches ``top_p``."""

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0):
        if not temperature >= 0:
            raise ConfigError(f"--temperature must be >= 0, got {temperature}")
        if top_k < 0:
            raise ConfigError(f"--top-k must be >= 0, got {top_k}")
        if not 0 < top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], got {top_p}")
        if seed < 0:
            raise ConfigError(f"--seed must be >= 0, got {seed}")
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.seed = seed

    def pick(self, logits, requests, step: int) -> np.ndarray:
        """The next token (B,) of each row, from its logits (B, V); ``requests`` (B,) are the
        rows' request ids and ``step`` the index of the token being chosen."""
        if self.temperature == 0:  # where the logits are (a GPU's stay there)
            return logits.argmax(axis=-1).astype(np.int64)
        logits = backend.to_host(logits)
        return np.array([self._draw(z, int(g), step) for z, g in zip(logits, requests,
                                                                     strict=True)], np.int64)

    def _kept(self, logits):
        """The kept tokens, most likely first, and their probabilities (not renormalized
        after top-p: the draw scales by their sum)."""
        z = logits.astype(np.float64) / self.temperature  # (V,)
        order = np.argsort(-z, kind="stable")  # most likely first, ties to the lower id
        if self.top_k:
            order = order[: self.top_k]
        p = np.exp(z[order] - z[order[0]])
        p /= p.sum()
        if self.top_p < 1:  # the smallest prefix whose probability reaches top_p
            p = p[: int(np.searchsorted(np.cumsum(p), self.top_p)) + 1]
        return order[: len(p)], p

    def probs(self, logits) -> np.ndarray:
        """The distribution (V,) a token is drawn from (greedy: all on the argmax), float64
        on the host (speculative decoding's p and q, refmp.inference.speculative)."""
        logits = backend.to_host(logits)
        out = np.zeros(logits.shape[-1])
        if self.temperature == 0:
            out[int(logits.argmax())] = 1.0
            return out
        order, p = self._kept(logits)
        out[order] = p / p.sum()
        return out

    def _draw(self, logits, request: int, step: int) -> int:
        order, p = self._kept(logits)
        cdf = np.cumsum(p)
        u = np.random.default_rng([self.seed, request, step]).random() * cdf[-1]
        return int(order[min(int(np.searchsorted(cdf, u, side="right")), len(p) - 1)])
