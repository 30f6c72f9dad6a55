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
