"""The MPI layer under real MPI: collectives, point-to-point checks, the ledger, the grid."""

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import collective

from refmp.config import check_sizes
from refmp.distributed.comm import Comm
from refmp.distributed.grid import ProcessGrid
from refmp.errors import ConfigError

pytestmark = pytest.mark.mpi


@pytest.mark.parallel(nprocs=[2, 4])
@collective
def test_collectives_and_ledger():
    c = Comm(MPI.COMM_WORLD, "world")
    r, n = c.rank, c.size
    buf = np.full(3, float(r + 1))
    c.allreduce(buf)
    np.testing.assert_array_equal(buf, n * (n + 1) / 2)
    g = c.allgather(np.array([[r, 10 * r]], dtype=np.int64))
    np.testing.assert_array_equal(g, [[i, 10 * i] for i in range(n)])
    rs = c.reduce_scatter(np.arange(2 * n, dtype=np.float64))  # each rank contributes 0..2n-1
    np.testing.assert_array_equal(rs, n * np.arange(2 * r, 2 * r + 2))
    b = np.array([7.0 if r == 0 else 0.0])
    c.bcast(b)
    assert b[0] == 7.0
    assert c.allreduce_scalar(1.0) == n
    led = c.ledger
    assert led.bytes("allreduce", "world") == 24 and led.count("allreduce") == 1
    assert led.bytes("allgather") == 16 * n
    assert led.bytes("reduce_scatter") == 16 * n
    assert led.bytes("bcast") == 8 and led.bytes("metric") == 8


@pytest.mark.parallel(nprocs=2)
@collective
def test_send_recv_checks_size():
    c = Comm(MPI.COMM_WORLD, "pp")
    if c.rank == 0:
        from refmp.distributed.waiting import wait

        wait(c.send(np.arange(6, dtype=np.float32).reshape(2, 3), dest=1, tag=1))
        wait(c.send(np.zeros(5, dtype=np.float32), dest=1, tag=2))
        wait(c.send(np.zeros(7, dtype=np.float32), dest=1, tag=3))
    else:
        got = c.recv((2, 3), np.float32, source=0, tag=1)
        np.testing.assert_array_equal(got, np.arange(6).reshape(2, 3))
        with pytest.raises(ValueError, match=r"expected 24 bytes .*got 20$"):  # shorter
            c.recv((2, 3), np.float32, source=0, tag=2)
        with pytest.raises(ValueError, match=r"expected 24 bytes .*tag 3, got more"):  # longer
            c.recv((2, 3), np.float32, source=0, tag=3)
        assert c.ledger.bytes("recv", "pp") == 24  # refused messages are not counted


@pytest.mark.parallel(nprocs=4)
@collective
def test_grid_coordinates_and_axes():
    rank = MPI.COMM_WORLD.rank
    g = ProcessGrid(dp=2, tp=2)
    assert g.coords == {"pp": 0, "dp": rank // 2, "cp": 0, "tp": rank % 2}  # tp fastest
    assert g.rank_of(**g.coords) == rank
    # tp peers are neighbours; dp peers are 2 apart
    tp_peers = g.comm["tp"].allgather(np.array([rank]))
    dp_peers = g.comm["dp"].allgather(np.array([rank]))
    assert list(tp_peers) == [rank - rank % 2, rank - rank % 2 + 1]
    assert list(dp_peers) == [rank % 2, rank % 2 + 2]
    g2 = ProcessGrid(dp=4, ep=2)
    ep = list(g2.comm["ep"].allgather(np.array([rank])))
    edp = list(g2.comm["edp"].allgather(np.array([rank])))
    assert ep == ([0, 1] if rank < 2 else [2, 3])
    assert edp == ([0, 2] if rank % 2 == 0 else [1, 3])


@pytest.mark.parallel(nprocs=4)
@collective
def test_measure_links_with_sync_is_the_slowest_rank_of_every_pair_measuring_at_once():
    """measure_links(pair, sync=world), as refmp.cost.nodes' calibration times the groups
    that share a link: every pair starts each repetition from the world's barrier, and every
    rank gets the slowest rank's figures (one answer over the world, not one a pair)."""
    from refmp.cli.calibrate import measure_links

    world = MPI.COMM_WORLD
    pair = world.Split(world.rank // 2, world.rank)  # ranks 0-1 and 2-3
    try:
        alone = measure_links(pair, nbytes=1 << 16, reps=3)
        together = measure_links(pair, nbytes=1 << 16, reps=3, sync=world)
    finally:
        pair.Free()
    got = world.allgather(together)
    assert all(g == got[0] for g in got), got
    assert got[0][0] > 0 and got[0][1] > 0
    mine = world.allgather(alone)  # without sync: a pair's own answer, the same in the pair
    assert mine[0] == mine[1] and mine[2] == mine[3], mine


def test_check_sizes_errors():
    assert check_sizes(8, pp=2, tp=2) == {"pp": 2, "dp": 2, "cp": 1, "tp": 2, "ep": 1}
    with pytest.raises(ConfigError, match=r"does not match the 4 MPI processes"):
        check_sizes(4, dp=3)
    with pytest.raises(ConfigError, match="does not divide the world size"):
        check_sizes(4, tp=3)
    with pytest.raises(ConfigError, match=r"must divide dp \* cp"):
        check_sizes(4, dp=4, ep=3)
    assert check_sizes(4, dp=2, cp=2, ep=4)["ep"] == 4  # experts carved from dp x cp
    with pytest.raises(ConfigError, match="at least 1"):
        check_sizes(4, pp=0)


@pytest.mark.parallel(nprocs=8)
@collective
def test_groups_of_axes_and_experts_carved_from_dp_x_cp():
    rank = MPI.COMM_WORLD.rank
    g = ProcessGrid(dp=2, cp=2, tp=2)  # rank = (dp_i * 2 + cp_i) * 2 + tp_i
    dense = g.group("dp", "cp")  # ranks with my tp coordinate: 4 of them, 2 apart
    assert dense is g.group("cp", "dp") and dense.axis == "dp+cp" and dense.size == 4
    assert list(dense.allgather(np.array([rank]))) == [rank % 2 + 2 * j for j in range(4)]
    assert g.group("cp", "tp").axis == "cp+tp" and g.size("cp", "tp") == 4
    # ep 4 over the dp x cp ranks (f = dp_i * 2 + cp_i) of each tp slice; edp is what is left
    g4 = ProcessGrid(dp=2, cp=2, tp=2, ep=4)
    assert list(g4.comm["ep"].allgather(np.array([rank]))) == [rank % 2 + 2 * j for j in range(4)]
    assert g4.comm["edp"].size == 1
    g2 = ProcessGrid(dp=2, cp=2, tp=2, ep=2)
    f = rank // 2  # the dp x cp index
    assert list(g2.comm["ep"].allgather(np.array([rank]))) == [
        2 * (2 * (f // 2) + j) + rank % 2 for j in range(2)]
    assert list(g2.comm["edp"].allgather(np.array([rank]))) == [
        2 * (2 * j + f % 2) + rank % 2 for j in range(2)]


def test_waits_spin_when_the_ranks_fit_the_cores_and_refuse_bad_settings(monkeypatch):
    """Tests without pause first (a collective needs many of MPI's progress steps), sleeping
    only after spin_time(); no spinning when ranks outnumber cores; bad values refused."""
    from refmp.distributed import waiting
    from refmp.runtime import cpu
    monkeypatch.delenv("REFMP_SPIN_US", raising=False)
    monkeypatch.delenv("REFMP_POLL_US", raising=False)
    monkeypatch.setattr(cpu, "cores", lambda: 2)
    monkeypatch.setattr(cpu, "local_ranks", lambda: 2)
    assert waiting.spin_time() == 1e-3 and waiting.poll_cap() == 1e-4
    monkeypatch.setattr(cpu, "local_ranks", lambda: 3)  # oversubscribed: sleep at once
    assert waiting.spin_time() == 0.0 and waiting.poll_cap() == 1e-4  # the cap alike
    monkeypatch.setenv("REFMP_POLL_US", "1000")
    assert waiting.poll_cap() == 1e-3
    monkeypatch.setenv("REFMP_SPIN_US", "250")
    assert waiting.spin_time() == 250e-6
    monkeypatch.setenv("REFMP_SPIN_US", "1ms")
    with pytest.raises(ConfigError, match="REFMP_SPIN_US must be a whole number of microseconds"):
        waiting.spin_time()

    sleeps, calls = [], []
    monkeypatch.setattr(waiting.time, "sleep", sleeps.append)
    monkeypatch.setattr(waiting, "_poll_cap", 1e-4)
    monkeypatch.setattr(waiting, "_spin", 10.0)  # long enough for 50 calls
    waiting.sleep_until(lambda: calls.append(1) or len(calls) == 50)
    assert len(calls) == 50 and sleeps == []  # done while spinning: never slept
    calls.clear()
    monkeypatch.setattr(waiting, "_spin", 0.0)
    waiting.sleep_until(lambda: calls.append(1) or len(calls) == 6)
    assert sleeps == [1e-5, 2e-5, 4e-5, 8e-5, 1e-4]  # backs off to the cap
