"""Tensor parallelism for the Llama block (refmp.nn.llama): Megatron's split with grouped-query
attention.

Shapes: C channels, F the MLP's width, NH query heads, NKV key/value heads, HS head size,
R = NH/NKV query heads per key/value head; tp tensor-parallel ranks.

The split is Megatron's (refmp.parallel.tensor.linear): q, k, v, gate and up are
column-parallel (rank r computes its heads, its F/tp columns of both SwiGLU halves, so that
silu(g) * u acts on columns it owns), o_proj and down_proj row-parallel; f (identity forward,
all-reduce backward) enters each parallel region and g (all-reduce forward) leaves it: four
all-reduces of (B, T, C) per block per micro-batch, as GPT-2's. RMSNorm weights, the
embedding and the head are replicated (every tp rank computes them on the same tokens, so
their gradients agree without a sum).

Grouped-query attention adds one question: which key/value heads a rank holds.

* tp <= NKV: rank r holds query heads [r NH/tp, (r+1) NH/tp) and key/value heads
  [r NKV/tp, (r+1) NKV/tp): exactly the ones those query heads read (head h reads h // R).
* tp > NKV (tp a multiple of NKV): a rank's NH/tp query heads all read one key/value head,
  j = r // (tp/NKV), so k_proj's and v_proj's columns of head j are *replicated* on the tp/NKV
  ranks of its group. Each copy's gradient is the part of the true one that its rank's query
  heads produced: the copies' gradients are summed over the group (``kv`` below) before the
  optimizer, and then every copy takes the same step.
"""

from __future__ import annotations

from refmp.distributed.comm import Comm
from refmp.errors import ConfigError
from refmp.nn import llama as LM
from refmp.parallel.tensor import sequence as SP
from refmp.runtime import backend

COLUMN = ("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight",
          "mlp.gate_proj.weight", "mlp.up_proj.weight")  # split along dim 1
ROW = ("attn.o_proj.weight", "mlp.down_proj.weight")  # split along dim 0
KV = ("attn.k_proj.weight", "attn.v_proj.weight")


def check_tp(cfg: LM.LlamaConfig, tp: int) -> None:
    """Refuse a tp that does not split the heads and the MLP evenly."""
    if cfg.n_head % tp or cfg.n_inner % tp:
        raise ConfigError(f"--tp {tp} must divide n_head ({cfg.n_head}) and n_inner "
                          f"({cfg.n_inner})")
    if cfg.n_kv_head % tp and tp % cfg.n_kv_head:
        raise ConfigError(f"--tp {tp} must divide n_kv_head ({cfg.n_kv_head}) or be a multiple "
                          f"of it (then each key/value head is replicated on tp/n_kv_head ranks)")


def kv_heads(cfg: LM.LlamaConfig, rank: int, tp: int) -> range:
    """The key/value heads tp rank ``rank`` holds (see the module docstring)."""
    if tp <= cfg.n_kv_head:
        per = cfg.n_kv_head // tp
        return range(rank * per, rank * per + per)
    j = rank // (tp // cfg.n_kv_head)  # the head its query heads read
    return range(j, j + 1)


def shard(name: str, w, cfg: LM.LlamaConfig, rank: int, tp: int):
    """Rank ``rank``'s piece of the whole parameter ``w`` (refmp.nn.llama's ``name``)."""
    inner = name.split(".", 2)[-1]
    if inner in KV:
        hs = cfg.head_size
        held = kv_heads(cfg, rank, tp)
        return w[:, held.start * hs : held.stop * hs]  # (C, NKV HS /tp), or one head's
    if inner in COLUMN:
        n = w.shape[1] // tp
        return w[:, rank * n : (rank + 1) * n]  # (C, out/tp)
    if inner in ROW:
        n = w.shape[0] // tp
        return w[rank * n : (rank + 1) * n]  # (in/tp, C)
    return w  # replicated


def unshard(name: str, pieces: list, cfg: LM.LlamaConfig):
    """shard's inverse: the whole parameter ``name`` from the tp ranks' ``pieces`` (rank
    order). Replicated key/value heads are taken once, from the first rank of their copies."""
    xp = backend.array_module(pieces[0])
    tp = len(pieces)
    inner = name.split(".", 2)[-1]
    if inner in KV and tp > cfg.n_kv_head:
        pieces = pieces[:: tp // cfg.n_kv_head]  # one copy of each head
    if inner in COLUMN:
        return xp.concatenate(pieces, axis=1)
    if inner in ROW:
        return xp.concatenate(pieces, axis=0)
    return pieces[0]


def kv_group(tp: Comm, cfg: LM.LlamaConfig) -> Comm:
    """The tp ranks holding copies of this rank's key/value heads (itself alone when tp <=
    NKV). Collective over ``tp``."""
    j = kv_heads(cfg, tp.rank, tp.size).start
    return Comm(tp.mpi.Split(j, tp.rank), "tp-kv", tp.ledger, tp.recorder)


class TensorOps(LM.Ops):
    """The Llama block's Ops split over ``tp``: NH/tp query heads and this rank's key/value
    heads (kv_heads), f and g around the two parallel regions; around any attention ``core``
    and the ``positions`` of a context-parallel rank."""

    def __init__(self, cfg: LM.LlamaConfig, tp: Comm, core=None, positions=None):
        check_tp(cfg, tp.size)
        super().__init__(cfg.n_head // tp.size, len(kv_heads(cfg, tp.rank, tp.size)), core,
                         positions)
        self.tp = tp

    def enter_backward(self, dh):
        """f backward: each rank's dX is its columns' part, summed."""
        return self.tp.allreduce(dh)  # (B, T, C) partial over tp -> summed

    def leave(self, z):
        """g forward: completes the row-parallel sum over the ranks' rows."""
        return self.tp.allreduce(z)  # (B, T, C) partial over tp -> summed


class SequenceOps(TensorOps):
    """Tensor parallelism with sequence parallelism (Korthikanti et al. 2022, sec. 4.2): the
    residual stream, the RMSNorms, the embedding and the head hold T/tp of the tokens; f
    all-gathers them along T before the column-parallel projections (reduce-scatter
    backward) and g reduce-scatters the row-parallel sums along T (all-gather backward).
    The replicated weights (RMSNorms, wte, lm_head) then see T/tp tokens a rank: their
    gradients are partial over tp (reduce_sp_grads). The projections keep the gathered
    (B, T, C) input for their backward (Korthikanti's sec. 4.2.3 keeps the T/tp shard and
    gathers it again: less memory, one more all-gather each)."""

    def __init__(self, cfg: LM.LlamaConfig, tp: Comm, core=None, positions=None):
        super().__init__(cfg, tp, core, positions)
        self.sequence_shards = tp.size

    def sequence(self, a):
        """This rank's T/tp tokens of ``a`` (B, T, ...): the residual stream's share."""
        n = a.shape[1] // self.tp.size
        return a[:, self.tp.rank * n : (self.tp.rank + 1) * n]

    def enter(self, h):
        return SP.gather_from_sp(h, self.tp)  # (B, T/tp, C) -> (B, T, C)

    def enter_backward(self, dh):
        return SP.gather_from_sp_backward(dh, self.tp)  # (B, T, C) partial -> (B, T/tp, C)

    def leave(self, z):
        return SP.reduce_scatter_to_sp(z, self.tp)  # (B, T, C) partial -> (B, T/tp, C)

    def leave_backward(self, dz):
        return SP.reduce_scatter_to_sp_backward(dz, self.tp)  # (B, T/tp, C) -> (B, T, C)


def reduce_sp_grads(grads: dict, tp: Comm) -> None:
    """Sequence parallelism: sum over tp the gradients of the weights every tp rank holds
    whole but saw only T/tp tokens for (in place)."""
    for name, g in grads.items():
        inner = name.split(".", 2)[-1]
        if inner not in COLUMN and inner not in ROW and not name.endswith(".padding"):
            tp.allreduce(g)  # partial over tp -> summed


def reduce_kv_grads(grads: dict, kv: Comm) -> None:
    """Sum the replicated key/value projections' gradients over their copies (in place):
    each copy saw only its own rank's query heads. Nothing to do when tp <= NKV."""
    if kv.size == 1:
        return
    for name, g in grads.items():
        if name.split(".", 2)[-1] in KV:
            kv.allreduce(g)  # (C, HS) partial over the copies -> summed
