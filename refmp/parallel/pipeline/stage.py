"""The model chunks one pipeline rank holds, as forward / backward / weight-gradient passes.

Shapes: b rows of one micro-batch, T time, C channels, V vocabulary.

A chunk is a run of consecutive blocks (partition.py); chunk 0 also embeds the tokens and
the last chunk also applies ln_f, the tied head and the loss. Every pass calls the pieces
(pieces.py): the serial ones of refmp.nn.gpt, so a chunk computes exactly what the serial
model computes there, or their tensor-parallel twins (tp x pp).
"""

from __future__ import annotations

from refmp.backend import array_module
from refmp.nn import gpt
from refmp.parallel.pipeline.pieces import SerialPieces


class Stage:
    """This rank's parameters, gradients and chunks (chunk id -> block indices); ``pieces``
    runs the embedding, blocks and head (SerialPieces, or TensorPieces for tp x pp)."""

    def __init__(self, params: dict, chunks: dict[int, range], n_chunks: int, n_head: int,
                 pieces=None):
        self.params, self.chunks, self.n_chunks, self.n_head = params, chunks, n_chunks, n_head
        self.pieces = pieces if pieces is not None else SerialPieces()
        self.grads: dict = {}
        self.zero_grad()

    def zero_grad(self) -> None:
        self.grads = {k: array_module(p).zeros_like(p) for k, p in self.params.items()}

    def _add(self, g: dict, prefix: str = "") -> None:
        for k, v in g.items():
            self.grads[prefix + k] += v

    def forward(self, c: int, inp, targets=None, denom=None, pieces=None):
        """Chunk c on one micro-batch: inp is token ids (chunk 0) or the previous chunk's
        output (b, T, C). Returns the output (b, T, C), or the loss share on the last chunk
        (logits without targets), and the cache the backward needs. ``pieces`` overrides
        the stage's own (decoding runs tensor parallelism without SP)."""
        p, first, last = self.params, c == 0, c == self.n_chunks - 1
        run = pieces if pieces is not None else self.pieces
        emb = None
        if first:
            inp, emb = run.embed_forward(p, inp)  # (b, T, C)
        x, blocks = inp, []
        for i in self.chunks[c]:
            x, cache = run.block_forward(gpt.block_params(p, i), x, self.n_head)  # (b, T, C)
            blocks.append(cache)
        head = None
        if last:
            x, head = run.head_forward(p, x, targets, denom)  # scalar: this micro-batch's share
        return x, (emb, blocks, head)

    def backward(self, c: int, dout, cache, split: bool):
        """Chunk c's backward; returns (dx of the chunk's input or None, what W needs).

        dout is the gradient of the chunk's output (b, T, C), or None on the last chunk (the
        loss share's own gradient is 1). Without ``split`` every gradient is accumulated here;
        with it the linears' weight gradients and the embedding's are left for :meth:`weight`.
        """
        emb, blocks, head = cache
        run, dx = self.pieces, dout
        if head is not None:
            dx, g = run.head_backward(1.0, head)  # (b, T, C); ln_f and wte (tied) gradients
            self._add(g)
        todo = []
        for i, bc in zip(reversed(self.chunks[c]), reversed(blocks), strict=True):
            if split:
                dx, g, w_todo = run.block_backward_input(dx, bc)  # (b, T, C)
                todo.append((i, w_todo))
            else:
                dx, g = run.block_backward(dx, bc)  # (b, T, C)
            self._add(g, f"h.{i}.")
        if emb is None:
            return dx, todo
        if split:
            todo.append(("embed", (dx, emb)))
        else:
            self._add(run.embed_backward(dx, emb))  # wte: the embedding's share (tied)
        return None, todo

    def weight(self, todo) -> None:
        """The W pass: the weight gradients a split backward deferred."""
        for i, w in todo:
            if i == "embed":
                self._add(self.pieces.embed_backward(*w))
            else:
                self._add(self.pieces.block_backward_weight(w), f"h.{i}.")
