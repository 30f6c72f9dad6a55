"""The Llama family's layers as forward/backward pairs (Touvron et al. 2023): RMSNorm, rotary
position embeddings, the SwiGLU gate and grouped-query attention.

Shapes: B batch, T time, C channels, NH query heads, NKV key/value heads (dividing NH),
HS head size (C/NH), F the MLP's width (intermediate_size), R = NH/NKV query heads per
key/value head.

The conventions are Hugging Face transformers' LlamaForCausalLM, so that its directories load
and compute the same numbers: RMSNorm scales after normalizing (w * (x / rms(x))), the rotary
embedding rotates the two halves of each head (``rotate_half``: [x1 | x2] -> [-x2 | x1], not
interleaved pairs), query head h reads key/value head h // R.

As in refmp.nn.layers, every ``*_forward`` returns ``(out, cache)``, every ``*_backward``
takes ``dout`` and the cache and mirrors the forward. Attention's core is refmp.nn.layers'
(the causal softmax(q k^T / sqrt(HS)) v of GPT-2): grouped-query attention only lays its
rotated q and its repeated k and v out as that core's [q | k | v], and sums the repeated
copies' gradients back onto the key/value head they came from.
"""

from __future__ import annotations

from refmp.nn import layers as L
from refmp.runtime.backend import array_module
from refmp.runtime.precision import autocast

# --- RMSNorm: y = w * x / sqrt(mean(x^2) + eps)   (Zhang & Sennrich 2019) --------------------


@autocast
def rmsnorm_forward(x, w, eps: float):
    """Normalize each token by its root mean square, then scale by ``w`` (C,); no bias, no
    mean subtracted."""
    xp = array_module(x)
    rstd = 1.0 / xp.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)  # (B, T, 1)
    xhat = x * rstd  # (B, T, C)
    return w * xhat, (xhat, rstd, w)


@autocast
def rmsnorm_backward(dout, cache):
    """dw = sum over tokens of dout * xhat; dx = rstd (dxhat - xhat mean(dxhat xhat))."""
    xhat, rstd, w = cache
    dw = (dout * xhat).reshape(-1, xhat.shape[-1]).sum(axis=0)  # (C,)
    # forward was: out = w * xhat, xhat = x * rstd, rstd = (mean(x^2) + eps)^-1/2
    dxhat = dout * w  # (B, T, C)
    dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    return dx, dw


# --- rotary position embeddings (Su et al. 2021), Hugging Face's rotate_half form ------------


def rope_tables(positions, head_size: int, theta: float, dtype):
    """cos and sin (T, HS) of angles pos * theta^(-2i/HS), i < HS/2, each half repeated:
    the tables for the tokens at ``positions`` (T,) (global positions: a context-parallel
    chunk or a decoded token passes its own)."""
    xp = array_module(positions)
    inv_freq = 1.0 / theta ** (xp.arange(0, head_size, 2, dtype="float64") / head_size)  # (HS/2,)
    ang = positions.astype("float64")[:, None] * inv_freq[None, :]  # (T, HS/2)
    ang = xp.concatenate([ang, ang], axis=-1)  # (T, HS)
    return xp.cos(ang).astype(dtype), xp.sin(ang).astype(dtype)


def rotate_half(x):
    """[x1 | x2] -> [-x2 | x1] over the last axis (its two halves)."""
    xp = array_module(x)
    h = x.shape[-1] // 2
    return xp.concatenate([-x[..., h:], x[..., :h]], axis=-1)


@autocast
def rope_forward(x, cos, sin):
    """x cos + rotate_half(x) sin for x (B, H, T, HS) and tables (T, HS)."""
    return x * cos + rotate_half(x) * sin


@autocast
def rope_backward(dout, cos, sin):
    """The rotation's transpose: rotate_half^T(g) = -rotate_half(g), so
    dx = dout cos - rotate_half(dout sin)."""
    return dout * cos - rotate_half(dout * sin)


# --- SwiGLU: silu(x W_gate) * (x W_up), then W_down   (Shazeer 2020) --------------------------


@autocast
def swiglu_forward(g, u):
    """silu(g) * u elementwise, for the gate and up projections g, u (B, T, F)."""
    xp = array_module(g)
    sig = 1.0 / (1.0 + xp.exp(-g))  # (B, T, F)
    return g * sig * u, (g, u, sig)


@autocast
def swiglu_backward(dout, cache):
    """d(silu(g))/dg = sig (1 + g (1 - sig)); returns dg, du."""
    g, u, sig = cache
    silu = g * sig
    du = dout * silu
    dg = dout * u * sig * (1.0 + g * (1.0 - sig))
    return dg, du


# --- grouped-query attention (Ainslie et al. 2023) ---------------------------------------------


def heads(x, n: int):
    """(B, T, n HS) -> (B, n, T, HS)."""
    B, T, D = x.shape
    return x.reshape(B, T, n, D // n).transpose(0, 2, 1, 3)


def merge_heads(x):
    """(B, n, T, HS) -> (B, T, n HS)."""
    B, n, T, hs = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, n * hs)


def repeat_kv(x, r: int):
    """(B, NKV, T, HS) -> (B, NKV r, T, HS): key/value head j serves query heads j r .. j r + r-1."""
    xp = array_module(x)
    return xp.repeat(x, r, axis=1)


def unrepeat_kv(dx, r: int):
    """repeat_kv's backward: the copies' gradients summed onto their head."""
    B, NH, T, hs = dx.shape
    return dx.reshape(B, NH // r, r, T, hs).sum(axis=2)  # (B, NKV, T, HS)


class RepeatedCore:
    """Grouped-query attention on a core that takes GPT-2's [q | k | v] (refmp.nn.layers'
    attention, cp's Ulysses): k and v repeated to NH heads, laid out with q, and the copies'
    gradients summed back onto their head. ``inner`` has forward(qkv, n_head) -> (y, cache)
    and backward(dout, cache) -> dqkv."""

    def __init__(self, inner):
        self.inner = inner

    def forward(self, q, k, v):
        """q (B, NH, T, HS), k, v (B, NKV, T, HS) -> y (B, NH, T, HS)."""
        xp = array_module(q)
        n_head, r = q.shape[1], q.shape[1] // k.shape[1]
        qkv = xp.concatenate([merge_heads(q), merge_heads(repeat_kv(k, r)),
                              merge_heads(repeat_kv(v, r))], axis=-1)  # (B, T, 3C)
        y, cache = self.inner.forward(qkv, n_head)  # (B, T, NH HS)
        return heads(y, n_head), (cache, n_head, r)

    def backward(self, dy, cache):
        """dy (B, NH, T, HS) -> dq (B, NH, T, HS), dk, dv (B, NKV, T, HS)."""
        inner, n_head, r = cache
        dqkv = self.inner.backward(merge_heads(dy), inner)  # (B, T, 3C)
        dq, dk, dv = (heads(a, n_head) for a in array_module(dy).split(dqkv, 3, axis=-1))
        return dq, unrepeat_kv(dk, r), unrepeat_kv(dv, r)  # the copies summed


class LocalCore:
    """refmp.nn.layers' attention core: every token of each sequence is here."""

    def __init__(self, keep_scores: bool = True):
        self.keep_scores = keep_scores  # False: selective recomputation of the softmax

    def forward(self, qkv, n_head: int):
        return L.attention_forward(qkv, n_head, self.keep_scores)  # (B, T, C)

    def backward(self, dout, cache):
        return L.attention_backward(dout, cache)  # (B, T, 3C)


class SerialCore(RepeatedCore):
    """The serial grouped-query core: refmp.nn.layers' attention on the repeated heads.
    Context parallelism passes its own (refmp.parallel.context.gqa_ring, or Ulysses in a
    RepeatedCore), with the same two methods."""

    def __init__(self, keep_scores: bool = True):
        super().__init__(LocalCore(keep_scores))


def gqa_forward(q, k, v, n_head: int, n_kv_head: int, cos, sin, core=None):
    """Causal attention of q (B, T, NH HS) over k, v (B, T, NKV HS), rotary positions from
    the tables (T, HS) of these tokens. Returns y (B, T, NH HS). ``core``: the attention core
    on heads, forward(q, k, v) with k, v of NKV heads (default SerialCore())."""
    core = SerialCore() if core is None else core
    qh = rope_forward(heads(q, n_head), cos, sin)  # (B, NH, T, HS)
    kh = rope_forward(heads(k, n_kv_head), cos, sin)  # (B, NKV, T, HS)
    y, cache = core.forward(qh, kh, heads(v, n_kv_head))  # (B, NH, T, HS)
    return merge_heads(y), (core, cache, n_head, cos, sin)


def gqa_backward(dout, cache):
    """Returns dq (B, T, NH HS), dk, dv (B, T, NKV HS)."""
    core, core_cache, n_head, cos, sin = cache
    dq, dk, dv = core.backward(heads(dout, n_head), core_cache)  # (B, NH | NKV, T, HS)
    # forward was: qh = rope(q), kh = rope(k), y = core(qh, kh, v)
    return (merge_heads(rope_backward(dq, cos, sin)), merge_heads(rope_backward(dk, cos, sin)),
            merge_heads(dv))
