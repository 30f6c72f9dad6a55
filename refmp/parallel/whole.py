"""One whole parameter from a run that holds it in pieces: what ``--save`` streams, tensor by
tensor (refmp.checkpoint.weights.save_streamed), so that no rank ever holds the model.

Shapes: S a unit's owned slice, Pp the unit flat and padded (refmp.parallel.data.sharder).

A parameter lives on the pipeline stages that hold its block (wte: both ends; the first is
read), cut over tp (its family's split, refmp.parallel.family: placement.TP_SPLITS for
GPT-2), an expert on the ep ranks that own it, and over ZeRO's group of its unit (S of Pp
each). ``ParamGatherer`` undoes the three on the first such stage only: the unit
all-gathered over its group (the whole unit, kept while the file asks for its names: one
unit at a time), the tp pieces glued (the family's gather_tp), then one rank of them sends
it to world rank 0 (``ParamGatherer``):

    allgather@group  Pp w      stage 3, or mixed precision's masters at stages 1-3
    allgather@tp     the parameter's shard, for a tp-split parameter
    send / recv      the parameter, w bytes an element, when world rank 0 does not hold it
"""

from __future__ import annotations

from refmp.distributed.waiting import wait
from refmp.parallel.placement import gather_etp, unit_of
from refmp.runtime import backend

TAG = 32766  # the whole parameter to world rank 0


class ParamGatherer:
    """``gather(name)``: the whole parameter ``name`` (GPT-2 name, the weights' dtype: with
    mixed precision the fp32 masters) on world rank 0 as a host array, None elsewhere.
    Collective over the world: every rank asks for the same names in the same order. Made
    once for a stream of names: it learns who holds what (``senders``, one allgather_obj),
    and keeps the unit it gathered last until a name of another unit comes (the file's order
    takes a block's names one after another), so each unit is gathered about once."""

    def __init__(self, engine):
        self.engine = engine
        self.senders = senders(engine)
        self.kept = None  # ((unit, step), its parameters whole)

    def __call__(self, name: str):
        eng = self.engine
        sh, world, xp = eng.sharder, eng.grid.world, backend.xp
        stage, sender = self.senders[name]
        u = unit_of(name)
        out = None
        mine = u in sh.units and name in sh.units[u].shapes  # (an expert: its ep ranks only)
        kept = self.kept
        self.kept = None  # the unit a call before gathered goes unless this call takes it
        if eng.pp.rank == stage and mine:
            same = kept is not None and kept[0] == (u, sh.step)  # no step between
            unit = kept[1] if same else sh.whole_unit(u)  # stage 3: the unit gathered now
            self.kept = ((u, sh.step), unit)
            if sh.groups[u].rank == 0:  # one rank of the unit's group glues its tp pieces
                out = eng.family.gather_tp({name: unit[name]}, eng.tp)[name]
                out = gather_etp({name: out}, eng.etp)[name]  # an expert's etp pieces (folding)
            del unit
        if sender != 0 and world.rank == sender:
            wait(world.send(xp.ascontiguousarray(out), 0, tag=TAG))
        elif sender != 0 and world.rank == 0:
            out = world.recv(eng.family.shapes()[name], sh.dtype, sender, tag=TAG)
        return backend.to_host(out) if world.rank == 0 else None  # written before the next step


def senders(engine) -> dict[str, tuple[int, int]]:
    """name -> (the first pp stage that holds it, the world rank that sends it from there:
    tp rank 0 (an expert with folding: etp rank 0) and rank 0 of its unit's group): one
    allgather_obj over the world."""
    sh = engine.sharder
    lead = engine.etp.rank == 0 if engine.grid.folded else engine.tp.rank == 0  # experts'
    held = [(k, (lead if u.endswith(".experts") else engine.tp.rank == 0)
             and sh.groups[u].rank == 0) for u, unit in sh.units.items() for k in unit.shapes]
    out: dict[str, tuple[int, int]] = {}
    for r, (pp, names) in enumerate(engine.grid.world.allgather_obj((engine.pp.rank, held))):
        for k, sends in names:
            if sends and (k not in out or pp < out[k][0]):
                out[k] = (pp, r)
    return out
