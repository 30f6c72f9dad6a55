"""Data parallelism: every rank holds the whole model and a slice of the global batch.

Shapes: B global batch (sequences per step), dp data-parallel ranks, T time.

Each dp rank takes rows [r*B/dp, (r+1)*B/dp) of the step's batch (dp_rows, below) and
computes its loss as a *share of the global mean*: the sum of its tokens' losses divided by
the global token count B*T (not by its own B/dp*T). The gradient of that share is the rank's
share of the global gradient, so a plain sum over dp gives exactly the serial gradient:

    grad = d/dw (1/(B T) sum_{all tokens} l)  =  sum_r  d/dw (1/(B T) sum_{rank r's tokens} l)

(Averaging per-rank means instead is the same only when every rank has the same token count;
summing shares is exact always, and it is what micro-batching will rely on too.)

Gradient accumulation: the rank's rows are split further into M micro-batches, run one after
the other; each micro-batch's loss is still divided by the *global* B*T, so the gradients it
adds up are exactly the serial ones, and only one reduction per step is needed. Activation
memory is then that of B/(dp M) rows.

Communication: one all-reduce of every gradient per step (4 or 8 bytes per parameter),
bucketed and overlapped with backward as in PyTorch DDP (Li et al. 2020, sec. 3.2): gradients
are grouped, in the order backward produces them (head, last block, ..., first block,
embeddings), into buckets of about ``bucket_mb`` megabytes; as soon as a bucket's last gradient
is ready its nonblocking all-reduce starts, and backward goes on computing the earlier layers
while it runs. All buckets are waited for before the optimizer. With micro-batches, only the
last micro-batch's backward communicates. ``bucket_mb = 0``: one all-reduce after backward.
This is ZeRO stage 0 of refmp.parallel.data.sharder, which does it for whatever a rank holds
(its tp shards, its pipeline stage, its experts); this module keeps the helpers and the idea.

MPICH (like most MPIs) has no progress thread: a started all-reduce advances only while the
rank calls into MPI (the tensor-parallel and pipeline messages of the next layers do that).
"""

from __future__ import annotations

from refmp.distributed.comm import Comm
from refmp.errors import ConfigError
from refmp.runtime.backend import array_module


def dp_rows(B: int, dp: int, dp_rank: int) -> slice:
    """Rows [r*B/dp, (r+1)*B/dp) of the global batch, for data-parallel rank r."""
    if B % dp:
        raise ConfigError(f"--batch-size ({B}) must be divisible by dp ({dp})")
    per = B // dp
    return slice(dp_rank * per, (dp_rank + 1) * per)


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


def split_microbatches(x, y, M: int) -> list:
    """M consecutive, equal row slices of (x, y): micro-batch i is rows [i b, (i+1) b).

    Copied (token ids, small), so a micro-batch's caches hold only its own rows.
    """
    b = x.shape[0] // M
    return [(x[i * b : (i + 1) * b].copy(), y[i * b : (i + 1) * b].copy()) for i in range(M)]
