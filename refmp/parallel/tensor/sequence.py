"""Sequence parallelism (Korthikanti et al. 2022, sec. 4.2): tensor parallelism's layers
(refmp.parallel.tensor.linear, .vocab) with the rest of the block split along T.

Shapes: B batch, T time, C channels, V vocabulary, Vl = Vp/tp vocabulary rows per rank; tp
tensor-parallel ranks; ``T/tp`` marks a sequence split over tp.

Outside its linears, a tp block replicates its work on every tp rank: the LayerNorms, the
residual adds, the dropout-free activations between blocks. SP shards those along T instead,
so each rank holds T/tp of the tokens there. Only Megatron's f and g change:

* f becomes ``gather_from_sp`` (all-gather along T forward, reduce-scatter backward): a
  column-parallel linear needs the whole sequence;
* g becomes ``reduce_scatter_to_sp`` (reduce-scatter forward, all-gather backward): the
  row-parallel partial sums are summed and split along T in one collective.

Same bytes on the wire as tp's all-reduces, since an all-reduce is a reduce-scatter followed
by an all-gather. The column-parallel layers keep only the T/tp shard of their input and
all-gather it again in backward (sec. 4.2.3): that is where the activation memory goes down
by tp, at the cost of one more all-gather per column layer. The weights every tp rank saw
only T/tp tokens for (LayerNorms, biases of the row layers, wpe) get gradients that are
partial over tp: the engine sums them (refmp.parallel.placement's "gradient summed over").

Each function here has the name and the arguments of its tp twin, so refmp.parallel.ops
runs a block with either set of layers (``LAYERS``, at the end).
"""

from __future__ import annotations

import sys

from refmp.distributed.comm import Comm
from refmp.nn import fast as L  # refmp.nn.layers' formulas, run fast (refmp.nn.fast)
from refmp.parallel.ops import Layers
from refmp.parallel.tensor import linear, vocab
from refmp.runtime import backend
from refmp.runtime.backend import array_module

# --- SP's f and g, as forward/backward pairs ---------------------------------------------


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


# --- column- and row-parallel linear layers on T/tp shards ------------------------------


def column_forward(x, w, b, comm: Comm):
    """Y_r = X W_r + b_r (tp's column-parallel linear) on x (B, T/tp, C_in): the whole X
    gathered first; only my shard of it kept (sec. 4.2.3)."""
    xf = gather_from_sp(x, comm)  # (B, T, C_in)
    out, _ = L.linear_forward(xf, w, b)  # (B, T, C_out/tp)
    return out, (x, w, b is not None)  # backward gathers x again


def column_backward(dout, cache, comm: Comm):
    """dX (my T/tp rows of sum_r dY_r W_r^T: a reduce-scatter); dW_r = X^T dY_r."""
    x, w, has_bias = cache
    x = gather_from_sp(x, comm)  # (B, T, C_in) again: recomputed, not stored
    dx, dw, db = L.linear_backward(dout, (x, w, has_bias))  # dx (B, T, C_in) partial over tp
    dx = gather_from_sp_backward(dx, comm)
    return dx, dw, db  # dx (B, T/tp, C_in); dw (C_in, C_out/tp)


def row_forward(x, w, b, comm: Comm):
    """Z = sum_r Y_r W_r + b (tp's row-parallel linear), summed and split along T at once.
    Returns (B, T/tp, C_out)."""
    z, cache = L.linear_forward(x, w)  # (B, T, C_out) partial over tp
    z = reduce_scatter_to_sp(z, comm)
    z += b  # (B, T/tp, C_out)
    return z, cache


def row_backward(dout, cache, comm: Comm):
    """db (partial over tp: my T/tp tokens); dY_r = dZ W_r^T; dW_r = Y_r^T dZ."""
    db = dout.sum(axis=tuple(range(dout.ndim - 1)))  # (C_out,) partial over tp
    dz = reduce_scatter_to_sp_backward(dout, comm)  # (B, T, C_out)
    dx, dw, _ = L.linear_backward(dz, cache)  # dx (B, T, C_in/tp), dw (C_in/tp, C_out)
    return dx, dw, db


# --- the zero-bubble split (as tp's): B keeps every collective but the column layer's
# re-gather of X, which W does just before dW = X^T dY. The tp ranks of a stage run the same
# W slots, so those all-gathers still pair up.


def column_backward_input(dout, cache, comm: Comm):
    """B of a column-parallel layer: my T/tp rows of dX (reduce-scatter); what W needs."""
    dx = L.linear_backward_input(dout, cache)  # (B, T, C_in) partial over tp
    dx = gather_from_sp_backward(dx, comm)  # (B, T/tp, C_in)
    return dx, (dout, cache, comm)


def column_backward_weight(dout, cache, comm: Comm):
    """W of a column-parallel layer: dW_r = X^T dY_r, db_r, X gathered again here."""
    x, w, has_bias = cache
    x = gather_from_sp(x, comm)  # (B, T, C_in): the SP re-gather
    return L.linear_backward_weight(dout, (x, w, has_bias))


def row_backward_input(dout, cache, comm: Comm):
    """B of a row-parallel layer: dY_r = dZ W_r^T (g backward: all-gather dZ); what W needs."""
    dz = reduce_scatter_to_sp_backward(dout, comm)  # (B, T, C_out)
    return L.linear_backward_input(dz, cache), (dout, dz, cache)


def row_backward_weight(dout, dz, cache):
    """W of a row-parallel layer: tp's, dW_r = Y_r^T dZ; db partial over tp (my T/tp)."""
    return linear.row_backward_weight(dout, dz, cache)


# --- the vocabulary-parallel ends on T/tp shards -----------------------------------------


def embed_forward(p: dict, idx, comm: Comm, positions=None):
    """x = wte[idx] + wpe[positions] on my T/tp of the tokens: tp's masked lookup, summed
    and split along T by one reduce-scatter. idx (B, T) is replicated; ``positions`` (T,)
    the tokens' global positions (context parallelism), of which I take the r-th T/tp."""
    xp = backend.array_module(p["wte.weight"])
    tok, lookup = vocab.lookup_forward(p["wte.weight"], idx, comm)  # (B, T, C) partial
    tok = reduce_scatter_to_sp(tok, comm)  # (B, T/tp, C)
    if positions is None:
        positions = xp.arange(idx.shape[1])  # (T,)
    T = tok.shape[1]
    positions = positions[comm.rank * T : (comm.rank + 1) * T]  # (T/tp,) mine
    pos, pos_cache = L.embedding_forward(positions, p["wpe.weight"])  # (T/tp, C)
    return tok + pos, (lookup, pos_cache)


def embed_backward(dx, cache, comm: Comm) -> dict:
    """dwte (my Vl rows) from every position holding my ids; dwpe from my positions only,
    so partial over tp (rows of the other ranks' positions are 0 here)."""
    lookup, pos_cache = cache
    dtok = reduce_scatter_to_sp_backward(dx, comm)  # (B, T, C): the reduce-scatter's mirror
    return {
        "wte.weight": vocab.lookup_backward(dtok, lookup),  # (Vl, C)
        "wpe.weight": L.embedding_backward(dx.sum(axis=0), pos_cache),  # (T, C) partial
    }


def logits_forward(p: dict, x, comm: Comm, V: int):
    """Final LayerNorm on my T/tp tokens, then my logits of every token (B, T, Vl)."""
    h, ln_f = L.layernorm_forward(x, p["ln_f.weight"], p["ln_f.bias"])  # (B, T/tp, C)
    wte = p["wte.weight"]
    logits, _ = column_forward(h, wte.T, None, comm)  # (B, T, Vl)
    vocab.mask_padding(logits, comm, V)
    return logits, (ln_f, h, wte)  # wte itself, not a view (ZeRO-3 frees it by name)


def head_forward(p: dict, x, targets, denom, comm: Comm, V: int):
    """Loss share of this rank's rows (the same on every tp rank) and the cache."""
    logits, head = logits_forward(p, x, comm, V)
    loss, ce = vocab.cross_entropy_forward(logits, targets, comm, denom)
    return loss, (head, ce)


def head_backward(dloss, cache, comm: Comm):
    """dx (B, T/tp, C) and the head's gradients: ln_f (partial over tp) and my wte rows."""
    (ln_f, h, wte), ce = cache
    dlogits = vocab.cross_entropy_backward(dloss, ce)  # (B, T, Vl)
    # forward was: logits = h wte_r^T, a column-parallel linear on T/tp shards
    dh, dwte_t, _ = column_backward(dlogits, (h, wte.T, False), comm)  # dwte_t (C, Vl)
    g = {"wte.weight": dwte_t.T}  # (Vl, C)
    dx, g["ln_f.weight"], g["ln_f.bias"] = L.layernorm_backward(dh, ln_f)
    return dx, g


LAYERS = Layers(sys.modules[__name__], sys.modules[__name__])  # ParallelOps' layers with SP
