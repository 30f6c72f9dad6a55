"""The pieces of one block (refmp.nn.gpt.Ops), split for a layout: ``make_ops``.

Shapes: B rows of one micro-batch, T tokens of a sequence this rank holds (T/cp with context
parallelism), C channels, NH heads, V vocabulary, Vl = Vp/tp vocabulary rows per tp rank.

``refmp.nn.gpt.block_forward`` / ``block_backward`` are written once, against an Ops object.
The serial Ops run plain linears, the serial attention core, embedding and head. A layout
changes only the pieces its axes split, each axis touching only its own:

* ``attn`` (cp, refmp.parallel.context; or a decoder's cached attention): another attention
  core, on the heads tp left this rank; ``positions``: the global positions of this rank's
  tokens, for the position embedding. Linears and ends stay serial: :class:`ContextOps`;
* ``tp`` (Megatron, refmp.parallel.tensor.linear): column- and row-parallel linears with f
  and g around them, NH/tp heads a rank, vocabulary-parallel embedding, tied head and
  cross-entropy (refmp.parallel.tensor.vocab): :class:`ParallelOps`, around any ``attn``;
  sequence parallelism hands it its own ``layers`` (refmp.parallel.tensor.sequence.LAYERS);
* experts (refmp.parallel.expert) are not here: the MoE MLP takes its dispatch from its
  MoEContext, so an MoE block composes with all of the above: one object, not a runner per pair.
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

from refmp.distributed.comm import Comm
from refmp.nn import fast as L  # refmp.nn.layers' formulas, run fast (refmp.nn.fast)
from refmp.nn import gpt
from refmp.parallel.tensor import linear, vocab


class Layers(NamedTuple):  # tp's layers by name (SP's: refmp.parallel.tensor.sequence.LAYERS)
    linear: ModuleType  # column_forward, row_forward, their backwards and halves
    vocab: ModuleType  # embed_forward, logits_forward, head_forward, their backwards


MEGATRON = Layers(linear, vocab)  # Megatron's f and g: identity and all-reduce


def make_ops(n_head: int, V: int, tp: Comm, layers: Layers = MEGATRON, attn=None,
             positions=None, keep_scores: bool = True) -> gpt.Ops:
    """The Ops of a layout: ParallelOps over ``tp`` running ``layers`` when it has more than one
    rank; else the serial Ops, around cp's ``attn`` and the tokens' global ``positions`` when
    given (ContextOps). ``keep_scores`` False: selective recomputation of the softmax."""
    if tp.size > 1:
        return ParallelOps(n_head, V, tp, layers, attn, positions, keep_scores)
    if attn is None and positions is None:
        return gpt.Ops(n_head, keep_scores)
    return ContextOps(n_head, attn, positions, keep_scores)


class LocalAttention:
    """The serial attention core (refmp.nn.layers) as an ``attn``: every token of each
    sequence is here, and the heads the Ops compute."""

    def __init__(self, keep_scores: bool = True):
        self.keep_scores = keep_scores

    def forward(self, qkv, n_head: int):
        return L.attention_forward(qkv, n_head, self.keep_scores)  # (B, T, C)

    def backward(self, dout, cache):
        return L.attention_backward(dout, cache)  # (B, T, 3C)


class ContextOps(gpt.Ops):
    """The serial Ops around another attention core ``attn`` (ring attention or Ulysses over
    cp, a decoder's cached attention; None: the serial core), with the global ``positions``
    (T,) of this rank's tokens for the embedding (None: 0..T-1)."""

    def __init__(self, n_head: int, attn=None, positions=None, keep_scores: bool = True):
        super().__init__(n_head, keep_scores)
        self.attn = attn if attn is not None else LocalAttention(keep_scores)
        self.positions = positions

    def attention(self, qkv):
        return self.attn.forward(qkv, self.n_head)  # (B, T, C/tp) on my tokens

    def attention_backward(self, da, cache):
        return self.attn.backward(da, cache)

    def embed(self, p: dict, idx):
        return gpt.embed_forward(p, idx, positions=self.positions)  # (B, T, C)


class ParallelOps(ContextOps):
    """Ops split over ``tp`` (more than one rank): NH/tp heads, column/row-parallel linears,
    vocabulary-parallel ends (Megatron's ``layers``, or SP's along T); around the attention
    core ``attn`` and with the ``positions`` of ContextOps."""

    def __init__(self, n_head: int, V: int, tp: Comm, layers: Layers = MEGATRON, attn=None,
                 positions=None, keep_scores: bool = True):
        super().__init__(n_head // tp.size, attn, positions, keep_scores)  # NH/tp here
        self.V = V
        self.tp = tp
        self.linear = layers.linear
        self.vocab = layers.vocab

    # --- the linears: column-parallel enters the tp region, row-parallel leaves it ------------

    def column(self, x, w, b):
        y, cache = self.linear.column_forward(x, w, b, self.tp)  # (B, T, out/tp)
        return y, ("column", cache)

    def row(self, x, w, b):
        z, cache = self.linear.row_forward(x, w, b, self.tp)  # (B, T, out), or T/tp with SP
        return z, ("row", cache)

    def linear_backward(self, dout, cache):
        kind, c = cache
        back = self.linear.column_backward if kind == "column" else self.linear.row_backward
        return back(dout, c, self.tp)  # dx, dw (my shard), db

    def linear_backward_input(self, dout, cache):
        kind, c = cache
        back = (self.linear.column_backward_input if kind == "column"
                else self.linear.row_backward_input)
        dx, deferred = back(dout, c, self.tp)
        return dx, (kind, deferred)

    def linear_backward_weight(self, item):
        kind, deferred = item
        back = (self.linear.column_backward_weight if kind == "column"
                else self.linear.row_backward_weight)
        return back(*deferred)  # dw (my shard), db

    # --- the ends: token + position embedding, tied head and loss -----------------------------

    def embed(self, p: dict, idx):
        return self.vocab.embed_forward(p, idx, self.tp, self.positions)  # T/tp with SP

    def embed_backward(self, dx, cache) -> dict:
        return self.vocab.embed_backward(dx, cache, self.tp)  # wte (Vl, C); wpe partial with SP

    def head(self, p: dict, x, targets=None, denom=None):
        if targets is None:  # my logits (B, T, Vl)
            return self.vocab.logits_forward(p, x, self.tp, self.V)
        return self.vocab.head_forward(p, x, targets, denom, self.tp, self.V)

    def head_backward(self, dloss, cache):
        return self.vocab.head_backward(dloss, cache, self.tp)  # dx like x; my wte rows
