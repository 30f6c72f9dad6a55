"""The PipeDream family's action lists: PipeDream-2BW and PipeDream with weight stashing,
pipelines without a flush (refmp.parallel.pipeline.asynchronous runs them).

Shapes: pp stages (ranks), m micro-batches of a batch; micro-batch j m + i of a step's list is
batch t + j's i-th. Actions as in schedules.py (F, B); catalog.run_of_steps strings steps
together with an update ``U`` between them.
"""

from __future__ import annotations

from refmp.parallel.pipeline.schedules import Action


def lead(pp: int, m: int, rank: int) -> int:
    """How many actions past its last backward of a batch rank r runs in a 2bw step: in
    the flush-free run at unit costs (F 1, B 2) the last backward of a batch reaches stage
    r 2r steps before stage 0, and the 2r steps hold F, B, F, ... (an action that would not
    end within them waits for the next step). Capped so that no forward of batch t+2 (whose
    weights the update makes) enters step t."""
    q, rem = divmod(2 * rank, 3)
    return min(2 * q + (rem >= 1), 2 * (m - min(pp - rank - 1, m)))


def two_bw(pp: int, m: int, rank: int, fill: bool = False, ahead: bool = True) -> list[Action]:
    """PipeDream-2BW's step (Narayanan et al. 2021, sec. 3): 1F1B without the flush.

    The flush-free run is one 1F1B list over every batch (warm-up F(0..w-1), w = min(pp -
    rank - 1, m), then F(k + w), B(k) for ever); a step is the stretch of it that ends when
    the step's last backward reaches stage 0, where every rank is at the same moment of the
    unit-cost run (rank r is ``lead`` actions further). Micro-batches 0..m-1 are this step's
    batch t, m..2m-1 batch t+1's: its first forwards (and on later stages its first
    backwards, whose gradients wait for step t+1) fill the cool-down. ``fill``: the first
    step, from the start; not ``ahead``: the drain, batch t's actions left (with fill: 1F1B).
    """
    w, s = min(pp - rank - 1, m), lead(pp, m, rank)
    run = [Action("F", i, rank) for i in range(w)]
    for k in range(3 * m):
        run += [Action("F", k + w, rank), Action("B", k, rank)]
    if fill:  # from the start to the first step's end
        acts, start = run[: w + 2 * m + s] if ahead else run, 0
    else:  # a steady step: batch 1 of the run is this step's
        acts, start = run[w + 2 * m + s : w + 4 * m + s] if ahead else run[w + 2 * m + s :], m
    return [Action(a.kind, a.mb - start, rank) for a in acts
            if ahead or start <= a.mb < start + m]


def pipedream_version(pp: int, rank: int, batch: int) -> int:
    """PipeDream's weight stashing (Narayanan et al. 2019, sec. 3.3), vertical sync off, one
    update per batch: stage ``rank``'s forward and backward of batch t both run on W(max(t -
    (pp - 1 - rank), 0)), the weights after max(t - (pp - 1 - rank), 0) updates."""
    return max(batch - (pp - 1 - rank), 0)


def pipedream(pp: int, m: int, rank: int, fill: bool = False, ahead: int = 0) -> list[Action]:
    """Step t of PipeDream with weight stashing: rank r forwards batch t + d (d = pp - 1 - r)
    on the current weights W(t) and runs batch t's backwards, each on its stashed version.

    Micro-batch j m + i is batch t + j's i-th. ``fill``: the first step, which forwards
    batches 0..d (all on W(0)); ``ahead``: how many batches after t exist (the drain leaves
    out forwards of batches past the last). Order: w = min(n, 2 d + 1) forwards (rank r's
    first backward arrives 2 d + 1 steps in, at F 1, B 2), then B, F pairs, then the B's left.
    """
    d = pp - 1 - rank
    offsets = range(min(d, ahead) + 1) if fill else [d] if d <= ahead else []
    fwd = [Action("F", j * m + i, rank) for j in offsets for i in range(m)]
    bwd = [Action("B", i, rank) for i in range(m)]
    w = min(len(fwd), 2 * d + 1)
    out = fwd[:w]
    for k in range(m):
        out += [bwd[k]] + fwd[w + k : w + k + 1]
    return out + fwd[w + m :]
