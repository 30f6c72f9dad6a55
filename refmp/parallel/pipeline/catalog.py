"""The schedule catalog: every pipeline schedule named once, with what its callers ask of it.

Shapes: pp stages (ranks), m micro-batches, v virtual stages (chunks per rank); r a stage,
t a batch (a step's).

A caller asks the catalog (``CATALOG[name]``), never compares a schedule's name: how to make
a rank's list (``actions``), how many chunks a rank holds and where they sit
(``chunk_placement``: in a loop or in a V), whether a step ends with a flush, how many later
batches a step runs actions of (``ahead``: 2bw 1, pipedream pp - 1, the rest 0), the weight
versions a stage keeps and the one a batch computes on, the textbook bubble, and what a
schedule without a flush carries from step to step. The list functions are schedules.py's,
vshape.py's and pipedream.py's; refmp.config's ``--schedule`` choices are these names
(tests/test_pipeline_schedules.py holds them equal).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from refmp.parallel.pipeline import pipedream as pd
from refmp.parallel.pipeline import schedules as sc
from refmp.parallel.pipeline import vshape
from refmp.parallel.pipeline.schedules import Action, ChunkPlacement


def one_step(fn: Callable) -> Callable:
    """A list function of (pp, m, rank) as the catalog calls every schedule's."""
    return lambda pp, m, rank, v, fill, ahead: fn(pp, m, rank)


def interleaved(pp: int, m: int, rank: int, v: int, fill: bool, ahead) -> list[Action]:
    return sc.interleaved(pp, m, rank, v)


def two_bw(pp: int, m: int, rank: int, v: int, fill: bool, ahead) -> list[Action]:
    """A step of 2bw (``ahead`` None: a later batch exists; 0: the drain)."""
    return pd.two_bw(pp, m, rank, fill, ahead is None or ahead > 0)


def pipedream(pp: int, m: int, rank: int, v: int, fill: bool, ahead) -> list[Action]:
    """A step of pipedream (``ahead`` None: enough later batches, pp)."""
    return pd.pipedream(pp, m, rank, fill, pp if ahead is None else ahead)


@dataclass(frozen=True)
class Schedule:
    """One schedule and its answers. ``build(pp, m, rank, v, fill, ahead)``: the list
    function; ``chunks``: chunks per rank (None: --virtual-stages, whose micro-batches go
    round the ranks in groups of pp); ``placement``: ChunkPlacement's kind; ``flushes``:
    each step sums its own batch's whole gradient; ``ahead(pp)``: the later batches whose
    actions a step runs; ``versions(pp, r)``: the weight versions stage r keeps;
    ``version(pp, r, t)``: the one batch t computes on at stage r; ``bubble(pp, m, v)``:
    idle / total for equal-cost chunks (simulate.py's docstring derives them); ``carries``:
    what a step without a flush hands the next (a checkpoint does not hold it); ``moe``:
    whether the MoE losses of the later batches' forwards land in their own step."""

    name: str
    build: Callable[..., list[Action]]
    bubble: Callable[[int, int, int], float]
    chunks: int | None = 1
    placement: str = "loop"
    flushes: bool = True
    ahead: Callable[[int], int] = lambda pp: 0
    versions: Callable[[int, int], int] = lambda pp, r: 1
    version: Callable[[int, int, int], int] = lambda pp, r, t: t
    carries: str = ""
    moe: bool = True

    def actions(self, pp: int, m: int, rank: int, v: int = 1, fill: bool = False,
                ahead: int | None = None) -> list[Action]:
        """Rank ``rank``'s actions for one step (``fill``: the first, from an empty
        pipeline; ``ahead``: how many later batches there are, None: enough)."""
        return self.build(pp, m, rank, v, fill, ahead)

    def chunks_per_rank(self, virtual: int = 1) -> int:
        return virtual if self.chunks is None else self.chunks

    def chunk_placement(self, pp: int, virtual: int = 1) -> ChunkPlacement:
        """Which chunks each of the pp ranks runs."""
        return ChunkPlacement(pp, self.chunks_per_rank(virtual), self.placement)


CATALOG = {s.name: s for s in (
    Schedule("naive", one_step(sc.naive), lambda p, m, v: (p - 1) / p),
    Schedule("gpipe", one_step(sc.gpipe), lambda p, m, v: (p - 1) / (m + p - 1)),
    Schedule("1f1b", one_step(sc.one_f_one_b), lambda p, m, v: (p - 1) / (m + p - 1)),
    Schedule("interleaved", interleaved, lambda p, m, v: (p - 1) / (v * m + p - 1),
             chunks=None),
    Schedule("zb-h1", one_step(sc.zb_h1), lambda p, m, v: (p - 1) / (3 * m + p - 1)),
    Schedule("zb-v", one_step(vshape.zb_v), lambda p, m, v: (p - 1) / (6 * m + p - 1),
             chunks=2, placement="v"),  # m >= 2p - 1
    Schedule("dualpipev", one_step(vshape.dualpipev), lambda p, m, v: (p - 1) / (6 * m + p - 1),
             chunks=2, placement="v"),  # m >= 2p
    # a steady step, boundaries uncapped (pipedream.two_bw)
    Schedule("2bw", two_bw, lambda p, m, v: (p > 1) / (3 * m + (p > 1)), flushes=False,
             ahead=lambda pp: 1, versions=lambda pp, r: 2,
             version=lambda pp, r, t: max(t - 1, 0),
             carries="computes on the previous weight version and carries the next batch's "
                     "activations and gradients"),
    Schedule("pipedream", pipedream, lambda p, m, v: 2 * (p - 1) / (3 * m + 2 * (p - 1)),
             flushes=False, ahead=lambda pp: pp - 1, versions=lambda pp, r: pp - r,
             version=pd.pipedream_version, moe=False,
             carries="carries the forwards of up to pp - 1 later batches and the weight "
                     "versions they ran on"),
)}
NAMES = tuple(CATALOG)  # --schedule's choices


def schedule(name: str, pp: int, m: int, rank: int, v: int = 1, fill: bool = False,
             ahead: int | None = None) -> list[Action]:
    """Rank ``rank``'s actions for one step of ``name`` with pp stages and m micro-batches
    (2bw and pipedream: by default a steady step; ``fill``: the first; ``ahead``: how many
    later batches there are, None: enough)."""
    return CATALOG[name].actions(pp, m, rank, v, fill, ahead)


def run_of_steps(name: str, pp: int, m: int, rank: int, steps: int) -> list[Action]:
    """Rank ``rank``'s actions over ``steps`` steps of an asynchronous schedule (2bw,
    pipedream: the first fills, the last drains), micro-batch g of step t as t m + g, and an
    action ``U`` (the update: a step boundary) between steps."""
    out: list[Action] = []
    for t in range(steps):
        out += [a._replace(mb=t * m + a.mb)
                for a in schedule(name, pp, m, rank, fill=t == 0, ahead=steps - 1 - t)]
        out += [Action("U", t, -1)] if t < steps - 1 else []
    return out
