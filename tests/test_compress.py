"""Communication compression (refmp.parallel.data.compress), float64.

PowerSGD over dp ranks equals the serial run with the same compressor (dp2, pp2 x dp2 and
dp4 x ep2 with experts, whose units it compresses over edp, against the serial run; dp2 x tp2
against tp2 alone), since its sums are linear in the gradient; full
rank equals the uncompressed run; the sum of the ranks' error shares is what the serial run
keeps. bf16 equals each rank's share rounded to bf16, then summed in bf16. Top-k's
error-feedback identity: what each rank sent plus what it kept is what it produced, and the
result is the sum of what was sent. Every codec's ledger bytes equal refmp.cost.zero's formula.
"""

import math
import re
import shutil
import tempfile
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import Mismatches, collective, mpiexec
from parity import TOL, assert_same_run

from refmp.checkpoint.flags import config_notes
from refmp.config import lr_at
from refmp.cost.memory import estimate_memory, need_bytes
from refmp.cost.model import Layout, predict
from refmp.cost.zero import comm_per_step, compressed_per_step, local_shapes, unit_sizes
from refmp.distributed.comm import Comm
from refmp.distributed.grid import ProcessGrid
from refmp.errors import ConfigError
from refmp.nn import GPTConfig
from refmp.nn.params import param_shapes
from refmp.parallel.data import compress
from refmp.parallel.data.accumulate import dp_rows
from refmp.parallel.data.sharder import Sharder
from refmp.parallel.data.zero import Unit
from refmp.parallel.rules import check_compression
from refmp.runtime.precision import BF16
from refmp.training.datasets import Dataset, get_batch
from refmp.training.optim import clip_grads
from refmp.training.trainer import TrainConfig, Trainer

DS = Dataset(np.random.default_rng(0).integers(0, 11, 200), 11, "random")
ALONE = SimpleNamespace(size=1)  # a group of one: the codec runs, nothing is sent


def tiny(**kw) -> TrainConfig:
    base = dict(n_layer=2, n_head=2, n_embd=16, block_size=4, batch_size=4, steps=3, lr=0.01,
                warmup_steps=1, dtype="float64", seed=3, progress=False, grad_compress="powersgd",
                compress_rank=2)
    return TrainConfig(**{**base, **kw})


def test_powersgd_at_full_rank_is_the_matrix(monkeypatch):
    """R = min(n, m): P^ spans M's columns, so g = P^ P^T M = M (compressed regardless of
    the byte rule); R < min(n, m): g differs from M and g + e = M (error feedback)."""
    monkeypatch.setattr(compress, "compresses", lambda shape, rank: len(shape) >= 2)
    unit = Unit("u", {"w": (6, 4), "b": (4,)}, 1, 0)
    grad = np.random.default_rng(1).standard_normal(28)
    for R in (4, 2):
        flat, codec = grad.copy(), compress.PowerSGD(R, seed=0)
        codec.reduce(unit, flat, ALONE)
        M, g, e = grad[:24].reshape(6, 4), flat[:24].reshape(6, 4), codec.error[("u", "w")]
        np.testing.assert_array_equal(flat[24:], grad[24:])  # the vector is sent whole
        np.testing.assert_allclose(g + e, M, atol=1e-14)
        assert (np.abs(e).max() < 1e-12) == (R == 4)


def test_refusals():
    for kw, message in [(dict(zero=2), "ZeRO-2 reduce-scatters"),
                        (dict(grad_compress="topk", zero=3), "keeps a shard"),
                        (dict(grad_compress="bf16", mixed_precision="bf16"), "--grad-dtype fp32"),
                        (dict(grad_compress="topk", device="gpu"), "runs on the CPU"),
                        (dict(weight_gather="int8", zero=1), "add --zero 3"),
                        (dict(compress_ratio=0.0), "--compress-ratio in")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            check_compression(tiny(**kw))


def test_int8_gathers_alone_still_round():
    """ZeRO-3 on one rank gathers nothing, but --weight-gather int8 is obeyed: the model
    computes on the block-wise int8 weights (within half a scale of the exact ones), and
    nothing enters the ledger."""
    tr = Trainer(tiny(grad_compress="none", zero=3, weight_gather="int8", quant_block=16),
                 grid=ProcessGrid(MPI.COMM_SELF), dataset=DS)
    tr.step()
    sharder = tr.runner.sharder
    rounded = 0.0
    for u in sharder.units:
        got, want = sharder.weights(u), sharder.weights(u, exact=True)
        for k in want:
            err = np.abs(got[k] - want[k]).max()
            assert err <= np.abs(want[k]).max() / 254 * (1 + 1e-6), (u, k)  # half a scale
            rounded = max(rounded, err)
    assert rounded > 0 and tr.grid.ledger.bytes(axis="dp") == 0


def test_plan_prices_the_codecs():
    """On a slow link the dp term shrinks with the bytes: PowerSGD and top-k below bf16
    below the plain sum (the codecs take fp32 gradients, bf16 sends 2 bytes)."""
    from refmp.cost.machines import MACHINES

    mach = MACHINES["dgx-a100"].__class__(**{**vars(MACHINES["dgx-a100"]), "gpus_per_node": 1})
    mcfg = GPTConfig(50257, 1024, 12, 12, 768)
    dp = {c: predict(Layout(dp=8, mixed_precision="none", grad_compress=c), mcfg, 64,
                     mach)["seconds"]["dp"] for c in ("none", "bf16", "powersgd", "topk")}
    assert dp["powersgd"] < dp["bf16"] < dp["none"] and dp["topk"] < dp["bf16"]
    shapes = {"u": {"w": (6, 4), "b": (4,)}}
    assert compressed_per_step(shapes, 2, "powersgd", 2, itemsize=8) == \
        {"allreduce": 8 * (2 * (6 + 4) + 4), "allgather": 0}
    assert compressed_per_step(shapes, 2, "topk", ratio=0.1, itemsize=8)["allgather"] == \
        2 * (3 + 1) * (8 + 4)


def test_the_codec_buffers_in_the_memory_report_and_the_estimate():
    """The run's ``error_feedback`` bytes (after two steps, the codec alone on its group)
    equal refmp.cost.memory's estimate and, stated again here per parameter seen as n_r x m:
    PowerSGD w (n_r m + m R) where R (n_r + m) < n_r m (the error share and Q; Q alone
    without error feedback), top-k w n_r m for every tensor, bf16 nothing; need_bytes adds it."""
    for kw in (dict(), dict(no_error_feedback=True), dict(grad_compress="topk"),
               dict(grad_compress="topk", no_error_feedback=True), dict(grad_compress="bf16"),
               dict(grad_compress="none"),
               dict(dtype="float32", mixed_precision="bf16", grad_dtype="fp32", compress_rank=3)):
        tr = Trainer(tiny(steps=2, **kw), grid=ProcessGrid(MPI.COMM_SELF), dataset=DS)
        tr.step(), tr.step()
        cfg = tr.cfg
        w, ef = 8 if cfg.dtype == "float64" else 4, not cfg.no_error_feedback
        R, want = cfg.compress_rank, 0
        for s in param_shapes(tr.mcfg).values():
            n, m = s[0], math.prod(s[1:])
            if cfg.grad_compress == "powersgd" and len(s) > 1 and R * (n + m) < n * m:
                want += w * (n * m * ef + m * R)
            elif cfg.grad_compress == "topk":
                want += w * n * m * ef
        est = estimate_memory(cfg, tr.mcfg, tr.grid.sizes, tr.grid.coords)
        assert (tr.memory()["error_feedback"], est["error_feedback"]) == (want, want), kw
        assert need_bytes(est) - need_bytes({**est, "error_feedback": 0}) == want


@pytest.mark.parallel(nprocs=2)
@collective
def test_bf16_training_is_each_share_rounded_then_summed():
    """dp2 --grad-compress bf16 for 3 steps against a reference on each rank alone: the same
    rows' gradient share (of the global loss), rounded to bf16, added to the other rank's in
    fp32 and rounded (the bf16 MPI sum), then the same AdamW step: the weights bit for bit."""
    world, bad = MPI.COMM_WORLD, Mismatches()
    cfg = tiny(grad_compress="bf16", dp=2, grad_clip=0.02)  # clipping in every step
    par = Trainer(cfg, dataset=DS)
    ref = Trainer(replace(cfg, grad_compress="none", dp=None), grid=ProcessGrid(MPI.COMM_SELF),
                  dataset=DS)
    run, B, T = ref.runner, cfg.batch_size, ref.T
    for s in range(3):
        rec = par.step()
        x, y = get_batch(DS.tokens, s, B, T, dp_rows(B, 2, world.rank))
        run.zero_grad()
        run.forward_backward(x, y, B * T)  # this rank's share of the global loss's gradient
        run.reduce_grads()  # alone: nothing to sum
        shares = world.allgather({k: g.astype(BF16).astype(np.float32) for k, g in run.grads.items()})
        for k, g in run.grads.items():
            g[...] = (shares[0][k] + shares[1][k]).astype(BF16)
        norm = run.grad_norm()
        clip_grads(run.grads, cfg.grad_clip, norm)
        ref.opt.lr = lr_at(cfg, s)
        ref.opt.step(run.grads)
        run.after_step()
        got, want = par.runner.full_params(), run.full_params()
        if world.rank == 0:
            bad.check(np.testing.assert_allclose, rec["grad_norm"], norm, **TOL)
            for k in want:
                bad.check(np.testing.assert_array_equal, got[k], want[k], err_msg=f"{k} {s}")
        bad.assert_none(world)


@pytest.mark.parallel(nprocs=2)
@collective
def test_a_resumed_compressed_run_is_bitwise_the_uninterrupted_run():
    """Saved after 2 of 4 steps and resumed on the same layout, PowerSGD's Q's and error
    shares and top-k's errors come back from the checkpoint, and --compress-start counts from
    the run's first step: every loss, weight and codec buffer is the uninterrupted run's, bit
    for bit. On another layout (each rank alone) the codec starts afresh, and says so."""
    world, bad = MPI.COMM_WORLD, Mismatches()
    for kw in (dict(), dict(grad_compress="topk", compress_ratio=0.2, zero=1),
               dict(compress_start=3)):
        cfg = tiny(steps=4, **kw)
        whole, first = Trainer(cfg, dataset=DS), Trainer(cfg, dataset=DS)
        losses = [whole.step()["loss"] for _ in range(4)]
        before = [first.step()["loss"] for _ in range(2)]
        d = world.bcast(tempfile.mkdtemp(prefix="refmp-codec-") if world.rank == 0 else None)
        first.save_checkpoint(d)
        second = Trainer(replace(cfg, resume=d), dataset=DS)
        after = [second.step()["loss"] for _ in range(2)]
        bad.check(np.testing.assert_equal, before + after, losses, err_msg=str(kw))
        bad.check(np.testing.assert_equal, config_notes(second.resumed, cfg), [])
        a, b = whole.runner.sharder.state(), second.runner.sharder.state()
        bad.check(np.testing.assert_equal, sorted(b), sorted(a), err_msg=str(kw))
        for k in a:
            bad.check(np.testing.assert_array_equal, b.get(k), a[k], err_msg=f"{k} {kw}")
        want, got = whole.runner.full_params(), second.runner.full_params()
        for k in want or {}:
            bad.check(np.testing.assert_array_equal, got[k], want[k], err_msg=f"{k} {kw}")
        if not kw:  # another layout: the same model, its codec from zero
            alone = Trainer(replace(cfg, dp=None, resume=d), grid=ProcessGrid(MPI.COMM_SELF),
                            dataset=DS)
            bad.check(np.testing.assert_equal, alone.runner.sharder.state(), {})
            bad.check(np.testing.assert_equal, "start afresh" in config_notes(alone.resumed, cfg)[0], True)
        world.barrier()
        if world.rank == 0:
            shutil.rmtree(d, ignore_errors=True)
    bad.assert_none(world)


@pytest.mark.parallel(nprocs=2)
@collective
def test_bf16_is_each_share_rounded_then_summed():
    world = Comm(MPI.COMM_WORLD, "dp")
    rng = np.random.default_rng(world.rank)
    local = {"w": np.zeros((5, 3)), "b": np.zeros(3)}
    for stage in (0, 1, 2):
        world.ledger.reset()
        sharder = Sharder(local, {"u": ["w", "b"]}, {"u": world}, stage,
                          codec=compress.Codec(wire=BF16))
        sharder.zero_grad()
        g = {"w": rng.standard_normal((5, 3)), "b": rng.standard_normal(3)}
        sharder.accumulate("u", g)
        sharder.grad_ready("u", True)
        sharder.finish()
        flat = np.concatenate([g["w"].ravel(), g["b"]])
        shares = MPI.COMM_WORLD.allgather(flat.astype(BF16).astype(np.float32))
        want = (shares[0] + shares[1]).astype(BF16).astype(np.float64)  # (18,): no padding
        unit = sharder.units["u"]
        np.testing.assert_array_equal(sharder.owned_grad("u"), want[unit.lo : unit.hi])
        op = "allreduce" if stage == 0 else "reduce_scatter"
        assert world.ledger.bytes(op, "dp") == 2 * unit.padded


@pytest.mark.parallel(nprocs=2)
@collective
def test_topk_error_feedback_identity():
    """Per rank: sent + kept == produced, exactly, with sent the k largest |produced|; the
    result is the sum of what every rank sent; the ledger is n k (8 + 4) per step."""
    world = Comm(MPI.COMM_WORLD, "dp")
    unit = Unit("u", {"w": (7, 5), "b": (5,)}, 1, 0)
    codec = compress.TopK(0.2)
    rng = np.random.default_rng(world.rank)
    for _ in range(3):  # error feedback: produced = gradient + what was kept before
        grad = rng.standard_normal(40)
        produced = grad + np.concatenate([codec.error[("u", k)].ravel() for k in ("w", "b")]) \
            if codec.error else grad.copy()
        flat = grad.copy()
        codec.reduce(unit, flat, world)
        kept = np.concatenate([codec.error[("u", k)].ravel() for k in ("w", "b")])
        sent = produced - kept
        for lo, hi, k in ((0, 35, 7), (35, 40, 1)):  # k = ceil(0.2 nm) per tensor
            nz = np.flatnonzero(sent[lo:hi])
            assert len(nz) == k and np.abs(sent[lo:hi][nz]).min() >= np.abs(kept[lo:hi]).max()
            np.testing.assert_array_equal(kept[lo:hi][nz], 0)
        np.testing.assert_array_equal(sent + kept, produced)
        np.testing.assert_allclose(flat, sum(MPI.COMM_WORLD.allgather(sent)), rtol=0, atol=1e-15)
    assert world.ledger.bytes("allgather", "dp") == 3 * 2 * 8 * (8 + 4)


@pytest.mark.parallel(nprocs=2)
@collective
def test_powersgd_error_shares_sum_to_the_serial_error():
    """After the sum, sum_i e_i + g = sum_i M_i: each rank kept its share of the error (a
    rank keeping M_i - g, or none, fails); dp2 training, and ZeRO-1 after a plain first step
    (--compress-start 1), equal the serial PowerSGD run."""
    world = Comm(MPI.COMM_WORLD, "dp")
    unit = Unit("u", {"w": (8, 6), "b": (6,)}, 1, 0)
    codec, rng = compress.PowerSGD(2, seed=0), np.random.default_rng(world.rank)
    for _ in range(2):
        grad = rng.standard_normal(54)
        e = codec.error.get(("u", "w"), np.zeros((8, 6))).ravel()
        produced = np.concatenate([grad[:48] + e, grad[48:]])
        flat = grad.copy()
        codec.reduce(unit, flat, world)
        kept = np.concatenate([codec.error[("u", "w")].ravel(), np.zeros(6)])
        total = sum(MPI.COMM_WORLD.allgather(produced)) - sum(MPI.COMM_WORLD.allgather(kept))
        np.testing.assert_allclose(flat, total, rtol=0, atol=1e-12)
    par = assert_same_run(tiny(), DS)
    n_step = compressed_per_step(local_shapes(par.runner.mcfg), 2, "powersgd", 2, itemsize=8)
    assert par.grid.ledger.bytes("allreduce", "dp") == 3 * n_step["allreduce"]
    assert par.memory()["error_feedback"] > 0
    late = assert_same_run(tiny(zero=1, compress_start=1), DS)  # ZeRO-1: one plain step first
    plain = comm_per_step(unit_sizes(late.runner.mcfg), 2, 1, itemsize=8)
    assert late.grid.ledger.bytes("allreduce", "dp") == 2 * n_step["allreduce"]
    assert late.grid.ledger.bytes("reduce_scatter", "dp") == plain["reduce_scatter"]


@pytest.mark.parallel(nprocs=2)
@collective
def test_full_rank_equals_uncompressed_and_the_ledgers():
    """Rank 64: no matrix shrinks, the run is the plain one; each codec's dp bytes per step
    equal the formula (bf16 2 bytes an element; top-k n k (8 + 4); int8 ZeRO-3 gathers)."""
    bad = Mismatches()
    plain, full = Trainer(tiny(grad_compress="none"), dataset=DS), Trainer(tiny(compress_rank=64), dataset=DS)
    for _ in range(3):
        plain.step(), full.step()
    a, b = plain.runner.full_params(), full.runner.full_params()
    if a is not None:
        for k in a:
            bad.check(np.testing.assert_allclose, b[k], a[k], **TOL, err_msg=k)
    mcfg = plain.runner.mcfg
    sizes, shapes = unit_sizes(mcfg), local_shapes(mcfg)
    for kw, op, want in [
            (dict(grad_compress="bf16"), "allreduce", comm_per_step(sizes, 2, 0, itemsize=2)["allreduce"]),
            (dict(grad_compress="topk"), "allgather",
             compressed_per_step(shapes, 2, "topk", ratio=0.01, itemsize=8)["allgather"]),
            (dict(grad_compress="none", zero=3, weight_gather="int8", quant_block=16), "allgather",
             comm_per_step(sizes, 2, 3, itemsize=8, quant_block=16)["allgather"])]:
        tr = Trainer(tiny(steps=2, **kw), dataset=DS)
        tr.step(), tr.step()
        bad.check(np.testing.assert_equal, tr.grid.ledger.bytes(op, "dp"), 2 * want, err_msg=str(kw))
    bad.assert_none(MPI.COMM_WORLD)


@pytest.mark.parallel(nprocs=4)
@collective
def test_powersgd_pp_and_tp_equal_their_serial_runs():
    """pp2 x dp2 and dp4 x ep2 (MoE) equal the serial PowerSGD run (the tied wte compressed
    whole; the experts over edp); dp2 x tp2
    equals tp2 on its own (PowerSGD compresses each tp shard: the serial run in dp)."""
    assert_same_run(tiny(pp=2, dp=2, microbatches=2), DS)
    # expert units over edp = 2, dense ones over dp = 4
    assert_same_run(tiny(ep=2, n_expert=4, top_k=2, capacity_factor=0.0), DS)
    world, bad = MPI.COMM_WORLD, Mismatches()
    sub = world.Split(0 if world.rank < 2 else MPI.UNDEFINED, world.rank)
    ref = Trainer(tiny(tp=2), grid=ProcessGrid(sub, tp=2), dataset=DS) if world.rank < 2 else None
    par = Trainer(tiny(tp=2, dp=2), dataset=DS)
    for s in range(3):
        a, b = ref.step() if ref else None, par.step()
        want, got = ref.runner.full_params() if ref else None, par.runner.full_params()
        if world.rank == 0:
            bad.check(np.testing.assert_allclose, b["loss"], a["loss"], **TOL)
            for k in want:
                bad.check(np.testing.assert_allclose, got[k], want[k], **TOL, err_msg=f"{k} {s}")
        bad.assert_none(world)


@pytest.mark.tutorial
def test_tutorial_runs():
    r = mpiexec(2, ["python", "tutorials/10_compression.py"], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all checks passed" in r.stdout
