"""Hierarchical context parallelism (--cp-ulysses) and HSDP (--dp-shard) under real MPI: the
attention layer and whole training runs equal the serial model (float64), the ledger's bytes
per level and the memory equal refmp.cost's formulas, and refmp plan takes them where its
model says they win. The parallel tests share one launch of 4 ranks; the refusals of both
options are cases of tests/test_cli.py's launch (BAD), one message on every rank.
"""

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import Mismatches, collective
from parity import assert_same_run

from refmp.cost.context import hybrid_cp_ledger
from refmp.cost.machines import MACHINES
from refmp.cost.nodes import cluster
from refmp.cost.search import search
from refmp.cost.zero import comm_per_step, hsdp_per_step, memory_per_rank, unit_sizes
from refmp.distributed.comm import Comm
from refmp.distributed.ledger import Ledger
from refmp.nn import layers as L
from refmp.nn.params import GPTConfig
from refmp.parallel.context.chunks import SequenceChunks
from refmp.parallel.context.hybrid import HybridAttention, split_cp
from refmp.parallel.data.hsdp import shard_notes
from refmp.training.datasets import Dataset
from refmp.training.trainer import TrainConfig

pytestmark = pytest.mark.mpi

TOL = dict(rtol=1e-9, atol=1e-12)
TINY = dict(n_layer=2, n_head=2, n_embd=8, block_size=8, steps=2, lr=0.01, warmup_steps=1,
            grad_clip=0.05, dtype="float64", seed=3, progress=False)


def random_data(seed: int = 0, V: int = 11) -> Dataset:
    return Dataset(np.random.default_rng(seed).integers(0, V, 200), V, "random")


def per_step(par) -> dict:
    """(op, label) -> bytes per step of the run's ledger (its own gathers kept out)."""
    return {k: v[0] / par.cfg.steps for k, v in par.grid.ledger.entries.items()}


# --- hierarchical context parallelism --------------------------------------------------------


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("balance", ["zigzag", "contiguous"])
@collective
def test_hybrid_attention_layer_equals_serial(balance):
    """cp 4 = Ulysses 2 x ring 2: every rank's tokens of the output and of the input's
    gradient equal serial causal attention's; each level's bytes equal the formula's."""
    comm = Comm(MPI.COMM_WORLD, "cp", Ledger())
    cp, r, U, NH, HS, B = comm.size, comm.rank, 2, 4, 2, 2
    C = NH * HS
    seq = SequenceChunks(2 * cp * 2 if balance == "zigzag" else cp * 2, cp, balance)
    rng = np.random.default_rng(7)
    qkv, dout = rng.standard_normal((B, seq.T, 3 * C)), rng.standard_normal((B, seq.T, C))
    y_ref, cache_ref = L.attention_forward(qkv, NH)
    dqkv_ref = L.attention_backward(dout, cache_ref)
    attn = HybridAttention(*split_cp(comm, U, (0,) * cp), seq)
    mine = seq.positions(r)
    y, cache = attn.forward(qkv[:, mine], NH)
    dqkv = attn.backward(dout[:, mine], cache)
    bad = Mismatches()
    bad.check(np.testing.assert_allclose, y, y_ref[:, mine], **TOL, err_msg=f"y, rank {r}")
    bad.check(np.testing.assert_allclose, dqkv, dqkv_ref[:, mine], **TOL, err_msg=f"dqkv {r}")
    lay = SimpleNamespace(tp=1, cp=cp, cp_ulysses=U, recompute="none")
    want = hybrid_cp_ledger(lay, B, seq.T // cp, C, 1, 1, 8)
    got = {k: (v[0], v[1]) for k, v in comm.ledger.entries.items()}
    bad.check(np.testing.assert_equal, got, want, err_msg="bytes by level")
    bad.assert_none(MPI.COMM_WORLD)


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("case", [dict(cp=4, zero=1, microbatches=2),
                                  dict(cp=4, cp_balance="contiguous", recompute="full")])
@collective
def test_hybrid_cp_training_equals_serial(case):
    """cp 4 = Ulysses 2 x ring 2 through the engine: every step equals the serial run, and
    the ledger's all-to-alls in the groups and sends around the ring equal the formulas."""
    cfg = TrainConfig(**TINY, batch_size=4, cp_ulysses=2, **case)
    par = assert_same_run(cfg, random_data())
    want = hybrid_cp_ledger(cfg, cfg.batch_size, par.T // 4, 8, 2, cfg.microbatches, 8)
    got = per_step(par)
    assert {k: got.get(k) for k in want} == {k: b for k, (b, _) in want.items()}, got
    assert not [k for k in got if k[0] in ("send", "recv", "alltoall") and k[1] == "cp"]


# --- HSDP ------------------------------------------------------------------------------------


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("zero", [1, 2, 3])
@collective
def test_hsdp_equals_serial(zero, monkeypatch):
    """dp 4 = 2 replicas x shard groups of 2, on 2 nodes of 2 ranks (REFMP_RANKS_PER_NODE):
    every step equals the serial run (and so plain dp); the shard group's bytes are ZeRO's
    over 2 ranks, the replicas' all-reduce the owned slice once a step, memory is ZeRO's
    over 2; and what crosses between the nodes is that all-reduce alone (the world's are
    the loss and the norm, scalars)."""
    monkeypatch.setenv("REFMP_RANKS_PER_NODE", "2")
    cfg = TrainConfig(**TINY, batch_size=8, dp_shard=2, zero=zero, microbatches=2)
    par = assert_same_run(cfg, random_data(1))
    sizes = unit_sizes(par.runner.mcfg)
    want = comm_per_step(sizes, 2, zero, 2, 8)
    got = per_step(par)
    assert got.get(("reduce_scatter", "dp.shard[intra]")) == want["reduce_scatter"], got
    assert got.get(("allgather", "dp.shard[intra]")) == want["allgather"], got
    assert got.get(("allreduce", "dp.replicate[inter]")) == hsdp_per_step(sizes, 2, 2, 8), got
    across = {k for k, b in got.items() if k[1].endswith("[inter]") and b and k[1] != "world[inter]"}
    assert across == {("allreduce", "dp.replicate[inter]")}, got
    mem, held = par.memory(), memory_per_rank(sizes, 2, zero, itemsize=8)
    assert {k: mem[k] for k in held} == held, mem


@pytest.mark.parallel(nprocs=4)
@collective
def test_hsdp_over_cp_with_hierarchical_cp():
    """dp 2 x cp 2 with --dp-shard 1: the shard group is a dp rank's cp ranks, the replicas
    the dp ranks; cp 2 = Ulysses 2 (a ring of one). ZeRO-3, 2 micro-batches."""
    cfg = TrainConfig(**TINY, batch_size=4, cp=2, cp_ulysses=2, dp_shard=1, zero=3,
                      microbatches=2)
    par = assert_same_run(cfg, random_data(2))
    got = per_step(par)
    sizes = unit_sizes(par.runner.mcfg)
    assert got[("allreduce", "dp+cp.replicate")] == hsdp_per_step(sizes, 2, 2, 8), got
    assert got[("reduce_scatter", "dp+cp.shard")] == comm_per_step(sizes, 2, 3, 2, 8)["reduce_scatter"]


# --- the planner -----------------------------------------------------------------------------


def test_the_planner_takes_them_where_they_win():
    """refmp plan's search offers both and ranks them by its step-time model: HSDP with a
    node's 8 dp ranks as the shard group for GPT-2 XL at ZeRO-3 on 4 nodes of 8 H100s (every
    use's weight gathers off the link between nodes), the same on nodes of 2 ranks sharing a
    1 Gbit/s link (--link-gbit), and Ulysses groups inside a node for cp
    16 over 2 nodes (one ring hop across instead of fifteen)."""
    mach = MACHINES["dgx-h100"]
    xl = GPTConfig(n_layer=48, n_embd=1600, n_head=25, vocab_size=50257, block_size=1024)
    fixed = dict(tp=1, pp=1, cp=1, zero=3, recompute="full", microbatch_size=8)
    fits, _ = search(xl, 512, 32, mach, fixed, top=2)
    assert [r["dp_shard"] for r in fits] == [8, 0], fits
    assert fits[0]["seconds"]["dp"] < fits[1]["seconds"]["dp"]
    assert fits[0]["memory_bytes"]["optimizer"] == 4 * fits[1]["memory_bytes"]["optimizer"]
    # --link-gbit 1 (refmp.cost.nodes.cluster): nodes of 2 ranks on a 1 Gbit/s link, dp 4
    slow = cluster(replace(mach, gpus_per_node=2), 2, 1.0, 50.0)
    small = GPTConfig(n_layer=4, n_embd=128, n_head=4, vocab_size=256, block_size=64)
    fixed = dict(tp=1, pp=1, cp=1, zero=3, recompute="none", microbatch_size=2,
                 mixed_precision="none")
    fits, _ = search(small, 16, 4, slow, fixed, top=2)
    assert [r["dp_shard"] for r in fits] == [2, 0], fits
    long = GPTConfig(n_layer=48, n_embd=1600, n_head=32, vocab_size=50257, block_size=16384)
    fixed = dict(tp=1, pp=1, cp=16, cp_algo="ring", zero=1, recompute="full", microbatch_size=1)
    fits, _ = search(long, 512, 16, mach, fixed, top=5)
    best = {r["cp_ulysses"]: r["step_seconds"] for r in fits}
    assert fits[0]["cp_ulysses"] > 1 and best[1] > fits[0]["step_seconds"], best


def test_a_shard_group_across_nodes_is_warned_of():
    """refmp train's warning (shard_notes, pure): none when every shard group is on a node."""
    sizes = dict(pp=1, dp=4, cp=1, tp=1, ep=1)
    assert shard_notes(sizes, (0, 0, 1, 1), 2) == [] and shard_notes(sizes, (0, 1, 2, 3), 0) == []
    (note,) = shard_notes(sizes, (0, 1, 2, 3), 2)  # nodes of one rank: every group crosses
    assert note.startswith("--dp-shard 2: the shard group of world ranks 0, 1 spans nodes"), note
    assert shard_notes({**sizes, "dp": 2, "cp": 2}, (0, 0, 1, 1), 1) == []  # dp 2 x cp 2
