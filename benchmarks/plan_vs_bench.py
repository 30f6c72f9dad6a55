"""Does the plan predict this machine's steps? Predicted (refmp plan, --machine cpu) against
measured (refmp bench) step times: 4-rank layouts ranked (their Spearman correlation), and
with --ranks 2 the 2-rank layouts' times (the ratio plan / bench of each).

Each round runs every layout once, in a rotated order, and before each layout's bench run a
calibration on as many ranks as the layout has (refmp.cli.calibrate.calibrate on every rank at
once, and MPI's bandwidth and latency by measure_links, or with --assumed-links 5 GB/s and
2 us): so a slow spell of a shared machine falls on the calibration and the run alike. The
plan of a round is refmp.cli.calibrate.cpu_machine on that round's calibration (the slowest
rank's rates, refmp.cli.calibrate.slowest); the table is the medians over rounds of the plan and
of bench's median ms_per_step, with the load average (os.getloadavg) beside them.

Run (a few minutes):  flock /tmp/refmp-bench.lock python benchmarks/plan_vs_bench.py --ranks 2
A smoke run:  python benchmarks/plan_vs_bench.py --preset tiny --steps 2 --warmup 0 --rounds 1
              --layouts dp4,tp2xdp2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from refmp.cli.bench import PRESETS
from refmp.cli.calibrate import cpu_machine
from refmp.cost.model import Layout, predict
from refmp.nn.params import GPTConfig

# name: the layout's bench flags (micro-batches M; n_expert: an MoE model, its blocks all
# MoE, top-2); the ranks are tp pp dp cp
LAYOUTS = {
    4: {"dp4": dict(dp=4), "tp2xdp2": dict(tp=2, dp=2), "pp2xdp2": dict(pp=2, dp=2, M=2),
        "tp4": dict(tp=4), "pp4": dict(pp=4, M=4), "cp2xdp2": dict(cp=2, dp=2),
        "tp2xpp2": dict(tp=2, pp=2, M=2)},
    2: {"serial": {}, "dp2": dict(dp=2), "tp2": dict(tp=2), "pp2": dict(pp=2, M=4),
        "cp2": dict(cp=2), "ep2": dict(dp=2, ep=2, n_expert=2), "zero3": dict(dp=2, zero=3)},
}


def world(lay: dict) -> int:
    return lay.get("tp", 1) * lay.get("pp", 1) * lay.get("dp", 1) * lay.get("cp", 1)


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rho: Pearson's correlation of the ranks (ties share their mean rank)."""
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return r

    a, b = ranks(xs), ranks(ys)
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b, strict=True))
    va, vb = sum((x - ma) ** 2 for x in a), sum((y - mb) ** 2 for y in b)
    return cov / (va * vb) ** 0.5 if va and vb else float("nan")


def predicted(lay: dict, spec: dict, calib: dict, links) -> float:
    """The plan's step seconds of ``lay`` on a machine calibrated by ``calib`` and ``links``."""
    mcfg = GPTConfig(n_layer=spec["n_layer"], n_embd=spec["n_embd"], n_head=spec["n_head"],
                     vocab_size=spec["vocab"], block_size=spec["block_size"],
                     n_expert=lay.get("n_expert", 0), moe_every=1)
    B, dp, M = spec["batch_size"], lay.get("dp", 1), lay.get("M", 1)
    mine = {k: v for k, v in lay.items() if k not in ("M", "n_expert")}
    layout = Layout(**mine, mixed_precision="none", microbatch_size=B // (dp * M))
    return predict(layout, mcfg, B, cpu_machine(world(lay), links, calib))["step_seconds"]


PROBE = ("import json; from mpi4py import MPI; from refmp.cli.calibrate import calibrate, "
         "measure_links, slowest; c = MPI.COMM_WORLD; l = measure_links(c); "
         "r = c.gather(calibrate(sync=c)); c.rank or print(json.dumps([l, slowest(r)]))")


def mpiexec(n: int, args: list[str]) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"} if n > 1 else \
        dict(os.environ)  # one rank: refmp's threads on every core, as bench runs it
    r = subprocess.run(["mpiexec", "-n", str(n), sys.executable, *args], capture_output=True,
                       text=True, env=env, timeout=600)
    if r.returncode:
        raise SystemExit(f"{' '.join(args[:4])} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return r.stdout.strip().splitlines()[-1]


def measured(lay: dict, args) -> float:
    """One refmp bench run of the layout under mpiexec: its median ms per step."""
    flags = [x for k, v in lay.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    flags = [{"--M": "--microbatches"}.get(f, f) for f in flags]
    out = mpiexec(world(lay), ["-m", "refmp", "bench", "--preset", args.preset, *flags,
                               "--steps", str(args.steps), "--warmup", str(args.warmup), "--json"])
    return json.loads(out)["ms_per_step"]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--steps", type=int, default=10, help="timed steps per bench run (10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per bench run (2)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (5)")
    p.add_argument("--ranks", type=int, choices=sorted(LAYOUTS), default=4,
                   help="the layout set: 4 (ranked, Spearman) or 2 (timed, plan / bench)")
    p.add_argument("--layouts", default=None, help="comma-separated, of the set's (all)")
    p.add_argument("--assumed-links", action="store_true",
                   help="plan with 5 GB/s and 2 us instead of measuring MPI's links")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    table = LAYOUTS[args.ranks]
    names = args.layouts.split(",") if args.layouts else list(table)
    bad = [n for n in names if n not in table]
    if bad:
        p.error(f"unknown layout(s) {', '.join(bad)}: choose from {', '.join(table)}")
    spec = PRESETS[args.preset]
    plans: dict[str, list[float]] = {n: [] for n in names}
    runs: dict[str, list[float]] = {n: [] for n in names}
    cals, loads, seen = [], [], []  # seen: each run's measured links (GB/s, us)
    for r in range(args.rounds):  # each round every layout once, the order rotated
        for n in names[r % len(names):] + names[:r % len(names)]:
            links, calib = json.loads(mpiexec(world(table[n]), ["-c", PROBE]))
            links = None if args.assumed_links else tuple(links)
            plans[n].append(1e3 * predicted(table[n], spec, calib, links))
            runs[n].append(measured(table[n], args))
            cals.append(calib)
            seen.append(links)
            loads.append(os.getloadavg()[0])
    plan_ms = {n: statistics.median(v) for n, v in plans.items()}
    bench_ms = {n: statistics.median(v) for n, v in runs.items()}
    rho = spearman([plan_ms[n] for n in names], [bench_ms[n] for n in names])
    calib = {k: statistics.median(c[k] for c in cals) for k in cals[0] if k != "short"}
    calib["short"] = [statistics.median(c["short"][i] for c in cals) for i in range(3)]
    out = {"preset": args.preset, "ranks": args.ranks, "steps": args.steps,
           "rounds": args.rounds, "calibration": calib, "spearman": rho,
           "links": None if args.assumed_links else [statistics.median(x[i] for x in seen)
                                                     for i in range(2)],
           "load": [min(loads), statistics.median(loads), max(loads)],
           "layouts": [{"layout": n, "plan_ms": plan_ms[n], "bench_ms": bench_ms[n],
                        "ratio": plan_ms[n] / bench_ms[n], "round_ratios": [
                            a / b for a, b in zip(plans[n], runs[n], strict=True)],
                        "plan_runs_ms": plans[n],
                        "bench_runs_ms": runs[n]} for n in names]}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"preset {args.preset}, {args.ranks}-rank layouts; bench: median of "
              f"{args.rounds} interleaved round(s) of {args.steps} steps; plan: --machine cpu "
              f"calibrated before each run (medians: {calib['gflops']:.1f} GFLOP/s and "
              f"{calib['gbs']:.2g} GB/s a rank, short sides (m, k, n) 1 + "
              f"{' + '.join(f'{h:.0f}/{d}' for h, d in zip(calib['short'], 'mkn', strict=True))}, "
              f"{calib['call_us']:.2g} us an operation, {calib['stream_gbs']:.2g} GB/s AdamW); "
              f"load {out['load'][0]:.1f}-"
              f"{out['load'][2]:.1f} (median {out['load'][1]:.1f})")
        print(f"{'layout':>10} {'plan ms':>9} {'bench ms':>9} {'plan/bench':>10}  each round's")
        for x in sorted(out["layouts"], key=lambda x: x["bench_ms"]):
            print(f"{x['layout']:>10} {x['plan_ms']:>9.1f} {x['bench_ms']:>9.1f} {x['ratio']:>10.2f}  "
                  f"{min(x['round_ratios']):.2f}-{max(x['round_ratios']):.2f}")
        print(f"Spearman rank correlation: {rho:+.2f} over {len(names)} layouts")
    return out


if __name__ == "__main__":
    main()
