"""Run by test_hypothesis_mpi.py under `mpiexec -n 2 pytest`: a property that fails on rank 1 only.

Not collected by the main suite (the name does not start with test_).
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_helpers import collective


@pytest.mark.parallel(nprocs=2)
@given(x=st.integers(0, 100))
@collective
def test_fails_on_rank_one_for_large_x(x):
    # the examples drawn must be identical on both ranks (derandomized profile)
    xs = MPI.COMM_WORLD.allgather(x)
    assert xs[0] == xs[1], f"ranks drew different examples: {xs}"
    MPI.COMM_WORLD.barrier()  # communicate first, assert after (see mpi_helpers.collective)
    if MPI.COMM_WORLD.rank == 1:
        assert x < 10, f"x = {x} is too large"
