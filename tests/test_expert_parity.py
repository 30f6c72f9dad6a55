"""Level 2/3 for mixture of experts: data- and expert-parallel training equal the serial run.

Every rank trains the serial MoE model itself (COMM_SELF, the whole batch) and the parallel
one (COMM_WORLD: dp = world size, experts over ep in {1, 2, 4}), step by step, float64, and
compares losses, routing statistics, gradients and updated weights; then the all-to-all bytes
in the ledger against what the serial model's routing implies, and the gathered model.
"""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_helpers import Mismatches, collective, mpiexec, refmp

from refmp.data import Dataset, dp_rows, get_batch
from refmp.grid import ProcessGrid
from refmp.nn import moe as M
from refmp.parallel.expert import alltoallv_bytes
from refmp.train import TrainConfig, Trainer

pytestmark = pytest.mark.mpi

TOL = dict(rtol=1e-9, atol=1e-12)


def expected_alltoallv_bytes(serial: Trainer, step: int, grid: ProcessGrid) -> int:
    """What the serial model's routing of this step implies for this rank (alltoallv_bytes)."""
    cfg, m = serial.cfg, serial.model
    x, y = get_batch(serial.ds.tokens, step, cfg.batch_size, serial.T, slice(None), serial.perm)
    _, cache = m.forward(x, y)
    owner = np.empty(cfg.batch_size, dtype=int)  # dp rank of each sequence
    for r in range(grid.dp):
        owner[dp_rows(cfg.batch_size, grid.dp, r)] = r
    total = 0
    for c in cache[1]:
        if isinstance(c[-1], M.MoECache):
            order = c[-1].order  # kept assignments a = n K + k
            tok, expert = order // m.cfg.top_k, c[-1].top.reshape(-1)[order]
            total += alltoallv_bytes(owner[tok // serial.T], expert, grid.dp_rank, grid.ep,
                                     m.cfg.n_expert, m.cfg.n_embd, 8)
    return total


def assert_same_moe_run(cfg: TrainConfig, ds: Dataset, ep: int) -> None:
    serial = Trainer(cfg, grid=ProcessGrid(MPI.COMM_SELF), dataset=ds)
    par = Trainer(replace(cfg, ep=ep), grid=ProcessGrid(MPI.COMM_WORLD, ep=ep), dataset=ds)
    grid, run = par.grid, par.runner
    close = np.testing.assert_allclose
    bad = Mismatches()
    for s in range(cfg.steps):
        want = expected_alltoallv_bytes(serial, s, grid) if ep > 1 else 0
        before = grid.ledger.bytes("alltoallv", "ep")
        a, b = serial.step(), par.step()
        got = grid.ledger.bytes("alltoallv", "ep") - before
        bad.check(close, got, want, rtol=0, err_msg=f"all-to-all bytes at step {s}")
        bad.check(close, b["loss"], a["loss"], **TOL, err_msg=f"loss at step {s}")
        bad.check(close, b["grad_norm"], a["grad_norm"], **TOL, err_msg=f"norm at step {s}")
        bad.check(close, b["moe"]["tokens_per_expert"], a["moe"]["tokens_per_expert"], rtol=0,
                  err_msg=f"tokens per expert at step {s}")
        bad.check(close, b["moe"]["aux_loss"], a["moe"]["aux_loss"], **TOL,
                  err_msg=f"aux loss at step {s}")
        for k in run.params:
            bad.check(close, run.grads[k], serial.model.grads[k], **TOL,
                      err_msg=f"gradient {k} at step {s}")
            bad.check(close, run.params[k], serial.model.params[k], **TOL,
                      err_msg=f"weight {k} after step {s}")
    full = run.full_params()  # collective
    if grid.rank == 0:
        bad.check(np.testing.assert_equal, list(full), list(serial.model.params))
        for k, v in serial.model.params.items():
            bad.check(close, full[k], v, **TOL, err_msg=f"gathered {k}")
    bad.assert_none()
    n_moe = sum(serial.model.cfg.is_moe(i) for i in range(cfg.n_layer))
    E = serial.model.cfg.n_expert
    assert grid.ledger.count("alltoall", "ep") == (cfg.steps * n_moe if ep > 1 else 0)
    assert grid.ledger.bytes("alltoall", "ep") == (cfg.steps * n_moe * E * 8 if ep > 1 else 0)
    assert grid.ledger.count("alltoallv", "ep") == (4 * cfg.steps * n_moe if ep > 1 else 0)
    # experts are held by ep ranks each: only the rest is data parallel
    if ep > 1:
        assert len(run.params) < len(serial.model.params)


@pytest.mark.parallel(nprocs=[2, 4])
@settings(max_examples=6)
@given(per_rank=st.sampled_from([2, 1]), K=st.integers(1, 2), ep=st.sampled_from([2, 4, 1]),
       cf=st.sampled_from([0.0, 0.5, 1.25]), n_layer=st.integers(1, 2),
       moe_every=st.integers(1, 2), T=st.integers(2, 6), rows=st.integers(1, 2),
       clip=st.sampled_from([0.0, 0.05]), seed=st.integers(0, 1000))
@example(per_rank=2, K=2, ep=4, cf=0.5, n_layer=2, moe_every=2, T=6, rows=2, clip=0.05, seed=7)
@collective
def test_moe_training_equals_serial(per_rank, K, ep, cf, n_layer, moe_every, T, rows, clip,
                                    seed):
    size = MPI.COMM_WORLD.size
    ep = min(ep, size)  # (no assume() here: @collective would see it as a failure)
    E = max(2, ep * per_rank)  # divisible by ep
    K = min(K, E)
    cfg = TrainConfig(n_layer=n_layer, n_head=2, n_embd=8, block_size=T, batch_size=rows * size,
                      steps=3, lr=0.01, warmup_steps=1, grad_clip=clip, dtype="float64",
                      seed=seed, n_expert=E, top_k=K, moe_every=moe_every, capacity_factor=cf,
                      aux_loss_coef=0.1, z_loss_coef=0.01, progress=False)
    rng = np.random.default_rng(seed)
    ds = Dataset(rng.integers(0, 11, 300), 11, "random")
    assert_same_moe_run(cfg, ds, ep)


@pytest.mark.parallel(nprocs=4)
@collective
def test_ep2_inside_dp4_drops_tokens_and_matches():
    """ep = 2 inside dp = 4 (two edp replicas of each expert), with dropping."""
    cfg = TrainConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, batch_size=8, steps=3,
                      lr=0.01, warmup_steps=1, grad_clip=0.05, dtype="float64", seed=3,
                      n_expert=4, top_k=2, capacity_factor=0.5, aux_loss_coef=0.1,
                      z_loss_coef=0.01, progress=False)
    rng = np.random.default_rng(3)
    assert_same_moe_run(cfg, Dataset(rng.integers(0, 11, 300), 11, "random"), ep=2)


@pytest.mark.parallel(nprocs=3)  # 3: blocks of every size 0..2 between every pair
@collective
def test_comm_alltoallv_uneven_and_empty_blocks():
    from refmp.comm import Comm

    c = Comm(MPI.COMM_WORLD, "ep")
    r, n = c.rank, c.size
    send = [(r + j) % 3 for j in range(n)]  # some blocks are empty
    buf = np.concatenate([np.full((send[j], 2), 10.0 * r + j) for j in range(n)])
    recv = c.alltoall(np.array(send, dtype=np.int64))
    out = c.alltoallv(buf, send, recv)
    expect = np.concatenate([np.full(((s + r) % 3, 2), 10.0 * s + r) for s in range(n)])
    np.testing.assert_array_equal(out, expect)
    assert c.ledger.bytes("alltoallv", "ep") == buf.nbytes  # the send buffer, this rank
    assert c.ledger.bytes("alltoall", "ep") == 8 * n


SMALL = ["train", "--n-layer", "1", "--n-head", "2", "--n-embd", "8", "--batch-size", "4",
         "--steps", "2", "--no-progress"]


@pytest.mark.parametrize("args, message", [
    (["--ep", "2", "--n-expert", "3"], "--n-expert (3) must be divisible by --ep (2)"),
    (["--n-expert", "2", "--top-k", "3"], "--top-k (3) must be between 1 and --n-expert (2)"),
    (["--ep", "2"], "--ep 2 needs a mixture-of-experts model"),
    (["--ep", "4", "--n-expert", "4"], "--ep (4) must divide --dp (2)"),
])
def test_bad_expert_layouts_are_refused_on_every_rank(args, message):
    r = refmp(2, [*SMALL, *args], timeout=120)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and r.stderr.count("error:") == 1, r.stderr
    assert "Traceback" not in r.stderr


def test_cli_expert_parallel_run_saves_the_full_model_and_reports_stats(tmp_path):
    import json

    from safetensors.numpy import load_file

    from refmp.checkpoint import load_model

    log, a = tmp_path / "log.jsonl", tmp_path / "a.safetensors"
    moe = ["--n-expert", "4", "--top-k", "2", "--capacity-factor", "0.5", "--moe-every", "1"]
    r = refmp(2, [*SMALL, "--ep", "2", *moe, "--dtype", "float64", "--log-json", str(log),
                  "--save", str(a)], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "tokens per expert" in r.stdout and "alltoallv@ep" in r.stdout
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert all("moe" in x for x in lines)
    assert 0 < lines[0]["moe"]["dropped"][0] < 1  # capacity 0.5 drops some
    # the file holds the full model with every expert, equal to the serial run's
    cfg = TrainConfig(n_layer=1, n_head=2, n_embd=8, batch_size=4, steps=2, dtype="float64",
                      n_expert=4, top_k=2, capacity_factor=0.5, progress=False)
    tr = Trainer(cfg, grid=ProcessGrid(MPI.COMM_SELF))
    for _ in range(2):
        tr.step()
    saved = load_file(str(a))
    assert set(saved) == set(tr.model.params) and "h.0.mlp.experts.3.c_fc.weight" in saved
    for k, v in tr.model.params.items():
        np.testing.assert_allclose(saved[k], v, rtol=1e-9, atol=1e-12, err_msg=k)
    loaded = load_model(str(a), dtype="float64")  # --init reads the MoE shape back
    assert (loaded.cfg.n_expert, loaded.cfg.top_k, loaded.cfg.capacity_factor) == (4, 2, 0.5)


@pytest.mark.tutorial
@pytest.mark.parametrize("n", [2, 4])
def test_tutorial_05_experts(n):
    r = mpiexec(n, ["python", "tutorials/05_experts.py"], timeout=200)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: expert parallel == serial" in r.stdout and "DROP" in r.stdout
    assert r.stdout.count("step 3:") == 1  # rank 0 alone narrates
