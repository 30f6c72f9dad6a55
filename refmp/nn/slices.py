"""A slice of a global tensor, and making it in bounded row blocks without the whole tensor.

Shapes: S a tensor's global shape (S[0] its rows; a row is S[1:]), n the elements of a slice,
R the rows of one block.

An :class:`Index` says which elements of a global tensor a rank holds, in the forms the
layouts cut them (``None`` stands for a whole dimension):

    rows      Index((((lo, hi),),))                     a stage's, a vocabulary split's rows
    columns   Index((None, ((lo, hi),)))                tp's column-parallel c_fc
    q|k|v     Index((None, ((lo, hi), (C+lo, C+hi), (2C+lo, 2C+hi))))   tp's c_attn heads
    padding   rows from S[0] on are zero                the vocabulary padded to Vp over tp
    flat      Index(dims, flat=(lo, hi))                elements [lo, hi) of the cut above,
                                                        flattened: ZeRO's partition of a shard

Each dimension's ranges are taken in order and concatenated (tp_index makes them from a
split). :func:`fill` makes a slice from a function that gives rows [g0, g1) of the tensor
(its other dimensions already cut), asking for chunks that never cross a multiple of R rows:
the slice plus one chunk is all that is ever allocated. The initializer
(refmp.nn.params.init_slice) draws one random block per R rows; the readers
(refmp.checkpoint.source) read each chunk from a file.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

BLOCK_BYTES = 1 << 20  # a chunk of rows: about 1 MiB (at least one row)

Ranges = tuple[tuple[int, int], ...]


class Index(NamedTuple):
    """Which elements of a global tensor: per leading dimension, the [start, stop) ranges
    taken along it (None, or a dimension left out: all of it), then optionally ``flat``, the
    elements [lo, hi) of that cut flattened in C order."""

    dims: tuple[Ranges | None, ...] = ()
    flat: tuple[int, int] | None = None


WHOLE = Index()


def rows(lo: int, hi: int) -> Index:
    """Rows [lo, hi) of a tensor (a stage's, a vocabulary split's)."""
    return Index((((lo, hi),),))


def ranges(shape: tuple[int, ...], index: Index, d: int) -> Ranges:
    """The ranges of dimension ``d`` that ``index`` takes."""
    rs = index.dims[d] if d < len(index.dims) else None
    return ((0, shape[d]),) if rs is None else tuple(rs)


def cut_shape(shape: tuple[int, ...], index: Index) -> tuple[int, ...]:
    """The shape of the dimensions' cut (before ``flat``)."""
    return tuple(sum(b - a for a, b in ranges(shape, index, d)) for d in range(len(shape)))


def slice_shape(shape: tuple[int, ...], index: Index) -> tuple[int, ...]:
    """The shape of the slice ``index`` makes of a tensor of ``shape``."""
    if index.flat is not None:
        return (index.flat[1] - index.flat[0],)
    return cut_shape(shape, index)


def check(shape: tuple[int, ...], index: Index, name: str = "tensor") -> None:
    """Refuse an index that does not fit ``shape`` (a ValueError naming the tensor): ranges
    run forward from 0, stay inside the tensor except along rows (padding), and ``flat`` lies
    inside the cut."""
    if not shape or len(index.dims) > len(shape):
        raise ValueError(f"{name}: index {index} does not fit shape {shape}")
    for d in range(len(shape)):
        for a, b in ranges(shape, index, d):
            if not 0 <= a <= b or (d > 0 and b > shape[d]):
                raise ValueError(f"{name}: range [{a}, {b}) of dimension {d} does not fit "
                                 f"shape {shape}")
    if index.flat is not None:
        lo, hi = index.flat
        if not 0 <= lo <= hi <= math.prod(cut_shape(shape, index)):
            raise ValueError(f"{name}: flat range [{lo}, {hi}) outside its cut "
                             f"{cut_shape(shape, index)}")


def cut(arr, shape: tuple[int, ...], index: Index):
    """``arr`` (some rows of the tensor, all of its other dimensions) cut along dimensions 1..:
    a copy where a dimension is cut, else ``arr`` itself."""
    for d in range(1, len(shape)):
        rs = ranges(shape, index, d)
        if rs != ((0, shape[d]),):
            at = (slice(None),) * d
            arr = np.concatenate([arr[at + (slice(a, b),)] for a, b in rs], axis=d)
    return arr


def take(full, index: Index):
    """The slice ``index`` of the whole tensor ``full`` (a host array): the reference the
    block-by-block makers are tested against, and what an in-memory source returns."""
    shape = tuple(full.shape)
    check(shape, index)
    parts = []
    for a, b in ranges(shape, index, 0):
        part = full[a:min(b, shape[0])]
        if b > shape[0]:  # padding rows, zero
            pad = np.zeros((b - max(a, shape[0]),) + shape[1:], full.dtype)
            part = np.concatenate([part, pad])
        parts.append(part)
    out = cut(np.concatenate(parts) if parts else full[:0], shape, index)
    if index.flat is not None:
        return np.ascontiguousarray(out).reshape(-1)[index.flat[0]:index.flat[1]].copy()
    return np.array(out)  # a copy, never a view of ``full``


def positions(shape: tuple[int, ...], index: Index) -> np.ndarray:
    """The global flat position (C order) of every element of the slice ``index`` makes, -1
    for padding rows: int64, shaped like the slice, made from one range per dimension
    without the whole tensor (what a sharded checkpoint stores beside a rank's values)."""
    check(shape, index)
    per_dim = [np.concatenate([np.arange(a, b, dtype=np.int64)
                               for a, b in ranges(shape, index, d)] or [np.zeros(0, np.int64)])
               for d in range(len(shape))]
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    mesh = np.ix_(*per_dim)
    out = sum(m * s for m, s in zip(mesh, strides, strict=True)) + np.zeros(
        cut_shape(shape, index), np.int64)  # (cut shape,)
    out[per_dim[0] >= shape[0]] = -1  # padding rows
    if index.flat is not None:
        return out.reshape(-1)[index.flat[0]:index.flat[1]].copy()
    return out


def fill(shape: tuple[int, ...], index: Index, dtype, read_rows: Callable, block: int):
    """The slice ``index`` of a tensor of global ``shape``, in ``dtype``, made by
    ``read_rows(g0, g1)``: rows [g0, g1) of the tensor with dimensions 1.. already cut (an
    array (g1 - g0, *cut_shape[1:])), asked for only where the slice needs them, never past
    S[0] (padding rows stay zero) and never across a multiple of ``block`` rows. The slice is
    allocated once; each chunk is copied in (cast to ``dtype``) and let go."""
    check(shape, index)
    cshape = cut_shape(shape, index)
    row = math.prod(cshape[1:])  # elements of one cut row
    lo, hi = index.flat if index.flat is not None else (0, cshape[0] * row)
    out = np.zeros(hi - lo, dtype)  # (n,) flat; zeros where the rows are padding
    if row == 0 or hi == lo:
        return out.reshape(slice_shape(shape, index))
    first, last = lo // row, -(-hi // row)  # the cut rows [first, last) the slice touches
    j = 0  # the cut row where this range starts
    for a, b in ranges(shape, index, 0):
        g = a + max(first - j, 0)  # the first global row of this range the slice needs
        end = min(a + min(last - j, b - a), shape[0])  # past its last (padding excluded)
        while g < end:
            g1 = min(end, (g // block + 1) * block)
            chunk = read_rows(g, g1)  # (g1 - g, *cshape[1:])
            p0 = (j + g - a) * row  # where the chunk starts in the flattened cut
            c0, c1 = max(p0, lo), min(p0 + (g1 - g) * row, hi)
            out[c0 - lo:c1 - lo] = chunk.reshape(-1)[c0 - p0:c1 - p0]
            del chunk
            g = g1
        j += b - a
    return out.reshape(slice_shape(shape, index))


def tp_index(shape: tuple[int, ...], dim: int, kind: str | None, rank: int, tp: int) -> Index:
    """The Index of tp rank ``rank``'s shard of a tensor split along ``dim`` (a split of
    refmp.parallel.placement.TP_SPLITS): ``"vocab"``, rows of the vocabulary padded to a
    multiple of tp (the rows past V are zero); ``"heads"``, the rank's columns of each of q,
    k and v; otherwise an even split of ``dim``."""
    if tp == 1:
        return WHOLE
    n = shape[dim]
    if kind == "vocab":
        n = -(-n // tp) * tp  # Vp
    if kind == "heads":
        C = n // 3
        w = C // tp
        rs = tuple((q * C + rank * w, q * C + (rank + 1) * w) for q in range(3))
    else:
        w = n // tp
        rs = ((rank * w, (rank + 1) * w),)
    return Index((None,) * dim + (rs,))
