"""Hugging Face GPT-2 directories: ``config.json`` + ``model.safetensors`` (+ a tokenizer's
files), read and written.

Shapes: V vocabulary, T positions, L layers, C channels, NH heads.

A directory is what ``transformers.GPT2LMHeadModel.from_pretrained`` loads and
``save_pretrained`` writes: the tensors under GPT-2's names with a ``transformer.`` prefix
(Conv1D weights stored (in, out), as refmp keeps them: ``c_attn.weight`` (C, 3C)), no
``lm_head.weight`` (the head is tied to ``wte``: logits = h wte^T), and ``config.json`` saying
what the tensors do not (n_head) and the settings that change what the model computes.

Reading: a ``config.json`` in the ``--init`` directory, or beside an ``--init`` file, is read
for its head count; its sizes must be the tensors' (else it describes another model), and a
setting refmp's GPT-2 does not compute (another activation, LayerNorm epsilon, attention
scaling, an untied head) is refused rather than run as a different model. A key the file
leaves out means transformers' GPT2Config default, which is refmp's.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

from refmp.checkpoint.tokenizer import tokenizer_files
from refmp.errors import ConfigError

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
PREFIX = "transformer."  # GPT2LMHeadModel's name for its GPT2Model

# GPT2Config's settings that change the numbers, and the value refmp computes (which is
# also GPT2Config's default, what a config.json without the key means)
COMPUTES = {"layer_norm_epsilon": 1e-5, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "tie_word_embeddings": True,
            "add_cross_attention": False}
GELU = ("gelu_new", "gelu_pytorch_tanh")  # GELU's tanh form (refmp.nn.layers.gelu_forward)


def config_path(path: str) -> str | None:
    """The ``config.json`` in the directory ``path``, or beside the file ``path``, if any."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    file = os.path.join(folder, CONFIG)
    return file if os.path.isfile(file) else None


def read_hf_config(path: str, sizes: dict, flag: str = "--init") -> dict | None:
    """The ``config.json`` of ``path`` (see config_path), checked against ``sizes`` (what the
    tensors say: vocab_size, n_positions, n_embd, n_layer) and refmp's GPT-2; None if none.
    """
    file = config_path(path)
    if file is None:
        return None
    try:
        with open(file) as f:
            conf = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{flag} {path}: {file} is not readable JSON ({e})") from e
    if not isinstance(conf, dict):
        raise ConfigError(f"{flag} {path}: {file} is not a JSON object")
    if conf.get("model_type", "gpt2") != "gpt2":
        raise ConfigError(f"{flag} {path}: {file} describes a {conf['model_type']!r} model; "
                          f"refmp reads GPT-2 (model_type gpt2)")
    differ = [f"{k} {conf[k]} (the tensors: {v})" for k, v in sizes.items()
              if k in conf and conf[k] != v]
    if differ:
        raise ConfigError(f"{flag} {path}: {file} says {', '.join(differ)}: it describes "
                          f"another model")
    act = conf.get("activation_function", "gelu_new")
    if act not in GELU:
        raise ConfigError(f"{flag} {path}: {file} has activation_function {act!r}; refmp's "
                          f"GPT-2 computes GELU's tanh form ({' or '.join(GELU)})")
    inner = conf.get("n_inner")
    if inner is not None and inner != 4 * sizes["n_embd"]:
        raise ConfigError(f"{flag} {path}: {file} has n_inner {inner}; refmp's MLP is 4 x "
                          f"n_embd = {4 * sizes['n_embd']} wide")
    for k, want in COMPUTES.items():
        if conf.get(k, want) != want:
            raise ConfigError(f"{flag} {path}: {file} has {k} {conf[k]!r}; refmp's GPT-2 "
                              f"computes {k} {want!r}")
    if not isinstance(conf.get("n_head"), int) or conf["n_head"] < 1:
        raise ConfigError(f"{flag} {path}: {file} has no n_head (a positive integer)")
    conf["path"] = file  # where it was read from (not in the file)
    return conf


def hf_config(mcfg, dtype: str) -> dict:
    """The ``config.json`` of a GPT2LMHeadModel with ``mcfg``'s shape: refmp's settings said
    (no dropout: refmp trains without it; no token ids it does not know)."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": mcfg.vocab_size, "n_positions": mcfg.block_size,
            "n_embd": mcfg.n_embd, "n_layer": mcfg.n_layer, "n_head": mcfg.n_head,
            "n_inner": None, "activation_function": "gelu_new", **COMPUTES,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "bos_token_id": None, "eos_token_id": None, "dtype": dtype}


def save_hf(out: str, params: dict, mcfg, vocab: str | None = None,
            tokenizer: str | None = None, flag: str = "--save") -> None:
    """Write ``params`` (full, GPT-2 names, host arrays) as the Hugging Face directory
    ``out`` (write_hf)."""
    dtype = next(iter(params.values())).dtype
    write_hf(out, mcfg, dtype, lambda k: params[k], vocab, tokenizer, flag)


def write_hf(out: str, mcfg, dtype, get, vocab: str | None = None,
             tokenizer: str | None = None, flag: str = "--save", write: bool = True) -> None:
    """Write the model ``mcfg`` as the Hugging Face directory ``out``, tensor by tensor
    from ``get(name)`` (a whole host array, called once per parameter in the file's order:
    refmp.checkpoint.stream.stream, whose ``write`` is this one's): ``model.safetensors``
    (tied head: no lm_head.weight; refmp's ``vocab`` in its metadata, for ``refmp
    generate``), ``config.json``, and the tokenizer's files copied from the directory
    ``tokenizer``. Each file is written whole or not at all."""
    from refmp.checkpoint.format import write_json
    from refmp.checkpoint.stream import stream
    from refmp.nn.params import param_shapes

    if mcfg.n_expert:
        raise ConfigError(f"{flag} {out}: a mixture-of-experts model has no Hugging Face GPT-2 "
                          f"form (GPT2LMHeadModel has no experts); save a .safetensors file")
    shapes = {PREFIX + k: s for k, s in param_shapes(mcfg).items()}
    meta = {"format": "pt"}  # what from_pretrained requires of a safetensors file
    if vocab is not None:
        meta["vocab"] = json.dumps(vocab)
    if write:  # a directory that cannot be made fails the write in stream, after the gathers
        try:
            os.makedirs(out, exist_ok=True)
        except OSError:
            pass
    try:
        stream(os.path.join(out, WEIGHTS), shapes, dtype, lambda k: get(k[len(PREFIX):]),
               meta, write, flag)
        if not write:
            return
        write_json(os.path.join(out, CONFIG), hf_config(mcfg, str(np.dtype(dtype))))
        for name in (tokenizer_files(tokenizer) or []) if tokenizer is not None else []:
            if os.path.abspath(os.path.dirname(name)) != os.path.abspath(out):
                shutil.copyfile(name, os.path.join(out, os.path.basename(name)))
    except OSError as e:
        raise ConfigError(f"{flag} {out}: cannot write it ({e.strerror or e})") from e
