"""Run by test_mpi_batch.py through a pytest of its own: parallel tests that hang on purpose.

Each hang is a bug of the kind refmp's collective code can have: a ring step that sends to
the wrong neighbour (every rank waits for a message that goes elsewhere), a rank that skips
an all-reduce, a test body that raises on one rank between two collectives, and a loop that
never ends although its ranks keep communicating (its own time limit, not the watchdog's
collective timeout, ends it). Each is followed, in the same group, by a test that passes.

Not collected by the main suite (the name does not start with test_).
"""

import numpy as np
import pytest

from refmp.distributed.grid import ProcessGrid


def ring_exchange(grid: ProcessGrid, to: int, frm: int) -> np.ndarray:
    """One step of a ring: send my block to rank ``to``, receive one from rank ``frm``."""
    mine = np.full(4, float(grid.rank))
    send = grid.world.send(mine, to, tag=7)
    got = grid.world.recv(mine.shape, mine.dtype, frm, tag=7)
    send.Wait()
    return got


@pytest.mark.parallel(nprocs=3)
def test_passes():
    grid = ProcessGrid()
    r, n = grid.rank, grid.world.size
    assert ring_exchange(grid, (r + 1) % n, (r - 1) % n)[0] == (r - 1) % n
    assert grid.world.allreduce(np.ones(2))[0] == n


@pytest.mark.parallel(nprocs=3)
def test_ring_step_sends_the_wrong_way():
    grid = ProcessGrid()
    r, n = grid.rank, grid.world.size
    ring_exchange(grid, (r - 1) % n, (r - 1) % n)  # should send to (r + 1) % n


@pytest.mark.parallel(nprocs=3)
def test_passes_after_the_hang():
    test_passes()


@pytest.mark.parallel(nprocs=2)
def test_one_rank_skips_an_allreduce():
    grid = ProcessGrid()
    grid.world.allreduce(np.ones(2))
    if grid.rank == 0:
        grid.world.allreduce(np.ones(2))


@pytest.mark.parallel(nprocs=2)
def test_raises_on_one_rank_between_collectives():
    grid = ProcessGrid()
    grid.world.allreduce(np.ones(2))
    assert grid.rank != 1, "rank 1 objects"
    grid.world.allreduce(np.ones(2))


@pytest.mark.parallel(nprocs=2)
@pytest.mark.timeout(3)
def test_communicates_forever():
    grid = ProcessGrid()
    while True:
        grid.world.allreduce(np.ones(2))


@pytest.mark.parallel(nprocs=2)
def test_passes_after_the_hangs():
    grid = ProcessGrid()
    assert grid.world.allreduce(np.ones(2))[0] == 2
