"""ZeRO: data parallelism that shards the optimizer state, gradients and parameters over dp.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", sec. 5. Plain data parallelism keeps a full copy of everything on every rank; in
float32 with AdamW that is 4 (params) + 4 (grads) + 8 (m, v) bytes per parameter. ZeRO keeps
on each of the dp ranks only 1/dp of

    stage 1 (P_os):      the optimizer state             4 + 4 + 8/dp  bytes per parameter
    stage 2 (P_os+g):    ... and the gradients           4 + (4 + 8)/dp
    stage 3 (P_os+g+p):  ... and the parameters          (4 + 4 + 8)/dp

Shapes: B batch, T time, C channels; P elements of a unit, Pp = P padded up to a multiple of
dp, S = Pp/dp the shard a rank owns. Units are the model's pieces (refmp.nn.gpt): ``embed``
(wte, wpe), ``h.{i}`` (one block) and ``ln_f``. Each unit's parameters are flattened in GPT-2
order into one buffer of Pp elements (zeros past P); dp rank r owns elements [r S, (r+1) S)
of every unit. Its optimizer works on those elements only, split by parameter so that weight
decay still goes to matrices only (a shard's piece of ``h.0.mlp.c_fc.weight`` is 1-D but is
decayed; the padding is a piece of its own whose gradient is always 0).

One step (M micro-batches):
  forward, per unit:   stage 3: all-gather the unit's weights (Pp), use them, free them
  backward, per unit:  stage 3: all-gather again (the forward's copy was freed);
                       stage 2/3: reduce-scatter the unit's gradient (Pp -> S) as soon as it is
                       complete and keep only the shard (per micro-batch);
                       stage 1: accumulate the full gradient (Pp)
  reduce_grads:        stage 1: reduce-scatter each unit's gradient (Pp -> S)
  optimizer:           AdamW on the S elements this rank owns
  after_step:          stage 1/2: all-gather each unit's updated parameters (S -> Pp)

Every reduction sums the ranks' loss *shares* (refmp.parallel.data), so the shard a rank owns
equals the same elements of the serial gradient; global-norm clipping sums the shards'
squares over dp (each element is owned by exactly one rank).
"""

from __future__ import annotations

import math

from mpi4py import MPI

from refmp.backend import array_module
from refmp.comm import Comm
from refmp.data import dp_rows
from refmp.nn import gpt as G
from refmp.parallel.data import activation_bytes, check_microbatches, split_microbatches


class Unit:
    """One piece of the model flattened into a padded buffer, and this rank's shard of it."""

    def __init__(self, name: str, shapes: dict, dp: int, rank: int):
        self.name, self.shapes = name, shapes
        self.offsets, o = {}, 0
        for k, s in shapes.items():
            self.offsets[k] = o
            o += math.prod(s)
        self.numel = o  # P
        self.padded = -(-o // dp) * dp  # Pp, a multiple of dp
        self.shard = self.padded // dp  # S
        self.lo, self.hi = rank * self.shard, (rank + 1) * self.shard

    def views(self, flat) -> dict:
        """The unit's parameters (full shapes) as views of a full flat buffer (Pp,)."""
        return {k: flat[o : o + math.prod(s)].reshape(s)
                for (k, s), o in zip(self.shapes.items(), self.offsets.values(), strict=True)}

    def flatten(self, arrays: dict, xp, dtype):
        """One padded flat buffer (Pp,) holding ``arrays`` (by name) in order, zeros after."""
        flat = xp.zeros(self.padded, dtype=dtype)
        for k, v in self.views(flat).items():
            v[...] = arrays[k]
        return flat

    def shard_of(self, arrays: dict, xp, dtype) -> dict:
        """This rank's pieces of full, named ``arrays`` (e.g. a serial run's gradients)."""
        return self.pieces(self.flatten(arrays, xp, dtype)[self.lo : self.hi])

    def pieces(self, shard) -> dict:
        """This rank's elements of each parameter (and of the padding) as views of ``shard``."""
        out = {}
        ends = [(k, o, o + math.prod(self.shapes[k])) for k, o in self.offsets.items()]
        for k, a, b in ends + [(f"{self.name}.padding", self.numel, self.padded)]:
            a, b = max(a, self.lo), min(b, self.hi)
            if a < b:
                out[k] = shard[a - self.lo : b - self.lo]  # (b-a,) flat piece
        return out


def decay_names(pieces: dict, shapes: dict) -> set[str]:
    """The pieces that get weight decay: those of parameters whose own ndim >= 2 (a flat
    piece of a matrix is 1-D but is decayed; biases, gains and the padding are not)."""
    return {k for k in pieces if k in shapes and len(shapes[k]) >= 2}


class WeightRef:
    """Stands in a cache for a weight that stage 3 freed; ``attach`` puts the weight back."""

    def __init__(self, name: str):
        self.name = name


def detach(cache, p: dict):
    """The cache with every array of ``p`` replaced by a WeightRef (so the weights can go)."""
    names = {id(v): k for k, v in p.items()}
    if isinstance(cache, tuple):
        return tuple(detach(c, p) for c in cache)
    return WeightRef(names[id(cache)]) if id(cache) in names else cache


def attach(cache, p: dict):
    """Inverse of detach, with the freshly gathered weights ``p``."""
    if isinstance(cache, tuple):
        return tuple(attach(c, p) for c in cache)
    return p[cache.name] if isinstance(cache, WeightRef) else cache


class ZeRO:
    """The DataParallel runner interface (refmp.parallel.data) with ZeRO stage 1, 2 or 3."""

    def __init__(self, model, grid, stage: int, microbatches: int = 1):
        cfg, self.model, self.grid, self.stage, self.M = model.cfg, model, grid, stage, microbatches
        self.dp = dp = grid.comm["dp"]
        self.eval_comm = dp if stage < 3 else Comm(MPI.COMM_SELF, "self", grid.ledger)
        shapes = G.param_shapes(cfg)
        groups = {"embed": ["wte.weight", "wpe.weight"], "ln_f": ["ln_f.weight", "ln_f.bias"]}
        groups.update({f"h.{i}": [k for k in shapes if k.startswith(f"h.{i}.")]
                       for i in range(cfg.n_layer)})
        self.units = {u: Unit(u, {k: shapes[k] for k in ks}, dp.size, dp.rank)
                      for u, ks in groups.items()}
        p0 = model.params["wte.weight"]
        self.xp, self.dtype = array_module(p0), p0.dtype
        full = {u: U.flatten(model.params, self.xp, self.dtype) for u, U in self.units.items()}
        if stage < 3:  # every rank keeps the full parameters; the model computes on views
            self.pbuf = full  # {unit: (Pp,)}
            for u, U in self.units.items():
                model.params.update(U.views(full[u]))
            pshards = {u: full[u][U.lo : U.hi] for u, U in self.units.items()}  # (S,) views
        else:  # only the shard stays; the full weights are freed (use full_params to see them)
            self.pbuf = pshards = {u: full[u][U.lo : U.hi].copy() for u, U in self.units.items()}
            model.params, model.grads = {}, {}
        if stage == 1:  # full gradients (Pp) during backward; this rank's S of them after
            self.gbuf = {u: self.xp.zeros(U.padded, self.dtype) for u, U in self.units.items()}
            gshards = {u: self.gbuf[u][U.lo : U.hi] for u, U in self.units.items()}
        else:  # stage 2/3: only the shard (S), reduced into as each unit's gradient completes
            self.gbuf = gshards = {u: self.xp.zeros(U.shard, self.dtype)
                                   for u, U in self.units.items()}
        self._params, self._grads = {}, {}
        for u, U in self.units.items():
            self._params.update(U.pieces(pshards[u]))
            self._grads.update(U.pieces(gshards[u]))
        self.decay = decay_names(self._params, shapes)
        self.peak_activations = 0

    @property
    def params(self) -> dict:
        return self._params  # this rank's pieces of every parameter, flat

    @property
    def grads(self) -> dict:
        return self._grads  # the same pieces of the global gradient

    def shard_of(self, full: dict) -> dict:
        """This rank's pieces of a full, named dict (e.g. the serial model's gradients)."""
        out = {}
        for U in self.units.values():
            out.update(U.shard_of(full, self.xp, self.dtype))
        return out

    def batch_rows(self, B: int) -> slice:
        check_microbatches(B, self.dp.size, self.M)
        return dp_rows(B, self.dp.size, self.dp.rank)

    def zero_grad(self) -> None:
        for g in self.gbuf.values():
            g[...] = 0

    # --- parameters and gradients of one unit ---------------------------------------------------

    def _weights(self, u: str) -> dict:
        """Unit u's full weights: views of the resident copy, or (stage 3) gathered now."""
        U = self.units[u]
        if self.stage < 3:
            return U.views(self.pbuf[u])
        # all-gather: every rank's S elements -> the unit's Pp, alive only while it is used
        return U.views(self.dp.allgather(self.pbuf[u]))

    def _add_grads(self, u: str, g: dict) -> None:
        """Accumulate unit u's gradient (this rank's share of it, full size)."""
        U = self.units[u]
        if self.stage == 1:
            for k, v in U.views(self.gbuf[u]).items():
                v += g[k]
            return
        # reduce-scatter: sum the ranks' shares (Pp) and keep this rank's S; the full
        # gradient of the unit is dropped here, so at most one unit's is alive at a time
        self.gbuf[u] += self.dp.reduce_scatter(U.flatten(g, self.xp, self.dtype))

    # --- the step ----------------------------------------------------------------------------

    def forward_backward(self, x, y, denom: int) -> float:
        n, share = self.model.cfg.n_layer, 0.0
        for xm, ym in split_microbatches(x, y, self.M):
            # forward: embeddings, blocks, head (each unit's weights only while it runs)
            h, emb = G.embed_forward(self._weights("embed"), xm)  # (b, T, C)
            blocks = []
            for i in range(n):
                p = G.block_params(self._weights(f"h.{i}"), i)  # names inside the block
                h, c = G.block_forward(p, h, self.model.cfg.n_head)  # (b, T, C)
                blocks.append(detach(c, p) if self.stage == 3 else c)
            p = {**self._weights("ln_f"), "wte.weight": self._weights("embed")["wte.weight"]}
            loss, head = G.head_forward(p, h, ym, denom)  # the LM head is tied to wte
            resident = list(self.pbuf.values()) if self.stage < 3 else []
            self.peak_activations = max(self.peak_activations, activation_bytes(
                (emb, blocks, head), exclude=resident + list(p.values())))
            # backward, mirror order; each unit's gradient is handed on as soon as complete
            dh, g = G.head_backward(1.0, head)
            del head, p  # the head's weights (stage 3: gathered) can go
            dwte = g.pop("wte.weight")  # the tied wte still awaits the embedding's share
            self._add_grads("ln_f", g)
            for i in reversed(range(n)):
                c = blocks.pop()
                if self.stage == 3:  # all-gather again: forward's copy was freed
                    c = attach(c, G.block_params(self._weights(f"h.{i}"), i))
                dh, g = G.block_backward(dh, c)
                self._add_grads(f"h.{i}", {f"h.{i}.{k}": v for k, v in g.items()})
            g = G.embed_backward(dh, emb)  # needs no weights, only the token ids
            g["wte.weight"] += dwte
            self._add_grads("embed", g)
            share += float(loss)
        return share

    def reduce_grads(self) -> None:
        if self.stage == 1:  # reduce-scatter once per step, after all micro-batches
            for u, U in self.units.items():
                self.gbuf[u][U.lo : U.hi] = self.dp.reduce_scatter(self.gbuf[u])  # (Pp) -> (S)
        # stage 2/3: already reduce-scattered, unit by unit, during backward

    def grad_sum_sq(self, local: float) -> float:
        return self.dp.allreduce_scalar(local)  # every element is owned by exactly one rank

    def after_step(self) -> None:
        if self.stage < 3:  # all-gather: each rank's updated S elements -> the full Pp
            for u, U in self.units.items():
                self.pbuf[u][...] = self.dp.allgather(self.pbuf[u][U.lo : U.hi])
        # stage 3: parameters stay sharded; forward gathers them when it needs them

    def loss_total(self, share: float) -> float:
        return self.dp.allreduce_scalar(share)

    def _gathered(self) -> dict:
        full = {}
        for u in self.units:
            full.update({k: v.copy() for k, v in self._weights(u).items()})
        return full

    def generate(self, idx, n: int):
        if self.stage < 3:
            return self.model.generate(idx, n)
        return G.GPT(self.model.cfg, self._gathered()).generate(idx, n)  # collective over dp

    def full_params(self) -> dict | None:
        full = self._gathered() if self.stage == 3 else dict(self.model.params)
        return full if self.grid.rank == 0 else None

    def memory(self) -> dict[str, int]:
        """Bytes of the parameter and gradient buffers this rank keeps, and peak activations."""
        return {"params": sum(int(b.nbytes) for b in self.pbuf.values()),
                "grads": sum(int(b.nbytes) for b in self.gbuf.values()),
                "activations": self.peak_activations}
