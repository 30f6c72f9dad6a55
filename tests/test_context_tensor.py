"""Context parallelism x tensor parallelism (cp=2 x tp=2 on 4 ranks) equals the serial model.

A TP block with the CP attention against the serial block, whole AdamW runs with clipping
against the serial run (shard by shard, and gathered), the ledger against the formula of
refmp/parallel/context_tensor.py, and the command line: --save, evaluation, bad input.
"""

import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_helpers import Mismatches, collective, refmp
from safetensors.numpy import load_file

from refmp.data import Dataset
from refmp.grid import ProcessGrid
from refmp.nn import gpt
from refmp.parallel import tensor as tpl
from refmp.parallel.context import ChunkLayout
from refmp.parallel.context_ring import RingAttention
from refmp.parallel.context_ulysses import UlyssesAttention
from refmp.parallel.tensor_runner import shard
from refmp.train import TrainConfig, Trainer

TOL = dict(rtol=1e-9, atol=1e-12)
close = np.testing.assert_allclose
NO_SHRINK = (Phase.explicit, Phase.generate)
LAYOUTS = [("ring", "zigzag"), ("ring", "contiguous"), ("ulysses", "zigzag")]


def free(*trainers):
    for tr in trainers:
        for c in tr.grid.comm.values():
            c.mpi.Free()


@pytest.mark.mpi
@pytest.mark.parallel(nprocs=4)
@settings(max_examples=4, phases=NO_SHRINK)
@given(layout=st.sampled_from(LAYOUTS), hs=st.integers(1, 2), B=st.integers(1, 2),
       c=st.integers(1, 2), seed=st.integers(0, 999))
@collective
def test_tp_block_with_cp_attention_equals_serial_block(layout, hs, B, c, seed):
    algo, balance = layout
    grid = ProcessGrid(MPI.COMM_WORLD, cp=2, tp=2)
    tp, cp = grid.comm["tp"], grid.comm["cp"]
    NH, T = 4, (4 if balance == "zigzag" else 2) * c  # 2cp or cp chunks of c tokens
    C, cpl = NH * hs, ChunkLayout(T, 2, balance)
    rng = np.random.default_rng(seed)
    p = {k: rng.standard_normal(s) * 0.3 for k, s in gpt.block_param_shapes(
        gpt.GPTConfig(n_head=NH, n_embd=C)).items()}
    x, dout = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, C))
    y_ref, cache = gpt.block_forward(p, x, NH)
    dx_ref, g_ref = gpt.block_backward(dout, cache)

    mine = cpl.positions(cp.rank)
    attn = (RingAttention if algo == "ring" else UlyssesAttention)(cp, cpl)
    p_tp = {k: shard(f"h.0.{k}", v, tp.rank, tp.size, 0) for k, v in p.items()}
    y, cache = tpl.block_forward(p_tp, x[:, mine], NH, tp, attention=(attn.forward, attn.backward))
    dx, g = tpl.block_backward(dout[:, mine], cache, tp)
    g = {k: cp.allreduce(np.ascontiguousarray(v)) for k, v in sorted(g.items())}  # over cp

    bad = Mismatches()
    bad.check(close, y, y_ref[:, mine], **TOL, err_msg="block output")
    bad.check(close, dx, dx_ref[:, mine], **TOL, err_msg="block dx")
    for k, v in g_ref.items():
        bad.check(close, g[k], shard(f"h.0.{k}", v, tp.rank, tp.size, 0), **TOL, err_msg=k)
    for comm in grid.comm.values():
        comm.mpi.Free()
    bad.assert_none()


def assert_ledger(tr: Trainer, cfg: TrainConfig) -> None:
    """Bytes (and calls) per step equal the formula of refmp/parallel/context_tensor.py."""
    led, w, L_, M = tr.grid.ledger, 8, cfg.n_layer, cfg.microbatches
    cp, tp = tr.grid.cp, tr.grid.tp
    b, Tl, C = cfg.batch_size // tr.grid.dp, tr.T // cp, cfg.n_embd
    n_local = sum(int(v.size) for v in tr.runner.params.values())
    want = {("allreduce", "tp"): ((4 * L_ + 2) * b * Tl * C * w + 3 * b * Tl * w, (4 * L_ + 5) * M),
            ("allreduce", "cp"): (n_local * w, 1),
            ("allreduce", "dp"): ((n_local * w, 1) if tr.grid.dp > 1 else (0, 0))}
    if cfg.cp_algo == "ring":
        want["send", "cp"] = (L_ * 3 * (cp - 1) * 2 * b * Tl * (C // tp) * w, L_ * 3 * (cp - 1) * M)
    else:
        want["alltoall", "cp"] = (L_ * 2 * b * Tl * 4 * (C // tp) * w, 4 * L_ * M)
    got = {k: (led.bytes(*k) // cfg.steps, led.count(*k) // cfg.steps) for k in want}
    assert got == want, (got, want)


def assert_same_run(cfg: TrainConfig) -> Trainer:
    """cfg.steps steps, serial (COMM_SELF) and cp x tp x dp (COMM_WORLD), shard by shard."""
    ds = Dataset(np.random.default_rng(0).integers(0, 7, 200), 7, "random")  # vocab 7: pad 8
    serial = Trainer(TrainConfig(**{**cfg.__dict__, "cp": 1, "tp": 1, "microbatches": 1}),
                     grid=ProcessGrid(MPI.COMM_SELF), dataset=ds)
    par = Trainer(cfg, dataset=ds)
    tp, Vp = par.grid.comm["tp"], par.runner.V_pad
    par.grid.ledger.reset()
    bad = Mismatches()
    for s in range(cfg.steps):
        a, b = serial.step(), par.step()
        bad.check(close, b["loss"], a["loss"], **TOL, err_msg=f"loss at step {s}")
        bad.check(close, b["grad_norm"], a["grad_norm"], **TOL, err_msg=f"norm at step {s}")
        for k, v in serial.model.params.items():
            want_g = shard(k, serial.model.grads[k], tp.rank, tp.size, Vp)
            bad.check(close, par.runner.grads[k], want_g, **TOL, err_msg=f"grad {k} step {s}")
            want_w = shard(k, v, tp.rank, tp.size, Vp)
            bad.check(close, par.runner.params[k], want_w, **TOL, err_msg=f"weight {k} step {s}")
    bad.check(assert_ledger, par, cfg)
    full = par.runner.full_params()  # collective over tp; world rank 0 gets the full model
    if full is not None:
        for k, v in serial.model.params.items():
            bad.check(close, full[k], v, **TOL, err_msg=f"gathered {k}")
    free(par)
    bad.assert_none()
    return par


def small_cfg(**kw) -> TrainConfig:
    base = dict(n_layer=2, n_head=4, n_embd=8, block_size=8, batch_size=2, steps=3, lr=0.02,
                warmup_steps=1, grad_clip=0.05, dtype="float64", seed=3, progress=False, cp=2,
                tp=2)
    return TrainConfig(**{**base, **kw})


@pytest.mark.mpi
@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("algo,balance,M", [(*LAYOUTS[0], 1), (*LAYOUTS[1], 2), (*LAYOUTS[2], 1)])
@collective
def test_cp_tp_training_equals_serial(algo, balance, M):
    """cp=2 x tp=2: 3 AdamW steps with clipping that bites (grad_clip 0.05)."""
    assert_same_run(small_cfg(cp_algo=algo, cp_balance=balance, microbatches=M))


@pytest.mark.mpi
@pytest.mark.parallel(nprocs=8)
@collective
def test_cp_tp_dp_training_equals_serial():
    """cp=2 x tp=2 x dp=2 (8 ranks, oversubscribed): the same, gradients also summed over dp."""
    assert assert_same_run(small_cfg(cp_algo="ring", batch_size=4)).grid.dp == 2


# --- the command line ------------------------------------------------------------------------

SMALL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "8", "--batch-size", "4", "--steps", "3",
         "--no-progress", "--dtype", "float64", "--grad-clip", "0.1"]


@pytest.mark.cli
def test_cp_tp_train_save_and_evaluate(tmp_path):
    """The issue's command line: 4 ranks, cp=2 x tp=2, --digits 4 (block 16), evaluation."""
    out = tmp_path / "m.safetensors"
    r = refmp(4, ["train", "--cp", "2", "--tp", "2", "--block-size", "16", "--digits", "4",
                  *SMALL, "--save", str(out)], timeout=150)
    assert r.returncode == 0, r.stderr
    assert "held-out exact match" in r.stdout and "cp=2 x tp=2" in r.stdout
    assert "send@cp" in r.stdout and "allreduce@tp" in r.stdout
    cfg = TrainConfig(n_layer=1, n_head=2, n_embd=8, batch_size=4, steps=3, dtype="float64",
                      grad_clip=0.1, block_size=16, digits=4, progress=False)
    tr = Trainer(cfg, grid=ProcessGrid(MPI.COMM_SELF))
    for _ in range(3):
        tr.step()
    saved = load_file(str(out))
    assert set(saved) == set(tr.model.params)
    for k, v in tr.model.params.items():  # full, unpadded (vocab 13 on tp 2), GPT-2 names
        assert saved[k].shape == v.shape, k
        close(saved[k], v, **TOL, err_msg=k)


@pytest.mark.cli
@pytest.mark.parametrize("args,message", [
    (["--cp-algo", "ulysses"], "each tp rank holds n_head/tp = 1 heads, which must be divisible"),
    (["--sequence-parallel"], "--sequence-parallel with --cp: not implemented"),
    (["--block-size", "6"], "block size 6 is not divisible by 4"),
    (["--n-head", "3", "--n-embd", "6"], "--tp 2 must divide the number of heads"),
])
def test_cp_tp_bad_input_fails_cleanly(args, message):
    r = refmp(4, ["train", "--cp", "2", "--tp", "2", "--block-size", "8", *SMALL, *args],
              timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count(message) == 1, r.stderr  # every rank refused; rank 0 says it once
    assert "Traceback" not in r.stderr
