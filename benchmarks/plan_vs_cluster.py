"""Does the plan predict steps across nodes? Predicted (refmp.cost.nodes.predict_on_nodes, on
--machine cpu's rates calibrated on the cluster) against measured (refmp bench) step times of
4-rank layouts on 2 nodes of 2 ranks (refmp cluster, root), at each --link-gbit.

Each round, at each link speed: a calibration on the cluster (refmp.cli.calibrate.calibrate on the
4 ranks at once, the slowest rank's rates: refmp.cli.calibrate.slowest; MPI's links inside a node
and the latency between nodes by measure_links), then every layout once, in a rotated order.
The flat all-reduce is pinned to recursive doubling
(MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM=sched_recursive_doubling, as refmp.cost.nodes prices
it). The plan takes a rank's share of the link as measured where it is below the set rate's
(refmp.cost.nodes.cluster: TCP on the ranks' own cores); the table: medians over rounds,
plan / bench, the same on the set rate alone, and Spearman's rank correlation of the
layouts at each speed.

Run (root, about 4 minutes):  flock /tmp/refmp-bench.lock python benchmarks/plan_vs_cluster.py \
    --rounds 3 --steps 4 --links 0.1,0.3
A smoke run:  python benchmarks/plan_vs_cluster.py --steps 1 --warmup 0 --rounds 1 --links 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from plan_vs_bench import spearman

from refmp.cli.calibrate import cpu_machine
from refmp.cost.model import Layout
from refmp.cost.nodes import cluster, predict_on_nodes
from refmp.nn.params import GPTConfig

# the model: link-bound at these speeds (its gradient, 14.6 MB in float32, crosses each step)
MODEL = dict(n_layer=2, n_embd=384, n_head=4, block_size=32, batch_size=4, vocab=256)
LAYOUTS = {"dp2xtp2": dict(dp=2, tp=2), "dp4": dict(dp=4),
           "dp4-hier": dict(dp=4, dp_reduce="hierarchical"),
           "pp2xtp2": dict(pp=2, tp=2, M=2), "tp4": dict(tp=4)}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
       "MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM": "sched_recursive_doubling"}
PROBE = ("import json; from mpi4py import MPI; from refmp.cli.calibrate import calibrate, "
         "measure_links, slowest; c = MPI.COMM_WORLD; node = c.Split_type(MPI.COMM_TYPE_SHARED); "
         "cross = c.Split(node.rank, c.rank); intra = measure_links(node); "
         "inter = measure_links(cross, sync=c); r = c.gather(calibrate(sync=c)); "
         "c.rank or print(json.dumps([intra, inter, slowest(r)]))")


def on_cluster(link: float, program: list[str]) -> str:
    """The last line ``program`` printed, run on 2 nodes of 2 ranks at ``link`` Gbit/s."""
    r = subprocess.run([sys.executable, "-m", "refmp", "cluster", "--nodes", "2",
                        "--ranks-per-node", "2", "--link-gbit", str(link), "--", *program],
                       capture_output=True, text=True, env=ENV, timeout=900)
    lines = [x for x in r.stdout.splitlines() if not x.startswith("refmp cluster")]
    if r.returncode or not lines:
        raise SystemExit(f"{' '.join(program[:5])} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return lines[-1]


def predicted(lay: dict, link: float, intra, inter, calib: dict, measured_link: bool = True) -> float:
    """The plan's step seconds, with a rank's share of the link as measured (inter: both
    pairs' exchanges at once, measure_links) where it is below the tbf rate's
    (refmp.cost.nodes.cluster's measured_gbs); ``measured_link`` False: the set rate alone."""
    mcfg = GPTConfig(n_layer=MODEL["n_layer"], n_embd=MODEL["n_embd"], n_head=MODEL["n_head"],
                     vocab_size=MODEL["vocab"], block_size=MODEL["block_size"])
    B, dp, M = MODEL["batch_size"], lay.get("dp", 1), lay.get("M", 1)
    mine = {k: v for k, v in lay.items() if k not in ("M", "dp_reduce")}
    layout = Layout(**mine, mixed_precision="none", microbatch_size=B // (dp * M))
    mach = cluster(cpu_machine(4, tuple(intra), calib), 2, link, inter[1],
                   inter[0] if measured_link else None)
    return predict_on_nodes(layout, mcfg, B, mach, lay.get("dp_reduce", "flat"))["step_seconds"]


def measured(lay: dict, link: float, args) -> float:
    flags = [x for k, v in lay.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    flags = [{"--M": "--microbatches"}.get(f, f) for f in flags]
    model = [x for k, v in MODEL.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    out = on_cluster(link, [sys.executable, "-m", "refmp", "bench", *model, *flags, "--steps",
                            str(args.steps), "--warmup", str(args.warmup), "--json"])
    return json.loads(out)["ms_per_step"]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--links", default="0.1,0.3", help="link speeds in Gbit/s (0.1,0.3)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per bench run (4)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per bench run (1)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (3)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    links = [float(x) for x in args.links.split(",")]
    names = list(LAYOUTS)
    plans = {(lk, n): [] for lk in links for n in names}
    seen = {(lk, n): [] for lk in links for n in names}  # the plan on the set rate alone
    runs = {(lk, n): [] for lk in links for n in names}
    loads = []
    links_seen: dict[float, list] = {}  # each round's (intra, inter) (GB/s, us), measure_links'
    calibs: dict[float, list] = {}  # each round's calibration (slowest's)
    for r in range(args.rounds):
        for lk in links:
            intra, inter, calib = json.loads(on_cluster(lk, [sys.executable, "-c", PROBE]))
            links_seen.setdefault(lk, []).append((intra, inter))
            calibs.setdefault(lk, []).append(calib)
            for n in names[r % len(names):] + names[:r % len(names)]:
                plans[(lk, n)].append(1e3 * predicted(LAYOUTS[n], lk, intra, inter, calib))
                seen[(lk, n)].append(1e3 * predicted(LAYOUTS[n], lk, intra, inter, calib, False))
                runs[(lk, n)].append(measured(LAYOUTS[n], lk, args))
                loads.append(os.getloadavg()[0])
    out = {"model": MODEL, "rounds": args.rounds, "steps": args.steps,
           "load": [min(loads), statistics.median(loads), max(loads)], "links": []}
    for lk in links:
        plan_ms = {n: statistics.median(plans[(lk, n)]) for n in names}
        seen_ms = {n: statistics.median(seen[(lk, n)]) for n in names}
        bench_ms = {n: statistics.median(runs[(lk, n)]) for n in names}
        rho = spearman([plan_ms[n] for n in names], [bench_ms[n] for n in names])
        seen_links = links_seen[lk]
        out["links"].append({"gbit": lk, "spearman": rho, "link_measured_gbs": [
            inter[0] for _, inter in seen_links], "link_latency_us": [
            inter[1] for _, inter in seen_links], "intra_gbs_us": [
            intra for intra, _ in seen_links], "calibration": {
            k: statistics.median(c[k] for c in calibs[lk])
            for k in ("gflops", "gbs", "stream_gbs", "call_us")}, "layouts": [
            {"layout": n, "plan_ms": plan_ms[n], "plan_set_rate_ms": seen_ms[n],
             "bench_ms": bench_ms[n],
             "ratio": plan_ms[n] / bench_ms[n], "bench_runs_ms": runs[(lk, n)],
             "plan_runs_ms": plans[(lk, n)]} for n in names]})
    if args.json:
        print(json.dumps(out))
        return out
    print(f"2 nodes x 2 ranks; bench: median of {args.rounds} round(s) of {args.steps} steps; "
          f"load {out['load'][0]:.1f}-{out['load'][2]:.1f} (median {out['load'][1]:.1f})")
    for row in out["links"]:
        print(f"link {row['gbit']:g} Gbit/s: Spearman {row['spearman']:+.2f}; measured a rank's "
              f"share {', '.join(f'{g * 1e3:.1f}' for g in row['link_measured_gbs'])} MB/s, "
              f"latency {', '.join(f'{u:.0f}' for u in row['link_latency_us'])} us (by round)")
        cal = row["calibration"]
        print(f"  calibration (medians): {cal['gflops']:.1f} GFLOP/s a rank, {cal['gbs']:.2g} GB/s "
              f"elementwise, {cal['stream_gbs']:.2g} GB/s AdamW, {cal['call_us']:.2g} us an operation")
        print(f"{'layout':>10} {'plan ms':>9} {'bench ms':>9} {'plan/bench':>10} "
              f"{'set rate':>13}  bench runs")
        for x in sorted(row["layouts"], key=lambda x: x["bench_ms"]):
            print(f"{x['layout']:>10} {x['plan_ms']:>9.1f} {x['bench_ms']:>9.1f} "
                  f"{x['ratio']:>10.2f} {x['plan_set_rate_ms'] / x['bench_ms']:>13.2f}  "
                  f"{', '.join(f'{v:.0f}' for v in x['bench_runs_ms'])}")
    return out


if __name__ == "__main__":
    main()
