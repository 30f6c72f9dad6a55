"""Collectives whose ranks give different numbers of rows (MoE parallel folding's tokens).

Shapes: rows[j] the rows rank j gives or takes, a row the array's other dimensions.

A mixin of :class:`refmp.distributed.comm.Comm`, as refmp.distributed.host_values is: each
method says which MPI call moves which bytes, and Transport does the rest (the flight
recorder, staging, the polite wait). refmp.parallel.folding gathers the rows sent to an
expert over its etp ranks and scatters their sums back with these.
"""

from __future__ import annotations

import numpy as np

from refmp.distributed.reductions import mpi_op
from refmp.distributed.transport import Transport
from refmp.runtime import backend


class Ragged(Transport):
    """all-gather and reduce-scatter of rank-dependent row counts (MPI's "v" collectives)."""

    def allgatherv(self, buf, rows):
        """Concatenate every rank's ``buf`` along axis 0, rank j's ``rows[j]`` rows (host ints,
        the same list on every rank). Ledger: the result's bytes, as :meth:`allgather`."""
        xp = backend.array_module(buf)
        row = int(np.prod(buf.shape[1:], dtype=np.int64))
        counts = np.asarray(rows, dtype=np.int64) * row
        if len(counts) != self.size or counts[self.rank] != buf.size:
            raise ValueError(f"allgatherv on {self.axis}: rows {list(rows)} do not fit "
                             f"{self.size} ranks and {buf.shape} here")
        out = xp.empty((int(sum(rows)),) + buf.shape[1:], dtype=buf.dtype)
        displ = np.concatenate([[0], np.cumsum(counts)[:-1]])
        return self._out_of_place("allgatherv", out.nbytes, lambda s, r: (
            self.mpi.Iallgatherv(s, [r, (counts, displ)])), buf, out)

    def reduce_scatterv(self, buf, rows):
        """Sum ``buf`` over ranks and return this rank's block of axis 0: rank j's is the
        ``rows[j]`` rows after those of ranks < j (host ints, the same on every rank).
        Ledger: the send buffer's bytes, as :meth:`reduce_scatter`."""
        xp = backend.array_module(buf)
        row = int(np.prod(buf.shape[1:], dtype=np.int64))
        counts = np.asarray(rows, dtype=np.int64) * row
        if len(counts) != self.size or counts.sum() != buf.size:
            raise ValueError(f"reduce_scatterv on {self.axis}: rows {list(rows)} do not fit "
                             f"{self.size} ranks and {buf.shape}")
        out = xp.empty((int(rows[self.rank]),) + buf.shape[1:], dtype=buf.dtype)
        op = mpi_op("sum", buf.dtype)
        return self._out_of_place("reduce_scatterv", buf.nbytes, lambda s, r: (
            self.mpi.Ireduce_scatter(s, r, counts, op=op)), buf, out)
