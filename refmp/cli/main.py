"""The ``refmp`` command: ``refmp train``, ``bench``, ``schedule``, ``plan``, ``convert``,
``generate``, ``trace`` and ``cluster`` (also ``python -m refmp``), each in its own module of
refmp.cli;
this one holds the parser's root, the exit codes and the rank-0 printing.

Run it under MPI for more than one rank: ``mpiexec -n 2 refmp train --dp 2``.
How a run ends when something goes wrong (refmp.distributed.faults, docs/faults.md): bad
input prints one message (from rank 0) and every rank exits with status 2; a non-finite loss or gradient
norm, one message and status 3; any other exception on any rank prints that rank's traceback
(``[rank r]`` before each line) and aborts the whole job (MPI_Abort); a rank without
progress for --collective-timeout seconds, the watchdog's report and status 5; a SIGTERM
(--exit-signal), a stop at the next step boundary (a checkpoint with --checkpoint-dir), one
message and status 4.
"""

from __future__ import annotations

import argparse
import os
import sys

from refmp.distributed.preemption import EXIT_PREEMPTED, Preempted
from refmp.errors import ConfigError, TrainingError

EXIT_BAD_INPUT = 2
EXIT_TRAINING = 3  # a run stopped on every rank (refmp.errors.TrainingError)


def launcher_rank() -> int:
    """This process's rank as the launcher tells it, without initializing MPI (for --help)."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


class Parser(argparse.ArgumentParser):
    """argparse, printing usage errors from rank 0 only (every rank still exits 2)."""

    def error(self, message):
        if launcher_rank() == 0:
            self.print_usage(sys.stderr)
            sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(EXIT_BAD_INPUT)


def make_parser() -> argparse.ArgumentParser:
    from refmp.cli import bench, cluster, convert, generate, plan, schedule, trace, train

    p = Parser(prog="refmp", description="refmp: GPT-2 in NumPy, split across MPI ranks.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in (train, bench, schedule, plan, convert, generate, trace, cluster):
        command.add_parser(sub)
    return p


def limit_threads() -> None:
    """One BLAS/OpenMP thread pool per rank must not oversubscribe the cores.

    Before NumPy loads: if the launcher says several ranks share this node and the user set
    no thread count, give each rank cores // local ranks threads (at least 1). Idle BLAS
    threads spin, so 2 ranks x 2 threads on 2 cores runs many times slower than 2 x 1.
    """
    from refmp.runtime.cpu import cores, local_ranks  # no NumPy there

    if local_ranks() <= 1:
        return
    threads = str(max(1, cores() // local_ranks()))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, threads)


def main(argv: list[str] | None = None) -> int:
    limit_threads()
    args = make_parser().parse_args(argv)
    from refmp.distributed.faults import abort_job, write_pid

    write_pid(launcher_rank())  # a testing hook (REFMP_TEST_PID_DIR), off by default
    try:
        if args.command == "train":  # --layout auto reads which flags were given
            args.run(args, (sys.argv[1:] if argv is None else argv)[1:])
        elif args.command == "cluster":  # the program's exit status
            return args.run(args)
        else:
            args.run(args)
    except (ConfigError, TrainingError) as e:  # raised on every rank: said once, rank 0
        if launcher_rank() == 0:
            sys.stderr.write(f"refmp {args.command}: error: {e}\n")
        return EXIT_BAD_INPUT if isinstance(e, ConfigError) else EXIT_TRAINING
    except Preempted as e:  # every rank, at the same step boundary
        if launcher_rank() == 0:
            sys.stderr.write(f"refmp {args.command}: {e}\n")
        return EXIT_PREEMPTED
    except (Exception, KeyboardInterrupt):  # noqa: BLE001  one rank: it must not wait alone
        abort_job()  # this rank's traceback, then MPI_Abort ends every rank
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
