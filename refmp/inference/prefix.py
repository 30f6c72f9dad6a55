"""Prefix caching: requests that start with the same tokens (a system prompt, a few-shot
header) share the paged cache's blocks of that prefix instead of prefilling it again
(vLLM's automatic prefix caching; SGLang's RadixAttention, Zheng et al. 2024, keeps the
same blocks in a radix tree).

Shapes: bs tokens per block, T0 a prompt's tokens.

A full block is named by a hash chain over the tokens up to its end:

    key_0 = H(tokens 0..bs-1),   key_j = H(key_{j-1} || tokens j bs .. (j + 1) bs - 1)

so two requests' block j have the same key exactly when their first (j + 1) bs tokens are the
same (the keys and values of a token depend on it and every token before it, and on nothing
else). H is SHA-256 of the parent key and the token ids: a key names content, never a block
id, so a block that is evicted and reused for other tokens cannot be matched by a stale key.
A radix tree would share the same blocks; the chain needs only one dict from key to block.

Blocks carry a reference count (the slots that use them). A request's prefill first matches
its prompt's full blocks, chain link by chain link, to cached blocks (their count goes up),
and prefills only the tokens after them (refmp.inference.extend). At least the prompt's last
token is always prefilled: its logits choose the first new token. Once prefilled (a chunk at a
time: refmp.inference.serving), the prompt's full blocks are keyed. A finished request's
blocks go back: a keyed block with no user stays cached, in least-recently-used order, and is
evicted (unkeyed and reused) only when the pool of never-keyed blocks is empty. A shared block
is never written: a match covers whole blocks, so the request's next token starts a block of
its own. """

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from refmp.inference.cache import PagedKVCache


def block_keys(tokens: list[int], bs: int) -> list[bytes]:
    """The chain's key of every full block of ``tokens`` (the module docstring)."""
    keys, key = [], b""
    for j in range(len(tokens) // bs):
        chunk = np.asarray(tokens[j * bs : (j + 1) * bs], dtype=np.int64).tobytes()
        key = hashlib.sha256(key + chunk).digest()
        keys.append(key)
    return keys


class PrefixCache(PagedKVCache):
    """A paged cache whose full prompt blocks are shared by requests with the same prefix."""

    def __init__(self, layers, S: int, NH: int, n_blocks: int, block_size: int, HS: int, dtype):
        super().__init__(layers, S, NH, n_blocks, block_size, HS, dtype)
        self.block_of: dict[bytes, int] = {}  # key -> the block that holds those tokens
        self.key_of: dict[int, bytes] = {}  # block -> its key (keyed blocks only)
        self.users = np.zeros(n_blocks, dtype=np.int64)  # slots that use each block
        self.unused: OrderedDict[int, None] = OrderedDict()  # keyed, no user: oldest first
        self.saved = 0  # prompt tokens matched, so not prefilled (every request so far)

    def match(self, slot: int, prompt: list[int]) -> int:
        """Attach the cached blocks of the prompt's longest keyed prefix to the empty
        ``slot``, leaving at least its last token to prefill. Returns the tokens matched."""
        for key in block_keys(prompt[:-1], self.bs):
            block = self.block_of.get(key)
            if block is None:
                break
            self.unused.pop(block, None)
            self.users[block] += 1
            self.table[slot].append(block)
        n = len(self.table[slot]) * self.bs
        self.length[slot] = n
        self.saved += n
        return n

    def register(self, slot: int, prompt: list[int]) -> None:
        """Key the slot's full blocks of ``prompt`` (prefilled): later requests may match them."""
        for block, key in zip(self.table[slot], block_keys(prompt, self.bs), strict=False):
            if key not in self.block_of and block not in self.key_of:
                self.block_of[key] = block
                self.key_of[block] = key

    def _take(self) -> int:
        """A never-keyed block, else the least recently used keyed block with no user."""
        if self.pool:
            block = self.pool.pop()
        elif self.unused:
            block, _ = self.unused.popitem(last=False)
            del self.block_of[self.key_of.pop(block)]  # evicted: its tokens are gone
        else:
            raise MemoryError("the paged KV cache has no free block left")
        self.users[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.users[block] -= 1
        if self.users[block] > 0:
            return
        if block in self.key_of:  # cached for the next request with this prefix
            self.unused[block] = None
        else:
            self.pool.append(block)


def predicted_saving(prompts: list[list[int]], bs: int) -> int:
    """Prompt tokens a prefix cache that never evicts saves over ``prompts`` prefilled in
    order: for each, the full blocks of its longest prefix (before its last token) that an
    earlier prompt shares."""
    saved = 0
    for i, p in enumerate(prompts):
        best = 0
        for q in prompts[:i]:
            n = 0
            while n < min(len(p) - 1, len(q)) and p[n] == q[n]:
                n += 1
            best = max(best, n)
        saved += best // bs * bs
    return saved
