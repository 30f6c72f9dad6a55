"""Activation recomputation (Korthikanti et al. 2022, sec. 5): the same run, bitwise.

``--recompute full`` keeps each block's input and runs its forward again inside its
backward; ``selective`` drops attention's (B, NH, T, T) softmax and recomputes it. Both
repeat the same operations in the same order, so losses, gradients and weights are bitwise
those of ``none``, in any layout (drawn by hypothesis on 4 ranks, zb-h1 and experts
included); and the memory they save is exactly the bytes they do not keep.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from mpi4py import MPI
from mpi_helpers import Mismatches, collective
from test_engine import config, data, layouts

from refmp.distributed.grid import ProcessGrid
from refmp.training.trainer import Trainer

pytestmark = pytest.mark.mpi


def run(cfg, ds, grid=None):
    """(losses, whole gradients, whole weights, peak activations) of cfg's steps."""
    tr = Trainer(cfg, grid=grid, dataset=ds)
    losses = [tr.step()["loss"] for _ in range(cfg.steps)]
    return losses, tr.runner.full_grads(), tr.runner.full_params(), tr.memory()["activations"]


@pytest.mark.parallel(nprocs=4)
@settings(max_examples=5)
@given(layout=layouts(world=4))
@collective
def test_recompute_is_bitwise_the_same_run(layout):
    kw, V = layout
    ds, bad = data(V), Mismatches()
    base = run(config(**kw, steps=2), ds)
    for mode in ("selective", "full"):
        other = run(config(**kw, steps=2, recompute=mode), ds)
        bad.check(np.testing.assert_array_equal, other[0], base[0], err_msg=f"{mode} loss")
        for k in base[1] or {}:  # rank 0 holds the gathered model
            bad.check(np.testing.assert_array_equal, other[1][k], base[1][k],
                      err_msg=f"{mode} gradient {k}")
            bad.check(np.testing.assert_array_equal, other[2][k], base[2][k],
                      err_msg=f"{mode} weight {k}")
    bad.assert_none()


def test_recompute_saves_exactly_what_it_does_not_keep():
    """Serial: selective keeps what none keeps (the attention, refmp.nn.flash, keeps no
    softmax to drop); full keeps, per block, only its input (B T C) of the block's whole cache."""
    cfg = config(steps=1)
    ds, grid = data(), ProcessGrid(MPI.COMM_SELF)
    B, T, C, NH, L, w = cfg.batch_size, cfg.block_size, cfg.n_embd, cfg.n_head, cfg.n_layer, 8
    none = run(cfg, ds, grid)[3]
    selective = run(config(steps=1, recompute="selective"), ds, grid)[3]
    full = run(config(steps=1, recompute="full"), ds, grid)[3]
    assert none == selective
    # what a block's cache holds beyond its input, measured on one block of the same shapes
    from refmp.nn import gpt
    from refmp.nn.params import GPTConfig, init_params
    from refmp.runtime.arrays import activation_bytes

    mc = GPTConfig(17, T, 1, NH, C)
    p = gpt.block_params(init_params(mc, 0, "float64"), 0)
    x = np.random.default_rng(0).standard_normal((B, T, C))
    _, cache = gpt.block_forward(p, x, gpt.Ops(NH))
    per_block = activation_bytes(cache, p.values())  # the block's cache, its input included
    assert none - full == L * (per_block - B * T * C * w)
