"""ZeRO stage 3 over tensor parallelism: each tp shard is itself sharded over dp.

Rajbhandari et al. 2020, sec. 5.3 (P_os+g+p), on top of Megatron tensor parallelism. A tp rank
holds its tp shards (refmp.parallel.tensor_runner); the dp ranks at one tp coordinate hold the
same shards, and stage 3 keeps on each only 1/dp of them, as refmp.parallel.zero does for the
whole model: the tp-local parameters are cut into the same units (``embed`` = wte's Vp/tp rows
and wpe, ``h.{i}``, ``ln_f``), each flattened and padded to a multiple of dp (zero.Unit).

Shapes: b rows of one micro-batch, T time, C channels; P elements of a unit's tp shards, Pp
padded to a multiple of dp, S = Pp/dp the slice this rank owns.

One micro-batch (the tp layers of tensor.py / vocab.py, with their tp communication):
  forward, per unit    all-gather over dp the unit's tp shards (S -> Pp), use them, free them
                       (a block's cache keeps references, zero.detach, not the weights)
  backward, per unit   all-gather again (the head's forward and backward run back to back on
                       one gather); with SP, all-reduce over tp the unit's replicated
                       gradients (partial over tp); reduce-scatter over dp (Pp -> S), keep S
  optimizer            AdamW on the S elements this rank owns; nothing to gather after it

Clipping: the squares of the owned pieces, tp shards summed over tp and replicated ones counted
once (TensorParallel.grad_sum_sq), then summed over dp (each element owned by one dp rank).
"""

from __future__ import annotations

from mpi4py import MPI

from refmp.backend import array_module
from refmp.comm import Comm
from refmp.nn.gpt import block_params
from refmp.parallel import tensor as tpl
from refmp.parallel import vocab
from refmp.parallel.data import activation_bytes, flatten, unflatten_into
from refmp.parallel.tensor_runner import split_of
from refmp.parallel.zero import Unit, attach, decay_names, detach


def unit_of(name: str) -> str:
    """``embed`` (wte, wpe), ``h.{i}`` or ``ln_f``: the unit a parameter belongs to."""
    if name.startswith(("wte", "wpe")):
        return "embed"
    return "ln_f" if name.startswith("ln_f") else ".".join(name.split(".")[:2])


class ZeRO3Tensor:
    """The runner interface (refmp.parallel.data) for tensor parallelism with ZeRO stage 3."""

    def __init__(self, inner, model, grid):
        self.inner, self.grid, self.cfg = inner, grid, inner.cfg
        self.tp, self.dp = inner.tp, grid.comm["dp"]
        self.sp, self.M = inner.sp, inner.M
        # generate gathers the model over dp (a collective): every dp rank decodes every prompt
        self.eval_comm = Comm(MPI.COMM_SELF, "self", grid.ledger)
        local = inner.params  # this tp rank's shards, by GPT-2 name
        shapes = {k: tuple(v.shape) for k, v in local.items()}
        names: dict[str, list[str]] = {}
        for k in local:
            names.setdefault(unit_of(k), []).append(k)
        self.units = {u: Unit(u, {k: shapes[k] for k in ks}, self.dp.size, self.dp.rank)
                      for u, ks in names.items()}
        p0 = local["wte.weight"]
        self.xp, self.dtype = array_module(p0), p0.dtype
        self.pbuf = {u: U.flatten(local, self.xp, self.dtype)[U.lo : U.hi].copy()
                     for u, U in self.units.items()}  # (S,) each: only my slice stays
        self.gbuf = {u: self.xp.zeros(U.shard, self.dtype) for u, U in self.units.items()}
        inner.params, model.params, model.grads = {}, {}, {}  # the full weights are freed
        self._params, self._grads = {}, {}
        for u, U in self.units.items():
            self._params.update(U.pieces(self.pbuf[u]))
            self._grads.update(U.pieces(self.gbuf[u]))
        self.decay = decay_names(self._params, shapes)
        self.peak_activations = 0

    @property
    def params(self) -> dict:
        return self._params  # my dp slice of my tp shards, flat pieces by name

    @property
    def grads(self) -> dict:
        return self._grads

    def shard_of(self, local: dict) -> dict:
        """My pieces of ``local`` (arrays shaped like this tp rank's shards, by name)."""
        out = {}
        for U in self.units.values():
            out.update(U.shard_of(local, self.xp, self.dtype))
        return out

    def batch_rows(self, B: int) -> slice:
        return self.inner.batch_rows(B)

    def zero_grad(self) -> None:
        for g in self.gbuf.values():
            g[...] = 0

    def _weights(self, u: str) -> dict:
        """Unit u's tp shards, all-gathered over dp now (S -> Pp); alive while used."""
        return self.units[u].views(self.dp.allgather(self.pbuf[u]))

    def _add_grads(self, u: str, g: dict) -> None:
        """Hand on unit u's complete gradient (this rank's share): reduce-scatter over dp."""
        U = self.units[u]
        repl = [g[k] for k in g if split_of(k) is None]
        if self.sp and self.tp.size > 1 and repl:  # SP: replicated gradients partial over tp
            flat = flatten(repl)
            self.tp.allreduce(flat)
            unflatten_into(flat, repl)
        self.gbuf[u] += self.dp.reduce_scatter(U.flatten(g, self.xp, self.dtype))  # Pp -> S

    def forward_backward(self, x, y, denom: int) -> float:
        cfg, tp, sp, share, b = self.cfg, self.tp, self.sp, 0.0, x.shape[0] // self.M
        for m in range(self.M):
            xm, ym = x[m * b : (m + 1) * b].copy(), y[m * b : (m + 1) * b].copy()  # (b, T)
            # forward: each unit's tp shards gathered over dp just before use
            h, emb = vocab.embed_forward(self._weights("embed"), xm, tp, sp)  # (b, T(/tp), C)
            blocks = []
            for i in range(cfg.n_layer):
                p = block_params(self._weights(f"h.{i}"), i)
                h, c = tpl.block_forward(p, h, cfg.n_head, tp, sp)
                blocks.append(detach(c, p))  # the weights can go; the cache names them
            p = {**self._weights("ln_f"), "wte.weight": self._weights("embed")["wte.weight"]}
            loss, head = vocab.head_forward(p, h, ym, denom, tp, cfg.vocab_size, sp)
            self.peak_activations = max(self.peak_activations, activation_bytes(
                (emb, blocks, head), exclude=list(p.values())))
            # backward, mirror order; each unit's gradient handed on as soon as complete
            dh, g = vocab.head_backward(1.0, head, tp)
            del head, p
            dwte = g.pop("wte.weight")  # (Vp/tp, C): the tied wte awaits the embedding's share
            self._add_grads("ln_f", g)
            for i in reversed(range(cfg.n_layer)):
                c = attach(blocks.pop(), block_params(self._weights(f"h.{i}"), i))
                dh, g = tpl.block_backward(dh, c, tp)
                self._add_grads(f"h.{i}", {f"h.{i}.{k}": v for k, v in g.items()})
            g = vocab.embed_backward(dh, emb, tp)  # needs no weights, only the token ids
            g["wte.weight"] += dwte
            self._add_grads("embed", g)
            share += float(loss)
        return share

    def reduce_grads(self) -> None:
        pass  # already reduce-scattered, unit by unit, during backward

    def grad_sum_sq(self, local: float) -> float:
        return self.dp.allreduce_scalar(self.inner.grad_sum_sq(local, self._grads))

    def after_step(self) -> None:
        pass  # parameters stay sharded; forward gathers them when it needs them

    def loss_total(self, share: float) -> float:
        return self.inner.loss_total(share)

    def _with_gathered(self, fn):
        """Run ``fn()`` with the inner runner's tp shards gathered over dp, then free them."""
        for u in self.units:
            self.inner.params.update({k: v.copy() for k, v in self._weights(u).items()})
        try:
            return fn()
        finally:
            self.inner.params = {}

    def generate(self, idx, n: int):
        return self._with_gathered(lambda: self.inner.generate(idx, n))  # collective over dp

    def full_params(self) -> dict | None:
        return self._with_gathered(self.inner.full_params)  # over dp, then tp, to rank 0

    def memory(self) -> dict[str, int]:
        """Bytes of the parameter and gradient slices this rank keeps, and peak activations."""
        return {"params": sum(int(b.nbytes) for b in self.pbuf.values()),
                "grads": sum(int(b.nbytes) for b in self.gbuf.values()),
                "activations": self.peak_activations}
