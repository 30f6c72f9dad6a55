"""Causal attention in blocks of queries, the (T, T) scores never held: the fast form of
refmp.nn.layers.attention_forward / attention_backward (the flash-attention schedule,
Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness";
the backward as in Dao 2023, "FlashAttention-2", algorithm 2).

Shapes: B batch, NH heads, T time, HS head size, C = NH HS; Tb queries a block (BLOCK).

For each block of Tb queries [lo, hi), the scores are computed against keys 0..hi only: the
causal mask hides every key after the block's last query, so the blocks above the diagonal
are skipped (about half the products and exponentials at large T), and the largest scores
array alive is (B, NH, Tb, T), not (B, NH, T, T). The forward keeps each row's log-sum-exp
(B, NH, T) and its output; the backward recomputes each block's probabilities from them,
p = exp(s - lse), with D = rowsum(dy * y) standing for sum_j p_j dp_j (the softmax's
backward). Nothing of size T x T is cached: attention's activation memory is q, k, v (views
of c_attn's output, which its backward keeps anyway), the output and the log-sum-exp
(refmp.cost.memory counts it so).

Equal to the plain attention to float rounding (the row sums and the key/value gradients are
summed in another order; tests/test_fast.py). Heads run in threads (refmp.runtime.cpu.rows),
each block's products on one BLAS thread: many small products gain nothing from BLAS's own
threads, whose hand-offs cost more than they save.
"""

from __future__ import annotations

import functools
import math
from collections import namedtuple

from refmp.runtime.backend import array_module
from refmp.runtime.cpu import one_blas_thread, rows
from refmp.runtime.precision import autocast

BLOCK = 128  # queries a block: the largest scores array is (B, NH, BLOCK, T)

# What the backward needs: q, k, v (B, NH, T, HS), views of qkv; the output y (B, T, C);
# each row's log-sum-exp (B, NH, T, 1); the scale 1/sqrt(HS)
FlashCache = namedtuple("FlashCache", "q k v y lse scale")


def _blocks(T: int):
    """The query blocks [lo, hi) of a sequence of T tokens."""
    return [(lo, min(lo + BLOCK, T)) for lo in range(0, T, BLOCK)]


def _probabilities(q, k, lo, hi, scale, shift):
    """exp(s - shift) for the queries [lo, hi) over keys 0..hi, s = q k^T * scale with the
    causal mask (-inf where key > query): (B, NH, hi - lo, hi). ``shift`` is the row max
    (forward) or the saved log-sum-exp (backward), (B, NH, hi - lo, 1); None: the row max."""
    xp = array_module(q)
    s = q[:, :, lo:hi] @ k[:, :, :hi].transpose(0, 1, 3, 2)  # (B, NH, Tb, hi)
    s *= scale
    s[..., lo:] += xp.triu(xp.full((hi - lo, hi - lo), -xp.inf, dtype=s.dtype), k=1)  # diagonal block
    if shift is None:
        shift = s.max(axis=-1, keepdims=True)  # (B, NH, Tb, 1) stable softmax
    s -= shift
    xp.exp(s, out=s)
    return s, shift


@autocast
def attention_forward(qkv, n_head, keep_scores: bool = True):
    """layers.attention_forward in query blocks. ``keep_scores`` is accepted for the same
    signature: no scores are kept either way (the backward always recomputes them)."""
    xp = array_module(qkv)
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    q, k, v = qkv.reshape(B, T, 3, n_head, hs).transpose(2, 0, 3, 1, 4)  # each (B, NH, T, HS)
    y = xp.empty((B, T, n_head, hs), dtype=qkv.dtype)  # (B, T, C) once reshaped
    _, lse = causal_forward(q, k, v, 1.0 / math.sqrt(hs), y.transpose(0, 2, 1, 3))
    y = y.reshape(B, T, C)  # heads side by side, written there by causal_forward
    return y, FlashCache(q, k, v, y, lse, 1.0 / math.sqrt(hs))


@autocast
def attention_backward(dout, cache):
    """layers.attention_backward in query blocks, probabilities recomputed from the lse."""
    q, k, v, y, lse, scale = cache
    xp = array_module(dout)
    B, NH, T, HS = q.shape
    dy = dout.reshape(B, T, NH, HS).transpose(0, 2, 1, 3)  # (B, NH, T, HS)
    yh = y.reshape(B, T, NH, HS).transpose(0, 2, 1, 3)  # (B, NH, T, HS)
    dqkv = xp.zeros((B, T, 3, NH, HS), dtype=dout.dtype)  # (B, T, 3C) once reshaped
    causal_backward(dy, yh, q, k, v, lse, scale, *(dqkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3)))
    return dqkv.reshape(B, T, 3 * NH * HS)  # (B, T, 3C)


def heads_first(*arrays) -> list:
    """Each (B, NH, ...) array as an (NH, B, ...) view, for rows() to give each thread its
    heads (B is often 1 at long T; every head is independent, and the kernels below treat
    the first two axes alike)."""
    return [a.swapaxes(0, 1) for a in arrays]


def causal_forward(q, k, v, scale, y=None):
    """softmax(q k^T * scale + causal mask) v for q, k, v (B, NH, T, HS), in query blocks:
    y (B, NH, T, HS), into ``y`` if given, and each row's log-sum-exp (B, NH, T, 1)."""
    xp = array_module(q)
    y = xp.empty_like(q) if y is None else y  # (B, NH, T, HS)
    lse = xp.empty((*q.shape[:3], 1), dtype=q.dtype)  # (B, NH, T, 1)
    with one_blas_thread(1, 1, 1, q):  # small products: heads go to threads, not BLAS's
        rows(functools.partial(_forward, scale=scale), *heads_first(q, k, v, y, lse))
    return y, lse


def _forward(q, k, v, y, lse, *, scale):
    """The rows (heads) of causal_forward, into y and lse: every array (NH, B, T, ...)."""
    xp = array_module(q)
    for lo, hi in _blocks(q.shape[2]):
        p, m = _probabilities(q, k, lo, hi, scale, None)  # (B, NH, Tb, hi)
        l = xp.einsum("...j->...", p)[..., None]  # (B, NH, Tb, 1) row sums
        xp.divide(p @ v[:, :, :hi], l, out=y[:, :, lo:hi])  # (B, NH, Tb, HS)
        lse[:, :, lo:hi] = m + xp.log(l)  # log sum_j exp(s_j)


def causal_backward(dy, y, q, k, v, lse, scale, dq=None, dk=None, dv=None):
    """The gradient of causal_forward: dq, dk, dv (B, NH, T, HS), into the arrays given (each
    filled whole), from the output ``y`` and ``lse`` of each row (the merged ones, when the
    rows saw other blocks of keys too: refmp.nn.blockwise)."""
    xp = array_module(dy)
    dq, dk, dv = (xp.empty_like(q) if a is None else a for a in (dq, dk, dv))
    dk[...] = 0
    dv[...] = 0
    with one_blas_thread(1, 1, 1, dy):  # small products: heads go to threads, not BLAS's
        rows(functools.partial(_backward, scale=scale), *heads_first(dy, y, q, k, v, lse, dq, dk, dv))
    return dq, dk, dv


def _backward(dy, y, q, k, v, lse, dq, dk, dv, *, scale):
    """The rows (heads) of causal_backward, into dq, dk, dv: every array (NH, B, T, ...)."""
    xp = array_module(dy)
    # D = sum_j p_j dp_j = rowsum(dy * y): forward was y = p v
    D = xp.einsum("...d,...d->...", dy, y)[..., None]  # (B, NH, T, 1)
    for lo, hi in _blocks(q.shape[2]):
        p, _ = _probabilities(q, k, lo, hi, scale, lse[:, :, lo:hi])  # (B, NH, Tb, hi)
        dyb = dy[:, :, lo:hi]  # (B, NH, Tb, HS)
        dv[:, :, :hi] += p.transpose(0, 1, 3, 2) @ dyb  # forward was: y = p v
        dp = dyb @ v[:, :, :hi].transpose(0, 1, 3, 2)  # (B, NH, Tb, hi)
        dp -= D[:, :, lo:hi]
        dp *= p  # ds = p (dp - D), the softmax's backward
        dp *= scale  # forward was: s = q k^T * scale
        dq[:, :, lo:hi] = dp @ k[:, :, :hi]
        dk[:, :, :hi] += dp.transpose(0, 1, 3, 2) @ q[:, :, lo:hi]
