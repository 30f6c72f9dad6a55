"""What tensor parallelism (refmp.parallel.tensor.linear) moves on tp in one step.

Communication per training step on tp, b = rows per dp rank, s = T, h = C, w bytes/element
(checked exactly against the ledger by tests/test_tensor_parallel.py; with context
parallelism s is the T/cp tokens of a rank). Every term but the
replicated gradients' is linear in b, so M micro-batches of b/M rows move the same bytes in
M times as many calls:

    without SP: allreduce       (4 L + 2) b s h w  +  3 b s w
                (per layer 2 forward (g) + 2 backward (f); the embedding's g; the head's f;
                 the cross-entropy's max, sum-exp and target logit)
    with SP:    reduce_scatter  (4 L + 2) b s h w
                allgather       (6 L + 3) b s h w   (2 per column layer, incl. the LM head,
                                                     are the re-gathers of Korthikanti 4.2.3)
                allreduce       3 b s w  +  w * (replicated parameters)
"""

from __future__ import annotations


def comm_bytes_per_step(b: int, s: int, h: int, n_layer: int, sp: bool, itemsize: int,
                        n_replicated: int = 0) -> dict[str, int]:
    """The bytes the ledger records on tp in one step, by collective (any micro-batching).

    b rows per dp rank, s = T, h = C; n_replicated: elements of the replicated parameters,
    whose gradients SP sums over tp. The formula in the module docstring.
    """
    act, L_ = b * s * h * itemsize, n_layer  # one (b, s, h) activation
    loss = 3 * b * s * itemsize  # the cross-entropy's max, sum of exponentials, target logit
    if not sp:
        return {"allreduce": (4 * L_ + 2) * act + loss, "allgather": 0, "reduce_scatter": 0}
    return {"allreduce": loss + n_replicated * itemsize, "allgather": (6 * L_ + 3) * act,
            "reduce_scatter": (4 * L_ + 2) * act}
