"""The byte ledger: every Comm call recorded as (op, axis) -> bytes and count.

Tests hold those figures against the textbook formulas. What an entry counts: the bytes of
the full logical tensor the operation acts on, as seen from one rank (all-reduce: the buffer;
all-gather: the gathered result; reduce-scatter: the input before scattering; send/recv: the
message). Multiply by the algorithm's factor (a ring all-reduce moves 2 (n-1)/n of it per
rank) to get wire traffic.

On several nodes, each group's label says whether it stays inside a node or crosses between
nodes (``spans``, set by the grid: refmp.distributed.topology): ``allreduce@dp[inter]``;
``bytes``/``count`` of axis "dp" count "dp[inter]" too.
"""

from __future__ import annotations

from collections import defaultdict


class Ledger:
    """Bytes and call counts per (op, axis), shared by all the Comms of one grid."""

    def __init__(self):
        self.entries: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        self.spans: dict[str, str] = {}  # label -> "intra" | "inter" (only on several nodes)

    def record(self, op: str, axis: str, nbytes: int) -> None:
        if axis in self.spans:
            axis = f"{axis}[{self.spans[axis]}]"
        entry = self.entries[(op, axis)]
        entry[0] += int(nbytes)
        entry[1] += 1

    def bytes(self, op: str | None = None, axis: str | None = None) -> int:
        """Total bytes of the entries matching op and axis (None matches any)."""
        return sum(
            b for (o, a), (b, _) in self.entries.items()
            if (op is None or o == op) and (axis is None or axis in (a, a.split("[")[0]))
        )

    def count(self, op: str | None = None, axis: str | None = None) -> int:
        return sum(
            c for (o, a), (_, c) in self.entries.items()
            if (op is None or o == op) and (axis is None or axis in (a, a.split("[")[0]))
        )

    def as_dict(self) -> dict[str, dict[str, int]]:
        """{"op@axis": {"bytes": ..., "count": ...}} for logs and summaries."""
        return {f"{o}@{a}": {"bytes": b, "count": c} for (o, a), (b, c) in sorted(self.entries.items())}

    def reset(self) -> None:
        self.entries.clear()
