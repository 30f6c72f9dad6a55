"""The sharded checkpoint's format: its names, slices, files and manifest (no MPI here).

Shapes: P elements of a full parameter (GPT-2 name, global shape), n its elements in one
rank's file, R the contiguous runs of global flat indices those n elements make.

A checkpoint is a directory per step, ``DIR/step-{N:08d}/``::

    rank-00000.safetensors   rank 0's pieces: for each, the tensors
        {name}/param           (n,) values, the model's dtype
        {name}/m, {name}/v     (n,) AdamW's moments (SGD with momentum: {name}/momentum)
        {name}/runs            (R, 2) int64: (first global flat index, length) of each run
    rank-00001.safetensors   ...
    codec-00000.safetensors  with --grad-compress powersgd / topk: rank 0's own codec state,
                             error/{unit}/{name} (its error buffers) and q/{name} (PowerSGD's
                             Q's), which only the same layout and codec continue from
    codec-00001.safetensors  ...
    manifest.json            layout, step, data position, lr, the run's TrainConfig and
                             GPTConfig, optimizer kind and step count, every tensor's global
                             shape, which file holds which pieces, each file's sha256

The directory is written as ``.step-{N:08d}.tmp`` and renamed (:func:`publish`) once every
file and the manifest are complete: a directory named ``step-*`` with a manifest is a whole
checkpoint, and anything else is not one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import asdict

import numpy as np

from refmp.checkpoint.stream import StreamWriter
from refmp.errors import ConfigError
from refmp.nn.families import config_from, family_name, param_shapes
from refmp.nn.params import GPTConfig

FORMAT = "refmp-checkpoint"
MANIFEST = "manifest.json"
STEP = re.compile(r"step-(\d{8})")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def codec_file(rank: int) -> str:
    return f"codec-{rank:05d}.safetensors"


# --- the slice a piece holds: runs of global flat indices --------------------------------------


def runs_of(index: np.ndarray) -> np.ndarray:
    """(R, 2) int64 (start, length) of the contiguous runs in ``index`` (n,), in order."""
    if index.size == 0:
        return np.zeros((0, 2), np.int64)
    breaks = np.flatnonzero(np.diff(index) != 1) + 1  # where a new run starts
    starts = np.concatenate([[0], breaks])
    lengths = np.diff(np.concatenate([starts, [index.size]]))
    return np.stack([index[starts], lengths], axis=1).astype(np.int64)


def index_of(runs: np.ndarray) -> np.ndarray:
    """Inverse of runs_of: the (n,) global flat indices, run by run."""
    starts, lengths = runs[:, 0], runs[:, 1]
    n = int(lengths.sum())
    before = np.cumsum(lengths) - lengths  # (R,) elements in the earlier runs
    return np.arange(n, dtype=np.int64) + np.repeat(starts - before, lengths)


# --- writing -----------------------------------------------------------------------------------


def write_rank_file(path: str, pieces: dict, to_host=np.asarray) -> dict:
    """Write ``pieces`` {name: (runs (R, 2), real, {kind: values})} as one safetensors file, a
    tensor at a time (refmp.checkpoint.stream.StreamWriter: the writer holds one piece's copy,
    never the rank's state again). ``runs``: the (start, length) runs of the piece's global
    flat indices (runs_of); ``values``: its elements in the rank's order (any shape, any
    device: ``to_host`` brings them over), of which ``real`` (a bool mask; None: all) are
    written.

    Returns the manifest's entry for the file: its size, sha256, and per piece its element
    count, first and last global index and number of runs (the slice, in brief)."""
    shapes, dtypes, summary = {}, {}, {}
    for name, (runs, _, arrays) in pieces.items():
        n = int(runs[:, 1].sum())
        shapes[f"{name}/runs"] = runs.shape
        dtypes[f"{name}/runs"] = np.int64
        for kind, a in arrays.items():
            shapes[f"{name}/{kind}"] = (n,)
            dtypes[f"{name}/{kind}"] = a.dtype
        summary[name] = {"numel": n, "first": int(runs[:, 0].min()),
                         "last": int((runs[:, 0] + runs[:, 1]).max() - 1), "runs": len(runs)}

    def tensor(key: str) -> np.ndarray:  # one tensor of the file, made as it is written
        name, kind = key.rsplit("/", 1)
        runs, real, arrays = pieces[name]
        if kind == "runs":
            return runs
        v = np.asarray(to_host(arrays[kind])).reshape(-1)
        return v if real is None else v[real]

    with StreamWriter(path, shapes, dtypes) as w:
        for key in w.order:
            w.write(key, tensor(key))
    return {"bytes": w.bytes, "sha256": w.sha256, "pieces": summary}


def write_tensors(path: str, tensors: dict) -> dict:
    """Write ``tensors`` {name: array} as one safetensors file; its size and sha256 (the
    manifest's entry, which read_file checks)."""
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, path)
    with open(path, "rb") as f:
        data = f.read()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def publish(tmp: str, final: str, keep: int = 0) -> None:
    """Rename the complete ``tmp`` to ``final`` (replacing an older copy of that step), then
    keep only the last ``keep`` complete checkpoints beside it (0: all). What is removed is
    renamed first, so no step-* directory is ever half there."""
    root = os.path.dirname(final)
    trash = f"{final}.old"
    if os.path.exists(final):
        os.rename(final, trash)
    os.rename(tmp, final)
    shutil.rmtree(trash, ignore_errors=True)
    if keep > 0:
        for step in complete_steps(root)[:-keep]:
            old = os.path.join(root, step_name(step))
            os.rename(old, f"{old}.old")
            shutil.rmtree(f"{old}.old", ignore_errors=True)


def write_json(path: str, obj: dict) -> None:
    """Write ``obj`` as the JSON file ``path``, whole or not at all (a temporary file renamed)."""
    with open(f"{path}.tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(f"{path}.tmp", path)


def file_error(what: str, path: str, e: OSError) -> ConfigError:
    """The ConfigError for an OSError on ``path``: ``what``, the path, and the OS's reason."""
    return ConfigError(f"{what} {path}: {e.strerror or e}")


# --- finding and checking ----------------------------------------------------------------------


def complete_steps(root: str) -> list[int]:
    """The steps of the complete checkpoints in ``root`` (a step-N directory with a manifest)."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for e in os.listdir(root) if (m := STEP.fullmatch(e))
                  and os.path.isfile(os.path.join(root, e, MANIFEST)))


def find(path: str) -> str:
    """``path`` if it is one checkpoint, else the latest complete checkpoint inside it."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    if not os.path.isdir(path):
        raise ConfigError(f"checkpoint {path}: no such directory")
    steps = complete_steps(path)
    if not steps:
        raise ConfigError(f"checkpoint {path}: no complete checkpoint in it (a step-NNNNNNNN "
                          f"directory holding a {MANIFEST})")
    return os.path.join(path, step_name(steps[-1]))


def read_manifest(ckpt: str) -> dict:
    """The manifest of the checkpoint directory ``ckpt``, checked for what readers rely on."""
    path = os.path.join(ckpt, MANIFEST)
    try:
        with open(path) as f:
            man = json.load(f)
    except OSError as e:
        raise file_error("checkpoint manifest", path, e) from e
    except ValueError as e:
        raise ConfigError(f"checkpoint manifest {path}: not valid JSON ({e})") from e
    try:
        if man["format"] != FORMAT:
            raise ConfigError(f"checkpoint manifest {path}: format {man['format']!r}, "
                              f"not {FORMAT!r}")
        shapes = {k: list(s) for k, s in param_shapes(model_config(man)).items()}
        np.dtype(man["dtype"])
        ok = (shapes == man["tensors"] and isinstance(man["step"], int)
              and isinstance(man["optimizer"]["t"], int) and isinstance(man["files"], dict)
              and all(_file_entry_ok(f, shapes) for f in man["files"].values()))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ConfigError(f"checkpoint manifest {path}: missing or malformed entry ({e!r})") from e
    if not ok:
        raise ConfigError(f"checkpoint manifest {path}: its entries do not fit its model "
                          f"(altered?)")
    man["path"], man["dir"] = path, ckpt  # where it was read from (not in the file)
    return man


def _file_entry_ok(f: dict, shapes: dict) -> bool:
    """A manifest's entry for one file has the fields readers use, of the right types."""
    ints = ("numel", "first", "last", "runs")
    return (isinstance(f["bytes"], int) and isinstance(f["sha256"], str)
            and isinstance(f["rank"], int) and isinstance(f["pieces"], dict)
            and all(k in shapes and all(isinstance(p[x], int) for x in ints)
                    for k, p in f["pieces"].items()))


def model_config(man: dict) -> GPTConfig:
    """The model's shape a manifest records: GPT-2's, or its ``family``'s (refmp.nn.families)."""
    return config_from(man.get("family", "gpt2"), man["model"])


def check_model(man: dict, mcfg) -> None:
    """Refuse a checkpoint of another model shape, naming the fields that differ."""
    run_model, saved = asdict(mcfg), man["model"]
    if family_name(mcfg) != man.get("family", "gpt2"):
        raise ConfigError(f"checkpoint manifest {man['path']} is a {man.get('family', 'gpt2')} "
                          f"model; this run's is {family_name(mcfg)} (--arch)")
    diff = [k for k in run_model if run_model[k] != saved.get(k)]
    if diff:
        said = ", ".join(f"{k} {saved.get(k)}" for k in diff)
        want = ", ".join(f"{k} {run_model[k]}" for k in diff)
        raise ConfigError(f"checkpoint manifest {man['path']} is a model with {said}; this "
                          f"run's model has {want} (give the model flags it was saved with)")


def read_file(ckpt: str, name: str, entry: dict) -> dict:
    """The tensors of one rank file, after checking its size and sha256 against the manifest."""
    from safetensors.numpy import load

    path = os.path.join(ckpt, name)
    if not os.path.isfile(path):
        raise ConfigError(f"checkpoint file {path}: missing (its manifest lists it)")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise file_error("checkpoint file", path, e) from e
    if len(data) != entry["bytes"]:
        raise ConfigError(f"checkpoint file {path}: {len(data)} bytes, its manifest says "
                          f"{entry['bytes']} (truncated or altered)")
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise ConfigError(f"checkpoint file {path}: sha256 differs from its manifest's "
                          f"(the file was altered)")
    try:
        return load(data)
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise ConfigError(f"checkpoint file {path}: not a readable safetensors file ({e})") from e
