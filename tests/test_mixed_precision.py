"""Mixed precision (Micikevicius et al. 2018): bf16 / fp16 compute, fp32 masters, loss scaling.

Tolerances. Let u be the compute dtype's unit roundoff (bf16 2^-8, fp16 2^-11: the relative
error of one rounding is at most u/2). A mixed-precision run rounds every layer's output,
cache and gradient to the compute dtype; a parallel layout rounds *different* values:
partial sums before they are reduced over dp, tp or cp (and the reductions' own additions,
in the compute dtype), where the serial run rounds the whole sum once. So each element of a
layout's gradient and the serial run's differ by a few roundings along its path: per
tensor, in norm, |g_layout - g_serial| <= k u |g_serial| with k the roundings on the longest
path (a block's backward rounds about four products and a LayerNorm; measured here k <= 3.5
for 2-4 blocks, for layouts and for mixed vs fp32 alike). The tests hold GRAD_K = 8.
The loss is a mean over B T tokens of cross-entropies computed in fp32 from rounded logits:
its rounding errors average out (measured <= 0.2 u, over 3 steps); held at LOSS_K = 1.

The weights cannot be held that tightly: AdamW divides each element's step by its own
gradient's root mean square, so where a gradient is at the level of the rounding noise the
step's sign flips (any two runs then differ by up to ~2 lr per step in that element). Over
3 steps the whole model's update w_3 - w_0 stays within UPDATE_TOL = 0.5 of the fp32 run's,
in relative norm (measured 0.02 - 0.45); a run whose compute copy missed an update is off by
more. AdamW is blind to a gradient's scale, and clipping that bites hides it too, so fp16's
unscaling is held where the scale shows (tests/test_loss_scale.py): the gradient norms with
clipping off, an SGD run, and Sharder.master_grads itself. What is exact: after every step,
in every layout, the compute copy equals the masters rounded to the compute dtype, bitwise.

Memory and bytes are exact: ZeRO's 2 + 2 + 12 bytes per parameter split by stage, the
activations half of fp32's (all but the integer token ids), every collective and message
half of fp32's bytes (the vocab-parallel cross-entropy's three (N,) all-reduces excepted:
they run in fp32, inside the autocast).
"""

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_helpers import Mismatches, collective
from test_engine import config, data, layouts

from refmp.config import check_config
from refmp.cost.tensor import comm_bytes_per_step
from refmp.cost.zero import comm_per_step, memory_per_rank, unit_sizes
from refmp.distributed.grid import ProcessGrid
from refmp.errors import ConfigError
from refmp.parallel.data.sharder import Sharder
from refmp.runtime.precision import BF16, COMPUTE
from refmp.training.trainer import TrainConfig, Trainer

pytestmark = pytest.mark.mpi

ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}  # u, the unit roundoff of the compute dtype
GRAD_K, LOSS_K, UPDATE_TOL = 8, 1, 0.5


def run(cfg, ds, grid=None):
    """(losses, the first step's whole gradient, whole weights before and after)."""
    tr = Trainer(cfg, grid=grid, dataset=ds)
    w0, losses, g0 = tr.runner.full_params(), [], None
    for s in range(cfg.steps):
        losses.append(tr.step()["loss"])
        if s == 0:
            g0 = tr.runner.full_grads()
    return np.array(losses), g0, w0, tr.runner.full_params(), tr


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def update_distance(run_a, run_b) -> float:
    """|(w3 - w0)_a - (w3 - w0)_b| / |(w3 - w0)_b| over the whole model."""
    da = np.concatenate([(run_a[3][k] - run_a[2][k]).ravel() for k in sorted(run_b[2])])
    db = np.concatenate([(run_b[3][k] - run_b[2][k]).ravel() for k in sorted(run_b[2])])
    return rel(da, db)


def compare(bad: Mismatches, got, want, mp: str, what: str) -> None:
    u = ROUNDOFF[mp]
    bad.check(np.testing.assert_array_less, np.abs(got[0] - want[0]) / want[0], LOSS_K * u,
              err_msg=f"{what}: loss")
    for k in want[1]:
        err = rel(got[1][k], want[1][k])
        if not err <= GRAD_K * u:
            bad.errors.append(f"{what}: gradient {k} off by {err:.3g} > {GRAD_K} u")


def compute_copy_is_rounded_masters(tr: Trainer, bad: Mismatches) -> None:
    """Every unit's compute copy (gathered at ZeRO-3) equals its masters, rounded (exact)."""
    sharder = tr.runner.sharder
    masters = sharder.full_local()  # fp32 masters, whole (collective over each unit's group)
    for unit in sharder.units:
        for k, w in sharder.weights(unit).items():
            if not np.array_equal(w, masters[k].astype(sharder.compute)):
                bad.errors.append(f"rank {tr.grid.rank}: compute copy of {k} != round(masters)")


@pytest.mark.parallel(nprocs=4)
@settings(max_examples=3)
@given(layout=layouts(world=4), mp=st.sampled_from(["bf16", "fp16"]),
       grad=st.sampled_from(["compute", "fp32"]))
@collective
def test_any_layout_matches_the_serial_mixed_precision_run(layout, mp, grad):
    kw, V = layout
    kw = {**kw, "grad_dtype": grad}
    ds, bad = data(V), Mismatches()
    par = run(config(**kw, mixed_precision=mp), ds)
    compute_copy_is_rounded_masters(par[4], bad)
    if MPI.COMM_WORLD.rank == 0:
        one = dict(dp=1, tp=1, pp=1, cp=1, ep=1, zero=0, sequence_parallel=False)
        serial = run(config(**{**kw, **one}, mixed_precision=mp), ds, ProcessGrid(MPI.COMM_SELF))
        compare(bad, par, serial, mp, f"{mp} {kw}")
        d = update_distance(par, serial)
        if not d <= UPDATE_TOL:
            bad.errors.append(f"{mp} {kw}: update off by {d:.3g}")
    bad.assert_none()


@pytest.mark.parametrize("mp", ["bf16", "fp16"])
def test_masters_stay_near_the_fp32_run(mp):
    """Serial, fp32 masters: the first gradient within GRAD_K u of fp32's, the losses within
    LOSS_K u, the 3 steps' update within UPDATE_TOL, and elementwise within Adam's bound."""
    ds, grid, bad = data(), ProcessGrid(MPI.COMM_SELF), Mismatches()
    fp32 = run(config(dtype="float32"), ds, grid)
    mixed = run(config(dtype="float32", mixed_precision=mp), ds, grid)
    compare(bad, mixed, fp32, mp, mp)
    assert update_distance(mixed, fp32) <= UPDATE_TOL
    lr_sum = 3 * 0.01  # config(): lr 0.01, 3 steps; |Adam's step| <~ lr in either run
    for k, w in fp32[3].items():
        assert mixed[3][k].dtype == np.float32  # the masters
        bad.check(np.testing.assert_array_less, np.abs(mixed[3][k] - w), 2 * lr_sum, err_msg=k)
    bad.assert_none()


def test_caches_hold_the_compute_dtype_and_half_the_bytes():
    """Every float array a forward keeps is bf16 (no silent promotion to fp32), and the peak
    activations are exactly half of fp32's but for the int64 token ids (x, y, positions)."""
    ds, grid = data(), ProcessGrid(MPI.COMM_SELF)
    for recompute in ("none", "selective", "full"):
        cfg = config(dtype="float32", recompute=recompute)
        fp32 = Trainer(cfg, grid=grid, dataset=ds)
        fp32.step()
        tr = Trainer(config(dtype="float32", recompute=recompute, mixed_precision="bf16"),
                     grid=grid, dataset=ds)
        seen = set()

        def dtypes(c, seen=seen):
            if isinstance(c, (tuple, list)):
                for x in c:
                    dtypes(x)
            elif isinstance(c, dict):
                for x in c.values():
                    dtypes(x)
            elif getattr(c, "ndim", 0) > 0 and hasattr(c, "dtype"):
                seen.add(np.dtype(c.dtype))

        measure = tr.runner.executor.on_forward
        tr.runner.executor.on_forward = lambda caches, m=measure: (dtypes(caches), m(caches))
        tr.step()
        assert {d for d in seen if d.kind == "f" or d == BF16} == {BF16}, (recompute, seen)
        B, T = cfg.batch_size, cfg.block_size
        ids = 8 * (2 * B * T + T)  # the embedding's ids, the targets, the positions
        a16, a32 = tr.memory()["activations"], fp32.memory()["activations"]
        assert 2 * (a16 - ids) == a32 - ids, recompute


def test_one_rank_holds_16_bytes_per_parameter():
    """ZeRO's accounting (sec. 3.1): 2 (bf16 weights) + 2 (bf16 gradients) + 12 (fp32
    masters and the two moments); --grad-dtype fp32: 2 + 4 + 12."""
    ds, grid = data(), ProcessGrid(MPI.COMM_SELF)
    for grad, g in (("compute", 2), ("fp32", 4)):
        tr = Trainer(config(dtype="float32", mixed_precision="bf16", grad_dtype=grad),
                     grid=grid, dataset=ds)
        tr.step()
        N, mem = tr.num_params, tr.memory()
        assert (mem["params"], mem["grads"], mem["optimizer"]) == (2 * N, g * N, 12 * N)


@pytest.mark.parallel(nprocs=4)
@collective
def test_zero_stages_hold_the_papers_bytes_per_parameter():
    """dp = 4, bf16: ZeRO-1 4 + 12/N_d, ZeRO-2 2 + 14/N_d, ZeRO-3 16/N_d bytes per (padded)
    parameter, N_d = 4; every rank, every stage; and the formula of refmp.cost.zero."""
    bad = Mismatches()
    for stage in (0, 1, 2, 3):
        cfg = config(dp=4, zero=stage, batch_size=4, dtype="float32", mixed_precision="bf16")
        tr = Trainer(cfg, dataset=data())
        tr.step()
        sizes = unit_sizes(tr.mcfg)
        n_pad = sum(-(-s // 4) * 4 for s in sizes.values()) if stage else sum(sizes.values())
        per_param = {0: 16, 1: 4 + 12 / 4, 2: 2 + 14 / 4, 3: 16 / 4}[stage]
        mem, want = tr.memory(), memory_per_rank(sizes, 4, stage, 4, compute=2)
        bad.check(np.testing.assert_equal, mem["params"] + mem["grads"] + mem["optimizer"],
                  per_param * n_pad, err_msg=f"stage {stage} total")
        for k in ("params", "grads", "optimizer"):
            bad.check(np.testing.assert_equal, mem[k], want[k], err_msg=f"stage {stage} {k}")
    bad.assert_none()


def ledger_of(cfg, steps: int = 2) -> dict:
    tr = Trainer(cfg, dataset=data(16))
    tr.grid.ledger.reset()
    for _ in range(steps):
        tr.step()
    return {k: v for k, v in tr.grid.ledger.entries.items() if k[0] not in ("metric",
                                                                          "allgather_obj")}


@pytest.mark.parallel(nprocs=4)
@collective
def test_every_collective_and_message_moves_half_the_bytes():
    """pp2 x dp2 with ZeRO-2 and micro-batches, then tp2 x dp2 with ZeRO-1: bf16 moves half
    of fp32's bytes in every entry of the ledger (the ZeRO formula with 2-byte elements);
    on tp the cross-entropy's three (N,) all-reduces stay fp32 (they run inside autocast)."""
    bad = Mismatches()
    kw = dict(pp=2, dp=2, zero=2, microbatches=2, batch_size=4, dtype="float32")
    fp32, bf16 = ledger_of(config(**kw)), ledger_of(config(**kw, mixed_precision="bf16"))
    bad.check(np.testing.assert_equal, sorted(bf16), sorted(fp32))
    for key, (nb, _) in fp32.items():
        bad.check(np.testing.assert_equal, 2 * bf16[key][0], nb, err_msg=str(key))
    tr = Trainer(config(**kw, mixed_precision="bf16"), dataset=data(16))  # the ZeRO formula
    sizes = unit_sizes(tr.mcfg, blocks=[b for c in tr.runner.stage.chunks.values() for b in c],
                       first=tr.runner.first, last=tr.runner.last)
    want = comm_per_step(sizes, 2, 2, 2, 2, tr.runner.first, tr.runner.last)
    for op in ("reduce_scatter", "allgather"):
        bad.check(np.testing.assert_equal, bf16.get((op, "dp"), [0])[0], 2 * want[op],
                  err_msg=op)
    kw = dict(tp=2, dp=2, zero=1, batch_size=4, dtype="float32")
    fp32, bf16 = ledger_of(config(**kw)), ledger_of(config(**kw, mixed_precision="bf16"))
    m, b, s = tr.mcfg, 2, 8
    ce = 3 * b * s  # elements of the cross-entropy's all-reduces per step, fp32 in both
    for key, (nb, _) in fp32.items():
        extra = 2 * ce * 4 if key == ("allreduce", "tp") else 0  # 2 steps, 4 bytes
        bad.check(np.testing.assert_equal, 2 * (bf16[key][0] - extra), nb - extra,
                  err_msg=str(key))
    want = comm_bytes_per_step(b, s, m.n_embd, m.n_layer, False, 2)["allreduce"] + ce * 2
    bad.check(np.testing.assert_equal, bf16[("allreduce", "tp")][0], 2 * want, err_msg="tp")
    bad.assert_none()


def inject_inf_at(step: int, rank: int):
    """Sharder.finish that, on world rank ``rank`` at ``step``, makes one gradient element
    inf after the reductions: only that rank sees it, so skipping needs a global agreement."""
    finish, calls = Sharder.finish, {"n": 0}

    def patched(self):
        finish(self)
        if calls["n"] == step and MPI.COMM_WORLD.rank == rank:
            u = next(iter(self.units))
            self.owned_grad(u)[0] = np.inf
        calls["n"] += 1

    return mock.patch.object(Sharder, "finish", patched)


@pytest.mark.parallel(nprocs=2)
@collective
def test_an_overflow_skips_exactly_that_step_and_halves_the_scale_on_every_rank():
    cfg = config(dp=2, zero=1, batch_size=4, steps=4, dtype="float32", mixed_precision="fp16",
                 loss_scale_window=2)
    tr, bad = Trainer(cfg, dataset=data()), Mismatches()
    recs, weights = [], []
    with inject_inf_at(step=1, rank=1):
        for _ in range(cfg.steps):
            recs.append(tr.step())
            weights.append(tr.runner.full_params())
    scales = [r["loss_scale"] for r in recs]
    bad.check(np.testing.assert_equal, [r["skipped"] for r in recs], [False, True, False, False])
    # 65536 at step 0 (1 good step), halved by step 1's overflow, then 2 good steps: doubled
    bad.check(np.testing.assert_equal, scales + [tr.scaler.scale], [2**16, 2**16, 2**15, 2**15,
                                                                   2**16])
    bad.check(np.testing.assert_equal, tr.opt.t, 3)  # the optimizer skipped one step
    if MPI.COMM_WORLD.rank == 0:
        for k in weights[0]:
            bad.check(np.testing.assert_array_equal, weights[1][k], weights[0][k], err_msg=k)
            assert not np.array_equal(weights[2][k], weights[1][k]) or k.endswith("bias")
    bad.assert_none()


def test_a_scale_too_large_for_fp16_comes_down_until_the_gradients_fit():
    """2^40 overflows fp16 (max 65504) at once: steps are skipped, halving, until it fits."""
    cfg = config(dtype="float32", mixed_precision="fp16", loss_scale_init=2.0**40, steps=40)
    tr = Trainer(cfg, grid=ProcessGrid(MPI.COMM_SELF), dataset=data())
    recs = [tr.step() for _ in range(cfg.steps)]
    skipped = [r["skipped"] for r in recs]
    assert skipped[0] and not skipped[-1] and tr.scaler.scale < 2.0**40
    first_good = skipped.index(False)
    assert all(skipped[:first_good]) and not any(skipped[first_good:])
    assert tr.scaler.scale == 2.0**40 / 2**first_good  # halved once per skipped step
    assert tr.opt.t == cfg.steps - first_good and np.isfinite(recs[-1]["loss"])


def test_mixed_precision_flags_are_checked():
    for bad in (dict(mixed_precision="fp8"), dict(grad_dtype="fp32"), dict(grad_dtype="bf16"),
                dict(mixed_precision="fp16", loss_scale_init=0.0)):
        with pytest.raises(ConfigError):
            check_config(TrainConfig(**bad))
    assert set(COMPUTE) == {"bf16", "fp16"}


@pytest.mark.tutorial
def test_tutorial_01_memory():
    from mpi_helpers import mpiexec

    r = mpiexec(2, ["python", "tutorials/01_memory.py"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: memory per rank equals the formulas" in r.stdout


def test_train_takes_the_flags_and_reports_2_2_12(tmp_path):
    import json

    from mpi_helpers import refmp

    log = tmp_path / "log.jsonl"
    r = refmp(2, ["train", "--dp", "2", "--zero", "1", "--mixed-precision", "fp16", "--steps",
                  "3", "--batch-size", "8", "--no-progress", "--log-json", str(log)])
    assert r.returncode == 0, r.stdout + r.stderr
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert [rec["loss_scale"] for rec in recs[:-1]] == [65536.0] * 3
    N = 101_760  # the addition task's default model
    mem = recs[-1]["memory_per_rank"][0]
    padded = mem["params"] // 2  # elements: the units, each padded to a multiple of dp = 2
    assert mem["grads"] == mem["params"] and N <= padded < N + 2 * 8  # 8 units
    assert mem["optimizer"] == 12 * padded // 2  # ZeRO-1: 12 bytes for my half
    assert recs[-1]["config"]["mixed_precision"] == "fp16"
