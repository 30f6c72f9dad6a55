"""Level 2/3: data-parallel training equals the serial run, under real MPI (float64).

Every rank trains the serial model itself (on MPI.COMM_SELF, the whole batch) and the
data-parallel model (on COMM_WORLD, its rows of the batch), step by step, and compares the
loss, the gradients after the all-reduce and clipping, and the updated weights.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_helpers import Mismatches, collective

from refmp.data import Dataset
from refmp.grid import ProcessGrid
from refmp.train import TrainConfig, Trainer

pytestmark = pytest.mark.mpi

TOL = dict(rtol=1e-9, atol=1e-12)  # float64: rounding only (sums in a different order)


def assert_same_run(cfg: TrainConfig, ds: Dataset) -> None:
    serial = Trainer(cfg, grid=ProcessGrid(MPI.COMM_SELF), dataset=ds)
    dp = Trainer(cfg, grid=ProcessGrid(MPI.COMM_WORLD), dataset=ds)
    assert dp.grid.dp == MPI.COMM_WORLD.size
    close = np.testing.assert_allclose
    bad = Mismatches()  # assert after the last collective, so no rank fails alone mid-run
    for s in range(cfg.steps):
        a, b = serial.step(), dp.step()
        bad.check(close, b["loss"], a["loss"], **TOL, err_msg=f"loss at step {s}")
        bad.check(close, b["grad_norm"], a["grad_norm"], **TOL, err_msg=f"norm at step {s}")
        for k in serial.model.params:
            bad.check(close, dp.model.grads[k], serial.model.grads[k], **TOL,
                      err_msg=f"gradient {k} at step {s}")
            bad.check(close, dp.model.params[k], serial.model.params[k], **TOL,
                      err_msg=f"weight {k} after step {s}")
    bad.assert_none()
    # one all-reduce of every gradient per step: 8 bytes per parameter in float64
    n = dp.model.num_params()
    assert dp.grid.ledger.count("allreduce", "dp") == cfg.steps
    assert dp.grid.ledger.bytes("allreduce", "dp") == cfg.steps * 8 * n


@pytest.mark.parallel(nprocs=[2, 4])
@settings(max_examples=6)
@given(n_layer=st.integers(1, 2), n_head=st.integers(1, 2), hs=st.integers(1, 4),
       V=st.integers(3, 17), T=st.integers(2, 6), rows=st.integers(1, 2),
       optimizer=st.sampled_from(["adamw", "sgd"]), clip=st.sampled_from([0.0, 0.05, 10.0]),
       shuffle=st.booleans(), seed=st.integers(0, 1000))
@collective
def test_dp_training_equals_serial(n_layer, n_head, hs, V, T, rows, optimizer, clip, shuffle,
                                   seed):
    size = MPI.COMM_WORLD.size
    cfg = TrainConfig(n_layer=n_layer, n_head=n_head, n_embd=n_head * hs, block_size=T,
                      batch_size=rows * size, steps=3, optimizer=optimizer, lr=0.01,
                      warmup_steps=1, momentum=0.9, grad_clip=clip, dtype="float64", seed=seed,
                      shuffle=shuffle, progress=False)
    rng = np.random.default_rng(seed)
    ds = Dataset(rng.integers(0, V, 200), V, "random")
    assert_same_run(cfg, ds)


@pytest.mark.parallel(nprocs=2)
@collective
def test_dp_addition_task_equals_serial():
    """The built-in task, AdamW with clipping that bites, a few steps (a golden run)."""
    cfg = TrainConfig(n_layer=2, n_head=2, n_embd=16, batch_size=8, steps=4, grad_clip=0.5,
                      dtype="float64", progress=False)
    from refmp.data import AdditionTask

    assert_same_run(cfg, AdditionTask(3, seed=0, n_train=500, n_test=10).dataset())
