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

Zero bubble (Qi et al. 2023) splits each block's backward into B (the input gradient, which
the previous stage waits for) and W (the weight gradients, deferred). For the tensor-parallel
block the split keeps every collective, only moving some into W: a row-parallel layer's B
does its g backward (identity, or SP's all-gather of dZ) and keeps dZ for W; a column-parallel
layer's B computes dX = dY W_r^T and its f backward (all-reduce, or SP's reduce-scatter), and
its W does SP's re-gather of X (Korthikanti sec. 4.2.3) just before dW = X^T dY. The tp ranks
of a stage run the same W slots, so those all-gathers still pair up, and the ledger's totals
equal the unsplit backward's.
"""

from __future__ import annotations

from refmp.backend import array_module
from refmp.comm import Comm
from refmp.nn import gpt
from refmp.nn import layers as L
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

    def block_backward_input(self, dout, cache):
        """Zero bubble's B for tpl.block_backward: dx, LayerNorm and row-bias gradients, and
        what W needs (name, kind, dout of that linear, its cache)."""
        ln1, c_attn, attn, a_proj, ln2, c_fc, gelu, m_proj = cache
        g, todo = {}, []
        # forward was: out = x + h
        dh, dz, g["mlp.c_proj.bias"] = self._row_input(dout, m_proj)  # (b, T, 4C/tp)
        todo.append(("mlp.c_proj", "row", dz, m_proj))
        dh = L.gelu_backward(dh, gelu)
        todo.append(("mlp.c_fc", "column", dh, c_fc))
        dx, g["ln_2.weight"], g["ln_2.bias"] = L.layernorm_backward(
            self._column_input(dh, c_fc), ln2)  # like x
        dx += dout
        # forward was: x = x + a
        da, dz, g["attn.c_proj.bias"] = self._row_input(dx, a_proj)  # (b, T, C/tp)
        todo.append(("attn.c_proj", "row", dz, a_proj))
        attn_backward, attn = attn  # the block keeps (backward, cache) of its attention core
        dqkv = attn_backward(da, attn)  # (b, T, 3C/tp)
        todo.append(("attn.c_attn", "column", dqkv, c_attn))
        dh, g["ln_1.weight"], g["ln_1.bias"] = L.layernorm_backward(
            self._column_input(dqkv, c_attn), ln1)
        return dx + dh, g, todo

    def block_backward_weight(self, todo) -> dict:
        """Zero bubble's W: dW_r = X^T dY of the four linears (SP re-gathers X here)."""
        g = {}
        for name, kind, dout, ((x, w, has_bias), sp) in todo:
            if kind == "column" and sp:
                x = tpl.gather_from_sp(x, self.comm)  # (b, T, C_in): the SP re-gather
            g[f"{name}.weight"], db = L.linear_backward_weight(dout, (x, w, has_bias))
            if db is not None:  # column layers' biases (row biases were done in B)
                g[f"{name}.bias"] = db
        return g

    def _row_input(self, dout, cache):
        """B of a row-parallel layer: (dY_r (b, T, C_in/tp), dZ kept for W, db)."""
        lin, sp = cache
        db = dout.sum(axis=tuple(range(dout.ndim - 1)))  # (C_out,) partial over tp with SP
        dz = tpl.reduce_scatter_to_sp_backward(dout, self.comm) if sp else dout  # g backward
        return L.linear_backward_input(dz, lin), dz, db

    def _column_input(self, dout, cache):
        """B of a column-parallel layer: dX = sum_r dY_r W_r^T (f backward over tp)."""
        lin, sp = cache
        dx = L.linear_backward_input(dout, lin)  # (b, T, C_in) partial over tp
        if sp:
            return tpl.gather_from_sp_backward(dx, self.comm)  # (b, T/tp, C_in)
        return tpl.copy_to_tp_backward(dx, self.comm)  # (b, T, C_in)

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

