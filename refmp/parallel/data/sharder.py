"""The Sharder: data parallelism and ZeRO 0-3 over whatever local arrays a rank holds.

Rajbhandari et al. 2020, "ZeRO", sec. 5. Shapes: P elements of a unit, Pp = P padded up to a
multiple of the unit's group size n (no padding at stage 0), S = Pp/n the slice a rank owns.

A rank's local parameters (its tp shards, its pipeline stage's blocks, its experts) are cut
into units (placement.unit_of: ``wte``, ``wpe``, each block ``h.{i}``, its experts
``h.{i}.experts``, ``ln_f``), each flattened in order into one buffer. A unit is replicated
over a group of ranks: dense units over dp x cp (grid.group("dp", "cp")), expert units over
edp. That replication is what the stages remove, on each unit's own group:

    stage 0   full params, full grads: the gradient is all-reduced, in buckets, as soon as
              its unit is complete after the last micro-batch (overlapping backward, as
              PyTorch DDP, Li et al. 2020); ``bucket_mb`` 0: one all-reduce after backward
    stage 1   ... optimizer state on the S owned elements only; the full gradient is
              reduce-scattered once per step; the updated slices all-gathered after the step
    stage 2   ... gradients too: each unit's gradient is reduce-scattered as soon as a
              micro-batch completes it, and only the slice S is kept
    stage 3   ... parameters too: a unit's weights are all-gathered just before each forward
              and each backward that needs them (``weights``), and freed after; with
              ``hpz`` (ZeRO++, refmp.parallel.data.hpz) inside blocks of G ranks, from a
              secondary slice refreshed across the blocks after each step (``after_step``)

The units' gradients are summed shares of the global loss (refmp.parallel.data.accumulate), so the slice
a rank owns equals the same elements of the serial gradient. Clipping and the optimizer see
``params`` / ``grads``: the owned slice of every unit, split back by parameter into flat
pieces (so weight decay still goes to matrices only; the padding is a piece of its own whose
gradient is always 0). The pipeline calls ``weights`` / ``accumulate`` / ``grad_ready``
around its actions: ZeRO (any stage) composes with every schedule, micro-batch by micro-batch.

Mixed precision (``compute`` bf16 or fp16; Micikevicius et al. 2018, ZeRO's sec. 3.1
accounting of 2 + 2 + 12 bytes per parameter): the buffers the model computes on (``pbuf``)
hold the 16-bit *compute copy*, the gradient buffers the compute dtype too (or ``grad_dtype``
fp32), and the optimizer's ``params`` are pieces of fp32 *masters* of the owned slice only
(S elements; all Pp at stage 0). Reductions run in the gradient dtype, so they move half the
bytes. Before the optimizer, ``master_grads`` widens the owned gradient slice to fp32 and
undoes the loss scale (fp16); after it, ``after_step`` rounds the masters into the owned
slice of the compute copy, and stages 1 and 2 all-gather that copy (half the bytes again).

Compression (refmp.parallel.data.compress), from the codec's ``start`` step on: bf16 sends
every reduction above in bf16; PowerSGD and top-k replace the sum of a whole unit (stages 0
and 1, after backward, no buckets; alone on its group the codec still runs, sending nothing:
the serial run with the same compressor); ``gather`` (ZeRO-3) all-gathers weights in int8.
"""

from __future__ import annotations

import math

import numpy as np

from refmp.distributed.comm import Comm
from refmp.distributed.waiting import progress, wait
from refmp.parallel.data.hpz import block_gather, secondary
from refmp.parallel.data.index import OwnedIndex
from refmp.parallel.data.zero import Unit
from refmp.runtime.backend import array_module


class InMemory:
    """Local arrays already whole in memory (a test's, a tutorial's) as what the Sharder
    reads: ``shapes``, ``dtype``, ``xp`` and ``read(name, flat)``, the array or elements
    [a, b) of it flattened (refmp.parallel.placement.ShardReader reads them from a Source)."""

    def __init__(self, arrays: dict):
        self.arrays = arrays
        self.shapes = {k: tuple(v.shape) for k, v in arrays.items()}
        p0 = next(iter(arrays.values()))
        self.dtype = p0.dtype
        self.xp = array_module(p0)

    def read(self, name: str, flat: tuple[int, int] | None = None):
        v = self.arrays[name]
        return v if flat is None else v.reshape(-1)[flat[0] : flat[1]]


def owned(unit: Unit, name: str) -> tuple[int, int] | None:
    """[a, b): the elements of parameter ``name`` (flattened) that this rank's slice of
    ``unit`` holds, the ``flat`` range of its refmp.nn.slices.Index (None: none of them)."""
    o = unit.offsets[name]
    a = max(o, unit.lo)
    b = min(o + math.prod(unit.shapes[name]), unit.hi)
    return (a - o, b - o) if a < b else None


class Sharder:
    """ZeRO ``stage`` over ``local`` (name -> array, or a reader as InMemory: the engine's
    reads each shard from a Source), cut into ``units`` (unit -> names), each reduced over
    ``groups[unit]``, built one unit at a time. The model computes on ``weights(unit)``.

    Options: ``bucket_mb`` stage 0's all-reduce buckets (0: one after backward); ``compute``
    and ``grad_dtype`` mixed precision's dtypes (None: the parameters'); ``codec`` a gradient
    codec and ``gather`` ZeRO-3's weight-gather codec (refmp.parallel.data.compress);
    ``hpz`` unit -> (inner, outer): ZeRO-3's gathers of that unit inside its inner group, from
    a secondary partition (refmp.parallel.data.hpz); ``replicas`` unit -> the ranks holding
    the same slices of that unit (HSDP, refmp.parallel.data.hsdp: ``groups[unit]`` is then
    its shard group), which sum the owned gradient once a step."""

    def __init__(self, local, units: dict[str, list[str]], groups: dict[str, Comm],
                 stage: int, *, bucket_mb: float = 25.0, compute=None, grad_dtype=None,
                 codec=None, gather=None, hpz: dict | None = None, replicas: dict | None = None):
        self.stage = stage
        self.groups = groups
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.codec = codec
        self.gather = gather
        self.hpz = hpz or {}
        self.replicas = replicas or {}
        self.step = -1  # zero_grad() calls - 1
        local = InMemory(local) if isinstance(local, dict) else local
        self.xp = local.xp
        self.dtype = np.dtype(local.dtype)  # the masters' (--dtype)
        self.compute = np.dtype(compute or self.dtype)  # what the model computes on
        self.gdtype = np.dtype(grad_dtype or self.compute)  # gradients, and their sums
        self.mixed = self.compute != self.dtype
        self.units = {u: Unit(u, {k: tuple(local.shapes[k]) for k in ks},
                              groups[u].size if stage else 1, groups[u].rank if stage else 0)
                      for u, ks in units.items()}
        self.pbuf: dict = {}  # unit -> the weights the model computes on (Pp,), stage 3: (S,)
        self.gbuf: dict = {}  # unit -> its gradient (Pp,), stages 2-3: the owned slice (S,)
        self.sbuf: dict = {}  # hpZ: unit -> its secondary slice (N S,)
        self.work: dict = {}  # stages 2-3: a micro-batch's full gradient until reduce-scattered
        self.master: dict = {}  # mixed precision: the fp32 owned slices (S,)
        self.mgrad: dict = {}  # and their fp32 unscaled gradients
        self.params: dict = {}  # the owned pieces, by name (the optimizer's view)
        self.grads: dict = {}
        for u, unit in self.units.items():  # one unit read at a time
            self._build(u, unit, local)
            self.gbuf[u] = self.xp.zeros(unit.padded if stage < 2 else unit.shard, self.gdtype)
            owned = self.pbuf[u][unit.lo : unit.hi] if stage < 3 else self.pbuf[u]
            self.params.update(unit.pieces(self.master[u] if self.mixed else owned))
            self.grads.update(unit.pieces(self.gbuf[u][unit.lo : unit.hi] if stage < 2 else self.gbuf[u]))
        self.decay = {k for k in self.params
                      if any(len(unit.shapes.get(k, ())) >= 2 for unit in self.units.values())}
        self._open: list = []  # stage 0: [units, flat, request] of started all-reduces
        self._ready: dict[str, list[str]] = {}  # stage 0: complete units not yet started, by group

    def _build(self, u: str, unit: Unit, local) -> None:
        """Unit u's weight buffers from ``local``: stages 0-2 (and hpZ) read the whole unit
        (Pp,), the one transient; stage 3 reads only the owned elements of each parameter."""
        if self.stage == 3 and u not in self.hpz:
            full = None
            own = self.xp.zeros(unit.shard, self.dtype)  # (S,)
            for k in unit.shapes:
                r = owned(unit, k)
                if r is not None:
                    o = unit.offsets[k] + r[0] - unit.lo
                    own[o : o + r[1] - r[0]] = local.read(k, r)
        else:
            full = self.xp.zeros(unit.padded, self.dtype)  # (Pp,)
            for k, v in unit.views(full).items():
                v[...] = local.read(k)
            own = full[unit.lo : unit.hi]
        if self.mixed:  # masters of my slice; the model gets the rounded compute copy
            self.master[u] = own.copy()  # (S,) fp32
            own = own.astype(self.compute)  # bf16 / fp16
            full = None if full is None else full.astype(self.compute)
        self.pbuf[u] = full if self.stage < 3 else own.copy() if full is not None else own
        if u in self.hpz:
            inner = self.hpz[u][0]
            self.sbuf[u] = secondary(full, inner.size, inner.rank, unit.shard)  # (N S,)

    # --- what the stage means for the callers ---------------------------------------------------

    @property
    def coding(self) -> bool:
        """PowerSGD or top-k replaces this step's sums (the codec has started)."""
        return self.codec is not None and self.codec.replaces and self.step >= self.codec.start

    def _wire(self, buf):
        """``buf`` as a plain reduction sends it: in the codec's wire dtype once it started."""
        codec = self.codec
        if codec is None or codec.wire is None or self.step < codec.start:
            return buf
        return buf.astype(codec.wire)

    @property
    def releases_weights(self) -> bool:
        """Stage 3: weights are gathered for each use and freed after, so a cache names its
        weights (``detach``) and gets them back gathered again (``attach``)."""
        return self.stage == 3

    @property
    def partitions(self) -> bool:
        """Stages 1-3: the ranks of a unit's group own disjoint slices (stage 0: copies)."""
        return self.stage > 0

    def resident(self, versions: list = ()) -> list:
        """The parameter buffers kept between uses (caches reference them; not activations),
        with the weight ``versions`` a pipeline keeps (its snapshots)."""
        return list(self.pbuf.values()) + list(versions) if self.stage < 3 else []

    # --- what the model computes with ---------------------------------------------------------

    def weights(self, u: str, exact: bool = False, version: dict | None = None) -> dict:
        """Unit u's parameters (full local shapes): views of the resident buffer, or, at
        stage 3, of an all-gather made now (S -> Pp; int8 with ``gather`` unless ``exact``),
        alive only while the caller keeps it; of ``version``'s buffer if given (a
        :meth:`snapshot`: 2BW's W(t-1), pipedream's stashed copies)."""
        unit = self.units[u]
        group = self.groups[u]
        buf = (self.pbuf if version is None else version)[u]
        if self.stage < 3 or (group.size == 1 and (self.gather is None or exact)):
            return unit.views(buf)  # (alone, int8 still rounds: the serial run of the codec)
        if self.gather is not None and not exact:
            return unit.views(self.gather.allgather(group, buf))
        if u in self.hpz:  # inside the block, from its secondaries (a version's are too)
            own = self.sbuf[u] if version is None else buf  # (N S,)
            return unit.views(block_gather(self.hpz[u][0], own, unit.shard))
        return unit.views(group.allgather(buf))

    def snapshot(self, into: dict | None = None) -> dict:
        """A copy of every unit's weight buffer (this rank's, as held; with hpZ its secondary
        slice, which the gathers read): a weight version the next update does not overwrite,
        for ``weights(version=)``. ``into``: a snapshot whose buffers are reused."""
        into = {} if into is None else into
        for u, held in self.pbuf.items():
            buf = self.sbuf[u] if u in self.hpz else held
            if u in into:
                into[u][...] = buf
            else:
                into[u] = buf.copy()
        return into

    def full_local(self, grads: bool = False) -> dict:
        """Every local parameter (or its gradient) whole: the owned slices all-gathered over
        each unit's group where they are sharded (collective over every group). With mixed
        precision: the fp32 masters, and the fp32 unscaled gradient of the last step."""
        out = {}
        for u in self.units:
            out.update({k: v.copy() for k, v in self.whole_unit(u, grads).items()})
        return out

    def whole_unit(self, u: str, grads: bool = False) -> dict:
        """Unit u's parameters (or gradients) whole, as views (collective over its group where
        sharded): the weights (ZeRO-3: all-gathered now), or with mixed precision the fp32
        masters; the gradients: the owned slices (mixed: fp32, unscaled) all-gathered."""
        if not grads and not self.mixed:
            return self.weights(u, exact=True)
        # the optimizer's view: fp32 masters, and (mixed) the fp32 unscaled gradient
        flat = self.master[u] if not grads else self.mgrad.get(u, self.owned_grad(u))
        group = self.groups[u]
        if self.stage > 0 and group.size > 1:
            flat = group.allgather(self.xp.ascontiguousarray(flat))  # (Pp,)
        return self.units[u].views(flat)

    def owned_index(self, index) -> OwnedIndex:
        """The owned pieces' global positions (refmp.parallel.data.index.OwnedIndex: a unit
        at a time, as read), by piece name as ``params`` is split; ``index(k)``: parameter
        k's positions shaped like its local shard, -1 where nothing global is held."""
        return OwnedIndex(self.units, index)

    # --- gradients as backward produces them ---------------------------------------------------

    def zero_grad(self) -> None:
        """A step begins (the codec's ``start`` counts these)."""
        self.step += 1
        for g in self.gbuf.values():
            g[...] = 0

    def accumulate(self, u: str, g: dict) -> None:
        """Add this micro-batch's gradients ``g`` (names of unit u, full local shapes)."""
        unit = self.units[u]
        if self.stage < 2:
            target = self.gbuf[u]  # (Pp,) the full gradient lives here all step
        else:  # stage 2/3: a full buffer only until this micro-batch's reduce-scatter
            if u not in self.work:
                self.work[u] = self.xp.zeros(unit.padded, self.gdtype)
            target = self.work[u]  # in the gradient dtype (bf16 / fp16, or fp32)
        views = unit.views(target)
        for k, v in g.items():
            views[k] += v

    def grad_ready(self, u: str, final: bool) -> None:
        """Unit u's gradient of this micro-batch is complete (``final``: of the step's last)."""
        if self.stage >= 2:
            # reduce-scatter: sum the ranks' shares (Pp) and keep my S; the full buffer goes
            work, group = self.work.pop(u), self.groups[u]
            summed = group.reduce_scatter(self._wire(work)) if group.size > 1 else work
            self.gbuf[u] += summed.astype(self.gdtype, copy=False)
        elif self.stage == 0 and final and self.bucket_bytes > 0 and not self.coding:
            ready = self._ready.setdefault(self.groups[u].axis, [])
            ready.append(u)
            if sum(self.gbuf[v].nbytes for v in ready) >= self.bucket_bytes:
                self._start(ready)
                ready.clear()
        for _, _, req in self._open:  # MPICH has no progress thread: Test drives the open
            progress(req)  # all-reduces while backward goes on (the earlier layers' work)

    def _start(self, units: list[str]) -> None:
        """Start the all-reduce of one bucket: these units' gradients, flattened together."""
        group = self.groups[units[0]]
        if group.size == 1:
            return  # nothing to sum
        flat = self._wire(self.xp.concatenate([self.gbuf[u] for u in units]))
        self._open.append((list(units), flat, group.allreduce_start(flat)))

    def finish(self) -> None:
        """After the step's backward: every owned slice holds the summed gradient."""
        if self.coding:  # stage 0 or 1: the codec sums each whole unit
            for u, unit in self.units.items():
                self.codec.reduce(unit, self.gbuf[u], self.groups[u])
        elif self.stage == 0:
            if self.bucket_bytes <= 0:  # one all-reduce per group, after backward
                for axis in dict.fromkeys(g.axis for g in self.groups.values()):
                    self._start([u for u in self.units if self.groups[u].axis == axis])
            for ready in self._ready.values():  # the last, partly filled buckets
                if ready:
                    self._start(ready)
            self._ready = {}
            for units, flat, req in self._open:
                wait(req)
                o = 0
                for u in units:
                    self.gbuf[u][...] = flat[o : o + self.gbuf[u].size]
                    o += self.gbuf[u].size
            self._open = []
        elif self.stage == 1:  # one reduce-scatter per unit per step
            for u, unit in self.units.items():
                if self.groups[u].size > 1:
                    self.gbuf[u][unit.lo : unit.hi] = self.groups[u].reduce_scatter(
                        self._wire(self.gbuf[u]))
        # stage 2/3: reduce-scattered unit by unit during backward
        for u, across in self.replicas.items():  # HSDP: my slice summed over the replicas
            if across.size > 1:
                across.allreduce(self.owned_grad(u))

    def owned_grad(self, u: str):
        """The flat owned slice of unit u's gradient (S,), or all of it at stage 0."""
        unit = self.units[u]
        return self.gbuf[u][unit.lo : unit.hi] if self.stage < 2 else self.gbuf[u]

    def master_grads(self, scale: float = 1.0) -> dict:
        """Mixed precision, before clipping and the optimizer: the owned gradient slices
        widened to the masters' dtype and divided by the loss scale (a power of two: exact),
        as pieces named like ``params``. A transient of the step (ZeRO's accounting, and
        memory(), count the gradient buffers in their own dtype)."""
        pieces = {}
        for u, unit in self.units.items():
            g = self.owned_grad(u).astype(self.dtype)  # (S,) fp32
            if scale != 1.0:
                g *= 1.0 / scale
            self.mgrad[u] = g
            pieces.update(unit.pieces(g))
        return pieces

    def after_step(self) -> None:
        if self.mixed:  # round the updated masters into my slice of the compute copy
            for u, unit in self.units.items():
                own = self.pbuf[u][unit.lo : unit.hi] if self.stage < 3 else self.pbuf[u]
                own[...] = self.master[u]  # fp32 -> bf16 / fp16, round to nearest even
        if self.stage in (1, 2):  # all-gather: each rank's updated S elements -> the full Pp
            for u, unit in self.units.items():
                if self.groups[u].size > 1:
                    self.pbuf[u][...] = self.groups[u].allgather(self.pbuf[u][unit.lo : unit.hi])
        for u, (_, outer) in self.hpz.items():  # hpZ: the updated primaries to the blocks
            self.sbuf[u][...] = outer.allgather(self.pbuf[u])
        # stage 0: every rank made the same update; stage 3: weights stay sharded

    def state(self) -> dict:
        """The codec's arrays that later steps depend on (error buffers, PowerSGD's Q's), by
        name ({} without a codec): refmp.checkpoint.sharded saves them rank by rank."""
        return self.codec.state() if self.codec is not None else {}

    def load_state(self, state: dict) -> None:
        """Continue after ``state["step"]`` steps (the codec's ``start`` counts from the run's
        first step), with the codec's arrays ``state["codec"]`` (None: from zero)."""
        self.step = int(state["step"]) - 1
        if self.codec is not None and state.get("codec") is not None:
            self.codec.load_state(state["codec"])

    def memory(self) -> dict[str, int]:
        """Bytes of the parameter (compute copy), gradient and fp32 master buffers this rank
        keeps between steps, and the codec's error buffers."""
        held = [*self.pbuf.values(), *self.sbuf.values()]
        return {"params": sum(int(b.nbytes) for b in held),
                "grads": sum(int(b.nbytes) for b in self.gbuf.values()),
                "masters": sum(int(b.nbytes) for b in self.master.values()),
                "error_feedback": self.codec.memory() if self.codec is not None else 0}
