"""Vocabulary-parallel embedding, tied LM head and cross-entropy (Megatron-LM).

Shapes: B batch, T time, C channels, V vocabulary, Vp = V padded up to a multiple of tp,
Vl = Vp/tp rows of the token embedding on each rank, N = B*T tokens.

``wte`` (Vp, C) is split by rows: rank r holds token ids [r*Vl, (r+1)*Vl). The same shard
serves twice, as GPT-2 ties them (Shoeybi et al. 2019, sec. 3, "input embedding"):

* **embedding**: each rank looks up the ids it owns and writes zeros for the others, so the
  sum over tp of the (B, T, C) lookups is the serial lookup: one all-reduce (g), or with
  sequence parallelism one reduce-scatter along T;
* **LM head**: logits = h wte^T is a column-parallel linear (weight wte_r^T, no bias): rank r
  gets the logits of its own Vl ids, (B, T, Vl), and they are never gathered;
* **cross-entropy** on logits split over the vocabulary needs three sums over tp of (N,)
  vectors only: the max (for stability), the sum of exponentials, and the target's logit:

      loss_i = log sum_r sum_{v in r} exp(l_iv - m_i) - (l_{i,y_i} - m_i),  m_i = max_r max_v l_iv

If tp does not divide V, the rows [V, Vp) are padding: zero weights whose logits are set to
-inf, so their softmax weight is exactly 0, they never win an argmax, and their gradient is 0.
"""

from __future__ import annotations

from refmp.distributed.comm import Comm
from refmp.nn import layers as L
from refmp.parallel.tensor.linear import (
    column_backward,
    column_forward,
    reduce_from_tp,
    reduce_scatter_to_sp,
    reduce_scatter_to_sp_backward,
)
from refmp.runtime import backend
from refmp.runtime.precision import autocast

# --- embedding: masked lookup, then a sum over tp ------------------------------------------


def embed_forward(p: dict, idx, comm: Comm, sp: bool = False, positions=None):
    """x = wte[idx] + wpe[positions], with wte split by rows over tp.

    idx (B, T) is replicated. Returns (B, T, C) replicated, or (B, T/tp, C) with sequence
    parallelism (then this rank's positions are the r-th T/tp of them). ``positions`` (T,),
    if given, are the tokens' global positions (context parallelism).
    """
    xp = backend.array_module(p["wte.weight"])
    Vl = p["wte.weight"].shape[0]
    start = comm.rank * Vl
    local = idx - start  # (B, T) row in my shard, if the id is there
    in_shard = (local >= 0) & (local < Vl)  # (B, T)
    local = xp.where(in_shard, local, 0)
    tok, tok_cache = L.embedding_forward(local, p["wte.weight"])  # (B, T, C)
    tok[~in_shard] = 0.0  # (B, T, C) partial over tp: only my ids are filled in
    # the sum over tp puts every token's row in place (each id is owned by exactly one rank)
    tok = reduce_scatter_to_sp(tok, comm) if sp else reduce_from_tp(tok, comm)
    if positions is None:
        positions = xp.arange(idx.shape[1])  # (T,)
    if sp:  # my T/tp of them (context parallelism: of this rank's cp tokens)
        T = tok.shape[1]
        positions = positions[comm.rank * T : (comm.rank + 1) * T]
    pos, pos_cache = L.embedding_forward(positions, p["wpe.weight"])  # (T, C)
    return tok + pos, (tok_cache, in_shard, pos_cache, sp)


def embed_backward(dx, cache, comm: Comm) -> dict:
    """dwte (my Vl rows) from the positions holding my ids; dwpe from my positions.

    With sequence parallelism dwpe is partial over tp (rows of the other ranks' positions
    are 0 here): the caller sums it over tp with the other replicated gradients.
    """
    (local, w_shape), in_shard, pos_cache, sp = cache
    # forward was: tok = sum over tp (g): backward identity, or all-gather with SP
    dtok = reduce_scatter_to_sp_backward(dx, comm) if sp else dx  # (B, T, C)
    # only the positions holding my ids (as cross_entropy_backward below): the forward wrote
    # zeros at the others, so no gradient reaches my rows from them (mapped to row 0, they
    # would make one index repeat N (1 - 1/tp) times in the scatter-add)
    return {
        "wte.weight": L.embedding_backward(dtok[in_shard], (local[in_shard], w_shape)),  # (Vl, C)
        "wpe.weight": L.embedding_backward(dx.sum(axis=0), pos_cache),  # (T, C)
    }


# --- the tied LM head and the vocab-parallel cross-entropy ----------------------------------


def logits_forward(p: dict, x, comm: Comm, V: int, sp: bool = False):
    """Final LayerNorm, then my logits h wte_r^T (B, T, Vl); padded ids get -inf."""
    h, ln_f = L.layernorm_forward(x, p["ln_f.weight"], p["ln_f.bias"])  # like x
    wte = p["wte.weight"]
    logits, ((x, _, _), sp) = column_forward(h, wte.T, None, comm, sp)  # (B, T, Vl)
    Vl = wte.shape[0]
    n_pad = min(Vl, max(0, comm.rank * Vl + Vl - V))  # ids >= V at the end of my shard
    if n_pad:
        logits[..., Vl - n_pad:] = -float("inf")  # padding: never in the softmax or argmax
    return logits, (ln_f, x, wte, sp)  # wte itself, not a view (ZeRO-3 frees it by name)


def head_forward(p: dict, x, targets, denom, comm: Comm, V: int, sp: bool = False):
    """Loss share of this rank's rows (the same on every tp rank) and the cache."""
    logits, head = logits_forward(p, x, comm, V, sp)
    loss, ce = cross_entropy_forward(logits, targets, comm, denom)
    return loss, (head, ce)


def head_backward(dloss, cache, comm: Comm):
    """dx and the head's gradients: ln_f (replicated) and my share of the tied wte."""
    (ln_f, x, wte, sp), ce = cache
    dlogits = cross_entropy_backward(dloss, ce)  # (B, T, Vl)
    # forward was: logits = h wte_r^T, a column-parallel linear
    dh, dwte_t, _ = column_backward(dlogits, ((x, wte.T, False), sp), comm)  # dwte_t (C, Vl)
    g = {"wte.weight": dwte_t.T}  # (Vl, C)
    dx, g["ln_f.weight"], g["ln_f.bias"] = L.layernorm_backward(dh, ln_f)
    return dx, g


@autocast
def cross_entropy_forward(logits, targets, comm: Comm, denom=None):
    """Vocab-parallel softmax cross-entropy: three all-reduces of (N,), never the logits.

    logits (B, T, Vl) are this rank's columns; targets (B, T) are global ids.
    """
    xp = backend.array_module(logits)
    Vl = logits.shape[-1]
    lg = logits.reshape(-1, Vl)  # (N, Vl)
    tg = targets.reshape(-1)  # (N,)
    denom = tg.size if denom is None else denom
    m = comm.allreduce(lg.max(axis=-1), op="max")  # (N,) global max: all-reduce 1
    shifted = lg - m[:, None]  # (N, Vl)
    sumexp = comm.allreduce(xp.exp(shifted).sum(axis=-1))  # (N,): all-reduce 2
    local = tg - comm.rank * Vl  # (N,) target's column here, if it is in my shard
    in_shard = (local >= 0) & (local < Vl)
    rows = xp.arange(tg.size)
    tgt = xp.where(in_shard, shifted[rows, xp.where(in_shard, local, 0)], 0.0)  # (N,) partial
    tgt = comm.allreduce(tgt)  # (N,) the target's shifted logit: all-reduce 3
    lse = xp.log(sumexp)  # (N,)
    loss = (lse - tgt).sum() / denom  # sum of -log p[target] over my rows / global count
    return loss, (shifted, lse, local, in_shard, denom, logits.shape)


@autocast
def cross_entropy_backward(dout, cache):
    """dlogits_r = (softmax - onehot) / denom * dout on my columns: no communication."""
    shifted, lse, local, in_shard, denom, shape = cache
    xp = backend.array_module(shifted)
    dlogits = xp.exp(shifted - lse[:, None])  # (N, Vl) = my columns of the softmax
    rows = xp.arange(local.size)[in_shard]
    dlogits[rows, local[in_shard]] -= 1.0
    dlogits *= dout / denom
    return dlogits.reshape(shape)  # (B, T, Vl)


@autocast
def argmax_forward(logits_last, comm: Comm):
    """Global argmax of (B, Vl) vocab shards: all-gather each rank's best (value, id).

    Ties go to the lower id, as NumPy's argmax on the full row does (lower ranks own lower ids).
    """
    xp = backend.array_module(logits_last)
    Vl = logits_last.shape[-1]
    j = logits_last.argmax(axis=-1)  # (B,) my best column
    ids = (j + comm.rank * Vl).astype(logits_last.dtype)  # (B,) as global ids
    best = xp.stack([logits_last[xp.arange(j.size), j], ids])  # (2, B)
    every = comm.allgather(best).reshape(comm.size, 2, -1)  # (tp, 2, B): each rank's best
    winner = every[:, 0, :].argmax(axis=0)  # (B,) first rank with the largest value
    return every[winner, 1, xp.arange(j.size)].astype(xp.int64)  # (B,) global ids
