"""Hypothesis under MPI: every rank draws the same examples, and a failure on one rank fails
all ranks together (shrinking in step), instead of leaving the others in a collective."""

import os

import pytest
from mpi_helpers import mpiexec

pytestmark = pytest.mark.mpi

HERE = os.path.dirname(os.path.abspath(__file__))


def test_failure_on_one_rank_fails_every_rank_without_hanging():
    script = os.path.join(HERE, "mpi_scripts", "failing_on_one_rank.py")
    r = mpiexec(2, ["python", "-m", "pytest", script, "-p", "no:cacheprovider", "-q",
                    "--rootdir", HERE, "-c", os.path.join(os.path.dirname(HERE), "pyproject.toml")],
                timeout=120, env={"PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE)])})
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    # both ranks report the failure, and hypothesis shrank it to the boundary on both
    assert out.count("1 failed") == 2, out
    assert "rank 1: AssertionError: x = 10 is too large" in out, out
    assert "ranks drew different examples" not in out, out
