"""ParallelOps: the pieces of one block (refmp.nn.gpt.Ops), split for a layout.

Shapes: B rows of one micro-batch, T tokens of a sequence this rank holds (T/cp with context
parallelism), C channels, NH heads, V vocabulary, Vl = Vp/tp vocabulary rows per tp rank.

``refmp.nn.gpt.block_forward`` / ``block_backward`` are written once, against an Ops object.
The serial Ops run plain linears, the serial attention core and the serial embedding and
head. ParallelOps composes what a layout asks for, each axis touching only its own piece:

* ``tp`` (Megatron, refmp.parallel.tensor.linear): the linears become column- and row-parallel
  with f and g around them (or, with ``sp``, sequence parallelism's all-gather and
  reduce-scatter), each rank computes NH/tp heads, and the embedding, tied head and
  cross-entropy are vocabulary-parallel (refmp.parallel.tensor.vocab);
* ``attn`` (context parallelism, refmp.parallel.context.chunks): the attention core becomes ring
  attention or Ulysses over cp, on whatever heads tp left this rank; ``positions`` are the
  global positions of this rank's tokens, for the position embedding;
* experts (refmp.parallel.expert) are not here: the MoE MLP takes its dispatch from the
  MoEContext the engine builds, so an MoE block composes with all of the above.

Composition is composition of Ops, not a runner per combination: tp x cp x SP is one object.
"""

from __future__ import annotations

from refmp.distributed.comm import Comm
from refmp.nn import gpt
from refmp.parallel.tensor import linear as tpl
from refmp.parallel.tensor import vocab as vocab
from refmp.runtime.backend import array_module


class ParallelOps(gpt.Ops):
    """Ops on ``tp`` (None or a size-1 axis: serial linears), with SP, a CP attention core
    ``attn`` (None: serial), and ``positions`` (None: 0..T-1) for the embedding."""

    def __init__(self, n_head: int, V: int, tp: Comm | None = None, sp: bool = False,
                 attn=None, positions=None, keep_scores: bool = True):
        self.tp = tp if tp is not None and tp.size > 1 else None
        super().__init__(n_head // (self.tp.size if self.tp else 1), keep_scores)  # NH/tp here
        self.V, self.sp, self.attn, self.positions = V, sp and self.tp is not None, attn, positions

    def for_decoding(self) -> ParallelOps:
        """The same tp split on whole prompts: serial attention, no SP (prompts of any
        length; SP and CP change where activations live, not the numbers)."""
        return ParallelOps(self.n_head * (self.tp.size if self.tp else 1), self.V, self.tp)

    # --- the linears: column-parallel enters the tp region, row-parallel leaves it ------------

    def column(self, x, w, b):
        if self.tp is None:
            return super().column(x, w, b)
        y, cache = tpl.column_forward(x, w, b, self.tp, self.sp)  # (B, T, out/tp)
        return y, ("column", cache)

    def row(self, x, w, b):
        if self.tp is None:
            return super().row(x, w, b)
        z, cache = tpl.row_forward(x, w, b, self.tp, self.sp)  # (B, T, out), or T/tp with SP
        return z, ("row", cache)

    def linear_backward(self, dout, cache):
        if self.tp is None:
            return super().linear_backward(dout, cache)
        kind, c = cache
        back = tpl.column_backward if kind == "column" else tpl.row_backward
        return back(dout, c, self.tp)  # dx, dw (my shard), db

    def linear_backward_input(self, dout, cache):
        if self.tp is None:
            return super().linear_backward_input(dout, cache)
        kind, c = cache
        back = tpl.column_backward_input if kind == "column" else tpl.row_backward_input
        dx, item = back(dout, c, self.tp)
        return dx, (kind, item)

    def linear_backward_weight(self, item):
        if self.tp is None:
            return super().linear_backward_weight(item)
        kind, item = item
        if kind == "column":
            return tpl.column_backward_weight(*item, self.tp)
        return tpl.row_backward_weight(*item)

    # --- the attention core: serial, or ring / Ulysses over cp --------------------------------

    def attention(self, qkv):
        if self.attn is None:
            return super().attention(qkv)
        return self.attn.forward(qkv, self.n_head)  # (B, T, C/tp) on my tokens

    def attention_backward(self, da, cache):
        if self.attn is None:
            return super().attention_backward(da, cache)
        return self.attn.backward(da, cache)

    # --- the ends: token + position embedding, tied head and loss -----------------------------

    def embed(self, p: dict, idx):
        if self.tp is None:
            return gpt.embed_forward(p, idx, positions=self.positions)  # (B, T, C)
        return vocab.embed_forward(p, idx, self.tp, self.sp, self.positions)  # T/tp with SP

    def embed_backward(self, dx, cache) -> dict:
        if self.tp is None:
            return gpt.embed_backward(dx, cache)
        return vocab.embed_backward(dx, cache, self.tp)  # wte (Vl, C); wpe partial with SP

    def head(self, p: dict, x, targets=None, denom=None):
        if self.tp is None:
            return gpt.head_forward(p, x, targets, denom)
        if targets is None:  # my logits (B, T, Vl)
            return vocab.logits_forward(p, x, self.tp, self.V, self.sp)
        return vocab.head_forward(p, x, targets, denom, self.tp, self.V, self.sp)

    def head_backward(self, dloss, cache):
        if self.tp is None:
            return gpt.head_backward(dloss, cache)
        return vocab.head_backward(dloss, cache, self.tp)  # dx like x; my wte rows

    def next_token(self, logits_last):
        if self.tp is None:
            return super().next_token(logits_last)
        # the global argmax over the vocabulary shards (B, Vl): an all-gather over tp
        return vocab.argmax_forward(array_module(logits_last).ascontiguousarray(logits_last), self.tp)
