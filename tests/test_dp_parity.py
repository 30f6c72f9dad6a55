"""Level 2/3: data-parallel training equals the serial run, under real MPI (float64).

Rank 0 trains the serial model itself (on MPI.COMM_SELF, the whole batch) beside the
data-parallel engine (on COMM_WORLD, each rank its rows of the batch): loss, norm, every
gradient after the all-reduce and clipping, every weight after each step (tests/parity.py).
Then the ledger: the gradients are all-reduced once per step in total (8 bytes per parameter
in float64), in as many calls as the Sharder's bucket rule forms buckets. The hierarchical
all-reduce on simulated nodes equals the flat one bitwise (tests/test_nodes.py: real ones),
and those nodes hold blocks of consecutive ranks, as a launch places them.
"""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_helpers import Mismatches, collective
from parity import assert_same_run

from refmp.cost.zero import unit_sizes
from refmp.distributed import topology
from refmp.distributed.grid import ProcessGrid
from refmp.nn import GPTConfig
from refmp.training.datasets import Dataset
from refmp.training.trainer import TrainConfig, Trainer

pytestmark = pytest.mark.mpi


def buckets_per_step(sizes: dict[str, int], bucket_mb: float, itemsize: int) -> int:
    """All-reduce calls per step of stage 0 (DDP's rule, refmp.parallel.data.sharder.Sharder):
    units become ready in backward order, ln_f, h.{L-1}, ..., h.0, then wte and wpe in the
    embedding's backward (with pp = 1 the tied wte is complete only then); a bucket starts
    as soon as the ready units hold ``bucket_mb``; what is left goes after backward.
    ``bucket_mb`` 0: one all-reduce of everything after backward."""
    limit = int(bucket_mb * 2**20)
    if limit <= 0:
        return 1
    L = sum(u.startswith("h.") for u in sizes)
    calls, held = 0, 0
    for u in ["ln_f", *(f"h.{i}" for i in reversed(range(L))), "wte", "wpe"]:
        held += itemsize * sizes[u]
        if held >= limit:
            calls, held = calls + 1, 0
    return calls + (held > 0)


def assert_same_run_and_ledger(cfg: TrainConfig, ds: Dataset) -> int:
    """Parity with the serial run, then the dp ledger; returns the buckets per step."""
    par = assert_same_run(cfg, ds)
    assert par.grid.sizes["dp"] == MPI.COMM_WORLD.size
    sizes = unit_sizes(par.mcfg)  # elements of wte, wpe, each block, ln_f
    n_buckets = buckets_per_step(sizes, cfg.bucket_mb, 8)
    led = par.grid.ledger  # every gradient once per step: 8 bytes per parameter in float64
    assert led.bytes("allreduce", "dp") == cfg.steps * 8 * sum(sizes.values())
    assert led.count("allreduce", "dp") == cfg.steps * n_buckets, (led.as_dict(), n_buckets)
    return n_buckets


@pytest.mark.parallel(nprocs=[2, 4])
@settings(max_examples=6)
@given(n_layer=st.integers(1, 2), n_head=st.integers(1, 2), hs=st.integers(1, 4),
       V=st.integers(3, 17), T=st.integers(2, 6), rows=st.integers(1, 2), M=st.integers(1, 2),
       bucket_mb=st.sampled_from([25.0, 0.0, 1e-3, 4e-3]),
       optimizer=st.sampled_from(["adamw", "sgd"]), clip=st.sampled_from([0.0, 0.05, 10.0]),
       shuffle=st.booleans(), seed=st.integers(0, 1000))
@example(n_layer=2, n_head=2, hs=4, V=17, T=6, rows=1, M=2, bucket_mb=1e-3, optimizer="adamw",
         clip=0.05, shuffle=False, seed=1)  # every block fills a 1e-3 MB bucket alone
@collective
def test_dp_training_equals_serial(n_layer, n_head, hs, V, T, rows, M, bucket_mb, optimizer,
                                   clip, shuffle, seed):
    size = MPI.COMM_WORLD.size
    cfg = TrainConfig(n_layer=n_layer, n_head=n_head, n_embd=n_head * hs, block_size=T,
                      batch_size=rows * M * size, steps=3, optimizer=optimizer, lr=0.01,
                      warmup_steps=1, momentum=0.9, grad_clip=clip, dtype="float64", seed=seed,
                      shuffle=shuffle, progress=False, microbatches=M, bucket_mb=bucket_mb)
    rng = np.random.default_rng(seed)
    ds = Dataset(rng.integers(0, V, 200), V, "random")
    n_buckets = assert_same_run_and_ledger(cfg, ds)
    if bucket_mb == 25.0:  # the default: a tiny model fills no bucket, one all-reduce a step
        assert n_buckets == 1


@pytest.mark.parallel(nprocs=2)
@collective
def test_dp_addition_task_equals_serial():
    """The built-in task, AdamW with clipping that bites, a few steps (a golden run), with
    the default 25 MB buckets (one all-reduce a step) and with buckets a little larger than
    a block, where the order units become ready in decides the count."""
    from refmp.training.datasets import AdditionTask

    ds = AdditionTask(3, seed=0, n_train=500, n_test=10).dataset()
    cfg = TrainConfig(n_layer=2, n_head=2, n_embd=16, batch_size=8, steps=4, grad_clip=0.5,
                      dtype="float64", progress=False)
    assert assert_same_run_and_ledger(cfg, ds) == 1
    # ln_f + h.1 fill the first bucket, h.0 + wte the second, wpe goes after backward: 3
    # calls (forward order, or a wte ready at the head, would make 2)
    sizes = unit_sizes(GPTConfig(ds.vocab_size, ds.task.line_len, 2, 2, 16))
    mb = 8 * (sizes["h.0"] + sizes["ln_f"] / 2) / 2**20
    assert assert_same_run_and_ledger(replace(cfg, bucket_mb=mb, steps=2), ds) == 3


@pytest.mark.parallel(nprocs=4)
@collective
def test_hierarchical_all_reduce_equals_flat_bitwise(monkeypatch):
    """--dp-reduce hierarchical over 2 nodes of 2 ranks (simulated: REFMP_RANKS_PER_NODE,
    refmp.distributed.topology): every step's loss and norm and the final weights are the
    flat all-reduce's, bitwise (refmp.parallel.data.hierarchical says why); the ledger: the
    whole gradient reduce-scattered and all-gathered inside a node, half of it all-reduced
    across, and each group labelled intra- or inter-node."""
    monkeypatch.setenv("REFMP_RANKS_PER_NODE", "2")
    ds = Dataset(np.random.default_rng(0).integers(0, 11, 300), 11, "random")
    cfg = TrainConfig(dp=4, n_layer=2, n_head=2, n_embd=8, block_size=5, batch_size=8, steps=3,
                      lr=0.01, warmup_steps=1, dtype="float64", progress=False)
    runs = {}
    for red in ("flat", "hierarchical"):
        tr = Trainer(replace(cfg, dp_reduce=red), dataset=ds)
        steps = [tr.step() for _ in range(cfg.steps)]
        runs[red] = ([(r["loss"], r["grad_norm"]) for r in steps], tr.runner.full_params(),
                     tr.grid.ledger.as_dict())
    bad = Mismatches()
    flat, hier = runs["flat"], runs["hierarchical"]
    bad.check(np.testing.assert_equal, hier[0], flat[0], err_msg="(loss, norm) of each step")
    if MPI.COMM_WORLD.rank == 0:
        for k, w in flat[1].items():
            bad.check(np.testing.assert_array_equal, hier[1][k], w, err_msg=k)
    P = 8 * sum(unit_sizes(GPTConfig(11, 5, 2, 2, 8)).values())  # the gradient's bytes
    whole = flat[2]["allreduce@dp[inter]"]["bytes"]
    bad.check(np.testing.assert_equal, whole, 3 * P)
    bad.check(np.testing.assert_equal, [hier[2].get(k, {}).get("bytes") for k in (
        "reduce_scatter@dp.node[intra]", "allgather@dp.node[intra]", "allreduce@dp.cross[inter]")],
        [whole, whole, whole // 2])  # P even: no padding
    bad.assert_none(MPI.COMM_WORLD)


@pytest.mark.parallel(nprocs=4)
@collective
def test_nodes_hold_blocks_of_consecutive_ranks(monkeypatch):
    """topology.node_ids as a launch places ranks: a block of consecutive ranks on each node
    (mpiexec -ppn k, refmp cluster's launch), nodes numbered in rank order. One host: MPI's
    shared-memory split puts all 4 on node 0; REFMP_RANKS_PER_NODE=k: nodes of k
    consecutive ranks, not dealt round robin; so with tp 2 x dp 2 on 2 nodes the grid keeps
    tp inside a node and sends dp across (Megatron's order)."""
    world = MPI.COMM_WORLD
    got = {"one host": topology.node_ids(world)}
    for k in (1, 2, 4):
        monkeypatch.setenv("REFMP_RANKS_PER_NODE", str(k))
        got[k] = topology.node_ids(world)
    monkeypatch.setenv("REFMP_RANKS_PER_NODE", "2")
    grid = ProcessGrid(world, dp=2, tp=2)
    got["grid"] = grid.nodes
    got["spans"] = {a: grid.ledger.spans[a] for a in ("tp", "dp", "world")}
    bad = Mismatches()
    bad.check(np.testing.assert_equal, got, {
        "one host": (0, 0, 0, 0), 1: (0, 1, 2, 3), 2: (0, 0, 1, 1), 4: (0, 0, 0, 0),
        "grid": (0, 0, 1, 1), "spans": {"tp": "intra", "dp": "inter", "world": "inter"}},
        err_msg=f"each rank's node: {got}")
    bad.assert_none(world)
