"""A parity failure fails on every rank at once, with the mismatch in the message.

tests/parity.assert_same_run compares on rank 0 only; if rank 0 raised alone, the other ranks
would go on into the test's next collective (its ledger checks, full_params) and wait there
until pytest-timeout ends them, minutes later. Here a run whose serial reference is
perturbed (another seed: other initial weights), and a ``check`` that fails on one rank only,
must raise the same AssertionError on both ranks within seconds. The check fails at the
last step, so that a helper without the agreement fails these tests quickly too (rank 0
raises after its loop, rank 1 returns) rather than hanging.
"""

import re
import time
from dataclasses import replace
from unittest import mock

import numpy as np
import parity
import pytest
from mpi4py import MPI
from mpi_helpers import collective

from refmp.training.datasets import Dataset
from refmp.training.trainer import TrainConfig

pytestmark = pytest.mark.mpi

FAST_S = 30  # a failing 3-step run of this size takes well under a second per step


def tiny(**kw) -> TrainConfig:
    return TrainConfig(**{**dict(n_layer=1, n_head=2, n_embd=8, block_size=4, batch_size=2,
                                 steps=3, lr=0.01, dtype="float64", seed=1, dp=2,
                                 progress=False), **kw})


DATA = Dataset(np.random.default_rng(0).integers(0, 11, 100), 11, "random")


def raises_everywhere(pattern: str, **kw) -> str:
    """assert_same_run(tiny(), DATA, **kw) raises an AssertionError whose message matches
    ``pattern`` on every rank, quickly. Returns the message. Each rank records its outcome
    and then allgathers it: a rank that did not raise fails the test here, with the others,
    instead of leaving them in a collective."""
    t0 = time.perf_counter()
    try:
        parity.assert_same_run(tiny(), DATA, **kw)
        msg = None
    except AssertionError as e:
        msg = str(e)
    seconds = time.perf_counter() - t0
    msgs = MPI.COMM_WORLD.allgather(msg)
    silent = [r for r, m in enumerate(msgs) if m is None]
    assert not silent, f"ranks {silent} did not raise"
    assert all(re.search(pattern, m, re.DOTALL) for m in msgs), msgs[0]
    assert seconds < FAST_S, seconds
    return msg


@pytest.mark.parallel(nprocs=2)
@collective
def test_a_perturbed_reference_fails_every_rank_at_its_first_step():
    serial_config = parity.serial_config
    other_seed = mock.patch.object(parity, "serial_config",
                                   lambda cfg: replace(serial_config(cfg), seed=cfg.seed + 1))
    with other_seed:
        msg = raises_everywhere("rank 0: .*loss at step 0")
    assert "step 1" not in msg  # it stopped at the first bad step


@pytest.mark.parallel(nprocs=2)
@collective
def test_a_check_failing_on_one_rank_fails_every_rank():
    def check(par, step):
        par.runner.full_params()  # a collective inside the check
        assert not (step == 2 and MPI.COMM_WORLD.rank == 1), "rank 1 objects at step 2"

    raises_everywhere("rank 1: rank 1 objects at step 2", check=check)
