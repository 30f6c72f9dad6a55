"""Datasets and the layout-invariant batch order.

The batch order, the same for every layout (what parity with the serial run rests on): with
block size T and global batch B, step s uses windows w = (s*B + j) mod n_windows for rows
j = 0..B-1, n_windows = (len(tokens)-1)//T; window w is x = tokens[w*T : w*T+T],
y = tokens[w*T+1 : w*T+T+1]. Data-parallel rank r of dp takes rows [r*B/dp, (r+1)*B/dp). An
optional seeded shuffle permutes the window indices, the same on every rank. Nothing here
depends on the layout except which rows a rank asks for.

Sources: the built-in addition task (no download), a text file (bytes, vocabulary 256, or
tokenized by a Hugging Face tokenizer: :func:`tokenize_text`), a .npy 1-D integer array, or
a nanoGPT-style .bin of uint16 tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import numpy as np

from refmp.errors import ConfigError


@dataclass
class Dataset:
    """A token stream, its vocabulary size, and (optionally) a held-out task to score."""

    tokens: np.ndarray  # (n,) int64
    vocab_size: int
    name: str
    task: AdditionTask | None = field(default=None, repr=False)
    vocab: str | None = None  # the characters of the ids, or "bytes" (None: not text)
    tokenizer: str | None = None  # the directory of the Hugging Face tokenizer that made them

    def n_windows(self, T: int) -> int:
        return (len(self.tokens) - 1) // T


# --- batch order -------------------------------------------------------------------------------


def window_indices(step: int, B: int, n_windows: int, perm: np.ndarray | None = None) -> np.ndarray:
    """The B window indices of ``step``: (s*B + j) mod n_windows, through ``perm`` if given."""
    w = (step * B + np.arange(B)) % n_windows  # (B,)
    return w if perm is None else perm[w]


def shuffle_perm(n_windows: int, seed: int) -> np.ndarray:
    """A seeded permutation of window indices (identical on every rank)."""
    return np.random.default_rng([seed, 0x5EED]).permutation(n_windows)


def get_batch(tokens: np.ndarray, step: int, B: int, T: int, rows: slice = slice(None),
              perm: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """x, y (len(rows), T) for the given rows of step's global batch."""
    n = (len(tokens) - 1) // T
    w = window_indices(step, B, n, perm)[rows]  # (b,)
    offs = w[:, None] * T + np.arange(T)  # (b, T)
    return tokens[offs], tokens[offs + 1]


# --- the built-in task: integer addition ------------------------------------------------------


ADD_CHARS = "0123456789+=\n"


@dataclass
class AdditionTask:
    """Problems ``a+b=c`` with ``digits``-digit operands, written as characters.

    Operands are zero-padded to ``digits`` and the sum to ``digits + 1`` characters, so every
    problem has the same length ``3*digits + 4`` (e.g. ``123+456=0579\\n``). The sum is written
    most-significant digit first, the way people write it. A seeded split holds out
    ``n_test`` problems that never appear in training; :meth:`score` measures exact-match
    accuracy on them by greedy decoding.
    """

    BATCH = 500  # prompts :meth:`score` decodes at once

    digits: int = 3
    seed: int = 0
    n_train: int = 200_000
    n_test: int = 1000

    def __post_init__(self):
        n_pairs = 10 ** (2 * self.digits)
        rng = np.random.default_rng([self.seed, 0xADD])
        order = rng.permutation(n_pairs)  # pair p = a * 10^d + b
        n_test = min(self.n_test, n_pairs // 5)  # 1 digit has only 100 problems: hold out 20
        self.test_pairs = order[:n_test]
        pool = order[n_test:]
        self.train_pairs = pool[rng.integers(0, len(pool), self.n_train)]

    @property
    def line_len(self) -> int:
        return 3 * self.digits + 4

    def encode(self, pairs: np.ndarray) -> np.ndarray:
        """Token ids (n, line_len) of the problems ``pairs`` (a * 10^d + b)."""
        d = self.digits
        a, b = np.divmod(pairs, 10**d)
        c = a + b

        def digits_of(v, width):  # (n, width), most significant first
            return (v[:, None] // 10 ** np.arange(width - 1, -1, -1)) % 10

        n = len(pairs)
        plus, eq, nl = ADD_CHARS.index("+"), ADD_CHARS.index("="), ADD_CHARS.index("\n")
        return np.concatenate([
            digits_of(a, d), np.full((n, 1), plus), digits_of(b, d), np.full((n, 1), eq),
            digits_of(c, d + 1), np.full((n, 1), nl),
        ], axis=1).astype(np.int64)

    def dataset(self) -> Dataset:
        return Dataset(self.encode(self.train_pairs).reshape(-1), len(ADD_CHARS),
                       f"addition ({self.digits}-digit)", task=self, vocab=ADD_CHARS)

    def score(self, model, pairs: np.ndarray | None = None, batch: int = BATCH) -> tuple[int, int]:
        """(correct, total) exact-match answers by greedy decoding on held-out problems."""
        from refmp.runtime import backend

        pairs = self.test_pairs if pairs is None else pairs
        lines = self.encode(pairs)
        prompt_len = 2 * self.digits + 2  # "aaa+bbb="
        correct = 0
        for i in range(0, len(lines), batch):
            chunk = lines[i : i + batch]
            prompt = backend.from_host(chunk[:, :prompt_len])
            out = backend.to_host(model.generate(prompt, self.digits + 1))
            correct += int((out[:, prompt_len:] == chunk[:, prompt_len:-1]).all(axis=1).sum())
        return correct, len(lines)


# --- files ----------------------------------------------------------------------------------


def load_tokens(path: str, tokenizer: str | None = None) -> Dataset:
    """Read a token file: .npy (1-D ints), .bin (uint16, nanoGPT), anything else as bytes, or
    with ``tokenizer`` (a directory) as text that tokenizer encodes."""
    if not os.path.isfile(path):
        raise ConfigError(f"--data {path}: no such file")
    if tokenizer is not None:
        return _checked(tokenize_text(path, tokenizer), path)
    try:
        if path.endswith(".npy"):
            arr = np.load(path, allow_pickle=False)
            if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                raise ConfigError(
                    f"--data {path}: expected a 1-D integer token array, got {arr.ndim}-D {arr.dtype}"
                )
            if arr.size and arr.min() < 0:
                raise ConfigError(f"--data {path}: token ids must be >= 0 (found {arr.min()})")
            tokens = arr.astype(np.int64)
        elif path.endswith(".bin"):
            if os.path.getsize(path) % 2:
                raise ConfigError(f"--data {path}: a .bin token file holds uint16 values; "
                                  "its size must be even")
            tokens = np.fromfile(path, dtype=np.uint16).astype(np.int64)
        else:
            tokens = np.frombuffer(open(path, "rb").read(), dtype=np.uint8).astype(np.int64)
            return _checked(Dataset(tokens, 256, f"text {os.path.basename(path)}",
                                    vocab="bytes"), path)
    except ConfigError:
        raise
    except (OSError, ValueError) as e:
        raise ConfigError(f"--data {path}: cannot read it ({e})") from e
    vocab = int(tokens.max()) + 1 if tokens.size else 0
    return _checked(Dataset(tokens, vocab, os.path.basename(path)), path)


def _checked(ds: Dataset, path: str) -> Dataset:
    if len(ds.tokens) < 2:
        raise ConfigError(f"--data {path}: needs at least 2 tokens, found {len(ds.tokens)}")
    return ds


def tokenize_text(path: str, tokenizer: str) -> Dataset:
    """The UTF-8 text file ``path`` as the ids of the Hugging Face tokenizer in ``tokenizer``
    (nanoGPT's prepare step: the whole text in one call, so no token is cut at a chunk's edge).

    Cached beside the text: ``{path}.tokens.bin`` (the ids, uint16 as nanoGPT's .bin) and
    ``{path}.tokens.json`` (what they were made from: the text's sha256, the tokenizer's
    fingerprint, the token count). The cache is used when the text and the tokenizer are
    the ones it records, else made again; each file is written whole or not at all, so
    ranks that tokenize at once each leave the same complete files.
    """
    from refmp.checkpoint.tokenizer import TextTokenizer

    tok = TextTokenizer(tokenizer, "--tokenizer")
    if tok.vocab_size > 2**16:
        raise ConfigError(f"--tokenizer {tokenizer}: {tok.vocab_size} ids do not fit the uint16 "
                          f"tokens of a .bin cache; tokenize elsewhere and give a .npy --data")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"--data {path}: cannot read it ({e.strerror})") from e
    made_from = {"text_sha256": hashlib.sha256(raw).hexdigest(), "tokenizer": tok.fingerprint}
    cache = f"{path}.tokens.bin"
    record = f"{path}.tokens.json"
    tokens = _cached(cache, record, made_from)
    if tokens is None:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"--data {path}: not UTF-8 text ({e}); --tokenizer reads text") from e
        tokens = np.array(tok.encode(text), dtype=np.uint16)  # (n,)
        try:
            _write_whole(cache, tokens.tobytes())
            _write_whole(record, json.dumps({**made_from, "tokens": int(tokens.size)}).encode())
        except OSError as e:
            raise ConfigError(f"--data {path}: cannot write the token cache {cache} "
                              f"({e.strerror})") from e
    name = f"text {os.path.basename(path)} ({os.path.basename(os.path.abspath(tokenizer))})"
    return Dataset(tokens.astype(np.int64), tok.vocab_size, name, tokenizer=tokenizer)


def _cached(cache: str, record: str, made_from: dict) -> np.ndarray | None:
    """The cached ids (n,) uint16 if the record says they were made from ``made_from`` and
    the cache holds all of them; else None."""
    try:
        with open(record) as f:
            said = json.load(f)
        tokens = np.fromfile(cache, dtype=np.uint16)
    except (OSError, ValueError):
        return None
    if not isinstance(said, dict) or any(said.get(k) != v for k, v in made_from.items()) \
            or said.get("tokens") != tokens.size:
        return None
    return tokens


def _write_whole(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file renamed over it."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
