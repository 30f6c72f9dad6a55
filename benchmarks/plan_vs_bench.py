"""Does the plan rank layouts as this machine runs them? Predicted (refmp plan, --machine cpu)
against measured (refmp bench) step times of 4-rank layouts, and their Spearman correlation.

For each layout: the plan's step_seconds on this host (refmp.cli.plan.cpu_machine: its
measured fp32 GEMM peak per core, and MPI's bandwidth and latency measured on 4 ranks by
measure_links,
or with --assumed-links 5 GB/s and 2 us), and the median ms_per_step
of ``mpiexec -n 4 python -m refmp bench --preset P <layout> --json`` over --rounds rounds.
The rounds interleave the layouts (each round runs every layout once, in a rotated order), so
that a slow spell of a shared machine falls on all of them rather than on one.

Run (a quiet machine, a few minutes):  python benchmarks/plan_vs_bench.py
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
from refmp.cli.plan import cpu_machine
from refmp.cost.machines import Machine
from refmp.cost.model import Layout, predict
from refmp.nn.params import GPTConfig

# name: (tp, pp, dp, cp, micro-batches); 4 ranks each
LAYOUTS = {"dp4": (1, 1, 4, 1, 1), "tp2xdp2": (2, 1, 2, 1, 1), "pp2xdp2": (1, 2, 2, 1, 2),
           "tp4": (4, 1, 1, 1, 1), "pp4": (1, 4, 1, 1, 4), "cp2xdp2": (1, 1, 2, 2, 1),
           "tp2xpp2": (2, 2, 1, 1, 2)}


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


def predicted(name: str, spec: dict, mach: Machine) -> float:
    tp, pp, dp, cp, M = LAYOUTS[name]
    mcfg = GPTConfig(n_layer=spec["n_layer"], n_embd=spec["n_embd"], n_head=spec["n_head"],
                     vocab_size=spec["vocab"], block_size=spec["block_size"])
    B = spec["batch_size"]
    lay = Layout(tp=tp, pp=pp, dp=dp, cp=cp, mixed_precision="none",
                 microbatch_size=B // (dp * M))
    return predict(lay, mcfg, B, mach)["step_seconds"]


PROBE = ("import json; from mpi4py import MPI; from refmp.cli.plan import measure_links; "
         "r = measure_links(MPI.COMM_WORLD); MPI.COMM_WORLD.rank or print(json.dumps(r))")


def mpiexec(args: list[str]) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    r = subprocess.run(["mpiexec", "-n", "4", sys.executable, *args], capture_output=True,
                       text=True, env=env, timeout=600)
    if r.returncode:
        raise SystemExit(f"{' '.join(args[:4])} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return r.stdout.strip().splitlines()[-1]


def measured(name: str, args) -> float:
    """One refmp bench run of the layout under mpiexec: its median ms per step."""
    tp, pp, dp, cp, M = LAYOUTS[name]
    out = mpiexec(["-m", "refmp", "bench", "--preset", args.preset, "--tp", str(tp), "--pp",
                   str(pp), "--dp", str(dp), "--cp", str(cp), "--microbatches", str(M),
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--json"])
    return json.loads(out)["ms_per_step"]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--steps", type=int, default=10, help="timed steps per bench run (10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per bench run (2)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (5)")
    p.add_argument("--layouts", default=",".join(LAYOUTS),
                   help=f"comma-separated, of {', '.join(LAYOUTS)} (all)")
    p.add_argument("--assumed-links", action="store_true",
                   help="plan with 5 GB/s and 2 us instead of measuring MPI's links")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    names = args.layouts.split(",")
    bad = [n for n in names if n not in LAYOUTS]
    if bad:
        p.error(f"unknown layout(s) {', '.join(bad)}: choose from {', '.join(LAYOUTS)}")
    spec = PRESETS[args.preset]
    links = None if args.assumed_links else tuple(json.loads(mpiexec(["-c", PROBE])))
    mach = cpu_machine(4, links)
    plan_ms = {n: 1e3 * predicted(n, spec, mach) for n in names}
    runs: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):  # each round every layout once, the order rotated
        for n in names[r % len(names):] + names[:r % len(names)]:
            runs[n].append(measured(n, args))
    bench_ms = {n: statistics.median(v) for n, v in runs.items()}
    rho = spearman([plan_ms[n] for n in names], [bench_ms[n] for n in names])
    out = {"preset": args.preset, "steps": args.steps, "rounds": args.rounds,
           "peak_gflops_per_rank": 1e3 * mach.peak_tflops, "link_gbs": mach.intra_node_gbs,
           "link_latency_us": mach.intra_latency_us, "spearman": rho,
           "layouts": [{"layout": n, "plan_ms": plan_ms[n], "bench_ms": bench_ms[n],
                        "bench_runs_ms": runs[n]} for n in names]}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"preset {args.preset}, 4 ranks; bench: median of {args.rounds} interleaved "
              f"round(s) of {args.steps} steps; plan: --machine cpu "
              f"({1e3 * mach.peak_tflops:.1f} GFLOP/s per rank, MPI {mach.intra_node_gbs:.2g} "
              f"GB/s and {mach.intra_latency_us:.3g} us, {'assumed' if links is None else 'measured'})")
        print(f"{'layout':>10} {'plan ms':>9} {'bench ms':>9}")
        for n in sorted(names, key=bench_ms.get):
            print(f"{n:>10} {plan_ms[n]:>9.2f} {bench_ms[n]:>9.2f}")
        print(f"Spearman rank correlation: {rho:+.2f} over {len(names)} layouts")
    return out


if __name__ == "__main__":
    main()
