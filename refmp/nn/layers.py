"""GPT-2's layers as forward/backward pairs of plain functions (the serial reference).

Shapes: B batch, T time (sequence), C channels (n_embd), NH heads, HS head size (C/NH),
V vocabulary, N = B*T tokens.

Every ``*_forward`` returns ``(out, cache)``; the matching ``*_backward`` takes the incoming
gradient ``dout`` and that cache and returns the gradients of the forward's inputs, in the
order of the forward's arguments. The caller owns the cache; nothing here keeps state.
Backward passes mirror their forward: sections in reverse order, and the forward line each
step inverts is quoted where it is not obvious.

Mixed precision: each layer is wrapped in refmp.runtime.precision.autocast. Given bf16 or fp16
arrays it computes in fp32 (BLAS has no bf16 kernel; LayerNorm statistics, softmax and
cross-entropy want fp32 anyway) and rounds what it returns, caches included, to that dtype.
Given fp32 or fp64 arrays it is the plain function.

Speed: the elementwise and row-wise layers (LayerNorm and GELU, whose tokens are independent,
and attention, whose heads are) write their math once, as a ``_kernel(inputs..., outputs...)``
that fills given output arrays in place, and run it with refmp.runtime.cpu.rows: on blocks of
tokens (of heads) in parallel threads for NumPy, in one call otherwise. Results are bitwise the
same either way (each row is computed by the same operations).
"""

from __future__ import annotations

import functools
import math

from refmp.runtime.backend import array_module, scatter_add
from refmp.runtime.cpu import one_blas_thread, rows
from refmp.runtime.precision import autocast

LN_EPS = 1e-5
GELU_K = math.sqrt(2.0 / math.pi)


def tokens(*arrays) -> list:
    """Each (..., X) array as (N, X), a row per token, for rows() to split the tokens (also
    of one sequence) over threads. The outputs are made C-contiguous, so theirs are views (an
    input that is not may be copied: it is only read)."""
    return [a.reshape(-1, a.shape[-1]) for a in arrays]


# --- embedding: out[b, t] = w[idx[b, t]] --------------------------------------------------


def embedding_forward(idx, w):
    """Look up rows of ``w`` (V, C) for integer ``idx`` (B, T). Used for wte and wpe."""
    out = w[idx]  # (B, T, C)
    return out, (idx, w.shape)


@autocast
def embedding_backward(dout, cache):
    """dw[v] = sum of dout over the positions where idx == v (a scatter-add)."""
    idx, w_shape = cache
    xp = array_module(dout)
    dw = xp.zeros(w_shape, dtype=dout.dtype)  # (V, C)
    scatter_add(dw, idx.reshape(-1), dout.reshape(-1, w_shape[1]))
    return dw


# --- linear: y = x @ w + b, w stored (in, out) as in GPT-2's Conv1D -----------------------


@autocast
def linear_forward(x, w, b=None):
    """y = x W + b for x (..., in), W (in, out), b (out,)."""
    # one (N, in) x (in, out) product: a single large BLAS call, not one per batch row
    out = (x.reshape(-1, x.shape[-1]) @ w).reshape(*x.shape[:-1], w.shape[1])  # (..., out)
    if b is not None:
        out += b
    return out, (x, w, b is not None)


def linear_backward(dout, cache):
    """dx = dout W^T, dW = x^T dout (summed over all leading axes), db = sum of dout.

    The two halves below, run back to back: the zero-bubble split (B now, W later) runs the
    same products, so both give bitwise the same gradients.
    """
    dx = linear_backward_input(dout, cache)
    dw, db = linear_backward_weight(dout, cache)
    return dx, dw, db


@autocast
def linear_backward_input(dout, cache):
    """The input half of linear_backward: dx = dout W^T (zero-bubble's B pass, Qi et al. 2023)."""
    x, w, has_bias = cache
    return (dout.reshape(-1, dout.shape[-1]) @ w.T).reshape(*dout.shape[:-1], w.shape[0])


@autocast
def linear_backward_weight(dout, cache):
    """The weight half of linear_backward: dW = x^T dout, db = sum of dout (zero-bubble's W)."""
    x, w, has_bias = cache
    d2 = dout.reshape(-1, dout.shape[-1])  # (N, out)
    dw = x.reshape(-1, x.shape[-1]).T @ d2  # (in, out)
    return dw, (d2.sum(axis=0) if has_bias else None)


# --- LayerNorm: y = (x - mean) / sqrt(var + eps) * w + b over the last axis -------------


@autocast
def layernorm_forward(x, w, b):
    """Normalize each token's C channels, then scale and shift (Ba et al. 2016)."""
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
    """dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), with dxhat = dout * w."""
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


# --- GELU, tanh approximation (as GPT-2) ---------------------------------------------------


@autocast
def gelu_forward(x):
    """gelu(x) = 0.5 x (1 + tanh(k (x + 0.044715 x^3))), k = sqrt(2/pi)."""
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
    """d gelu/dx = 0.5 (1 + th) + 0.5 x (1 - th^2) k (1 + 3 * 0.044715 x^2).

    Computed in place, in dx and one scratch array: on large activations fresh temporaries
    cost more than the arithmetic.
    """
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


# --- causal multi-head self-attention (the core, without the two projections) ------------


@autocast
def attention_forward(qkv, n_head, keep_scores: bool = True):
    """softmax(q k^T / sqrt(HS) + causal mask) v, batched over B and NH (Vaswani et al. 2017).

    ``qkv`` is c_attn's output (B, T, 3C) laid out as [q | k | v], each C wide and split into
    NH heads of HS channels. Returns y (B, T, C) with the heads concatenated again.

    ``keep_scores=False`` is selective recomputation (Korthikanti et al. 2022, sec. 5): the
    cache keeps q, k, v (views of qkv, which c_attn's backward keeps anyway) but not the
    (B, NH, T, T) softmax, which backward recomputes by the same operations, bitwise.
    """
    xp = array_module(qkv)
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    # (B, T, 3, NH, HS) -> (3, B, NH, T, HS): one transpose gives all three in head-major form
    q, k, v = qkv.reshape(B, T, 3, n_head, hs).transpose(2, 0, 3, 1, 4)  # each (B, NH, T, HS)
    scale = 1.0 / math.sqrt(hs)
    att = xp.empty((B, n_head, T, T), dtype=qkv.dtype)
    y = xp.empty((B, T, n_head, hs), dtype=qkv.dtype)  # (B, T, C) once reshaped
    with one_blas_thread(T, T, hs, qkv):  # B NH small products (refmp.runtime.cpu)
        rows(functools.partial(_attention, scale=scale), q, k, v, att, y)  # per batch element
    return y.reshape(B, T, C), (q, k, v, att if keep_scores else None, scale)


def _attention(q, k, v, att, y, *, scale):
    """The rows (batch elements) of attention_forward, into att and y (B, T, NH, HS)."""
    attention_weights(q, k, scale, out=att)  # (B, NH, T, T)
    y[...] = (att @ v).transpose(0, 2, 1, 3)  # (B, T, NH, HS) heads side by side


@autocast
def attention_weights(q, k, scale, out=None):
    """softmax(q k^T * scale) with the causal mask: (B, NH, T, T), into ``out`` if given."""
    xp = array_module(q)
    T = q.shape[2]
    att = xp.matmul(q, k.transpose(0, 1, 3, 2), out=out)  # (B, NH, T, T)
    att *= scale
    # causal mask: position t sees positions <= t only (-inf above the diagonal)
    att += xp.triu(xp.full((T, T), -xp.inf, dtype=att.dtype), k=1)  # (T, T) broadcast
    att -= att.max(axis=-1, keepdims=True)  # stable softmax
    xp.exp(att, out=att)
    # row sums by einsum: NumPy's .sum costs 3x as much on rows this short (per-row overhead)
    att /= xp.einsum("...j->...", att)[..., None]  # (B, NH, T, T) attention weights
    return att


@autocast
def attention_backward(dout, cache):
    """Gradient of attention_forward with respect to qkv (B, T, 3C)."""
    q, k, v, att, scale = cache
    xp = array_module(dout)
    B, NH, T, HS = q.shape
    recompute = att is None  # selective recomputation: the forward's weights, again
    if recompute:
        att = xp.empty((B, NH, T, T), dtype=q.dtype)
    dy = dout.reshape(B, T, NH, HS).transpose(0, 2, 1, 3)  # (B, NH, T, HS)
    dqkv = xp.empty((B, T, 3, NH, HS), dtype=dout.dtype)  # (B, T, 3C) once reshaped
    with one_blas_thread(T, T, HS, dout):  # B NH small products (refmp.runtime.cpu)
        grad = functools.partial(_attention_grad, scale=scale, recompute=recompute)
        rows(grad, dy, q, k, v, att, dqkv)  # per batch element
    return dqkv.reshape(B, T, 3 * NH * HS)  # (B, T, 3C)


def _attention_grad(dy, q, k, v, att, dqkv, *, scale, recompute):
    """The rows (batch elements) of attention_backward, into dqkv (B, T, 3, NH, HS)."""
    xp = array_module(dy)
    if recompute:
        attention_weights(q, k, scale, out=att)  # (B, NH, T, T)
    # forward was: y = att @ v
    datt = dy @ v.transpose(0, 1, 3, 2)  # (B, NH, T, T)
    dv = att.transpose(0, 1, 3, 2) @ dy  # (B, NH, T, HS)
    # forward was: att = softmax(s); ds = att * (datt - sum(datt * att)); masked entries have
    # att == 0, so their gradient is 0 without looking at the mask again. (In place: datt -> ds.)
    datt -= xp.einsum("...j,...j->...", datt, att)[..., None]  # row sums, no temporary
    datt *= att  # (B, NH, T, T) = ds
    # forward was: s = q @ k^T * scale; write dq, dk, dv straight into c_attn's layout
    dqkv[:, :, 0] = (datt @ k).transpose(0, 2, 1, 3)  # dq, (B, T, NH, HS)
    dqkv[:, :, 1] = (datt.transpose(0, 1, 3, 2) @ q).transpose(0, 2, 1, 3)  # dk
    dqkv[:, :, 2] = dv.transpose(0, 2, 1, 3)
    dqkv[:, :, :2] *= scale


# --- softmax cross-entropy -----------------------------------------------------------------


@autocast
def cross_entropy_forward(logits, targets, denom=None):
    """loss = -sum_i log softmax(logits_i)[targets_i] / denom.

    ``denom`` defaults to the number of tokens here; a data-parallel rank passes the token
    count of the *global* batch, so that summing the ranks' losses (and gradients) gives
    exactly the serial mean. Uses log-sum-exp with the max subtracted (stable).
    """
    xp = array_module(logits)
    V = logits.shape[-1]
    lg = logits.reshape(-1, V)  # (N, V)
    tg = targets.reshape(-1)  # (N,)
    denom = tg.size if denom is None else denom
    shifted = lg - lg.max(axis=-1, keepdims=True)  # (N, V)
    lse = xp.log(xp.exp(shifted).sum(axis=-1))  # (N,)
    rows = xp.arange(tg.size)
    nll = lse - shifted[rows, tg]  # (N,) = -log p[target]
    loss = nll.sum() / denom
    return loss, (shifted, lse, tg, denom, logits.shape)


@autocast
def cross_entropy_backward(dout, cache):
    """dlogits = (softmax(logits) - onehot(targets)) / denom * dout."""
    shifted, lse, tg, denom, shape = cache
    xp = array_module(shifted)
    dlogits = xp.exp(shifted - lse[:, None])  # (N, V) = softmax
    dlogits[xp.arange(tg.size), tg] -= 1.0
    dlogits *= dout / denom
    return dlogits.reshape(shape)  # (B, T, V)
