"""``REFMP_CHECK_CALLS=1``: before each collective, the ranks of its group check that they
make the same call (operation, bytes, dtype), so a mismatch is an error naming every rank's
call, never garbage.

Without it, the watchdog finds mismatched calls that hang (refmp.distributed.diagnose), but
two different collectives whose messages happen to fit complete under MPICH with wrong
values (an all-reduce on one rank against an all-gather of as many bytes on the other), and
no rank ever waits. The check is one more small all-reduce per collective, on a duplicate of
the group's communicator (so neither the ledger nor the recorder's sequence numbers see it):
a debugging switch, like PyTorch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, not a default.
"""

from __future__ import annotations

import os
import zlib

import numpy as np
from mpi4py import MPI

from refmp.distributed.recorder import caller
from refmp.distributed.waiting import wait
from refmp.errors import TrainingError

ENABLED = os.environ.get("REFMP_CHECK_CALLS") == "1"


class MismatchedCalls(TrainingError):
    """The ranks of a group made different collective calls (raised on every rank of it)."""


def check_call(comm, op: str, nbytes: int, dtype) -> None:
    """Raise MismatchedCalls on every rank of ``comm`` unless all make this call.

    A fingerprint f of the call is all-reduced as (f, -f) with MAX: all equal exactly when
    max f == -max(-f) == min f. An all-to-all-v's bytes differ by rank: only its op counts."""
    if comm.check_mpi is None:
        comm.check_mpi = comm.mpi.Dup()
    what = op if op == "alltoallv" else f"{op} {nbytes} {dtype}"
    fingerprint = zlib.crc32(what.encode())
    buf = np.array([fingerprint, -fingerprint], dtype=np.int64)
    wait(comm.check_mpi.Iallreduce(MPI.IN_PLACE, buf, op=MPI.MAX))
    if buf[0] == -buf[1]:
        return
    file, line, fn = caller()
    mine = f"{op} {nbytes} B {dtype} at {os.path.basename(file)}:{line} {fn}"
    calls = comm.check_mpi.allgather((comm.world_ranks[comm.rank], mine))
    seq = comm.recorder.counts.get(comm.group_id, 0) + 1
    raise MismatchedCalls(f"mismatched calls on {comm.recorder.group_name(comm.group_id)} "
                          f"#{seq}: " + "; ".join(f"rank {r} {c}" for r, c in calls))
