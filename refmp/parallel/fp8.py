"""FP8 training, emulated: the layout's Ops with every linear's GEMM on FP8 operands.

Shapes: B rows of one micro-batch, T tokens, C_in / C_out a linear's input and output
channels (``/tp`` where tensor parallelism splits them).

:class:`FP8Ops` wraps the Ops of any layout (refmp.parallel.ops: serial, tp, SP, cp) and
changes only its linears. Forward, the input X and the weight W are rounded to E4M3;
backward, the incoming gradient dY to E5M2 (refmp.runtime.fp8); the wrapped linear then runs
on the dequantized values, so dX = dY^ W^T and dW = X^T dY^ both use the forward's FP8
copies, as Transformer Engine's GEMMs do. The master weights, the optimizer and every other
layer (LayerNorm, attention's core, the head) stay in the run's dtype (with bf16 mixed
precision, its compute copy); the cache keeps X and W in FP8 (1 byte an element).

Three recipes choose the scales:

* ``tensor`` (current scaling): one scale per tensor, from its amax now;
* ``delayed``: one scale per tensor, from the largest amax of the last ``history`` steps
  (Transformer Engine's default); the first step scales by the current amax;
* ``mxfp8``: one scale per 32 consecutive elements along the channels (OCP MX).

What a layout must agree on is the scale. A tensor that tp splits (a column-parallel W, its
dY; a row-parallel X and W; with SP, every activation) is quantized as the serial run
quantizes the whole: its amax is all-reduced (max) over tp first. MXFP8 needs no reduction
where a block never crosses a shard's edge (C/tp a multiple of 32). Delayed scaling records
each step's amaxes reduced over tp and over the data-parallel ranks, so its scales are those
of the whole global batch, as in the serial run. Current scaling sees one micro-batch: dp
ranks with M micro-batches each equal the serial run with dp M micro-batches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from refmp.errors import ConfigError
from refmp.parallel.pipeline.catalog import CATALOG
from refmp.runtime import fp8 as F
from refmp.runtime.arrays import map_leaves
from refmp.runtime.backend import array_module

if TYPE_CHECKING:  # (the layout's rules import this module; cost/ never imports MPI)
    from refmp.distributed.comm import Comm

X, W, G = 0, 1, 2  # the roles: a linear's input, its weight, the gradient of its output
FORMAT = {X: F.E4M3, W: F.E4M3, G: F.E5M2}
# Megatron's layers over tp > 1: which of (X, W, dY) each linear holds a shard of; with
# sequence parallelism the activations are split along T as well (SPLIT_SP)
SPLIT = {"column": (False, True, True), "row": (True, True, False)}
SPLIT_SP = {"column": (True, True, True), "row": (True, True, True)}


class FP8Cache(NamedTuple):
    """A linear's cache under FP8: its site (the linear's index in this rank's forward, for
    the delayed recipe), its kind (column or row) and the wrapped Ops' cache, in which X and
    W are refmp.runtime.fp8.Quantized."""

    site: int
    kind: str
    inner: object


class Scales:
    """The amaxes of one rank's linears, for the delayed recipe: ``history`` past steps of
    (n_sites, 3 roles), and this step's running maximum. ``end_step`` reduces this step's
    over ``groups`` (tp, dp x cp) and pushes it, so every rank of a pipeline stage holds the
    same history (the serial run's, for the stage's blocks): training state, which a
    checkpoint saves by block (``state``) and any layout reads back (refmp.checkpoint.amax)."""

    def __init__(self, n_sites: int, history: int, groups: list[Comm]):
        self.past = np.zeros((history, n_sites, 3))  # (H, sites, roles)
        self.steps = 0
        self.now = np.zeros((n_sites, 3))
        self.groups = [g for g in groups if g.size > 1]

    def amax(self, site: int, role: int) -> float | None:
        """The delayed amax of a site's role: the largest of the kept steps (None before)."""
        if self.steps == 0:
            return None
        return float(self.past[: self.steps, site, role].max())

    def record(self, site: int, role: int, a) -> None:
        self.now[site, role] = max(self.now[site, role], float(a))

    def end_step(self) -> None:
        for g in self.groups:  # the whole global batch's amax, as one rank sees it serially
            g.allreduce(self.now, op="max")
        self.past = np.roll(self.past, 1, axis=0)
        self.past[0] = self.now
        self.steps = min(self.steps + 1, len(self.past))
        self.now = np.zeros_like(self.now)

    def state(self, blocks: list[tuple[int, int]]) -> dict:
        """{"steps": kept steps, "amax": {"h.{i}": (H, k, 3)}}: each of ``blocks`` (i, its k
        linears, in this rank's forward order) with the history of its linears."""
        amax, s = {}, 0
        for i, k in blocks:
            amax[f"h.{i}"] = self.past[:, s:s + k].copy()  # (H, k, roles)
            s += k
        return {"steps": self.steps, "amax": amax}

    def load_state(self, state: dict, blocks: list[tuple[int, int]]) -> None:
        """Set the history from ``state`` (``state()``'s form, any rank's blocks among it)."""
        if blocks:  # (a stage may hold no block: the embeddings or the head alone)
            self.past[...] = np.concatenate([state["amax"][f"h.{i}"] for i, _ in blocks], axis=1)
        self.steps = int(state["steps"])
        self.now[...] = 0.0


class FP8Ops:
    """The Ops ``inner`` with FP8 linears (``recipe``: tensor, delayed or mxfp8), tp's amaxes
    reduced over ``tp`` (``sp``: with sequence parallelism) and, for the activations and
    gradients, over ``cp``'s sequence shards; ``n_sites`` the linears one
    forward of this rank runs, ``groups`` what the delayed recipe reduces its amaxes over,
    ``blocks`` [(block i, its linears k)] whose linears those sites are, in forward order."""

    def __init__(self, inner, recipe: str, tp: Comm, sp: bool = False, n_sites: int = 0,
                 history: int = 16, groups: list[Comm] = (), cp: Comm | None = None,
                 blocks: list[tuple[int, int]] = ()):
        self.inner = inner
        self.recipe = recipe
        self.tp = tp
        self.cp = cp if cp is not None and cp.size > 1 else None  # activations split along T
        self.split = SPLIT_SP if sp else SPLIT
        self.n_sites = n_sites
        self.blocks = list(blocks)
        self.calls = 0
        self.scales = Scales(n_sites, history, [tp, *groups]) if recipe == "delayed" else None

    @property
    def n_head(self) -> int:
        return self.inner.n_head

    # --- quantizing one operand ---------------------------------------------------------------

    def quantize(self, x, role: int, kind: str, site: int):
        """(x^, Q): x rounded to FP8 and back (the GEMM's operand), and its FP8 form."""
        fmt, split = FORMAT[role], self.tp.size > 1 and self.split[kind][role]
        if self.recipe == "mxfp8":  # blocks along the channels: W's input rows, X's and dY's last
            z = F.quantize_blocks(x, fmt, 0 if role == W else -1)
            return F.dequantize(z, x.dtype), z
        a = self.scales.amax(site, role) if self.scales is not None else None
        if self.scales is not None:
            self.scales.record(site, role, F.amax(x))  # reduced over tp at the step's end
        if a is None:
            a = F.amax(x)  # ()
            over = ([self.tp] if split else []) + ([self.cp] if self.cp and role != W else [])
            for g in over:  # the whole tensor's amax: the largest over the shards
                a = g.allreduce(array_module(x).asarray(a, dtype=np.float64).reshape(1), op="max")[0]
        z = F.quantize_tensor(x, fmt, a)
        return F.dequantize(z, x.dtype), z

    def end_step(self) -> None:
        """After a step's backward: the delayed recipe pushes the step's amaxes."""
        if self.scales is not None:
            self.scales.end_step()

    def state(self) -> dict:
        """What later steps depend on: the delayed recipe's amax history by block (Scales.state;
        {} for the other recipes, which keep nothing from step to step)."""
        return self.scales.state(self.blocks) if self.scales is not None else {}

    def load_state(self, state: dict) -> None:
        if self.scales is not None:
            self.scales.load_state(state, self.blocks)

    # --- the linears ----------------------------------------------------------------------------

    def _forward(self, kind: str, x, w, b):
        site = self.calls % self.n_sites if self.n_sites else 0
        self.calls += 1
        xq, zx = self.quantize(x, X, kind, site)
        wq, zw = self.quantize(w, W, kind, site)
        linear = self.inner.column if kind == "column" else self.inner.row
        y, cache = linear(xq, wq, b)
        fp8 = {id(xq): zx, id(wq): zw}  # the cache keeps the FP8 copies, not x^ and w^
        return y, FP8Cache(site, kind, map_leaves(cache, lambda a: fp8.get(id(a), a)))

    def _inner(self, dout, cache: FP8Cache):
        """(dY^, the wrapped Ops' cache with X^ and W^ dequantized again)."""
        dq, _ = self.quantize(dout, G, cache.kind, cache.site)

        def wide(a):
            return F.dequantize(a) if isinstance(a, F.Quantized) else a

        return dq, map_leaves(cache.inner, wide)

    def column(self, x, w, b):
        return self._forward("column", x, w, b)

    def row(self, x, w, b):
        return self._forward("row", x, w, b)

    def linear_backward(self, dout, cache: FP8Cache):
        return self.inner.linear_backward(*self._inner(dout, cache))  # dx, dw, db

    def linear_backward_input(self, dout, cache: FP8Cache):
        return self.inner.linear_backward_input(*self._inner(dout, cache))  # dx, what W needs

    def linear_backward_weight(self, item):
        return self.inner.linear_backward_weight(item)

    # --- the rest is the wrapped Ops' ---------------------------------------------------------

    def attention(self, qkv):
        return self.inner.attention(qkv)

    def attention_backward(self, da, cache):
        return self.inner.attention_backward(da, cache)

    def embed(self, p: dict, idx):
        return self.inner.embed(p, idx)

    def embed_backward(self, dx, cache) -> dict:
        return self.inner.embed_backward(dx, cache)

    def head(self, p: dict, x, targets=None, denom=None):
        return self.inner.head(p, x, targets, denom)

    def head_backward(self, dloss, cache):
        return self.inner.head_backward(dloss, cache)


def apply_fp8(ops, recipe: str, grid, sp: bool, mcfg, chunks: dict[int, range]) -> FP8Ops:
    """The build step: ``ops`` with FP8 linears; its sites are the linears of this rank's
    ``chunks`` (4 a dense block, 2 an MoE block, whose experts stay in the run's dtype)."""
    blocks = [(i, 2 if mcfg.is_moe(i) else 4) for held in chunks.values() for i in held]
    return FP8Ops(ops, recipe, grid.comm["tp"], sp, sum(k for _, k in blocks),
                  groups=[grid.group("dp", "cp")], cp=grid.comm["cp"], blocks=blocks)


def check_fp8(cfg, n_embd: int, tp: int) -> None:
    """Refuse what the FP8 emulation cannot run, with why (``cfg`` a TrainConfig; the model's
    ``n_embd``; ``tp`` ranks)."""
    if cfg.fp8 == "none":
        return
    if cfg.fp8 == "mxfp8" and tp > 1 and (n_embd // tp) % F.MX_BLOCK:
        raise ConfigError(f"--fp8 mxfp8 with --tp {tp}: each tp rank holds C/tp = {n_embd // tp} "
                          f"channels of a block's activations, not a multiple of {F.MX_BLOCK}, so a "
                          "block of 32 would cross a shard's edge and be scaled unlike the serial "
                          "run's: choose n_embd and --tp with C/tp a multiple of 32")
    if cfg.device == "gpu":
        raise ConfigError(f"--fp8 {cfg.fp8} is emulated on the CPU (ml_dtypes' float8 types): "
                          "drop --device gpu")
    sched = CATALOG.get(cfg.schedule)
    chunks = sched.chunks_per_rank(cfg.virtual_stages) if sched is not None else 1
    why = "keeps each linear's amax history by its place in a rank's forward, which needs {}"
    if cfg.fp8 == "delayed" and chunks > 1:
        raise ConfigError(f"--fp8 delayed {why.format('one model chunk per rank')}: --schedule "
                          f"{cfg.schedule} runs {chunks} (or use --fp8 tensor)")
    if cfg.fp8 == "delayed" and cfg.recompute == "full":
        raise ConfigError(f"--fp8 delayed {why.format('each forward run once')}: --recompute full "
                          "runs each block's forward again in its backward (or use --fp8 tensor)")
