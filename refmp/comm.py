"""The one wrapper over mpi4py: collectives, point-to-point, waiting, and a byte ledger.

Every MPI call in refmp goes through a :class:`Comm`, which knows the grid axis it works on
("world", "dp", "tp", ...) and records each call in a shared :class:`Ledger` as
(op, axis) -> bytes and count. Tests hold those figures against the textbook formulas.

What a ledger entry counts: the bytes of the full logical tensor the operation acts on, as
seen from one rank (all-reduce: the buffer; all-gather: the gathered result; reduce-scatter:
the input before scattering; send/recv: the message). Multiply by the algorithm's factor
(a ring all-reduce moves 2 (n-1)/n of it per rank) to get wire traffic.

Waiting: MPICH busy-polls inside blocking calls, so a rank that waits would burn the core a
working rank needs when ranks outnumber cores. refmp therefore starts every operation
nonblocking and waits with Test-and-sleep (:func:`wait`), backing off from 10 us to 1 ms.
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np
from mpi4py import MPI

from refmp import backend

_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


class Ledger:
    """Bytes and call counts per (op, axis), shared by all the Comms of one grid."""

    def __init__(self):
        self.entries: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])

    def record(self, op: str, axis: str, nbytes: int) -> None:
        entry = self.entries[(op, axis)]
        entry[0] += int(nbytes)
        entry[1] += 1

    def bytes(self, op: str | None = None, axis: str | None = None) -> int:
        """Total bytes of the entries matching op and axis (None matches any)."""
        return sum(
            b for (o, a), (b, _) in self.entries.items()
            if (op is None or o == op) and (axis is None or a == axis)
        )

    def count(self, op: str | None = None, axis: str | None = None) -> int:
        return sum(
            c for (o, a), (_, c) in self.entries.items()
            if (op is None or o == op) and (axis is None or a == axis)
        )

    def as_dict(self) -> dict[str, dict[str, int]]:
        """{"op@axis": {"bytes": ..., "count": ...}} for logs and summaries."""
        return {f"{o}@{a}": {"bytes": b, "count": c} for (o, a), (b, c) in sorted(self.entries.items())}

    def reset(self) -> None:
        self.entries.clear()


def wait(req: MPI.Request):
    """Wait for a request without busy-polling: Test, then sleep, backing off to 1 ms."""
    delay = 1e-5
    while not req.Test():
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)


def wait_all(reqs: list[MPI.Request]) -> None:
    for r in reqs:
        wait(r)


class Comm:
    """An MPI communicator for one grid axis, with checked, counted, politely-waiting calls."""

    def __init__(self, mpi_comm: MPI.Comm, axis: str = "world", ledger: Ledger | None = None):
        self.mpi = mpi_comm
        self.axis = axis
        self.ledger = ledger if ledger is not None else Ledger()
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()

    # --- collectives on arrays --------------------------------------------------------------

    def allreduce(self, buf, op: str = "sum"):
        """In-place all-reduce of ``buf`` over this axis; returns ``buf``."""
        self.ledger.record("allreduce", self.axis, buf.nbytes)
        if self.size > 1:
            backend.sync()
            wait(self.mpi.Iallreduce(MPI.IN_PLACE, buf, op=_OPS[op]))
        return buf

    def allreduce_start(self, buf, op: str = "sum") -> MPI.Request | None:
        """Start an in-place all-reduce; finish it with :func:`wait`. For overlap with compute."""
        self.ledger.record("allreduce", self.axis, buf.nbytes)
        if self.size == 1:
            return None
        backend.sync()
        return self.mpi.Iallreduce(MPI.IN_PLACE, buf, op=_OPS[op])

    def allgather(self, buf):
        """Concatenate every rank's ``buf`` along axis 0, in rank order (same shape on all)."""
        xp = backend.array_module(buf)
        out = xp.empty((self.size * buf.shape[0],) + buf.shape[1:], dtype=buf.dtype)
        self.ledger.record("allgather", self.axis, out.nbytes)
        if self.size == 1:
            out[...] = buf
            return out
        backend.sync()
        wait(self.mpi.Iallgather(xp.ascontiguousarray(buf), out))
        return out

    def reduce_scatter(self, buf):
        """Sum ``buf`` over ranks and return this rank's 1/size slice of axis 0."""
        xp = backend.array_module(buf)
        if buf.shape[0] % self.size:
            raise ValueError(f"reduce_scatter: axis 0 ({buf.shape[0]}) not divisible by {self.size}")
        out = xp.empty((buf.shape[0] // self.size,) + buf.shape[1:], dtype=buf.dtype)
        self.ledger.record("reduce_scatter", self.axis, buf.nbytes)
        if self.size == 1:
            out[...] = buf
            return out
        backend.sync()
        wait(self.mpi.Ireduce_scatter_block(xp.ascontiguousarray(buf), out, op=MPI.SUM))
        return out

    def alltoall(self, buf):
        """Block j of ``buf`` (axis 0 in ``size`` equal blocks) goes to rank j; block j of the
        result came from rank j. Ledger: the send buffer's bytes."""
        xp = backend.array_module(buf)
        if buf.shape[0] % self.size:
            raise ValueError(f"alltoall: axis 0 ({buf.shape[0]}) not divisible by {self.size}")
        out = xp.empty_like(buf)
        self.ledger.record("alltoall", self.axis, buf.nbytes)
        if self.size == 1:
            out[...] = buf
            return out
        backend.sync()
        wait(self.mpi.Ialltoall(xp.ascontiguousarray(buf), out))
        return out

    def alltoallv(self, buf, send_rows, recv_rows):
        """Variable all-to-all along axis 0: the next ``send_rows[j]`` rows of ``buf`` go to
        rank j (in rank order); returns ``sum(recv_rows)`` rows, rank j's ``recv_rows[j]``
        rows in block j. Both counts are host integers, and must match the peers' (exchange
        them first, e.g. with :meth:`alltoall`). Ledger: the send buffer's bytes.
        """
        xp = backend.array_module(buf)
        row = int(np.prod(buf.shape[1:], dtype=np.int64))  # elements per row
        send = np.asarray(send_rows, dtype=np.int64) * row
        recv = np.asarray(recv_rows, dtype=np.int64) * row
        if len(send) != self.size or len(recv) != self.size or send.sum() != buf.size:
            raise ValueError(f"alltoallv on {self.axis}: counts {list(send_rows)} / "
                             f"{list(recv_rows)} do not fit {self.size} ranks and {buf.shape}")
        out = xp.empty((int(recv.sum()) // max(row, 1),) + buf.shape[1:], dtype=buf.dtype)
        self.ledger.record("alltoallv", self.axis, buf.nbytes)
        if self.size == 1:
            out[...] = buf
            return out
        sdispl = np.concatenate([[0], np.cumsum(send)[:-1]])
        rdispl = np.concatenate([[0], np.cumsum(recv)[:-1]])
        backend.sync()
        wait(self.mpi.Ialltoallv([xp.ascontiguousarray(buf), (send, sdispl)],
                                 [out, (recv, rdispl)]))
        return out

    def bcast(self, buf, root: int = 0):
        """In-place broadcast of ``buf`` from ``root``; returns ``buf``."""
        self.ledger.record("bcast", self.axis, buf.nbytes)
        if self.size > 1:
            backend.sync()
            wait(self.mpi.Ibcast(buf, root=root))
        return buf

    # --- small Python values (metrics, agreement), counted like the rest ---------------------

    def allreduce_scalar(self, value: float, op: str = "sum") -> float:
        """All-reduce one float (a loss or a count); ledgered as op "metric", not "allreduce"."""
        buf = np.array([value], dtype=np.float64)
        self.ledger.record("metric", self.axis, buf.nbytes)
        if self.size > 1:
            wait(self.mpi.Iallreduce(MPI.IN_PLACE, buf, op=_OPS[op]))
        return float(buf[0])

    def allgather_obj(self, obj) -> list:
        """Gather a small picklable object from every rank (used for agreement, not data)."""
        self.ledger.record("allgather_obj", self.axis, 0)
        if self.size == 1:
            return [obj]
        wait(self.mpi.Ibarrier())  # sleep here rather than busy-poll inside allgather
        return self.mpi.allgather(obj)

    def barrier(self) -> None:
        if self.size > 1:
            wait(self.mpi.Ibarrier())

    # --- point-to-point ----------------------------------------------------------------------

    def send(self, buf, dest: int, tag: int = 0) -> MPI.Request:
        """Start sending ``buf`` (contiguous) to ``dest``; wait on the returned request."""
        self.ledger.record("send", self.axis, buf.nbytes)
        backend.sync()
        return self.mpi.Isend(buf, dest=dest, tag=tag)

    def recv(self, shape, dtype, source: int, tag: int = 0):
        """Receive a new array of ``shape`` and ``dtype`` from ``source``, checking its size.

        The message is probed first (with Test-and-sleep) so that a size mismatch becomes a
        clear error naming both sides instead of a truncation or silent garbage.
        """
        xp = backend.xp
        out = xp.empty(shape, dtype=dtype)
        status = MPI.Status()
        delay = 1e-5
        while not self.mpi.Iprobe(source=source, tag=tag, status=status):
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
        got = status.Get_count(MPI.BYTE)
        if got != out.nbytes:
            raise ValueError(
                f"rank {self.rank} on {self.axis}: expected {out.nbytes} bytes "
                f"({tuple(shape)} {np.dtype(dtype).name}) from rank {source} tag {tag}, got {got}"
            )
        self.ledger.record("recv", self.axis, out.nbytes)
        wait(self.mpi.Irecv(out, source=source, tag=tag))
        return out
