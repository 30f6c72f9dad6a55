"""One whole parameter from a run that holds it in pieces: what ``--save`` streams, tensor by
tensor (refmp.checkpoint.weights.save_streamed), so that no rank ever holds the model.

Shapes: S a unit's owned slice, Pp the unit flat and padded (refmp.parallel.data.sharder).

A parameter lives on the pipeline stages that hold its block (wte: both ends; the first is
read), cut over tp (placement.TP_SPLITS), an expert on the ep ranks that own it, and over
ZeRO's group of its unit (S of Pp each). ``gather_param`` undoes the three on the first such
stage only: the unit all-gathered over its group (the whole unit, kept while the file asks
for its names: one unit at a time), the tp pieces glued (placement.gather_tp, tp_unshard),
then one rank of them sends it to world rank 0:

    allgather@group  Pp w      stage 3, or mixed precision's masters at stages 1-3
    allgather@tp     the parameter's shard, for a tp-split parameter
    send / recv      the parameter, w bytes an element, when world rank 0 does not hold it
"""

from __future__ import annotations

from refmp.distributed.waiting import wait
from refmp.nn import gpt
from refmp.parallel.placement import gather_tp, unit_of
from refmp.runtime import backend

TAG = 32766  # the whole parameter to world rank 0


def senders(engine) -> dict[str, tuple[int, int]]:
    """name -> (the first pp stage that holds it, the world rank that sends it from there:
    tp rank 0 and rank 0 of its unit's group): one allgather_obj over the world."""
    sh = engine.sharder
    held = [(k, engine.tp.rank == 0 and sh.groups[u].rank == 0)
            for u, unit in sh.units.items() for k in unit.shapes]
    out: dict[str, tuple[int, int]] = {}
    for r, (pp, names) in enumerate(engine.grid.world.allgather_obj((engine.pp.rank, held))):
        for k, sends in names:
            if sends and (k not in out or pp < out[k][0]):
                out[k] = (pp, r)
    return out


def gather_param(engine, name: str):
    """The whole parameter ``name`` (GPT-2 name, the weights' dtype: with mixed precision the
    fp32 masters) on world rank 0 as a host array, None elsewhere. Collective over the world:
    every rank asks for the same names in the same order; the first call learns who holds
    what (``senders``, kept on the engine). A unit gathered is kept until a call asks for a
    parameter of another (the file's order takes a block's names one after another), so
    each unit is gathered about once."""
    sh, world, xp = engine.sharder, engine.grid.world, backend.xp
    if getattr(engine, "_senders", None) is None:
        engine._senders = senders(engine)
    stage, sender = engine._senders[name]
    u = unit_of(name)
    out = None
    mine = u in sh.units and name in sh.units[u].shapes  # (an expert: its ep ranks only)
    kept = getattr(engine, "_gathered", None)
    engine._gathered = None  # the unit a call before gathered: kept while its names come
    if engine.pp.rank == stage and mine:
        if kept is not None and kept[0] == (u, sh.step):  # the same unit, no step between
            unit = kept[1]
        elif sh.mixed:  # the fp32 masters of the unit, all-gathered where partitioned
            flat, group = sh.master[u], sh.groups[u]
            if sh.stage > 0 and group.size > 1:
                flat = group.allgather(xp.ascontiguousarray(flat))
            unit = sh.units[u].views(flat)
        else:
            unit = sh.weights(u, exact=True)  # stage 3: the unit gathered now
        engine._gathered = ((u, sh.step), unit)
        piece = unit[name]
        if sh.groups[u].rank == 0:  # one rank of the unit's group glues its tp pieces
            out = gather_tp({name: piece}, engine.tp, engine.mcfg.vocab_size)[name]
        del piece, unit
    if sender != 0 and world.rank == sender:
        wait(world.send(xp.ascontiguousarray(out), 0, tag=TAG))
    elif sender != 0 and world.rank == 0:
        out = world.recv(gpt.param_shapes(engine.mcfg)[name], sh.dtype, sender, tag=TAG)
    return backend.to_host(out) if world.rank == 0 else None  # written before the next step
