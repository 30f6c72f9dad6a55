"""``refmp plan --published``: the published runs the planner is held to (refmp.cost.published;
docs/published_runs.md), each with the planner's figure, the ratio and the command that
predicts it."""

from __future__ import annotations

import json

from refmp.cost.published import RUNS, command, reproduce, within

UNITS = {"mfu": "% MFU", "tflops": "TFLOP/s/GPU", "tokens": "tokens/s/GPU"}


def run_published(as_json: bool = False) -> dict:
    rows = []
    for run in RUNS:
        got = reproduce(run)
        rows.append({"run": run.key, "source": run.source, "what": run.what,
                     "unit": run.unit, "published": run.figure, **got,
                     "within": within(run, got), "lacks": run.lacks,
                     "assumed": list(run.assumed), "command": command(run)})
    if as_json:
        print(json.dumps({"runs": rows}, indent=1))
        return {"runs": rows}
    print(f"{'run':>28} {'published':>10} {'plan':>8} {'ratio':>6} {'GB':>5} {'top 3':>5}  unit")
    for r in rows:
        place = "" if "place" not in r else (str(r["place"]) if r["place"] else "no")
        print(f"{r['run']:>28} {r['published']:>10g} {r['figure']:>8.1f} {r['ratio']:>6.2f} "
              f"{r['memory_gb']:>5.0f} {place:>5}  {UNITS[r['unit']]}"
              + ("" if r["within"] else "  (outside 15%: see docs/published_runs.md)"))
    return {"runs": rows}
