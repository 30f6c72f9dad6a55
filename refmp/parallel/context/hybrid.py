"""Hierarchical context parallelism: cp = U x R, Ulysses inside groups, the ring across them
(USP, Fang and Zhao 2024; Megatron's ``a2a+p2p``).

Shapes: B batch (this dp rank's rows), T sequence, Tl = T/cp tokens on this rank, c chunk
length (SequenceChunks), NH heads, HS head size, C = NH*HS; U ranks in a Ulysses group
(``--cp-ulysses``), R = cp/U groups around the ring, nh = NH/U heads per rank.

The cp ranks are numbered g U + i: rank i of Ulysses group g (consecutive cp ranks, the
nearest), and rank g of the ring of the ranks with index i in their groups:

    (B, Tl, 3C) my tokens       --all-to-all in my group-->  (B, U Tl, 3C/U) my group's
                                                             tokens, my nh heads
    ring attention over the R groups' tokens (refmp.parallel.context.ring), nh heads
    (B, U Tl, C/U) my heads     --all-to-all in my group-->  (B, Tl, C) my tokens

After the first all-to-all rank i of group g holds the tokens of cp ranks gU .. gU+U-1 in
rank order: their chunks (:class:`GroupChunks`), which the ring treats as one rank's
chunks, masking chunk by chunk as it always does. With zig-zag chunks every group holds U
early and U late chunks, so the groups' causal work is equal, as the ranks' is in a plain
ring. The backward pass is the same exchanges in reverse, around the ring's backward.

Bytes per layer and micro-batch, on this rank: the Ulysses group moves Ulysses' four
all-to-alls, 2 (b Tl 3C + b Tl C) w; the ring moves blocks of K/V of its U Tl tokens and
nh heads, 2 b Tl C w, the same size as a plain ring's over cp, but R - 1 times instead of
cp - 1 (forward, again backward, and the dK/dV blocks: 3 (R - 1) transfers). U = cp is
Ulysses (no ring), U = 1 the ring.
"""

from __future__ import annotations

from refmp.distributed.comm import Comm
from refmp.parallel.context.chunks import SequenceChunks
from refmp.parallel.context.ring import RingAttention
from refmp.parallel.context.ulysses import to_heads, to_sequence
from refmp.parallel.data.hierarchical import two_levels


def split_cp(cp: Comm, U: int, nodes: tuple[int, ...]) -> tuple[Comm, Comm]:
    """(ulysses, ring): my group of U consecutive cp ranks, and the R ranks with my index in
    theirs (ledger labels ``cp.ulysses`` and ``cp.ring``, with ``[intra]`` / ``[inter]``
    where the grid spans several ``nodes``)."""
    g, i = divmod(cp.rank, U)
    return two_levels(cp, g, i, ("ulysses", "ring"), nodes)


class GroupChunks:
    """The chunks a Ulysses group holds after its all-to-all, as the ring sees them: group g
    (a ring rank) holds the chunks of cp ranks gU .. gU+U-1, in that order; ``c`` the chunk
    length. The interface of :class:`SequenceChunks` that RingAttention reads."""

    def __init__(self, seq: SequenceChunks, U: int):
        self.seq = seq
        self.U = U
        self.c = seq.c

    def chunks(self, g: int) -> list[int]:
        return [k for i in range(self.U) for k in self.seq.chunks(g * self.U + i)]


class HybridAttention:
    """Causal attention over cp = U x R ranks: ``ulysses`` my group's U ranks, ``ring`` the R
    ranks with my index in theirs. ``forward(qkv, n_head)`` / ``backward(dout, cache)`` as
    refmp.nn.layers' attention, on this rank's tokens (``seq.positions(cp rank)``)."""

    def __init__(self, ulysses: Comm, ring: Comm, seq: SequenceChunks):
        self.ulysses = ulysses
        self.ring = RingAttention(ring, GroupChunks(seq, ulysses.size))

    @property
    def flops(self) -> int:
        """The attention FLOPs this rank executed in the forward (the ring's, nh heads)."""
        return self.ring.flops

    def forward(self, qkv, n_head: int):
        U = self.ulysses.size
        B, Tl, C3 = qkv.shape
        nh, hs = n_head // U, C3 // 3 // n_head
        # (B, Tl, 3, NH, HS) -> (B, Tl, U, 3*nh*HS): head group j's q, k, v side by side
        grouped = qkv.reshape(B, Tl, 3, U, nh * hs).transpose(0, 1, 3, 2, 4)
        full = to_heads(self.ulysses, grouped, B, Tl, 3 * nh * hs)  # (B, U Tl, 3C/U) all-to-all #1
        y, cache = self.ring.forward(full, nh)  # (B, U Tl, C/U) the ring across groups
        return to_sequence(self.ulysses, y, B, Tl, nh * hs), (cache, nh)  # (B, Tl, C) #2

    def backward(self, dout, cache):
        cache, nh = cache
        U = self.ulysses.size
        B, Tl, C = dout.shape
        hs = C // (nh * U)
        dy = to_heads(self.ulysses, dout, B, Tl, nh * hs)  # (B, U Tl, C/U) #3, mirrors #2
        dfull = self.ring.backward(dy, cache)  # (B, U Tl, 3C/U)
        dgrouped = to_sequence(self.ulysses, dfull, B, Tl, 3 * nh * hs)  # (B, Tl, U*3C/U) #4
        dqkv = dgrouped.reshape(B, Tl, U, 3, nh * hs).transpose(0, 1, 3, 2, 4)  # (B, Tl, 3, U, .)
        return dqkv.reshape(B, Tl, 3 * C)  # (B, Tl, 3C)
