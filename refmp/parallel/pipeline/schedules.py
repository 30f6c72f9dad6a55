"""Pipeline schedules as data: a pure function gives each rank its list of actions.

Shapes: pp stages (ranks), m micro-batches, v virtual stages (chunks per rank), S = pp * v.

An action is (kind, micro-batch, chunk):
  F  forward of the chunk on the micro-batch;
  B  backward: the gradient of the chunk's input, plus, in schedules without W actions, its
     weight gradients (the whole backward);
  W  the weight gradients the B left out (zero-bubble schedules only; Qi et al. 2023): a B
     is split exactly when its W is on the list.
Communication is implied by the chunk graph, not listed: F(i, c) needs chunk c-1's output
for micro-batch i (sent by the rank of chunk c-1, ChunkPlacement.rank, when it finishes
F(i, c-1)), and B(i, c) needs the gradient of chunk c's output from B(i, c+1). The executor
(executor.py) posts those sends and receives; the simulator (simulate.py) runs the same lists
without MPI.

Here: naive, GPipe, 1F1B, interleaved 1F1B and ZB-H1, and where each chunk runs. vshape.py
has the V-shaped schedules (ZB-V, DualPipeV), pipedream.py the PipeDream family's (2BW,
weight stashing); catalog.py names every schedule and what it asks.
"""

from __future__ import annotations

from typing import NamedTuple


class Action(NamedTuple):
    kind: str  # "F", "B" or "W"
    mb: int  # micro-batch
    chunk: int  # model chunk (= stage when v = 1)

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


class Event(NamedTuple):
    """An interval on a rank, simulated or measured: compute (F, B, W) or a send or recv."""

    rank: int
    kind: str
    mb: int
    chunk: int
    start: float
    end: float


def naive(pp: int, m: int, rank: int) -> list[Action]:
    """One micro-batch at a time through the whole pipeline: only one rank ever works."""
    out = []
    for i in range(m):
        out += [Action("F", i, rank), Action("B", i, rank)]
    return out


def gpipe(pp: int, m: int, rank: int) -> list[Action]:
    """All forwards, then all backwards (Huang et al. 2019): holds all m activations."""
    return [Action("F", i, rank) for i in range(m)] + [Action("B", i, rank) for i in range(m)]


def one_f_one_b(pp: int, m: int, rank: int) -> list[Action]:
    """PipeDream-Flush (Narayanan et al. 2021, Megatron-LM on GPUs, sec. 2.2): <= pp - rank held.

    Warm-up: pp - rank - 1 forwards fill the pipe below this rank. Steady state: one forward,
    one backward. Cool-down: the backwards still owed.
    """
    warmup = min(pp - rank - 1, m)
    out = [Action("F", i, rank) for i in range(warmup)]  # warm-up
    for i in range(m - warmup):  # steady state
        out += [Action("F", warmup + i, rank), Action("B", i, rank)]
    out += [Action("B", i, rank) for i in range(m - warmup, m)]  # cool-down
    return out


def interleaved(pp: int, m: int, rank: int, v: int) -> list[Action]:
    """Interleaved 1F1B (Narayanan et al. 2021, sec. 2.2): v chunks per rank, m % pp == 0.

    Micro-batches go round in groups of pp: forward k (of m v on this rank) is micro-batch
    (k // (pp v)) pp + k % pp on this rank's chunk (k // pp) % v; backwards take the chunks in
    reverse. The bubble shrinks by v because each chunk's step is 1/v of a stage's.
    """
    total = m * v

    def fwd(k: int) -> Action:
        return Action("F", (k // (pp * v)) * pp + k % pp, ((k // pp) % v) * pp + rank)

    def bwd(k: int) -> Action:
        return Action("B", (k // (pp * v)) * pp + k % pp, (v - 1 - (k // pp) % v) * pp + rank)

    warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    out = [fwd(k) for k in range(warmup)]  # warm-up
    for k in range(total - warmup):  # steady state
        out += [fwd(warmup + k), bwd(k)]
    out += [bwd(k) for k in range(total - warmup, total)]  # cool-down
    return out


def zb_h1(pp: int, m: int, rank: int) -> list[Action]:
    """ZB-H1 (Qi et al. 2023, sec. 3.1): 1F1B with the backward split into B and W.

    Same warm-up as 1F1B. In the steady state rank r lets up to r weight passes wait: the
    later stages send each B upstream sooner, and their deferred W's fill the cool-down,
    cutting the bubble from (pp-1)(F+B+W) to (pp-1)(F+B-W) when m >= pp. Peak activations
    (held until W) stay at 1F1B's worst, pp micro-batches.
    """
    warmup = min(pp - rank - 1, m)
    out = [Action("F", i, rank) for i in range(warmup)]  # warm-up
    w_next = 0
    for i in range(m - warmup):  # steady state: F, B, and a W once more than r wait
        out += [Action("F", warmup + i, rank), Action("B", i, rank)]
        if i + 1 - w_next > rank:
            out.append(Action("W", w_next, rank))
            w_next += 1
    for i in range(m - warmup, m):  # cool-down: each B followed by the oldest deferred W
        out += [Action("B", i, rank), Action("W", w_next, rank)]
        w_next += 1
    out += [Action("W", i, rank) for i in range(w_next, m)]  # the W's still owed
    return out


class ChunkPlacement(NamedTuple):
    """Where the S = pp v chunks run: chunk c on rank c % pp (``loop``; v > 1: Narayanan et al.
    2021's interleaving), or in a V (ZB-V, DualPipeV: v = 2) on rank c going down and rank
    2 pp - 1 - c coming back, so the turn and both ends of the tied wte stay on one rank."""

    pp: int
    v: int = 1  # chunks per rank
    kind: str = "loop"  # or "v"

    def rank(self, c: int) -> int:
        """The pipeline rank of chunk c."""
        return (c if c < self.pp else 2 * self.pp - 1 - c) if self.kind == "v" else c % self.pp

    def chunks(self, rank: int) -> list[int]:
        """The chunks pipeline rank ``rank`` runs, in model order."""
        return [c for c in range(self.pp * self.v) if self.rank(c) == rank]
