"""What a pipeline stage runs for its embedding, blocks and head: serial or tensor-parallel.

Shapes: b rows of one micro-batch, T time, C channels, V vocabulary, Vl = Vp/tp vocabulary
rows of one tp rank; tp tensor-parallel ranks (``/tp`` marks a split axis).

A Stage (stage.py) calls the pieces through one of these objects, so the same stage and
executor run either the serial model's pieces (refmp.nn.gpt) or Megatron's (tp x pp):

* ``SerialPieces``: refmp.nn.gpt's embed / block / head; a stage boundary carries (b, T, C).
* ``TensorPieces``: each block is refmp.parallel.tensor's (column/row-parallel linears, f and
  g on grid.comm["tp"]), the first stage's embedding and the last stage's tied head and loss
  are vocab-parallel (refmp.parallel.vocab). Every tp rank of a stage runs the same action
  list, so their tp collectives pair up; the pp sends and receives go between the ranks of
  the same tp coordinate (grid.comm["pp"] holds exactly those). A stage boundary carries
  (b, T, C) per tp rank, replicated over tp, or (b, T/tp, C) with sequence parallelism (the
  block's output is already sharded along T: Korthikanti et al. 2022, sec. 4.2), so SP also
  divides the pipeline's point-to-point bytes by tp.

The zero-bubble split (B then W) exists for the serial pieces only (check_pipeline_tp).
"""

from __future__ import annotations

from refmp.backend import array_module
from refmp.comm import Comm
from refmp.errors import ConfigError
from refmp.nn import gpt
from refmp.parallel import tensor as tpl
from refmp.parallel import vocab


class SerialPieces:
    """The serial model's pieces, as they are."""

    embed_forward = staticmethod(gpt.embed_forward)  # (p, idx) -> (b, T, C)
    embed_backward = staticmethod(gpt.embed_backward)
    block_forward = staticmethod(gpt.block_forward)  # (p, x, n_head) -> (b, T, C)
    block_backward = staticmethod(gpt.block_backward)
    block_backward_input = staticmethod(gpt.block_backward_input)  # zero bubble: B
    block_backward_weight = staticmethod(gpt.block_backward_weight)  # zero bubble: W
    head_forward = staticmethod(gpt.head_forward)  # loss share, or logits (b, T, V)
    head_backward = staticmethod(gpt.head_backward)

    def act_shape(self, b: int, T: int, C: int) -> tuple[int, int, int]:
        return (b, T, C)  # what crosses a stage boundary

    def next_token(self, logits_last):
        return logits_last.argmax(axis=-1)  # (b,) from (b, V)


class TensorPieces:
    """Megatron's pieces on ``comm`` (grid.comm["tp"]); ``sp``: sequence parallelism."""

    def __init__(self, comm: Comm, V: int, sp: bool = False):
        self.comm, self.V, self.sp = comm, V, sp

    def embed_forward(self, p: dict, idx):
        return vocab.embed_forward(p, idx, self.comm, self.sp)  # (b, T, C) or (b, T/tp, C)

    def embed_backward(self, dx, cache) -> dict:
        return vocab.embed_backward(dx, cache, self.comm)  # wte (Vl, C); wpe partial with SP

    def block_forward(self, p: dict, x, n_head: int):
        return tpl.block_forward(p, x, n_head, self.comm, self.sp)  # like x

    def block_backward(self, dout, cache):
        return tpl.block_backward(dout, cache, self.comm)  # my shards' gradients

    def head_forward(self, p: dict, x, targets=None, denom=None):
        """Loss share (the same on every tp rank), or my logits (b, T, Vl) without targets."""
        if targets is None:
            return vocab.logits_forward(p, x, self.comm, self.V, self.sp)
        return vocab.head_forward(p, x, targets, denom, self.comm, self.V, self.sp)

    def head_backward(self, dloss, cache):
        return vocab.head_backward(dloss, cache, self.comm)  # dx like x; my wte rows

    def act_shape(self, b: int, T: int, C: int) -> tuple[int, int, int]:
        return (b, T // self.comm.size, C) if self.sp else (b, T, C)

    def next_token(self, logits_last):
        """Global argmax over the vocabulary shards (b, Vl): an all-gather over tp."""
        return vocab.argmax_forward(array_module(logits_last).ascontiguousarray(logits_last),
                                    self.comm)


def check_pipeline_tp(schedule: str, tp: int) -> None:
    """Refuse what tp x pp does not do (same answer on every rank, before communication)."""
    if tp > 1 and schedule == "zb-h1":
        raise ConfigError("--schedule zb-h1 with --tp > 1: not implemented (splitting the "
                          "tensor-parallel backward into B and W would move its communication); "
                          "use naive, gpipe, 1f1b or interleaved")
