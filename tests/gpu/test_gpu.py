"""The same code on CuPy: float64 parity with the CPU, and no hidden host copies in a step.

Skipped, cleanly, where CuPy or a GPU is missing (CPU-only CI). tests/gpu/check.sh runs these
on a machine with a GPU, together with the GPU benchmark.
"""

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
try:
    HAVE_GPU = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:  # no driver
    HAVE_GPU = False
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="no GPU")]

from mpi4py import MPI  # noqa: E402
from mpi_helpers import Mismatches, collective  # noqa: E402

from refmp.distributed.grid import ProcessGrid  # noqa: E402
from refmp.nn import GPT, GPTConfig  # noqa: E402
from refmp.runtime import backend  # noqa: E402
from refmp.training.datasets import Dataset  # noqa: E402
from refmp.training.trainer import TrainConfig, Trainer  # noqa: E402

TOL = dict(rtol=1e-9, atol=1e-12)


def test_model_gradients_equal_cpu():
    cfg = GPTConfig(vocab_size=17, block_size=8, n_layer=2, n_head=2, n_embd=16)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 17, (3, 8)), rng.integers(0, 17, (3, 8))
    cpu = GPT.create(cfg, seed=1, dtype="float64")
    gpu = GPT(cfg, {k: cupy.asarray(v) for k, v in cpu.params.items()})
    l_cpu, c_cpu = cpu.forward(x, y)
    l_gpu, c_gpu = gpu.forward(cupy.asarray(x), cupy.asarray(y))
    np.testing.assert_allclose(float(l_gpu), float(l_cpu), **TOL)
    cpu.backward(c_cpu)
    gpu.backward(c_gpu)
    for k in cpu.grads:
        assert isinstance(gpu.grads[k], cupy.ndarray), k
        np.testing.assert_allclose(cupy.asnumpy(gpu.grads[k]), cpu.grads[k], **TOL, err_msg=k)


@pytest.mark.parallel(nprocs=2)
@collective
def test_dp_training_on_gpu_equals_cpu_serial():
    cfg = TrainConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, batch_size=4, steps=3,
                      dtype="float64", grad_clip=0.05, progress=False)
    rng = np.random.default_rng(3)
    ds = Dataset(rng.integers(0, 11, 400), 11, "random")
    serial = Trainer(cfg, grid=ProcessGrid(MPI.COMM_SELF), dataset=ds)  # NumPy, CPU
    serial_hist = [serial.step()["loss"] for _ in range(cfg.steps)]
    gpu_cfg = TrainConfig(**{**cfg.__dict__, "device": "gpu"})
    gpu = Trainer(gpu_cfg, grid=ProcessGrid(MPI.COMM_WORLD), dataset=ds)
    backend.transfers.reset()
    gpu.grid.ledger.reset()
    hist = [gpu.step()["loss"] for _ in range(cfg.steps)]
    led, moved = gpu.grid.ledger, backend.transfers.bytes
    batch_bytes = cfg.steps * 2 * (cfg.batch_size // 2) * cfg.block_size * 8  # x and y, int64
    bad = Mismatches()
    bad.check(np.testing.assert_allclose, hist, serial_hist, **TOL)
    want, got = serial.runner.full_params(), gpu.runner.full_params()  # collective
    for k, v in (want.items() if got is not None else []):
        bad.check(np.testing.assert_allclose, cupy.asnumpy(got[k]), v, **TOL, err_msg=k)
    # no hidden copies: device->host only MPI's staging, host->device only batches + staging
    bad.check(lambda: _eq(moved["d2h"], led.bytes("stage_d2h"), "d2h"))
    bad.check(lambda: _eq(moved["h2d"], batch_bytes + led.bytes("stage_h2d"), "h2d"))
    bad.assert_none()


def _eq(got, want, what):
    assert got == want, f"{what}: {got} bytes moved, expected {want}"
