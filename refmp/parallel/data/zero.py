"""ZeRO's partition (Rajbhandari et al. 2020, sec. 5): a unit of parameters as one flat buffer,
padded and cut into one slice per rank of its data-parallel group.

Shapes: P elements of a unit, n ranks in its group, Pp = P padded up to a multiple of n,
S = Pp/n the slice [lo, hi) rank r owns.

Each stage keeps less of the replicated state by owning a slice, and needs two collectives
to move between the slice and the whole:

    gradients   reduce-scatter (Pp,) -> (S,): the sum of every rank's gradient, my slice of
                it (stage 1 once per step, stages 2 and 3 after each micro-batch);
    parameters  all-gather (S,) -> (Pp,): every rank's updated slice, the whole unit again
                (stages 1 and 2 after the step; stage 3 before each use, freed after).

The optimizer updates only the S elements a rank owns (``pieces``: split back by parameter
so that weight decay still knows the matrices). refmp.parallel.data.sharder runs the stages
over every unit of a rank; tutorials/04_zero.py runs one step by hand from this class and the
two collectives of refmp.distributed.comm.Comm.
"""

from __future__ import annotations

import math


class Unit:
    """One unit flattened into a padded buffer (Pp,), and the slice [lo, hi) this rank owns."""

    def __init__(self, name: str, shapes: dict, n: int, rank: int):
        self.name = name
        self.shapes = shapes
        self.offsets = {}
        o = 0
        for k, s in shapes.items():
            self.offsets[k] = o
            o += math.prod(s)
        self.numel = o  # P
        self.padded = -(-o // n) * n  # Pp, a multiple of n
        self.shard = self.padded // n  # S
        self.lo = rank * self.shard  # my slice [lo, hi)
        self.hi = (rank + 1) * self.shard

    def views(self, flat) -> dict:
        """The unit's parameters (full shapes) as views of a full flat buffer (Pp,)."""
        return {k: flat[o : o + math.prod(s)].reshape(s)
                for (k, s), o in zip(self.shapes.items(), self.offsets.values(), strict=True)}

    def flatten(self, arrays: dict, xp, dtype):
        """One padded flat buffer (Pp,) holding ``arrays`` (by name) in order, zeros after."""
        flat = xp.zeros(self.padded, dtype=dtype)
        for k, v in self.views(flat).items():
            v[...] = arrays[k]
        return flat

    def pieces(self, shard) -> dict:
        """This rank's elements of each parameter (and of the padding) as views of ``shard``."""
        out = {}
        ends = [(k, o, o + math.prod(self.shapes[k])) for k, o in self.offsets.items()]
        for k, a, b in ends + [(f"{self.name}.padding", self.numel, self.padded)]:
            a, b = max(a, self.lo), min(b, self.hi)
            if a < b:
                out[k] = shard[a - self.lo : b - self.lo]  # (b-a,) flat piece
        return out
