"""Timelines of a pipeline step, simulated or measured, and three ways to draw them.

An :class:`Event` (schedules.py's) is one interval on one rank: compute (F, B, W) or, in a
measured run, time spent in communication (send, recv). Everything else on a rank's row is
idle: the bubble.
The same :class:`Timeline` is drawn as ASCII (:meth:`Timeline.ascii`), as Chrome trace JSON
(:meth:`Timeline.chrome_trace`, open it in https://ui.perfetto.dev) and as a PNG
(:meth:`Timeline.png`, matplotlib, imported only there).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from refmp.parallel.pipeline.schedules import Event

COMPUTE = ("F", "B", "W")


@dataclass
class Timeline:
    name: str
    pp: int
    m: int
    v: int = 1
    events: list[Event] = field(default_factory=list)
    unit: str = "step"  # what a time of 1 means: a simulated step, or "s" when measured
    peak_held: list[int] = field(default_factory=list)  # per rank, simulated or measured
    versions: dict[tuple[int, int], int] = field(default_factory=dict)  # (rank, micro-batch)
    # -> the weight version it computes on, drawn as F3@1 (asynchronous schedules)
    barriers: list[float] = field(default_factory=list)  # the step boundaries (2bw's runs)

    @property
    def t0(self) -> float:
        return min(e.start for e in self.events)

    @property
    def makespan(self) -> float:
        return max(e.end for e in self.events) - self.t0

    def window(self, start: float, end: float) -> Timeline:
        """The events that start in [start, end): one step of a run of several."""
        events = [e for e in self.events if start <= e.start < end]
        return Timeline(self.name, self.pp, self.m, self.v, events, self.unit, self.peak_held,
                        self.versions)

    def busy(self, rank: int) -> float:
        return sum(e.end - e.start for e in self.events if e.rank == rank and e.kind in COMPUTE)

    def bubble(self) -> float:
        """Fraction of rank-time not spent computing: 1 - sum_r busy_r / (pp * makespan)."""
        busy = sum(e.end - e.start for e in self.events if e.kind in COMPUTE)  # all ranks'
        return 1.0 - busy / (self.pp * self.makespan)

    def spans(self, kinds) -> dict[tuple[int, str], list[float]]:
        """{(rank, kind): sorted durations} of the events of ``kinds`` about one micro-batch."""
        spans: dict[tuple[int, str], list[float]] = {}
        for e in self.events:
            if e.kind in kinds and e.mb >= 0:
                spans.setdefault((e.rank, e.kind), []).append(e.end - e.start)
        return {k: sorted(d) for k, d in spans.items()}

    def costs(self) -> dict[tuple[int, str], float]:
        """{(rank, kind): median duration} of the compute events (F, B, W) on each rank."""
        return {k: d[len(d) // 2] for k, d in self.spans(COMPUTE).items()}

    def action_costs(self) -> dict[tuple[int, str, int, int], float]:
        """{(rank, kind, mb, chunk): duration} of every compute event (a step replayed)."""
        return {(e.rank, e.kind, e.mb, e.chunk): e.end - e.start for e in self.events
                if e.kind in COMPUTE}

    def hops(self) -> dict[int, tuple[float, float]]:
        """{rank: (send, recv)} what one message costs a rank outside compute, measured:
        the median of its sends (starting one), and its shortest receive (one whose message
        was already waiting: the copy and MPI's calls, no wait). 0 for a rank without any."""
        d = self.spans(("send", "recv"))
        send, recv = ({r: d.get((r, k), [0.0]) for r in range(self.pp)} for k in ("send", "recv"))
        return {r: (send[r][len(send[r]) // 2], recv[r][0]) for r in range(self.pp)}

    def idle(self) -> dict[str, float]:
        """Where the rank-time that is not compute goes, as fractions of pp * makespan:
        ``recv`` waiting for a message, ``send`` starting sends and finishing them at the
        end of the step, ``other`` the gaps between events (Python between actions, and a
        rank that finished first waiting for the slowest). They sum to bubble()."""
        total = self.pp * self.makespan
        comm = {k: sum(e.end - e.start for e in self.events if e.kind == k) / total
                for k in ("recv", "send")}
        return {**comm, "other": self.bubble() - comm["recv"] - comm["send"]}

    def label(self, e: Event) -> str:
        if e.mb < 0:  # not about one micro-batch (the end-of-step wait for sends)
            return e.kind
        virtual = "" if self.v == 1 else "abcdefghijklmnopqrstuvwxyz"[e.chunk // self.pp]
        version = self.versions.get((e.rank, e.mb))
        version = "" if version is None else f"@{version}"
        return f"{e.kind}{e.mb}{virtual}{version}"

    def ascii(self) -> str:
        """One row per rank, one cell per time step (simulated timelines: integer times)."""
        width = max(len(self.label(e)) for e in self.events) + 1
        steps = int(round(self.makespan))
        rows = []
        for r in range(self.pp):
            cells = ["." * (width - 1) + " "] * steps
            for e in self.events:
                if e.rank == r and e.kind in COMPUTE:
                    for t in range(int(round(e.start - self.t0)), int(round(e.end - self.t0))):
                        cells[t] = self.label(e).ljust(width)
            for t in sorted(self.barriers, reverse=True):  # a step boundary: "|"
                cells.insert(int(round(t - self.t0)), "| ")
            rows.append(f"rank {r} | " + "".join(cells).rstrip())
        return "\n".join(rows)

    def chrome_trace(self) -> dict:
        """Chrome trace events (one thread per rank; times in microseconds)."""
        scale = 1e6 if self.unit == "s" else 1e3  # a simulated step is drawn as 1 ms
        out = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r,
                "args": {"name": f"rank {r}"}} for r in range(self.pp)]
        for e in self.events:
            out.append({"name": self.label(e), "cat": e.kind, "ph": "X", "pid": 0, "tid": e.rank,
                        "ts": (e.start - self.t0) * scale, "dur": (e.end - e.start) * scale,
                        "args": {"micro_batch": e.mb, "chunk": e.chunk}})
        return {"traceEvents": out, "displayTimeUnit": "ms",
                "otherData": {"schedule": self.name, "pp": self.pp, "microbatches": self.m,
                              "virtual_stages": self.v, "bubble": self.bubble(),
                              "unit": self.unit}}

    @classmethod
    def from_chrome_trace(cls, trace: dict) -> Timeline:
        """The timeline chrome_trace wrote (``--trace`` of refmp train, bench and schedule),
        its times from the step's start; a trace without a unit was measured (seconds)."""
        meta = trace["otherData"]
        unit = meta.get("unit", "s")
        scale = 1e6 if unit == "s" else 1e3
        events = [Event(e["tid"], e["cat"], e["args"]["micro_batch"], e["args"]["chunk"],
                        e["ts"] / scale, (e["ts"] + e["dur"]) / scale)
                  for e in trace["traceEvents"] if e["ph"] == "X"]
        return cls(meta["schedule"], meta["pp"], meta["microbatches"], meta["virtual_stages"],
                   events, unit)

    def write_trace(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)

    def png(self, path: str, title: str | None = None) -> None:
        """Draw the timeline with matplotlib (pip install refmp[plot])."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        colours = {"F": "#4c9be8", "B": "#f5a142", "W": "#6cc46c", "send": "#bbbbbb",
                   "recv": "#dddddd"}
        fig, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * self.pp))
        for e in self.events:
            x0, w = e.start - self.t0, e.end - e.start
            ax.broken_barh([(x0, w)], (e.rank - 0.4, 0.8), facecolors=colours[e.kind],
                           edgecolors="white", linewidth=0.5)
            if e.kind in COMPUTE and self.unit != "s":
                ax.text(x0 + w / 2, e.rank, self.label(e)[1:], ha="center", va="center",
                        fontsize=7)
        ax.set_yticks(range(self.pp), [f"rank {r}" for r in range(self.pp)])
        ax.invert_yaxis()
        ax.set_xlim(0, self.makespan)
        ax.set_xlabel("time (s)" if self.unit == "s" else "time (steps: F = B = W = 1)")
        ax.set_title(title or f"{self.name}: pp {self.pp}, {self.m} micro-batches"
                     + (f", v {self.v}" if self.v > 1 else "")
                     + f", bubble {100 * self.bubble():.1f}%", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=80)
        plt.close(fig)
