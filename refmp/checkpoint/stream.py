"""Writing a safetensors file tensor by tensor: the header from the shapes alone, then each
tensor as it is handed in, so the writer holds one tensor at a time, never the model.

Shapes: n the bytes of the header's JSON, padded with spaces to a multiple of 8.

The file is what safetensors' ``save_file`` writes for the same tensors, byte for byte:

    8 bytes     n, little-endian
    n bytes     JSON: {"__metadata__": {...}, name: {"dtype", "shape", "data_offsets"}, ...}
    the data    each tensor's bytes (C order, little-endian), in the header's order

The header's order is save_file's: by dtype, widest first (U64, I64, F64, F32, ..., BOOL),
then by name; ``order`` says it, and the tensors must come in it. save_file writes the
metadata's keys in no fixed order (a hash map's); StreamWriter writes them in the order
given, so the same model always makes the same bytes. The file appears under its name only
once every tensor is written (a temporary name, renamed), and its sha256 is computed as it
is written (the sharded checkpoint's manifest records it).
"""

from __future__ import annotations

import hashlib
import json
import math
import os

import numpy as np

from refmp.errors import ConfigError
from refmp.nn.slices import BLOCK_BYTES

# safetensors' dtype names, in its header order (widest first)
DTYPES = {"uint64": "U64", "int64": "I64", "float64": "F64", "float32": "F32", "uint32": "U32",
          "int32": "I32", "bfloat16": "BF16", "float16": "F16", "uint16": "U16", "int16": "I16",
          "int8": "I8", "uint8": "U8", "bool": "BOOL"}
RANK = {d: i for i, d in enumerate(DTYPES)}


def dtype_name(dtype) -> str:
    """The NumPy name of ``dtype`` that DTYPES knows (a ValueError for others)."""
    name = np.dtype(dtype).name
    if name not in DTYPES:
        raise ValueError(f"safetensors has no dtype for {name}")
    return name


def header(shapes: dict, dtypes: dict, metadata: dict | None = None) -> tuple[bytes, dict]:
    """(the file's first 8 + n bytes, {name: (start, end) of its data}) for tensors of these
    ``shapes`` and ``dtypes`` (by name), in the order save_file puts them (see ``order``)."""
    spans, at = {}, 0
    entries = {} if metadata is None else {"__metadata__": dict(metadata)}
    for k in order(shapes, dtypes):
        d = dtype_name(dtypes[k])
        end = at + math.prod(shapes[k]) * np.dtype(d).itemsize
        entries[k] = {"dtype": DTYPES[d], "shape": list(shapes[k]), "data_offsets": [at, end]}
        spans[k] = (at, end)
        at = end
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, spans


def order(shapes: dict, dtypes: dict) -> list[str]:
    """The tensors' order in the file: by dtype, widest first, then by name."""
    return sorted(shapes, key=lambda k: (RANK[dtype_name(dtypes[k])], k.encode()))


class StreamWriter:
    """``with StreamWriter(path, shapes, dtype, metadata) as w: w.write(name, array)`` for
    each name of ``w.order``, in that order: ``path`` appears, complete, when the block ends.

    ``dtype``: one dtype for every tensor, or {name: dtype}. Every tensor must be written
    once, in order, with its shape and dtype (a ValueError names what is wrong); a block
    left by an exception, or before every tensor was written, leaves no file behind.
    ``bytes`` and ``sha256`` describe the file once it is complete."""

    def __init__(self, path: str, shapes: dict, dtype, metadata: dict | None = None):
        dtypes = dtype if isinstance(dtype, dict) else {k: dtype for k in shapes}
        self.shapes = {k: tuple(int(n) for n in s) for k, s in shapes.items()}
        self.dtypes = {k: np.dtype(dtype_name(dtypes[k])) for k in self.shapes}
        self.order = order(self.shapes, self.dtypes)
        head, _ = header(self.shapes, self.dtypes, metadata)
        self.path = path
        self.tmp = f"{path}.tmp{os.getpid()}"
        self.done = 0  # tensors written
        self.f = open(self.tmp, "wb")  # noqa: SIM115 (closed by close or abort)
        self.hash = hashlib.sha256()
        self.bytes = 0
        self.sha256 = None
        self._put(head)

    def _put(self, data) -> None:
        self.f.write(data)
        self.hash.update(data)
        self.bytes += len(data)

    def write(self, name: str, array) -> None:
        """Append ``array``, the tensor ``name`` (the next one of ``order``)."""
        if self.done == len(self.order):
            raise ValueError(f"{self.path}: {name} written after every tensor of the header")
        want = self.order[self.done]
        if name != want:
            raise ValueError(f"{self.path}: {name} handed in where the header has {want} next")
        array = np.asarray(array)
        if tuple(array.shape) != self.shapes[name] or array.dtype != self.dtypes[name]:
            raise ValueError(f"{self.path}: {name} is {array.dtype} {tuple(array.shape)}, the "
                             f"header says {self.dtypes[name]} {self.shapes[name]}")
        step = max(1, BLOCK_BYTES // max(1, array[:1].nbytes)) if array.ndim else 1
        for g in range(0, max(1, len(array)) if array.ndim else 1, step):
            part = array[g:g + step] if array.ndim else array
            # a view when contiguous; else a copy of one bounded chunk of rows
            self._put(np.ascontiguousarray(part).reshape(-1).view(np.uint8).data)
        self.done += 1

    def close(self) -> None:
        """Finish: every tensor written, the file renamed to its name (else a ValueError)."""
        if self.done != len(self.order):
            self.abort()
            raise ValueError(f"{self.path}: {len(self.order) - self.done} tensors never written "
                             f"(the next was {self.order[self.done]})")
        self.f.close()
        os.replace(self.tmp, self.path)  # never a half-written file under the real name
        self.sha256 = self.hash.hexdigest()

    def abort(self) -> None:
        """Drop the temporary file."""
        self.f.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


def stream(path: str, shapes: dict, dtype, get, metadata: dict | None = None,
           write: bool = True, flag: str = "--save") -> StreamWriter | None:
    """Write the file ``path`` of tensors of ``shapes`` from ``get(name)``, called once per
    tensor in the file's order (``order``), so that only one is held at a time.

    Every rank of a collective gather calls this with the same shapes: ``get`` is called for
    every tensor, in the same order, on each of them, and only the rank with ``write`` writes.
    A failure to write (the disk, a tensor of the wrong shape) does not stop the calls to
    ``get`` (the other ranks' gathers would wait for this one); it is raised after the last,
    an OSError as a ConfigError naming ``flag`` and the path. Returns the finished writer
    (its bytes and sha256), or None where nothing was written."""
    dtypes = dtype if isinstance(dtype, dict) else {k: dtype for k in shapes}
    w, error = None, None
    try:
        w = StreamWriter(path, shapes, dtypes, metadata) if write else None
    except OSError as e:
        error = e
    for k in order(shapes, dtypes):
        array = get(k)
        if w is not None and error is None:
            try:
                w.write(k, array)
            except (OSError, ValueError) as e:
                error = e
                w.abort()
        del array
    try:
        if w is not None and error is None:
            w.close()
    except OSError as e:
        error = e
    if isinstance(error, OSError):
        raise ConfigError(f"{flag} {path}: cannot write it ({error.strerror or error})") from error
    if error is not None:
        raise error
    return w
