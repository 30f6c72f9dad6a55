"""MkDocs hook: measured beside modelled, drawn while the site is built from files a refmp
command wrote (committed in docs/data/; the build runs no MPI job):

    img/measured/pipeline.svg     the last timed step of
        OMP_NUM_THREADS=1 mpiexec -n 2 refmp bench --preset small --pp 2 --microbatches 8 \\
            --schedule 1f1b --steps 5 --trace docs/data/pipeline_1f1b_trace.json
      (refmp.parallel.pipeline.timeline.Timeline.from_chrome_trace), above the same schedule
      simulated (refmp.parallel.pipeline.simulate.simulate_schedule) at that step's median
      F and B costs and messages' costs, on one time axis
    img/measured/collectives.svg  each collective's measured time by size, from
        OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/collectives.py \\
            --json docs/data/collectives.json
      beside the alpha-beta lines of refmp.cost.terms.collective at the fitted alpha, beta
"""

from __future__ import annotations

import json
import math
import pathlib

from mkdocs.structure.files import File
from svg import INK, KIND, Svg, colour

from refmp.cost.terms import collective
from refmp.parallel.pipeline.simulate import bubble_formula, simulate_schedule
from refmp.parallel.pipeline.timeline import COMPUTE, Timeline

DATA = pathlib.Path(__file__).resolve().parent.parent / "data"


def draw_timeline(s: Svg, tl: Timeline, y: float, x0: float, scale: float, title: str) -> float:
    """One timeline's rows (one per rank) from height y; returns the next free y."""
    s.text(x0, y + 12, title, 11, bold=True)
    t0 = tl.t0
    for e in tl.events:
        h = 18 if e.kind in COMPUTE else 8
        top = y + 20 + 24 * e.rank + (0 if e.kind in COMPUTE else 10)
        s.rect(x0 + 50 + (e.start - t0) * scale, top, (e.end - e.start) * scale, h, KIND[e.kind],
               "#ffffff", f"{tl.label(e)}: {1e3 * (e.end - e.start):.2f} ms")
        if e.kind in COMPUTE and (e.end - e.start) * scale > 14:
            s.text(x0 + 50 + ((e.start + e.end) / 2 - t0) * scale, top + 13, tl.label(e)[1:], 9,
                   "middle")
    for r in range(tl.pp):
        s.text(x0, y + 33 + 24 * r, f"rank {r}", 10)
    return y + 24 + 24 * tl.pp


def pipeline() -> Svg:
    measured = Timeline.from_chrome_trace(json.loads((DATA / "pipeline_1f1b_trace.json").read_text()))
    shape = (measured.name, measured.pp, measured.m, measured.v)
    at_costs = simulate_schedule(*shape, costs=measured.costs())
    with_hops = simulate_schedule(*shape, costs=measured.costs(), hops=measured.hops())
    span = max(measured.makespan, at_costs.makespan, with_hops.makespan)
    scale = 680 / span
    s = Svg(760, 300, "a measured 1F1B step beside the simulated one")
    s.text(10, 18, f"{measured.name}, pp {measured.pp}, {measured.m} micro-batches (refmp bench "
                   f"--preset small): one step measured, then simulated; {1e3 * span:.0f} ms "
                   f"across", 12, bold=True)
    y = draw_timeline(s, measured, 28, 10, scale,
                      f"measured: bubble {measured.bubble():.3f} (recv / send in grey)")
    y = draw_timeline(s, with_hops, y, 10, scale,
                      f"simulated at its median F and B costs and its messages' costs: bubble "
                      f"{with_hops.bubble():.3f}")
    y = draw_timeline(s, at_costs, y, 10, scale,
                      f"simulated at its costs, messages free: bubble {at_costs.bubble():.3f} "
                      f"(equal costs: {bubble_formula(*shape):.3f})")
    s.legend(10, y + 12, [(KIND["F"], "forward"), (KIND["B"], "backward"), (KIND["send"], "send"),
                          (KIND["recv"], "receive")])
    s.height = y + 20
    return s


def collectives() -> Svg:
    data = json.loads((DATA / "collectives.json").read_text())
    n = data["ranks"]
    alpha = data["alpha_s"]
    beta = data["beta_s_per_byte"]
    ops = list(dict.fromkeys(op for op, _, _ in data["rows"]))
    sizes = sorted({b for _, b, _ in data["rows"]})
    times = [t for _, _, t in data["rows"]]
    lx0, lx1 = math.log10(sizes[0]), math.log10(sizes[-1])
    ly0, ly1 = math.floor(math.log10(min(times) * 1e6)), math.ceil(math.log10(max(times) * 1e6))
    W = 560  # the plot's width and height, and its top left corner
    H = 300
    X = 70
    Y = 40

    def at(nbytes: float, sec: float) -> tuple[float, float]:
        return (X + W * (math.log10(nbytes) - lx0) / (lx1 - lx0),
                Y + H - H * (math.log10(sec * 1e6) - ly0) / (ly1 - ly0))

    s = Svg(760, 390, "collectives measured beside the alpha-beta model")
    s.text(10, 18, f"{n} ranks: refmp's Comm timed (dots) and refmp.cost.terms.collective at the "
                   f"fitted alpha {alpha * 1e6:.1f} us, bandwidth {1e-9 / beta:.2f} GB/s (lines)",
           12, bold=True)
    s.rect(X, Y, W, H, "#ffffff", "#999999")
    for p in range(ly0, ly1 + 1):
        y = at(sizes[0], 10.0 ** p / 1e6)[1]
        s.line(X, y, X + W, y, "#e4e4e4")
        s.text(X - 6, y + 4, f"{10 ** p:g} us", 10, "end")
    for b in sizes[::2]:
        x = at(b, 1e-6 * 10 ** ly0)[0]
        s.text(x, Y + H + 16, f"{b:,}" if b < 1e6 else f"{b / 2**20:g} MiB", 10, "middle")
    s.text(X + W / 2, Y + H + 34, "bytes (the ledger's: an all-reduce's input, an all-gather's "
                                  "output)", 10, "middle")
    for k, op in enumerate(ops):
        grid = [b * 2 ** (i / 4) for b in sizes[:-1] for i in range(4)] + [sizes[-1]]
        model = [at(b, collective(op, b, 1, n, 1 / beta, alpha)) for b in grid]
        s.polyline(model, colour(k))
        for o, b, t in data["rows"]:
            if o == op:
                s.circle(*at(b, t), 3.5, colour(k))
        s.rect(X + W + 20, Y + 10 + 20 * k, 12, 12, colour(k))
        s.text(X + W + 38, Y + 20 + 20 * k, op, 11, fill=INK)
    return s


PICTURES = {"pipeline": pipeline, "collectives": collectives}


def on_files(files, config, **kwargs):
    for name, draw in PICTURES.items():
        files.append(File.generated(config, f"img/measured/{name}.svg", content=str(draw())))
    return files
