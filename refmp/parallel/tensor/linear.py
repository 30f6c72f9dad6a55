"""Tensor parallelism (Megatron-LM) and sequence parallelism: the layers.

Shapes: B batch (this dp rank's rows), T time, C channels, NH heads, HS head size (C/NH);
tp tensor-parallel ranks; ``/tp`` in a shape comment marks the axis that is split over tp,
"partial over tp" a tensor that still needs a sum over tp.

Megatron-LM (Shoeybi et al. 2019, sec. 3, fig. 3) splits each transformer block's two
matrix pairs so that a block needs one all-reduce forward and one backward per pair:

* a **column-parallel** linear ``Y = X [W_1 | ... | W_tp]`` gives rank r the columns
  ``Y_r = X W_r`` (no communication: X is replicated);
* a **row-parallel** linear ``Z = [Y_1 | ... | Y_tp] [W_1; ...; W_tp] = sum_r Y_r W_r`` takes
  rank r's columns of Y as they are and leaves a *partial* sum: one all-reduce completes it.

Column then row, the nonlinearity in between acts on columns a rank owns (GELU is elementwise;
attention heads are independent), so ``MLP(X) = sum_r GELU(X A_r) B_r``.

The communication sits in two operators, Megatron's f and g, named here by what they do:
``copy_to_tp`` (f: identity forward, all-reduce backward) enters the parallel region and
``reduce_from_tp`` (g: all-reduce forward, identity backward) leaves it.

Sequence parallelism (Korthikanti et al. 2022, sec. 4.2) shards the rest of the block (the
LayerNorms, residual adds) along T instead of replicating it: f becomes ``gather_from_sp``
(all-gather along T forward, reduce-scatter backward) and g becomes ``reduce_scatter_to_sp``
(reduce-scatter forward, all-gather backward): same bytes on the wire, since an all-reduce
is a reduce-scatter followed by an all-gather. The column-parallel layers keep only the
T/tp shard of their input and all-gather it again in backward (sec. 4.2.3): that is where
the activation memory goes down by tp, at the cost of one more all-gather per column layer.

The bytes these layers move on tp per step: refmp.cost.tensor.comm_bytes_per_step.
"""

from __future__ import annotations

from refmp.distributed.comm import Comm
from refmp.nn import layers as L
from refmp.runtime.backend import array_module

# --- the f and g operators (Megatron fig. 3), as forward/backward pairs -------------------


def copy_to_tp(x, comm: Comm):
    """f, forward: identity. Every rank already holds the whole X."""
    return x


def copy_to_tp_backward(dx, comm: Comm):
    """f, backward: all-reduce. Each rank's dX = dY_r W_r^T is its columns' part of dX."""
    return comm.allreduce(dx)  # (B, T, C) partial over tp -> summed


def reduce_from_tp(x, comm: Comm):
    """g, forward: all-reduce. Completes the row-parallel sum_r Y_r W_r."""
    return comm.allreduce(x)  # (B, T, C) partial over tp -> summed


def reduce_from_tp_backward(dx, comm: Comm):
    """g, backward: identity. dZ reaches every rank's partial product unchanged."""
    return dx


def _swap_bt(x):
    """(B, T, C) <-> (T, B, C), contiguous: Comm's collectives split and join axis 0, and
    sequence parallelism splits time."""
    return array_module(x).ascontiguousarray(x.transpose(1, 0, 2))


def gather_from_sp(x, comm: Comm):
    """SP's f, forward: all-gather the T/tp shards into the whole sequence (Korthikanti g)."""
    return _swap_bt(comm.allgather(_swap_bt(x)))  # (B, T/tp, C) -> (B, T, C)


def gather_from_sp_backward(dx, comm: Comm):
    """SP's f, backward: reduce-scatter: sum the ranks' partial dX, keep my T/tp rows."""
    return _swap_bt(comm.reduce_scatter(_swap_bt(dx)))  # (B, T, C) -> (B, T/tp, C)


def reduce_scatter_to_sp(x, comm: Comm):
    """SP's g, forward: reduce-scatter the row-parallel partial sums along T."""
    return _swap_bt(comm.reduce_scatter(_swap_bt(x)))  # (B, T, C) partial -> (B, T/tp, C)


def reduce_scatter_to_sp_backward(dx, comm: Comm):
    """SP's g, backward: all-gather dZ, which every rank's partial product needs whole."""
    return _swap_bt(comm.allgather(_swap_bt(dx)))  # (B, T/tp, C) -> (B, T, C)


# --- column- and row-parallel linear layers -------------------------------------------------


def column_forward(x, w, b, comm: Comm, sp: bool = False):
    """Y_r = X W_r + b_r with W_r (C_in, C_out/tp): this rank's columns (Megatron eq. 3).

    x is (B, T, C_in) replicated, or (B, T/tp, C_in) with sequence parallelism.
    """
    xf = gather_from_sp(x, comm) if sp else copy_to_tp(x, comm)  # (B, T, C_in)
    out, cache = L.linear_forward(xf, w, b)  # (B, T, C_out/tp)
    if sp:  # keep only my T/tp shard of the input; backward gathers it again (sec. 4.2.3)
        cache = (x, w, b is not None)
    return out, (cache, sp)


def column_backward(dout, cache, comm: Comm):
    """dX = sum_r dY_r W_r^T (f's all-reduce, or SP's reduce-scatter); dW_r = X^T dY_r."""
    (x, w, has_bias), sp = cache
    if sp:
        x = gather_from_sp(x, comm)  # (B, T, C_in) again: recomputed, not stored
    dx, dw, db = L.linear_backward(dout, (x, w, has_bias))  # dx (B, T, C_in) partial over tp
    dx = gather_from_sp_backward(dx, comm) if sp else copy_to_tp_backward(dx, comm)
    return dx, dw, db  # dx (B, T, C_in) or (B, T/tp, C_in); dw (C_in, C_out/tp)


def row_forward(x, w, b, comm: Comm, sp: bool = False):
    """Z = sum_r Y_r W_r + b with W_r (C_in/tp, C_out): this rank's rows (Megatron eq. 3).

    The bias is added once, after the reduction (adding it on every rank would count it tp
    times). Returns (B, T, C_out), or (B, T/tp, C_out) with sequence parallelism.
    """
    z, cache = L.linear_forward(x, w)  # (B, T, C_out) partial over tp
    z = reduce_scatter_to_sp(z, comm) if sp else reduce_from_tp(z, comm)
    z += b  # (B, T, C_out) or (B, T/tp, C_out)
    return z, (cache, sp)


def row_backward(dout, cache, comm: Comm):
    """db = sum of dZ; dY_r = dZ W_r^T (this rank's columns of dY); dW_r = Y_r^T dZ."""
    lin, sp = cache
    db = dout.sum(axis=tuple(range(dout.ndim - 1)))  # (C_out,) partial over tp with SP
    dz = reduce_scatter_to_sp_backward(dout, comm) if sp else reduce_from_tp_backward(dout, comm)
    dx, dw, _ = L.linear_backward(dz, lin)  # dx (B, T, C_in/tp), dw (C_in/tp, C_out)
    return dx, dw, db


# --- the zero-bubble split of the two (Qi et al. 2023): B now, W later ------------------
# The split keeps every collective, only moving some into W: a row-parallel layer's B does
# its g backward (identity, or SP's all-gather of dZ) and keeps dZ for W; a column-parallel
# layer's B computes dX = dY W_r^T and its f backward (all-reduce, or SP's reduce-scatter),
# and its W does SP's re-gather of X (Korthikanti sec. 4.2.3) just before dW = X^T dY. The tp
# ranks of a stage run the same W slots, so those all-gathers still pair up.


def column_backward_input(dout, cache, comm: Comm):
    """B of a column-parallel layer: dX = sum_r dY_r W_r^T (f backward); what W needs."""
    lin, sp = cache
    dx = L.linear_backward_input(dout, lin)  # (B, T, C_in) partial over tp
    dx = gather_from_sp_backward(dx, comm) if sp else copy_to_tp_backward(dx, comm)
    return dx, (dout, cache)


def column_backward_weight(dout, cache, comm: Comm):
    """W of a column-parallel layer: dW_r = X^T dY_r, db_r (SP re-gathers X here)."""
    (x, w, has_bias), sp = cache
    if sp:
        x = gather_from_sp(x, comm)  # (B, T, C_in): the SP re-gather
    return L.linear_backward_weight(dout, (x, w, has_bias))


def row_backward_input(dout, cache, comm: Comm):
    """B of a row-parallel layer: dY_r = dZ W_r^T (g backward first); what W needs."""
    lin, sp = cache
    dz = reduce_scatter_to_sp_backward(dout, comm) if sp else reduce_from_tp_backward(dout, comm)
    return L.linear_backward_input(dz, lin), (dout, dz, lin)


def row_backward_weight(dout, dz, lin):
    """W of a row-parallel layer: dW_r = Y_r^T dZ; db = sum of dZ (partial over tp with SP)."""
    db = dout.sum(axis=tuple(range(dout.ndim - 1)))  # (C_out,)
    return L.linear_backward_weight(dz, lin)[0], db
