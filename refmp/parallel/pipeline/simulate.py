"""Run the schedules' action lists without MPI: completion, bubble, memory, timeline.

Shapes: pp stages, m micro-batches, v virtual stages, S = pp * v chunks.

Time model (Qi et al. 2023's): a chunk's forward F, input-gradient B and weight-gradient W
each take one step; a backward that is not split takes two (B + W). Messages are free and
sends never block, so a rank waits only for the message it needs next. Each rank runs its list
in order; an action starts when the rank is free and its inputs exist (schedules.py says
which). If no rank can move before all are done, the schedule deadlocks: :func:`simulate`
raises and names what each rank waits for.

Bubble fraction = idle / (pp * makespan). With those costs (all chunks equal):
  naive (p-1)/p;  gpipe, 1f1b (p-1)/(m+p-1);  interleaved (p-1)/(v m+p-1);
  zb-h1 (p-1)/(3m+p-1)  (Qi et al.: bubble (p-1)(F+B-W) instead of (p-1)(F+B+W));
  zb-v, dualpipev (p-1)/(6m+p-1): 2 chunks per rank, each 1/2 a stage, 6m steps of work, and
  p-1 steps idle per rank (the fill of the V), for m >= 2p-1 (ZB-V) and m >= 2p (DualPipeV);
  2bw 1/(3m+1) in a steady step (for p > 1, where pipedream.lead is not capped): the next
  batch's first forwards and backwards fill the cool-down, and the step boundary (the
  global norm needs the whole gradient) falls where every rank is at the same moment of the
  flush-free run, but for rank 1's backward that would not end by then: one idle step;
  pipedream 2(p-1)/(3m+2(p-1)) in a steady step: the forwards need no message of the step,
  but the next step's need its update, so the last backward's way down to stage 0 is idle.
"""

from __future__ import annotations

from refmp.parallel.pipeline.catalog import CATALOG, run_of_steps
from refmp.parallel.pipeline.schedules import Action, ChunkPlacement
from refmp.parallel.pipeline.timeline import Event, Timeline


class Deadlock(RuntimeError):
    pass


def depends_on(a: Action, chunks: int) -> list[Action]:
    """The actions whose results ``a`` needs (the messages and the cache it consumes)."""
    if a.kind == "F":
        return [Action("F", a.mb, a.chunk - 1)] if a.chunk > 0 else []
    if a.kind == "B":
        after = [Action("B", a.mb, a.chunk + 1)] if a.chunk < chunks - 1 else []
        return [Action("F", a.mb, a.chunk)] + after
    return [Action("B", a.mb, a.chunk)]  # W


def check_actions(lists: list[list[Action]], pp: int, m: int, v: int,
                  placed: ChunkPlacement | None = None) -> set[tuple[int, int]]:
    """Every F and B of every micro-batch and chunk once, on its rank, and at most one W each,
    after its B; returns the (micro-batch, chunk) whose backward is split (a W is listed).
    ``placed``: where the chunks sit (default: in a loop)."""
    placed = placed or ChunkPlacement(pp, v)
    lists = [[a for a in acts if a.kind != "U"] for acts in lists]  # step boundaries
    split = {(a.mb, a.chunk) for acts in lists for a in acts if a.kind == "W"}
    want = sorted([Action(k, i, c) for k in "FB" for i in range(m) for c in range(pp * v)]
                  + [Action("W", i, c) for i, c in split])
    got = sorted(a for acts in lists for a in acts)
    if got != want:
        raise ValueError("the schedule does not run every action exactly once")
    for r, acts in enumerate(lists):
        if any(placed.rank(c) != r for c in {a.chunk for a in acts}):
            raise ValueError(f"rank {r} is given a chunk it does not hold")
    return split


def simulate(lists: list[list[Action]], pp: int, m: int, v: int = 1, name: str = "",
             costs: dict[tuple[int, str], float] | None = None,
             placed: ChunkPlacement | None = None, pair: float | None = None,
             hops: dict[int, tuple[float, float]] | None = None) -> Timeline:
    """Execute the per-rank lists in simulated time; a Timeline with events and peak memory.

    ``costs`` {(rank, kind): time} replaces the unit costs, e.g. a measured run's
    (Timeline.costs): the bubble the schedule itself implies for those costs, with messages
    still free (what is left of a measured bubble beyond it is communication and overhead).
    An entry {(rank, kind, mb, chunk): time} sets one action's cost (Timeline.action_costs:
    a measured step replayed).
    An action ``U`` is a step boundary (the gradient's reduction, its norm and the update:
    collectives over every rank): no rank passes it before every rank has reached it.
    ``pair`` (DualPipe's F&B, DeepSeek-V3 sec. 3.2.1): an F followed on its rank's list by
    an unsplit B of another chunk run as one overlapped pair of that cost, from when both
    may start (drawn as F for a third of it, then B; both results at its end).
    ``hops`` {rank: (send, recv)}: what a message costs its ranks outside compute (a
    measured run's, Timeline.hops): the sender after the action that makes it, the receiver
    before the action that takes it; the events stay the compute, so bubble() counts the
    hops as idle, as a measured timeline does.
    """
    if hops is not None and pair is not None:
        raise ValueError("simulate: hops are not modelled for DualPipe's overlapped pairs")
    split = check_actions(lists, pp, m, v, placed)
    chunks = pp * v
    done: dict[Action, int] = {}
    pos, free = [0] * pp, [0] * pp
    live, peak = [0] * pp, [0] * pp  # micro-batch activations live per rank (over chunks)
    tl = Timeline(name, pp, m, v)
    while any(pos[r] < len(lists[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while pos[r] < len(lists[r]):
                a = lists[r][pos[r]]
                if a.kind == "U":
                    break
                b = lists[r][pos[r] + 1] if pos[r] + 1 < len(lists[r]) else a
                paired = (pair is not None and a.kind == "F" and b.kind == "B"
                          and b.chunk != a.chunk and (b.mb, b.chunk) not in split)
                group = [a, b] if paired else [a]
                deps = [d for g in group for d in depends_on(g, chunks) if d not in group]
                try:
                    start = t0 = max([free[r]] + [done[d] for d in deps])
                except KeyError:  # an input not made yet: the rank waits for it
                    break
                send, recv = hops[r] if hops else (0.0, 0.0)
                if hops and any(d.chunk != a.chunk for d in deps):  # a message from another chunk
                    start = t0 = start + recv
                for g in group:
                    whole = g.kind == "B" and (g.mb, g.chunk) not in split  # B + W in one pass
                    end = (t0 + pair * (1 if g is b else 1 / 3) if paired else
                           start + (costs.get((r, *g), costs.get((r, g.kind))) if costs
                                    else 1 + whole))
                    tl.events.append(Event(r, g.kind, g.mb, g.chunk, start, end))
                    sends = (g.kind == "F" and g.chunk < chunks - 1) or (g.kind == "B" and g.chunk > 0)
                    done[g] = free[r] = start = end + (send if sends else 0.0)
                    # the cache of F lives until the last pass that reads it (B, or W if split)
                    live[r] += {"F": 1, "B": -whole, "W": -1}[g.kind]
                    peak[r] = max(peak[r], live[r])
                if paired:
                    done[a] = done[b]  # the pair's results at its end
                pos[r] += len(group)
                moved = True
        at_u = [pos[r] < len(lists[r]) and lists[r][pos[r]].kind == "U" for r in range(pp)]
        if not moved and all(at_u):  # every rank at the boundary: they leave it together
            free = [max(free)] * pp
            tl.barriers.append(free[0])
            pos = [p + 1 for p in pos]
            moved = True
        if not moved:
            waits = ", ".join(f"rank {r} at {lists[r][pos[r]]}" for r in range(pp)
                              if pos[r] < len(lists[r]))
            raise Deadlock(f"schedule {name!r} deadlocks: {waits}")
    tl.peak_held = peak
    return tl


def simulate_steps(name: str, pp: int, m: int, steps: int = 3,
                   costs: dict[tuple[int, str], float] | None = None,
                   hops: dict[int, tuple[float, float]] | None = None) -> Timeline:
    """``steps`` training steps of an asynchronous schedule (2bw, pipedream: the first
    fills, the last drains) with the step boundaries between them. Micro-batch g is batch
    g // m's; each event is labelled with the weight version it computes on (``versions``,
    (rank, micro-batch) -> version): 2bw's W(g // m - 1) (W(-1) = W(0)), pipedream's
    pipedream.pipedream_version (the catalog's ``version``)."""
    lists = [run_of_steps(name, pp, m, r, steps) for r in range(pp)]
    tl = simulate(lists, pp, steps * m, 1, name, costs, hops=hops)
    rule = CATALOG[name].version
    tl.versions = {(r, g): rule(pp, r, g // m) for r in range(pp) for g in range(steps * m)}
    return tl


def simulate_schedule(name: str, pp: int, m: int, v: int = 1,
                      costs: dict[tuple[int, str], float] | None = None,
                      hops: dict[int, tuple[float, float]] | None = None) -> Timeline:
    """One step of ``name``; for 2bw and pipedream a steady one (for 2bw the middle step of
    three, for pipedream step pp - 1 of 2 pp - 1, between its boundaries: step ``ahead``),
    as a step of a long run goes."""
    s = CATALOG[name]
    if not s.flushes:
        k = max(s.ahead(pp), 1)
        tl = simulate_steps(name, pp, m, 2 * k + 1, costs, hops)
        return tl.window(*tl.barriers[k - 1 : k + 1])
    placed = s.chunk_placement(pp, v)
    return simulate([s.actions(pp, m, r, placed.v) for r in range(pp)], pp, m, placed.v, name,
                    costs, placed, hops=hops)


def bubble_formula(name: str, pp: int, m: int, v: int = 1) -> float:
    """The textbook bubble fraction (idle / total) for equal-cost chunks (the catalog's)."""
    return CATALOG[name].bubble(pp, m, v)
