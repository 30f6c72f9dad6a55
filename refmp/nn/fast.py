"""refmp.nn.layers' formulas made fast: the functions the model and every layout call.

Shapes as in refmp.nn.layers: B batch, T time, C channels, NH heads, HS head size, V
vocabulary, N = B*T tokens.

Each function here has the signature, the cache layout and the result of the function of
the same name in refmp.nn.layers, whose plain NumPy lines are the formula to read; this module
computes it with fewer passes over memory and on every core (tests/test_fast.py holds each to
its plain form: bitwise where the operations and their order are the same, else to rounding).
Embedding and linear are one BLAS call or one scatter already: they are the plain ones.

What makes them fast:
* LayerNorm and GELU (tokens independent) write their math once, as a ``_kernel(inputs...,
  outputs...)`` that fills given output arrays in place, and run it with refmp.runtime.cpu.rows:
  on blocks of tokens in parallel threads for NumPy, in one call otherwise (bitwise the same
  either way: each row is computed by the same operations).
* Attention runs in blocks of queries (refmp.nn.flash): the blocks above the causal diagonal
  skipped, no (T, T) array held, heads on threads.
* Cross-entropy reads the logits in chunks of the vocabulary, and the tied head's backward
  uses each chunk's dlogits and lets it go: no second (N, V) array.
"""

from __future__ import annotations

import functools

from refmp.nn.flash import attention_backward, attention_forward  # noqa: F401  (in blocks)
from refmp.nn.layers import (  # noqa: F401  (the plain ones are already fast)
    GELU_K,
    LN_EPS,
    embedding_backward,
    embedding_forward,
    linear_backward,
    linear_backward_input,
    linear_backward_weight,
    linear_forward,
)
from refmp.runtime.backend import array_module
from refmp.runtime.cpu import rows
from refmp.runtime.precision import autocast


def tokens(*arrays) -> list:
    """Each (..., X) array as (N, X), a row per token, for rows() to split the tokens (also
    of one sequence) over threads. The outputs are made C-contiguous, so theirs are views (an
    input that is not may be copied: it is only read)."""
    return [a.reshape(-1, a.shape[-1]) for a in arrays]


# --- LayerNorm: refmp.nn.layers.layernorm_forward / layernorm_backward --------------------


@autocast
def layernorm_forward(x, w, b):
    """layers.layernorm_forward, in place and in row blocks over threads."""
    xp = array_module(x)
    xhat, out = xp.empty_like(x, order="C"), xp.empty_like(x, order="C")  # (B, T, C)
    rstd = xp.empty((*x.shape[:-1], 1), dtype=x.dtype)  # (B, T, 1)
    rows(functools.partial(_layernorm, w=w, b=b), *tokens(x, xhat, rstd, out))
    return out, (xhat, rstd, w)


def _layernorm(x, xhat, rstd, out, *, w, b):
    """The rows of layernorm_forward: xhat = (x - mean) * rstd, out = xhat * w + b."""
    xp = array_module(x)
    C = x.shape[-1]
    # row sums by einsum: one pass and no temporary (twice as fast as .mean, (x * x).mean)
    mean = xp.einsum("...c->...", x)[..., None] / C  # (B, T, 1)
    xp.subtract(x, mean, out=xhat)  # centred; normalized in place below
    var = xp.einsum("...c,...c->...", xhat, xhat)[..., None] / C  # (B, T, 1), biased like torch
    xp.divide(1.0, xp.sqrt(var + LN_EPS), out=rstd)  # (B, T, 1)
    xhat *= rstd  # (B, T, C)
    xp.multiply(xhat, w, out=out)
    out += b  # (B, T, C)


@autocast
def layernorm_backward(dout, cache):
    """layers.layernorm_backward, in place and in row blocks over threads."""
    xhat, rstd, w = cache
    xp = array_module(dout)
    lead = tuple(range(dout.ndim - 1))
    dx, dout_xhat = xp.empty_like(dout, order="C"), xp.empty_like(dout, order="C")  # (B, T, C)
    rows(functools.partial(_layernorm_grad, w=w), *tokens(dout, xhat, rstd, dx, dout_xhat))
    dw = dout_xhat.sum(axis=lead)  # (C,)  forward was: out = xhat * w + b
    db = dout.sum(axis=lead)  # (C,)
    return dx, dw, db


def _layernorm_grad(dout, xhat, rstd, dx, dout_xhat, *, w):
    """The rows of layernorm_backward: dx, and dout * xhat (summed over rows for dw)."""
    xp = array_module(dout)
    C = dout.shape[-1]
    xp.multiply(dout, xhat, out=dout_xhat)
    mean_dxhat = xp.einsum("...c,c->...", dout, w)[..., None] / C  # (B, T, 1), dxhat = dout * w
    mean_dxhat_xhat = xp.einsum("...c,c->...", dout_xhat, w)[..., None] / C  # (B, T, 1)
    xp.multiply(dout, w, out=dx)  # dxhat
    dx -= mean_dxhat
    dx -= xhat * mean_dxhat_xhat
    dx *= rstd  # (B, T, C)


# --- GELU: refmp.nn.layers.gelu_forward / gelu_backward ------------------------------------


@autocast
def gelu_forward(x):
    """layers.gelu_forward, in place and in row blocks over threads."""
    xp = array_module(x)
    th, out = xp.empty_like(x, order="C"), xp.empty_like(x, order="C")  # (B, T, 4C)
    rows(_gelu, *tokens(x, th, out))
    return out, (x, th)


def _gelu(x, th, out):
    """The rows of gelu_forward, into th = tanh(u) and out."""
    xp = array_module(x)
    # u = k x (1 + 0.044715 x^2), built in one buffer (x*x rather than x**3, in place: faster)
    xp.multiply(x, x, out=th)
    th *= 0.044715
    th += 1.0
    th *= x
    th *= GELU_K
    xp.tanh(th, out=th)
    xp.add(th, 1.0, out=out)
    out *= x
    out *= 0.5


@autocast
def gelu_backward(dout, cache):
    """layers.gelu_backward, in place (in dx and one scratch array: on large activations
    fresh temporaries cost more than the arithmetic) and in row blocks over threads."""
    x, th = cache
    xp = array_module(dout)
    dx = xp.empty_like(th, order="C")  # (B, T, 4C)
    rows(_gelu_grad, *tokens(dout, x, th, dx))
    return dx


def _gelu_grad(dout, x, th, dx):
    """The rows of gelu_backward, into dx."""
    xp = array_module(dout)
    xp.multiply(th, th, out=dx)
    xp.subtract(1.0, dx, out=dx)  # d tanh(u) / du
    dx *= x
    t = x * x
    t *= 3 * 0.044715
    t += 1.0
    dx *= t  # du/dx / k
    dx *= 0.5 * GELU_K
    xp.add(th, 1.0, out=t)
    t *= 0.5
    dx += t
    dx *= dout


# --- cross-entropy and the tied head: refmp.nn.layers.cross_entropy_*, tied_head_backward ---

VOCAB_CHUNK = 16384  # vocabulary columns a chunk: the largest temporary is (N, VOCAB_CHUNK)


def _chunks(V: int):
    return [(a, min(a + VOCAB_CHUNK, V)) for a in range(0, V, VOCAB_CHUNK)]


@autocast
def cross_entropy_forward(logits, targets, denom=None):
    """layers.cross_entropy_forward reading the logits in chunks of the vocabulary: the
    log-sum-exp from each row's max and exp(logits - max) summed chunk by chunk, so nothing
    of the logits' size is made (the plain form makes the shifted logits and their exp).
    The cache keeps the logits themselves (the head's one (N, V) array) and the lse."""
    xp = array_module(logits)
    V = logits.shape[-1]
    lg = logits.reshape(-1, V)  # (N, V), a view
    tg = targets.reshape(-1)  # (N,)
    denom = tg.size if denom is None else denom
    m = lg.max(axis=-1)  # (N,)
    total = xp.zeros_like(m)  # (N,) sum_j exp(logits_j - max)
    for a, b in _chunks(V):
        total += xp.einsum("nv->n", _exp_minus(lg[:, a:b], m))  # row sums, one pass
    lse = m + xp.log(total)  # (N,)
    nll = lse - lg[xp.arange(tg.size), tg]  # (N,) = -log p[target]
    return nll.sum() / denom, (lg, lse, tg, denom, logits.shape)


def _exp_minus(lg, shift):
    """exp(lg - shift[:, None]) for a chunk of columns (N, Vc), in one new array."""
    xp = array_module(lg)
    out = xp.subtract(lg, shift[:, None])  # (N, Vc)
    return xp.exp(out, out=out)


def _dlogits(dout, cache, a, b):
    """Columns [a, b) of dlogits = (softmax(logits) - onehot(targets)) / denom * dout."""
    lg, lse, tg, denom, shape = cache
    xp = array_module(lg)
    d = _exp_minus(lg[:, a:b], lse)  # (N, b - a) softmax, recomputed from the lse
    hit = xp.nonzero((tg >= a) & (tg < b))[0]  # the rows whose target is in this chunk
    d[hit, tg[hit] - a] -= 1.0
    d *= dout / denom
    return d


@autocast
def cross_entropy_backward(dout, cache):
    """layers.cross_entropy_backward, filled chunk by chunk of the vocabulary."""
    lg, lse, tg, denom, shape = cache
    xp = array_module(lg)
    dlogits = xp.empty(lg.shape, dtype=lg.dtype)  # (N, V)
    for a, b in _chunks(lg.shape[1]):
        dlogits[:, a:b] = _dlogits(dout, cache, a, b)
    return dlogits.reshape(shape)  # (B, T, V)


@autocast
def tied_head_backward(dout, cache, h, wte):
    """layers.tied_head_backward a chunk of the vocabulary at a time: each chunk's dlogits
    (N, Vc) made, used for dh += dlogits wte[chunk] and dwte[chunk] = dlogits^T h, and let go;
    the (N, V) dlogits is never whole."""
    xp = array_module(h)
    C = h.shape[-1]
    h2 = h.reshape(-1, C)  # (N, C)
    dh = xp.zeros_like(h2)  # (N, C)
    dwte = xp.empty(wte.shape, dtype=h.dtype)  # (V, C)
    for a, b in _chunks(wte.shape[0]):
        d = _dlogits(dout, cache, a, b)  # (N, Vc)
        dh += d @ wte[a:b]  # forward was: logits = h @ wte^T
        dwte[a:b] = d.T @ h2
    return dh.reshape(h.shape), dwte  # (B, T, C), (V, C)
