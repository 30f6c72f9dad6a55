"""No rank fails alone: checks before the first step, and how a failing job ends.

Shapes: B global batch, b = B/(dp M) rows of one micro-batch on a rank, M micro-batches,
T sequence, Tl = T/cp tokens per rank, s = Tl/tp with sequence parallelism (else Tl),
C channels, NH heads, V vocabulary (Vl = Vp/tp columns per rank), E experts, K top_k,
L blocks; w bytes per element; pp, dp, cp, tp, ep group sizes.

Three ways a run can go wrong, and what each does (docs/faults.md):

* **bad input** (refmp.errors.ConfigError): found before any work, on every rank (through
  :func:`agreed` where only one rank can see it), said once, exit status 2. This module holds
  ``agreed`` and the output-path checks (which flags they apply to, and every other check
  before the first step: refmp.training.checks);
* **a diverging run** (refmp.errors.TrainingError): a non-finite loss or gradient norm is a
  global value, the same on every rank, so every rank stops at the same step, before the
  update; said once, exit status 3;
* **anything else** (a bug, a failed node, an injected fault): the rank that raised prints its
  traceback, each line prefixed ``[rank r]``, and calls MPI_Abort, which ends every rank of
  the job (what ``python -m mpi4py`` does). A rank killed by a signal ends the job too:
  MPICH's mpiexec tears down the others when one process dies.

Two more end a run on purpose: a hang, found by the watchdog (refmp.distributed.watchdog,
status 5), and a preemption signal, agreed at a step boundary (refmp.distributed.preemption,
status 4). :func:`inject_fault` provokes the failures the tests need.

The memory check (refmp.cost.memory) compares an *estimate* of the bytes a rank will hold
with what the node has free. It is there to refuse, in a second, what cannot fit by far (a
``--block-size 100000`` asks for terabytes); it does not promise that what passes fits.
"""

from __future__ import annotations

import math
import os
import sys
import time
import traceback

from refmp.errors import ConfigError, TrainingError

ABORT_GRACE_S = 1.0  # between a failing rank's traceback and MPI_Abort (abort_job)

# --- one rank's error is every rank's -----------------------------------------------------


def agreed(comm, fn):
    """Run ``fn()`` on every rank of ``comm``; if it raised a ConfigError on any rank, raise it
    on all.

    Without this, a rank that failed alone (say, an unreadable file on its node) would leave
    the others waiting in their next collective forever.
    """
    err = None
    try:
        out = fn()
    except ConfigError as e:
        err, out = str(e), None
    errors = [e for e in comm.allgather_obj(err) if e is not None]
    if errors:
        raise ConfigError(errors[0])
    return out


# --- output paths -------------------------------------------------------------------------


def _try_create(folder: str) -> str | None:
    """Create and remove a file in ``folder``; the OS's reason if that fails (None if fine).

    Trying is the only honest test: os.access says yes to root on a read-only file system."""
    probe = os.path.join(folder, f".refmp-write-test-{os.getpid()}")
    try:
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        return e.strerror or str(e)
    return None


def check_writable_file(path: str, flag: str) -> None:
    """Refuse ``flag path`` unless a file can be written there: not a directory, its
    directory exists, and a file can be created in it (an existing file: opened to append)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: is a directory; give a file name")
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag} {path}: the directory {folder} does not exist")
    if os.path.exists(path):
        try:
            with open(path, "a"):
                pass
        except OSError as e:
            raise ConfigError(f"{flag} {path}: cannot write it ({e.strerror})") from None
    elif (why := _try_create(folder)) is not None:
        raise ConfigError(f"{flag} {path}: cannot write in {folder} ({why})")


def check_writable_dir(path: str, flag: str) -> None:
    """Refuse ``flag path`` unless files can be written in it: an existing directory we can
    write in, or a path whose nearest existing ancestor is one (os.makedirs makes the rest)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: exists and is not a directory")
    folder = os.path.abspath(path)
    while not os.path.isdir(folder):
        parent = os.path.dirname(folder)
        if os.path.exists(folder) or parent == folder:
            raise ConfigError(f"{flag} {path}: {folder} is not a directory")
        folder = parent
    if (why := _try_create(folder)) is not None:
        raise ConfigError(f"{flag} {path}: cannot write in {folder} ({why})")


# --- during the run ---------------------------------------------------------------------------


def check_finite(step: int, loss: float, grad_norm: float) -> None:
    """Stop (every rank: both numbers are global) when the loss or gradient norm is not finite."""
    for what, x in (("loss", loss), ("gradient norm", grad_norm)):
        if not math.isfinite(x):
            raise TrainingError(f"step {step}: {what} is {x}; stopped before the update "
                                f"(lower --lr, or clip with --grad-clip)")


STUCK_TAG = 32766  # the stuck receive's: the executor's tags stay below, the tied wte's is 32767


def inject_fault(rank: int, step: int, comm=None) -> None:
    """Testing hook: REFMP_FAULT_RANK=r REFMP_FAULT_STEP=s make rank r fail before step s, as
    REFMP_FAULT_MODE says: ``raise`` (default) a RuntimeError; ``hang``: sleep forever,
    outside MPI; ``recv``: receive, on ``comm``, a message its next rank never sends;
    ``mpi``: an MPI call that MPI refuses (a receive from rank ``comm.size``: MPI.Exception);
    ``memory``: touch as many bytes as the rank's memory limit (refmp cluster --rank-memory),
    for the kernel to kill it (refused without a limit: it would fill the machine)."""
    want = os.environ.get("REFMP_FAULT_RANK"), os.environ.get("REFMP_FAULT_STEP")
    if want[0] is None or int(want[0]) != rank or int(want[1] or 0) != step:
        return
    mode = os.environ.get("REFMP_FAULT_MODE", "raise")
    if mode == "hang":
        while True:
            time.sleep(3600)
    if mode == "recv":
        import numpy as np  # noqa: PLC0415

        comm.recv((1,), np.float32, (comm.rank + 1) % comm.size, STUCK_TAG)
    if mode == "memory":
        from refmp.runtime.cgroup import rank_limit  # noqa: PLC0415

        limit = rank_limit()
        if limit is None:
            raise RuntimeError("REFMP_FAULT_MODE=memory needs a rank with a memory limit")
        import numpy as np  # noqa: PLC0415

        held = [np.ones(1 << 23) for _ in range(limit[0] // (8 << 23) + 1)]  # 64 MiB each
        raise RuntimeError(f"rank {rank} touched {len(held) * 64} MiB and was not killed")
    if mode == "mpi":
        comm.mpi.Irecv(bytearray(8), source=comm.size)  # no such rank: MPI raises
    raise RuntimeError(f"injected fault on rank {rank} at step {step} (REFMP_FAULT_RANK)")


def write_pid(rank: int) -> None:
    """Testing hook: with REFMP_TEST_PID_DIR set, write this process's id to DIR/rank{r}.pid."""
    folder = os.environ.get("REFMP_TEST_PID_DIR")
    if folder:
        path = os.path.join(folder, f"rank{rank}.pid")
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)  # a reader never sees a half-written id


def abort_job() -> None:
    """From an ``except`` block: print this rank's traceback, each line prefixed with the rank
    (for Ctrl-C, one line), and end the whole job with MPI_Abort (as ``python -m mpi4py``
    does). Without MPI running, or alone, re-raise instead (Python's own traceback, status 1)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized() or mpi.COMM_WORLD.size == 1:
        raise  # the exception being handled
    rank = mpi.COMM_WORLD.Get_rank()
    interrupted = isinstance(sys.exc_info()[1], KeyboardInterrupt)  # Ctrl-C reaches every rank
    text = "interrupted (KeyboardInterrupt)" if interrupted else traceback.format_exc()
    sys.stdout.flush()
    sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
    sys.stderr.write(f"[rank {rank}] refmp: aborting the job (MPI_Abort)\n")
    sys.stderr.flush()
    time.sleep(ABORT_GRACE_S)  # for the launcher to forward it: the abort kills the pipes too
    mpi.COMM_WORLD.Abort(1)  # MPICH may return from it while the launcher kills the job:
    os._exit(1)  # then leave at once, without MPI_Finalize waiting on ranks that wait on us
