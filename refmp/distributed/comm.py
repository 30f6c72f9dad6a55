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
nonblocking and waits with Test-and-sleep (:func:`wait`). MPI moves a nonblocking operation
on only inside a call such as Test, and a collective takes many such steps (an all-to-all of
1 MiB a peer took 25 ms when each Test was followed by a sleep, 0.3 ms when tested without
pause), so when the ranks fit the cores a wait first tests without pause for 1 ms
(``REFMP_SPIN_US``), then sleeps between tests, backing off from 10 us to a cap: 100 us,
because a message that arrives while its receiver sleeps waits for the wake-up (in a
pipeline, on every hop). When this node's ranks outnumber its cores there is no spinning and
the cap is 1 ms: a sleeping rank leaves the core to a working one. ``REFMP_POLL_US`` sets
the cap.

GPU arrays: before MPI touches device memory the stream is synchronized. With a CUDA-aware
MPI (``comm.cuda_aware``, agreed by all ranks, see refmp.runtime.device) device arrays go to MPI as
they are; otherwise they are staged through host memory, one copy each way, ledgered as
``stage_d2h`` / ``stage_h2d``.

bf16 (mixed precision, refmp.runtime.precision): MPI has no bf16 datatype and mpi4py refuses the
``ml_dtypes`` arrays, so a bf16 buffer goes to MPI as its uint16 view (all-gathers, all-to-alls
and messages only move bytes), and a reduction of bf16 uses a user-defined MPI operation that
adds (or takes the max of) two bf16 buffers in fp32 and rounds: exactly bf16 arithmetic, on
the wire 2 bytes per element. fp16 is MPI's own (MPIX_C_FLOAT16 in MPICH, through mpi4py).
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

import numpy as np
from mpi4py import MPI

from refmp.runtime import backend, cpu
from refmp.runtime.precision import BF16

_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


def _bf16_op(fn) -> MPI.Op:
    """A commutative MPI op on bf16 buffers (seen by MPI as uint16): inout = fn(in, inout)."""

    def apply(inbuf, inoutbuf, datatype):
        a, b = np.frombuffer(inbuf, dtype=BF16), np.frombuffer(inoutbuf, dtype=BF16)
        b[...] = fn(a.astype(np.float32), b.astype(np.float32))  # rounded back to bf16

    return MPI.Op.Create(apply, commute=True)


_BF16_OPS = {"sum": _bf16_op(np.add), "max": _bf16_op(np.maximum), "min": _bf16_op(np.minimum)}


def _wire(buf):
    """What MPI is handed for ``buf``: bf16 as its uint16 view (the same bytes), else itself."""
    return buf.view(np.uint16) if buf.dtype == BF16 else buf


def _op(op: str, dtype) -> MPI.Op:
    return _BF16_OPS[op] if dtype == BF16 else _OPS[op]


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


class StagedRequest(MPI.Request):
    """A request whose result must still be copied from a host staging buffer to the device.

    :func:`wait` calls ``finish`` once the request completes; ``keep`` holds the host buffer
    alive until then (MPI reads or writes it asynchronously).
    """

    def __new__(cls, req: MPI.Request, finish=None, keep=None):
        self = super().__new__(cls, req)
        self.finish, self.keep = finish, keep
        return self


def _env_us(name: str) -> float | None:
    """The environment's ``name`` in microseconds, as seconds (None if unset; refused if bad)."""
    given = os.environ.get(name)
    if given is None:
        return None
    if not given.isdigit():
        from refmp.errors import ConfigError  # noqa: PLC0415

        raise ConfigError(f"{name} must be a whole number of microseconds, got {given!r}")
    return int(given) * 1e-6


def poll_cap() -> float:
    """The longest sleep between tests, in seconds (see the module docstring)."""
    given = _env_us("REFMP_POLL_US")
    if given is not None:
        return given
    return 1e-3 if cpu.local_ranks() > cpu.cores() else 1e-4


def spin_time() -> float:
    """How long a wait keeps testing before its first sleep, in seconds (module docstring)."""
    given = _env_us("REFMP_SPIN_US")
    if given is not None:
        return given
    return 0.0 if cpu.local_ranks() > cpu.cores() else 1e-3


_poll_cap: float | None = None  # poll_cap(), read at the first wait
_spin: float | None = None  # spin_time(), likewise


def sleep_until(done) -> None:
    """Call ``done()`` until it is true: without pause for spin_time(), then sleeping between
    calls (10 us, doubling to poll_cap())."""
    global _poll_cap, _spin
    if _poll_cap is None:
        _poll_cap, _spin = poll_cap(), spin_time()
    end, delay = time.perf_counter() + _spin, 1e-5
    while not done():
        if time.perf_counter() < end:
            continue  # still spinning
        time.sleep(delay)
        delay = min(delay * 2, _poll_cap)


def wait(req: MPI.Request | None):
    """Wait for a request: Test without pause for spin_time(), then Test and sleep, backing
    off to poll_cap() (see the module docstring).

    ``None`` (what a size-1 communicator returns for a skipped operation) is already done.
    """
    if req is None:
        return
    sleep_until(req.Test)  # Test also drives MPI's progress engine
    if isinstance(req, StagedRequest) and req.finish is not None:
        req.finish()
        req.finish = req.keep = None


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
        self.cuda_aware = False  # set for all axes by ProcessGrid.use_gpu, agreed by all ranks

    # --- what MPI sees: the array itself, or a host copy of a device array ------------------

    def _mpi_in(self, buf):
        """A buffer MPI may read: ``buf`` (host, or device with CUDA-aware MPI) or a host copy."""
        if not buf.flags.c_contiguous:
            buf = backend.array_module(buf).ascontiguousarray(buf)
        if not backend.is_device_array(buf):
            return buf
        backend.sync()  # kernels writing buf must finish before MPI reads it
        if self.cuda_aware:
            return buf
        self.ledger.record("stage_d2h", self.axis, buf.nbytes)
        return backend.to_host(buf)

    def _mpi_out(self, out):
        """A buffer MPI may write for ``out``: itself, or a host buffer to copy back later."""
        if not backend.is_device_array(out) or self.cuda_aware:
            return out
        return np.empty(out.shape, dtype=out.dtype)

    def _finish(self, out, host) -> None:
        """Copy a staged result back to the device (nothing when MPI wrote ``out`` itself)."""
        if host is not out:
            if backend.is_device_array(out):
                self.ledger.record("stage_h2d", self.axis, out.nbytes)
            backend.copy_from_host(out, host)

    def _out_of_place(self, start, buf, out):
        """Run ``start(send, recv)`` on what MPI may touch, wait, and copy a staged result back."""
        m_in, m_out = self._mpi_in(buf), self._mpi_out(out)
        wait(start(_wire(m_in), _wire(m_out)))
        self._finish(out, m_out)
        return out

    # --- collectives on arrays --------------------------------------------------------------

    def allreduce(self, buf, op: str = "sum"):
        """In-place all-reduce of ``buf`` (contiguous) over this axis; returns ``buf``."""
        wait(self.allreduce_start(buf, op))
        return buf

    def allreduce_start(self, buf, op: str = "sum") -> MPI.Request | None:
        """Start an in-place all-reduce; finish it with :func:`wait`. For overlap with compute."""
        self.ledger.record("allreduce", self.axis, buf.nbytes)
        if self.size == 1:
            return None
        m = self._mpi_in(buf)
        req = self.mpi.Iallreduce(MPI.IN_PLACE, _wire(m), op=_op(op, m.dtype))
        return req if m is buf else StagedRequest(req, lambda: self._finish(buf, m), keep=m)

    def allgather(self, buf):
        """Concatenate every rank's ``buf`` along axis 0, in rank order (same shape on all)."""
        xp = backend.array_module(buf)
        out = xp.empty((self.size * buf.shape[0],) + buf.shape[1:], dtype=buf.dtype)
        self.ledger.record("allgather", self.axis, out.nbytes)
        if self.size == 1:
            out[...] = buf
            return out
        return self._out_of_place(self.mpi.Iallgather, buf, out)

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
        return self._out_of_place(
            lambda send, recv: self.mpi.Ireduce_scatter_block(send, recv, op=_op("sum", buf.dtype)),
            buf, out)

    def alltoall(self, buf):
        """Block j of ``buf`` (axis 0 in ``size`` equal blocks) goes to rank j; block j of the
        result came from rank j (with axis 0 == size: ``buf[j]`` goes to rank j). Ledger: the
        send buffer's bytes."""
        xp = backend.array_module(buf)
        if buf.shape[0] % self.size:
            raise ValueError(f"alltoall: axis 0 ({buf.shape[0]}) not divisible by {self.size}")
        out = xp.empty_like(buf)
        self.ledger.record("alltoall", self.axis, buf.nbytes)
        if self.size == 1:
            out[...] = buf
            return out
        return self._out_of_place(self.mpi.Ialltoall, buf, out)

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
        return self._out_of_place(
            lambda s, r: self.mpi.Ialltoallv([s, (send, sdispl)], [r, (recv, rdispl)]), buf, out)

    def bcast(self, buf, root: int = 0):
        """In-place broadcast of ``buf`` (contiguous) from ``root``; returns ``buf``."""
        self.ledger.record("bcast", self.axis, buf.nbytes)
        if self.size > 1:
            m = self._mpi_in(buf)
            wait(self.mpi.Ibcast(_wire(m), root=root))
            self._finish(buf, m)
        return buf

    # --- small Python values (metrics, agreement), counted like the rest ---------------------

    def allreduce_scalar(self, value: float, op: str = "sum") -> float:
        """All-reduce one float (a loss or a count); ledgered as op "metric", not "allreduce"."""
        return float(self.allreduce_metrics([value], op)[0])

    def allreduce_metrics(self, values, op: str = "sum") -> np.ndarray:
        """All-reduce a few host floats (losses, counts, statistics), as op "metric"."""
        buf = np.array(values, dtype=np.float64)
        self.ledger.record("metric", self.axis, buf.nbytes)
        if self.size > 1:
            wait(self.mpi.Iallreduce(MPI.IN_PLACE, buf, op=_OPS[op]))
        return buf

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
        """Start sending ``buf`` to ``dest``; wait on the returned request (with :func:`wait`)."""
        self.ledger.record("send", self.axis, buf.nbytes)
        m = self._mpi_in(buf)
        req = self.mpi.Isend(_wire(m), dest=dest, tag=tag)
        return req if m is buf else StagedRequest(req, keep=m)  # keep the host copy alive

    def recv(self, shape, dtype, source: int, tag: int = 0):
        """Receive a new array of ``shape`` and ``dtype`` from ``source``, checking its size.

        A message of another size is a clear error naming both sides, not silent garbage:
        a shorter one is caught from the receive's status, a longer one from MPI's truncation
        error. (Checked after the receive, not by probing first: a probe costs every message
        one more trip through MPI's progress engine, 60-100 us per pipeline hop here.)
        """
        xp = backend.xp
        out = xp.empty(shape, dtype=dtype)
        m = self._mpi_out(out)
        status = MPI.Status()
        req = self.mpi.Irecv(_wire(m), source=source, tag=tag)
        try:
            sleep_until(lambda: req.Test(status))
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
        """Start receiving a new array; returns (array, request). Finish with :func:`wait`.

        For overlapping a transfer with compute (ring attention). Unlike :meth:`recv` the size
        is not probed first: a longer message is MPI's truncation error.
        """
        out = backend.xp.empty(shape, dtype=dtype)
        self.ledger.record("recv", self.axis, out.nbytes)
        m = self._mpi_out(out)
        req = self.mpi.Irecv(_wire(m), source=source, tag=tag)
        return out, (req if m is out else StagedRequest(req, lambda: self._finish(out, m), keep=m))
