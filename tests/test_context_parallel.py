"""Context parallelism under real MPI: the attention layer and whole training runs equal the
serial model (float64), the ledger equals the analytic byte counts, bad input is refused.

Every rank computes the serial reference itself (on the full sequence) and compares it with
its own tokens' share of the parallel result.
"""

import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_helpers import Mismatches, collective, mpiexec, refmp

from refmp.comm import Comm, Ledger
from refmp.data import AdditionTask, Dataset
from refmp.grid import ProcessGrid
from refmp.nn import layers as L
from refmp.parallel.context import ChunkLayout, nbytes_of, ring_attention_flops
from refmp.parallel.context_ring import RingAttention
from refmp.parallel.context_ulysses import UlyssesAttention
from refmp.train import TrainConfig, Trainer

pytestmark = pytest.mark.mpi

TOL = dict(rtol=1e-9, atol=1e-12)
ALGO = st.sampled_from(["ring", "ulysses"])
BALANCE = st.sampled_from(["zigzag", "contiguous"])
NO_SHRINK = (Phase.explicit, Phase.generate)  # under MPI, shrinking a failure takes minutes


def n_chunks(cp: int, balance: str) -> int:
    return 2 * cp if balance == "zigzag" else cp


@pytest.mark.parallel(nprocs=[2, 4])
@collective
def test_alltoall_sends_block_j_to_rank_j():
    comm = Comm(MPI.COMM_WORLD, "cp", Ledger())
    n, r = comm.size, comm.rank
    buf = (10 * r + np.arange(n, dtype=np.float64))[:, None] * np.ones((1, 3))  # (n, 3)
    out = comm.alltoall(buf)
    np.testing.assert_array_equal(out[:, 0], 10 * np.arange(n) + r)  # out[j] = rank j's buf[r]
    assert comm.ledger.bytes("alltoall", "cp") == buf.nbytes and comm.ledger.count() == 1


# --- the attention layer ---------------------------------------------------------------------


@pytest.mark.parallel(nprocs=[2, 4])
@settings(max_examples=8, phases=NO_SHRINK)
@given(algo=ALGO, balance=BALANCE, heads_per=st.integers(1, 2), HS=st.integers(1, 3),
       B=st.integers(1, 2), c=st.integers(1, 2), seed=st.integers(0, 999))
@collective
def test_attention_layer_equals_serial(algo, balance, heads_per, HS, B, c, seed):
    comm = Comm(MPI.COMM_WORLD, "cp", Ledger())
    cp, r = comm.size, comm.rank
    NH = heads_per * cp if algo == "ulysses" else heads_per + 1  # ring: any head count
    C, T = NH * HS, n_chunks(cp, balance) * c
    rng = np.random.default_rng(seed)  # the same full tensors on every rank
    qkv, dout = rng.standard_normal((B, T, 3 * C)), rng.standard_normal((B, T, C))
    y_ref, cache_ref = L.attention_forward(qkv, NH)
    dqkv_ref = L.attention_backward(dout, cache_ref)

    layout = ChunkLayout(T, cp, balance)
    mine = layout.positions(r)  # includes every chunk border: chunks are c long
    attn = (RingAttention if algo == "ring" else UlyssesAttention)(comm, layout)
    y, cache = attn.forward(qkv[:, mine], NH)
    dqkv = attn.backward(dout[:, mine], cache)

    bad = Mismatches()
    bad.check(np.testing.assert_allclose, y, y_ref[:, mine], **TOL, err_msg=f"y, rank {r}")
    bad.check(np.testing.assert_allclose, dqkv, dqkv_ref[:, mine], **TOL,
              err_msg=f"dqkv, rank {r}")
    bad.assert_none()
    Tl, isz = T // cp, 8
    if algo == "ring":
        # forward: cp-1 K/V blocks in; backward: cp-1 K/V blocks again, cp-1 dK/dV blocks
        kv = 2 * B * Tl * C * isz
        assert comm.ledger.bytes("send", "cp") == 3 * (cp - 1) * kv
        assert comm.ledger.bytes("recv", "cp") == 3 * (cp - 1) * kv
        assert attn.flops == ring_attention_flops(layout, r, B, NH, HS)
        # the cache holds q, k, v, y (b, NH, Tl, HS) and lse (b, NH, Tl): 1/cp of the sequence
        assert nbytes_of(cache) == (4 * B * NH * T * HS + B * NH * T) * isz // cp
    else:
        # four all-to-alls: qkv (b, Tl, 3C) and y (b, Tl, C) forward, their gradients backward
        assert comm.ledger.count("alltoall", "cp") == 4
        assert comm.ledger.bytes("alltoall", "cp") == 2 * (B * Tl * 3 * C + B * Tl * C) * isz
        # the cache is serial attention's on NH/cp heads: q, k, v and the (T, T) weights / cp
        assert cp * nbytes_of(cache) == nbytes_of(cache_ref)


# --- whole training runs ---------------------------------------------------------------------


def assert_same_run(cfg: TrainConfig, ds: Dataset, evaluate: bool = False) -> Trainer:
    serial = Trainer(cfg, grid=ProcessGrid(MPI.COMM_SELF), dataset=ds)
    par = Trainer(cfg, grid=ProcessGrid(MPI.COMM_WORLD, cp=cfg.cp), dataset=ds)
    bad = Mismatches()  # assert after the last collective
    close = np.testing.assert_allclose
    for s in range(cfg.steps):
        a, b = serial.step(), par.step()
        bad.check(close, b["loss"], a["loss"], **TOL, err_msg=f"loss at step {s}")
        bad.check(close, b["grad_norm"], a["grad_norm"], **TOL, err_msg=f"norm at step {s}")
        for k in serial.model.params:
            bad.check(close, par.model.grads[k], serial.model.grads[k], **TOL,
                      err_msg=f"gradient {k} at step {s}")
            bad.check(close, par.model.params[k], serial.model.params[k], **TOL,
                      err_msg=f"weight {k} after step {s}")
    if evaluate:
        bad.check(np.testing.assert_equal, par.evaluate(), serial.evaluate(), err_msg="eval")
    bad.assert_none()
    return par


def assert_ledger(par: Trainer, cfg: TrainConfig) -> None:
    """Bytes per step equal the formulas (float64: 8 bytes per element); memory / cp."""
    led, cp, dp = par.grid.ledger, par.grid.cp, par.grid.dp
    b, Tl, C, n = cfg.batch_size // dp, par.T // cp, par.model.cfg.n_embd, par.model.num_params()
    per_layer = cfg.steps * cfg.n_layer
    assert led.bytes("allreduce", "cp") == cfg.steps * 8 * n  # gradients summed over cp
    assert led.bytes("allreduce", "dp") == (cfg.steps * 8 * n if dp > 1 else 0)
    # attention activation memory per rank: 1/cp of the whole sequence's
    _, (_, blocks, _) = par.model.forward(np.zeros((b, par.T), dtype=np.int64))  # serial, b rows
    serial_cache = sum(nbytes_of(c[2][1]) for c in blocks)
    NH = par.model.cfg.n_head
    if cfg.cp_algo == "ring":
        assert led.bytes("send", "cp") == per_layer * 3 * (cp - 1) * 2 * b * Tl * C * 8
        assert led.count("send", "cp") == per_layer * 3 * (cp - 1)
        assert par.runner.attn_bytes == cfg.n_layer * (4 * b * Tl * C + b * NH * Tl) * 8
    else:
        assert led.bytes("alltoall", "cp") == per_layer * 2 * b * Tl * 4 * C * 8
        assert led.count("alltoall", "cp") == per_layer * 4
        assert cp * par.runner.attn_bytes == serial_cache


@pytest.mark.parallel(nprocs=[2, 4])
@settings(max_examples=6, phases=NO_SHRINK)
@given(cp=st.sampled_from([2, 4]), algo=ALGO, balance=BALANCE, heads_per=st.integers(1, 2),
       hs=st.integers(1, 2), c=st.integers(1, 2), n_layer=st.integers(1, 2),
       rows=st.integers(1, 2), clip=st.sampled_from([0.0, 0.05]), seed=st.integers(0, 999))
@collective
def test_cp_training_equals_serial(cp, algo, balance, heads_per, hs, c, n_layer, rows, clip,
                                   seed):
    size = MPI.COMM_WORLD.size
    cp = min(cp, size)  # every rank draws the same; at 2 ranks cp is 2
    n_head = heads_per * cp if algo == "ulysses" else heads_per
    c = min(c, 8 // n_chunks(cp, balance))  # T <= 8
    T = n_chunks(cp, balance) * c
    cfg = TrainConfig(n_layer=n_layer, n_head=n_head, n_embd=n_head * hs, block_size=T,
                      batch_size=rows * size // cp, steps=3, lr=0.01, warmup_steps=1,
                      grad_clip=clip, dtype="float64", seed=seed, progress=False, cp=cp,
                      cp_algo=algo, cp_balance=balance)
    V = 11
    ds = Dataset(np.random.default_rng(seed).integers(0, V, 120), V, "random")
    par = assert_same_run(cfg, ds)
    assert_ledger(par, cfg)


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("algo", ["ring", "ulysses"])
@collective
def test_cp_times_dp_addition_task(algo):
    """cp=2 x dp=2 on the built-in task, clipping that bites, and greedy evaluation."""
    cfg = TrainConfig(n_layer=1, n_head=2, n_embd=8, block_size=12, batch_size=4, steps=3,
                      grad_clip=0.5, dtype="float64", progress=False, cp=2, cp_algo=algo)
    par = assert_same_run(cfg, AdditionTask(3, seed=0, n_train=200, n_test=6).dataset(),
                          evaluate=True)
    assert par.grid.dp == 2 and par.grid.cp == 2
    assert_ledger(par, cfg)


# --- the command line ------------------------------------------------------------------------

SMALL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "8", "--batch-size", "4", "--steps", "2",
         "--no-progress", "--dtype", "float64"]


@pytest.mark.cli
@pytest.mark.parametrize("args,message", [
    (["--block-size", "6"], "block size 6 is not divisible by 4"),  # zigzag: 2*cp chunks
    (["--block-size", "5", "--cp-balance", "contiguous"], "block size 5 is not divisible by 2"),
    (["--cp-algo", "ulysses", "--n-head", "3", "--n-embd", "6", "--block-size", "8"],
     "n_head (3) is not divisible by --cp 2"),
])
def test_cp_bad_input_fails_cleanly(args, message):
    r = refmp(2, ["train", "--cp", "2", *SMALL, *args], timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count(message) == 1, r.stderr  # every rank refused; rank 0 says it once
    assert "Traceback" not in r.stderr


@pytest.mark.cli
def test_cp_train_command():
    r = refmp(2, ["train", "--cp", "2", "--cp-algo", "ring", "--block-size", "12", *SMALL])
    assert r.returncode == 0, r.stderr
    assert "cp=2" in r.stdout and "send@cp" in r.stdout and "held-out exact match" in r.stdout


@pytest.mark.tutorial
def test_tutorial_07_context_parallel():
    r = mpiexec(4, ["python", "tutorials/07_context_parallel.py"], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all checks passed" in r.stdout
