"""`refmp train --tp` end to end under mpiexec: saved weights, evaluation, bad input, and
the tutorial. TP composes with the other axes through the one engine: tp x dp with SP and
micro-batches, tp x cp with SP and ZeRO-3."""

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import refmp, refused_each
from safetensors.numpy import load_file

from refmp.distributed.grid import ProcessGrid
from refmp.training.trainer import TrainConfig, Trainer

pytestmark = pytest.mark.cli


@pytest.mark.parametrize("n,layout,T", [
    (2, ["--tp", "2"], None),  # vocab 13: padded to 14
    (4, ["--tp", "2", "--dp", "2", "--sequence-parallel", "--microbatches", "2"], 12),
    (4, ["--tp", "2", "--cp", "2", "--sequence-parallel", "--zero", "3"], 12),  # SP with cp
])
def test_tp_train_save_and_evaluate(tmp_path, n, layout, T):
    out = tmp_path / "m.safetensors"
    shape = ["--n-layer", "1", "--n-head", "2", "--n-embd", "8", "--batch-size", "4",
             "--steps", "3", "--dtype", "float64", "--grad-clip", "0.1"]
    if T:
        shape += ["--block-size", str(T)]
    r = refmp(n, ["train", *layout, *shape, "--no-progress", "--save", str(out)], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "held-out exact match" in r.stdout  # greedy decoding across vocab shards ran
    assert ("reduce_scatter@tp" in r.stdout) == ("--sequence-parallel" in layout)
    cfg = TrainConfig(n_layer=1, n_head=2, n_embd=8, batch_size=4, steps=3, dtype="float64",
                      grad_clip=0.1, block_size=T, progress=False)
    tr = Trainer(cfg, grid=ProcessGrid(MPI.COMM_SELF))
    for _ in range(3):
        tr.step()
    saved, want = load_file(str(out)), tr.runner.full_params()
    assert set(saved) == set(want)
    for k, v in want.items():  # full, unpadded, GPT-2 names
        assert saved[k].shape == v.shape, k
        np.testing.assert_allclose(saved[k], v, rtol=1e-9, atol=1e-12, err_msg=k)


BAD_TP = [
    (["--tp", "2", "--n-head", "3", "--n-embd", "12"], "--tp 2 must divide the number of heads"),
    (["--tp", "2", "--n-head", "2", "--sequence-parallel"], "must divide the tokens each rank holds"),
    (["--tp", "2", "--n-head", "2", "--batch-size", "3", "--microbatches", "2"],
     "must be divisible by dp * microbatches"),
]


@pytest.fixture(scope="module")
def bad_tp_runs():
    """BAD_TP's command lines, each refused on 2 ranks, all in one launch
    (mpi_helpers.refused)."""
    return refused_each(2, ["train", "--no-progress"], BAD_TP)


@pytest.mark.parametrize("args,message", BAD_TP)
def test_tp_bad_input_fails_cleanly_on_every_rank(bad_tp_runs, args, message):
    r = bad_tp_runs[str(args)]
    assert r.returncode == 2
    assert message in r.stderr, r.stderr
    assert r.stderr.count(message) == 1 and "Traceback" not in r.stderr


@pytest.mark.tutorial
@pytest.mark.parametrize("n", [2, 4])
def test_tutorial_runs_and_checks_itself(n):
    from mpi_helpers import mpiexec

    r = mpiexec(n, ["python", "tutorials/05_tensor_parallel.py"], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: tensor parallel == serial, ledger == formula" in r.stdout
    assert "1. by hand: tp = " in r.stdout
