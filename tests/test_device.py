"""GPU plumbing that CPU-only CI can still test: device choice, CUDA-awareness detection, and
host staging (with the strict stand-in for CuPy, tests/device/strict.py, as device memory)."""

import numpy as np
import pytest
from device import strict
from mpi4py import MPI
from mpi_helpers import Mismatches, collective

from refmp.distributed.comm import Comm
from refmp.distributed.waiting import wait
from refmp.errors import ConfigError
from refmp.runtime import backend
from refmp.runtime.device import detect_cuda_aware, device_for


def pretend(a):
    """A host array copied into the strict stand-in's "device memory" (tests/device/strict.py)."""
    return strict.asarray(np.asarray(a))


def test_device_for_round_robin():
    assert [device_for(r, 4) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    with pytest.raises(ConfigError, match="no CUDA device"):
        device_for(0, 0)


def test_detect_cuda_aware():
    assert detect_cuda_aware({"REFMP_CUDA_AWARE": "1"}) == (True, "REFMP_CUDA_AWARE")
    assert detect_cuda_aware({"REFMP_CUDA_AWARE": "0"}) == (False, "REFMP_CUDA_AWARE")
    answer, source = detect_cuda_aware({})
    assert source in ("mpi_memory_alloc_kinds", "MPIX_Query_cuda_support", "unknown")
    if "mpich" in MPI.Get_library_version().lower() and source == "MPIX_Query_cuda_support":
        assert answer is False  # the PyPI MPICH wheel is built without CUDA


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("aware", [False, True])
@collective
def test_staging_through_host(aware):
    c = Comm(MPI.COMM_WORLD, "dp")
    c.cuda_aware = aware
    backend.use(strict)  # recv makes its array in the run's module: "device memory"
    try:
        _staging(c, aware)
    finally:
        backend.use("numpy")


def _staging(c, aware):
    r = c.rank
    backend.transfers.reset()
    buf = pretend(np.full(4, r + 1.0))
    c.allreduce(buf)
    pending = pretend(np.full(3, 10.0 * (r + 1)))
    req = c.allreduce_start(pending)
    wait(req)  # the staged copy comes back to the "device" only here
    b = pretend(np.arange(2.0) if r == 0 else np.zeros(2))
    c.bcast(b)
    if r == 0:
        wait(c.send(pretend(np.arange(5.0)), dest=1))
    else:
        got = c.recv((5,), np.float64, source=0)
    led = c.ledger
    bad = Mismatches()
    bad.check(np.testing.assert_array_equal, buf.get(), 3.0)
    bad.check(np.testing.assert_array_equal, pending.get(), 30.0)
    bad.check(np.testing.assert_array_equal, b.get(), [0.0, 1.0])
    if r == 1:
        bad.check(np.testing.assert_array_equal, got.get(), np.arange(5.0))
    sent, received = (40, 0) if r == 0 else (0, 40)
    expect_d2h = 0 if aware else 32 + 24 + 16 + sent  # allreduce, allreduce_start, bcast, send
    expect_h2d = 0 if aware else 32 + 24 + 16 + received  # in-place results, the message
    bad.check(lambda: assert_equal(led.bytes("stage_d2h"), expect_d2h, "stage_d2h"))
    bad.check(lambda: assert_equal(led.bytes("stage_h2d"), expect_h2d, "stage_h2d"))
    bad.check(lambda: assert_equal(backend.transfers.bytes["d2h"], expect_d2h, "transfers d2h"))
    bad.assert_none()


def assert_equal(got, want, what):
    assert got == want, f"{what}: {got} bytes, expected {want}"
