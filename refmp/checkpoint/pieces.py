"""Reading a slice of a sharded checkpoint (refmp.checkpoint.format) from the pieces that
hold it, run by run, never a whole tensor or a whole file.

Shapes: W the runs of global flat indices a slice wants, R a piece's runs, n the slice's
elements, P a tensor's elements.

A slice (a refmp.nn.slices.Index, or an array of global flat indices as a rank's
``piece_index`` gives them) is a list of wanted runs: (global start, length, where it goes in
the slice). Each file whose manifest entry says its piece of the tensor overlaps them is
checked (size and sha256, streamed, once), its ``{name}/runs`` (R, 2) read, and the overlaps
of the two lists of runs computed; the values are then read with safetensors' get_slice in
spans of at most one chunk (refmp.nn.slices.BLOCK_BYTES), each copied into the slice. The
overlaps must cover the slice exactly once: a checkpoint that misses elements, or gives one
twice, is refused.
"""

from __future__ import annotations

import hashlib
import math
import os

import numpy as np

from refmp.checkpoint.format import find, read_manifest
from refmp.errors import ConfigError
from refmp.nn.slices import BLOCK_BYTES, WHOLE, Index, check, cut_shape, ranges, slice_shape


def index_runs(shape: tuple[int, ...], index: Index):
    """(starts, lengths, offsets) (W,) int64: the global flat runs the slice ``index`` of a
    tensor of ``shape`` holds, and where each begins in the slice (padding rows hold none)."""
    cshape = cut_shape(shape, index)
    s = np.zeros(1, np.int64)  # runs inside one element of the dimensions after d
    ln = np.ones(1, np.int64)
    o = np.zeros(1, np.int64)
    for d in range(len(shape) - 1, -1, -1):
        stride = math.prod(shape[d + 1:])  # elements of one index along d
        cstride = math.prod(cshape[d + 1:])
        whole = len(s) == 1 and s[0] == 0 and ln[0] == stride
        S, L, O = [], [], []
        j = 0  # the cut index where this range starts
        for a, b in ranges(shape, index, d):
            b_real = min(b, shape[d])  # rows past the end: padding, no runs
            if whole and b_real > a:  # whole sub-blocks: one run for the range
                S.append(np.array([a * stride]))
                L.append(np.array([(b_real - a) * stride]))
                O.append(np.array([j * cstride]))
            elif b_real > a:
                i = np.arange(a, b_real, dtype=np.int64)[:, None]
                S.append((i * stride + s[None, :]).ravel())
                L.append(np.broadcast_to(ln, (len(i), len(ln))).ravel())
                O.append(((i - a + j) * cstride + o[None, :]).ravel())
            j += b - a
        empty = np.zeros(0, np.int64)
        s, ln, o = (np.concatenate(x) if x else empty for x in (S, L, O))
    if index.flat is not None:  # keep the parts inside [lo, hi) of the cut
        lo, hi = index.flat
        keep = (o < hi) & (o + ln > lo)
        s, ln, o = s[keep], ln[keep], o[keep]
        a, b = np.maximum(o, lo), np.minimum(o + ln, hi)
        s, ln, o = s + (a - o), b - a, a - lo
    keep = ln > 0
    return s[keep], ln[keep], o[keep]


def element_runs(flat_index: np.ndarray):
    """(starts, lengths, offsets): the runs of the global flat indices ``flat_index`` (n,),
    -1 for padding (left out), and where each begins in it."""
    pos = np.flatnonzero(flat_index >= 0)
    g = flat_index[pos]
    breaks = np.flatnonzero((np.diff(g) != 1) | (np.diff(pos) != 1)) + 1
    first = np.concatenate([[0], breaks]).astype(np.int64)
    lengths = np.diff(np.concatenate([first, [len(g)]])).astype(np.int64)
    return g[first].astype(np.int64), lengths, pos[first].astype(np.int64)


def overlaps(want, have):
    """(offsets in the slice, offsets in the piece's values, lengths) of every overlap of
    the wanted runs ``want`` (starts, lengths, offsets) with a piece's ``have`` (starts,
    lengths, value offsets), each list of disjoint runs."""
    ws, wl, wo = want
    order = np.argsort(have[0], kind="stable")
    ps, pl, pv = (x[order] for x in have)
    pe, we = ps + pl, ws + wl
    j0 = np.searchsorted(pe, ws, "right")  # the first piece run ending after each start
    j1 = np.searchsorted(ps, we, "left")  # past the last one starting before its end
    counts = np.maximum(j1 - j0, 0)
    i = np.repeat(np.arange(len(ws)), counts)
    j = j0[i] + np.arange(len(i)) - np.repeat(np.cumsum(counts) - counts, counts)
    a, b = np.maximum(ws[i], ps[j]), np.minimum(we[i], pe[j])
    return wo[i] + (a - ws[i]), pv[j] + (a - ps[j]), b - a


class CheckpointSource:
    """The sharded checkpoint at (or latest in) ``path``, read slice by slice: a Source
    (refmp.checkpoint.source) of its parameters, and of its optimizer moments (``kind``)."""

    def __init__(self, path: str):
        self.ckpt = find(path)
        self.man = read_manifest(self.ckpt)
        self.dtype = np.dtype(self.man["dtype"])
        self.metadata: dict[str, str] = {}
        self.checked: set[str] = set()  # the files whose size and sha256 were checked

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(s) for k, s in self.man["tensors"].items()}

    def read(self, name: str, index: Index = WHOLE, dtype=None, kind: str = "param"):
        """The slice ``index`` of tensor ``name`` (its ``kind``: param, or a moment)."""
        shape = self.shapes()[name]
        check(shape, index, name)
        out = self.read_runs(name, index_runs(shape, index), math.prod(slice_shape(shape, index)),
                             dtype, kind)
        return out.reshape(slice_shape(shape, index))

    def read_elements(self, name: str, flat_index: np.ndarray, dtype=None, kind: str = "param"):
        """The elements of ``name`` at the global flat indices ``flat_index`` (n,), 0 where
        it is -1 (padding): a rank's piece, as its ``piece_index`` says."""
        return self.read_runs(name, element_runs(flat_index), flat_index.size, dtype, kind)

    def verify(self, fname: str) -> None:
        """Check one file's size and sha256 against the manifest (streamed, once)."""
        if fname in self.checked:
            return
        entry = self.man["files"][fname]
        path = os.path.join(self.ckpt, fname)
        if not os.path.isfile(path):
            raise ConfigError(f"checkpoint file {path}: missing (its manifest lists it)")
        size = os.path.getsize(path)
        if size != entry["bytes"]:
            raise ConfigError(f"checkpoint file {path}: {size} bytes, its manifest says "
                              f"{entry['bytes']} (truncated or altered)")
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(BLOCK_BYTES):
                h.update(chunk)
        if h.hexdigest() != entry["sha256"]:
            raise ConfigError(f"checkpoint file {path}: sha256 differs from its manifest's "
                              f"(the file was altered)")
        self.checked.add(fname)

    def read_runs(self, name: str, want, n: int, dtype=None, kind: str = "param"):
        """(n,) the elements of ``name`` the runs ``want`` (starts, lengths, offsets) ask
        for, from every file holding some of them; 0 where no run points."""
        from safetensors import safe_open

        out = np.zeros(n, self.dtype if dtype is None else dtype)
        P = math.prod(self.man["tensors"][name])
        lo = int(want[0].min()) if len(want[0]) else 0
        hi = int((want[0] + want[1]).max()) if len(want[0]) else 0
        got = []  # (offsets, lengths) covered, from every file
        for fname, entry in sorted(self.man["files"].items()):
            p = entry["pieces"].get(name)
            if p is None or p["first"] >= hi or p["last"] < lo:
                continue
            self.verify(fname)
            path = os.path.join(self.ckpt, fname)
            try:
                with safe_open(path, framework="numpy") as f:
                    runs = f.get_tensor(f"{name}/runs")  # (R, 2) start, length
                    if int(runs[:, 1].sum()) != p["numel"] or runs[:, 0].min() < 0 \
                            or (runs[:, 0] + runs[:, 1]).max() > P:
                        raise ValueError("its runs are not the slice its manifest gives")
                    values = np.cumsum(runs[:, 1]) - runs[:, 1]  # (R,) where each run starts
                    o, v, ln = overlaps(want, (runs[:, 0], runs[:, 1], values))
                    copy_spans(f.get_slice(f"{name}/{kind}"), o, v, ln, out)
            except ConfigError:
                raise
            except Exception as e:  # a missing tensor, a bad header, runs out of range
                raise ConfigError(f"checkpoint file {path}: {name} does not match the manifest "
                                  f"({e})") from e
            got.append((o, ln))
        covered = np.concatenate([g[0] for g in got]) if got else np.zeros(0, np.int64)
        lengths = np.concatenate([g[1] for g in got]) if got else np.zeros(0, np.int64)
        order = np.argsort(covered, kind="stable")
        ends = (covered + lengths)[order]
        twice = bool((covered[order][1:] < ends[:-1]).any())
        missing = int(want[1].sum() - lengths.sum())
        if twice or missing:
            what = "some elements are held twice" if twice else f"no file holds {missing} elements"
            raise ConfigError(f"checkpoint manifest {self.man['path']}: {what} of {name} (of "
                              f"the slice asked for)")
        return out


def copy_spans(sl, o, v, ln, out) -> None:
    """Copy the pieces [v, v + ln) of the values ``sl`` (a safetensors slice) to [o, o + ln)
    of ``out``, reading spans of at most one chunk (BLOCK_BYTES)."""
    step = max(1, BLOCK_BYTES // out.dtype.itemsize)
    pieces = np.maximum(-(-ln // step), 1)  # split long overlaps into chunks
    k = np.repeat(np.arange(len(ln)), pieces)
    part = np.arange(len(k)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    o2, v2 = o[k] + part * step, v[k] + part * step
    ln2 = np.minimum(ln[k] - part * step, step)
    order = np.argsort(v2, kind="stable")
    o2, v2, ln2 = o2[order], v2[order], ln2[order]
    t = 0
    while t < len(v2):
        u = t + 1  # the overlaps [t, u) read as one span [v2[t], end)
        end = v2[t] + ln2[t]
        while u < len(v2) and max(end, v2[u] + ln2[u]) - v2[t] <= step:
            end = max(end, v2[u] + ln2[u])  # (a slice may ask for an element twice)
            u += 1
        data = sl[int(v2[t]):int(end)]
        for a, b, c in zip(o2[t:u], v2[t:u] - v2[t], ln2[t:u], strict=True):
            out[a:a + c] = data[b:b + c]
        t = u
