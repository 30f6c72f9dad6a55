"""Model weights as safetensors, with GPT-2's parameter names.

``save_model`` writes the full model (host arrays, the model's dtype) plus metadata giving
the shape that the tensors alone do not say (n_head, and an MoE model's top_k, capacity
factor, loss weights). ``load_model`` reads refmp's files, GPT-2 state dicts saved as
safetensors, and Hugging Face directories (refmp.checkpoint.hf): a ``transformer.`` prefix is
stripped, the attention-mask buffers are ignored, and a ``lm_head.weight`` must be the tied
``wte.weight`` (refmp's head is tied). ``read_config`` says what configuration a file gives,
with the flags the user gave winning over its metadata, and notes where they differ.
Sharded checkpoints (one file per rank, any layout reads any other's) are refmp.checkpoint.sharded.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

from refmp.checkpoint.hf import read_hf_config
from refmp.errors import ConfigError
from refmp.nn.gpt import GPT, GPTConfig, param_shapes
from refmp.runtime import backend

MOE_META = ("top_k", "moe_every", "capacity_factor", "aux_loss_coef", "z_loss_coef")


def model_metadata(cfg: GPTConfig, vocab: str | None = None) -> dict[str, str]:
    """The metadata of refmp's model file: its format, n_head, the tokenizer ``vocab`` (the
    data's characters, or "bytes") if any, and an MoE model's settings the tensors do not say."""
    meta = {"format": "refmp", "n_head": str(cfg.n_head)}
    if vocab is not None:
        meta["vocab"] = json.dumps(vocab)
    if cfg.n_expert:
        meta.update({k: str(getattr(cfg, k)) for k in MOE_META})
    return meta


def save_model(path: str, params: dict, cfg: GPTConfig, vocab: str | None = None,
               flag: str = "--save") -> None:
    """Write full (unsharded) parameters, GPT-2 names, to ``path``, atomically, one tensor at
    a time (refmp.checkpoint.stream). ``vocab``: the data's tokenizer for ``refmp generate``
    (its characters, or "bytes"), if it has one."""
    from refmp.checkpoint.stream import stream

    shapes = {k: tuple(v.shape) for k, v in params.items()}
    dtypes = {k: v.dtype for k, v in params.items()}
    stream(path, shapes, dtypes, lambda k: backend.to_host(params[k]),
           model_metadata(cfg, vocab), flag=flag)


def save_order(mcfg: GPTConfig, dtype) -> list[str]:
    """The order in which save_streamed asks for the parameters (the file's: by name)."""
    from refmp.checkpoint.stream import order

    shapes = param_shapes(mcfg)
    return order(shapes, {k: dtype for k in shapes})


def save_streamed(out: str, mcfg: GPTConfig, dtype, gather, vocab: str | None = None,
                  tokenizer: str | None = None, write: bool = True, flag: str = "--save") -> None:
    """``--save FILE``, or ``--save DIR`` (a Hugging Face directory: refmp.config's
    saves_directory), tensor by tensor: ``gather(name)`` gives each whole parameter (a host
    array in ``dtype``) on the writing rank, and is called once per parameter in save_order
    on every rank that calls this with the same arguments, so a collective gather keeps the
    ranks in step; only the rank with ``write`` writes, holding one tensor at a time. A
    failure to write is raised after the last gather (refmp.checkpoint.stream.stream).
    ``tokenizer``: the directory whose tokenizer files a Hugging Face directory gets."""
    from refmp.checkpoint.hf import write_hf
    from refmp.checkpoint.stream import stream
    from refmp.config import saves_directory

    if saves_directory(out):
        write_hf(out, mcfg, dtype, gather, vocab, tokenizer, flag, write)
    else:
        stream(out, param_shapes(mcfg), dtype, gather, model_metadata(mcfg, vocab), write, flag)


def read_tensors(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(every tensor, whole, by GPT-2 name; metadata) of a safetensors file or a Hugging Face
    directory (refmp.checkpoint.source.FileSource: clear errors if unreadable, a
    ``lm_head.weight`` that is not ``wte.weight`` refused: refmp's logits are h wte^T)."""
    from refmp.checkpoint.source import FileSource, read_all

    src = FileSource(path)
    src.check_head()
    return read_all(src), src.metadata


def read_shapes(path: str) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """(shapes by GPT-2 name, metadata) from the files' headers alone (no tensor is read)."""
    from refmp.checkpoint.source import FileSource

    src = FileSource(path)
    return src.shapes(), src.metadata


def read_config(path: str, n_head: int | None = None,
                moe: dict | None = None) -> tuple[GPTConfig, list[str]]:
    """The GPTConfig a file gives, and notes to print once (on rank 0).

    ``path``: a safetensors file or a Hugging Face directory. Shapes come from the tensors:
    V, C from wte, T from wpe, L from the block names, E from a router, moe_every from which
    blocks have routers. Heads: what the file says (refmp's metadata, else the config.json in
    the directory or beside the file, refmp.checkpoint.hf.read_hf_config), else ``n_head``
    (--n-head); a flag that contradicts the file is refused, and a file that says nothing
    (a bare file from another implementation) is refused without the flag, since the
    tensors alone fit any head count that divides C. The other MoE settings: ``moe`` (the
    flags given, by field name) wins over the metadata; top_k, which changes what the model
    computes, is refused when neither says it; the training settings (capacity factor, the
    losses' weights) fall back to GPTConfig's defaults. The notes say where a flag overrides
    the metadata, and which of those settings the file does not record (a file from another
    implementation). A given moe_every must put the experts where the file's routers are.
    """
    shapes, meta = read_shapes(path)
    if "wte.weight" not in shapes or "wpe.weight" not in shapes:
        raise ConfigError(f"--init {path}: no wte.weight / wpe.weight; is this a GPT-2 model?")
    V, C = shapes["wte.weight"]
    T = shapes["wpe.weight"][0]
    n_layer = len({int(m.group(1)) for k in shapes if (m := re.match(r"h\.(\d+)\.", k))})
    heads = _heads(path, meta, {"vocab_size": V, "n_positions": T, "n_embd": C,
                                "n_layer": n_layer}, n_head)
    routers = sorted(int(m.group(1)) for k in shapes
                     if (m := re.fullmatch(r"h\.(\d+)\.mlp\.router\.weight", k)))
    given, notes, settings = dict(moe or {}), [], {}
    flag = {k: f"--{k.replace('_', '-')}" for k in MOE_META}
    if not routers:
        if given:
            notes.append(f"--init {path} is a dense model (no routers): "
                         f"{', '.join(flag[k] for k in given)} ignored")
    else:  # mixture of experts: E and moe_every from the routers, the rest as given or said
        settings = {"n_expert": shapes[f"h.{routers[0]}.mlp.router.weight"][1],
                    "moe_every": routers[1] - routers[0] if len(routers) > 1 else n_layer}
        unsaid = []
        for k in MOE_META:
            said = type(getattr(GPTConfig, k))(meta[k]) if k in meta else None
            if k in given:
                if said is not None and said != given[k] and k != "moe_every":
                    notes.append(f"{flag[k]} {given[k]} overrides {k} {said} in {path}")
                settings[k] = given[k]
            elif said is not None:
                settings[k] = said
            elif k != "moe_every":  # the tensors say moe_every
                unsaid.append(k)
        if "top_k" in unsaid:  # what the forward computes: never a default
            raise ConfigError(f"--init {path} does not say how many experts each token goes "
                              f"to (no refmp metadata: a file from another implementation); "
                              f"give --top-k K (refmp generate: --moe-top-k K)")
        if unsaid:  # the training settings (capacity, the losses' weights), noted
            notes.append(f"{path} does not record {', '.join(unsaid)}: using the defaults "
                         + ", ".join(f"{flag[k]} {getattr(GPTConfig, k)}" for k in unsaid))
    cfg = GPTConfig(V, T, n_layer, heads, C, **settings)
    cfg.check()
    if "moe_every" in given and routers:  # the tensors decide where the experts are
        blocks = [i for i in range(n_layer) if cfg.is_moe(i)]
        if blocks != routers:
            raise ConfigError(f"--moe-every {given['moe_every']} puts experts in blocks {blocks}, "
                              f"but {path} has routers in blocks {routers}")
    return cfg, notes


def _heads(path: str, meta: dict, sizes: dict, n_head: int | None) -> int:
    """The head count: what the file says (its metadata; a directory's config.json, or the
    one beside a file whose metadata does not say it), which a given ``n_head`` must equal;
    else ``n_head``; else refused, naming --n-head."""
    said = int(meta["n_head"]) if "n_head" in meta else None  # the head count the file says
    where = f"{path}'s metadata"  # and where it says it
    conf = read_hf_config(path, sizes) if os.path.isdir(path) or said is None else None
    if conf is not None:
        if said is not None and conf["n_head"] != said:
            raise ConfigError(f"--init {path}: its metadata says n_head {said}, {conf['path']} "
                              f"says {conf['n_head']}")
        said = conf["n_head"]
        where = conf["path"]
    if n_head is not None and said is not None and n_head != said:
        raise ConfigError(f"--n-head {n_head}, but {where} says n_head {said} (give no "
                          f"--n-head: the file says it)")
    if said is None and n_head is None:
        raise ConfigError(f"--init {path} does not say how many attention heads the model has "
                          f"(no refmp metadata, no config.json beside it: a file from another "
                          f"implementation); give --n-head N, or put the Hugging Face "
                          f"config.json that says it beside the file")
    return said if said is not None else n_head


def open_model(path: str, n_head: int | None = None, moe: dict | None = None):
    """(``read_config(path, n_head, moe)``'s GPTConfig, the file's Source: FileSource, read
    slice by slice), its names and shapes checked against that model's and its head tied."""
    from refmp.checkpoint.source import FileSource

    cfg, _ = read_config(path, n_head, moe)  # the caller prints the notes on one rank
    src = FileSource(path)
    shapes = src.shapes()
    expected = param_shapes(cfg)
    missing = sorted(set(expected) - set(shapes))
    extra = sorted(set(shapes) - set(expected))
    if missing or extra:
        raise ConfigError(f"--init {path}: names do not match a {cfg.n_layer}-layer GPT-2 "
                          f"(missing {missing[:4]}, unexpected {extra[:4]})")
    for k, shape in expected.items():
        if tuple(shapes[k]) != shape:
            raise ConfigError(f"--init {path}: {k} has shape {tuple(shapes[k])}, "
                              f"expected {shape}")
    src.check_head()
    return cfg, src


def read_model(path: str, n_head: int | None = None,
               moe: dict | None = None) -> tuple[GPTConfig, dict[str, np.ndarray]]:
    """``read_config(path, n_head, moe)``'s GPTConfig and the file's tensors, whole (host
    arrays, the file's dtype, GPT-2's order), checked as open_model checks them."""
    cfg, src = open_model(path, n_head, moe)
    return cfg, {k: src.read(k) for k in param_shapes(cfg)}


def load_model(path: str, n_head: int | None = None, dtype: str = "float32",
               moe: dict | None = None) -> GPT:
    """A GPT whose configuration is ``read_config(path, n_head, moe)``'s, with the file's weights."""
    cfg, src = open_model(path, n_head, moe)
    return GPT(cfg, {k: backend.from_host(src.read(k, dtype=dtype)) for k in param_shapes(cfg)})
