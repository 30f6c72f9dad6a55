"""Gradient accumulation, bucketed all-reduce and ZeRO 1/2/3 equal the serial run (float64).

Every rank trains the serial model itself (COMM_SELF, the whole batch, one micro-batch) and
the data-parallel one (COMM_WORLD), step by step. A ZeRO rank holds only its shard of the
gradients and optimizer state (and, stage 3, of the weights), so it is compared with the same
elements of the serial arrays (``runner.shard_of``). Memory and ledger bytes are held against
the formulas of refmp.parallel.zero_cost, exactly.
"""

import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_helpers import Mismatches, collective, mpiexec, refmp

from refmp.data import Dataset
from refmp.grid import ProcessGrid
from refmp.nn import GPTConfig
from refmp.parallel.data import activation_bytes
from refmp.parallel.zero_cost import comm_per_step, memory_per_rank
from refmp.train import TrainConfig, Trainer

TOL = dict(rtol=1e-9, atol=1e-12)


def train_both(cfg: TrainConfig, ds: Dataset, bad: Mismatches):
    serial = Trainer(TrainConfig(**{**vars(cfg), "zero": 0, "microbatches": 1}),
                     grid=ProcessGrid(MPI.COMM_SELF), dataset=ds)
    par = Trainer(cfg, grid=ProcessGrid(MPI.COMM_WORLD), dataset=ds)
    run, close = par.runner, np.testing.assert_allclose
    for s in range(cfg.steps):
        a, b = serial.step(), par.step()
        bad.check(close, b["loss"], a["loss"], **TOL, err_msg=f"loss at step {s}")
        bad.check(close, b["grad_norm"], a["grad_norm"], **TOL, err_msg=f"norm at step {s}")
        # the elements this rank owns (all of them without ZeRO) after reduction and clipping
        want_g = run.shard_of(serial.model.grads) if cfg.zero else serial.model.grads
        want_p = run.shard_of(serial.model.params) if cfg.zero else serial.model.params
        for k in want_g:
            bad.check(close, run.grads[k], want_g[k], **TOL, err_msg=f"grad {k} at step {s}")
            bad.check(close, run.params[k], want_p[k], **TOL, err_msg=f"weight {k} after {s}")
    led = par.grid.ledger
    sent = {op: (led.bytes(op, "dp"), led.count(op, "dp"))
            for op in ("allreduce", "reduce_scatter", "allgather")}  # before gathering below
    full = run.full_params()  # collective (stage 3 gathers); rank 0 gets it
    if full is not None:
        for k, v in serial.model.params.items():
            bad.check(close, full[k], v, **TOL, err_msg=f"gathered weight {k}")
    return serial, par, sent


@pytest.mark.mpi
@pytest.mark.parallel(nprocs=[2, 4])
@settings(max_examples=8, phases=[Phase.generate])  # no shrinking: each try makes 12 MPI comms
@given(zero=st.sampled_from([0, 1, 2, 3]), M=st.sampled_from([1, 2]),
       bucket_mb=st.sampled_from([0.0, 1e-4, 4e-4, 25.0]), n_layer=st.integers(1, 2),
       n_head=st.integers(1, 2), hs=st.integers(1, 3), V=st.integers(3, 13),
       T=st.integers(2, 5), clip=st.sampled_from([0.0, 0.05, 10.0]), seed=st.integers(0, 99))
@collective
def test_training_equals_serial(zero, M, bucket_mb, n_layer, n_head, hs, V, T, clip, seed):
    dp = MPI.COMM_WORLD.size
    cfg = TrainConfig(n_layer=n_layer, n_head=n_head, n_embd=n_head * hs, block_size=T,
                      batch_size=dp * M, steps=3, lr=0.01, warmup_steps=1, grad_clip=clip,
                      dtype="float64", seed=seed, progress=False, zero=zero, microbatches=M,
                      bucket_mb=bucket_mb)
    ds = Dataset(np.random.default_rng(seed).integers(0, V, 120), V, "random")
    bad = Mismatches()
    serial, par, sent = train_both(cfg, ds, bad)
    # memory: the ZeRO table, exactly (8 bytes per element in float64), padding included
    mcfg = GPTConfig(V, T, n_layer, n_head, n_head * hs)
    mem, want = par.memory(), memory_per_rank(mcfg, dp, zero, itemsize=8)
    for kind in ("params", "grads", "optimizer"):
        bad.check(np.testing.assert_equal, mem[kind], want[kind], err_msg=f"{kind} bytes")
    # peak activations: one micro-batch's caches, as the serial model's on the same rows
    m = serial.model
    x = np.zeros((cfg.batch_size // (dp * M), T), dtype=np.int64)
    _, cache = m.forward(x, x.copy(), 1)
    bad.check(np.testing.assert_equal, mem["activations"],
              activation_bytes(cache, m.params.values()), err_msg="activation bytes")
    # communication per step = the formulas (metrics, the loss and norm, are ledgered apart)
    want = comm_per_step(mcfg, dp, zero, M, itemsize=8)
    for op, (b, _) in sent.items():
        bad.check(np.testing.assert_equal, b, cfg.steps * want.get(op, 0), err_msg=f"{op} bytes")
    if zero == 0:
        n_calls = len(par.runner.buckets) if bucket_mb else 1
        bad.check(np.testing.assert_equal, sent["allreduce"][1], cfg.steps * n_calls,
                  err_msg="all-reduce calls: one per bucket per step")
    bad.assert_none()


@pytest.mark.mpi
@pytest.mark.parallel(nprocs=2)
@collective
def test_buckets_start_during_backward():
    """Buckets follow backward order; all but the last start before backward ends."""
    cfg = TrainConfig(n_layer=2, n_head=2, n_embd=8, block_size=4, batch_size=4, steps=1,
                      dtype="float64", progress=False, bucket_mb=5e-3)
    tr = Trainer(cfg, dataset=Dataset(np.arange(100) % 7, 7, "r"))
    tr.step()
    run = tr.runner
    order = [k for b in run.buckets for k in b]
    assert order[:2] == ["ln_f.weight", "ln_f.bias"] and order[-2:] == ["wte.weight", "wpe.weight"]
    assert len(run.buckets) >= 3
    ev = run.timeline.events
    end_backward = max(e[3] for e in ev if e[1] == "backward embed")
    starts = [e[2] for e in ev if e[0] == "comm"]
    assert len(starts) == len(run.buckets)
    assert all(t < end_backward for t in starts[:-1]), run.timeline.ascii()


def test_formulas_match_the_paper_without_padding():
    """With no padding (sizes divisible by dp): 4+4+8 bytes per parameter, divided by stage."""
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
    n = sum(cfg_sizes for cfg_sizes in [64 * 16 + 16 * 16, 2 * (12 * 16 * 16 + 13 * 16), 32])
    dp = 4
    assert memory_per_rank(cfg, dp, 0) == {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n}
    assert memory_per_rank(cfg, dp, 1) == {"params": 4 * n, "grads": 4 * n,
                                           "optimizer": 8 * n // dp}
    assert memory_per_rank(cfg, dp, 2) == {"params": 4 * n, "grads": 4 * n // dp,
                                           "optimizer": 8 * n // dp}
    assert memory_per_rank(cfg, dp, 3) == {"params": 4 * n // dp, "grads": 4 * n // dp,
                                           "optimizer": 8 * n // dp}


@pytest.mark.cli
@pytest.mark.parametrize("args, message", [
    (["--zero", "4"], "invalid choice"),
    (["--microbatches", "3", "--batch-size", "8"], "divisible by dp * microbatches"),
    (["--bucket-mb", "-1"], "--bucket-mb must be >= 0"),
])
def test_bad_input_is_refused(args, message):
    r = refmp(2, ["train", "--n-embd", "8", "--steps", "1", "--no-progress", *args], timeout=60)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.tutorial
def test_tutorial_runs():
    r = mpiexec(2, ["python", "tutorials/06_zero.py"], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all checks passed" in r.stdout
