"""Sharded checkpoints: every rank writes what it owns; any layout reads back what it needs.

Shapes: P elements of a full parameter (GPT-2 name, global shape), n its elements in one
rank's file, R the contiguous runs of global flat indices those n elements make.

A checkpoint is a directory per step, ``DIR/step-{N:08d}/``::

    rank-00000.safetensors   rank 0's counted pieces: for each, the tensors
        {name}/param           (n,) values, the model's dtype
        {name}/m, {name}/v     (n,) AdamW's moments (SGD with momentum: {name}/momentum)
        {name}/runs            (R, 2) int64: (first global flat index, length) of each run
    rank-00001.safetensors   ...
    manifest.json            layout, step, data position, lr, the run's TrainConfig and
                             GPTConfig, optimizer kind and step count, every tensor's global
                             shape, which file holds which pieces, each file's sha256

A rank writes only the pieces it *counts* (Engine.counted: one rank per distinct copy of an
element), so the files are disjoint and together hold every element once. The directory is
written as ``.step-{N:08d}.tmp`` and renamed by rank 0 once every file and the manifest are
complete: a directory named ``step-*`` with a manifest is a whole checkpoint, and anything
else is not one.

Resharding is reading the slices you need: a rank of any layout knows, from its own
``Engine.piece_index()``, the global flat indices of every element it holds. It reads the
files whose pieces of those parameters overlap them (the manifest gives each piece's first
and last index), scatters each piece into the full flat tensor through its runs, and takes
its own elements out through its index. Small models only: a rank builds the full tensors
of the parameters it holds (docs/checkpoints.md has the sizes).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from dataclasses import asdict

import numpy as np

from refmp.errors import ConfigError
from refmp.nn.params import GPTConfig, param_shapes
from refmp.runtime import backend

FORMAT = "refmp-checkpoint"
MANIFEST = "manifest.json"
STEP = re.compile(r"step-(\d{8})")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


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


def write_rank_file(path: str, pieces: dict) -> dict:
    """Write ``pieces`` {name: (index (n,), {kind: values (n,)})} as one safetensors file.

    Returns the manifest's entry for the file: its size, sha256, and per piece its element
    count, first and last global index and number of runs (the slice, in brief)."""
    from safetensors.numpy import save_file

    tensors, summary = {}, {}
    for name, (index, values) in pieces.items():
        runs = runs_of(index)
        tensors[f"{name}/runs"] = runs
        for kind, v in values.items():
            tensors[f"{name}/{kind}"] = np.ascontiguousarray(v)
        summary[name] = {"numel": int(index.size), "first": int(index.min()),
                         "last": int(index.max()), "runs": len(runs)}
    save_file(tensors, path)
    with open(path, "rb") as f:
        data = f.read()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pieces": summary}


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


def _write_json(path: str, obj: dict) -> None:
    with open(f"{path}.tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(f"{path}.tmp", path)


def _oserror(what: str, path: str, e: OSError) -> ConfigError:
    return ConfigError(f"{what} {path}: {e.strerror or e}")


def save(tr, root: str, keep: int = 0) -> str:
    """Write the Trainer ``tr``'s state after ``tr.step_num`` steps as ``root/step-{N:08d}``
    (collective over the world). Returns that directory."""
    from refmp.training.trainer import agreed, lr_at

    world, run, cfg, step = tr.grid.world, tr.runner, tr.cfg, tr.step_num
    final = os.path.join(root, step_name(step))
    tmp = os.path.join(root, f".{step_name(step)}.tmp")

    def prepare():  # rank 0 makes an empty temporary directory; the others wait (agreed)
        if world.rank == 0:
            try:
                os.makedirs(root, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)  # left by a run that died while saving
                os.makedirs(tmp)
            except OSError as e:
                raise _oserror("--checkpoint-dir", root, e) from e

    agreed(world, prepare)
    opt, moments = tr.optimizer_state()
    pieces = {}
    for k, index in run.piece_index().items():  # my elements' global flat indices
        held = index >= 0  # -1: padding (ZeRO's, or the vocabulary's with tp)
        if not run.counted[k] or not held.any():
            continue  # another rank writes this copy, or it holds nothing
        host = {"param": backend.to_host(run.params[k])}
        host.update({m: backend.to_host(a[k]) for m, a in moments.items()})
        pieces[k] = (index[held], {m: np.asarray(v)[held] for m, v in host.items()})

    def write():
        path = os.path.join(tmp, rank_file(world.rank))
        try:
            entry = write_rank_file(path, pieces)
        except OSError as e:
            raise _oserror("cannot write checkpoint file", path, e) from e
        return {"rank": world.rank, "coords": tr.grid.coords, **entry}

    files = world.allgather_obj(agreed(world, write))
    mcfg, B, T = tr.model.cfg, cfg.batch_size, tr.T
    n_windows = tr.ds.n_windows(T)
    manifest = {
        "format": FORMAT, "version": 1, "step": step, "dtype": cfg.dtype,
        "layout": {**tr.grid.sizes, "world": world.size, "zero": cfg.zero,
                   "sequence_parallel": cfg.sequence_parallel,
                   "virtual_stages": cfg.virtual_stages, "stage_layers": cfg.stage_layers},
        "optimizer": {**opt, "moments": sorted(moments)},
        # the batch order is a function of (step, B, seed, shuffle): this is where it stands
        "data": {"name": tr.ds.name, "tokens": len(tr.ds.tokens), "batch_size": B,
                 "block_size": T, "windows": n_windows, "next_window": step * B % n_windows,
                 "epoch": step * B // n_windows, "shuffle": cfg.shuffle, "seed": cfg.seed},
        "lr": {"schedule": cfg.lr_schedule, "steps": cfg.steps, "next": lr_at(cfg, step)},
        "rng": "none: after initialization a step draws no random numbers",
        "model": asdict(mcfg), "config": asdict(cfg), "vocab": tr.ds.vocab,
        "tensors": {k: list(s) for k, s in param_shapes(mcfg).items()},
        "files": {rank_file(f["rank"]): f for f in files},
    }

    def finish():  # rank 0: the manifest last, then the rename that makes it a checkpoint
        if world.rank == 0:
            try:
                _write_json(os.path.join(tmp, MANIFEST), manifest)
                publish(tmp, final, keep)
            except OSError as e:
                raise _oserror("cannot complete checkpoint", final, e) from e

    agreed(world, finish)
    return final


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
        raise _oserror("checkpoint manifest", path, e) from e
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
    return GPTConfig(**man["model"])


def check_model(man: dict, mcfg) -> None:
    """Refuse a checkpoint of another model shape, naming the fields that differ."""
    mine, theirs = asdict(mcfg), man["model"]
    diff = [k for k in mine if mine[k] != theirs.get(k)]
    if diff:
        said = ", ".join(f"{k} {theirs.get(k)}" for k in diff)
        want = ", ".join(f"{k} {mine[k]}" for k in diff)
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
        raise _oserror("checkpoint file", path, e) from e
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


def assemble(ckpt: str, man: dict, want: dict, kinds: list[str], verify: set = frozenset()):
    """Full flat tensors {kind: {name: (P,)}} of the names in ``want`` {name: (lo, hi)}, read
    from the files holding elements in [lo, hi]; ``seen`` {name: (P,) bool} says which
    elements some file gave. The files in ``verify`` are read (checked) even if not needed."""
    dtype = np.dtype(man["dtype"])
    sizes = {k: math.prod(s) for k, s in man["tensors"].items()}
    full = {kind: {k: np.zeros(sizes[k], dtype) for k in want} for kind in kinds}
    seen = {k: np.zeros(sizes[k], bool) for k in want}
    for fname, entry in sorted(man["files"].items()):
        needed = [k for k, p in entry["pieces"].items()
                  if k in want and p["first"] <= want[k][1] and p["last"] >= want[k][0]]
        if not needed and fname not in verify:
            continue
        tensors = read_file(ckpt, fname, entry)
        path = os.path.join(ckpt, fname)
        for k in needed:
            try:
                index = index_of(tensors[f"{k}/runs"])  # (n,) global flat indices
                if index.size != entry["pieces"][k]["numel"] or index.min() < 0 \
                        or index.max() >= sizes[k] or seen[k][index].any():
                    raise ValueError("its slice is not the one its manifest gives")
                for kind in kinds:
                    full[kind][k][index] = tensors[f"{k}/{kind}"]
            except (KeyError, ValueError, IndexError) as e:
                raise ConfigError(f"checkpoint file {path}: {k} does not match the manifest "
                                  f"({e})") from e
            seen[k][index] = True
    return full, seen


# --- reading into a Trainer of any layout ------------------------------------------------------


def load(tr, path: str) -> dict:
    """Set the Trainer ``tr``'s weights, optimizer state and step from the checkpoint at (or
    latest in) ``path``, whatever layout wrote it (collective over the world). Returns the
    manifest. Every check raises a ConfigError on every rank (train.agreed)."""
    from refmp.training.trainer import agreed

    world, run = tr.grid.world, tr.runner
    index = run.piece_index()  # {piece: (n,) global flat index, -1 for padding}
    opt, _ = tr.optimizer_state()

    def read():
        ckpt = find(path)
        man = read_manifest(ckpt)
        check_model(man, tr.model.cfg)
        kind = man["optimizer"]["kind"]
        if kind is not None and kind != opt["kind"]:
            raise ConfigError(f"checkpoint manifest {man['path']}: its optimizer is {kind}, "
                              f"this run's is {opt['kind']} (--optimizer {kind})")
        kinds = ["param", *man["optimizer"]["moments"]]  # the moments of the same optimizer
        want = {k: (int(i[i >= 0].min()), int(i[i >= 0].max()))
                for k, i in index.items() if (i >= 0).any()}
        names = sorted(man["files"])
        verify = {f for j, f in enumerate(names) if j % world.size == world.rank}
        full, seen = assemble(ckpt, man, want, kinds, verify)
        for k in want:
            i = index[k][index[k] >= 0]
            if not seen[k][i].all():
                raise ConfigError(f"checkpoint manifest {man['path']}: no file holds "
                                  f"{int((~seen[k][i]).sum())} elements of {k}")
        return man, kinds, full

    man, kinds, full = agreed(world, read)

    def mine(kind: str, k: str) -> np.ndarray:
        """This rank's piece k of ``kind``: its elements of the full tensor, 0 at padding."""
        i = index[k]
        out = np.zeros(i.size, man["dtype"])
        if k in full[kind]:
            out[i >= 0] = full[kind][k][i[i >= 0]]
        return out

    for k, p in run.params.items():
        p[...] = backend.from_host(mine("param", k))
    tr.load_optimizer_state(man["optimizer"]["t"] if man["optimizer"]["kind"] else 0,
                            {m: {k: mine(m, k) for k in run.params} for m in kinds[1:]})
    if tr.scaler is not None and "loss_scale" in man["optimizer"]:  # fp16's dynamic scale
        tr.scaler.load_state(man["optimizer"]["loss_scale"])
    run.after_step()  # the compute copy from the pieces; ZeRO 1/2: all-gather them
    tr.step_num = int(man["step"])
    return man


def config_notes(man: dict, cfg) -> list[str]:
    """Where this run's training settings differ from the saved run's (said once, rank 0)."""
    saved = man.get("config") or {}
    math_fields = ("batch_size", "optimizer", "lr", "lr_schedule", "warmup_steps",
                   "min_lr_ratio", "weight_decay", "beta1", "beta2", "momentum", "grad_clip",
                   "dtype", "seed", "data", "shuffle", "digits", "steps")
    mine = asdict(cfg)
    return [f"--{k.replace('_', '-')} {mine[k]} differs from the checkpoint's {saved[k]}"
            for k in math_fields if k in saved and saved[k] != mine[k]]


def check_flags(cfg) -> None:
    """--checkpoint-dir, --save-every, --keep, --resume: values that make sense together."""
    for k in ("save_every", "keep"):
        if getattr(cfg, k) < 0:
            raise ConfigError(f"--{k.replace('_', '-')} must be 0 or more, got {getattr(cfg, k)}")
    if (cfg.save_every or cfg.keep) and not cfg.checkpoint_dir:
        raise ConfigError("--save-every and --keep need --checkpoint-dir DIR")
