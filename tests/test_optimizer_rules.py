"""Rules the parity tests cannot see, held against their own statement.

The serial reference of tests/parity.py runs through the same Sharder as every layout, so a
wrong rule there is wrong in both runs and they still agree. Weight decay is such a rule:
AdamW's decoupled decay goes to the matrices only (ndim >= 2: the linear weights and the
embeddings; Loshchilov & Hutter 2019, as GPT-2 training does), never to biases, LayerNorm
gains and shifts, or ZeRO's padding. Written out here from the parameters' shapes.
The learning-rate schedule (refmp.config.lr_at) is another: the serial run reads the same
function. Written out here step by step, and against PyTorch's LambdaLR.
"""

import importlib.util
import math

import numpy as np
import pytest
from extras import reason
from mpi4py import MPI

from refmp.config import lr_at
from refmp.distributed.grid import ProcessGrid
from refmp.parallel.data.sharder import Sharder
from refmp.training.datasets import Dataset
from refmp.training.trainer import TrainConfig, Trainer


class Group:
    """What Sharder's constructor reads of a unit's group: its size and this rank's place."""

    def __init__(self, size: int, rank: int, axis: str = "dp"):
        self.size, self.rank, self.axis = size, rank, axis


def matrices(shapes: dict) -> set[str]:
    return {k for k, s in shapes.items() if len(s) >= 2}


def test_the_trainer_decays_the_matrices_only():
    cfg = TrainConfig(n_layer=2, n_head=2, n_embd=8, block_size=4, batch_size=2, steps=1,
                      dtype="float64", progress=False, n_expert=2, top_k=1)
    ds = Dataset(np.random.default_rng(0).integers(0, 11, 100), 11, "random")
    tr = Trainer(cfg, grid=ProcessGrid(MPI.COMM_SELF), dataset=ds)
    shapes = {k: v.shape for k, v in tr.runner.full_params().items()}
    want = matrices(shapes)
    assert want and want != set(shapes)  # there are matrices, and vectors that get none
    assert tr.opt.decay == want


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_sharded_pieces_of_a_matrix_decay_and_padding_does_not(stage):
    """A unit of a (3, 3) matrix and a (3,) bias, 12 elements over 5 ranks: padded to 15,
    slices of 3: ranks 0-2 own pieces of the matrix, rank 3 the bias, rank 4 the padding.
    Every owned piece is flat, so decay must go by the parameter's shape, not the piece's."""
    shapes = {"w": (3, 3), "b": (3,)}
    local = {k: np.ones(s) for k, s in shapes.items()}
    owned = set()
    for rank in range(5):
        sh = Sharder(local, {"u": list(shapes)}, {"u": Group(5, rank)}, stage)
        assert all(p.ndim == 1 for p in sh.params.values())
        assert sh.decay == matrices(shapes) & set(sh.params), (rank, sorted(sh.params))
        owned |= set(sh.params)
    assert owned == set(shapes) | ({"u.padding"} if stage else set())


# lr 0.6, 3 warm-up steps of 7, to a tenth: the warm-up climbs lr (s + 1) / 3 to the top at
# step 2; then a half cosine over the 4 steps left, 0.06 + 0.54 (1 + cos(pi (s - 3) / 4)) / 2,
# from the top at step 3 to 0.06 at step 7 (the step after the last)
HALF_DOWN = 0.5 * (1 + math.sqrt(0.5))  # (1 + cos(pi / 4)) / 2
WRITTEN_OUT = [0.2, 0.4, 0.6, 0.6, 0.06 + 0.54 * HALF_DOWN, 0.06 + 0.54 * 0.5,
               0.06 + 0.54 * (1 - HALF_DOWN), 0.06]


def test_the_learning_rate_schedule_is_written_out_step_by_step():
    """Linear warm-up to lr, then a cosine to min_lr_ratio lr; no warm-up starts at the top;
    constant stays at lr; and a run's steps take those rates in turn."""
    cfg = TrainConfig(lr=0.6, warmup_steps=3, steps=7, min_lr_ratio=0.1)
    assert [lr_at(cfg, s) for s in range(8)] == pytest.approx(WRITTEN_OUT, rel=1e-12)
    cold = TrainConfig(lr=0.6, warmup_steps=0, steps=4, min_lr_ratio=0.1)  # a quarter a step
    assert [lr_at(cold, s) for s in range(5)] == pytest.approx(
        [0.6, 0.06 + 0.54 * HALF_DOWN, 0.33, 0.06 + 0.54 * (1 - HALF_DOWN), 0.06], rel=1e-12)
    whole = TrainConfig(lr=0.6, warmup_steps=2, steps=2)  # all warm-up
    assert [lr_at(whole, s) for s in range(2)] == pytest.approx([0.3, 0.6], rel=1e-12)
    flat = TrainConfig(lr=0.6, warmup_steps=3, steps=7, lr_schedule="constant")
    assert [lr_at(flat, s) for s in range(8)] == [0.6] * 8
    run = TrainConfig(n_layer=1, n_head=2, n_embd=8, block_size=4, batch_size=2, steps=7,
                      lr=0.6, warmup_steps=3, min_lr_ratio=0.1, progress=False)
    ds = Dataset(np.random.default_rng(0).integers(0, 11, 100), 11, "random")
    tr = Trainer(run, grid=ProcessGrid(MPI.COMM_SELF), dataset=ds)
    assert [tr.step()["lr"] for _ in range(7)] == pytest.approx(WRITTEN_OUT[:7], rel=1e-12)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason=reason("torch", "hf"))
@pytest.mark.parametrize("warmup, steps", [(3, 7), (0, 5), (1, 2), (10, 40)])
def test_the_learning_rate_schedule_is_lambdalr_with_nanogpts_formula(warmup, steps):
    """torch.optim.lr_scheduler.LambdaLR stepping nanoGPT's get_lr (the GPT-2 reproduction's:
    warm-up lr (it + 1) / W, then cosine decay to min_lr at max_steps), one rate a step."""
    import torch

    max_lr, min_lr = 6e-4, 6e-5

    def get_lr(it):
        if it < warmup:
            return max_lr * (it + 1) / warmup
        if it > steps:
            return min_lr
        decay_ratio = (it - warmup) / (steps - warmup)
        coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
        return min_lr + coeff * (max_lr - min_lr)

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=max_lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: get_lr(it) / max_lr)
    cfg = TrainConfig(lr=max_lr, warmup_steps=warmup, steps=steps, min_lr_ratio=0.1)
    for it in range(steps + 1):
        assert lr_at(cfg, it) == pytest.approx(sched.get_last_lr()[0], rel=1e-12), it
        opt.step()
        sched.step()
