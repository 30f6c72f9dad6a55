"""What MPI is handed for an array's dtype: the buffer it sees and the reduction it applies.

bf16 (mixed precision, refmp.runtime.precision): MPI has no bf16 datatype and mpi4py refuses
the ``ml_dtypes`` arrays, so a bf16 buffer goes to MPI as its uint16 view (all-gathers,
all-to-alls and messages only move bytes), and a reduction of bf16 uses a user-defined MPI
operation that adds (or takes the max of) two bf16 buffers in fp32 and rounds: exactly bf16
arithmetic, on the wire 2 bytes per element. fp16 is MPI's own (MPIX_C_FLOAT16 in MPICH,
through mpi4py).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from refmp.runtime.precision import BF16

MPI_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


def _bf16_op(fn) -> MPI.Op:
    """A commutative MPI op on bf16 buffers (seen by MPI as uint16): inout = fn(in, inout)."""

    def apply(inbuf, inoutbuf, datatype):
        a, b = np.frombuffer(inbuf, dtype=BF16), np.frombuffer(inoutbuf, dtype=BF16)
        b[...] = fn(a.astype(np.float32), b.astype(np.float32))  # rounded back to bf16

    return MPI.Op.Create(apply, commute=True)


BF16_OPS = {"sum": _bf16_op(np.add), "max": _bf16_op(np.maximum), "min": _bf16_op(np.minimum)}


def wire(buf):
    """What MPI is handed for ``buf``: bf16 as its uint16 view (the same bytes), else itself."""
    return buf.view(np.uint16) if buf.dtype == BF16 else buf


def mpi_op(op: str, dtype) -> MPI.Op:
    """The MPI operation that reduces arrays of ``dtype`` by ``op`` ("sum", "max", "min")."""
    return BF16_OPS[op] if dtype == BF16 else MPI_OPS[op]
