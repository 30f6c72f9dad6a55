"""Gradient accumulation, bucketed all-reduce and ZeRO 1/2/3 equal the serial run (float64).

Rank 0 trains the serial model itself (COMM_SELF, the whole batch, one micro-batch) beside
the engine on dp ranks (COMM_WORLD); after every step the whole gradient and the whole
weights are gathered from the shards and compared element by element (tests/parity.py).
The memory a rank keeps and the bytes its ledger counts are held against the formulas of
refmp.cost.zero, exactly, on the Sharder's units (zero_cost.unit_sizes).
"""

import contextlib
from dataclasses import replace
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
from refmp.errors import ConfigError
from refmp.nn import GPT, GPTConfig
from refmp.parallel.data.hpz import block_notes
from refmp.parallel.engine import Engine
from refmp.parallel.rules import check_hpz
from refmp.runtime.arrays import activation_bytes
from refmp.training.datasets import Dataset
from refmp.training.trainer import TrainConfig, Trainer

OPS = ("allreduce", "reduce_scatter", "allgather")
STATE = ("params", "grads", "optimizer", "activations")


@contextlib.contextmanager
def kept_out(ledger):
    """What ``ledger`` records inside the block is left out of it."""
    kept = {key: list(entry) for key, entry in ledger.entries.items()}
    yield
    ledger.entries.clear()
    ledger.entries.update(kept)


@contextlib.contextmanager
def ledger_of_the_steps():
    """Keep assert_same_run's own gathers out of the ledger: after every step it gathers
    the whole gradient and the whole weights (Engine.full_grads / full_params, over the
    ZeRO groups too), which is not what a training step moves."""

    def unrecorded(gather):
        def run(self):
            with kept_out(self.grid.ledger):
                return gather(self)
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
@settings(max_examples=4, phases=[Phase.explicit, Phase.generate])  # no shrinking (MPI comms)
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


HPZ = {  # a ZeRO group of 4 ranks in blocks of 2, nodes of 2 ranks (REFMP_RANKS_PER_NODE)
    "dp 4, 2 micro-batches": dict(microbatches=2),
    "dp 2 x cp 2": dict(dp=2, cp=2),  # the ZeRO group is dp x cp
    "dp 4, bf16, 2bw": dict(dtype="float32", mixed_precision="bf16", schedule="2bw"),
}  # 2BW (at pp 1 too) computes on the weights of the step before: a weight version


def same_as_zero3(cfg: TrainConfig, ds: Dataset, version: dict):
    """(``check(par, s)`` for assert_same_run, the plain ZeRO-3 Trainer it steps): plain
    ZeRO-3 (no hpZ) steps beside the run on the same data, and its whole gradient and
    weights are the run's after every step, bitwise. After the first step it also keeps, out
    of the ledger, a weight version of the run (Sharder.snapshot) and the weights it gathers
    then, in ``version``."""
    plain = Trainer(replace(cfg, hpz_size=1), dataset=ds)

    def check(par, s):
        plain.step()
        runs = [(what, r.runner.full_grads() if what == "gradient" else r.runner.full_params())
                for what in ("gradient", "weight") for r in (par, plain)]
        if s == 0:
            sharder = par.runner.sharder
            with kept_out(par.grid.ledger):
                version["snapshot"] = sharder.snapshot()
                version["weights"] = {u: {k: w.copy() for k, w in sharder.weights(u).items()}
                                      for u in sharder.units}
        for (what, got), (_, want) in zip(runs[::2], runs[1::2], strict=True):
            for k in want or {}:  # the whole model is on rank 0
                np.testing.assert_array_equal(got[k], want[k], err_msg=f"{what} {k}, step {s}")

    return check, plain


@pytest.mark.mpi
@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("case", HPZ)
@collective
def test_hpz_gathers_inside_its_blocks_and_equals_zero3(case, monkeypatch):
    """ZeRO-3 with hpZ in blocks of 2 of the 4 ranks: the serial run's losses and weights
    (float64; bf16's ZeRO-3 is held to the serial run in tests/test_mixed_precision.py, 2BW's
    in tests/test_async_pipeline.py), and plain ZeRO-3's bitwise; the gathers of every use
    on the blocks ("dp.hpz", inside a node), with ZeRO-3's bytes, none on the whole group;
    the refresh across blocks (the only weight bytes between nodes) Pp w / G a step;
    S (1 + n/G) weights held, and the plan's estimate of every buffer the same
    (refmp.cost.zero.hpz_per_step, refmp.cost.memory.stage_memory); a weight version
    copies the secondaries and gathers the weights it was taken at, inside the blocks."""
    monkeypatch.setenv("REFMP_RANKS_PER_NODE", "2")
    cfg = TrainConfig(**{**dict(n_layer=2, n_head=2, n_embd=6, block_size=4, batch_size=8,
                                steps=3, lr=0.01, warmup_steps=1, dtype="float64", seed=3,
                                progress=False, zero=3, hpz_size=2), **HPZ[case]})
    ds = Dataset(np.random.default_rng(3).integers(0, 11, 120), 11, "random")
    version = {}
    bad = Mismatches()
    check, plain = same_as_zero3(cfg, ds, version)
    with ledger_of_the_steps():
        if cfg.mixed_precision == "none":
            par = assert_same_run(cfg, ds, check=check)
        else:
            par = Trainer(cfg, dataset=ds)
            for s in range(cfg.steps):
                par.step()
                bad.check(check, par, s)
    w = 2 if cfg.mixed_precision == "bf16" else 8  # the weights' and gradients' bytes
    sizes = unit_sizes(par.mcfg)
    n = 4  # the ZeRO group: dp x cp
    led = par.grid.ledger
    label = par.grid.group("dp", "cp").axis  # "dp", or "dp+cp"
    want = comm_per_step(sizes, n, 3, cfg.microbatches, w)
    hpz = hpz_per_step(sizes, n, 2, w)
    for run, key, nbytes in (
            (par, f"allgather@{label}.hpz[intra]", cfg.steps * want["allgather"]),
            (par, f"allgather@{label}[inter]", 0),
            (par, f"reduce_scatter@{label}[inter]", cfg.steps * want["reduce_scatter"]),
            (par, f"allgather@{label}.hpz-cross[inter]", cfg.steps * hpz["refresh"]),
            (plain, f"allgather@{label}[inter]", cfg.steps * want["allgather"])):  # ZeRO-3's
        got = run.grid.ledger.as_dict().get(key, {"bytes": 0})["bytes"]
        bad.check(np.testing.assert_equal, got, nbytes, err_msg=f"{key} {run.cfg.hpz_size}")
    mem = par.memory()
    bad.check(np.testing.assert_equal, mem["params"], hpz["params"], err_msg="params")
    plan = stage_memory(cfg, par.mcfg, par.grid.sizes, 0)
    kinds = (*STATE, "versions")
    bad.check(np.testing.assert_equal, [plan[k] for k in kinds], [mem.get(k, 0) for k in kinds],
              err_msg=f"the plan's {kinds}")
    sharder = par.runner.sharder
    before = led.bytes("allgather", label)
    then = {u: sharder.weights(u, version=version["snapshot"]) for u in sharder.units}
    bad.check(np.testing.assert_equal, led.bytes("allgather", label), before,
              err_msg="a version's gathers on the whole group")
    bad.check(np.testing.assert_equal, sum(b.nbytes for b in version["snapshot"].values()),
              hpz["secondary"], err_msg="a version's bytes")
    for u, ws in version["weights"].items():
        for k, w0 in ws.items():
            bad.check(np.testing.assert_array_equal, then[u][k], w0, err_msg=f"version: {k}")
    bad.assert_none()


def test_hpz_blocks_and_sizes():
    """--hpz-size's rule on groups the refusal batch's 2 ranks cannot make, and the warning
    when a block spans nodes (pure: what every rank decides alike)."""
    for n, G, ok in ((4, 2, True), (4, 3, False), (6, 3, True), (6, 4, False), (8, 8, False)):
        cfg = TrainConfig(zero=3, hpz_size=G)
        if ok:
            check_hpz(cfg, n)
        else:
            with pytest.raises(ConfigError, match=f"--hpz-size {G} must divide"):
                check_hpz(cfg, n)
    two = (0, 0, 1, 1)  # 2 nodes of 2 ranks
    grid = {"pp": 1, "dp": 4, "cp": 1, "tp": 1, "ep": 1}
    assert block_notes(grid, two, 2) == [] and block_notes(grid, two, 1) == []
    note = block_notes(grid, (0, 1, 2, 3), 2)  # a node per rank: every block crosses
    assert len(note) == 1 and "world ranks 0, 1 spans nodes" in note[0]
    assert "leave --hpz-size 1" in note[0]
    tp2 = {**grid, "tp": 2}  # 8 ranks; rank 0's dp group: 0, 2, 4, 6; 4 ranks a node
    assert "(here 2)" in block_notes(tp2, (0,) * 4 + (1,) * 4, 4)[0]
    assert block_notes(tp2, (0,) * 4 + (1,) * 4, 2) == []


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
    (["--zero", "3", "--hpz-size", "0"], "--hpz-size must be at least 1"),
    (["--zero", "3", "--hpz-size", "2", "--weight-gather", "int8"], "use one of the two"),
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
    r = mpiexec(2, ["python", "tutorials/04_zero.py"], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all checks passed" in r.stdout
    assert "1. by hand: one ZeRO step" in r.stdout
