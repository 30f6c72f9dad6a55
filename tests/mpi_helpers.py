"""Helpers for tests that run under real MPI (launched by mpi-pytest or mpiexec)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile

from mpi4py import MPI
from mpi_batch import collective_timeout


def collective(fn):
    """Make a test body fail on every rank together when it fails on any.

    Each rank runs the body and records its outcome; an allgather shares the outcomes; if any
    rank failed, every rank raises an AssertionError naming the failing ranks. Without this, a
    rank that fails alone leaves the others blocked in their next collective (a hang), and
    hypothesis on the other ranks would go on drawing examples the failing rank never sees.
    Under hypothesis, put it below @given so every example is agreed on.

    The body must not raise on one rank between collectives: the others would wait in the
    next one while the failing rank waits here. Communicate first, then assert, or gather
    mismatches in a list (:class:`Mismatches`) and assert at the end.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        comm = MPI.COMM_WORLD
        err = None
        try:
            fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001  (re-raised below on every rank)
            err = f"rank {comm.rank}: {type(e).__name__}: {e}"
        errors = [e for e in comm.allgather(err) if e is not None]
        if errors:
            raise AssertionError("\n".join(errors))

    return wrapper


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WATCHED = os.path.join(REPO, "tests", "mpi_scripts", "watched.py")


def mpiexec(n: int, args: list[str], timeout: float = 240, cwd: str | None = None,
            env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n n <args>``, with a timeout. args[0] 'python' means this interpreter,
    and with n > 1 the program runs under refmp's watchdog (tests/mpi_scripts/watched.py): a
    hang ends the job in the collective timeout of tests/mpi_batch.py, with the watchdog's
    report on stderr and status 5."""
    if args and args[0] == "python":
        watched = [WATCHED, str(collective_timeout())] if n > 1 else []
        args = [sys.executable, *watched, *args[1:]]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                **(env or {})}
    return subprocess.run(["mpiexec", "-n", str(n), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or REPO, env=full_env)


def refmp(n: int, args: list[str], **kw) -> subprocess.CompletedProcess:
    """``mpiexec -n n python -m refmp <args>``."""
    return mpiexec(n, ["python", "-m", "refmp", *args], **kw)


REFUSALS = os.path.join(REPO, "tests", "mpi_scripts", "refusals.py")


def refused(n: int, cases: dict[str, list[str]], timeout: float = 120,
            **kw) -> dict[str, subprocess.CompletedProcess]:
    """Many ``refmp`` command lines that must be refused, in one launch of ``n`` ranks
    (tests/mpi_scripts/refusals.py): name -> what ``refmp(n, argv)`` would have given, each
    rank's exit status (``statuses``; ``returncode`` is the largest) and output in rank
    order, and ``seconds``, the slowest rank's. A case the launch did not finish on every rank
    (a hang the watchdog ended, a crash) gets the launch's own status and output."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "cases.json")
        with open(path, "w") as f:
            json.dump(cases, f)
        launch = mpiexec(n, ["python", REFUSALS, path, d], timeout=timeout, **kw)
        ranks = []
        for r in range(n):
            rank_file = os.path.join(d, f"rank-{r}.json")
            if not os.path.exists(rank_file):  # the launch ended before this rank wrote
                ranks.append({})
                continue
            with open(rank_file) as f:
                ranks.append(json.load(f))
    results = {}
    for name, argv in cases.items():
        got = [rank.get(name) for rank in ranks]
        if None in got:
            results[name] = subprocess.CompletedProcess(argv, launch.returncode or 1,
                                                        launch.stdout, launch.stderr)
            results[name].statuses = None
            results[name].seconds = float("inf")
            continue
        statuses = [g["status"] for g in got]
        result = subprocess.CompletedProcess(argv, max(statuses),
                                             "".join(g["stdout"] for g in got),
                                             "".join(g["stderr"] for g in got))
        result.statuses = statuses
        result.seconds = max(g["seconds"] for g in got)
        results[name] = result
    return results


def refused_each(n: int, prefix: list[str], bad: list) -> dict[str, subprocess.CompletedProcess]:
    """:func:`refused` of ``prefix`` + each case's arguments (a case: ``(args, ...)``, as a
    test's parametrize list gives it), keyed by ``str(args)``."""
    return refused(n, {str(args): [*prefix, *args] for args, *_ in bad})


class Mismatches:
    """Collects comparison failures so a test can keep communicating and assert at the end."""

    def __init__(self):
        self.errors: list[str] = []

    def check(self, fn, *args, **kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except AssertionError as e:
            self.errors.append(str(e).strip())

    def assert_none(self, comm: MPI.Comm | None = None) -> None:
        """Raise if any check failed. With ``comm`` (collective over it): every rank's
        mismatches are allgathered and every rank raises the same error, naming the ranks,
        so the verdict is agreed and no rank goes on alone into its next collective."""
        errors = self.errors
        if comm is not None:
            errors = [f"rank {r}: {e}" for r, errs in enumerate(comm.allgather(errors))
                      for e in errs]
        assert not errors, "\n".join(errors[:5]) + f"\n({len(errors)} in all)"
