"""``refmp schedule``: a pipeline schedule simulated (no MPI needed).

    refmp schedule --pp 4 --microbatches 8 --schedule 1f1b [--png out.png] [--trace out.json]

prints each rank's simulated timeline, the simulated bubble against the formula, and the
peak number of micro-batches whose activations each rank holds (``--json``: those as JSON).
2bw is drawn over three steps and pipedream over 2 pp - 1 (the first fills the pipeline, the
last drains it; ``|`` marks a step boundary), each micro-batch labelled with the weight
version it computes on (F7@1: on W(1)); the bubble is a steady step's (2bw's middle one,
pipedream's step pp - 1).
"""

from __future__ import annotations

import json

from refmp.errors import ConfigError
from refmp.parallel.pipeline.catalog import CATALOG, NAMES


def add_parser(sub) -> None:
    s = sub.add_parser("schedule", help="simulate a pipeline schedule: timeline and bubble",
                       description="Run a pipeline schedule's action lists without MPI: prove "
                                   "they complete, print the timeline and the bubble fraction.")
    s.add_argument("--pp", type=int, default=4, help="pipeline stages (4)")
    s.add_argument("--microbatches", type=int, default=8, help="micro-batches (8)")
    s.add_argument("--schedule", choices=NAMES, default="1f1b")
    s.add_argument("--virtual-stages", type=int, default=1, help="for interleaved (1)")
    s.add_argument("--png", default=None, metavar="PATH.png", help="draw the timeline")
    s.add_argument("--trace", default=None, metavar="PATH.json", help="Chrome trace JSON")
    s.add_argument("--json", action="store_true", help="print the figures as JSON only")
    s.set_defaults(run=run_schedule)


def run_schedule(args) -> dict:
    from refmp.parallel.pipeline.partition import check_pipeline
    from refmp.parallel.pipeline.simulate import bubble_formula, simulate_schedule, simulate_steps

    P, M, V = args.pp, args.microbatches, args.virtual_stages
    if P < 1:
        raise ConfigError(f"--pp must be at least 1, got {P}")
    sched = CATALOG[args.schedule]
    check_pipeline(P * sched.chunks_per_rank(V), P, M, args.schedule, V, None, M)
    tl = simulate_schedule(args.schedule, P, M, V)
    formula = bubble_formula(args.schedule, P, M, V)
    # without a flush: 2bw over three steps, pipedream over 2 pp - 1, labelled with versions
    name, steps, carried = args.schedule, 2 * sched.ahead(P) + 1, not sched.flushes
    run = simulate_steps(name, P, M, steps) if carried else tl
    # weight versions held per rank: 2bw's W(t) and W(t-1); pipedream's pp - s (stage s)
    versions = [sched.versions(P, r) for r in range(P)]
    figures = {"schedule": name, "pp": P, "microbatches": M, "bubble": tl.bubble(),
               "formula": formula, "peak_held": tl.peak_held, "weight_versions": versions}
    if args.json:
        print(json.dumps(figures))
        return figures
    print(f"refmp schedule: {args.schedule}, pp {P}, {M} micro-batches"
          + (f", {V} virtual stages" if V > 1 else "")
          + (f", {steps} steps" if carried else "")
          + " (F = B = W = 1 step; an unsplit backward is B + W = 2)")
    print(run.ascii())
    print(f"completes in {run.makespan:g} steps; bubble {tl.bubble():.4f} simulated"
          + (f" (a steady step, {tl.makespan:g} steps)" if carried else "")
          + f", {formula:.4f} formula")
    print("peak micro-batches held per rank: " + ", ".join(map(str, tl.peak_held)))
    if args.trace:
        run.write_trace(args.trace)
        print(f"wrote {args.trace}")
    if args.png:
        run.png(args.png)
        print(f"wrote {args.png}")
    return figures
