"""Context parallelism under real MPI: the attention layer and whole training runs equal the
serial model (float64), the ledger equals the analytic byte counts, bad input is refused.

The attention layer: every rank computes serial attention on the full sequence itself and
compares its own tokens' share of the parallel result. Whole runs go through the engine
(refmp.parallel.engine) and tests/parity.assert_same_run: rank 0 trains the serial model,
and every step's loss, gradient norm, whole gradient and whole weights are compared, for cp
alone, cp x dp, cp with ZeRO 1-3 and micro-batches, and a pipeline of cp groups.
"""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_helpers import Mismatches, collective, mpiexec, refmp, refused_each
from parity import assert_same_run, serial_config

from refmp.cost.flops import ring_attention_flops
from refmp.cost.tensor import comm_bytes_per_step
from refmp.cost.zero import comm_per_step, unit_sizes
from refmp.distributed.comm import Comm
from refmp.distributed.grid import ProcessGrid
from refmp.distributed.ledger import Ledger
from refmp.nn import fast as F
from refmp.nn import layers as L
from refmp.nn.gpt import GPT
from refmp.parallel.context.chunks import SequenceChunks
from refmp.parallel.context.ring import RingAttention
from refmp.parallel.context.ulysses import UlyssesAttention
from refmp.parallel.placement import place
from refmp.runtime.arrays import activation_bytes, nbytes_of
from refmp.training.datasets import AdditionTask, Dataset
from refmp.training.evaluate import evaluate
from refmp.training.trainer import TrainConfig, Trainer

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
@settings(max_examples=4, phases=NO_SHRINK)
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

    layout = SequenceChunks(T, cp, balance)
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
        # the cache is the serial (fast, refmp.nn.flash) attention's on NH/cp heads: q, k, v,
        # the output and the lse, / cp
        assert cp * nbytes_of(cache) == nbytes_of(F.attention_forward(qkv, NH)[1])


# --- the ledger and the memory of whole runs -------------------------------------------------


def want_per_step(par: Trainer) -> dict:
    """(op, axis) -> (bytes, calls or None) per step on this rank, float64 (8 bytes).

    Attention over cp moves the NH/tp heads of this rank's L layers; the dense gradients are
    reduced ONCE over grid.group("dp", "cp") (label "dp+cp", or "cp" when dp = 1), as
    refmp.cost.zero says for the ZeRO stage, and never over dp or cp alone; tp (with
    pp = 1 only) moves what refmp.cost.tensor.comm_bytes_per_step says, with s = Tl.
    """
    cfg, run, s, w, M = par.cfg, par.runner, par.grid.sizes, 8, par.cfg.microbatches
    cp, tp, dp, C = s["cp"], s["tp"], s["dp"], run.mcfg.n_embd
    b, Tl = cfg.batch_size // dp, par.T // cp
    blocks = [i for c in run.stage.chunks.values() for i in c]  # this rank's layers
    n = len(blocks)
    want = {}
    if cfg.cp_algo == "ring":  # cp-1 K/V blocks forward, again backward, and cp-1 dK/dV blocks
        kv = 2 * b * Tl * (C // tp) * w
        want["send", "cp"] = want["recv", "cp"] = (n * 3 * (cp - 1) * kv, n * 3 * (cp - 1) * M)
    else:  # qkv (b, Tl, 3C/tp) and y (b, Tl, C/tp) forward, their gradients backward
        want["alltoall", "cp"] = (n * 2 * b * Tl * 4 * (C // tp) * w, 4 * n * M)
    group = "dp+cp" if dp > 1 else "cp"
    sizes = unit_sizes(run.mcfg, tp, blocks, run.first, run.last)
    zero = comm_per_step(sizes, dp * cp, cfg.zero, M, w, run.first, run.last)
    for op, nbytes in zero.items():
        # stage 0: one bucketed all-reduce, and the model here fits one 25 MB bucket
        want[op, group] = (nbytes, 1 if op == "allreduce" and cfg.zero == 0 else None)
        for alone in {"dp", "cp"} - {group}:  # no reduction over one axis of the two
            want[op, alone] = (0, 0)
    if tp > 1:
        assert s["pp"] == 1, "the tp formula is the whole model's"
        # SP: the replicated weights' owned pieces are summed over tp too (placement)
        n_rep = sum(int(g.size) for k, g in run.grads.items()
                    if not k.endswith(".padding") and "tp" in place(k, True).reduce)
        for op, nbytes in comm_bytes_per_step(b, Tl, C, n, cfg.sequence_parallel, w,
                                              n_rep).items():
            want[op, "tp"] = (nbytes, None)
    return want


def assert_ledger(par: Trainer) -> None:
    """The ledger per step equals want_per_step (assert_same_run keeps its own gathers of the
    whole model out of the ledger: what is left is the training steps')."""
    led, steps, want = par.grid.ledger, par.cfg.steps, want_per_step(par)
    got = {(op, axis): (led.bytes(op, axis) / steps,
                        None if calls is None else led.count(op, axis) / steps)
           for (op, axis), (_, calls) in want.items()}
    assert got == want, (got, want)


def assert_activations_per_cp(par: Trainer, ds: Dataset) -> None:
    """The engine's peak activations (memory()["activations"]) against a serial run of the
    same rows: every cached array holds 1/cp of the tokens, except the attention core's
    cache, which is the ring's own (q, k, v, y and lse of Tl tokens) or Ulysses' (serial
    attention on NH/cp heads: 1/cp of the serial cache, its output included)."""
    cfg, s, mc = par.cfg, par.grid.sizes, par.runner.mcfg
    cp, M = s["cp"], cfg.microbatches
    bm = cfg.batch_size // s["dp"] // M  # rows of one micro-batch
    one = replace(serial_config(cfg), batch_size=bm * M, microbatches=M, steps=1)
    serial = Trainer(one, grid=ProcessGrid(MPI.COMM_SELF), dataset=ds)
    serial.step()
    whole, got = serial.runner.memory()["activations"], par.runner.memory()["activations"]
    NH, T, C, L_ = mc.n_head, par.T, mc.n_embd, mc.n_layer
    # the serial attention's own cache (refmp.nn.flash): q, k, v (qkv) and the lse; its output
    # is c_proj's input, counted with the tokens
    y0, c0 = F.attention_forward(np.zeros((bm, T, 3 * C)), NH)
    attn_serial = activation_bytes(c0, exclude=[y0])
    if cfg.cp_algo == "ring":
        Tl = T // cp
        # per layer: q, k, v, y (b, NH, Tl, HS) and lse (b, NH, Tl); with one head (or one
        # token) y (b, 1, Tl, HS) is already the output (b, Tl, C), which c_proj caches anyway
        y = 0 if NH == 1 or Tl == 1 else bm * Tl * C
        ring = (3 * bm * Tl * C + y + bm * NH * Tl) * 8
        assert (whole - L_ * attn_serial) % cp == 0
        assert got == (whole - L_ * attn_serial) // cp + L_ * ring, (got, whole)
    else:  # and Ulysses keeps its heads' output before the all-to-all back: 1/cp of (b, T, C)
        assert cp * got == whole + L_ * bm * T * C * 8, (got, whole)


# --- whole training runs ---------------------------------------------------------------------


def random_data(seed: int, V: int = 11) -> Dataset:
    return Dataset(np.random.default_rng(seed).integers(0, V, 160), V, "random")


@pytest.mark.parallel(nprocs=[2, 4])
@settings(max_examples=4, phases=NO_SHRINK)
@given(cp=st.sampled_from([2, 4]), algo=ALGO, balance=BALANCE, heads_per=st.integers(1, 2),
       hs=st.integers(1, 2), c=st.integers(1, 2), n_layer=st.integers(1, 2),
       rows=st.integers(1, 2), M=st.integers(1, 2), zero=st.sampled_from([0, 1, 2, 3]),
       clip=st.sampled_from([0.0, 0.05]), seed=st.integers(0, 999))
@collective
def test_cp_training_equals_serial(cp, algo, balance, heads_per, hs, c, n_layer, rows, M,
                                   zero, clip, seed):
    """cp (x dp with what is left) with ZeRO 0-3 and M micro-batches: 3 AdamW steps."""
    size = MPI.COMM_WORLD.size
    cp = min(cp, size)  # every rank draws the same; at 2 ranks cp is 2
    n_head = heads_per * cp if algo == "ulysses" else heads_per
    c = min(c, 8 // n_chunks(cp, balance))  # T <= 8
    T = n_chunks(cp, balance) * c
    cfg = TrainConfig(n_layer=n_layer, n_head=n_head, n_embd=n_head * hs, block_size=T,
                      batch_size=rows * M * size // cp, steps=3, lr=0.01, warmup_steps=1,
                      grad_clip=clip, dtype="float64", seed=seed, progress=False, cp=cp,
                      cp_algo=algo, cp_balance=balance, microbatches=M, zero=zero)
    ds = random_data(seed)
    par = assert_same_run(cfg, ds)
    assert_ledger(par)
    assert_activations_per_cp(par, ds)


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("algo", ["ring", "ulysses"])
@collective
def test_cp_times_dp_addition_task(algo):
    """cp=2 x dp=2 on the built-in task, clipping that bites, and greedy evaluation: the
    held-out score split over dp x cp equals the serial model's with the same weights."""
    cfg = TrainConfig(n_layer=1, n_head=2, n_embd=8, block_size=12, batch_size=4, steps=3,
                      grad_clip=0.5, dtype="float64", progress=False, cp=2, cp_algo=algo)
    ds = AdditionTask(3, seed=0, n_train=200, n_test=6).dataset()
    par = assert_same_run(cfg, ds)
    assert par.grid.sizes["dp"] == 2 and par.grid.sizes["cp"] == 2
    assert_ledger(par)  # among others: one all-reduce@dp+cp per step, none over dp or cp
    full = par.runner.full_params()  # collective; the whole model on rank 0
    got = evaluate(par.runner, par.grid, par.mcfg, par.T, ds.task)  # collective (world)
    if full is not None:
        want = ds.task.score(GPT(par.runner.mcfg, full))
        assert got == want, (got, want)


@pytest.mark.parallel(nprocs=4)
@settings(max_examples=3, phases=NO_SHRINK)
@given(algo=ALGO, balance=BALANCE, schedule=st.sampled_from(["gpipe", "1f1b", "zb-h1"]),
       seed=st.integers(0, 999))
@collective
def test_pipeline_of_cp_groups_equals_serial(algo, balance, schedule, seed):
    """pp=2 x cp=2: each pipeline stage is a cp group; its ring / all-to-alls carry only its
    own layers, and the stage's gradients are reduced over cp (dp = 1)."""
    cfg = TrainConfig(n_layer=2, n_head=2, n_embd=8, block_size=8, batch_size=2, steps=2,
                      lr=0.01, warmup_steps=1, grad_clip=0.05, dtype="float64", seed=seed,
                      progress=False, pp=2, cp=2, cp_algo=algo, cp_balance=balance,
                      microbatches=2, schedule=schedule)
    par = assert_same_run(cfg, random_data(seed))
    assert par.grid.sizes["pp"] == 2 and par.grid.sizes["cp"] == 2
    assert_ledger(par)


# --- the command line ------------------------------------------------------------------------

SMALL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "8", "--batch-size", "4", "--steps", "2",
         "--no-progress", "--dtype", "float64"]


BAD_CP = [
    (["--block-size", "6"], "block size 6 is not divisible by 4"),  # zigzag: 2*cp chunks
    (["--block-size", "5", "--cp-balance", "contiguous"], "--cp 2 must divide the block size"),
    (["--cp-algo", "ulysses", "--n-head", "3", "--n-embd", "6", "--block-size", "8"],
     "n_head/tp = 3 heads of a tp rank, which must be divisible by --cp 2"),
]


@pytest.fixture(scope="module")
def bad_cp_runs():
    """BAD_CP's command lines, each refused on 2 ranks, all in one launch
    (mpi_helpers.refused)."""
    return refused_each(2, ["train", "--cp", "2", *SMALL], BAD_CP)


@pytest.mark.cli
@pytest.mark.parametrize("args,message", BAD_CP)
def test_cp_bad_input_fails_cleanly(bad_cp_runs, args, message):
    r = bad_cp_runs[str(args)]
    assert r.returncode == 2, r.stderr
    assert r.stderr.count(message) == 1, r.stderr  # every rank refused; rank 0 says it once
    assert "Traceback" not in r.stderr


@pytest.mark.cli
def test_cp_train_command():
    r = refmp(2, ["train", "--cp", "2", "--cp-algo", "ring", "--block-size", "12", *SMALL])
    assert r.returncode == 0, r.stderr
    assert "cp=2" in r.stdout and "send@cp" in r.stdout and "held-out exact match" in r.stdout


@pytest.mark.tutorial
def test_tutorial_06_context_parallel():
    r = mpiexec(4, ["python", "tutorials/06_context_parallel.py"], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all checks passed" in r.stdout
    assert "== 1. by hand: cp = 4" in r.stdout
