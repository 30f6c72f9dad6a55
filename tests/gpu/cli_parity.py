"""The commands on a GPU against the same commands on the CPU (part of tests/gpu/check.sh).

`refmp train --device gpu` in float64 for serial, dp 2, tp 2, pp 2 and pp 2 x tp 2 with
ZeRO-3 (the ranks share the one GPU; messages staged through the host unless MPI is
CUDA-aware), each against `--device cpu` of the same layout: every step's loss and the saved
weights equal to 1e-10 relative, and the ledger showing the messages staged through the host
both ways (stage_d2h, stage_h2d) unless MPI is CUDA-aware. Then `refmp generate --device gpu`
against the CPU's tokens (identical) and logits (1e-10). Writes its results to --out (a JSON
per run and results.json) and exits non-zero on any difference.

    python tests/gpu/cli_parity.py --out gpu-check        (on a machine with a GPU)
    python tests/gpu/cli_parity.py --out x --device cpu   (the mechanics, both sides on the CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
from safetensors.numpy import load_file

LAYOUTS = {  # name: (ranks, flags)
    "serial": (1, []),
    "dp2": (2, ["--dp", "2"]),
    "tp2": (2, ["--tp", "2"]),
    "pp2": (2, ["--pp", "2", "--microbatches", "2"]),
    "pp2-tp2-zero3": (4, ["--pp", "2", "--tp", "2", "--dp", "1", "--zero", "3",
                          "--microbatches", "2"]),
}
COMMON = ["--steps", "3", "--batch-size", "8", "--n-layer", "4", "--dtype", "float64",
          "--no-progress"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def train(out: pathlib.Path, name: str, device: str) -> dict:
    n, flags = LAYOUTS[name]
    tag = f"{name}-{device}"
    argv = ["mpiexec", "-n", str(n), "refmp", "train", *COMMON, *flags, "--device", device,
            "--save", str(out / f"{tag}.safetensors"), "--log-json", str(out / f"{tag}.jsonl")]
    r = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=600)
    (out / f"{tag}.log").write_text(r.stdout + r.stderr)
    if r.returncode:
        return {"status": r.returncode}
    lines = [json.loads(x) for x in (out / f"{tag}.jsonl").read_text().splitlines()]
    return {"status": 0, "losses": [x["loss"] for x in lines if "loss" in x],
            "comm": lines[-1]["comm"]}


def staged_ok(comm: dict, device: str) -> tuple[bool, str]:
    """Whether the ledger shows staging where it must: on a GPU without CUDA-aware MPI every
    message crosses to the host and back (stage_d2h and stage_h2d both non-zero); on the CPU
    nothing is staged. The exact per-call formula is tests/gpu/test_gpu.py's and
    tests/device's, run by check.sh on the same GPU."""
    staged = {k: v["bytes"] for k, v in comm.items() if k.startswith("stage_")}
    moved = sum(v["bytes"] for k, v in comm.items() if not k.startswith("stage_"))
    aware = os.environ.get("REFMP_CUDA_AWARE") == "1"
    both = all(any(k.startswith(d) and b > 0 for k, b in staged.items())
               for d in ("stage_d2h", "stage_h2d"))
    ok = not staged if device == "cpu" or aware else both
    return ok, f"staged {staged}; the ledger's other calls {moved:,} B"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="gpu", help="the side compared with the CPU (gpu)")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, bad = {}, 0
    for name in LAYOUTS:
        cpu, dev = train(out, name, "cpu"), train(out, name, args.device)
        row = {"cpu": cpu.get("status"), args.device: dev.get("status")}
        if cpu.get("status") == 0 and dev.get("status") == 0:
            a = load_file(str(out / f"{name}-cpu.safetensors"))
            b = load_file(str(out / f"{name}-{args.device}.safetensors"))
            row["weights_rel"] = max(float(np.abs(a[k] - b[k]).max() / (np.abs(a[k]).max() or 1))
                                     for k in a)
            row["loss_rel"] = max(abs(x - y) / abs(x) for x, y in
                                  zip(cpu["losses"], dev["losses"], strict=True))
            row["staged_ok"], row["staged"] = staged_ok(dev["comm"], args.device)
            row["ok"] = row["weights_rel"] < 1e-10 and row["loss_rel"] < 1e-10 and row["staged_ok"]
        else:
            row["ok"] = False
        bad += not row["ok"]
        results[f"train {name}"] = row
        print(f"train {name}: {row}", flush=True)
    model = out / "serial-cpu.safetensors"
    for name, n, flags in (("serial", 1, []), ("tp2", 2, ["--tp", "2"]), ("pp2", 2, ["--pp", "2"])):
        got = {}
        for device in ("cpu", args.device):
            tag = f"gen-{name}-{device}"
            argv = ["mpiexec", "-n", str(n), "refmp", "generate", "--init", str(model),
                    "--prompt", "123+456=", "--prompt", "999+001=", "--dtype", "float64",
                    "--device", device, *flags, "--save-tokens", str(out / f"{tag}.tok.npy"),
                    "--save-logits", str(out / f"{tag}.logits.npy")]
            r = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=600)
            (out / f"{tag}.log").write_text(r.stdout + r.stderr)
            got[device] = r.returncode
        row = {"status": got}
        if not any(got.values()):
            t = [np.load(out / f"gen-{name}-{d}.tok.npy") for d in ("cpu", args.device)]
            lg = [np.load(out / f"gen-{name}-{d}.logits.npy") for d in ("cpu", args.device)]
            row["tokens_equal"] = bool(np.array_equal(*t))
            row["logits_rel"] = float(np.abs(lg[0] - lg[1]).max() / np.abs(lg[0]).max())
            row["ok"] = row["tokens_equal"] and row["logits_rel"] < 1e-10
        else:
            row["ok"] = False
        bad += not row["ok"]
        results[f"generate {name}"] = row
        print(f"generate {name}: {row}", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"{len(results) - bad} of {len(results)} equal; results in {out / 'results.json'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
