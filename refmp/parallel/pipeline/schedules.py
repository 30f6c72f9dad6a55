"""Pipeline schedules as data: a pure function gives each rank its list of actions.

Shapes: pp stages (ranks), m micro-batches, v virtual stages (chunks per rank), S = pp * v.

An action is (kind, micro-batch, chunk):
  F  forward of the chunk on the micro-batch;
  B  backward: the gradient of the chunk's input, plus, in schedules without W actions, its
     weight gradients (the whole backward);
  W  the weight gradients the B left out (zero-bubble schedules only; Qi et al. 2023): a B
     is split exactly when its W is on the list.
Communication is implied by the chunk graph, not listed: F(i, c) needs chunk c-1's output
for micro-batch i (sent by the rank of chunk c-1, placement.chunk_rank, when it finishes
F(i, c-1)), and B(i, c) needs the gradient of chunk c's output from B(i, c+1). The executor
(executor.py) posts those sends and receives; the simulator (simulate.py) runs the same lists
without MPI.
"""

from __future__ import annotations

from typing import NamedTuple


class Action(NamedTuple):
    kind: str  # "F", "B" or "W"
    mb: int  # micro-batch
    chunk: int  # model chunk (= stage when v = 1)

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


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
    """PipeDream-Flush (Narayanan et al. 2021, sec. 2.2): at most pp - rank activations held.

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


class VRank:
    """A rank's two chunks in a V (rank r: chunk r going down, chunk 2 pp - 1 - r coming back)
    and the next micro-batch of each pass on each, so a V schedule is written as its phases."""

    def __init__(self, pp: int, m: int, rank: int):
        self.m = m
        self.chunk = (rank, 2 * pp - 1 - rank)
        self.out = []
        self.next = {(k, half): 0 for k in "FBW" for half in (0, 1)}
        self.deferred: list[Action] = []  # split B's whose W has not run yet, oldest first

    def add(self, kind: str, half: int, split: bool = False) -> None:
        i = self.next[kind, half]
        self.next[kind, half] += 1
        if i < self.m:  # ZB-V's phases assume m >= 2 pp - 1 and leave the rest out
            self.out.append(Action(kind, i, self.chunk[half]))
            if split:
                self.deferred.append(Action("W", i, self.chunk[half]))

    def weight(self, half: int | None = None) -> None:
        """The oldest deferred W (of chunk ``half`` only, if given), if there is one."""
        owed = [w for w in self.deferred if half is None or w.chunk == self.chunk[half]]
        if owed:
            self.deferred.remove(owed[0])
            self.out.append(owed[0])


def zb_v(pp: int, m: int, rank: int) -> list[Action]:
    """ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", sec. 6; as
    torch.distributed.pipelining's ScheduleZBVZeroBubble): two chunks per rank in a V, every
    backward split. At F = B = W the steady state has no bubble; only the fill and drain of
    the V are left, (pp - 1) steps of rank time per rank, with 1F1B's peak memory."""
    r, v = rank, VRank(pp, m, rank)
    for _ in range(2 * (pp - r) - 1):  # warm-up: down the V
        v.add("F", 0)
    for _ in range(r):
        v.add("F", 1), v.add("F", 0)
    for _ in range(pp - r):  # the first backwards of the second chunk, their W at once
        v.add("F", 1), v.add("B", 1, True), v.weight()
    while v.next["F", 1] < v.next["F", 0] or v.next["F", 0] < max(m, 2 * pp - 1):  # steady
        if v.next["F", 0] < max(m, 2 * pp - 1):
            v.add("F", 0)
        v.add("B", 0, True), v.weight()
        v.add("F", 1), v.add("B", 1, True), v.weight()
    for _ in range(r):  # cool-down: input gradients first, the W's fill the drain
        v.add("B", 0, True), v.add("B", 1, True)
    for _ in range(pp - r):
        v.add("B", 0, True), v.weight(0)
    while v.deferred:  # the second chunk's W's, then the first's
        v.weight(1) if any(w.chunk == v.chunk[1] for w in v.deferred) else v.weight(0)
    return v.out


def dualpipev(pp: int, m: int, rank: int) -> list[Action]:
    """DualPipeV (DeepSeek's DualPipe cut in half, the DualPipe repository's dualpipev.py;
    m >= 2 pp): two chunks per rank in a V; the steady state pairs a forward of one chunk with
    a whole backward of the other (DualPipe overlaps each pair's compute with the other's
    communication); zero-bubble splits only at the edges. Bubble (PP/2 - 1)(F&B + B - 3W) for
    PP = 2 pp chunks, B a whole backward and F&B a forward and backward pair."""
    r, v = rank, VRank(pp, m, rank)
    for _ in range(2 * (pp - r - 1)):  # 1: forwards of the first chunk
        v.add("F", 0)
    for _ in range(r + 1):  # 2: both chunks
        v.add("F", 0), v.add("F", 1)
    for _ in range(pp - r - 1):  # 3: B and W of the second chunk, then its next forward
        v.add("B", 1, True), v.weight(), v.add("F", 1)
    for _ in range(m - 2 * pp + r + 1):  # 4, the steady state: F0 B1, F1 B0
        v.add("F", 0), v.add("B", 1), v.add("F", 1), v.add("B", 0)
    for _ in range(pp - r - 1):  # 5
        v.add("B", 1), v.add("F", 1), v.add("B", 0)
    split = False
    for i in range(r + 1):  # 6: the backwards left; their second half split
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        v.add("B", 1, split)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        v.add("B", 0, split)
    for _ in range(pp - r - 1):  # 7
        v.weight(), v.add("B", 0, True)
    while v.deferred:  # 8
        v.weight()
    return v.out


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


SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev", "2bw",
             "pipedream")
ASYNC = ("2bw", "pipedream")  # no flush: a step's lists hold later batches' micro-batches
V_SHAPED = ("zb-v", "dualpipev")  # two chunks per rank, placed in a V (placement.chunk_rank)


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


def chunks_per_rank(name: str, v: int = 1) -> int:
    """v for the interleaved schedule, 2 for the V-shaped ones, else 1."""
    return 2 if name in V_SHAPED else v


def schedule(name: str, pp: int, m: int, rank: int, v: int = 1, fill: bool = False,
             ahead: int | None = None) -> list[Action]:
    """Rank ``rank``'s actions for one step of ``name`` with pp stages and m micro-batches
    (2bw: :func:`two_bw`'s, pipedream: :func:`pipedream`'s, by default a steady step;
    ``ahead``: how many later batches there are, None: enough)."""
    if name == "interleaved":
        return interleaved(pp, m, rank, v)
    if name == "2bw":
        return two_bw(pp, m, rank, fill, ahead is None or ahead > 0)
    if name == "pipedream":
        return pipedream(pp, m, rank, fill, pp if ahead is None else ahead)
    fn = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1, "zb-v": zb_v,
          "dualpipev": dualpipev}[name]
    return fn(pp, m, rank)
