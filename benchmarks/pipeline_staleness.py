"""What weight staleness costs: the main job (README's, the addition task) on pp 2 with 1f1b,
2bw (each step's gradient taken at the weights of a step before) and pipedream (stage s on
the weights of pp - 1 - s steps before), one after the other: the loss of every step, the
held-out exact-match accuracy every --eval-every steps, and the measured bubble each schedule
leaves (the median over the steps timed), drawn side by side in docs/img/pipeline_staleness.png.

Run (a few minutes on 2 cores):  python benchmarks/pipeline_staleness.py
It launches ``mpiexec -n 2`` with OMP_NUM_THREADS=1 once per schedule (``--run S`` is that
rank's part), writes runs/pipeline_staleness.json and the figure, and prints a table.
A smoke run:  python benchmarks/pipeline_staleness.py --steps 20 --eval-every 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SCHEDULES = ("1f1b", "2bw", "pipedream")


def train(schedule: str, args) -> dict | None:
    """One run on this world (2 ranks): {steps: [loss], evals: [[step, acc]], bubble}."""
    from refmp.training.evaluate import evaluate
    from refmp.training.trainer import TrainConfig, Trainer

    cfg = TrainConfig(pp=2, microbatches=args.microbatches, schedule=schedule, steps=args.steps,
                      progress=False)
    tr = Trainer(cfg)
    losses, evals, bubbles = [], [], []
    while tr.step_num < cfg.steps:
        losses.append(tr.step()["loss"])
        if tr.step_num % args.time_every == 0:
            bubbles.append(tr.runner.timeline().bubble())  # collective over pp
        if tr.step_num % args.eval_every == 0 or tr.step_num == cfg.steps:
            # collective: W(t+1), the newest weights
            correct, total = evaluate(tr.runner, tr.grid, tr.mcfg, tr.T, tr.ds.task)
            evals.append([tr.step_num, correct / total])
    if tr.grid.rank:
        return None
    return {"loss": losses, "evals": evals, "bubble": statistics.median(bubbles)}


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, r in results.items():
        label = f"{name} (bubble {100 * r['bubble']:.0f}%)"
        ax1.plot(range(1, len(r["loss"]) + 1), r["loss"], lw=0.8, label=label)
        steps, acc = zip(*r["evals"], strict=True)
        ax2.plot(steps, [100 * a for a in acc], marker="o", ms=3, label=label)
    ax1.set(xlabel="step", ylabel="training loss", yscale="log", title="loss")
    ax2.set(xlabel="step", ylabel="held-out exact match (%)", title="accuracy (1000 problems)")
    for ax in (ax1, ax2):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle("the main job on pp 2, 4 micro-batches: synchronous 1F1B against 2BW's "
                 "and PipeDream's stale weights", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1500, help="the main job's (1500)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--time-every", type=int, default=10, help="steps between timelines")
    ap.add_argument("--run", choices=SCHEDULES, help="(internal) this rank's run")
    ap.add_argument("--out", default="runs/pipeline_staleness.json")
    ap.add_argument("--png", default="docs/img/pipeline_staleness.png")
    args = ap.parse_args()
    if args.run:
        r = train(args.run, args)
        if r is not None:
            with open(f"{args.out}.{args.run}", "w") as f:
                json.dump(r, f)
        return
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results = {}
    for s in SCHEDULES:  # one after the other: the runs never share the cores
        passed = [a for a in sys.argv[1:] if not a.startswith("--run")]
        subprocess.run(["mpiexec", "-n", "2", sys.executable, __file__, *passed, "--run", s],
                       check=True, env=env)
        with open(f"{args.out}.{s}") as f:
            results[s] = json.load(f)
        os.remove(f"{args.out}.{s}")
    with open(args.out, "w") as f:
        json.dump(results, f)
    plot(results, args.png)
    print(f"{'schedule':9} {'final loss':>10} {'accuracy':>9} {'bubble':>7}")
    for s, r in results.items():
        print(f"{s:9} {r['loss'][-1]:10.4f} {100 * r['evals'][-1][1]:8.1f}% "
              f"{100 * r['bubble']:6.1f}%")
    print(f"wrote {args.out} and {args.png}")


if __name__ == "__main__":
    main()
