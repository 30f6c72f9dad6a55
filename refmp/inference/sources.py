"""What ``refmp generate`` reads: the weights (a GPT-2-named safetensors file, a Hugging Face
model directory, or a sharded checkpoint of any layout), the tokenizer they were trained
with, and the prompts (token ids, text, or a request file for continuous batching).

Tokenizers (pick_tokenizer): a Hugging Face tokenizer (--tokenizer DIR, or the one in the
weights' directory: refmp.checkpoint.tokenizer), the characters ``refmp train --save``
records in the file's metadata (``vocab``: the built-in addition task's
``0123456789+=\\n``), or raw bytes (``"bytes"``: a text file trained on, or any model of
vocabulary 256 that names no tokenizer).
"""

from __future__ import annotations

import json
import os

import numpy as np

from refmp.errors import ConfigError


class Tokenizer:
    """Text <-> ids by a character list (id i is ``chars[i]``), or by raw bytes (None)."""

    def __init__(self, chars: str | None):
        self.chars = chars

    def encode(self, text: str) -> list[int]:
        if self.chars is None:
            return list(text.encode())
        bad = sorted({c for c in text if c not in self.chars})
        if bad:
            raise ConfigError(f"--prompt {text!r}: {', '.join(map(repr, bad))} not in the "
                              f"model's vocabulary {self.chars!r}")
        return [self.chars.index(c) for c in text]

    def decode(self, ids) -> str:
        if self.chars is None:
            return bytes(int(i) for i in ids).decode(errors="replace")
        return "".join(self.chars[int(i)] if int(i) < len(self.chars) else "?" for i in ids)


def weight_source(init: str | None, checkpoint: str | None, moe: dict | None = None,
                  n_head: int | None = None, tokenizer: str | None = None, text: bool = True):
    """(GPTConfig, the weights' Source (refmp.checkpoint.source: read slice by slice),
    tokenizer or None) from ``--init`` (a file or a Hugging Face directory, one
    model.safetensors or several) or ``--checkpoint`` (a sharded checkpoint of any layout).
    ``moe``: the MoE settings given (top_k, moe_every), winning over what the weights say;
    refused for a dense model. ``n_head``: the heads of an --init file that does not say
    them (--n-head). ``tokenizer``: --tokenizer DIR; ``text``: whether prompts may be text
    (see pick_tokenizer).
    """
    from refmp.checkpoint.weights import open_model

    if (init is None) == (checkpoint is None):
        raise ConfigError("give the weights: --init PATH or --checkpoint DIR (one of them)")
    moe = {k: v for k, v in (moe or {}).items() if v is not None}
    if checkpoint is not None and n_head is not None:
        raise ConfigError("--n-head is for an --init file; a checkpoint's manifest says it")
    if checkpoint is not None:
        from refmp.checkpoint.format import model_config
        from refmp.checkpoint.pieces import CheckpointSource

        src = CheckpointSource(checkpoint)
        mcfg = model_config(src.man)
        tok = pick_tokenizer(tokenizer, src.man.get("vocab"), None, mcfg.vocab_size, text)
        return with_moe(mcfg, moe, checkpoint), src, tok
    mcfg, src = open_model(init, n_head, {k: v for k, v in moe.items() if k == "top_k"})
    mcfg = with_moe(mcfg, moe, init)
    vocab = json.loads(src.metadata["vocab"]) if "vocab" in src.metadata else None
    folder = init if os.path.isdir(init) else os.path.dirname(os.path.abspath(init))
    return mcfg, src, pick_tokenizer(tokenizer, vocab, folder, mcfg.vocab_size, text)


def pick_tokenizer(given: str | None, vocab: str | None, folder: str | None, V: int,
                   text: bool):
    """The tokenizer, first found of: --tokenizer DIR (``given``); the one refmp recorded
    with the weights (``vocab``: the addition task's characters, or "bytes"); the Hugging
    Face tokenizer in the weights' directory (``folder``: tokenizer.json, or vocab.json and
    merges.txt); raw bytes for a vocabulary of 256; else None (ids only).

    A directory's tokenizer needs the tokenizers library: without it, refused when prompts
    may be ``text``, else None (ids in, ids out)."""
    from refmp.checkpoint.tokenizer import TextTokenizer, have_library, tokenizer_files

    if given is not None:
        return TextTokenizer(given, "--tokenizer")
    if vocab is not None:
        return Tokenizer(None if vocab == "bytes" else vocab)
    if folder is not None and tokenizer_files(folder) is not None:
        if text or have_library():
            return TextTokenizer(folder, "the weights' tokenizer in")
        return None
    return Tokenizer(None) if V == 256 else None


def with_moe(mcfg, moe: dict, path: str):
    """``mcfg`` with the MoE flags given (--moe-top-k, --moe-every), checked against the
    experts the weights hold."""
    import dataclasses

    if not moe:
        return mcfg
    if not mcfg.n_expert:
        flags = ", ".join(f"--{k.replace('_', '-').replace('top-k', 'moe-top-k')}" for k in moe)
        raise ConfigError(f"{path} is a dense model (no experts): {flags} cannot apply")
    k = moe.get("top_k", mcfg.top_k)
    if not 1 <= k <= mcfg.n_expert:
        raise ConfigError(f"--moe-top-k {k} must be between 1 and the model's {mcfg.n_expert} "
                          f"experts")
    every = moe.get("moe_every", mcfg.moe_every)
    blocks = [i for i in range(mcfg.n_layer) if mcfg.is_moe(i)]
    out = dataclasses.replace(mcfg, top_k=k, moe_every=max(every, 1))
    if every < 1 or [i for i in range(mcfg.n_layer) if out.is_moe(i)] != blocks:
        raise ConfigError(f"--moe-every {moe['moe_every']} does not put experts where {path} "
                          f"has them (blocks {blocks})")
    return out


def read_prompts(path: str | None, texts: list[str] | None, tok: Tokenizer | None, V: int):
    """The prompts as a list of id lists, from ``--prompts PATH.npy`` (B, T0) or ``--prompt``."""
    if (path is None) == (not texts):
        raise ConfigError("give the prompts: --prompts PATH.npy or --prompt TEXT (not both)")
    if path is not None:
        try:
            arr = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--prompts {path}: cannot read it ({e})") from e
        if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer) or arr.shape[1] < 1:
            raise ConfigError(f"--prompts {path}: expected a (B, T0) integer array, got "
                              f"{arr.ndim}-D {arr.dtype}")
        rows = [list(map(int, r)) for r in arr]
    else:
        if tok is None:
            raise ConfigError("--prompt TEXT needs a tokenizer: the weights name none (refmp "
                              "train --save records the addition task's or bytes; a Hugging "
                              "Face directory holds its own); give --tokenizer DIR, or token "
                              "ids with --prompts PATH.npy")
        rows = [tok.encode(t) for t in texts]
    for r in rows:
        if not r:
            raise ConfigError("an empty prompt: every prompt needs at least one token")
        if min(r) < 0 or max(r) >= V:
            raise ConfigError(f"prompt token ids must be in [0, {V}), got {min(r)}..{max(r)}")
    return rows


def read_requests(path: str, tok: Tokenizer | None, V: int) -> list[dict]:
    """``--requests PATH.jsonl``: one request a line, {"prompt": ids or text,
    "max_new_tokens": N, "arrival": step (default 0)}."""
    out = []
    try:
        with open(path) as f:
            lines = [x for x in f.read().splitlines() if x.strip()]
    except OSError as e:
        raise ConfigError(f"--requests {path}: cannot read it ({e})") from e
    for n, line in enumerate(lines, 1):
        try:
            r = json.loads(line)
            p = r["prompt"]
            ids = read_prompts(None, [p], tok, V)[0] if isinstance(p, str) else \
                read_prompts_ids(p, V)
            out.append({"prompt": ids, "max_new_tokens": int(r["max_new_tokens"]),
                        "arrival": int(r.get("arrival", 0))})
        except ConfigError as e:
            raise ConfigError(f"--requests {path} line {n}: {e}") from e
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"--requests {path} line {n}: {e!r}") from e
    if not out:
        raise ConfigError(f"--requests {path}: no request in it")
    return out


def read_prompts_ids(ids, V: int) -> list[int]:
    ids = [int(i) for i in ids]
    if not ids or min(ids) < 0 or max(ids) >= V:
        raise ConfigError(f"a request's prompt must be token ids in [0, {V}), got {ids}")
    return ids
