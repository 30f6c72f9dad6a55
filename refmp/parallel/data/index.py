"""Where each element a rank owns sits in the whole model, one unit at a time.

A sharded checkpoint stores, beside each owned piece's values, the global flat index of every
element (refmp.checkpoint.sharded), and a resume reads a rank's elements by those indices. An
int64 per element weighs as much as float64 weights, so the indices of every piece at once
would hold the model's share twice over: ``OwnedIndex`` computes them a unit at a time, as
they are read, and keeps only the last unit's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np


class OwnedIndex(Mapping):
    """piece name -> (n,) int64 global flat indices of its elements, -1 at padding, for the
    pieces a rank owns (the Sharder's ``params``, in their order). ``units``: the Sharder's
    units; ``index(k)``: parameter k's positions shaped like its local (tp) shard."""

    def __init__(self, units: dict, index: Callable[[str], np.ndarray]):
        self.units = units
        self.index = index
        self.unit_of = {}  # piece -> its unit, in the order params has them
        for u, unit in units.items():
            shell = np.broadcast_to(np.int64(0), (unit.hi - unit.lo,))  # a view: no memory
            self.unit_of.update(dict.fromkeys(unit.pieces(shell), u))
        self.unit = None  # the unit computed last, and its pieces
        self.pieces: dict = {}

    def __getitem__(self, k: str) -> np.ndarray:
        u = self.unit_of[k]
        if u != self.unit:
            unit = self.units[u]
            self.pieces = {}  # the last unit's go first
            flat = unit.flatten({n: self.index(n) + 1 for n in unit.shapes}, np, np.int64) - 1
            self.pieces = unit.pieces(flat[unit.lo : unit.hi].copy())  # padding: -1
            self.unit = u
        return self.pieces[k]

    def __iter__(self):
        return iter(self.unit_of)

    def __len__(self) -> int:
        return len(self.unit_of)
