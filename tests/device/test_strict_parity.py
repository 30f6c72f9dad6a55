"""Every strategy on "device memory", without a GPU: the engine's parity through the strict
stand-in (tests/device/strict.py), and what a step moves between host and device.

With ``backend.use(strict)`` every parameter, gradient, activation and optimizer moment is a
DeviceArray, which refuses each implicit trip to the host where CuPy does; Comm stages device
buffers through the host (MPI here is not CUDA-aware) or, told it is CUDA-aware, hands them to
MPI as they are. Each layout must equal the serial run (tests/parity.py, float64), and one more
step is traced: every host<->device crossing is either MPI's staging (equal to the ledger's
stage_d2h / stage_h2d), the batch (x, y), or a site of ALLOWED (the figures a step reports,
and the routing counts an all-to-all(v) needs on the host).
"""

import os

import numpy as np
import pytest
from device import strict
from mpi4py import MPI
from mpi_helpers import Mismatches, collective
from parity import assert_same_run
from test_engine import COMPOSED

from refmp.distributed.grid import ProcessGrid
from refmp.runtime import backend
from refmp.training.datasets import Dataset
from refmp.training.trainer import TrainConfig

pytestmark = [pytest.mark.mpi, pytest.mark.device]
# tests/gpu/check.sh runs these again with REFMP_TEST_XP=cupy: the same layouts on CuPy, on a GPU
XP = os.environ.get("REFMP_TEST_XP", "strict")

# the engine issue's layouts (tests/test_engine.py), but three whose code paths the others
# already take on the device, and one of each strategy besides
SAME_PATHS = [dict(cp=2, dp=2, zero=2), dict(cp=2, dp=2, microbatches=2),
              dict(tp=2, pp=2, zero=1, microbatches=2)]
LAYOUTS = [kw for kw in COMPOSED if kw not in SAME_PATHS] + [
    dict(dp=4),
    dict(tp=4, sequence_parallel=True, recompute="full"),
    dict(cp=4, cp_algo="ring", recompute="selective"),
]

# what a step may move besides the batch and MPI staging: {(kind, "file:function"): why}
ALLOWED = {
    ("scalar", "refmp/runtime/arrays.py:global_grad_norm"): "the gradient norm (one float)",
    ("scalar", "refmp/parallel/pipeline/executor.py:step"): "the loss (a float a micro-batch)",
    ("scalar", "refmp/parallel/pipeline/stage.py:forward"): "MoE's auxiliary loss (a layer)",
    ("scalar", "refmp/nn/moe.py:moe_forward"): "the aux and z losses for the statistics",
    ("d2h", "refmp/nn/moe.py:moe_forward"): "tokens per expert: all-to-all(v)'s sizes, stats",
    ("h2d", "refmp/parallel/expert.py:forward"): "the regrouping permutation, a stable argsort "
                                                 "of the received counts' labels",
}


def config(**kw) -> TrainConfig:
    base = dict(n_layer=2, n_head=4, n_embd=16, block_size=8, batch_size=4, steps=2,
                lr=0.01, warmup_steps=1, grad_clip=0.05, dtype="float64", seed=3,
                progress=False, capacity_factor=1.0, top_k=2)
    return TrainConfig(**{**base, **kw})


def data() -> Dataset:
    return Dataset(np.random.default_rng(0).integers(0, 17, 400), 17, "random")


def traced_step(tr, bad: Mismatches, what: str) -> dict | None:
    """One more step of ``tr``, every crossing accounted for (collects mismatches); returns
    the step's record."""
    if backend.xp is not strict:  # CuPy: only backend's counts (dense layouts: all of them)
        return cupy_step(tr, bad, what)
    led, c = tr.grid.ledger, strict.crossings
    led.reset()
    backend.transfers.reset()
    c.reset()
    c.trace = True
    try:
        rec = tr.step()
    finally:
        c.trace = False
    staged = {k: sum(n for kind, n, _, s in c.log if s and kind == k) for k in ("d2h", "h2d")}
    other = [(kind, n, site) for kind, n, site, s in c.log if not s]
    batch = [n for kind, n, site in other if (kind, site) == ("h2d", "refmp/training/trainer.py:step")]
    rows = tr.rows.stop - tr.rows.start
    want_batch = [rows * tr.T * tr.ds.tokens.itemsize] * 2  # x, y
    stray = sorted({(kind, site) for kind, n, site in other
                    if (kind, site) != ("h2d", "refmp/training/trainer.py:step")
                    and (kind, site) not in ALLOWED})
    eq = np.testing.assert_equal
    bad.check(eq, staged["d2h"], led.bytes("stage_d2h"), err_msg=f"{what}: staged d2h")
    bad.check(eq, staged["h2d"], led.bytes("stage_h2d"), err_msg=f"{what}: staged h2d")
    bad.check(eq, batch, want_batch, err_msg=f"{what}: the batch")
    bad.check(_none, stray, f"{what}: unexpected host<->device crossings")
    # nothing bypassed backend.to_host / from_host / copy_from_host (scalars aside)
    bad.check(eq, c.bytes, backend.transfers.bytes, err_msg=f"{what}: crossings outside backend")
    # a synchronisation before each staged read of device memory
    bad.check(lambda: _at_least(c.count["sync"], led.count("stage_d2h"), what))
    return rec


def cupy_step(tr, bad: Mismatches, what: str) -> dict:
    led, moved = tr.grid.ledger, backend.transfers
    led.reset()
    moved.reset()
    rec = tr.step()
    if tr.cfg.n_expert:
        return rec  # routing counts and the regrouping permutation cross too (ALLOWED)
    batch = 2 * (tr.rows.stop - tr.rows.start) * tr.T * tr.ds.tokens.itemsize
    eq = np.testing.assert_equal
    bad.check(eq, moved.bytes["d2h"], led.bytes("stage_d2h"), err_msg=f"{what}: d2h")
    bad.check(eq, moved.bytes["h2d"], batch + led.bytes("stage_h2d"), err_msg=f"{what}: h2d")
    return rec


def _none(stray, what):
    assert not stray, f"{what}: {stray}"


def _at_least(got, want, what):
    assert got >= want, f"{what}: {got} stream syncs for {want} staged reads"


@pytest.fixture
def on_strict_device():
    if XP == "cupy":
        pytest.importorskip("cupy")
    backend.use("cupy" if XP == "cupy" else strict)
    try:
        yield
    finally:
        backend.use("numpy")


@pytest.mark.parallel(nprocs=4)
@collective
def test_every_strategy_on_device_equals_serial_and_moves_only_the_batch(on_strict_device):
    bad = Mismatches()
    for kw in LAYOUTS:
        par = assert_same_run(config(**kw), data())
        bad.check(_is_device, next(iter(par.runner.params.values())), kw)
        traced_step(par, bad, str(kw))
    bad.assert_none()


def _is_device(a, kw):
    assert isinstance(a, backend.xp.ndarray), f"{kw}: parameters on the host ({type(a)})"


@pytest.mark.parallel(nprocs=4)
@collective
def test_cuda_aware_mpi_takes_device_buffers_unstaged(on_strict_device):
    if XP == "cupy" and os.environ.get("REFMP_CUDA_AWARE") != "1":
        return  # real device pointers: only for an MPI known to be CUDA-aware
    kw = dict(tp=2, pp=2, zero=2, microbatches=2, schedule="zb-h1")
    cfg = config(**kw)
    grid = ProcessGrid(MPI.COMM_WORLD, pp=2, tp=2)
    grid.set_cuda_aware(True)
    par = assert_same_run(cfg, data(), grid=grid)
    bad = Mismatches()
    traced_step(par, bad, f"{kw} CUDA-aware")
    bad.check(np.testing.assert_equal, par.grid.ledger.bytes("stage_d2h"), 0)
    bad.assert_none()


@pytest.mark.parallel(nprocs=4)
@collective
def test_generation_and_resume_on_device(on_strict_device, tmp_path_factory):
    """Greedy decoding and a checkpoint's save and resume, all on device arrays: the resumed
    run's next step is bitwise the uninterrupted one's."""
    from refmp.training.evaluate import decoder
    from refmp.training.trainer import Trainer

    kw = dict(pp=2, tp=2, zero=3, microbatches=2)
    tr = Trainer(config(**kw), dataset=data())
    tr.step()
    greedy = decoder(tr.runner, tr.grid, tr.mcfg, tr.T)
    out = greedy.generate(backend.from_host(np.zeros((1, 2), dtype=np.int64)), 3)
    root = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("ckpt")) if MPI.COMM_WORLD.rank == 0
                                else None)
    again = Trainer(config(**kw, resume=tr.save_checkpoint(root)), dataset=data())
    a, b = tr.step(), again.step()
    bad = Mismatches()
    bad.check(_is_device, out, kw)
    bad.check(np.testing.assert_equal, out.shape, (1, 5))
    bad.check(np.testing.assert_equal, b["loss"], a["loss"], err_msg="resumed loss")
    bad.check(np.testing.assert_equal, b["grad_norm"], a["grad_norm"], err_msg="resumed norm")
    bad.assert_none()


@pytest.mark.parallel(nprocs=4)
@collective
def test_fp16_on_device_is_bitwise_the_cpu_run(on_strict_device):
    """Mixed precision (fp16 compute, fp32 masters, loss scaling) on device arrays: the stand-in
    computes with NumPy, so staging and the device branches must leave every bit as on the
    CPU; and its step crosses only where a float64 one does."""
    from refmp.training.trainer import Trainer

    if XP == "cupy":
        return  # cuBLAS rounds differently: tests/gpu holds CuPy to tolerances instead
    kw = dict(dp=2, tp=2, zero=1, mixed_precision="fp16", dtype="float32", steps=3)
    backend.use("numpy")
    cpu = Trainer(config(**kw), dataset=data())
    want = [cpu.step() for _ in range(3)]
    backend.use(strict)
    dev = Trainer(config(**kw), dataset=data())
    bad = Mismatches()
    got = [dev.step() for _ in range(2)] + [traced_step(dev, bad, f"{kw}")]
    for s, (a, b) in enumerate(zip(want, got, strict=True)):
        for k in ("loss", "grad_norm", "loss_scale"):
            bad.check(np.testing.assert_equal, b[k], a[k], err_msg=f"{k} at step {s}")
    bad.assert_none()


@pytest.mark.parallel(nprocs=4)
@collective
def test_a_whole_run_on_device(on_strict_device, tmp_path_factory):
    """refmp.cli.train end to end on device arrays: training, the held-out evaluation (generation),
    the gathered --save, the log, the pipeline trace and a sharded checkpoint."""
    from refmp.cli.train import run

    world = MPI.COMM_WORLD
    d = world.bcast(str(tmp_path_factory.mktemp("run")) if world.rank == 0 else None)
    cfg = TrainConfig(n_layer=2, n_head=4, n_embd=16, batch_size=4, steps=2, progress=False,
                      pp=2, tp=2, zero=1, microbatches=2, save=f"{d}/m.safetensors",
                      log_json=f"{d}/log.json", trace=f"{d}/t.json", checkpoint_dir=f"{d}/ck")
    run(cfg)
    if world.rank == 0:
        assert all(os.path.exists(f"{d}/{f}") for f in ("m.safetensors", "log.json", "t.json",
                                                         "ck")), os.listdir(d)
