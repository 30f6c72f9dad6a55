"""Where each element a rank owns sits in the whole model, one unit at a time.

A sharded checkpoint stores, beside each owned piece's values, the global flat index of every
element (refmp.checkpoint.sharded), and a resume reads a rank's elements by those indices. An
int64 per element weighs as much as float64 weights, so the indices of every piece at once
would hold the model's share twice over: ``OwnedIndex`` computes them a unit at a time, as
they are read, and keeps only the last unit's. ``UnitAtATime`` is that pattern alone, which
training's evaluation uses too (its ZeRO-3 weights, all-gathered a unit at a time).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np


class UnitAtATime(Mapping):
    """A Mapping over the names of ZeRO units whose values are made a whole unit at a time
    (``load(u)``: {name: value} of unit u), keeping only the last unit's: reading name k
    loads k's unit unless it is the one held. ``unit_of``: name -> its unit, in order."""

    def __init__(self, unit_of: dict):
        self.unit_of = unit_of
        self.unit = None  # the unit held now, and its values
        self.held: dict = {}

    def load(self, u: str) -> dict:
        raise NotImplementedError

    def __getitem__(self, k: str):
        u = self.unit_of[k]
        if u != self.unit:
            self.held = {}  # the last unit's go before the next is made
            self.held = self.load(u)
            self.unit = u
        return self.held[k]

    def __iter__(self):
        return iter(self.unit_of)

    def __len__(self) -> int:
        return len(self.unit_of)


class OwnedIndex(UnitAtATime):
    """piece name -> (n,) int64 global flat indices of its elements, -1 at padding, for the
    pieces a rank owns (the Sharder's ``params``, in their order). ``units``: the Sharder's
    units; ``index(k)``: parameter k's positions shaped like its local (tp) shard."""

    def __init__(self, units: dict, index: Callable[[str], np.ndarray]):
        unit_of = {}  # piece -> its unit, in the order params has them
        for u, unit in units.items():
            shell = np.broadcast_to(np.int64(0), (unit.hi - unit.lo,))  # a view: no memory
            unit_of.update(dict.fromkeys(unit.pieces(shell), u))
        super().__init__(unit_of)
        self.units = units
        self.index = index

    def load(self, u: str) -> dict:
        unit = self.units[u]
        flat = unit.flatten({n: self.index(n) + 1 for n in unit.shapes}, np, np.int64) - 1
        return unit.pieces(flat[unit.lo : unit.hi].copy())  # padding: -1
