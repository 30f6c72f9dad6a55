"""Every tutorial runs, as a reader runs it, and checks itself (exit status 0)."""

import pytest
from mpi_helpers import mpiexec

pytestmark = pytest.mark.tutorial


def test_02_serial_gpt():
    r = mpiexec(1, ["python", "tutorials/02_serial_gpt.py"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: gradients match" in r.stdout


@pytest.mark.parametrize("n", [2, 4])
def test_03_data_parallel(n):
    r = mpiexec(n, ["python", "tutorials/03_data_parallel.py"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: data parallel == serial" in r.stdout
    assert r.stdout.count("step 4:") == 1  # rank 0 alone narrates


def test_15_no_rank_can_hold():
    r = mpiexec(4, ["python", "tutorials/15_no_rank_can_hold.py"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: every rank made and trained only its share" in r.stdout


def test_14_across_nodes():
    """As root: 2 nodes made of network namespaces (it runs mpiexec itself); else skipped."""
    import subprocess
    import sys

    from mpi_helpers import REPO

    from refmp.cli.netns import unavailable

    why = unavailable()
    if why:
        pytest.skip(f"no local cluster: {why}")
    r = subprocess.run([sys.executable, "tutorials/14_across_nodes.py"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: the same sums; the slow link carries G = 2 times less" in r.stdout
