"""LlamaForCausalLM directories for the engine: read slice by slice (``--init DIR``, each rank
its share) and written tensor by tensor (``--save DIR``, ``refmp convert``), as GPT-2's are
(refmp.checkpoint.source, refmp.checkpoint.stream). refmp.checkpoint.hf_llama names the
tensors and reads the configuration; this module moves their slices.

Shapes: S a refmp parameter's global shape (a linear's (in, out)), R the rows of one read chunk.

A projection is stored (out, in) in the directory and (in, out) in refmp, so refmp's rows
[g0, g1) of it are the directory's columns [g0, g1), and refmp's column ranges (tp's column
split, a rank's key/value heads) are the directory's rows: a chunk of refmp rows is read as
``get_slice(key)[a:b, g0:g1]`` for each column range [a, b), transposed. The other tensors
(norms, the embedding, the head) are read as they are.
"""

from __future__ import annotations

import os

import numpy as np

from refmp.checkpoint.hf_llama import CONFIG, WEIGHTS, hf_config, hf_name, read_config
from refmp.checkpoint.source import INDEX, check_complete, chunk_rows
from refmp.errors import ConfigError
from refmp.nn.llama import LlamaConfig, param_shapes
from refmp.nn.slices import WHOLE, Index, cut, fill, ranges


class LlamaSource:
    """A LlamaForCausalLM directory as a Source (refmp.checkpoint.source), by refmp's names:
    ``cfg`` its configuration (config.json, refused where refmp computes another model);
    every tensor's name and shape checked against it when opened."""

    def __init__(self, folder: str, flag: str = "--init"):
        import json

        from safetensors import safe_open

        self.path = folder
        self.flag = flag
        self.cfg = read_config(folder, flag)
        self.metadata: dict[str, str] = {}
        files = [os.path.join(folder, WEIGHTS)]
        if not os.path.isfile(files[0]) and os.path.isfile(os.path.join(folder, INDEX)):
            try:
                with open(os.path.join(folder, INDEX)) as f:
                    names = sorted(set(json.load(f)["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ConfigError(f"{flag} {folder}: {INDEX} is not readable ({e!r})") from e
            files = [os.path.join(folder, n) for n in names]
        keys: dict[str, tuple[str, tuple[int, ...]]] = {}  # the directory's key -> file, shape
        for file in files:
            if not os.path.isfile(file):
                raise ConfigError(f"{flag} {folder}: no {os.path.basename(file)}")
            check_complete(file, flag)
            try:
                with safe_open(file, framework="numpy") as f:
                    keys.update({k: (file, tuple(f.get_slice(k).get_shape())) for k in f.keys()})
            except Exception as e:  # safetensors' own error types
                raise ConfigError(f"{flag} {file}: not a readable safetensors file ({e})") from e
        self.where: dict[str, tuple[str, str, bool]] = {}  # refmp name -> file, key, transposed
        self._shapes = param_shapes(self.cfg)
        for name, shape in self._shapes.items():
            key, transposed = hf_name(name)
            if key not in keys:
                raise ConfigError(f"{flag} {folder}: no {key} (its {CONFIG} describes a "
                                  f"{self.cfg.n_layer}-layer model)")
            have = keys[key][1][::-1] if transposed else keys[key][1]
            if have != shape:
                raise ConfigError(f"{flag} {folder}: {key} is {keys[key][1]}; {CONFIG} makes it "
                                  f"{shape[::-1] if transposed else shape}")
            self.where[name] = (keys[key][0], key, transposed)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def read(self, name: str, index: Index = WHOLE, dtype=None) -> np.ndarray:
        """The slice ``index`` of refmp's parameter ``name``, one chunk of rows at a time."""
        from safetensors import safe_open

        file, key, transposed = self.where[name]
        shape = self._shapes[name]
        with safe_open(file, framework="numpy") as f:
            sl = f.get_slice(key)

            def read_rows(g0: int, g1: int):  # refmp's rows [g0, g1), its columns cut
                if transposed:  # the directory's columns g0..g1 of each of refmp's column ranges
                    parts = [sl[a:b, g0:g1].T for a, b in ranges(shape, index, 1)]
                    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
                return cut(sl[g0:g1], shape, index)

            have = sl[0:0].dtype
            kind = have if dtype is None else np.dtype(dtype)
            size = max(have.itemsize, kind.itemsize)
            return fill(shape, index, kind, read_rows, chunk_rows(shape, index, size))


def save_llama_streamed(out: str, cfg: LlamaConfig, dtype, gather, tokenizer: str | None = None,
                        write: bool = True, flag: str = "--save") -> None:
    """``--save DIR`` for a Llama model: the LlamaForCausalLM directory ``out`` (config.json,
    model.safetensors, the ``tokenizer`` directory's files), its weights streamed tensor by
    tensor as refmp.checkpoint.stream.stream does (``gather(name)``: the whole parameter by
    refmp's name on the writing rank, called once per tensor on every rank, in the file's
    order; only the rank with ``write`` writes)."""
    import shutil

    from refmp.checkpoint.format import write_json
    from refmp.checkpoint.stream import dtype_name, stream
    from refmp.checkpoint.tokenizer import tokenizer_files

    ours = param_shapes(cfg)
    names = {hf_name(k)[0]: k for k in ours}  # the directory's key -> refmp's
    shapes = {key: (ours[k][::-1] if hf_name(k)[1] else ours[k]) for key, k in names.items()}

    def get(key: str):
        a = gather(names[key])
        return np.ascontiguousarray(a.T) if a is not None and hf_name(names[key])[1] else a

    if write:  # a directory that cannot be made fails the write in stream, after the gathers
        try:
            os.makedirs(out, exist_ok=True)
        except OSError:
            pass
    stream(os.path.join(out, WEIGHTS), shapes, dtype, get, {"format": "pt"}, write, flag)
    if not write:
        return
    try:
        write_json(os.path.join(out, CONFIG), hf_config(cfg, dtype_name(dtype)))
        for file in (tokenizer_files(tokenizer) or []) if tokenizer is not None else []:
            if os.path.abspath(os.path.dirname(file)) != os.path.abspath(out):
                shutil.copyfile(file, os.path.join(out, os.path.basename(file)))
    except OSError as e:
        raise ConfigError(f"{flag} {out}: cannot write it ({e.strerror or e})") from e
