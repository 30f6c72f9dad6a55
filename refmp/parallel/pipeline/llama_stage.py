"""The chunks of a Llama model (refmp.nn.llama) one pipeline rank holds, for the executors
of refmp.parallel.pipeline: every schedule of the catalog runs it unchanged, the flush ones
(naive, GPipe, 1F1B, interleaved, ZB-H1, ZB-V, DualPipeV) and those without a flush (2BW,
PipeDream), whose executor hands each pass a ``Route`` (refmp.parallel.pipeline.stage): the
weight version it runs on, and where its gradients and MoE figures go, as GPT-2's Stage
takes it (tests/test_llama_parallel.py runs GPipe, 1F1B, interleaved, ZB-V, 2BW and
PipeDream).

Shapes: b rows of one micro-batch, T tokens of a sequence this rank holds (T/cp under
context parallelism), C channels, L layers, S = pp v chunks.

A chunk is L/S consecutive blocks; chunk 0 also embeds the tokens (``wte``), the last chunk
also applies ``ln_f``, the head and the loss. With an untied head (Llama's usual
``tie_word_embeddings: false``) the last stage owns ``lm_head.weight`` and the first owns
``wte.weight``: no parameter lives on two stages and no embedding gradient crosses the
pipeline (GPT-2's tied head needs the first and last stages to sum wte's gradient). A tied
head is run when one rank holds both ends (pp = 1, or a V placement, where chunk 0 and the
last chunk are both on rank 0), and refused otherwise.

The executor's interface: ``n_chunks``, ``act_shape``, ``forward``, ``backward`` (each
with an optional ``route``), ``weight``; and ``sharder``, ``figures`` (the asynchronous ones').
A zero-bubble schedule's W action finds nothing to do: this stage computes each block's
weight gradients in its B (the numbers are the same; only the timeline differs).

A Mixtral-style model (``n_expert``) runs each block's MLP as refmp.nn.moe's layer on SwiGLU
experts, in the MoE context the Engine makes (``moe(denom)``: expert parallelism's
all-to-all over ep, the ranks a sequence is split over), as GPT-2's Stage does: a block's
experts held here are a Sharder unit of their own (``h.{i}.experts``, summed over edp), its
routing figures and MoE loss shares (0: Mixtral has no auxiliary losses) gathered per step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from refmp.nn import layers as L
from refmp.nn import llama as LM
from refmp.nn import llama_layers as LL
from refmp.parallel.pipeline.stage import Route, Stage
from refmp.runtime.arrays import attach, detach


class Recompute(NamedTuple):
    """A block's cache under full recomputation (Korthikanti et al. 2022, sec. 5): its input
    (b, T, C), the rotary tables and its MoE context (None: dense); backward runs the
    forward again for the rest (an MoE block's all-to-alls too)."""

    x: Any
    cos: Any
    sin: Any
    moe: Any = None


def of_units(weights, *units: str) -> dict:
    """The parameters of these Sharder units, from ``weights`` (a Route's: unit -> {name:
    array}): the current buffers, or a weight version's."""
    return {k: v for u in units for k, v in weights(u).items()}


class LlamaStage(Stage):
    """This rank's chunks (chunk id -> blocks), the layout's Ops (refmp.nn.llama.Ops: serial,
    tp's, around cp's attention core) and a Sharder over its parameters (what
    refmp.parallel.family's LlamaFamily holds, its tp shards, its units): every pass computes
    on ``sharder.weights(unit)`` (ZeRO-3: gathered for the forward, let go, gathered again
    for the backward) and hands each unit's gradient to the Sharder when it is complete,
    which sums it over dp x cp (ZeRO 0: all-reduce; 2-3: reduce-scatter) while the schedule
    goes on. ``moe(denom)``: the
    MoEContext of one forward of an MoE model (None: dense; refmp.parallel.engine.moe_context)."""

    def __init__(self, cfg: LM.LlamaConfig, chunks: dict[int, range], n_chunks: int,
                 ops: LM.Ops, sharder, recompute: bool = False, moe=None):
        # GPT-2's Stage keeps the same state (units, block units, figures, loss scale) and
        # answers begin_step, aux, act_shape, block_weights, weight and _add_block alike
        super().__init__(chunks, n_chunks, cfg, ops, sharder,
                         moe if moe is not None else (cfg.moe_context if cfg.n_expert else None),
                         ops.sequence_shards, recompute)
        self.head_unit = "wte" if cfg.tied else "lm_head"

    def tables(self, T: int):
        """The rotary tables (T, HS) of this rank's tokens (their global positions)."""
        xp = self.sharder.xp
        positions = xp.arange(T) if self.ops.positions is None else self.ops.positions
        dtype = self.sharder.dtype if self.sharder.mixed else self.sharder.compute  # fp32 when mixed
        return LL.rope_tables(positions, self.cfg.head_size, self.cfg.rope_theta, dtype)

    def forward(self, c: int, inp, targets=None, denom=None, route: Route | None = None):
        """Chunk c on one micro-batch: ``inp`` is token ids (chunk 0) or the previous chunk's
        output. Returns the output, or on the last chunk the loss share, and the cache.
        ``route``: the weights it runs on and where its MoE figures go (default Stage.route:
        the Sharder's; 2BW's and PipeDream's weight versions, refmp.parallel.pipeline.asynchronous)."""
        route = route or self.route()
        weights = route.weights
        T = inp.shape[1] * (1 if c == 0 else self.ops.sequence_shards)  # tokens attended
        cos, sin = self.tables(T)
        x, emb, head, blocks = inp, None, None, []
        if c == 0:  # (b, T, C), or with SP the rank's (b, T/tp, C)
            x, emb = L.embedding_forward(self.ops.sequence(inp), weights("wte")["wte.weight"])
        train = targets is not None
        moe = self.moe(denom if train else None) if self.moe else None  # None: dense
        for i in self.chunks[c]:
            p = self.block_weights(i, weights)
            x_in = x
            x, bc = LM.block_forward(p, x, self.cfg, cos, sin, self.ops, moe)
            if train and isinstance(bc.mlp, LM.MoEMLPCache):  # a scalar to the host
                route.figures.add(i, float(bc.mlp.moe.loss), bc.mlp.moe.stats["raw"])
            if self.recompute:  # the input is all we keep (and the tables, shared by all)
                bc = Recompute(x_in, cos, sin, moe)
            blocks.append(detach(bc, p) if route.release else bc)
        if c == self.n_chunks - 1:
            p = of_units(weights, "ln_f", self.head_unit)
            tg = None if targets is None else self.ops.sequence(targets)
            x, head = LM.head_forward(p, x, self.cfg, tg, denom)
            head = detach(head, p) if route.release and head is not None else head
        return x, (emb, blocks, head)

    def backward(self, c: int, dout, cache, split: bool, final: bool, route: Route | None = None):
        """Chunk c's backward; returns (the input's gradient, or None on chunk 0; nothing
        left for a W action). ``final``: the step's last micro-batch. ``route``: the weights
        its forward ran on (attached again where the cache names them) and what takes the
        gradients (default Stage.route: the Sharder's; 2BW's stash for a later batch)."""
        emb, blocks, head = cache
        route = route or self.route()
        sink = route.sink
        weights = route.weights
        dx = dout
        if head is not None:
            if route.release:
                head = attach(head, of_units(weights, "ln_f", self.head_unit))
            dx, g = LM.head_backward(self.loss_scale, head, self.cfg)
            sink.accumulate("ln_f", {"ln_f.weight": g.pop("ln_f.weight")})
            sink.accumulate(self.head_unit, g)
            sink.grad_ready("ln_f", final)
            if not self.cfg.tied:  # a tied wte is complete after the embedding's share
                sink.grad_ready("lm_head", final)
        for i, bc in zip(reversed(self.chunks[c]), reversed(blocks), strict=True):
            if isinstance(bc, Recompute):  # the block's forward again, its communication too
                _, bc = LM.block_forward(self.block_weights(i, weights), bc.x, self.cfg, bc.cos,
                                         bc.sin, self.ops, bc.moe)
            elif route.release:
                bc = attach(bc, self.block_weights(i, weights))
            dx, g = LM.block_backward(dx, bc, self.ops, self.loss_scale)
            self._add_block(i, g, final, True, sink)  # the whole backward ran here: no W
        if emb is None:
            return dx, []
        sink.accumulate("wte", {"wte.weight": L.embedding_backward(dx, emb)})
        sink.grad_ready("wte", final)
        return None, []
