"""Preemption: a signal stops the run at the next step boundary, on every rank, with a
checkpoint.

A scheduler about to preempt a job (Slurm, Kubernetes) sends SIGTERM first, and MPICH's
mpiexec (Hydra) forwards it to every rank; SIGUSR1 is what Slurm's ``--signal`` sends
ahead of a time limit. Stopping where the signal lands would cut a collective in half, so
the handler only sets a flag (:meth:`Preemption.handle`), and the ranks agree on it at the
step boundary with one small all-reduce (MAX of the signal number) on a communicator of its
own (not ledgered: the run's byte counts stay those of the step). Whatever rank got the
signal, all ranks see it at the same step, write a checkpoint there (refmp.cli.train) and
exit with status :data:`EXIT_PREEMPTED` (Megatron-LM's ``--exit-signal-handler``).

A second signal during the save only sets the flag again; a SIGKILL then (a scheduler's
grace period over) leaves the checkpoint's temporary directory unrenamed
(refmp.checkpoint.format.publish), so no half-written step is ever read by ``--resume``.
"""

from __future__ import annotations

import signal

from refmp.errors import ConfigError

EXIT_PREEMPTED = 4


class Preempted(Exception):
    """Raised on every rank at the same step boundary; refmp.cli.main exits with status 4."""


def parse_signals(names: str) -> list[signal.Signals]:
    """"SIGTERM,SIGUSR1" (or "TERM", or "none") as signals; a bad name is bad input."""
    if names.strip().lower() in ("", "none"):
        return []
    out = []
    for name in names.split(","):
        name = name.strip().upper()
        name = name if name.startswith("SIG") else f"SIG{name}"
        if not hasattr(signal.Signals, name) or name in ("SIGKILL", "SIGSTOP"):
            raise ConfigError(f"--exit-signal: {name} is not a signal a process can catch")
        out.append(signal.Signals[name])
    return out


class Preemption:
    """The flag the handler sets, and the ranks' agreement on it."""

    def __init__(self, names: str):
        self.signals = parse_signals(names)
        self.received = 0  # the number of the last signal caught (0: none)
        self.comm = None  # a Comm of its own for the agreement (install)

    def install(self, grid) -> None:
        """Catch the signals; make the agreement's communicator (collective over the world)."""
        if not self.signals:
            return
        from refmp.distributed.comm import Comm  # noqa: PLC0415  (refmp.cli.main reads this
        from refmp.distributed.ledger import Ledger  # noqa: PLC0415  module without MPI)

        self.comm = Comm(grid.world.mpi.Dup(), "stop", Ledger(), grid.recorder)
        for s in self.signals:
            signal.signal(s, self.handle)

    def handle(self, signum, frame) -> None:
        self.received = signum  # nothing else here: the step boundary acts on it

    def agreed(self) -> str | None:
        """At a step boundary, on every rank: the signal any rank caught (its name), else None."""
        if self.comm is None:
            return None
        signum = int(self.comm.allreduce_scalar(float(self.received), "max"))
        if not signum:
            return None
        for s in self.signals:  # the run ends: a later signal (the launcher cleaning up after
            signal.signal(s, signal.SIG_IGN)  # the first rank's exit) must not kill a rank
        return signal.Signals(signum).name  # while it saves or finalizes
