"""Sharded checkpoints: every rank writes what it owns; any layout reads back what it needs.

What is saved comes as a :class:`Checkpointed` record whose parts save and restore
themselves (torchtitan's ``Stateful``). A rank writes only the pieces it *counts*
(``counts_in_norm``: one rank per distinct copy of an element), so the files (the format:
refmp.checkpoint.format) are disjoint and together hold every element once.

The gradient codec's state (``codec``: PowerSGD's and top-k's error buffers, PowerSGD's Q's)
is each rank's own, of its own shards and share of the error: each rank writes its file, and
a run continues from it only on the same layout with the same codec (``codec_layout``;
elsewhere the codec starts afresh, and the resumed run says so). Delayed FP8 scaling's amax
history (``fp8``) is the same on every rank of a stage, so it is saved once, by block, and
read back by any layout (refmp.checkpoint.amax).

Resharding is reading the slices you need: a rank of any layout knows, from its own
``piece_index()``, the global flat indices of every element it holds. It reads the files
whose pieces of those parameters overlap them and copies the overlaps of the pieces' runs
with its own, run by run (refmp.checkpoint.pieces): no rank builds a whole tensor.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Protocol

import numpy as np

from refmp.checkpoint.amax import gathered_history, read_history, write_history
from refmp.checkpoint.format import (
    FORMAT,
    MANIFEST,
    check_model,
    codec_file,
    file_error,
    publish,
    rank_file,
    read_file,
    runs_of,
    step_name,
    write_json,
    write_rank_file,
    write_tensors,
)
from refmp.checkpoint.pieces import CheckpointSource
from refmp.config import TrainConfig
from refmp.distributed.faults import agreed
from refmp.distributed.grid import ProcessGrid
from refmp.errors import ConfigError
from refmp.nn.families import family_name, param_shapes
from refmp.nn.params import GPTConfig
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
    codec: Stateful | None = None  # the data-parallel sums' codec (Sharder.state)
    fp8: Stateful | None = None  # FP8's scales: delayed scaling's amax history (refmp.checkpoint.amax)


STATEFUL = ("powersgd", "topk")  # the codecs that keep arrays between steps
CODEC_LAYOUT = ("world", "pp", "dp", "cp", "tp", "ep", "schedule", "virtual_stages",
                "stage_layers", "grad_compress", "compress_rank", "compress_ratio",
                "no_error_feedback")  # what a rank's codec state depends on


def codec_layout(layout: dict, dtype: str) -> dict:
    """What a codec's state belongs to: the ranks, what each holds, the codec, the dtype."""
    folded = {"etp": layout["etp"]} if layout.get("etp") else {}  # the experts' grid (folding)
    return {**{k: layout[k] for k in CODEC_LAYOUT}, **folded, "dtype": dtype}


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
    pieces = {}  # name -> (runs of its global indices, which elements are real, its arrays)
    for k, index in run.piece_index().items():  # my elements' global flat indices
        real = index >= 0  # -1: padding (ZeRO's, or the vocabulary's with tp)
        if not run.counts_in_norm[k] or not real.any():
            continue  # another rank writes this copy, or it holds nothing
        arrays = {"param": run.params[k], **{m: a[k] for m, a in moments.items()}}
        pieces[k] = (runs_of(index[real]), None if real.all() else real, arrays)

    stateful = cfg.grad_compress in STATEFUL and parts.codec is not None
    codec = {k: backend.to_host(v) for k, v in parts.codec.state().items()} if stateful else {}
    history = gathered_history(parts)  # every block's amax history, or None

    def write():
        path = os.path.join(tmp, rank_file(world.rank))
        try:
            entry = write_rank_file(path, pieces, backend.to_host)  # a piece at a time
            if stateful:  # this rank's own codec state
                path = os.path.join(tmp, codec_file(world.rank))
                entry["codec"] = {"rank": world.rank, **write_tensors(path, codec)}
        except OSError as e:
            raise file_error("cannot write checkpoint file", path, e) from e
        return {"rank": world.rank, "coords": parts.grid.coords, **entry}

    files = world.allgather_obj(agreed(world, write))
    layout = {**cfg.as_dict(parts.grid.sizes), "world": world.size}
    codecs = {codec_file(f["rank"]): f.pop("codec") for f in files if "codec" in f}
    scale = {"loss_scale": parts.scaler.state()} if parts.scaler is not None else {}
    manifest = {
        "format": FORMAT, "version": 1, "step": step, "dtype": cfg.dtype,
        "layout": layout,
        "optimizer": {"kind": opt["kind"], "t": opt["t"], **scale, "moments": sorted(moments)},
        "data": progress["data"], "lr": progress["lr"],
        "rng": "none: after initialization a step draws no random numbers",
        "model": asdict(parts.model), "config": asdict(cfg), "vocab": parts.vocab,
        "tensors": {k: list(s) for k, s in param_shapes(parts.model).items()},
        "files": {rank_file(f["rank"]): f for f in files},
    }
    if family_name(parts.model) != "gpt2":  # absent: GPT-2 (refmp.nn.families)
        manifest["family"] = family_name(parts.model)
    if stateful:
        manifest["codec"] = {"layout": codec_layout(layout, cfg.dtype), "files": codecs}

    def finish():  # rank 0: the manifest last, then the rename that makes it a checkpoint
        if world.rank == 0:
            try:
                if history is not None:  # before the manifest, which lists it
                    manifest["fp8"] = write_history(tmp, history)
                write_json(os.path.join(tmp, MANIFEST), manifest)
                publish(tmp, final, keep)
            except OSError as e:
                raise file_error("cannot complete checkpoint", final, e) from e

    agreed(world, finish)
    return final


def load(parts: Checkpointed, path: str) -> dict:
    """Set ``parts`` (weights, optimizer state, loss scale, step) from the checkpoint at (or
    latest in) ``path``, whatever layout wrote it (collective over the world). Returns the
    manifest. Every check raises a ConfigError on every rank (faults.agreed), before any
    piece is read; then the pieces are read one at a time, each straight into the array it
    sets (a rank holds its state and one piece more)."""
    world, run = parts.grid.world, parts.runner
    index = run.piece_index()  # {piece: (n,) global flat index, -1 for padding}
    ours = parts.optimizer.state()["kind"]

    def check():
        src = CheckpointSource(path)
        man = src.man
        check_model(man, parts.model)
        kind = man["optimizer"]["kind"]
        if kind is not None and kind != ours:
            raise ConfigError(f"checkpoint manifest {man['path']}: its optimizer is {kind}, "
                              f"this run's is {ours} (--optimizer {kind})")
        for j, f in enumerate(sorted(man["files"])):  # every file checked by some rank
            if j % world.size == world.rank:
                src.verify(f)
        return src, man, read_codec(src.ckpt, man, parts), read_history(src.ckpt, man, parts)

    src, man, codec, history = agreed(world, check)
    for k, p in run.params.items():
        p[...] = backend.from_host(own_piece(src, man, "param", k, index[k]))
    saved = man["optimizer"]
    moments = {m: MomentPieces(src, man, m, index) for m in saved["moments"]}
    parts.optimizer.load_state({"t": saved["t"] if saved["kind"] else 0, "moments": moments})
    if parts.scaler is not None and "loss_scale" in saved:  # fp16's dynamic scale
        parts.scaler.load_state(saved["loss_scale"])
    run.after_step()  # the compute copy from the pieces; ZeRO 1/2: all-gather them
    parts.progress.load_state({"step": int(man["step"])})
    if parts.codec is not None:
        parts.codec.load_state({"step": int(man["step"]), "codec": codec})
    man["codec_restored"] = codec is not None  # (not in the file) for config_notes
    if history is not None:  # delayed FP8 scaling: the blocks this rank runs
        parts.fp8.load_state(history)
    man["fp8_restored"] = history is not None
    return man


def own_piece(src: CheckpointSource, man: dict, kind: str, k: str, i: np.ndarray) -> np.ndarray:
    """This rank's piece k of ``kind`` (the parameter, or an optimizer moment): the
    checkpoint's elements at global flat index ``i``, 0 at padding (-1)."""
    if (i >= 0).any():
        return src.read_elements(k, i, kind=kind)
    return np.zeros(i.size, man["dtype"])  # padding alone


class MomentPieces(Mapping):
    """One optimizer moment's pieces, read from the checkpoint as the optimizer takes each."""

    def __init__(self, src: CheckpointSource, man: dict, kind: str, index: dict):
        self.src = src
        self.man = man
        self.kind = kind
        self.index = index

    def __getitem__(self, k: str) -> np.ndarray:
        return own_piece(self.src, self.man, self.kind, k, self.index[k])

    def __iter__(self):
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)


def read_codec(ckpt: str, man: dict, parts: Checkpointed) -> dict | None:
    """This rank's codec state from ``ckpt``, where it was saved by the same layout and
    codec as this run's (else None: the codec starts afresh)."""
    cfg, world = parts.cfg, parts.grid.world
    ours = codec_layout({**cfg.as_dict(parts.grid.sizes), "world": world.size}, cfg.dtype)
    saved = man.get("codec")
    if cfg.grad_compress not in STATEFUL or parts.codec is None or not isinstance(saved, dict) \
            or saved.get("layout") != ours:
        return None
    name = codec_file(world.rank)
    entry = saved.get("files", {}).get(name)
    if not isinstance(entry, dict) or not {"bytes", "sha256"} <= entry.keys():
        raise ConfigError(f"checkpoint manifest {man['path']}: no entry for {name} (altered?)")
    return read_file(ckpt, name, entry)
