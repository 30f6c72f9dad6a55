"""Where a rank's weights come from, read one slice at a time: a Source.

Shapes: S a tensor's global shape, R the rows of one read chunk (about 1 MiB of the slice's
rows: refmp.nn.slices.BLOCK_BYTES).

Every source answers the same two questions, by GPT-2 name: ``shapes()`` (every tensor's
global shape, from headers alone) and ``read(name, index, dtype)`` (the slice ``index``, a
refmp.nn.slices.Index, as a host array: rows, tp's columns and q|k|v heads, the padded
vocabulary, ZeRO's flat range). A read allocates the slice and one chunk of it at a time:

    InitSource        a fresh model: refmp.nn.params.init_slice (seed, name, element)
    FileSource        a GPT-2-named safetensors file, or a Hugging Face directory (one
                      model.safetensors, or several behind model.safetensors.index.json):
                      safetensors' get_slice reads a chunk's rows and columns, nothing else
    CheckpointSource  a sharded checkpoint of any layout (refmp.checkpoint.pieces): the
                      pieces the manifest says overlap the slice, run by run
    ArraySource       whole arrays already in memory (a model in a test, a tutorial)

``open_source`` picks the file kinds from a path.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Protocol

import numpy as np

from refmp.checkpoint.hf import CONFIG, WEIGHTS
from refmp.errors import ConfigError
from refmp.nn.params import GPTConfig, init_slice
from refmp.nn.slices import BLOCK_BYTES, WHOLE, Index, cut, cut_shape, fill, ranges, slice_shape, take

INDEX = WEIGHTS + ".index.json"  # a Hugging Face model in several files


class Source(Protocol):
    """Tensors by GPT-2 name, each read one slice at a time."""

    def shapes(self) -> dict[str, tuple[int, ...]]: ...  # global shapes, in the file's order

    def read(self, name: str, index: Index = WHOLE, dtype=None) -> np.ndarray: ...


def read_all(source: Source, dtype=None) -> dict[str, np.ndarray]:
    """Every tensor of ``source``, whole (the one-rank case: a serial model, a small file)."""
    return {k: source.read(k, WHOLE, dtype) for k in source.shapes()}


class ArraySource:
    """Whole host arrays by name: the slices are refmp.nn.slices.take's."""

    def __init__(self, arrays: dict):
        self.arrays = arrays

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.arrays.items()}

    def read(self, name: str, index: Index = WHOLE, dtype=None) -> np.ndarray:
        out = take(self.arrays[name], index)
        return out if dtype is None else out.astype(dtype, copy=False)


class InitSource:
    """A fresh model of ``cfg`` from ``seed``: refmp.nn.params.init_slice."""

    def __init__(self, cfg: GPTConfig, seed: int):
        from refmp.nn.families import param_shapes  # GPT-2's or a Llama model's

        self.cfg = cfg
        self.seed = seed
        self._shapes = param_shapes(cfg)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def read(self, name: str, index: Index = WHOLE, dtype=None) -> np.ndarray:
        return init_slice(name, self._shapes[name], self.cfg, self.seed, index,
                          "float64" if dtype is None else dtype)


class ZeroSource(InitSource):
    """Zeros in ``cfg``'s shapes: the weights of a run about to resume, which the checkpoint
    sets piece by piece (refmp.checkpoint.sharded.load), so nothing is drawn for them."""

    def read(self, name: str, index: Index = WHOLE, dtype=None) -> np.ndarray:
        return np.zeros(slice_shape(self._shapes[name], index), "float64" if dtype is None else dtype)


def gpt2_name(key: str) -> str | None:
    """A file's tensor name as refmp's parameter name; None for what is not a parameter."""
    key = key.removeprefix("transformer.")
    if key == "lm_head.weight" or re.fullmatch(r"h\.\d+\.attn\.(masked_)?bias", key):
        return None  # tied head, causal-mask buffers: not parameters
    return key


def check_complete(path: str, flag: str = "--init") -> None:
    """Refuse a truncated safetensors file (an interrupted copy or download), naming it.

    The format: an 8-byte little-endian header length n, n bytes of JSON giving each
    tensor's ``data_offsets`` [begin, end) in the data that follows; so the file must hold
    8 + n + the largest end bytes. Other damage is left to safetensors' own message.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little")
        if len(head) < 8 or 8 + n > size:
            raise ConfigError(f"{flag} {path}: truncated, or not a safetensors file ({size:,} "
                              f"bytes, too short for the header it starts with)")
        try:
            header = json.loads(f.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items()
                       if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, AttributeError):
            return  # not a header we can read: safetensors says what is wrong
    if 8 + n + end > size:
        raise ConfigError(f"{flag} {path}: truncated: the file has {size:,} bytes but its "
                          f"header describes {8 + n + end:,} (an interrupted copy or download?)")


def chunk_rows(shape: tuple[int, ...], index: Index, itemsize: int) -> int:
    """R: the rows of one read chunk of the slice ``index`` (about BLOCK_BYTES, at least 1)."""
    return max(1, BLOCK_BYTES // max(1, itemsize * math.prod(cut_shape(shape, index)[1:])))


class FileSource:
    """A GPT-2-named safetensors file, or a Hugging Face directory, read slice by slice.

    Names lose Hugging Face's ``transformer.`` prefix; the attention-mask buffers are not
    parameters; a ``lm_head.weight`` must equal ``wte.weight`` (refmp's head is tied),
    checked chunk by chunk by check_head. ``metadata``: the (first) file's safetensors
    metadata. Errors (missing, truncated, unreadable, an untied head) are ConfigErrors naming
    ``flag``."""

    def __init__(self, path: str, flag: str = "--init"):
        self.path = path
        self.flag = flag
        files = self._files(path)
        self.where: dict[str, tuple[str, str]] = {}  # GPT-2 name -> (file, key in it)
        self._shapes: dict[str, tuple[int, ...]] = {}
        self.metadata: dict[str, str] = {}
        self.head = None  # (file, key) of a lm_head.weight
        for i, file in enumerate(files):
            if not os.path.isfile(file):
                raise ConfigError(f"{flag} {file}: no such file" + (
                    f" (named by {INDEX})" if os.path.isdir(path) else ""))
            check_complete(file, flag)
            keys, meta = self._open(file, lambda f: ({k: tuple(f.get_slice(k).get_shape())
                                                      for k in f.keys()}, f.metadata() or {}))
            if i == 0:
                self.metadata = dict(meta)
            for k, s in keys.items():
                if k == "lm_head.weight":
                    self.head = (file, k)
                elif (n := gpt2_name(k)) is not None:
                    self.where[n] = (file, k)
                    self._shapes[n] = s

    def _files(self, path: str) -> list[str]:
        """The safetensors files of ``path``: itself, a directory's model.safetensors, or
        the files its model.safetensors.index.json names."""
        if not os.path.isdir(path):
            return [path]
        one, many = os.path.join(path, WEIGHTS), os.path.join(path, INDEX)
        if os.path.isfile(one):
            return [one]
        if not os.path.isfile(many):
            raise ConfigError(f"{self.flag} {path}: a directory without {WEIGHTS} or {INDEX} (a "
                              f"Hugging Face model directory holds {CONFIG} and its weights)")
        try:
            with open(many) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{self.flag} {many}: not a readable index of weight files "
                              f"({e!r})") from e
        return [os.path.join(path, n) for n in names]

    def _open(self, file: str, read):
        """``read(f)`` on the opened safetensors ``file``, its errors as ConfigErrors."""
        from safetensors import safe_open

        try:
            with safe_open(file, framework="numpy") as f:
                return read(f)
        except ConfigError:
            raise
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise ConfigError(f"{self.flag} {file}: not a readable safetensors file ({e})") from e

    def check_head(self) -> None:
        """Refuse a ``lm_head.weight`` that is not ``wte.weight``, compared chunk by chunk."""
        head = self.head
        if head is None:
            return
        wte = self.where.get("wte.weight")
        same = wte is not None and self._shape_of(*head) == self._shapes["wte.weight"]
        step = chunk_rows(self._shapes.get("wte.weight", (1, 1)), WHOLE, 8)
        for g in range(0, self._shapes["wte.weight"][0] if same else 0, step):
            rows = Index((((g, g + step),),))
            a = self._read(*head, self._shape_of(*head), rows, None)
            if not np.array_equal(a, self.read("wte.weight", rows)):
                same = False
                break
        if not same:
            raise ConfigError(f"{self.flag} {self.path}: its lm_head.weight is not wte.weight "
                              f"(an untied head); refmp's GPT-2 ties them")

    def _shape_of(self, file: str, key: str) -> tuple[int, ...]:
        return self._open(file, lambda f: tuple(f.get_slice(key).get_shape()))

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def read(self, name: str, index: Index = WHOLE, dtype=None) -> np.ndarray:
        if name not in self.where:
            raise ConfigError(f"{self.flag} {self.path}: no tensor {name}")
        return self._read(*self.where[name], self._shapes[name], index, dtype)

    def _read(self, file: str, key: str, shape, index: Index, dtype) -> np.ndarray:
        def read(f):
            sl = f.get_slice(key)

            def read_rows(g0: int, g1: int):
                if len(shape) == 2:  # the columns' ranges, each read alone
                    parts = [sl[g0:g1, a:b] for a, b in ranges(shape, index, 1)]
                    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
                return cut(sl[g0:g1], shape, index)

            have = sl[0:0].dtype  # the file's dtype, from an empty read
            kind = have if dtype is None else np.dtype(dtype)
            size = max(have.itemsize, kind.itemsize)
            return fill(shape, index, kind, read_rows, chunk_rows(shape, index, size))
        return self._open(file, read)


def open_source(path: str, flag: str = "--init"):
    """The Source of ``path``: a sharded checkpoint (a directory holding step-N directories
    or a manifest), else a safetensors file or Hugging Face directory."""
    from refmp.checkpoint.format import MANIFEST, complete_steps

    if os.path.isdir(path) and (os.path.isfile(os.path.join(path, MANIFEST))
                                or complete_steps(path)):
        from refmp.checkpoint.pieces import CheckpointSource

        return CheckpointSource(path)
    return FileSource(path, flag)
