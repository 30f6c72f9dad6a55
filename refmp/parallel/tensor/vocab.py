"""Vocabulary-parallel embedding, tied LM head and cross-entropy (Megatron-LM).

Shapes: B batch, T time, C channels, V vocabulary, Vp = V padded up to a multiple of tp,
Vl = Vp/tp rows of the token embedding on each rank, N = B*T tokens.

``wte`` (Vp, C) is split by rows: rank r holds token ids [r*Vl, (r+1)*Vl). The same shard
serves twice, as GPT-2 ties them (Shoeybi et al. 2019, sec. 3, "input embedding"):

* **embedding**: each rank looks up the ids it owns and writes zeros for the others, so the
  sum over tp of the (B, T, C) lookups is the serial lookup: one all-reduce (g);
* **LM head**: logits = h wte^T is a column-parallel linear (weight wte_r^T, no bias): rank r
  gets the logits of its own Vl ids, (B, T, Vl), and training never gathers them (a decoder
  does, to pick its token: ``gather_logits``);
* **cross-entropy** on logits split over the vocabulary needs three sums over tp of (N,)
  vectors only: the max (for stability), the sum of exponentials, and the target's logit:

      loss_i = log sum_r sum_{v in r} exp(l_iv - m_i) - (l_{i,y_i} - m_i),  m_i = max_r max_v l_iv

If tp does not divide V, the rows [V, Vp) are padding: zero weights whose logits are set to
-inf, so their softmax weight is exactly 0, they never win an argmax, and their gradient is 0.
Sequence parallelism's embedding and head (refmp.parallel.tensor.sequence) build on the
lookup, the padding and the cross-entropy here.
"""

from __future__ import annotations

from refmp.distributed.comm import Comm
from refmp.nn import fast as L  # refmp.nn.layers' formulas, run fast (refmp.nn.fast)
from refmp.parallel.tensor.linear import (
    column_backward,
    column_forward,
    reduce_from_tp,
    reduce_from_tp_backward,
)
from refmp.runtime import backend
from refmp.runtime.precision import autocast

# --- embedding: masked lookup, then a sum over tp ------------------------------------------


def lookup_forward(wte, idx, comm: Comm):
    """wte[idx] for the ids this rank's rows hold, zeros for the others: (B, T, C) partial
    over tp (each id is owned by exactly one rank, so the sum over tp is the serial lookup)."""
    xp = backend.array_module(wte)
    Vl = wte.shape[0]
    local = idx - comm.rank * Vl  # (B, T) row in my shard, if the id is there
    in_shard = (local >= 0) & (local < Vl)  # (B, T)
    local = xp.where(in_shard, local, 0)
    tok, tok_cache = L.embedding_forward(local, wte)  # (B, T, C)
    tok[~in_shard] = 0.0  # (B, T, C) partial over tp: only my ids are filled in
    return tok, (tok_cache, in_shard)


def lookup_backward(dtok, cache):
    """dwte (my Vl rows) from the positions holding my ids (as cross_entropy_backward below):
    the forward wrote zeros at the others, so no gradient reaches my rows from them (mapped
    to row 0, they would make one index repeat N (1 - 1/tp) times in the scatter-add)."""
    (local, w_shape), in_shard = cache
    return L.embedding_backward(dtok[in_shard], (local[in_shard], w_shape))  # (Vl, C)


def embed_forward(p: dict, idx, comm: Comm, positions=None):
    """x = wte[idx] + wpe[positions], with wte split by rows over tp.

    idx (B, T) is replicated; returns (B, T, C) replicated. ``positions`` (T,), if given, are
    the tokens' global positions (context parallelism).
    """
    xp = backend.array_module(p["wte.weight"])
    tok, lookup = lookup_forward(p["wte.weight"], idx, comm)  # (B, T, C) partial over tp
    tok = reduce_from_tp(tok, comm)  # g: every token's row in place
    if positions is None:
        positions = xp.arange(idx.shape[1])  # (T,)
    pos, pos_cache = L.embedding_forward(positions, p["wpe.weight"])  # (T, C)
    return tok + pos, (lookup, pos_cache)


def embed_backward(dx, cache, comm: Comm) -> dict:
    """dwte (my Vl rows) from the positions holding my ids; dwpe, replicated."""
    lookup, pos_cache = cache
    dtok = reduce_from_tp_backward(dx, comm)  # forward was: tok = sum over tp (g)
    return {
        "wte.weight": lookup_backward(dtok, lookup),  # (Vl, C)
        "wpe.weight": L.embedding_backward(dx.sum(axis=0), pos_cache),  # (T, C)
    }


# --- the tied LM head and the vocab-parallel cross-entropy ----------------------------------


def mask_padding(logits, comm: Comm, V: int) -> None:
    """Set the logits of the padding ids (>= V, at the end of the last shards) to -inf, in
    place: never in the softmax or the argmax."""
    Vl = logits.shape[-1]
    n_pad = min(Vl, max(0, comm.rank * Vl + Vl - V))  # ids >= V at the end of my shard
    if n_pad:
        logits[..., Vl - n_pad:] = -float("inf")


def logits_forward(p: dict, x, comm: Comm, V: int):
    """Final LayerNorm, then my logits h wte_r^T (B, T, Vl); padded ids get -inf."""
    h, ln_f = L.layernorm_forward(x, p["ln_f.weight"], p["ln_f.bias"])  # like x
    wte = p["wte.weight"]
    logits, _ = column_forward(h, wte.T, None, comm)  # (B, T, Vl)
    mask_padding(logits, comm, V)
    return logits, (ln_f, h, wte)  # wte itself, not a view (ZeRO-3 frees it by name)


def head_forward(p: dict, x, targets, denom, comm: Comm, V: int):
    """Loss share of this rank's rows (the same on every tp rank) and the cache."""
    logits, head = logits_forward(p, x, comm, V)
    loss, ce = cross_entropy_forward(logits, targets, comm, denom)
    return loss, (head, ce)


def head_backward(dloss, cache, comm: Comm):
    """dx and the head's gradients: ln_f (replicated) and my share of the tied wte."""
    (ln_f, h, wte), ce = cache
    dlogits = cross_entropy_backward(dloss, ce)  # (B, T, Vl)
    # forward was: logits = h wte_r^T, a column-parallel linear
    dh, dwte_t, _ = column_backward(dlogits, (h, wte.T, False), comm)  # dwte_t (C, Vl)
    g = {"wte.weight": dwte_t.T}  # (Vl, C)
    dx, g["ln_f.weight"], g["ln_f.bias"] = L.layernorm_backward(dh, ln_f)
    return dx, g


def gather_logits(mine, comm: Comm, V: int):
    """The full logits (B, V) from every rank's (B, Vl) columns: one all-gather over tp (a
    decoder picks its token from them, and keeps them)."""
    xp = backend.array_module(mine)
    every = comm.allgather(xp.ascontiguousarray(mine.T))  # (Vp, B)
    return xp.ascontiguousarray(every.T[:, :V])  # (B, V)


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
