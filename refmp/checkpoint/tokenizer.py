"""Text <-> token ids with a directory's Hugging Face tokenizer: its ``tokenizer.json``, or
GPT-2's ``vocab.json`` + ``merges.txt`` (byte-level BPE; Radford et al. 2019, sec. 2.2),
through Hugging Face's ``tokenizers`` library (the ``text`` extra). refmp writes no BPE of its
own: the library is the tokenizer, and these are the files it reads.

``refmp generate --prompt TEXT`` encodes with it and prints decoded text; ``refmp train
--data FILE.txt --tokenizer DIR`` tokenizes a text file with it (refmp.training.datasets).
"""

from __future__ import annotations

import hashlib
import os

from refmp.errors import ConfigError

EXTRA = 'pip install "refmp[text]"'  # the tokenizers library
FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"))  # what a directory may hold


def tokenizer_files(folder: str) -> list[str] | None:
    """The tokenizer's files in ``folder`` (tokenizer.json first), or None if it has none."""
    for names in FILES:
        paths = [os.path.join(folder, n) for n in names]
        if all(os.path.isfile(p) for p in paths):
            return paths
    return None


def have_library() -> bool:
    """Whether the tokenizers library can be imported."""
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return False
    return True


class TextTokenizer:
    """A ``tokenizers`` tokenizer read from a directory: encode, decode, its vocabulary size,
    and a fingerprint (sha256 of its whole definition: vocabulary, merges, pre-tokenizer)
    that changes when the tokenizer does."""

    def __init__(self, folder: str, flag: str = "--tokenizer"):
        files = tokenizer_files(folder) if os.path.isdir(folder) else None
        if files is None:
            raise ConfigError(f"{flag} {folder}: no tokenizer in it (tokenizer.json, or "
                              f"vocab.json and merges.txt)")
        try:
            import tokenizers
        except ImportError:
            raise ConfigError(f"{flag} {folder}: reading its tokenizer ({os.path.basename(files[0])}) "
                              f"needs Hugging Face's tokenizers library: {EXTRA}") from None
        try:
            if len(files) == 1:
                self.tok = tokenizers.Tokenizer.from_file(files[0])
            else:  # GPT-2's own files: the library's byte-level BPE (as GPT2TokenizerFast)
                self.tok = tokenizers.ByteLevelBPETokenizer(*files)
        except Exception as e:  # the library raises its own error types for bad files
            raise ConfigError(f"{flag} {folder}: the tokenizer cannot be read ({e})") from e
        self.folder = folder
        self.files = files
        self.vocab_size = self.tok.get_vocab_size()
        self.fingerprint = hashlib.sha256(self.tok.to_str().encode()).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids) -> str:
        """Every id as text, special tokens too (nothing is dropped from what was decoded)."""
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)
