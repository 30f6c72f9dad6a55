"""FP8 numbers, emulated: the two formats, power-of-two scales, and quantizing a tensor whole
(one scale) or in blocks of 32 (MXFP8, one scale a block).

Shapes: ``...`` any leading axes; nb blocks of MX_BLOCK elements along the blocked axis.

FP8 training (Micikevicius et al. 2022, "FP8 Formats for Deep Learning") runs each GEMM on
8-bit operands: E4M3 (4 exponent bits, 3 mantissa bits, largest 448) for the forward's
inputs, E5M2 (largest 57344, more range, less precision) for the gradients. A tensor x is
multiplied by a scale s so that its largest magnitude (its *amax*) lands near the format's
largest value, then rounded: ``q = fp8(x s)``, and the product of two such operands is
``(q_a q_b) / (s_a s_b)``, accumulated wide.

Here every scale is a power of two, ``s = 2^floor(log2(fp8_max / amax))`` (the smallest
power-of-two divisor that fits the amax, the rule NVIDIA's MXFP8 recipe uses for its E8M0
block scales), so:

* ``x s`` and ``q / s`` are exact: dequantizing first and multiplying in the run's dtype
  (float64 in the parity tests, fp32 otherwise) is the FP8 product with wide accumulation,
  bit for bit: the emulation needs no FP8 matrix multiply;
* a scale is one byte, its exponent (MXFP8's E8M0).

``ml_dtypes`` gives NumPy the two formats (float8_e4m3fn, float8_e5m2); a value past the
format's largest becomes NaN there, so values are clipped first (a delayed scale, taken from
past amaxes, may be too large for this step's tensor: those values saturate).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from refmp.runtime.backend import array_module

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)  # forward: activations and weights
E5M2 = np.dtype(ml_dtypes.float8_e5m2)  # backward: gradients
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
MX_BLOCK = 32  # MXFP8: elements sharing one scale (OCP Microscaling spec, 2023)
EXP_LIMIT = 127  # a scale's exponent fits E8M0 (and an int8)


class Quantized:
    """An FP8 tensor: ``q`` the 8-bit values, ``exp`` the scales' exponents (int8: s = 2^exp;
    one, or one per block of MX_BLOCK along ``axis``), ``shape`` the tensor's. A leaf in a
    cache (not a tuple): the activation ledger counts its ``nbytes``, 1 per element plus the
    scales."""

    def __init__(self, q, exp, shape: tuple, axis: int | None, dtype):
        self.q = q  # like x; with blocks: (..., nb, MX_BLOCK), the blocked axis last
        self.exp = exp  # () or (..., nb, 1)
        self.shape = shape
        self.axis = axis
        self.dtype = dtype  # what it was quantized from, and dequantizes to

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes) + int(self.exp.nbytes)


def amax(x):
    """max |x| over the whole tensor, a 0-d array in x's dtype (0 for an empty tensor)."""
    xp = array_module(x)
    return xp.abs(x).max() if x.size else xp.zeros((), dtype=x.dtype)


def scale_exponent(a, fmt: np.dtype):
    """floor(log2(fp8_max / a)) as int8, elementwise; 0 where a is 0 (nothing to scale)."""
    xp = array_module(a)
    a = xp.asarray(a, dtype=np.float64)
    safe = xp.where(a > 0, a, 1.0)
    e = xp.floor(xp.log2(FP8_MAX[fmt] / safe))
    # log2 may round across an integer: fix so that a * 2^e <= max < a * 2^(e+1)
    e = xp.where(safe * xp.ldexp(1.0, e.astype(np.int32)) > FP8_MAX[fmt], e - 1, e)
    e = xp.where(safe * xp.ldexp(1.0, (e + 1).astype(np.int32)) <= FP8_MAX[fmt], e + 1, e)
    e = xp.where(a > 0, e, 0)
    return xp.clip(e, -EXP_LIMIT, EXP_LIMIT).astype(np.int8)


def pow2(exp, dtype):
    """2^exp in ``dtype`` (exact: |exp| <= 127 fits fp32's and bf16's exponents)."""
    xp = array_module(exp)
    return xp.ldexp(1.0, xp.asarray(exp, dtype=np.int32)).astype(dtype)


def _round(x, exp, fmt: np.dtype):
    """fp8(x 2^exp), clipped to the format's range (exact scaling: a power of two)."""
    xp = array_module(x)
    m = FP8_MAX[fmt]
    scaled = x * pow2(exp, x.dtype)
    return xp.clip(scaled, -m, m).astype(fmt)


def quantize_tensor(x, fmt: np.dtype, a=None) -> Quantized:
    """One scale for the whole tensor, from its amax ``a`` (default: x's own; a layout that
    holds a shard passes the amax reduced over the shards, a delayed recipe a past one)."""
    exp = scale_exponent(amax(x) if a is None else a, fmt)  # ()
    return Quantized(_round(x, exp, fmt), exp, x.shape, None, x.dtype)


def quantize_blocks(x, fmt: np.dtype, axis: int) -> Quantized:
    """MXFP8: one scale per MX_BLOCK consecutive elements along ``axis`` (a short last block
    when the axis is not a multiple of it). Blocks start at index 0 of this array: a shard
    whose edges fall on block edges is quantized exactly as the whole tensor's slice."""
    xp = array_module(x)
    xt = xp.moveaxis(x, axis, -1)  # (..., n)
    n = xt.shape[-1]
    nb = -(-n // MX_BLOCK)
    pad = xp.zeros((*xt.shape[:-1], nb * MX_BLOCK), dtype=x.dtype)
    pad[..., :n] = xt
    blocks = pad.reshape(*xt.shape[:-1], nb, MX_BLOCK)  # (..., nb, 32)
    exp = scale_exponent(xp.abs(blocks).max(axis=-1, keepdims=True), fmt)  # (..., nb, 1)
    return Quantized(_round(blocks, exp, fmt), exp, x.shape, axis % x.ndim, x.dtype)


def dequantize(z: Quantized, dtype=None):
    """The values q / s in ``dtype`` (default the tensor's own; exact for float64, fp32 and bf16: q has 3 or 2
    mantissa bits and s is a power of two)."""
    xp = array_module(z.q)
    dtype = z.dtype if dtype is None else dtype
    x = z.q.astype(dtype) * pow2(-z.exp.astype(np.int32), dtype)
    if z.axis is None:
        return x
    n = z.shape[z.axis]
    x = x.reshape(*x.shape[:-2], -1)[..., :n]  # (..., n)
    return xp.ascontiguousarray(xp.moveaxis(x, -1, z.axis))
