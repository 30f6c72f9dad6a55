"""ZeRO 1/2/3 over composed layouts equals the serial run (float64), under real MPI on 4 ranks:
tp 2 x dp 2 (with and without SP), pp 2 x dp 2 (every schedule, ZeRO-3 inside the pipeline
too) and cp 2 x dp 2.

The Sharder shards whatever a rank holds (refmp.parallel.data.sharder): its tp shards, its
pipeline stage's units, over the dense ZeRO group grid.group("dp", "cp"), which with cp 2 x
dp 2 is all 4 ranks (ledger label "dp+cp"). Rank 0 trains the serial model beside the layout;
after every step the whole gradient and the whole weights are gathered and compared element
by element (tests/parity.py). Each rank's memory and its ZeRO group's ledger are held against
refmp.cost.zero's formulas, exactly, on the units that rank holds
(``unit_sizes(cfg, tp, blocks, first, last)``); the CLI's --save against a serial CLI run.
"""

import numpy as np
import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from mpi_helpers import Mismatches, collective, refmp
from parity import TOL, assert_same_run
from test_zero import check_memory_and_ledger, ledger_of_the_steps

from refmp.checkpoint.weights import read_tensors
from refmp.cost.zero import unit_sizes
from refmp.training.datasets import Dataset
from refmp.training.trainer import TrainConfig


@pytest.mark.mpi
@pytest.mark.parallel(nprocs=4)
@settings(max_examples=8, phases=[Phase.explicit, Phase.generate])  # no shrinking (MPI comms)
@given(axis=st.sampled_from(["tp", "pp", "cp"]), zero=st.sampled_from([1, 2, 3]),
       M=st.sampled_from([1, 2]), sp=st.booleans(),
       schedule=st.sampled_from(["gpipe", "1f1b", "zb-h1", "interleaved"]),
       cp_algo=st.sampled_from(["ring", "ulysses"]), hs=st.integers(1, 3), V=st.integers(3, 13),
       clip=st.sampled_from([0.0, 0.05, 10.0]), seed=st.integers(0, 99))
@example(axis="tp", zero=3, M=2, sp=True, schedule="1f1b", cp_algo="ring", hs=3, V=7, clip=0.05,
         seed=2)
@example(axis="pp", zero=3, M=2, sp=False, schedule="1f1b", cp_algo="ring", hs=2, V=11,
         clip=0.05, seed=3)  # ZeRO-3 inside a pipeline (DeepSpeed refuses it)
@example(axis="pp", zero=3, M=2, sp=False, schedule="zb-h1", cp_algo="ring", hs=3, V=5,
         clip=0.05, seed=4)  # ... with the weight gradients deferred (W after B)
@example(axis="cp", zero=3, M=2, sp=False, schedule="1f1b", cp_algo="ring", hs=2, V=11,
         clip=0.05, seed=5)  # the ZeRO group is dp x cp: 4 ranks
@example(axis="cp", zero=2, M=2, sp=False, schedule="1f1b", cp_algo="ulysses", hs=1, V=9,
         clip=0.05, seed=6)
@collective
def test_zero_over_tp_pp_and_cp_equals_serial(axis, zero, M, sp, schedule, cp_algo, hs, V, clip,
                                              seed):
    n_layer, v = 2, 1
    if axis == "pp" and schedule == "interleaved":  # 2 chunks per pipeline rank
        n_layer, v, M = 4, 2, 2
    dp = 2
    cfg = TrainConfig(n_layer=n_layer, n_head=2, n_embd=2 * hs, block_size=4,
                      batch_size=dp * M * 2, steps=3, lr=0.01, warmup_steps=1, grad_clip=clip,
                      dtype="float64", seed=seed, progress=False, zero=zero, microbatches=M,
                      dp=dp, tp=2 if axis == "tp" else 1, pp=2 if axis == "pp" else 1,
                      cp=2 if axis == "cp" else 1, cp_algo=cp_algo,
                      sequence_parallel=sp and axis == "tp",
                      schedule=schedule if axis == "pp" else "1f1b", virtual_stages=v)
    ds = Dataset(np.random.default_rng(seed).integers(0, V, 120), V, "random")
    with ledger_of_the_steps():
        par = assert_same_run(cfg, ds)
    run, bad = par.runner, Mismatches()
    # the units this rank holds: its tp shards of its stage's blocks (and ends)
    blocks = [i for c in run.stage.chunks.values() for i in c]
    sizes = unit_sizes(run.mcfg, tp=cfg.tp, blocks=blocks, first=run.first, last=run.last)
    bad.check(np.testing.assert_equal, sorted(sizes), sorted(run.sharder.units), err_msg="units")
    group = par.grid.group("dp", "cp")  # the dense ZeRO group: dp x cp
    bad.check(np.testing.assert_equal, (group.size, group.axis),
              (4, "dp+cp") if axis == "cp" else (2, "dp"), err_msg="ZeRO group")
    check_memory_and_ledger(par, sizes, bad, run.first, run.last)
    bad.assert_none()


@pytest.fixture(scope="module")
def serial_save(tmp_path_factory):
    """The serial CLI run's --save, once for every layout below."""
    path = tmp_path_factory.mktemp("serial") / "serial.safetensors"
    r = refmp(1, [*COMMON, "--save", str(path)], timeout=120)
    assert r.returncode == 0, r.stderr
    return read_tensors(str(path))[0]


COMMON = ["train", "--n-embd", "8", "--n-layer", "2", "--n-head", "2", "--steps", "3",
          "--batch-size", "8", "--dtype", "float64", "--no-progress", "--digits", "2"]


@pytest.mark.cli
@pytest.mark.parametrize("layout", [["--zero", "1", "--tp", "2", "--dp", "2"],
                                    ["--zero", "3", "--tp", "2", "--dp", "2",
                                     "--sequence-parallel", "--microbatches", "2"],
                                    ["--zero", "2", "--pp", "2", "--dp", "2",
                                     "--microbatches", "2"],
                                    ["--zero", "3", "--pp", "2", "--dp", "2",
                                     "--microbatches", "2", "--schedule", "zb-h1"]])
def test_cli_trains_and_saves_the_full_model(layout, serial_save, tmp_path):
    r = refmp(4, [*COMMON, *layout, "--save", str(tmp_path / "zero.safetensors")], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "reduce_scatter@dp" in r.stdout and "allreduce@dp" not in r.stdout
    got, _ = read_tensors(str(tmp_path / "zero.safetensors"))
    assert sorted(got) == sorted(serial_save)
    for k, want in serial_save.items():
        np.testing.assert_allclose(got[k], want, **TOL, err_msg=k)
