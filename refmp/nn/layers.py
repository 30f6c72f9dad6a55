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

Speed: these are the formulas, written plainly. refmp.nn.fast runs the same formulas fast
(in place, in threads, fused; attention in blocks that never hold the (T, T) scores) and is
what the model and every layout call; tests/test_fast.py holds the two to agreement.
"""

from __future__ import annotations

import math

from refmp.runtime.backend import array_module, scatter_add
from refmp.runtime.precision import autocast

LN_EPS = 1e-5
GELU_K = math.sqrt(2.0 / math.pi)


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
    mean = x.mean(axis=-1, keepdims=True)  # (B, T, 1)
    xc = x - mean  # (B, T, C) centred
    var = (xc * xc).mean(axis=-1, keepdims=True)  # (B, T, 1), biased like torch
    rstd = 1.0 / xp.sqrt(var + LN_EPS)  # (B, T, 1)
    xhat = xc * rstd  # (B, T, C)
    out = xhat * w + b  # (B, T, C)
    return out, (xhat, rstd, w)


@autocast
def layernorm_backward(dout, cache):
    """dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), with dxhat = dout * w."""
    xhat, rstd, w = cache
    lead = tuple(range(dout.ndim - 1))
    # forward was: out = xhat * w + b
    dw = (dout * xhat).sum(axis=lead)  # (C,)
    db = dout.sum(axis=lead)  # (C,)
    dxhat = dout * w  # (B, T, C)
    # forward was: xhat = (x - mean) * rstd, with mean and rstd functions of x as well
    mean_dxhat = dxhat.mean(axis=-1, keepdims=True)  # (B, T, 1)
    mean_dxhat_xhat = (dxhat * xhat).mean(axis=-1, keepdims=True)  # (B, T, 1)
    dx = rstd * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat)  # (B, T, C)
    return dx, dw, db


# --- GELU, tanh approximation (as GPT-2) ---------------------------------------------------


@autocast
def gelu_forward(x):
    """gelu(x) = 0.5 x (1 + tanh(u)), u = k (x + 0.044715 x^3), k = sqrt(2/pi)."""
    xp = array_module(x)
    th = xp.tanh(GELU_K * (x + 0.044715 * x**3))  # (B, T, 4C) tanh(u)
    out = 0.5 * x * (1.0 + th)  # (B, T, 4C)
    return out, (x, th)


@autocast
def gelu_backward(dout, cache):
    """d gelu/dx = 0.5 (1 + th) + 0.5 x (1 - th^2) du/dx, du/dx = k (1 + 3 * 0.044715 x^2)."""
    x, th = cache
    du = GELU_K * (1.0 + 3 * 0.044715 * x**2)  # (B, T, 4C)
    # forward was: out = 0.5 x (1 + th), th = tanh(u); d tanh(u)/du = 1 - th^2
    dx = dout * (0.5 * (1.0 + th) + 0.5 * x * (1.0 - th**2) * du)  # (B, T, 4C)
    return dx


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
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    # (B, T, 3, NH, HS) -> (3, B, NH, T, HS): one transpose gives all three in head-major form
    q, k, v = qkv.reshape(B, T, 3, n_head, hs).transpose(2, 0, 3, 1, 4)  # each (B, NH, T, HS)
    scale = 1.0 / math.sqrt(hs)
    att = attention_weights(q, k, scale)  # (B, NH, T, T)
    y = att @ v  # (B, NH, T, HS)
    y = y.transpose(0, 2, 1, 3).reshape(B, T, C)  # (B, T, C) heads side by side
    return y, (q, k, v, att if keep_scores else None, scale)


@autocast
def attention_weights(q, k, scale):
    """softmax(q k^T * scale) with the causal mask: (B, NH, T, T)."""
    xp = array_module(q)
    T = q.shape[2]
    s = (q @ k.transpose(0, 1, 3, 2)) * scale  # (B, NH, T, T)
    # causal mask: position t sees positions <= t only (-inf above the diagonal)
    s = s + xp.triu(xp.full((T, T), -xp.inf, dtype=s.dtype), k=1)  # (T, T) broadcast
    e = xp.exp(s - s.max(axis=-1, keepdims=True))  # stable softmax
    return e / e.sum(axis=-1, keepdims=True)  # (B, NH, T, T) attention weights


@autocast
def attention_backward(dout, cache):
    """Gradient of attention_forward with respect to qkv (B, T, 3C)."""
    q, k, v, att, scale = cache
    xp = array_module(dout)
    B, NH, T, HS = q.shape
    if att is None:  # selective recomputation: the forward's weights, again
        att = attention_weights(q, k, scale)  # (B, NH, T, T)
    dy = dout.reshape(B, T, NH, HS).transpose(0, 2, 1, 3)  # (B, NH, T, HS)
    # forward was: y = att @ v
    datt = dy @ v.transpose(0, 1, 3, 2)  # (B, NH, T, T)
    dv = att.transpose(0, 1, 3, 2) @ dy  # (B, NH, T, HS)
    # forward was: att = softmax(s); ds = att * (datt - sum(datt * att)); masked entries have
    # att == 0, so their gradient is 0 without looking at the mask again
    ds = att * (datt - (datt * att).sum(axis=-1, keepdims=True))  # (B, NH, T, T)
    # forward was: s = q @ k^T * scale
    dq = (ds @ k) * scale  # (B, NH, T, HS)
    dk = (ds.transpose(0, 1, 3, 2) @ q) * scale  # (B, NH, T, HS)
    dqkv = xp.stack([dq, dk, dv]).transpose(1, 3, 0, 2, 4)  # (B, T, 3, NH, HS), c_attn's layout
    return dqkv.reshape(B, T, 3 * NH * HS)  # (B, T, 3C)


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


@autocast
def tied_head_backward(dout, cache, h, wte):
    """The tied LM head's backward, through logits = h wte^T and the cross-entropy: returns
    dh = dlogits wte and dwte = dlogits^T h (summed over all tokens). ``cache`` is
    cross_entropy_forward's."""
    dlogits = cross_entropy_backward(dout, cache)  # (B, T, V)
    # forward was: logits = h @ wte^T
    dh = dlogits @ wte  # (B, T, C)
    dwte = dlogits.reshape(-1, dlogits.shape[-1]).T @ h.reshape(-1, h.shape[-1])  # (V, C)
    return dh, dwte
