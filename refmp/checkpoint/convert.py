"""``refmp convert``: a sharded checkpoint (refmp.checkpoint.sharded) to one GPT-2-named
safetensors file or a Hugging Face directory (the ``--save`` formats) and back, weights to a
Hugging Face directory, and what a checkpoint holds (``--info``).

One process, no MPI: the checkpoint's files are read through their manifest, each tensor
assembled from the slices the files hold (refmp.checkpoint.format.assemble), as any layout's
reader does.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import asdict

import numpy as np

from refmp.checkpoint.format import (
    FORMAT,
    MANIFEST,
    assemble,
    file_error,
    find,
    model_config,
    publish,
    rank_file,
    read_manifest,
    step_name,
    write_json,
    write_rank_file,
)
from refmp.config import saves_directory
from refmp.errors import ConfigError
from refmp.nn.params import param_shapes


def to_gpt2(path: str, out: str) -> str:
    """Write the checkpoint at (or latest in) ``path`` as --save writes a model: one
    GPT-2-named safetensors file, or for an ``out`` not ending in .safetensors a Hugging
    Face directory (refmp.config.saves_directory). Returns the checkpoint read."""
    from refmp.checkpoint.hf import save_hf
    from refmp.checkpoint.weights import save_model

    man, params = read_params(path)
    if saves_directory(out):
        save_hf(out, params, model_config(man), man.get("vocab"), flag="convert")
        return man["dir"]
    try:
        save_model(out, params, model_config(man), man.get("vocab"))
    except OSError as e:
        raise file_error("cannot write", out, e) from e
    return man["dir"]


def weights_to_hf(path: str, out: str, n_head: int | None = None) -> None:
    """Write the weights ``path`` (a GPT-2 file or a Hugging Face directory) as the Hugging
    Face directory ``out``, with the tokenizer they name or their directory holds."""
    from refmp.checkpoint.hf import save_hf
    from refmp.checkpoint.tokenizer import tokenizer_files
    from refmp.checkpoint.weights import read_model, read_shapes

    mcfg, params = read_model(path, n_head)
    vocab = read_shapes(path)[1].get("vocab")
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    save_hf(out, params, mcfg, None if vocab is None else json.loads(vocab),
            folder if tokenizer_files(folder) else None, flag="convert")


def read_params(path: str) -> tuple[dict, dict]:
    """(the manifest, the whole parameters by GPT-2 name) of the checkpoint at (or latest
    in) ``path``, saved by any layout."""
    ckpt = find(path)
    man = read_manifest(ckpt)
    shapes = man["tensors"]
    full, seen = assemble(ckpt, man, {k: (0, math.prod(s) - 1) for k, s in shapes.items()},
                          ["param"], set(man["files"]))
    for k, s in seen.items():
        if not s.all():
            raise ConfigError(f"checkpoint manifest {man['path']}: no file holds "
                              f"{int((~s).sum())} elements of {k}")
    return man, {k: v.reshape(shapes[k]) for k, v in full["param"].items()}


def from_gpt2(path: str, root: str, n_head: int | None = None, top_k: int | None = None) -> str:
    """A 1-rank checkpoint (weights only, step 0) in ``root`` from a GPT-2-named safetensors
    file or a Hugging Face directory: what --resume then reads into any layout, as --init
    would. ``n_head``, ``top_k``: the heads, and an MoE model's experts per token, of a file
    that does not say them (--n-head, --top-k)."""
    from refmp.checkpoint.weights import read_model, read_shapes

    mcfg, params = read_model(path, n_head, None if top_k is None else {"top_k": top_k})
    vocab = read_shapes(path)[1].get("vocab")  # the tokenizer the file names, if any
    final, tmp = os.path.join(root, step_name(0)), os.path.join(root, f".{step_name(0)}.tmp")
    try:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        flat = {k: np.ascontiguousarray(v).reshape(-1) for k, v in params.items()}
        entry = write_rank_file(os.path.join(tmp, rank_file(0)),
                                {k: (np.arange(v.size, dtype=np.int64), {"param": v})
                                 for k, v in flat.items()})
        dtype = str(next(iter(flat.values())).dtype)
        write_json(os.path.join(tmp, MANIFEST), {
            "format": FORMAT, "version": 1, "step": 0, "dtype": dtype,
            "layout": {"pp": 1, "dp": 1, "cp": 1, "tp": 1, "ep": 1, "world": 1, "zero": 0},
            "optimizer": {"kind": None, "t": 0, "moments": []}, "source": path,
            "model": asdict(mcfg), "config": None,
            "vocab": None if vocab is None else json.loads(vocab),
            "tensors": {k: list(s) for k, s in param_shapes(mcfg).items()},
            "files": {rank_file(0): {"rank": 0, "coords": {}, **entry}},
        })
        publish(tmp, final)
    except OSError as e:
        raise file_error("cannot write checkpoint", root, e) from e
    return final


def info(path: str) -> str:
    """What a checkpoint holds, for people: step, layout, model, optimizer, files, and for
    each tensor which rank's file holds which elements (count, first..last, runs)."""
    ckpt = find(path)
    man = read_manifest(ckpt)
    lay, opt, m = man["layout"], man["optimizer"], man["model"]
    n = sum(math.prod(s) for s in man["tensors"].values())
    lines = [f"checkpoint {ckpt}: step {man['step']}",
             "  saved by " + " x ".join(f"{a}={lay[a]}" for a in ("pp", "dp", "cp", "tp", "ep"))
             + f", ZeRO {lay['zero']} ({lay['world']} rank{'s' * (lay['world'] > 1)})",
             f"  model: {m['n_layer']} layers, {m['n_head']} heads, n_embd {m['n_embd']}, vocab "
             f"{m['vocab_size']}, block {m['block_size']}, experts {m['n_expert']}: {n:,} "
             f"parameters ({man['dtype']})",
             f"  optimizer: {opt['kind']}, step count {opt['t']}, moments "
             f"{', '.join(opt['moments']) or 'none'}"]
    if man.get("data"):
        d, lr = man["data"], man["lr"]
        lines.append(f"  data: {d['name']}, next window {d['next_window']} of {d['windows']} "
                     f"(epoch {d['epoch']}), shuffle {d['shuffle']}, seed {d['seed']}; next lr "
                     f"{lr['next']:.6g} ({lr['schedule']} over {lr['steps']} steps)")
    lines.append("  files:")
    for fname, f in sorted(man["files"].items()):
        at = " ".join(f"{a} {i}" for a, i in f["coords"].items())
        lines.append(f"    {fname}  {f['bytes']:>10,} B  sha256 {f['sha256'][:16]}  "
                     f"{len(f['pieces']):>3} pieces  {at}")
    lines.append("  who holds which slice (global flat indices: rank: count [first..last] runs):")
    for k, shape in man["tensors"].items():
        holders = [f"r{f['rank']}: {p['numel']} [{p['first']}..{p['last']}] {p['runs']}"
                   for f in sorted(man["files"].values(), key=lambda f: f["rank"])
                   if (p := f["pieces"].get(k))]
        lines.append(f"    {k:<28} {str(tuple(shape)):<10} " + "; ".join(holders))
    return "\n".join(lines)
