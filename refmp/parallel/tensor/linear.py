"""Tensor parallelism (Megatron-LM): the column- and row-parallel linear layers.

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
``reduce_from_tp`` (g: all-reduce forward, identity backward) leaves it. Sequence parallelism
(refmp.parallel.tensor.sequence) is the same two layers with other f and g.

The bytes these layers move on tp per step: refmp.cost.tensor.comm_bytes_per_step.
"""

from __future__ import annotations

from refmp.distributed.comm import Comm
from refmp.nn import layers as L

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


# --- column- and row-parallel linear layers -------------------------------------------------


def column_forward(x, w, b, comm: Comm):
    """Y_r = X W_r + b_r with W_r (C_in, C_out/tp): this rank's columns (Megatron eq. 3).
    x (B, T, C_in) is replicated."""
    x = copy_to_tp(x, comm)  # (B, T, C_in)
    return L.linear_forward(x, w, b)  # (B, T, C_out/tp)


def column_backward(dout, cache, comm: Comm):
    """dX = sum_r dY_r W_r^T (f's all-reduce); dW_r = X^T dY_r."""
    dx, dw, db = L.linear_backward(dout, cache)  # dx (B, T, C_in) partial over tp
    dx = copy_to_tp_backward(dx, comm)
    return dx, dw, db  # dx (B, T, C_in); dw (C_in, C_out/tp)


def row_forward(x, w, b, comm: Comm):
    """Z = sum_r Y_r W_r + b with W_r (C_in/tp, C_out): this rank's rows (Megatron eq. 3).

    The bias is added once, after the reduction (adding it on every rank would count it tp
    times). Returns (B, T, C_out), replicated.
    """
    z, cache = L.linear_forward(x, w)  # (B, T, C_out) partial over tp
    z = reduce_from_tp(z, comm)
    z += b  # (B, T, C_out)
    return z, cache


def row_backward(dout, cache, comm: Comm):
    """db = sum of dZ; dY_r = dZ W_r^T (this rank's columns of dY); dW_r = Y_r^T dZ."""
    db = dout.sum(axis=tuple(range(dout.ndim - 1)))  # (C_out,)
    dz = reduce_from_tp_backward(dout, comm)
    dx, dw, _ = L.linear_backward(dz, cache)  # dx (B, T, C_in/tp), dw (C_in/tp, C_out)
    return dx, dw, db


# --- the zero-bubble split of the two (Qi et al. 2023): B now, W later ------------------
# The split keeps every collective in B: a row-parallel layer's B does its g backward
# (identity) and keeps dZ for W; a column-parallel layer's B computes dX = dY W_r^T and its f
# backward (all-reduce). A B returns (dX, what its W needs); W is a function of that alone.


def column_backward_input(dout, cache, comm: Comm):
    """B of a column-parallel layer: dX = sum_r dY_r W_r^T (f backward); what W needs."""
    dx = L.linear_backward_input(dout, cache)  # (B, T, C_in) partial over tp
    dx = copy_to_tp_backward(dx, comm)
    return dx, (dout, cache)


def column_backward_weight(dout, cache):
    """W of a column-parallel layer: dW_r = X^T dY_r, db_r."""
    return L.linear_backward_weight(dout, cache)


def row_backward_input(dout, cache, comm: Comm):
    """B of a row-parallel layer: dY_r = dZ W_r^T (g backward first); what W needs."""
    dz = reduce_from_tp_backward(dout, comm)
    return L.linear_backward_input(dz, cache), (dout, dz, cache)


def row_backward_weight(dout, dz, cache):
    """W of a row-parallel layer: dW_r = Y_r^T dZ; db = sum of dZ."""
    db = dout.sum(axis=tuple(range(dout.ndim - 1)))  # (C_out,)
    return L.linear_backward_weight(dz, cache)[0], db
