"""fp16's loss scale seen where it shows: the gradient norm with clipping off, an SGD run, and
Sharder.master_grads (Micikevicius et al. 2018, sec. 3.2: backward starts from the loss times
a scale S, and the gradients are divided by S before the optimizer).

A gradient left scaled is S = 2^16 times too large, yet AdamW's step is blind to a gradient's
scale and clipping that bites hides it too, so the mixed-precision parity tests cannot see
it. Tolerances are test_mixed_precision's: u the unit roundoff, GRAD_K u per gradient.
"""

import numpy as np
import pytest
from mpi4py import MPI
from test_engine import config, data
from test_mixed_precision import GRAD_K, ROUNDOFF, update_distance

from refmp.distributed.comm import Comm
from refmp.distributed.grid import ProcessGrid
from refmp.parallel.data.sharder import Sharder
from refmp.training.trainer import Trainer


def scaled_run(mp: str, **kw) -> tuple:
    """Serial run, fp32 masters, no clipping: (gradient norms, losses, whole weights before
    and after), the weights where ``update_distance`` reads them."""
    cfg = config(dtype="float32", grad_clip=0.0, mixed_precision=mp, **kw)
    tr = Trainer(cfg, grid=ProcessGrid(MPI.COMM_SELF), dataset=data())
    w0 = tr.runner.full_params()
    recs = [tr.step() for _ in range(cfg.steps)]
    norms, losses = (np.array([r[k] for r in recs]) for k in ("grad_norm", "loss"))
    return norms, losses, w0, tr.runner.full_params()


@pytest.mark.parametrize("mp", ["bf16", "fp16"])
@pytest.mark.parametrize("opt", [dict(), dict(optimizer="sgd", lr=0.1)], ids=["adamw", "sgd"])
def test_gradient_norms_equal_fp32s_without_clipping(mp, opt):
    """With clipping off the gradient norm is what the optimizer is given, unclipped: every
    step's norm within GRAD_K u of the fp32 run's (fp16: after dividing by the loss scale,
    2^16; not dividing makes it 2^16 times fp32's). SGD's update is lr times the gradients
    themselves (AdamW's is blind to a gradient's scale), so its 3 steps' update, and every
    loss, are held to the gradient's tolerance too (measured: norms <= 1.7 u, SGD's update
    <= 1.3 u)."""
    u, fp32, mixed = ROUNDOFF[mp], scaled_run("none", **opt), scaled_run(mp, **opt)
    np.testing.assert_array_less(np.abs(mixed[0] - fp32[0]) / fp32[0], GRAD_K * u)
    if opt:
        np.testing.assert_array_less(np.abs(mixed[1] - fp32[1]) / fp32[1], GRAD_K * u)
        assert update_distance(mixed, fp32) <= GRAD_K * u


def test_master_grads_widen_and_unscale_the_owned_gradient():
    """Sharder.master_grads(scale): the owned fp16 gradient, widened to fp32 and divided by
    the scale (a power of two: exact), as pieces named like ``params``; the same arrays are
    what full_local(grads=True) reports. scale 1: widened only."""
    rng = np.random.default_rng(0)
    local = {"w": rng.standard_normal((2, 3)).astype(np.float32),
             "b": rng.standard_normal(3).astype(np.float32)}
    groups = {"u": Comm(MPI.COMM_SELF, "dp")}
    sharder = Sharder(local, {"u": ["w", "b"]}, groups, stage=0, compute=np.float16)
    g16 = {k: (rng.standard_normal(v.shape) * 2.0**12).astype(np.float16)
           for k, v in local.items()}
    sharder.accumulate("u", g16)
    for scale in (2.0**16, 1.0):
        pieces = sharder.master_grads(scale)
        assert sorted(pieces) == sorted(sharder.params)
        full = sharder.full_local(grads=True)
        for k, g in g16.items():
            want = g.astype(np.float32) / np.float32(scale)
            assert pieces[k].dtype == np.float32
            np.testing.assert_array_equal(pieces[k], want.ravel())
            np.testing.assert_array_equal(full[k], want)
