"""The model chunks one pipeline rank holds, as forward / backward / weight-gradient passes.

Shapes: b rows of one micro-batch, T time, C channels, V vocabulary.

A chunk is a run of consecutive blocks (partition.py); chunk 0 also embeds the tokens and
the last chunk also applies ln_f, the tied head and the loss. Every pass reuses the serial
pieces of refmp.nn.gpt, so a chunk computes exactly what the serial model computes there.
"""

from __future__ import annotations

from refmp.backend import array_module
from refmp.nn import gpt


class Stage:
    """This rank's parameters, gradients and chunks (chunk id -> block indices)."""

    def __init__(self, params: dict, chunks: dict[int, range], n_chunks: int, n_head: int):
        self.params, self.chunks, self.n_chunks, self.n_head = params, chunks, n_chunks, n_head
        self.grads: dict = {}
        self.zero_grad()

    def zero_grad(self) -> None:
        self.grads = {k: array_module(p).zeros_like(p) for k, p in self.params.items()}

    def _add(self, g: dict, prefix: str = "") -> None:
        for k, v in g.items():
            self.grads[prefix + k] += v

    def forward(self, c: int, inp, targets=None, denom=None):
        """Chunk c on one micro-batch: inp is token ids (chunk 0) or the previous chunk's
        output (b, T, C). Returns the output (b, T, C), or the loss share on the last chunk,
        and the cache the backward needs."""
        p, first, last = self.params, c == 0, c == self.n_chunks - 1
        emb = None
        if first:
            inp, emb = gpt.embed_forward(p, inp)  # (b, T, C)
        x, blocks = inp, []
        for i in self.chunks[c]:
            x, cache = gpt.block_forward(gpt.block_params(p, i), x, self.n_head)  # (b, T, C)
            blocks.append(cache)
        head = None
        if last:
            x, head = gpt.head_forward(p, x, targets, denom)  # scalar: this micro-batch's share
        return x, (emb, blocks, head)

    def backward(self, c: int, dout, cache, split: bool):
        """Chunk c's backward; returns (dx of the chunk's input or None, what W needs).

        dout is the gradient of the chunk's output (b, T, C), or None on the last chunk (the
        loss share's own gradient is 1). Without ``split`` every gradient is accumulated here;
        with it the linears' weight gradients and the embedding's are left for :meth:`weight`.
        """
        emb, blocks, head = cache
        dx = dout
        if head is not None:
            dx, g = gpt.head_backward(1.0, head)  # (b, T, C); ln_f and wte (tied) gradients
            self._add(g)
        todo = []
        for i, bc in zip(reversed(self.chunks[c]), reversed(blocks), strict=True):
            if split:
                dx, g, w_todo = gpt.block_backward_input(dx, bc)  # (b, T, C)
                todo.append((i, w_todo))
            else:
                dx, g = gpt.block_backward(dx, bc)  # (b, T, C)
            self._add(g, f"h.{i}.")
        if emb is None:
            return dx, todo
        if split:
            todo.append(("embed", (dx, emb)))
        else:
            self._add(gpt.embed_backward(dx, emb))  # wte: the embedding's share (tied)
        return None, todo

    def weight(self, todo) -> None:
        """The W pass: the weight gradients a split backward deferred."""
        for i, w in todo:
            if i == "embed":
                self._add(gpt.embed_backward(*w))
            else:
                self._add(gpt.block_backward_weight(w), f"h.{i}.")
