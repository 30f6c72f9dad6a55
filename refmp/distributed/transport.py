"""How a call reaches MPI: its flight-recorder entry, its device staging, its polite wait.

:class:`refmp.distributed.comm.Comm` builds each collective and point-to-point call from these
steps, so its own methods say only which MPI call moves which bytes. A learner can skip this
file: on host arrays its staging hands MPI the array itself.

The recorder (:class:`refmp.distributed.recorder.Recorder`) keeps the last calls with sequence
numbers, for the watchdog: an entry is started when a call is handed to MPI and completed when
its request is waited on. Every operation starts nonblocking and is waited on with
Test-and-sleep (refmp.distributed.waiting).

GPU arrays: before MPI touches device memory the stream is synchronized. With a CUDA-aware
MPI (``comm.cuda_aware``, agreed by all ranks, see refmp.runtime.device) device arrays go to
MPI as they are; otherwise they are staged through host memory, one copy each way, ledgered
as ``stage_d2h`` / ``stage_h2d``. bf16 goes to MPI as its uint16 view, reduced by refmp's own
operation (refmp.distributed.reductions).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from refmp.distributed import callcheck
from refmp.distributed.reductions import wire
from refmp.distributed.waiting import StagedRequest, wait
from refmp.runtime import backend


class Transport:
    """The steps around every MPI call of a :class:`~refmp.distributed.comm.Comm`; uses its
    ``mpi``, ``axis``, ``size``, ``ledger``, ``recorder``, ``world_ranks``, ``group_id`` and
    ``cuda_aware``."""

    # --- the recorder: an entry per call handed to MPI, completed when its request is -------

    def _record(self, op: str, nbytes: int, dtype, peer: int = -1, tag: int = -1) -> list:
        """Start a recorder entry (``peer``: a rank of this group, -1 for a collective);
        with REFMP_CHECK_CALLS=1 a collective first checks the others make the same call."""
        if peer < 0 and callcheck.ENABLED:
            callcheck.check_call(self, op, nbytes, dtype)
        world_peer = self.world_ranks[peer] if peer >= 0 else -1
        return self.recorder.start(self.group_id, op, nbytes, dtype, world_peer, tag)

    def _tracked(self, req: MPI.Request, entry: list, copy_back=None, keep=None) -> StagedRequest:
        """``req`` whose wait completes ``entry`` (after copying a staged result back)."""
        recorder = self.recorder

        def finish():
            if copy_back is not None:
                copy_back()
            recorder.done(entry)

        tracked = StagedRequest(req, finish, keep)
        tracked.entry = entry
        return tracked

    def _wait(self, req: StagedRequest) -> None:
        """Wait here for a tracked ``req``: the recorder knows which call a rank waits in."""
        self.recorder.waiting = req.entry
        wait(req)

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

    def _out_of_place(self, op: str, nbytes: int, start, buf, out):
        """Ledger ``op``, run ``start(send, recv)`` on what MPI may touch, wait, and copy a
        staged result back. Alone on this axis: ``out`` becomes a copy of ``buf``."""
        self.ledger.record(op, self.axis, nbytes)
        if self.size == 1:
            out[...] = buf
            return out
        m_in, m_out = self._mpi_in(buf), self._mpi_out(out)
        entry = self._record(op, nbytes, buf.dtype)
        self._wait(self._tracked(start(wire(m_in), wire(m_out)), entry))
        self._finish(out, m_out)
        return out
