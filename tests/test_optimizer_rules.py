"""Rules the parity tests cannot see, held against their own statement.

The serial reference of tests/parity.py runs through the same Sharder as every layout, so a
wrong rule there is wrong in both runs and they still agree. Weight decay is such a rule:
AdamW's decoupled decay goes to the matrices only (ndim >= 2: the linear weights and the
embeddings; Loshchilov & Hutter 2019, as GPT-2 training does), never to biases, LayerNorm
gains and shifts, or ZeRO's padding. Written out here from the parameters' shapes.
"""

import numpy as np
import pytest
from mpi4py import MPI

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
