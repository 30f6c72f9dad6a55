"""The model chunks one pipeline rank holds, as forward / backward / weight-gradient passes.

Shapes: b rows of one micro-batch, T tokens per sequence on this rank (T/cp with context
parallelism, then /tp with sequence parallelism), C channels.

A chunk is a run of consecutive blocks (partition.py); chunk 0 also embeds the tokens and
the last chunk also applies ln_f, the tied head and the loss. Every pass runs the one block
of refmp.nn.gpt through the layout's Ops (refmp.parallel.ops), on weights the Sharder hands
out unit by unit (refmp.parallel.data.sharder): views of resident buffers, or, with ZeRO-3,
gathered just before the forward and again just before the backward. After each unit's
backward of a micro-batch the Sharder is told its gradient is ready, so it can reduce it
while the schedule goes on. pp = 1 is the same code with one chunk. With full recomputation
a block keeps only its input and runs its forward again at the start of its backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from refmp.nn import gpt
from refmp.nn import moe as M
from refmp.nn.routing import MoEFigures
from refmp.runtime.arrays import attach, detach


class Recompute(NamedTuple):
    """A block's cache under full recomputation (Korthikanti et al. 2022, sec. 5): its input
    (B, T, C) and its MoE context; backward runs the forward again to rebuild the rest. The
    recomputed forward repeats the block's communication too (tp, cp's ring, ep's
    all-to-all), in the same order on every rank, so the ledger shows what it costs."""

    x: Any
    moe: Any


class Route(NamedTuple):
    """Where a pass's weights come from and its results go (Stage.route, or 2BW's versions)."""

    weights: Callable  # unit -> {name: array}
    sink: Any  # takes the gradients: accumulate(unit, g), grad_ready(unit, final)
    figures: MoEFigures
    release: bool  # the forward's cache names its weights; the backward attaches them again


class Stage:
    """This rank's chunks (chunk id -> block indices), its Ops and its Sharder.

    ``moe(denom)`` makes the MoEContext of one forward (None: a dense model);
    ``sequence_shards`` is tp with sequence parallelism (a boundary activation holds T/tp
    tokens), else 1. ``begin_step``: the starting gradient (1, fp16's scale), new MoE figures.
    """

    def __init__(self, chunks: dict[int, range], n_chunks: int, cfg, ops, sharder, moe=None,
                 sequence_shards: int = 1, recompute: bool = False):
        self.chunks = chunks
        self.n_chunks = n_chunks
        self.cfg = cfg
        self.ops = ops
        self.sharder = sharder
        self.moe = moe
        self.sequence_shards = sequence_shards
        self.recompute = recompute  # full recomputation: keep only each block's input
        self.unit = {k: u for u, unit in sharder.units.items() for k in unit.shapes}
        # block -> the Sharder units of its parameters held here: dense, then its experts
        self.block_units = {i: list(dict.fromkeys(u for k, u in self.unit.items() if k.startswith(f"h.{i}.")))
                            for blocks in chunks.values() for i in blocks}
        self.figures = MoEFigures()  # this step's
        self.loss_scale = 1.0  # the gradient of each loss share: 1, or fp16's loss scale

    def begin_step(self, loss_scale: float = 1.0) -> None:
        self.figures = MoEFigures()
        self.loss_scale = loss_scale

    @property
    def aux(self) -> float:
        """This rank's share of the step's MoE losses."""
        return self.figures.aux

    def act_shape(self, b: int, T: int) -> tuple[int, int, int]:
        return (b, T // self.sequence_shards, self.cfg.n_embd)  # what crosses a stage boundary

    def block_weights(self, i: int, weights) -> dict:
        """Block i's parameters by their name inside the block (dense unit + its experts)."""
        return gpt.block_params({k: v for u in self.block_units[i] for k, v in weights(u).items()}, i)

    def route(self) -> Route:
        """The Sharder's current weights (ZeRO-3 releases them) and sums, this step's figures."""
        return Route(self.sharder.weights, self.sharder, self.figures, self.sharder.releases_weights)

    def forward(self, c: int, inp, targets=None, denom=None, route: Route | None = None):
        """Chunk c on one micro-batch: inp is token ids (chunk 0) or the previous chunk's
        output. Returns the output, or on the last chunk the loss share (logits without
        targets), and the backward's cache. ``route``: weights and figures (:meth:`route`)."""
        route = route or self.route()
        weights = route.weights
        train = targets is not None
        release = train and route.release  # the cache names its weights, not the arrays
        x, emb, head, blocks = inp, None, None, []
        if c == 0:
            x, emb = self.ops.embed({**weights("wte"), **weights("wpe")}, inp)  # (b, T, C)
        ctx = self.moe(denom if train else None) if self.moe else None
        for i in self.chunks[c]:
            p, moe = self.block_weights(i, weights), ctx if self.cfg.is_moe(i) else None
            x_in = x
            x, bc = gpt.block_forward(p, x, self.ops, moe)
            if train and isinstance(bc.mlp, M.MoECache):
                route.figures.add(i, float(bc.mlp.loss), bc.mlp.stats["raw"])  # a scalar to the host
            if train and self.recompute:  # full recomputation: the input is all we keep
                bc = Recompute(x_in, moe)
            blocks.append(detach(bc, p) if release else bc)
        if c == self.n_chunks - 1:
            p = {**weights("ln_f"), **weights("wte")}
            x, head = self.ops.head(p, x, targets, denom)  # loss share, or logits
            head = detach(head, p) if release else head
        return x, (emb, blocks, head)

    def backward(self, c: int, dout, cache, split: bool, final: bool, route: Route | None = None):
        """Chunk c's backward; returns (dx of the chunk's input or None, what W needs).

        dout is the gradient of the chunk's output, or None on the last chunk (the loss
        share's own gradient is ``loss_scale``: 1, or fp16's; MoE losses get it too).
        With ``split`` (zero bubble) the linears' weight gradients and the embedding's are
        left for :meth:`weight`. ``final``: this is the step's last micro-batch (the Sharder
        starts stage 0's all-reduces then). ``route``: what the forward ran on (released, to
        attach again) and what takes the gradients (default :meth:`route`).
        """
        emb, blocks, head = cache
        route = route or self.route()
        dx = dout
        sink = route.sink
        weights = route.weights
        if head is not None:
            if route.release:  # gathered again: the forward's copy was freed
                head = attach(head, {**weights("ln_f"), **weights("wte")})
            dx, g = self.ops.head_backward(self.loss_scale, head)  # ln_f and the tied wte's head share
            del head  # ZeRO-3's gathered wte goes before its gradient's buffer comes
            sink.accumulate("wte", {"wte.weight": g.pop("wte.weight")})
            sink.accumulate("ln_f", g)
            sink.grad_ready("ln_f", final)
            if 0 not in self.chunks:  # the last stage's own copy of wte is complete
                sink.grad_ready("wte", final)
        todo = []
        for i, bc in zip(reversed(self.chunks[c]), reversed(blocks), strict=True):
            if isinstance(bc, Recompute):  # the block's forward again (bitwise the same)
                _, bc = gpt.block_forward(self.block_weights(i, weights), bc.x, self.ops, bc.moe)
            elif route.release:
                bc = attach(bc, self.block_weights(i, weights))
            w_todo = [] if split else None
            dx, g = gpt.block_backward(dx, bc, self.ops, w_todo, self.loss_scale)
            self._add_block(i, g, final, not split, sink)
            del g  # one block's gradients alive at a time (the workspace's, cost/memory.py)
            if split:
                todo.append((i, w_todo))
        if emb is None:
            return dx, todo
        if split:
            todo.append(("embed", (dx, emb)))
        else:
            self._embed_backward(dx, emb, final, sink)
        return None, todo

    def weight(self, todo, final: bool) -> None:
        """The W pass: the weight gradients a split backward deferred."""
        for i, w in todo:
            if i == "embed":
                self._embed_backward(*w, final, self.sharder)
            else:
                self._add_block(i, gpt.block_backward_weight(w, self.ops), final, True, self.sharder)

    def _add_block(self, i: int, g: dict, final: bool, dense_ready: bool, sink) -> None:
        """Block i's gradients ``g`` (names inside the block) into its units. Its experts'
        unit is complete after B (an MoE MLP does its whole backward there); its dense unit
        after B, or after W when the backward is split."""
        dense, *experts = self.block_units[i]
        by_unit: dict[str, dict] = {u: {} for u in self.block_units[i]}
        for k, v in g.items():
            by_unit[self.unit[f"h.{i}.{k}"]][f"h.{i}.{k}"] = v
        sink.accumulate(dense, by_unit[dense])
        for u in experts:
            if by_unit[u]:
                sink.accumulate(u, by_unit[u])
                sink.grad_ready(u, final)
        if dense_ready:
            sink.grad_ready(dense, final)

    def _embed_backward(self, dx, emb, final: bool, sink) -> None:
        g = self.ops.embed_backward(dx, emb)  # needs no weights, only the token ids
        sink.accumulate("wte", {"wte.weight": g["wte.weight"]})  # + the head's share
        sink.accumulate("wpe", {"wpe.weight": g["wpe.weight"]})
        sink.grad_ready("wte", final)
        sink.grad_ready("wpe", final)
