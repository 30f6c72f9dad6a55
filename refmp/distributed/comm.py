"""The one wrapper over mpi4py: collectives and point-to-point, each call ledgered.

Every MPI call in refmp goes through a :class:`Comm`, which knows the grid axis it works on
("world", "dp", "tp", ...) and records each call's bytes and count in a shared
:class:`refmp.distributed.ledger.Ledger`. Every operation starts nonblocking; a method that
returns a request leaves the wait to the caller (refmp.distributed.waiting.wait).

What every call does around MPI (the flight recorder's entry, staging device arrays through
host memory, the polite wait) is :class:`refmp.distributed.transport.Transport`'s, so each
method here says only which MPI call moves which bytes. The calls on small Python values
(a loss, a count, an object every rank must agree on, a barrier) are
:class:`refmp.distributed.host_values.HostValues`'; those whose ranks give different numbers
of rows, :class:`refmp.distributed.ragged.Ragged`'.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from refmp.distributed.host_values import HostValues
from refmp.distributed.ledger import Ledger
from refmp.distributed.ragged import Ragged
from refmp.distributed.recorder import Recorder, for_new_grid
from refmp.distributed.reductions import mpi_op, wire
from refmp.distributed.waiting import sleep_until
from refmp.runtime import backend


class Comm(HostValues, Ragged):
    """An MPI communicator for one grid axis, with checked, counted, politely-waiting calls."""

    def __init__(self, mpi_comm: MPI.Comm, axis: str = "world", ledger: Ledger | None = None,
                 recorder: Recorder | None = None):
        self.mpi = mpi_comm
        self.axis = axis
        self.ledger = ledger if ledger is not None else Ledger()
        self.recorder = recorder if recorder is not None else for_new_grid()
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        # this group's members as world ranks: how the recorder names groups and peers
        self.world_ranks = tuple(MPI.Group.Translate_ranks(
            mpi_comm.Get_group(), list(range(self.size)), MPI.COMM_WORLD.Get_group()))
        self.group_id = self.recorder.group(axis, self.world_ranks)
        self.check_mpi: MPI.Comm | None = None  # REFMP_CHECK_CALLS's duplicate (callcheck)
        self.cuda_aware = False  # set for all axes by ProcessGrid.set_cuda_aware, agreed by all ranks

    # --- collectives on arrays --------------------------------------------------------------

    def allreduce(self, buf, op: str = "sum"):
        """In-place all-reduce of ``buf`` (contiguous) over this axis; returns ``buf``."""
        req = self.allreduce_start(buf, op)
        if req is not None:
            self._wait(req)
        return buf

    def allreduce_start(self, buf, op: str = "sum") -> MPI.Request | None:
        """Start an in-place all-reduce; finish it with ``wait`` (refmp.distributed.waiting), for
        overlap with compute."""
        self.ledger.record("allreduce", self.axis, buf.nbytes)
        if self.size == 1:
            return None
        m = self._mpi_in(buf)
        entry = self._record("allreduce", buf.nbytes, buf.dtype)
        req = self.mpi.Iallreduce(MPI.IN_PLACE, wire(m), op=mpi_op(op, m.dtype))
        if m is buf:
            return self._tracked(req, entry)
        return self._tracked(req, entry, lambda: self._finish(buf, m), keep=m)

    def allgather(self, buf):
        """Concatenate every rank's ``buf`` along axis 0, in rank order (same shape on all)."""
        xp = backend.array_module(buf)
        out = xp.empty((self.size * buf.shape[0],) + buf.shape[1:], dtype=buf.dtype)
        return self._out_of_place("allgather", out.nbytes, self.mpi.Iallgather, buf, out)

    def reduce_scatter(self, buf):
        """Sum ``buf`` over ranks and return this rank's 1/size slice of axis 0."""
        xp = backend.array_module(buf)
        if buf.shape[0] % self.size:
            raise ValueError(f"reduce_scatter: axis 0 ({buf.shape[0]}) not divisible by {self.size}")
        out = xp.empty((buf.shape[0] // self.size,) + buf.shape[1:], dtype=buf.dtype)
        op = mpi_op("sum", buf.dtype)
        return self._out_of_place("reduce_scatter", buf.nbytes, lambda send, recv: (
            self.mpi.Ireduce_scatter_block(send, recv, op=op)), buf, out)

    def alltoall(self, buf):
        """Block j of ``buf`` (axis 0 in ``size`` equal blocks) goes to rank j; block j of the
        result came from rank j (with axis 0 == size: ``buf[j]`` goes to rank j). Ledger: the
        send buffer's bytes."""
        xp = backend.array_module(buf)
        if buf.shape[0] % self.size:
            raise ValueError(f"alltoall: axis 0 ({buf.shape[0]}) not divisible by {self.size}")
        out = xp.empty_like(buf)
        return self._out_of_place("alltoall", buf.nbytes, self.mpi.Ialltoall, buf, out)

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
        sdispl = np.concatenate([[0], np.cumsum(send)[:-1]])
        rdispl = np.concatenate([[0], np.cumsum(recv)[:-1]])
        return self._out_of_place("alltoallv", buf.nbytes, lambda s, r: (
            self.mpi.Ialltoallv([s, (send, sdispl)], [r, (recv, rdispl)])), buf, out)

    def bcast(self, buf, root: int = 0):
        """In-place broadcast of ``buf`` (contiguous) from ``root``; returns ``buf``."""
        self.ledger.record("bcast", self.axis, buf.nbytes)
        if self.size > 1:
            m = self._mpi_in(buf)
            entry = self._record("bcast", buf.nbytes, buf.dtype)
            self._wait(self._tracked(self.mpi.Ibcast(wire(m), root=root), entry))
            self._finish(buf, m)
        return buf

    # --- point-to-point ----------------------------------------------------------------------

    def send(self, buf, dest: int, tag: int = 0) -> MPI.Request:
        """Start sending ``buf`` to ``dest``; finish it with ``wait`` (refmp.distributed.waiting)."""
        self.ledger.record("send", self.axis, buf.nbytes)
        m = self._mpi_in(buf)
        entry = self._record("send", buf.nbytes, buf.dtype, dest, tag)
        return self._tracked(self.mpi.Isend(wire(m), dest=dest, tag=tag), entry,
                             keep=None if m is buf else m)  # keep a host copy alive

    def recv(self, shape, dtype, source: int, tag: int = 0):
        """Receive a new array of ``shape`` and ``dtype`` from ``source``, checking its size.

        A message of another size is a clear error naming both sides, not silent garbage:
        a shorter one is caught from the receive's status, a longer one from MPI's truncation
        error. (Checked after the receive, not by probing first: a probe costs every message
        one more trip through MPI's progress engine.)
        """
        xp = backend.xp
        out = xp.empty(shape, dtype=dtype)
        m = self._mpi_out(out)
        status = MPI.Status()
        entry = self._record("recv", out.nbytes, out.dtype, source, tag)
        req = self.mpi.Irecv(wire(m), source=source, tag=tag)
        self.recorder.waiting = entry
        try:
            sleep_until(lambda: req.Test(status))
            self.recorder.done(entry)
            got = status.Get_count(MPI.BYTE)
        except MPI.Exception as e:
            if e.Get_error_class() != MPI.ERR_TRUNCATE:
                raise
            got = f"more ({e.Get_error_string().splitlines()[0]})"
        if got != out.nbytes:
            raise ValueError(
                f"rank {self.rank} on {self.axis}: expected {out.nbytes} bytes "
                f"({tuple(shape)} {np.dtype(dtype).name}) from rank {source} tag {tag}, got {got}"
            )
        self.ledger.record("recv", self.axis, out.nbytes)
        self._finish(out, m)
        return out

    def recv_start(self, shape, dtype, source: int, tag: int = 0):
        """Start receiving a new array; returns (array, request). Finish with
        refmp.distributed.waiting.wait.

        For overlapping a transfer with compute (ring attention). Unlike :meth:`recv` the
        received size is not checked: a longer message is MPI's truncation error at the wait.
        """
        out = backend.xp.empty(shape, dtype=dtype)
        self.ledger.record("recv", self.axis, out.nbytes)
        m = self._mpi_out(out)
        entry = self._record("recv", out.nbytes, out.dtype, source, tag)
        req = self.mpi.Irecv(wire(m), source=source, tag=tag)
        if m is out:
            return out, self._tracked(req, entry)
        return out, self._tracked(req, entry, lambda: self._finish(out, m), keep=m)
