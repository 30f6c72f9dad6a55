"""Delayed FP8 scaling's amax history in a sharded checkpoint (refmp.parallel.fp8.Scales).

Shapes: H steps kept, k a block's FP8 linears (4 dense, 2 MoE: its experts stay wide), 3
roles (a linear's input X, its weight W, its output's gradient dY).

The history is training state: a step's scales come from the largest amax of the last H
steps, so a resumed run that started it afresh would scale its next steps by their current
amaxes and leave the run it continues. It is kept per tensor, and after each step every
rank of a pipeline stage holds the same values, reduced (max) over tp and dp x cp: the
serial run's history for the stage's blocks. So it is saved by block, once, and any layout
reads back the blocks it runs, whatever the saved run's tp, dp, cp or pipeline split:

    fp8-amax.safetensors   {"h.{i}": (H, k, 3) float64}, one tensor a block
    manifest["fp8"]        {"recipe", "steps" (kept, at most H), "file": its bytes and sha256}

A checkpoint without it (saved by a run of another recipe, or none) resumes a delayed run
with an empty history, and the resumed run says so (refmp.checkpoint.flags.config_notes).
"""

from __future__ import annotations

import os

from refmp.checkpoint.format import read_file, write_tensors
from refmp.errors import ConfigError

AMAX_FILE = "fp8-amax.safetensors"


def gathered_history(parts) -> dict | None:
    """Every block's history ({"steps", "amax": {"h.{i}": (H, k, 3)}}), on every rank
    (collective over the world): each stage's ranks hold its blocks' history, the same on
    each (Scales.end_step's reductions). None where the run does not scale by delayed amaxes."""
    if parts.cfg.fp8 != "delayed" or parts.fp8 is None:
        return None
    stages = parts.grid.world.allgather_obj(parts.fp8.state())
    amax = {k: v for s in stages for k, v in s["amax"].items()}
    return {"steps": stages[0]["steps"], "amax": dict(sorted(amax.items()))}


def write_history(directory: str, history: dict) -> dict:
    """Write the history as AMAX_FILE in ``directory`` (one rank); the manifest's entry."""
    entry = write_tensors(os.path.join(directory, AMAX_FILE), history["amax"])
    return {"recipe": "delayed", "steps": history["steps"], "file": entry}


def read_history(ckpt: str, man: dict, parts) -> dict | None:
    """The saved history for this run (Scales.load_state's form), checked against the
    model: every block's (H, k, 3) amaxes; None where this run is not delayed or the
    checkpoint holds none."""
    saved = man.get("fp8")
    if parts.cfg.fp8 != "delayed" or parts.fp8 is None or not isinstance(saved, dict):
        return None
    if not isinstance(saved.get("file"), dict) or not isinstance(saved.get("steps"), int):
        raise ConfigError(f"checkpoint manifest {man['path']}: its fp8 entry has no file or "
                          "steps (altered?)")
    amax = read_file(ckpt, AMAX_FILE, saved["file"])
    H = parts.fp8.scales.past.shape[0]
    if not 0 <= saved["steps"] <= H:
        raise ConfigError(f"checkpoint manifest {man['path']}: its fp8 history keeps "
                          f"{saved['steps']} steps, this run at most {H}")
    for i in range(parts.model.n_layer):
        want = (H, 2 if parts.model.is_moe(i) else 4, 3)
        got = amax.get(f"h.{i}")
        if got is None or got.shape != want:
            raise ConfigError(f"checkpoint file {os.path.join(ckpt, AMAX_FILE)}: block {i}'s amax "
                              f"history is {None if got is None else got.shape}, this run keeps "
                              f"{want} (history, linears, roles) of {H} steps")
    return {"steps": saved["steps"], "amax": amax}
