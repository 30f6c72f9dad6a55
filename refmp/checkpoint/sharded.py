"""Sharded checkpoints: every rank writes what it owns; any layout reads back what it needs.

What is saved comes as a :class:`Checkpointed` record whose parts save and restore
themselves (torchtitan's ``Stateful``). A rank writes only the pieces it *counts*
(``counts_in_norm``: one rank per distinct copy of an element), so the files (the format:
refmp.checkpoint.format) are disjoint and together hold every element once.

Resharding is reading the slices you need: a rank of any layout knows, from its own
``piece_index()``, the global flat indices of every element it holds. It reads the files
whose pieces of those parameters overlap them, scatters each piece into the full flat tensor
through its runs, and takes its own elements out through its index. Small models only: a
rank builds the full tensors of the parameters it holds (docs/checkpoints.md has the sizes).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass
from typing import Protocol

import numpy as np

from refmp.checkpoint.format import (
    FORMAT,
    MANIFEST,
    assemble,
    check_model,
    file_error,
    find,
    publish,
    rank_file,
    read_manifest,
    step_name,
    write_json,
    write_rank_file,
)
from refmp.config import TrainConfig
from refmp.distributed.faults import agreed
from refmp.distributed.grid import ProcessGrid
from refmp.errors import ConfigError
from refmp.nn.params import GPTConfig, param_shapes
from refmp.runtime import backend


class Stateful(Protocol):
    """A part of the training state that saves and restores itself."""

    def state(self) -> dict: ...  # what later steps depend on (arrays may be the live ones)

    def load_state(self, state: dict) -> None: ...  # set it back, from host arrays


class Pieces(Protocol):
    """The arrays a rank owns, by piece name, and where their elements sit in the full model."""

    params: dict  # {piece: array} the values this rank updates
    counts_in_norm: dict[str, bool]  # {piece: is this rank the one copy that counts}

    def piece_index(self) -> dict: ...  # {piece: (n,) global flat index, -1 for padding}

    def after_step(self) -> None: ...  # after the pieces changed (ZeRO 1/2: all-gather)


@dataclass
class Checkpointed:
    """One run's checkpointed parts, and the settings its manifest records beside them.

    ``optimizer.state()``: {"kind", "t", "moments": {moment: {piece: array}}}; ``scaler``:
    fp16's loss scaler, or None; ``progress.state()``: {"step", "data", "lr"}."""

    grid: ProcessGrid
    cfg: TrainConfig
    model: GPTConfig
    runner: Pieces
    optimizer: Stateful
    scaler: Stateful | None
    progress: Stateful
    vocab: str | None = None  # the tokenizer (refmp.training.datasets.Dataset.vocab)


def save(parts: Checkpointed, root: str, keep: int = 0) -> str:
    """Write ``parts`` after ``progress``'s step N as ``root/step-{N:08d}`` (collective over
    the world). Returns that directory."""
    world, run, cfg = parts.grid.world, parts.runner, parts.cfg
    progress, opt = parts.progress.state(), parts.optimizer.state()
    step, moments = progress["step"], opt["moments"]
    final = os.path.join(root, step_name(step))
    tmp = os.path.join(root, f".{step_name(step)}.tmp")

    def prepare():  # rank 0 makes an empty temporary directory; the others wait (agreed)
        if world.rank == 0:
            try:
                os.makedirs(root, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)  # left by a run that died while saving
                os.makedirs(tmp)
            except OSError as e:
                raise file_error("--checkpoint-dir", root, e) from e

    agreed(world, prepare)
    pieces = {}
    for k, index in run.piece_index().items():  # my elements' global flat indices
        real = index >= 0  # -1: padding (ZeRO's, or the vocabulary's with tp)
        if not run.counts_in_norm[k] or not real.any():
            continue  # another rank writes this copy, or it holds nothing
        host = {"param": backend.to_host(run.params[k])}
        host.update({m: backend.to_host(a[k]) for m, a in moments.items()})
        pieces[k] = (index[real], {m: np.asarray(v)[real] for m, v in host.items()})

    def write():
        path = os.path.join(tmp, rank_file(world.rank))
        try:
            entry = write_rank_file(path, pieces)
        except OSError as e:
            raise file_error("cannot write checkpoint file", path, e) from e
        return {"rank": world.rank, "coords": parts.grid.coords, **entry}

    files = world.allgather_obj(agreed(world, write))
    scale = {"loss_scale": parts.scaler.state()} if parts.scaler is not None else {}
    manifest = {
        "format": FORMAT, "version": 1, "step": step, "dtype": cfg.dtype,
        "layout": {**cfg.layout(parts.grid.sizes), "world": world.size},
        "optimizer": {"kind": opt["kind"], "t": opt["t"], **scale, "moments": sorted(moments)},
        "data": progress["data"], "lr": progress["lr"],
        "rng": "none: after initialization a step draws no random numbers",
        "model": asdict(parts.model), "config": asdict(cfg), "vocab": parts.vocab,
        "tensors": {k: list(s) for k, s in param_shapes(parts.model).items()},
        "files": {rank_file(f["rank"]): f for f in files},
    }

    def finish():  # rank 0: the manifest last, then the rename that makes it a checkpoint
        if world.rank == 0:
            try:
                write_json(os.path.join(tmp, MANIFEST), manifest)
                publish(tmp, final, keep)
            except OSError as e:
                raise file_error("cannot complete checkpoint", final, e) from e

    agreed(world, finish)
    return final


def load(parts: Checkpointed, path: str) -> dict:
    """Set ``parts`` (weights, optimizer state, loss scale, step) from the checkpoint at (or
    latest in) ``path``, whatever layout wrote it (collective over the world). Returns the
    manifest. Every check raises a ConfigError on every rank (faults.agreed)."""
    world, run = parts.grid.world, parts.runner
    index = run.piece_index()  # {piece: (n,) global flat index, -1 for padding}
    ours = parts.optimizer.state()["kind"]

    def read():
        ckpt = find(path)
        man = read_manifest(ckpt)
        check_model(man, parts.model)
        kind = man["optimizer"]["kind"]
        if kind is not None and kind != ours:
            raise ConfigError(f"checkpoint manifest {man['path']}: its optimizer is {kind}, "
                              f"this run's is {ours} (--optimizer {kind})")
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

    def own_piece(kind: str, k: str) -> np.ndarray:
        """This rank's piece k of ``kind``: its elements of the full tensor, 0 at padding."""
        i = index[k]
        out = np.zeros(i.size, man["dtype"])
        if k in full[kind]:
            out[i >= 0] = full[kind][k][i[i >= 0]]
        return out

    for k, p in run.params.items():
        p[...] = backend.from_host(own_piece("param", k))
    saved = man["optimizer"]
    parts.optimizer.load_state({
        "t": saved["t"] if saved["kind"] else 0,
        "moments": {m: {k: own_piece(m, k) for k in run.params} for m in kinds[1:]}})
    if parts.scaler is not None and "loss_scale" in saved:  # fp16's dynamic scale
        parts.scaler.load_state(saved["loss_scale"])
    run.after_step()  # the compute copy from the pieces; ZeRO 1/2: all-gather them
    parts.progress.load_state({"step": int(man["step"])})
    return man
