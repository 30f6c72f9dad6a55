"""FP8 training, emulated (refmp.runtime.fp8, refmp.parallel.fp8): the numbers, and every
layout against the serial FP8 run.

The serial run a layout is held to is the same FP8 recipe on one rank, in float64. Scales
are powers of two, so dequantized operands are exact and the only differences left are the
float64 sums' order: the parity tolerance of tests/parity.py. What must agree is the scale:
a tensor split over tp (or cp) is scaled by the amax of the whole (all-reduced), MXFP8 by
blocks that never cross a shard's edge. Current scaling sees one micro-batch, so dp ranks of
M micro-batches are compared with the serial run of dp M micro-batches; delayed scaling's
history holds the whole global batch's amaxes (reduced over dp), so after its first step it
does not depend on the micro-batches at all.
"""

import shutil
import tempfile
from dataclasses import fields, replace

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import Mismatches
from parity import SERIAL_ONLY, TOL, compare_step, gathered
from test_engine import config, data

from refmp.cost.fp8 import amax_bytes_per_step, cached_linear_input_bytes
from refmp.cost.memory import estimate_memory, stage_memory
from refmp.cost.tensor import comm_bytes_per_step
from refmp.cost.zero import comm_per_step, unit_sizes
from refmp.distributed.grid import ProcessGrid
from refmp.errors import ConfigError
from refmp.nn import gpt
from refmp.nn.params import GPTConfig
from refmp.parallel import fp8 as P
from refmp.parallel.rules import check_layout
from refmp.runtime import fp8 as F
from refmp.runtime.arrays import activation_bytes
from refmp.training.trainer import TrainConfig, Trainer

# --- the numbers ------------------------------------------------------------------------------


def test_scales_are_powers_of_two_that_fit_the_amax():
    a = np.array([448.0, 449.0, 224.0, 1.0, 3e-5, 0.0])
    e = F.scale_exponent(a, F.E4M3).astype(np.int64)
    assert list(e) == [0, -1, 1, 8, 23, 0]
    scaled = a * 2.0 ** e
    assert np.all(scaled <= 448) and np.all((scaled > 224) | (a == 0))


def test_dequantized_values_are_exact_and_requantizing_them_changes_nothing():
    x = np.random.default_rng(0).standard_normal((6, 40)) * 3
    for fmt in (F.E4M3, F.E5M2):
        z = F.quantize_tensor(x, fmt)
        np.testing.assert_array_equal(F.dequantize(z), z.q.astype(np.float64) / 2.0 ** int(z.exp))
        assert np.abs(F.dequantize(z) - x).max() <= np.abs(x).max() * 2.0**-3
        for zz in (z, F.quantize_blocks(x, fmt, 1), F.quantize_blocks(x, fmt, 0)):
            xh = F.dequantize(zz)
            assert xh.shape == x.shape and xh.dtype == x.dtype
            again = F.quantize_tensor(xh, fmt) if zz.axis is None else F.quantize_blocks(xh, fmt, zz.axis)
            np.testing.assert_array_equal(F.dequantize(again), xh)


def test_a_scale_from_a_shard_is_not_the_whole_tensors():
    """What the layouts must avoid: a shard scaled by its own amax rounds differently from the
    serial run's slice; by the whole tensor's amax (what tp's all-reduce gives), identically.
    MXFP8 blocks that start at the shard's edge need nothing. (With power-of-two scales a
    normal number's rounding does not depend on the scale: the two differ where one scale
    puts values into the subnormals, as here, where the whole's amax is far larger.)"""
    x = np.random.default_rng(1).standard_normal((4, 64))
    x[:, :32] *= 1000  # the left half holds the amax
    whole = F.dequantize(F.quantize_tensor(x, F.E4M3))[:, 32:]
    own = F.dequantize(F.quantize_tensor(x[:, 32:], F.E4M3))
    shared = F.dequantize(F.quantize_tensor(x[:, 32:], F.E4M3, F.amax(x)))
    assert not np.array_equal(own, whole)
    np.testing.assert_array_equal(shared, whole)
    blocks = F.dequantize(F.quantize_blocks(x, F.E4M3, 1))
    np.testing.assert_array_equal(F.dequantize(F.quantize_blocks(x[:, 32:], F.E4M3, 1)), blocks[:, 32:])
    assert not np.array_equal(F.dequantize(F.quantize_blocks(x[:, 16:48], F.E4M3, 1)), blocks[:, 16:48])


def test_the_cache_keeps_fp8_and_the_formula_says_how_much():
    x, w = np.ones((4, 8, 32)), np.ones((32, 96))
    for recipe in ("tensor", "mxfp8"):
        ops = P.FP8Ops(gpt.Ops(2), recipe, ProcessGrid(MPI.COMM_SELF).comm["tp"])
        _, cache = ops.column(x, w, None)
        cx, cw, _ = cache.inner  # the wrapped linear's (x, w, has_bias), in FP8
        assert cx.q.dtype == F.E4M3 and cw.q.dtype == F.E4M3
        assert activation_bytes(cx) == cached_linear_input_bytes(x.size, 8, recipe)
    assert cached_linear_input_bytes(x.size, 8, "none") == x.nbytes


@pytest.mark.parametrize("kw", [dict(fp8="tensor"), dict(fp8="mxfp8", n_embd=48),
                                dict(fp8="delayed", microbatches=2, zero=3)])
def test_the_memory_estimate_holds_the_fp8_caches(kw):
    """The activations' peak of an FP8 run, measured, equals estimate_memory's (the X and W
    each linear keeps in FP8 instead of X in float64), and is below the run without FP8."""
    cfg = config(**{"n_embd": 32, "n_head": 2, "steps": 1, **kw})
    peaks = []
    for c in (cfg, replace(cfg, fp8="none")):
        tr = Trainer(c, grid=ProcessGrid(MPI.COMM_SELF), dataset=data())
        tr.step()
        est = estimate_memory(c, tr.mcfg, tr.grid.sizes, tr.grid.coords)["activations"]
        assert tr.runner.memory()["activations"] == est
        peaks.append(est)
    assert peaks[0] < peaks[1]


def test_fp8_over_bf16_mixed_precision():
    """With --mixed-precision bf16 the FP8 values dequantize into the bf16 compute copy
    exactly; the planner's stage_memory (which rescales the estimate to 2-byte caches) equals
    the measured peak."""
    cfg = config(fp8="tensor", n_embd=32, n_head=2, steps=1, dtype="float32", mixed_precision="bf16")
    tr = Trainer(cfg, grid=ProcessGrid(MPI.COMM_SELF), dataset=data())
    assert np.isfinite(tr.step()["loss"])
    assert tr.runner.memory()["activations"] == stage_memory(cfg, tr.mcfg, tr.grid.sizes, 0)["activations"]


@pytest.mark.parametrize("kw", [dict(), dict(n_expert=4, moe_every=2)])
def test_one_forward_runs_every_site_once(kw):
    """Delayed scaling keys its history by a linear's place in the rank's forward: a forward
    runs n_sites linears (4 a dense block, 2 an MoE block: its experts stay unrounded)."""
    cfg = config(**{"fp8": "delayed", "n_embd": 32, "n_head": 2, "steps": 1, "n_layer": 2, **kw})
    tr = Trainer(cfg, grid=ProcessGrid(MPI.COMM_SELF), dataset=data())
    tr.step()
    fp8 = tr.runner.fp8
    assert fp8.n_sites == (6 if kw else 8) and fp8.calls == fp8.n_sites
    assert (fp8.scales.past[0] > 0).all()  # every site and role recorded an amax


def test_the_amax_formula():
    assert amax_bytes_per_step("tensor", 2, 3, False, 2) == {"tp": 8 * 8 * 2 * 3, "cp": 0, "dense": 0}
    assert amax_bytes_per_step("mxfp8", 2, 3, True, 2, 2, 4) == {"tp": 0, "cp": 0, "dense": 0}
    later = amax_bytes_per_step("delayed", 2, 3, True, 2, 1, 2, first_step=False)
    assert later == {"tp": 8 * 24, "cp": 0, "dense": 8 * 24}
    # an MoE block: attention's two linears, half a dense block's amaxes
    assert amax_bytes_per_step("tensor", 1, 2, False, 2, 2, 2, n_moe=1) == {"tp": 192, "cp": 192,
                                                                              "dense": 0}


@pytest.mark.parametrize("lay,moe", [(dict(tp=2, dp=4), 0), (dict(pp=2, dp=4, zero=1), 0),
                                     (dict(tp=2, cp=2, dp=2, sequence_parallel=True), 0),
                                     (dict(tp=2, dp=4), 2)])
def test_the_planner_moves_and_times_the_amaxes(lay, moe):
    """refmp.cost.model.predict (what refmp plan and the explorer show) adds a step's amax
    all-reduces after the first (the formula the ledger is held to above) to each axis,
    and their time: one call an amax for current scaling, one a group for delayed."""
    from refmp.cost.machines import MACHINES
    from refmp.cost.model import Layout, predict, split

    mcfg = GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=128, block_size=32, n_expert=4 * bool(moe),
                     moe_every=moe or 1)
    lay = Layout(**lay, microbatch_size=2)
    M = 32 // (lay.dp * 2)
    base = predict(lay, mcfg, 32, MACHINES["dgx-a100"])
    for recipe in ("tensor", "delayed", "mxfp8"):
        got = predict(replace(lay, fp8=recipe), mcfg, 32, MACHINES["dgx-a100"])
        for r, (a, b) in enumerate(zip(base["bytes"], got["bytes"], strict=True)):
            blocks = split(mcfg, lay.pp)[r]
            n_moe = sum(mcfg.is_moe(i) for i in blocks)
            want = amax_bytes_per_step(recipe, len(blocks) - n_moe, M, lay.sequence_parallel, lay.tp,
                                       lay.cp, lay.dp * lay.cp, first_step=False, n_moe=n_moe)
            for axis, k in (("tp", "tp"), ("cp", "cp"), ("dp", "dense")):
                moved = b[axis].get("allreduce", 0) - a[axis].get("allreduce", 0)
                assert moved == want[k], (recipe, r, axis)
        slower = got["seconds"]["tp"] > base["seconds"]["tp"]
        assert slower == (recipe != "mxfp8" and lay.tp > 1), recipe


@pytest.mark.parametrize("kw,message", [
    (dict(fp8="delayed", pp=2, schedule="interleaved", virtual_stages=2, microbatches=2, n_layer=4),
     "one model chunk per rank: --schedule interleaved runs 2"),
    (dict(fp8="delayed", recompute="full"), "--recompute full runs each block's forward again"),
    (dict(fp8="tensor", device="gpu"), "emulated on the CPU"),
    (dict(fp8="mxfp8", tp=2), "C/tp = 8 channels"),
    (dict(weight_gather="fp8", zero=2), "--weight-gather fp8 quantizes ZeRO-3's all-gathers"),
])
def test_bad_combinations_are_refused(kw, message):
    cfg = config(**kw)
    with pytest.raises(ConfigError, match=message):
        check_layout(cfg, GPTConfig(n_layer=cfg.n_layer, n_head=4, n_embd=16, block_size=8,
                                    vocab_size=17), cfg.pp * cfg.tp)


# --- every layout against the serial FP8 run ---------------------------------------------------


def serial_of(cfg: TrainConfig, microbatches: int) -> TrainConfig:
    """The serial run: one rank, ``microbatches``; ZeRO-3 kept where the weights are gathered
    in FP8 (one rank gathers nothing, but the codec still rounds: its serial run)."""
    defaults = {f.name: f.default for f in fields(TrainConfig) if f.name in SERIAL_ONLY}
    zero = 3 if cfg.weight_gather != "none" else 0
    return replace(cfg, **{**defaults, "microbatches": microbatches, "zero": zero})


def run_against_serial(cfg: TrainConfig, serial_mb: int, check=None) -> Trainer:
    """Like parity.assert_same_run, the serial run with ``serial_mb`` micro-batches."""
    world, ds = MPI.COMM_WORLD, data()
    serial = Trainer(serial_of(cfg, serial_mb), grid=ProcessGrid(MPI.COMM_SELF), dataset=ds) \
        if world.rank == 0 else None
    par = Trainer(cfg, dataset=ds)
    bad = Mismatches()
    for s in range(cfg.steps):
        a = serial.step() if serial is not None else None
        b = par.step()
        if check is not None:
            bad.check(check, par, s)
        grads, params = gathered(par)
        if a is not None:
            compare_step(bad, a, b, serial, grads, params, TOL, s)
        bad.assert_none(world)
        par.grid.ledger.reset()
    return par


LAYOUTS = [  # (layout, the serial run's micro-batches)
    (dict(fp8="tensor", tp=2, cp=2, sequence_parallel=True), 1),
    (dict(fp8="delayed", tp=2, dp=2, zero=3), 2),
    (dict(fp8="delayed", pp=2, dp=2, zero=1, microbatches=2), 4),
    (dict(fp8="mxfp8", tp=2, dp=2, zero=2, n_embd=64), 2),
    # every unit's shard a multiple of 32 elements: the FP8 gather's blocks are the serial's
    (dict(fp8="tensor", pp=2, dp=2, zero=3, weight_gather="fp8", microbatches=2, n_embd=64), 4),
]


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("layout,serial_mb", LAYOUTS)
def test_layout_equals_the_serial_fp8_run(layout, serial_mb):
    cfg = config(**{"n_embd": 32, "n_head": 2, "batch_size": 4, "steps": 2, **layout})

    def amaxes(par, s):  # the amax all-reduces, byte for byte (Megatron's on one stage)
        g, led = par.grid, par.grid.ledger
        L = len([i for blocks in par.runner.stage.chunks.values() for i in blocks])
        want = amax_bytes_per_step(cfg.fp8, L, cfg.microbatches, cfg.sequence_parallel,
                                   g.sizes["tp"], g.sizes["cp"], g.sizes["dp"] * g.sizes["cp"], s == 0)
        if g.sizes["tp"] > 1 and not cfg.sequence_parallel and g.sizes["pp"] == 1:
            b = cfg.batch_size // g.sizes["dp"]
            megatron = comm_bytes_per_step(b, cfg.block_size // g.sizes["cp"], cfg.n_embd, L, False, 8)
            assert led.bytes("allreduce", "tp") == megatron["allreduce"] + want["tp"]
        if cfg.weight_gather == "fp8":  # 1 byte a parameter and 1 a block of 32
            r = par.runner
            sizes = unit_sizes(r.mcfg, 1, [i for b in r.stage.chunks.values() for i in b], r.first, r.last)
            zero3 = comm_per_step(sizes, 2, 3, cfg.microbatches, 8, r.first, r.last, quant_block=32,
                                  scale_bytes=1)
            assert led.bytes("allgather", "dp") == zero3["allgather"]
        if not cfg.sequence_parallel and g.sizes["cp"] == 1:  # the FP8 caches' peak, to the byte
            est = estimate_memory(cfg, par.runner.mcfg, g.sizes, g.coords)["activations"]
            assert par.runner.memory()["activations"] == est
        dense = g.group("dp", "cp")
        if dense.size > 1 and cfg.fp8 == "delayed" and cfg.zero > 0:  # (ZeRO sums by reduce-scatter)
            assert led.bytes("allreduce", dense.axis) == want["dense"]

    run_against_serial(cfg, serial_mb, check=amaxes)


def tp_linears(recipe: str, grid) -> list:
    """A column-parallel then a row-parallel FP8 linear over tp, forward and backward, on
    inputs whose halves differ by 2^10 (one shard's amax far below the whole's): the FP8
    copies each keeps and the whole results, beside the serial FP8Ops' (rank 0 of tp's)."""
    from refmp.parallel.ops import make_ops
    rng = np.random.default_rng(5)
    B, T, C = 2, 4, 64
    x = rng.standard_normal((B, T, C))
    w1, w2 = rng.standard_normal((C, 2 * C)), rng.standard_normal((2 * C, C))
    w1[:, C:] *= 2.0**-10  # tp rank 1's columns
    w2[C:] *= 2.0**-10  # and rows
    dout = rng.standard_normal((B, T, C))
    tp = grid.comm["tp"]
    r, n = tp.rank, tp.size
    out = []
    mine = np.ascontiguousarray(np.split(w1, n, axis=1)[r]), np.ascontiguousarray(np.split(w2, n)[r])
    for ops, a1, a2 in ((P.FP8Ops(gpt.Ops(2), recipe, ProcessGrid(MPI.COMM_SELF).comm["tp"]), w1, w2),
                        (P.FP8Ops(make_ops(2, 16, tp), recipe, tp), *mine)):
        h, c1 = ops.column(x, a1, None)
        y, c2 = ops.row(h, a2, np.zeros(C))
        dh, dw2, _ = ops.linear_backward(dout, c2)
        dx, dw1, _ = ops.linear_backward(dh, c1)
        q = [F.dequantize((c.inner[1] if isinstance(c.inner[0], str) else c.inner)[1])
             for c in (c1, c2)]  # the weights' FP8 values q / s (ParallelOps' caches: (kind, cache))
        out.append(dict(y=y, dx=dx, dw1=dw1, dw2=dw2, q1=q[0], q2=q[1]))
    serial, mine = out
    return [(k, mine[k], serial[k] if k in ("y", "dx") else
             np.split(serial[k], n, axis=1 if k in ("dw1", "q1") else 0)[r]) for k in mine]


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("recipe", ["tensor", "mxfp8"])
def test_tp_linears_quantize_as_the_whole_tensor(recipe, monkeypatch):
    """The weights' FP8 values on each tp rank are the serial ones' slice, bitwise, and the
    results equal to rounding; with each shard scaled by its own amax (no all-reduce: the
    planted bug) they are not. MXFP8 needs no all-reduce (C/tp = 32)."""
    grid = ProcessGrid(MPI.COMM_WORLD, tp=2)
    bad = Mismatches()
    for k, got, want in tp_linears(recipe, grid):
        if k.startswith("q"):
            bad.check(np.testing.assert_array_equal, got, want, err_msg=k)
        else:
            bad.check(np.testing.assert_allclose, got, want, **TOL, err_msg=k)
    bad.assert_none(MPI.COMM_WORLD)
    if recipe == "tensor":
        monkeypatch.setattr(P, "SPLIT", {"column": (False,) * 3, "row": (False,) * 3})
        differ = [k for k, got, want in tp_linears(recipe, grid) if not np.allclose(got, want, **TOL)]
        assert all(MPI.COMM_WORLD.allgather(bool(differ)))


@pytest.mark.parallel(nprocs=4)
def test_the_amax_history_resumes_into_another_layout():
    """Delayed scaling saved after 2 of 4 steps on pp 2 x dp 2 and resumed on tp 2 x dp 2:
    the history read back is the saved one, block by block, bitwise (every rank of a stage
    holds the same, reduced over tp and dp x cp), and the resumed run's losses and history
    are the serial uninterrupted run's to float64 rounding."""
    world, ds, bad = MPI.COMM_WORLD, data(), Mismatches()
    cfg = config(n_embd=32, n_head=2, batch_size=4, steps=4, fp8="delayed", microbatches=2)
    serial = Trainer(serial_of(cfg, 4), grid=ProcessGrid(MPI.COMM_SELF), dataset=ds) \
        if world.rank == 0 else None
    losses = [serial.step()["loss"] for _ in range(4)] if serial is not None else None
    first = Trainer(replace(cfg, pp=2, dp=2), dataset=ds)
    before = [first.step()["loss"] for _ in range(2)]
    d = world.bcast(tempfile.mkdtemp(prefix="refmp-fp8-") if world.rank == 0 else None)
    first.save_checkpoint(d)
    saved = {k: v for s in world.allgather(first.runner.fp8.state()["amax"]) for k, v in s.items()}
    second = Trainer(replace(cfg, tp=2, dp=2, resume=d), dataset=ds)
    got = second.runner.fp8.state()
    bad.check(np.testing.assert_equal, got["steps"], 2)
    for k, v in got["amax"].items():
        bad.check(np.testing.assert_array_equal, v, saved[k], err_msg=f"{k} read back")
    after = [second.step()["loss"] for _ in range(2)]
    if serial is not None:
        bad.check(np.testing.assert_allclose, before + after, losses, **TOL, err_msg="losses")
        want = serial.runner.fp8.state()
        for k, v in second.runner.fp8.state()["amax"].items():
            bad.check(np.testing.assert_allclose, v, want["amax"][k], **TOL, err_msg=f"{k} after")
        shutil.rmtree(d)
    bad.assert_none(world)
