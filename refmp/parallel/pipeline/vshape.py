"""The V-shaped schedules: two chunks per rank placed in a V (ChunkPlacement, kind "v"), rank r
holding chunk r on the way down and chunk 2 pp - 1 - r on the way back, so the first and the
last chunk sit on one rank and the pipeline's fill and drain overlap.

Shapes: pp stages (ranks), m micro-batches, 2 pp chunks. Actions as in schedules.py (F, B,
W: a B is split exactly when its W is on the list).
"""

from __future__ import annotations

from refmp.parallel.pipeline.schedules import Action


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
        v.add("F", 1)
        v.add("F", 0)
    for _ in range(pp - r):  # the first backwards of the second chunk, their W at once
        v.add("F", 1)
        v.add("B", 1, True)
        v.weight()
    while v.next["F", 1] < v.next["F", 0] or v.next["F", 0] < max(m, 2 * pp - 1):  # steady
        if v.next["F", 0] < max(m, 2 * pp - 1):
            v.add("F", 0)
        v.add("B", 0, True)
        v.weight()
        v.add("F", 1)
        v.add("B", 1, True)
        v.weight()
    for _ in range(r):  # cool-down: input gradients first, the W's fill the drain
        v.add("B", 0, True)
        v.add("B", 1, True)
    for _ in range(pp - r):
        v.add("B", 0, True)
        v.weight(0)
    while v.deferred:  # the second chunk's W's, then the first's
        v.weight(1 if any(w.chunk == v.chunk[1] for w in v.deferred) else 0)
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
        v.add("F", 0)
        v.add("F", 1)
    for _ in range(pp - r - 1):  # 3: B and W of the second chunk, then its next forward
        v.add("B", 1, True)
        v.weight()
        v.add("F", 1)
    for _ in range(m - 2 * pp + r + 1):  # 4, the steady state: F0 B1, F1 B0
        v.add("F", 0)
        v.add("B", 1)
        v.add("F", 1)
        v.add("B", 0)
    for _ in range(pp - r - 1):  # 5
        v.add("B", 1)
        v.add("F", 1)
        v.add("B", 0)
    split = False
    for i in range(r + 1):  # 6: the backwards left; their second half split
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        v.add("B", 1, split)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        v.add("B", 0, split)
    for _ in range(pp - r - 1):  # 7
        v.weight()
        v.add("B", 0, True)
    while v.deferred:  # 8
        v.weight()
    return v.out
