"""The main job with each codec: held-out accuracy and final loss against the dp bytes per step.

Runs ``mpiexec -n 2 refmp train --dp 2`` (README's main job on the built-in addition task)
once per codec, one after another, reads each run's summary (``--log-json``) and writes the
figures as JSON and the plot docs/img/compression_convergence.png. Not a timing measurement:
the accuracy and the ledger's bytes do not depend on the machine's load.

    OMP_NUM_THREADS=1 python benchmarks/compress_convergence.py

writes docs/img/compression_convergence.json and .png.

The dp bytes per step are every ledger entry on the data-parallel axis (all-reduce,
all-gather, reduce-scatter) over the run's steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

RUNS = {  # label -> the flags after `refmp train --dp 2`
    "none": [],
    "bf16": ["--grad-compress", "bf16"],
    "powersgd R=4": ["--grad-compress", "powersgd", "--compress-rank", "4"],
    "powersgd R=1": ["--grad-compress", "powersgd", "--compress-rank", "1"],
    "topk 10%": ["--grad-compress", "topk", "--compress-ratio", "0.1"],
    "topk 1%": ["--grad-compress", "topk", "--compress-ratio", "0.01"],
    "zero3": ["--zero", "3"],
    "zero3 int8 gather": ["--zero", "3", "--weight-gather", "int8"],
}


def run_one(label: str, flags: list[str], extra: list[str]) -> dict:
    """One run's accuracy, final loss and dp bytes per step, from its summary line."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.json")
        cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "refmp", "train", "--dp", "2",
               *flags, *extra, "--no-progress", "--log-json", log]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        with open(log) as f:
            summary = [json.loads(line) for line in f if line.strip()][-1]
    dp = {k: v["bytes"] for k, v in summary["comm"].items() if k.endswith("@dp")}
    steps = summary["steps"] - summary["start_step"]
    out = {"label": label, "flags": flags, "accuracy": summary["accuracy"],
           "final_loss": summary["final_loss"], "dp_bytes_per_step": sum(dp.values()) / steps,
           "dp_bytes": dp, "steps": steps,
           "memory_rank0": summary["memory_per_rank"][0], "seconds": summary["seconds"]}
    print(f"{label:<20} accuracy {100 * out['accuracy']:5.1f}%  final loss "
          f"{out['final_loss']:.4f}  dp bytes/step {out['dp_bytes_per_step']:>12,.0f}", flush=True)
    return out


def plot(results: list[dict], path: str) -> None:
    """Held-out accuracy and final loss against the dp bytes per step (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, name in ((axes[0], "accuracy", "held-out exact match (%)"),
                          (axes[1], "final_loss", "final training loss")):
        for r in results:
            y = 100 * r[key] if key == "accuracy" else r[key]
            ax.scatter(r["dp_bytes_per_step"], y, s=30)
            ax.annotate(r["label"], (r["dp_bytes_per_step"], y), fontsize=8,
                        xytext=(4, 4), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("bytes per step on dp (ledger)")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
    axes[0].axhline(85, color="gray", ls=":", lw=1)
    axes[0].axhline(90, color="gray", ls="--", lw=1)
    fig.suptitle("The main job (mpiexec -n 2 refmp train --dp 2) with each codec")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/img/compression_convergence.json", help="the figures (JSON)")
    p.add_argument("--plot", default="docs/img/compression_convergence.png")
    p.add_argument("--only", nargs="*", default=None, help="labels to run (default: all)")
    p.add_argument("--replot", action="store_true", help="plot --out without running")
    args, extra = p.parse_known_args()  # the rest goes to every run (e.g. --steps 300)
    if args.replot:
        with open(args.out) as f:
            results = json.load(f)["runs"]
    else:
        results = [run_one(k, v, extra) for k, v in RUNS.items()
                   if args.only is None or k in args.only]
        with open(args.out, "w") as f:
            json.dump({"command": "mpiexec -n 2 refmp train --dp 2 <flags> " + " ".join(extra),
                       "runs": results}, f, indent=1)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
