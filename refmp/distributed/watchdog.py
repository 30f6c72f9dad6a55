"""No hang ever: a watchdog thread per rank that names the stuck rank and ends the job.

A collective program hangs when one rank does not reach a call the others wait in (stuck in
computation, blocked outside MPI, waiting for a message nobody sends, or in a different
call): nothing fails, the others wait forever. Each rank therefore runs a thread that looks
at its flight recorder (refmp.distributed.recorder) every ``period`` seconds; when the rank
has made no progress (no call started or completed) for ``--collective-timeout`` seconds,
whether it waits in a call or computes, the watchdog fires (and, given a ``limit``, when the
watch has lasted that long whatever the progress: a test's time limit, tests/mpi_batch.py):

1. it creates the alarm file in the job's side-channel directory (``O_EXCL``: the first
   rank to do so leads the report), and writes its rank and why it fired there;
2. every rank's thread sees the alarm within a period, writes its state (its recorder, the
   wall time, its main thread's Python stack) as ``rank{r}.json`` there, and prints its
   Python traceback (faulthandler), each line prefixed ``[rank r]``;
3. the leader waits for the other states (a grace period), prints the table and the
   findings of refmp.distributed.diagnose (which rank has not entered which call) and ends
   the job with MPI_Abort, exit status :data:`EXIT_HANG`.

The side channel is a directory, not MPI: the stuck collective cannot carry the report, and
a second communicator driven by these threads would need MPI_THREAD_MULTIPLE progress while
the main thread polls (MPICH serializes both under one lock, and an oversubscribed rank may
not be scheduled for long). Files need only a file system the ranks share: ``--trace-dir``
(which then keeps the states: read them again with ``refmp trace``), else a temporary
directory on rank 0's node, agreed at start (ranks on other nodes cannot answer there; give
``--trace-dir`` on a shared file system for a multi-node job). A rank stuck in computation
still answers: the thread runs whenever the main thread releases the interpreter (in
``time.sleep``, in NumPy's kernels, in MPI's Test loop); a rank that holds it for good, or is
gone, is named as not answering.
"""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback

from refmp.distributed.diagnose import report
from refmp.distributed.recorder import Recorder
from refmp.errors import ConfigError

EXIT_HANG = 5  # the status of a job the watchdog ended (MPI_Abort's error code)
ALARM = "alarm"


def state_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}.json")


def write_json(path: str, obj) -> None:
    """``path`` whole or not at all: a reader never sees half a state."""
    with open(f"{path}.tmp", "w") as f:
        json.dump(obj, f)
    os.replace(f"{path}.tmp", path)


class Watchdog:
    """One rank's watchdog thread (module docstring); :meth:`start` is collective."""

    def __init__(self, mpi_world, recorder: Recorder, timeout: float, trace_dir: str | None,
                 limit: float = 0.0):
        if not recorder.on:  # the same environment on every rank: refused on all
            raise ConfigError("REFMP_RECORDER_CALLS=0 turns off the flight recorder that the "
                              "watchdog reads: give --collective-timeout 0 too")
        self.mpi = mpi_world
        self.recorder = recorder
        self.timeout = float(timeout)
        self.limit = float(limit)  # seconds from start() to fire at, progress or not (0: none)
        self.rank = mpi_world.Get_rank()
        self.size = mpi_world.Get_size()
        self.period = min(1.0, self.timeout / 4)
        self.grace = max(2.0, 3 * self.period)  # for every thread to see the alarm and answer
        self.trace_dir = trace_dir
        self.folder: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Watchdog:
        """Agree on the side-channel directory (rank 0 makes it, or clears --trace-dir of an
        earlier run's states) and start the thread."""
        folder = None
        if self.rank == 0:
            if self.trace_dir is None:
                folder = tempfile.mkdtemp(prefix="refmp-watchdog-")
            else:
                folder = self.trace_dir
                os.makedirs(folder, exist_ok=True)
                for path in (os.path.join(folder, ALARM),
                             *(state_file(folder, r) for r in range(self.size))):
                    if os.path.exists(path):
                        os.remove(path)
        self.folder = self.mpi.bcast(folder, root=0)
        hosts = set(self.mpi.allgather(socket.gethostname()))
        if self.rank == 0 and len(hosts) > 1 and self.trace_dir is None:
            print(f"refmp: warning: the watchdog's side channel {self.folder} is on one node of "
                  f"{len(hosts)}; give --trace-dir on a shared file system to hear every rank",
                  file=sys.stderr, flush=True)
        self.recorder.progress = time.time()
        self._thread = threading.Thread(target=self._watch, name="refmp-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread (the run is over); rank 0 removes a temporary directory."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.period)
        if self.rank == 0 and self.trace_dir is None and self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    # --- the thread -----------------------------------------------------------------------

    def _watch(self) -> None:
        alarm = os.path.join(self.folder, ALARM)
        started = time.time()
        while not self._stop.wait(self.period):
            if os.path.exists(alarm):
                self._answer()
                return
            now = time.time()
            idle = now - self.recorder.progress
            if idle > self.timeout:
                self._fire(alarm, f"no progress for {idle:.1f} s (--collective-timeout "
                                  f"{self.timeout:g})")
                return
            if self.limit and now - started > self.limit:
                self._fire(alarm, f"still running after {now - started:.1f} s (its limit: "
                                  f"{self.limit:g} s)")
                return

    def _fire(self, alarm: str, why: str) -> None:
        try:  # the alarm says who fired and why (a reader that captures stderr finds it here)
            fd = os.open(alarm, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, f"rank {self.rank}: {why}\n".encode())
            os.close(fd)
        except FileExistsError:  # another rank fired first: it leads
            self._answer()
            return
        except OSError:
            pass  # no side channel left (the run is ending): report this rank alone
        sys.stderr.write(f"[rank {self.rank}] refmp: watchdog: {why}; asking every rank where "
                         f"it is\n")
        sys.stderr.flush()
        self._write_state()
        deadline = time.time() + self.grace
        while time.time() < deadline and not all(
                os.path.exists(state_file(self.folder, r)) for r in range(self.size)):
            time.sleep(0.05)
        states = {}
        for r in range(self.size):
            try:
                with open(state_file(self.folder, r)) as f:
                    states[r] = json.load(f)
            except (OSError, ValueError):
                pass  # did not answer: the report says so
        text = report(states, self.size)
        if self.trace_dir is not None:
            text += f"\nthe ranks' flight recorders: {self.trace_dir} (refmp trace {self.trace_dir})"
        else:
            shutil.rmtree(self.folder, ignore_errors=True)
        sys.stderr.write("".join(f"[rank {self.rank}] {line}\n" for line in text.splitlines()))
        sys.stderr.write(f"[rank {self.rank}] refmp: the watchdog ends the job "
                         f"(MPI_Abort, status {EXIT_HANG})\n")
        sys.stderr.flush()
        time.sleep(0.5)  # for the launcher to forward the report before the abort
        self.mpi.Abort(EXIT_HANG)
        os._exit(EXIT_HANG)

    def _answer(self) -> None:
        """Another rank fired: write this rank's state, print its traceback, wait for the
        leader's abort (and abort alone if it never comes)."""
        self._write_state()
        time.sleep(4 * self.grace)
        self.mpi.Abort(EXIT_HANG)
        os._exit(EXIT_HANG)

    def _write_state(self) -> None:
        main = sys._current_frames().get(threading.main_thread().ident)
        stack = [] if main is None else [[f.filename, f.lineno, f.name]
                                         for f in traceback.extract_stack(main)]
        state = {**self.recorder.dump(), "rank": self.rank, "world_size": self.size,
                 "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
                 "timeout": self.timeout, "stack": stack}
        try:
            write_json(state_file(self.folder, self.rank), state)
        except OSError as e:
            sys.stderr.write(f"[rank {self.rank}] refmp: watchdog: cannot write its state ({e})\n")
        with tempfile.TemporaryFile("w+") as f:  # faulthandler writes to a file descriptor
            faulthandler.dump_traceback(f, all_threads=True)  # the main thread and this one
            f.seek(0)
            text = f.read()
        sys.stderr.write("".join(f"[rank {self.rank}] {line}\n" for line in text.splitlines()))
        sys.stderr.flush()
