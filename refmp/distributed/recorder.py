"""The flight recorder: each rank's last N communication calls, always on.

Every call a :class:`refmp.distributed.comm.Comm` hands to MPI is one entry of a ring
(``collections.deque(maxlen=N)``, N = 2,000): the group, the operation, the group's
sequence number, bytes, dtype, peer and tag (point-to-point), state (started, completed),
the step and micro-batch the trainer and pipeline executor label it with, the wall times,
and the Python frame that issued it. This is PyTorch's Flight Recorder for NCCL, and what
the watchdog (refmp.distributed.watchdog) reads when a rank stops making progress.

Sequence numbers are what find a stuck rank. A collective is the k-th on its group on every
rank of the group (MPI orders collectives per communicator), so the counts of the ranks of
one group must agree: the rank whose count is behind has not entered the collective the
others wait in. Messages between two ranks with one tag are not overtaken (MPI's ordering),
so the k-th send from a to b with tag t is the k-th receive at b from a with tag t: a
receiver whose count runs ahead of its sender's waits for a message not yet sent.

The hot path formats nothing: an entry is a list of plain values (the dtype object as
given, the frame as (file, line, function) from ``sys._getframe``); :meth:`Recorder.dump`
turns the ring into JSON only when a report is written.

``REFMP_RECORDER_CALLS=N`` sets the ring's size; 0 turns the recorder off (``start`` and
``done`` do nothing), for measuring what it costs (docs/faults.md). The watchdog reads the
recorder, so it refuses to run without one (refmp.training.checks.check_outputs).

A grid makes its own recorder, unless one is installed (:func:`install`): then every grid
made afterwards in the process records into it. That is for a watchdog that watches code
making grids of its own (the trainer, a test): tests/mpi_batch.py installs one per test.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque

from refmp.errors import ConfigError

CAPACITY = 2000  # entries kept by default (REFMP_RECORDER_CALLS)
STARTED, COMPLETED = "started", "completed"
# the fields of an entry, in order (an entry is a list: its state and end time change)
FIELDS = ("id", "group", "op", "seq", "bytes", "dtype", "peer", "tag", "state", "step",
          "microbatch", "t_start", "t_end", "frame")
STATE, T_END = FIELDS.index("state"), FIELDS.index("t_end")
_OFF = [-1] * len(FIELDS)  # the entry an off recorder hands out
_HERE = os.path.dirname(os.path.abspath(__file__))  # frames in this package are skipped


def ring_size() -> int:
    """The ring's size: ``REFMP_RECORDER_CALLS`` (a whole number; 0: off), else CAPACITY."""
    given = os.environ.get("REFMP_RECORDER_CALLS", str(CAPACITY))
    if not given.isdigit():
        raise ConfigError(f"REFMP_RECORDER_CALLS must be a whole number of calls (0: no flight "
                          f"recorder), got {given!r}")
    return int(given)


def caller():
    """(file, line, function) of the first frame outside refmp.distributed."""
    f = sys._getframe(2)
    while f.f_back is not None and f.f_code.co_filename.startswith(_HERE):
        f = f.f_back
    return (f.f_code.co_filename, f.f_lineno, f.f_code.co_name)


class Recorder:
    """One rank's ring of communication calls, shared by the Comms of its grid."""

    def __init__(self, capacity: int | None = None):
        capacity = ring_size() if capacity is None else capacity
        self.ring: deque[list] = deque(maxlen=capacity)
        self.groups: list[tuple[str, tuple[int, ...]]] = []  # group id -> (label, world ranks)
        self._made: dict[tuple[str, tuple[int, ...]], int] = {}  # (label, ranks) -> groups made
        self.counts: dict[tuple, int] = {}  # group id, or (group id, op, peer, tag) -> calls
        self.calls = 0  # calls recorded since the start (entry ids)
        self.step = -1  # labels set by the trainer and the pipeline executor
        self.microbatch = -1
        self.waiting: list | None = None  # the entry a blocking Comm call waits in, if any
        self.progress = time.time()  # the last start or completion: what the watchdog watches
        self.on = capacity > 0
        if not self.on:  # off: the same calls, doing nothing (instance attributes win)
            self.start = lambda *a, **k: _OFF
            self.done = lambda entry: None

    def group(self, label: str, members: tuple[int, ...]) -> int:
        """An id for the group of world ranks ``members`` called ``label`` ("dp", "pp+tp").

        Another communicator of the same ranks and label gets "label~2" (and so on): every
        rank makes its communicators in the same order, so the names agree across ranks."""
        members = tuple(members)
        same = self._made.get((label, members), 0)
        self._made[(label, members)] = same + 1
        self.groups.append((label if not same else f"{label}~{same + 1}", members))
        return len(self.groups) - 1

    def start(self, group: int, op: str, nbytes: int, dtype, peer: int = -1,
              tag: int = -1) -> list:
        """Record a call handed to MPI; ``peer`` (a world rank) and ``tag`` for send/recv."""
        key = group if peer < 0 else (group, op, peer, tag)
        seq = self.counts.get(key, 0) + 1
        self.counts[key] = seq
        now = time.time()
        entry = [self.calls, group, op, seq, nbytes, dtype, peer, tag, STARTED, self.step,
                 self.microbatch, now, 0.0, caller()]
        self.calls += 1
        self.ring.append(entry)
        self.progress = now
        return entry

    def done(self, entry: list) -> None:
        """The call of ``entry`` completed (seen complete by a wait)."""
        now = time.time()
        entry[STATE], entry[T_END] = COMPLETED, now
        if self.waiting is entry:
            self.waiting = None
        self.progress = now

    # --- the report: JSON only here, never in the hot path ---------------------------------

    def group_name(self, group: int) -> str:
        """"dp[0,2]": the label and the world ranks, the same text on every member."""
        label, members = self.groups[group]
        return f"{label}[{','.join(map(str, members))}]"

    def entry_dict(self, entry: list) -> dict:
        out = dict(zip(FIELDS, entry, strict=True))
        out["group"] = self.group_name(entry[1])
        out["dtype"] = None if entry[5] is None else str(entry[5])
        out["frame"] = list(entry[13])
        return out

    def dump(self) -> dict:
        """The ring and the counts, as JSON-ready values."""
        counts = []
        for key, n in list(self.counts.items()):  # one C call: the main thread may go on
            if isinstance(key, tuple):
                group, op, peer, tag = key
                counts.append({"group": self.group_name(group), "op": op, "peer": peer,
                               "tag": tag, "count": n})
            else:
                counts.append({"group": self.group_name(key), "op": "collective", "count": n})
        return {"calls": self.calls, "counts": counts,
                "entries": [self.entry_dict(e) for e in list(self.ring)],
                "waiting": None if self.waiting is None else self.waiting[0],
                "step": self.step, "microbatch": self.microbatch, "progress": self.progress}


_installed: Recorder | None = None  # what install() set


def install(recorder: Recorder | None) -> None:
    """Every grid made from now on records into ``recorder`` (None: each into its own)."""
    global _installed
    _installed = recorder


def for_new_grid() -> Recorder:
    """The recorder a new grid (or a Comm given none) records into."""
    return _installed if _installed is not None else Recorder()
