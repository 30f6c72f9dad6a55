"""The main job with each codec: held-out accuracy and final loss against the dp bytes per step.

Runs ``mpiexec -n 2 refmp train --dp 2`` (README's main job on the built-in addition task)
once per codec, one after another, reads each run's summary (``--log-json``) and writes the
figures as JSON and the plot docs/img/compression_convergence.png. Not a timing measurement:
the accuracy and the ledger's bytes do not depend on the machine's load.

    OMP_NUM_THREADS=1 python benchmarks/compress_convergence.py

writes docs/img/compression_convergence.json and .png. Flags it does not know go to every
run (``--lr 3e-3``); ``--against FILE`` draws a second file's runs hollow beside, and its
accuracy in a last column of the table.

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


def flags_of(command: str) -> str:
    """What a file's runs add to the defaults (its command's flags after the seed)."""
    from refmp.config import TrainConfig

    return command.split("--seed S")[-1].strip() or f"the defaults (lr {TrainConfig.lr:g})"


def run_one(label: str, flags: list[str], seed: int, extra: list[str]) -> dict:
    """One run's accuracy, final loss and dp bytes per step, from its summary line."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.json")
        cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "refmp", "train", "--dp", "2",
               *flags, "--seed", str(seed), *extra, "--no-progress", "--log-json", log]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        with open(log) as f:
            summary = [json.loads(line) for line in f if line.strip()][-1]
    dp = {k: v["bytes"] for k, v in summary["comm"].items() if k.endswith("@dp")}
    steps = summary["steps"] - summary["start_step"]
    out = {"label": label, "flags": flags, "seed": seed, "accuracy": summary["accuracy"],
           "final_loss": summary["final_loss"], "dp_bytes_per_step": sum(dp.values()) / steps,
           "dp_bytes": dp, "steps": steps, "memory_rank0": summary["memory_per_rank"][0]}
    print(f"{label:<20} seed {seed}  accuracy {100 * out['accuracy']:5.1f}%  final loss "
          f"{out['final_loss']:.4f}  dp bytes/step {out['dp_bytes_per_step']:>12,.0f}", flush=True)
    return out


def by_codec(runs: list[dict]) -> list[dict]:
    """The runs of each label together: accuracy and final loss per seed, the bytes."""
    out = {}
    for r in runs:
        c = out.setdefault(r["label"], {"label": r["label"], "flags": r["flags"],
                                        "dp_bytes_per_step": r["dp_bytes_per_step"],
                                        "error_feedback_bytes": r["memory_rank0"].get(
                                            "error_feedback", 0),
                                        "seeds": [], "accuracy": [], "final_loss": []})
        for k in ("seed", "accuracy", "final_loss"):
            c["seeds" if k == "seed" else k].append(r[k])
    return list(out.values())


def table(codecs: list[dict], base: float, other: dict | None = None) -> str:
    """The docs' table: bytes, their ratio to the plain sum's, accuracy and loss by seed, and
    (``other``: {"name", "codecs"}) the accuracy of the same labels in a second file."""
    def acc(c):
        a = c["accuracy"]
        return f"{100 * sum(a) / len(a):.1f}% ({', '.join(f'{100 * x:.1f}' for x in a)})"

    theirs = {c["label"]: c for c in other["codecs"]} if other else {}
    head = "| run | dp bytes per step | of plain | codec buffers per rank | held-out accuracy " \
           "(mean; per seed) | final loss (mean) |" + (f" held-out, {other['name']} |" if other else "")
    lines = [head, "|---|---:|---:|---:|---:|---:|" + ("---:|" if other else "")]
    for c in codecs:
        mine = (f"| {c['label']} | {c['dp_bytes_per_step']:,.0f} | "
                f"{c['dp_bytes_per_step'] / base:.3f} | {c['error_feedback_bytes']:,} | {acc(c)} | "
                f"{sum(c['final_loss']) / len(c['accuracy']):.4f} |")
        lines.append(mine + (f" {acc(theirs[c['label']]) if c['label'] in theirs else '-'} |"
                             if other else ""))
    return "\n".join(lines)


def plot(codecs: list[dict], path: str, name: str, other: dict | None = None) -> None:
    """Held-out accuracy and final loss against the dp bytes per step (log scale): the mean
    over the seeds, the bar from the lowest to the highest; ``other``'s codecs hollow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    theirs = {c["label"]: c for c in other["codecs"]} if other else {}
    for ax, key, ylabel in ((axes[0], "accuracy", "held-out exact match (%)"),
                            (axes[1], "final_loss", "final training loss")):
        for i, c in enumerate(codecs):
            color = f"C{i}"
            for cc, hollow in ((c, False), (theirs.get(c["label"]), True)):
                if cc is None:
                    continue
                ys = [100 * y if key == "accuracy" else y for y in cc[key]]
                mean, x = sum(ys) / len(ys), cc["dp_bytes_per_step"] * (1.08 if hollow else 1)
                ax.errorbar(x, mean, yerr=[[mean - min(ys)], [max(ys) - mean]], fmt="o",
                            capsize=3, color=color, mfc="white" if hollow else color)
                ax.scatter([x] * len(ys), ys, s=10, color=color, alpha=0.5)  # each seed
            ax.annotate(c["label"], (c["dp_bytes_per_step"], sum(c[key]) / len(c[key])
                                     * (100 if key == "accuracy" else 1)),
                        fontsize=8, xytext=(5, 4 if i % 2 else -11), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("bytes per step on dp (ledger)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    axes[0].axhline(85, color="gray", ls=":", lw=1)
    axes[0].axhline(90, color="gray", ls="--", lw=1)
    axes[0].plot([], [], "ko", label=name)
    if other:
        axes[0].plot([], [], "ko", mfc="white", label=other["name"])
    axes[0].legend(fontsize=8, loc="center")
    fig.suptitle("mpiexec -n 2 refmp train --dp 2 with each codec: the mean over seeds, "
                 "bars from the lowest to the highest")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/img/compression_convergence.json", help="the figures")
    p.add_argument("--plot", default="docs/img/compression_convergence.png")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--only", nargs="*", default=None, help="labels to run (default: all)")
    p.add_argument("--keep", nargs="*", default=[], help="JSON files of earlier runs of this "
                   "script (the same flags): their runs are in --out, and not run again")
    p.add_argument("--against", default=None, help="a JSON file of this script's runs at "
                   "other flags (e.g. --lr 3e-3): their accuracy beside, hollow in the plot")
    p.add_argument("--replot", action="store_true",
                   help="no runs: the table and plot of --out's runs and --keep's")
    args, extra = p.parse_known_args()  # the rest goes to every run (e.g. --steps 300)
    if args.replot:
        runs = []
        for path in [args.out, *args.keep]:  # the runs of every file, in order
            with open(path) as f:
                runs += json.load(f)["runs"]
    else:
        done = {}
        for path in args.keep:
            with open(path) as f:
                done.update({(r["label"], r.get("seed", 0)): r for r in json.load(f)["runs"]})
        runs = list(done.values()) + [run_one(k, v, seed, extra) for k, v in RUNS.items()
                                      if args.only is None or k in args.only
                                      for seed in args.seeds if (k, seed) not in done]
        for r in runs:
            r.setdefault("seed", 0)
        with open(args.out, "w") as f:
            json.dump({"command": "mpiexec -n 2 refmp train --dp 2 <flags> --seed S "
                       + " ".join(extra), "runs": runs, "codecs": by_codec(runs)}, f, indent=1)
    codecs = by_codec(runs)
    base = next((c["dp_bytes_per_step"] for c in codecs if c["label"] == "none"),
                codecs[0]["dp_bytes_per_step"])
    other = None
    if args.against:
        with open(args.against) as f:
            d = json.load(f)
        other = {"name": flags_of(d["command"]), "codecs": d["codecs"]}
    with open(args.out) as f:
        name = flags_of(json.load(f)["command"])
    print(table(codecs, base, other))
    if args.plot:
        plot(codecs, args.plot, name, other)


if __name__ == "__main__":
    main()
