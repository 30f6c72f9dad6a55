"""A failure fails on every rank at once, with the mismatch in the message; a hang fails its
test in seconds, naming the stuck ranks, and the rest of its launch still runs.

tests/parity.assert_same_run compares on rank 0 only; if rank 0 raised alone, the other ranks
would go on into the test's next collective (its ledger checks, full_params) and wait there
until pytest-timeout ends them, minutes later. Here a run whose serial reference is
perturbed (another seed: other initial weights), and a ``check`` that fails on one rank only,
must raise the same AssertionError on both ranks within seconds. The check fails at the
last step, so that a helper without the agreement fails these tests quickly too (rank 0
raises after its loop, rank 1 returns) rather than hanging.

The hangs are planted in tests/mpi_scripts/planted_hangs.py, run by a pytest of their own
(tests/mpi_batch.py's launches, with a collective timeout of a few seconds): each group,
one pytest, all at the same time (they mostly wait).
"""

import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from unittest import mock

import numpy as np
import parity
import pytest
from mpi4py import MPI
from mpi_batch import COLLECTIVE_TIMEOUT
from mpi_helpers import REPO, collective

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


PLANTED = "tests/mpi_scripts/planted_hangs.py"
HANG_TIMEOUT_S = 2  # the planted launches' collective timeout
GROUPS = {  # a pytest each: the tests it runs, in order
    "ring": ["test_passes", "test_ring_step_sends_the_wrong_way", "test_passes_after_the_hang"],
    "skip": ["test_one_rank_skips_an_allreduce", "test_passes_after_the_hangs"],
    "raise": ["test_raises_on_one_rank_between_collectives", "test_passes_after_the_hangs"],
    "forever": ["test_communicates_forever", "test_passes_after_the_hangs"],
}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """{group: ({test: its failure text, "" if it passed}, seconds)}."""
    d = tmp_path_factory.mktemp("planted")

    def run(name):
        xml = d / f"{name}.xml"
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        f"--junitxml={xml}", *(f"{PLANTED}::{t}" for t in GROUPS[name])],
                       cwd=REPO, capture_output=True, timeout=240,
                       env={**os.environ, COLLECTIVE_TIMEOUT: str(HANG_TIMEOUT_S)})
        seconds = time.perf_counter() - t0
        cases = ET.parse(xml).getroot().iter("testcase")
        return name, ({c.get("name"): "".join(f.text or "" for f in c.iter("failure"))
                       for c in cases}, seconds)

    with ThreadPoolExecutor(len(GROUPS)) as pool:
        return dict(pool.map(run, GROUPS))


def hung(planted, group: str, test: str) -> str:
    """The failure text of the hung ``test``, after checking what every hang shares: it
    failed, its launch took seconds, and the test after it in the group passed."""
    results, seconds = planted[group]
    assert seconds < HANG_TIMEOUT_S + 45, (seconds, results)
    assert results[GROUPS[group][-1]] == "", results  # launched again, and passed
    text = results[test]
    assert "the watchdog ended the launch during this test" in text, text
    assert "no progress for" in text or "its limit" in text, text
    return text


def test_a_ring_step_sent_the_wrong_way_names_every_waiting_rank(planted):
    text = hung(planted, "ring", "test_ring_step_sends_the_wrong_way")
    assert planted["ring"][0]["test_passes"] == ""  # reported from the first launch
    for r in range(3):
        assert f"rank {(r - 1) % 3} has not sent message #1 (tag 7) on world that rank {r} " \
               f"waits for in recv" in text, text
        assert f"rank {r}'s Python stack" in text
    assert "planted_hangs.py:22 ring_exchange: got = grid.world.recv(" in text, text


def test_a_skipped_allreduce_names_the_rank_that_skipped_it(planted):
    text = hung(planted, "skip", "test_one_rank_skips_an_allreduce")
    assert "rank 1 has not entered allreduce@world #2 that rank 0 waits in" in text, text
    assert "MPI.COMM_WORLD.barrier()" in text  # rank 1's stack: in mpi-pytest's barrier


def test_a_test_raising_on_one_rank_reports_the_error_and_the_waiting_rank(planted):
    text = hung(planted, "raise", "test_raises_on_one_rank_between_collectives")
    assert "rank 1 (call)" in text and "AssertionError: rank 1 objects" in text, text
    assert "rank 1 has not entered allreduce@world #2 that rank 0 waits in" in text, text


def test_a_test_past_its_limit_ends_though_its_ranks_communicate(planted):
    text = hung(planted, "forever", "test_communicates_forever")
    assert "(its limit: 3 s)" in text, text
