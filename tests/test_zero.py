"""Gradient accumulation, bucketed all-reduce and ZeRO 1/2/3 equal the serial run (float64).

Rank 0 trains the serial model itself (COMM_SELF, the whole batch, one micro-batch) beside
the engine on dp ranks (COMM_WORLD); after every step the whole gradient and the whole
weights are gathered from the shards and compared element by element (tests/parity.py).
The memory a rank keeps and the bytes its ledger counts are held against the formulas of
refmp.cost.zero, exactly, on the Sharder's units (zero_cost.unit_sizes).
"""

import contextlib
from unittest import mock

import numpy as np
import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_helpers import Mismatches, collective, mpiexec, refused_each
from parity import assert_same_run

from refmp.cost.memory import stage_memory
from refmp.cost.zero import comm_per_step, hpz_per_step, memory_per_rank, unit_sizes
from refmp.nn import GPT, GPTConfig
from refmp.parallel.engine import Engine
from refmp.runtime.arrays import activation_bytes
from refmp.training.datasets import Dataset
from refmp.training.trainer import TrainConfig

OPS = ("allreduce", "reduce_scatter", "allgather")


@contextlib.contextmanager
def ledger_of_the_steps():
    """Keep assert_same_run's own gathers out of the ledger: after every step it gathers
    the whole gradient and the whole weights (Engine.full_grads / full_params, over the
    ZeRO groups too), which is not what a training step moves."""

    def unrecorded(gather):
        def run(self):
            kept = {key: list(entry) for key, entry in self.grid.ledger.entries.items()}
            out = gather(self)
            self.grid.ledger.entries.clear()
            self.grid.ledger.entries.update(kept)
            return out
        return run

    with mock.patch.object(Engine, "full_grads", unrecorded(Engine.full_grads)), \
            mock.patch.object(Engine, "full_params", unrecorded(Engine.full_params)):
        yield


def check_memory_and_ledger(par, sizes: dict[str, int], bad: Mismatches, first: bool = True,
                            last: bool = True) -> None:
    """This rank's kept bytes and its dense ZeRO group's ledger (dp x cp, n ranks) equal
    the formulas on ``sizes``, the units it holds (float64: 8 bytes per element)."""
    cfg, n, label = par.cfg, par.grid.size("dp", "cp"), par.grid.group("dp", "cp").axis
    mem, want = par.memory(), memory_per_rank(sizes, n, cfg.zero, itemsize=8)
    for kind in ("params", "grads", "optimizer"):
        bad.check(np.testing.assert_equal, mem[kind], want[kind], err_msg=f"{kind} bytes")
    led = par.grid.ledger
    want = comm_per_step(sizes, n, cfg.zero, cfg.microbatches, 8, first, last)
    for op in OPS:
        bad.check(np.testing.assert_equal, led.bytes(op, label), cfg.steps * want[op],
                  err_msg=f"{op}@{label} bytes")


@pytest.mark.mpi
@pytest.mark.parallel(nprocs=[2, 4])
@settings(max_examples=6, phases=[Phase.explicit, Phase.generate])  # no shrinking (MPI comms)
@given(zero=st.sampled_from([0, 1, 2, 3]), M=st.sampled_from([1, 2]),
       bucket_mb=st.sampled_from([0.0, 1e-4, 4e-4, 25.0]), n_layer=st.integers(1, 2),
       n_head=st.integers(1, 2), hs=st.integers(1, 3), V=st.integers(3, 13),
       T=st.integers(2, 5), clip=st.sampled_from([0.0, 0.05, 10.0]), seed=st.integers(0, 99))
@example(zero=2, M=2, bucket_mb=25.0, n_layer=2, n_head=2, hs=3, V=13, T=5, clip=0.05,
         seed=1)  # stage 2 reduce-scatters every micro-batch
@collective
def test_training_equals_serial(zero, M, bucket_mb, n_layer, n_head, hs, V, T, clip, seed):
    dp = MPI.COMM_WORLD.size
    cfg = TrainConfig(n_layer=n_layer, n_head=n_head, n_embd=n_head * hs, block_size=T,
                      batch_size=dp * M, steps=3, lr=0.01, warmup_steps=1, grad_clip=clip,
                      dtype="float64", seed=seed, progress=False, zero=zero, microbatches=M,
                      bucket_mb=bucket_mb)
    ds = Dataset(np.random.default_rng(seed).integers(0, V, 120), V, "random")
    with ledger_of_the_steps():
        par = assert_same_run(cfg, ds)
    bad = Mismatches()
    # memory and communication: the ZeRO table on the units, padding included
    mcfg = GPTConfig(V, T, n_layer, n_head, n_head * hs)
    check_memory_and_ledger(par, unit_sizes(mcfg), bad)
    # peak activations: one micro-batch's caches, as the serial model's on the same rows
    m = GPT.create(mcfg, seed, "float64")
    x = np.zeros((cfg.batch_size // (dp * M), T), dtype=np.int64)
    _, cache = m.forward(x, x.copy(), 1)
    bad.check(np.testing.assert_equal, par.memory()["activations"],
              activation_bytes(cache, m.params.values()), err_msg="activation bytes")
    bad.assert_none()


@pytest.mark.mpi
@pytest.mark.parallel(nprocs=4)
@collective
def test_hpz_gathers_inside_its_blocks_and_equals_serial():
    """ZeRO-3 with hpZ in blocks of 2 of the 4 ranks, two micro-batches: the serial run's
    weights; the gathers of every use on the blocks ("dp.hpz"), with ZeRO-3's bytes; the
    refresh across blocks Pp w / G a step; S (1 + n/G) weights held (cost.zero.hpz_per_step)
    and the plan's memory estimate the same."""
    cfg = TrainConfig(n_layer=2, n_head=2, n_embd=6, block_size=5, batch_size=8, steps=3,
                      lr=0.01, warmup_steps=1, dtype="float64", seed=3, progress=False, zero=3,
                      microbatches=2, hpz_size=2)
    ds = Dataset(np.random.default_rng(3).integers(0, 11, 120), 11, "random")
    with ledger_of_the_steps():
        par = assert_same_run(cfg, ds)
    sizes = unit_sizes(GPTConfig(11, 5, 2, 2, 6))
    led, n, bad = par.grid.ledger, 4, Mismatches()
    want = comm_per_step(sizes, n, 3, 2, 8)
    hpz = hpz_per_step(sizes, n, 2, 8)
    for label, op, nbytes in (("dp.hpz", "allgather", cfg.steps * want["allgather"]),
                              ("dp", "allgather", 0),
                              ("dp", "reduce_scatter", cfg.steps * want["reduce_scatter"]),
                              ("dp.hpz-cross", "allgather", cfg.steps * hpz["refresh"])):
        bad.check(np.testing.assert_equal, led.bytes(op, label), nbytes, err_msg=f"{op}@{label}")
    bad.check(np.testing.assert_equal, par.memory()["params"], hpz["params"], err_msg="params")
    plan = stage_memory(cfg, par.model.cfg, par.grid.sizes, 0)
    bad.check(np.testing.assert_equal, plan["params"], hpz["params"], err_msg="plan's params")
    bad.assert_none()


def test_formulas_match_the_paper_without_padding():
    """With no padding (every unit divisible by dp): 4+4+8 bytes per parameter, divided by
    stage; stages 1 and 2 move what plain DP moves, stage 3 gathers every unit again."""
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
    sizes = unit_sizes(cfg)
    n, dp = 64 * 16 + 16 * 16 + 2 * (12 * 16 * 16 + 13 * 16) + 32, 4
    assert sum(sizes.values()) == n and all(s % dp == 0 for s in sizes.values())
    assert memory_per_rank(sizes, dp, 0) == {"params": 4 * n, "grads": 4 * n,
                                             "optimizer": 8 * n}
    assert memory_per_rank(sizes, dp, 1) == {"params": 4 * n, "grads": 4 * n,
                                             "optimizer": 8 * n // dp}
    assert memory_per_rank(sizes, dp, 2) == {"params": 4 * n, "grads": 4 * n // dp,
                                             "optimizer": 8 * n // dp}
    assert memory_per_rank(sizes, dp, 3) == {"params": 4 * n // dp, "grads": 4 * n // dp,
                                             "optimizer": 8 * n // dp}
    assert comm_per_step(sizes, dp, 0)["allreduce"] == 4 * n
    assert comm_per_step(sizes, dp, 1) == comm_per_step(sizes, dp, 2) == \
        {"allreduce": 0, "reduce_scatter": 4 * n, "allgather": 4 * n}
    # per micro-batch: wte 3x (embedding forward, head forward and backward), wpe 1x,
    # each block and ln_f 2x (forward and backward)
    blocks = n - sizes["wte"] - sizes["wpe"] - sizes["ln_f"]
    gathered = 3 * sizes["wte"] + sizes["wpe"] + 2 * blocks + 2 * sizes["ln_f"]
    assert comm_per_step(sizes, dp, 3, microbatches=2) == \
        {"allreduce": 0, "reduce_scatter": 2 * 4 * n, "allgather": 2 * 4 * gathered}


BAD_ZERO = [
    (["--zero", "4"], "invalid choice"),
    (["--microbatches", "3", "--batch-size", "8"], "divisible by dp * microbatches"),
    (["--bucket-mb", "-1"], "--bucket-mb must be >= 0"),
    (["--hpz-size", "2"], "add --zero 3"),  # on 2 ranks:
    (["--zero", "3", "--hpz-size", "2"], "must divide the dp x cp ranks of a ZeRO group (2)"),
    (["--zero", "3", "--hpz-size", "3"], "--hpz-size 3 must divide"),
]


@pytest.fixture(scope="module")
def bad_zero_runs():
    """BAD_ZERO's command lines, each refused on 2 ranks, all in one launch
    (mpi_helpers.refused)."""
    train = ["train", "--n-embd", "8", "--steps", "1", "--no-progress"]
    return refused_each(2, train, BAD_ZERO)


@pytest.mark.cli
@pytest.mark.parametrize("args, message", BAD_ZERO)
def test_bad_input_is_refused(bad_zero_runs, args, message):
    r = bad_zero_runs[str(args)]
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.tutorial
def test_tutorial_runs():
    r = mpiexec(2, ["python", "tutorials/06_zero.py"], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all checks passed" in r.stdout
    assert "1. by hand: one ZeRO step" in r.stdout
