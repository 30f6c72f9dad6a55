"""The calls on small Python values: a loss or a count summed over ranks, a few statistics,
an object every rank must agree on, a barrier. They carry no model data; each is ledgered
("metric", "allgather_obj") and recorded like the array calls of
:class:`refmp.distributed.comm.Comm`, which inherits them.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from refmp.distributed.reductions import mpi_op
from refmp.distributed.transport import Transport


class HostValues(Transport):
    """Collectives on host floats and picklable objects, for a :class:`~refmp.distributed.
    comm.Comm` (its ``mpi``, ``axis``, ``size`` and ``ledger``)."""

    def allreduce_scalar(self, value: float, op: str = "sum") -> float:
        """All-reduce one float (a loss or a count); ledgered as op "metric", not "allreduce"."""
        return float(self.allreduce_metrics([value], op)[0])

    def allreduce_metrics(self, values, op: str = "sum") -> np.ndarray:
        """All-reduce a few host floats (losses, counts, statistics), as op "metric"."""
        buf = np.array(values, dtype=np.float64)
        self.ledger.record("metric", self.axis, buf.nbytes)
        if self.size > 1:
            entry = self._record("metric", buf.nbytes, buf.dtype)
            self._wait(self._tracked(self.mpi.Iallreduce(MPI.IN_PLACE, buf,
                                                         op=mpi_op(op, buf.dtype)), entry))
        return buf

    def allgather_obj(self, obj) -> list:
        """Gather a small picklable object from every rank (used for agreement, not data)."""
        self.ledger.record("allgather_obj", self.axis, 0)
        if self.size == 1:
            return [obj]
        entry = self._record("allgather_obj", 0, None)
        # sleep in the barrier rather than busy-poll inside allgather
        self._wait(self._tracked(self.mpi.Ibarrier(), entry))
        return self.mpi.allgather(obj)

    def barrier(self) -> None:
        if self.size > 1:
            entry = self._record("barrier", 0, None)
            self._wait(self._tracked(self.mpi.Ibarrier(), entry))
