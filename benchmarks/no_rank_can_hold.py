"""A model no rank can hold: training and decoding on ranks whose memory is a hard limit the
kernel enforces (refmp cluster --rank-memory: a memory cgroup per rank; root), against the
same runs uncapped on one rank.

Training, GPT-2 large's shape by default (36 layers, C 1280, 20 heads, vocabulary 50257: 774M
parameters, 12.4 GB of float32 AdamW state), --train-memory per rank:
  * serial under the limit: refused by the memory check before any allocation (exit 2);
  * serial uncapped (one process, no cgroup): the reference losses;
  * ZeRO-3 over 4 ranks, and tp 2 x pp 2, under the limit: a few steps each, their losses
    beside the reference's, every rank's measured peak beside the planner's prediction.
Decoding, GPT-2 XL's shape by default (48 layers, C 1600, 25 heads: 1.56B parameters, 6.2 GB
of float32 weights) from a Hugging Face directory this script writes tensor by tensor from
refmp's init (nothing whole in memory), --decode-memory per rank:
  * serial uncapped: the reference tokens;
  * tp 5 and pp 4 under the limit (tp must divide the 25 heads): greedy tokens beside the
    reference's, and peaks.

Every run's output lands in --out (a directory every node sees: not under /tmp), with a
table (table.md) of the losses, tokens, and measured peaks against predictions.

Run (root, the machine otherwise idle; about 10 minutes on 2 cores, 24 GB):
    python benchmarks/no_rank_can_hold.py --out runs/no-rank-can-hold
A quick run of the same steps at a small shape (seconds):
    python benchmarks/no_rank_can_hold.py --out runs/nrch-small --small
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np

LARGE = dict(n_layer=36, n_embd=1280, n_head=20, vocab=50257)
XL = dict(n_layer=48, n_embd=1600, n_head=25, vocab=50257)
SMALL_TRAIN = dict(n_layer=4, n_embd=256, n_head=4, vocab=50257)
SMALL_DECODE = dict(n_layer=4, n_embd=320, n_head=5, vocab=50257)
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run(argv: list[str], log: pathlib.Path) -> int:
    """Run argv, its output to ``log``; print one line; return its exit status."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        status = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=ENV).returncode
    print(f"  {log.stem}: exit {status} in {time.perf_counter() - t0:.0f} s", flush=True)
    return status


def cluster(ranks: int, memory: str, out: pathlib.Path, name: str) -> list[str]:
    """``refmp cluster`` on one node of ``ranks`` ranks, each in a cgroup of ``memory``."""
    return ["refmp", "cluster", "--nodes", "1", "--ranks-per-node", str(ranks),
            "--rank-memory", memory, "--json", str(out / f"{name}.cluster.json"), "--"]


def summary(path: pathlib.Path) -> dict | None:
    """The summary object of a --log-json file (its last line), or None."""
    if not path.exists():
        return None
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return lines[-1] if lines and lines[-1].get("summary") else None


def losses(path: pathlib.Path) -> list[float]:
    return [json.loads(x)["loss"] for x in path.read_text().splitlines()
            if x.strip() and "loss" in json.loads(x)]


def peaks(s: dict | None) -> str:
    """Each rank's measured peak beside the planner's prediction, in GiB."""
    if not s or not s.get("memory_measured"):
        return "-"
    g = 2 ** 30
    return "; ".join(f"r{r}: {m['rss'] / g:.2f} (plan {m['predicted'] / g:.2f})"
                     for r, m in enumerate(s["memory_measured"]))


def json_line(log: pathlib.Path) -> dict | None:
    """The JSON object ``refmp generate --json`` printed into ``log``, or None."""
    for line in log.read_text().splitlines() if log.exists() else []:
        if line.startswith("{"):
            return json.loads(line)
    return None


def train(args, out: pathlib.Path, rows: list[str]) -> None:
    shape = SMALL_TRAIN if args.small else LARGE
    data = out / "tokens.npy"
    if not data.exists():  # every id of the vocabulary can occur; the last one does
        rng = np.random.default_rng(0)
        toks = rng.integers(0, shape["vocab"], 4096, dtype=np.int64)
        toks[-1] = shape["vocab"] - 1
        np.save(data, toks)
    model = ["--n-layer", str(shape["n_layer"]), "--n-embd", str(shape["n_embd"]),
             "--n-head", str(shape["n_head"]), "--data", str(data), "--block-size", "64",
             "--batch-size", "4", "--steps", str(args.steps), "--dtype", "float32",
             "--warmup-steps", "0", "--no-progress"]
    mem = args.train_memory
    print(f"training at {shape}, {mem} a rank", flush=True)
    refused = run(cluster(1, mem, out, "train-serial-capped") + ["refmp", "train", *model],
                  out / "train-serial-capped.log")
    rows.append(f"| train serial, {mem} | refused before work: exit {refused} | - | - |")
    run(["refmp", "train", *model, "--log-json", str(out / "train-serial.jsonl")],
        out / "train-serial.log")
    ref = losses(out / "train-serial.jsonl") if (out / "train-serial.jsonl").exists() else []
    rows.append(f"| train serial, uncapped | losses {', '.join(f'{x:.6f}' for x in ref)} | - "
                f"| {peaks(summary(out / 'train-serial.jsonl'))} |")
    for name, n, flags in (("zero3-dp4", 4, ["--dp", "4", "--zero", "3"]),
                           ("tp2-pp2", 4, ["--tp", "2", "--pp", "2", "--microbatches", "2"])):
        log = out / f"train-{name}.jsonl"
        status = run(cluster(n, mem, out, f"train-{name}") + ["refmp", "train", *model, *flags,
                     "--log-json", str(log)], out / f"train-{name}.log")
        got = losses(log) if log.exists() else []
        diff = (max(abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True))
                if got and len(got) == len(ref) else float("nan"))
        rows.append(f"| train {name}, {mem} | exit {status}; losses "
                    f"{', '.join(f'{x:.6f}' for x in got)} | largest relative difference from "
                    f"serial {diff:.1e} | {peaks(summary(log))} |")


def write_model_dir(shape: dict, path: pathlib.Path, seed: int = 0) -> None:
    """A Hugging Face directory of refmp's init at ``shape``, written tensor by tensor."""
    from refmp.checkpoint.source import InitSource
    from refmp.checkpoint.weights import save_streamed
    from refmp.nn.params import GPTConfig

    mcfg = GPTConfig(vocab_size=shape["vocab"], block_size=64, n_layer=shape["n_layer"],
                     n_head=shape["n_head"], n_embd=shape["n_embd"])
    src = InitSource(mcfg, seed)
    save_streamed(str(path), mcfg, np.float32, lambda k: src.read(k, dtype=np.float32))


def decode(args, out: pathlib.Path, rows: list[str]) -> None:
    shape = SMALL_DECODE if args.small else XL
    model = out / ("model-small" if args.small else "model-xl")
    if not (model / "config.json").exists():
        t0 = time.perf_counter()
        write_model_dir(shape, model)
        print(f"  wrote {model} in {time.perf_counter() - t0:.0f} s", flush=True)
    prompts = out / "prompts.npy"
    np.save(prompts, np.random.default_rng(1).integers(0, shape["vocab"], (2, 8)))
    gen = ["refmp", "generate", "--init", str(model), "--prompts", str(prompts),
           "--max-new-tokens", "8", "--dtype", "float32"]
    mem = args.decode_memory
    print(f"decoding at {shape}, {mem} a rank", flush=True)
    run(gen + ["--save-tokens", str(out / "decode-serial.npy"), "--json"],
        out / "decode-serial.log")
    ref = np.load(out / "decode-serial.npy") if (out / "decode-serial.npy").exists() else None
    rows.append(f"| decode serial, uncapped | tokens {ref.tolist() if ref is not None else '-'} "
                f"| - | {peaks(json_line(out / 'decode-serial.log'))} |")
    for name, n, flags in (("tp5", 5, ["--tp", "5"]), ("pp4", 4, ["--pp", "4"])):
        toks = out / f"decode-{name}.npy"
        status = run(cluster(n, mem, out, f"decode-{name}") + gen + flags
                     + ["--save-tokens", str(toks), "--json"], out / f"decode-{name}.log")
        same = (ref is not None and toks.exists()
                and np.array_equal(np.load(toks), ref))
        rows.append(f"| decode {name}, {mem} | exit {status} | tokens "
                    f"{'identical to' if same else 'DIFFERENT from'} serial | "
                    f"{peaks(json_line(out / f'decode-{name}.log'))} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="a directory every node sees (not under /tmp)")
    ap.add_argument("--part", choices=("train", "decode", "all"), default="all")
    ap.add_argument("--small", action="store_true", help="a small shape: the steps, in seconds")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--train-memory", help="each training rank's limit (4GiB; --small: 250MiB)")
    ap.add_argument("--decode-memory", help="each decoding rank's limit (2.5GiB; --small: 160MiB)")
    args = ap.parse_args()
    args.train_memory = args.train_memory or ("250MiB" if args.small else "4GiB")
    args.decode_memory = args.decode_memory or ("160MiB" if args.small else "2.5GiB")
    out = pathlib.Path(args.out).resolve()
    if str(out).startswith("/tmp"):
        ap.error("--out must not be under /tmp: each node has its own /tmp")
    if os.geteuid() != 0:
        ap.error("refmp cluster makes memory cgroups: run as root")
    out.mkdir(parents=True, exist_ok=True)
    rows = ["| run | result | against serial | measured peak per rank, GiB (planner's) |",
            "| --- | --- | --- | --- |"]
    if args.part in ("train", "all"):
        train(args, out, rows)
    if args.part in ("decode", "all"):
        decode(args, out, rows)
    table = "\n".join(rows) + "\n"
    (out / "table.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
