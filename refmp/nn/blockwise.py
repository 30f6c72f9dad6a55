"""Attention over one block of keys at a time, with each row's log-sum-exp: the pieces ring
attention (refmp.parallel.context.ring) is built of.

Shapes: B batch, NH heads, Tq queries and Tk keys of the block, HS head size. The serial
attention (refmp.nn.layers.attention_forward) sees every key at once; these see one block,
return what is needed to merge blocks exactly, and recompute in the backward what the
forward did not keep. Summed over all blocks they give the serial attention and its
gradient (tests/test_context_serial.py).
"""

from __future__ import annotations

from refmp.nn import flash
from refmp.runtime.backend import array_module
from refmp.runtime.precision import autocast


@autocast
def attention_block_forward(q, k, v, scale, causal=False):
    """Attention of queries ``q`` over one block of keys/values, and the row log-sum-exp.

    q (B, NH, Tq, HS), k and v (B, NH, Tk, HS). With s = q k^T * scale (plus, if ``causal``,
    -inf above the diagonal of an aligned Tq == Tk block: refmp.nn.flash's query blocks, which
    skip the keys above it):

        y = softmax(s) v  (normalized within this block),   lse = log sum_j exp(s_j)

    Two blocks' results merge exactly with :func:`attention_merge` (Milakov & Gimelshein
    2018; the rule FlashAttention and ring attention are built on). Nothing is cached: the
    backward recomputes s from q and k (memory vs compute: a (Tq, Tk) matrix per block is
    never kept).
    """
    xp = array_module(q)
    if causal:  # the same formula in query blocks, the keys above the diagonal skipped
        y, lse = flash.causal_forward(q, k, v, scale)  # (B, NH, Tq, HS), (B, NH, Tq, 1)
        return y, lse[..., 0]
    s = (q @ k.transpose(0, 1, 3, 2)) * scale  # (B, NH, Tq, Tk)
    m = s.max(axis=-1, keepdims=True)  # (B, NH, Tq, 1)
    p = xp.exp(s - m)  # (B, NH, Tq, Tk)
    l = p.sum(axis=-1, keepdims=True)  # (B, NH, Tq, 1)
    y = (p @ v) / l  # (B, NH, Tq, HS)
    lse = (m + xp.log(l))[..., 0]  # (B, NH, Tq)
    return y, lse


@autocast
def attention_merge(y1, lse1, y2, lse2):
    """Merge two partial attentions over disjoint key sets (the online-softmax rule):

        lse = log(exp(lse1) + exp(lse2)),   y = exp(lse1 - lse) y1 + exp(lse2 - lse) y2

    ``lse1 = -inf`` (nothing seen yet) gives back (y2, lse2) exactly.
    """
    xp = array_module(y1)
    lse = xp.logaddexp(lse1, lse2)  # (B, NH, Tq)
    y = xp.exp(lse1 - lse)[..., None] * y1 + xp.exp(lse2 - lse)[..., None] * y2  # (B, NH, Tq, HS)
    return y, lse


@autocast
def attention_block_backward(dy, q, k, v, y, lse, scale, causal=False):
    """This block's share of the attention gradient, given the *merged* y and lse of each row.

    With p = exp(s - lse) the final softmax weights restricted to this block and
    D = rowsum(dy * y) (FlashAttention-2 backward, Dao 2023, algorithm 2):

        dv = p^T dy,  dp = dy v^T,  ds = p (dp - D),  dq = ds k * scale,  dk = ds^T q * scale

    Summing dq over all key blocks, and dk, dv over all query blocks, gives
    :func:`refmp.nn.layers.attention_backward`'s gradient.
    """
    xp = array_module(q)
    if causal:  # the same formula in query blocks, the keys above the diagonal skipped
        return flash.causal_backward(dy, y, q, k, v, lse[..., None], scale)
    s = (q @ k.transpose(0, 1, 3, 2)) * scale  # (B, NH, Tq, Tk), recomputed
    p = xp.exp(s - lse[..., None])  # (B, NH, Tq, Tk) forward was: softmax over all blocks
    dv = p.transpose(0, 1, 3, 2) @ dy  # (B, NH, Tk, HS)  forward was: y = p @ v
    dp = dy @ v.transpose(0, 1, 3, 2)  # (B, NH, Tq, Tk)
    D = (dy * y).sum(axis=-1, keepdims=True)  # (B, NH, Tq, 1) = sum_j p_j dp_j over all blocks
    ds = p * (dp - D)  # (B, NH, Tq, Tk)
    dq = (ds @ k) * scale  # (B, NH, Tq, HS)  forward was: s = q @ k^T * scale
    dk = (ds.transpose(0, 1, 3, 2) @ q) * scale  # (B, NH, Tk, HS)
    return dq, dk, dv
