"""Data parallelism: every rank holds the whole model and a slice of the global batch.

Shapes: B global batch (sequences per step), dp data-parallel ranks, T time.

Each dp rank takes rows [r*B/dp, (r+1)*B/dp) of the step's batch (refmp.data.dp_rows) and
computes its loss as a *share of the global mean*: the sum of its tokens' losses divided by
the global token count B*T (not by its own B/dp*T). The gradient of that share is the rank's
share of the global gradient, so a plain sum over dp gives exactly the serial gradient:

    grad = d/dw (1/(B T) sum_{all tokens} l)  =  sum_r  d/dw (1/(B T) sum_{rank r's tokens} l)

(Averaging per-rank means instead is the same only when every rank has the same token count;
summing shares is exact always, and it is what micro-batching will rely on too.)

Communication: one all-reduce of all gradients per step, packed into one flat buffer so the
ledger shows one call of 4 or 8 bytes per parameter. Bucketing and overlap come later.
"""

from __future__ import annotations

from refmp.backend import array_module
from refmp.comm import Comm
from refmp.data import dp_rows


def flatten(arrays: list):
    """One contiguous 1-D buffer holding ``arrays`` back to back (a copy)."""
    xp = array_module(*arrays)
    return xp.concatenate([a.reshape(-1) for a in arrays])


def unflatten_into(flat, arrays: list) -> None:
    """Copy consecutive pieces of ``flat`` back into ``arrays`` (in place)."""
    o = 0
    for a in arrays:
        a[...] = flat[o : o + a.size].reshape(a.shape)
        o += a.size


def allreduce_grads(grads: dict, comm: Comm) -> None:
    """Sum every gradient over the data-parallel ranks, in place (one all-reduce)."""
    if comm.size == 1:
        return
    arrays = list(grads.values())
    flat = flatten(arrays)  # (P,) all gradients
    comm.allreduce(flat)  # sum of the ranks' shares = the global gradient
    unflatten_into(flat, arrays)


class DataParallel:
    """Plain data parallelism, and the interface every strategy's runner offers the Trainer.

    A runner owns how one step's forward and backward are computed and communicated; the
    Trainer owns the batch, the optimizer and the logging. The interface:

    * ``params`` / ``grads``: the arrays this rank updates, by GPT-2 name (shards welcome);
    * ``batch_rows(B)``: which rows of the global batch this rank reads;
    * ``forward_backward(x, y, denom)``: accumulate this rank's gradients, return its loss
      share (its tokens' loss sum / denom, denom = global token count);
    * ``reduce_grads()``: communicate so that ``grads`` is the global gradient of ``params``;
    * ``grad_sum_sq(local)``: add partial sums of squares over ranks owning other elements;
    * ``loss_total(share)``: the global mean loss from the shares;
    * ``generate(idx, n)``: greedy decoding (collective where the model is split);
    * ``eval_comm``: the ranks that split evaluation prompts between them;
    * ``full_params()``: the whole model with GPT-2 names (gathered) on rank 0, else None.
    """

    def __init__(self, model, grid):
        self.model, self.grid = model, grid
        self.dp = grid.comm["dp"]
        self.eval_comm = self.dp

    @property
    def params(self) -> dict:
        return self.model.params

    @property
    def grads(self) -> dict:
        return self.model.grads

    def batch_rows(self, B: int) -> slice:
        return dp_rows(B, self.dp.size, self.dp.rank)

    def zero_grad(self) -> None:
        self.model.zero_grad()

    def forward_backward(self, x, y, denom: int) -> float:
        # (b, T) rows -> this rank's share; MoE routing statistics are summed over dp
        loss, cache = self.model.forward(x, y, denom, stats_comm=self.dp)
        self.model.backward(cache)
        self.stats = self.model.moe_stats(cache)  # {} for a dense model
        return float(loss)

    def reduce_grads(self) -> None:
        allreduce_grads(self.model.grads, self.dp)  # every rank now holds the global gradient

    def grad_sum_sq(self, local: float) -> float:
        return local  # gradients are replicated after reduce_grads: count them once

    def loss_total(self, share: float) -> float:
        return self.dp.allreduce_scalar(share)  # sum of shares = the global mean loss

    def generate(self, idx, n: int):
        return self.model.generate(idx, n)

    def full_params(self) -> dict | None:
        return self.model.params if self.grid.rank == 0 else None
