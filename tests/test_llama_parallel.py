"""The Llama block split over real MPI ranks equals the serial model (float64): tp with
grouped-query attention (tp larger than the key/value heads: replicated heads, their
gradients summed over the copies), cp (ring and Ulysses, zig-zag chunks) with the rotary
tables at each token's global position, dp, and their products.

Every rank runs the serial model on the whole batch itself (the same weights: the same
draw), then its share of the layout: its dp rows, its cp tokens (SequenceChunks), its tp
shard of each parameter (refmp.parallel.tensor.llama.shard). After each step the loss (its
share, summed over dp x cp) and every gradient and weight shard it holds are compared with
the serial run's piece; two AdamW steps.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import Mismatches, collective

from refmp.distributed.grid import ProcessGrid
from refmp.nn import llama as LM
from refmp.parallel.context.chunks import SequenceChunks
from refmp.parallel.context.ring import RingAttention
from refmp.parallel.context.ulysses import UlyssesAttention
from refmp.parallel.tensor import llama as TPL
from refmp.training.optim import AdamW

pytestmark = pytest.mark.mpi

TOL = dict(rtol=1e-9, atol=1e-12)
B, T, V = 4, 8, 23


def config(n_kv_head: int) -> LM.LlamaConfig:
    return LM.LlamaConfig(vocab_size=V, block_size=T, n_layer=2, n_head=4, n_kv_head=n_kv_head,
                          n_embd=16, n_inner=24, rope_theta=100.0)


def run_layout(dp: int, cp: int, tp: int, n_kv_head: int, algo: str = "ring") -> None:
    cfg = config(n_kv_head)
    grid = ProcessGrid(MPI.COMM_WORLD, dp=dp, cp=cp, tp=tp)
    d, c, t = (grid.coords[a] for a in ("dp", "cp", "tp"))
    serial = LM.Llama.create(cfg, seed=3, dtype="float64")
    whole = {k: v.copy() for k, v in serial.params.items()}
    mine = LM.Llama(cfg, {k: TPL.shard(k, v, cfg, t, tp).copy() for k, v in whole.items()})
    seq = SequenceChunks(T, cp, "zigzag")
    pos = seq.positions(c)
    core = None
    if cp > 1:
        core = (RingAttention(grid.comm["cp"], seq) if algo == "ring"
                else UlyssesAttention(grid.comm["cp"], seq))
    if tp > 1:
        ops = TPL.TensorOps(cfg, grid.comm["tp"], core, pos)
    else:
        ops = LM.Ops(cfg.n_head, cfg.n_kv_head, core, pos)
    kv = TPL.kv_group(grid.comm["tp"], cfg)
    dpcp = grid.group("dp", "cp")
    opts = [AdamW(m.params, lr=1e-2, weight_decay=0.1) for m in (serial, mine)]
    bad = Mismatches()
    rng = np.random.default_rng(7)
    rows = slice(d * B // dp, (d + 1) * B // dp)
    for step in range(2):
        idx, tgt = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))
        loss, cache = serial.forward(idx, tgt)
        serial.zero_grad()
        serial.backward(cache)
        share, cache = mine.forward(idx[rows][:, pos], tgt[rows][:, pos], B * T, ops)
        mine.zero_grad()
        mine.backward(cache)
        for g in mine.grads.values():  # the shares of every token: summed over dp x cp
            dpcp.allreduce(g)
        TPL.reduce_kv_grads(mine.grads, kv)
        total = dpcp.allreduce(np.array([share]))[0]
        bad.check(np.testing.assert_allclose, total, loss, **TOL, err_msg=f"loss at step {step}")
        for k, g in mine.grads.items():
            want = TPL.shard(k, serial.grads[k], cfg, t, tp)
            bad.check(np.testing.assert_allclose, g, want, **TOL, err_msg=f"gradient {k} at {step}")
        for o, m in zip(opts, (serial, mine)):
            o.step(m.grads)
        for k, w in mine.params.items():
            want = TPL.shard(k, serial.params[k], cfg, t, tp)
            bad.check(np.testing.assert_allclose, w, want, **TOL, err_msg=f"weight {k} at {step}")
    # the ledger: Megatron's four all-reduces of (b, T/cp, C) per block, and the copies'
    # key/value gradients (C, HS) each, k and v, per block, when tp > NKV
    act = (B // dp) * (T // cp) * cfg.n_embd * 8
    want = 2 * cfg.n_layer * 4 * act if tp > 1 else 0
    bad.check(np.testing.assert_equal, grid.ledger.bytes("allreduce", "tp"), want,
              err_msg="tp all-reduce bytes")
    kv_want = 2 * cfg.n_layer * 2 * cfg.n_embd * cfg.head_size * 8 if tp > n_kv_head else 0
    bad.check(np.testing.assert_equal, grid.ledger.bytes("allreduce", "tp-kv"), kv_want,
              err_msg="key/value copies' all-reduce bytes")
    bad.assert_none(MPI.COMM_WORLD)


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("n_kv_head", [1, 2])
@collective
def test_tp4_with_fewer_kv_heads_than_ranks(n_kv_head):
    run_layout(1, 1, 4, n_kv_head)


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("algo", ["ring", "ulysses"])
@collective
def test_cp4_rotary_at_global_positions(algo):
    run_layout(1, 4, 1, 2, algo)


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("dp,cp,tp,n_kv_head,algo", [(1, 2, 2, 1, "ring"), (2, 1, 2, 2, "ring"),
                                                     (2, 2, 1, 2, "ulysses")])
@collective
def test_products_of_layouts(dp, cp, tp, n_kv_head, algo):
    """tp > NKV under cp; tp = NKV (no copies) under dp."""
    run_layout(dp, cp, tp, n_kv_head, algo)
