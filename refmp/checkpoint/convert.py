"""``refmp convert``: a sharded checkpoint (refmp.checkpoint.sharded) to one GPT-2-named
safetensors file or a Hugging Face directory (the ``--save`` formats) and back, weights to a
Hugging Face directory, and what a checkpoint holds (``--info``).

One process, no MPI, one tensor at a time: each is read whole from the slices the files hold
(refmp.checkpoint.pieces, as any layout's reader does) or from the weights file
(refmp.checkpoint.source), written (refmp.checkpoint.stream), and let go. The peak is the
largest tensor plus one read chunk.
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
    file_error,
    find,
    model_config,
    publish,
    rank_file,
    read_manifest,
    step_name,
    write_json,
)
from refmp.config import saves_directory
from refmp.errors import ConfigError
from refmp.nn.families import is_llama, param_shapes


def to_gpt2(path: str, out: str) -> str:
    """Write the checkpoint at (or latest in) ``path`` as --save writes a model: one
    GPT-2-named safetensors file, or for an ``out`` not ending in .safetensors a Hugging
    Face directory (refmp.config.saves_directory), tensor by tensor: each read whole from
    the slices the files hold (refmp.checkpoint.pieces), written, and let go. Returns the
    checkpoint read."""
    from refmp.checkpoint.pieces import CheckpointSource

    src = CheckpointSource(path)
    save_source(out, src, model_config(src.man), src.dtype, src.man.get("vocab"))
    return src.ckpt


def save_source(out: str, src, mcfg, dtype, vocab=None, tokenizer: str | None = None,
                flag: str = "convert") -> None:
    """Write the model ``mcfg`` read from the Source ``src`` as ``out`` (a GPT-2 file, or a
    Hugging Face directory: refmp.config.saves_directory), one whole tensor at a time."""
    from refmp.checkpoint.weights import save_streamed

    if is_llama(mcfg):  # a LlamaForCausalLM directory (refmp.checkpoint.llama_files)
        from refmp.checkpoint.llama_files import save_llama_streamed

        if not saves_directory(out):
            raise ConfigError(f"{flag} {out}: a Llama model is written as a LlamaForCausalLM "
                              f"directory (a path not ending in .safetensors)")
        if mcfg.n_expert:
            raise ConfigError(f"{flag} {out}: a Mixtral-style model (n_expert) has no "
                              f"LlamaForCausalLM form (its experts are not a Llama MLP)")
        save_llama_streamed(out, mcfg, dtype, lambda k: src.read(k, dtype=dtype), tokenizer,
                            flag=flag)
        return
    save_streamed(out, mcfg, dtype, lambda k: src.read(k, dtype=dtype), vocab, tokenizer,
                  flag=flag)


def weights_to_hf(path: str, out: str, n_head: int | None = None) -> None:
    """Write the weights ``path`` (a GPT-2 file or a Hugging Face directory) as the Hugging
    Face directory ``out``, with the tokenizer they name or their directory holds."""
    from refmp.checkpoint.tokenizer import tokenizer_files
    from refmp.checkpoint.weights import open_model

    mcfg, src = open_model(path, n_head)
    vocab = src.metadata.get("vocab")
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    dtype = src.read("ln_f.weight").dtype  # the file's dtype
    save_source(out, src, mcfg, dtype, None if vocab is None else json.loads(vocab),
                folder if tokenizer_files(folder) else None)


def read_params(path: str) -> tuple[dict, dict]:
    """(the manifest, the whole parameters by GPT-2 name) of the checkpoint at (or latest
    in) ``path``, saved by any layout: the whole model, for one process that holds it."""
    from refmp.checkpoint.pieces import CheckpointSource
    from refmp.checkpoint.source import read_all

    src = CheckpointSource(path)
    for f in sorted(src.man["files"]):  # every file checked, as a whole read should
        src.verify(f)
    return src.man, read_all(src)


def from_gpt2(path: str, root: str, n_head: int | None = None, top_k: int | None = None) -> str:
    """A 1-rank checkpoint (weights only, step 0) in ``root`` from a GPT-2-named safetensors
    file or a Hugging Face directory: what --resume then reads into any layout, as --init
    would. ``n_head``, ``top_k``: the heads, and an MoE model's experts per token, of a file
    that does not say them (--n-head, --top-k). Written tensor by tensor: one whole tensor
    at a time is read and written."""
    from refmp.checkpoint.hf_llama import is_llama_dir
    from refmp.checkpoint.llama_files import LlamaSource
    from refmp.checkpoint.stream import StreamWriter
    from refmp.checkpoint.weights import open_model

    if is_llama_dir(path):  # a LlamaForCausalLM directory: its config.json says the shape
        src = LlamaSource(path, "convert")
        mcfg = src.cfg
    else:
        mcfg, src = open_model(path, n_head, None if top_k is None else {"top_k": top_k})
    vocab = src.metadata.get("vocab")  # the tokenizer the file names, if any
    final, tmp = os.path.join(root, step_name(0)), os.path.join(root, f".{step_name(0)}.tmp")
    shapes = param_shapes(mcfg)
    dtype = src.read("ln_f.weight").dtype  # the file's dtype
    try:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        sizes = {k: math.prod(s) for k, s in shapes.items()}  # one piece each: all of it
        with StreamWriter(os.path.join(tmp, rank_file(0)),
                          {**{f"{k}/runs": (1, 2) for k in shapes},
                           **{f"{k}/param": (n,) for k, n in sizes.items()}},
                          {**{f"{k}/runs": np.int64 for k in shapes},
                           **{f"{k}/param": dtype for k in shapes}}) as w:
            for t in w.order:
                k, kind = t.rsplit("/", 1)
                w.write(t, np.array([[0, sizes[k]]], np.int64) if kind == "runs"
                        else src.read(k).reshape(-1))
        pieces = {k: {"numel": n, "first": 0, "last": n - 1, "runs": 1} for k, n in sizes.items()}
        write_json(os.path.join(tmp, MANIFEST), {
            "format": FORMAT, "version": 1, "step": 0, "dtype": str(np.dtype(dtype)),
            "layout": {"pp": 1, "dp": 1, "cp": 1, "tp": 1, "ep": 1, "world": 1, "zero": 0},
            "optimizer": {"kind": None, "t": 0, "moments": []}, "source": path,
            "model": asdict(mcfg), "config": None,
            **({"family": "llama"} if is_llama(mcfg) else {}),
            "vocab": None if vocab is None else json.loads(vocab),
            "tensors": {k: list(s) for k, s in shapes.items()},
            "files": {rank_file(0): {"rank": 0, "coords": {}, "bytes": w.bytes,
                                     "sha256": w.sha256, "pieces": pieces}},
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
