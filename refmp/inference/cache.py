"""KV caches: the keys and values of every token decoded so far, per layer, kept so that a new
token attends over them without recomputing the prefix (Pope et al. 2022, sec. 2).

Shapes: S slots (rows of the batch a request occupies), NH heads on this rank (n_head/tp),
HS head size, t tokens a slot holds on this rank, bs tokens per block (paged).

A rank holds the cache of its own share of the model: the layers of its pipeline stage, its
NH/tp heads, and under context parallelism its share of each sequence's tokens. Per rank:

    bytes = 2 (k and v) x layers here x S x tokens here x C/tp x itemsize

(tokens here: T0/cp of the prompt plus the decoded tokens appended round robin over cp).

Two layouts behind one interface (``append``, ``view``, ``free``, ``nbytes``; and
``append_rows``, ``view_rows`` for a whole batch at once):

* :class:`KVCache`: one contiguous (S, NH, T, HS) buffer per layer for k and v, its length
  fixed when the cache is made (what Megatron-core's static inference context does);
* :class:`PagedKVCache`: vLLM's PagedAttention (Kwon et al. 2023): a pool of fixed-size
  blocks (NH, bs, HS) per layer and a block table per slot; a slot takes a new block when its
  last one is full, so it wastes at most bs - 1 token places, and a finished request gives
  its blocks back to the pool. ``view`` gathers a slot's blocks into the same (NH, t, HS)
  arrays the contiguous cache returns: the attention that reads them is bitwise the same.
"""

from __future__ import annotations

import numpy as np

from refmp.runtime import backend


class _Rows:
    """What both layouts share: every row of a batch at once, when the rows hold the same
    number of tokens (a batch of equal prompts): one attention call for the batch instead of
    one a row, the same numbers (each (row, head) is the same product either way)."""

    def append_rows(self, i: int, slots: list[int], k, v) -> None:
        """Write k, v (B, NH, t, HS) of layer i, row b after slot ``slots[b]``'s tokens."""
        for b, slot in enumerate(slots):
            self.append(i, slot, k[b], v[b])

    def equal(self, slots: list[int]) -> bool:
        """Whether the rows ``slots`` hold the same number of tokens (what ``view_rows`` needs)."""
        return len({int(self.length[s]) for s in slots}) == 1

    def view_rows(self, i: int, slots: list[int], extra: int = 0):
        """(k, v) of layer i for the rows ``slots``, of equal lengths: (B, NH, n, HS) each."""
        got = [self.view(i, s, extra) for s in slots]
        xp = backend.array_module(got[0][0])
        return xp.stack([k for k, _ in got]), xp.stack([v for _, v in got])


class KVCache(_Rows):
    """Contiguous: k, v of ``layers`` (their global indices), (S, NH, T, HS) each."""

    def __init__(self, layers, S: int, NH: int, T: int, HS: int, dtype):
        self.k = {i: backend.xp.zeros((S, NH, T, HS), dtype) for i in layers}
        self.v = {i: backend.xp.zeros((S, NH, T, HS), dtype) for i in layers}
        self.length = np.zeros(S, dtype=np.int64)  # tokens each slot holds (host ints)

    def append(self, i: int, slot: int, k, v) -> None:
        """Write k, v (NH, t, HS) of layer i after the slot's tokens (``advance`` moves on)."""
        n, t = int(self.length[slot]), k.shape[1]
        self.k[i][slot, :, n : n + t] = k
        self.v[i][slot, :, n : n + t] = v

    def advance(self, slot: int, t: int) -> None:
        """Every layer has appended its t tokens of this slot: they count from now on."""
        self.length[slot] += t

    def view(self, i: int, slot: int, extra: int = 0):
        """(k, v) of layer i, the slot's tokens and ``extra`` appended since the last
        ``advance``: (NH, t, HS) each."""
        n = int(self.length[slot]) + extra
        return self.k[i][slot, :, :n], self.v[i][slot, :, :n]

    def _whole(self, slots: list[int]) -> bool:
        """Every slot, in order, of equal lengths: the batch is a slice of the buffers."""
        return slots == list(range(len(self.length))) and self.equal(slots)

    def append_rows(self, i: int, slots: list[int], k, v) -> None:
        if not self._whole(slots):
            return super().append_rows(i, slots, k, v)
        n, t = int(self.length[0]), k.shape[2]  # every slot, equal lengths: one write
        self.k[i][:, :, n : n + t] = k
        self.v[i][:, :, n : n + t] = v

    def view_rows(self, i: int, slots: list[int], extra: int = 0):
        if not self._whole(slots):
            return super().view_rows(i, slots, extra)
        n = int(self.length[0]) + extra  # every slot, equal lengths: a view, no copy
        return self.k[i][:, :, :n], self.v[i][:, :, :n]

    def free(self, slot: int) -> None:
        self.length[slot] = 0

    def truncate(self, slot: int, n: int) -> None:
        """Keep the slot's first n tokens (speculative decoding drops the rejected ones)."""
        self.length[slot] = n

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (*self.k.values(), *self.v.values()))


class PagedKVCache(_Rows):
    """Paged: per layer a pool of ``n_blocks`` blocks (NH, bs, HS) for k and v; slot s's
    tokens are in blocks ``table[s]``, in order (token j in block j // bs, place j % bs)."""

    def __init__(self, layers, S: int, NH: int, n_blocks: int, block_size: int, HS: int, dtype):
        self.bs = block_size
        self.k = {i: backend.xp.zeros((n_blocks, NH, block_size, HS), dtype) for i in layers}
        self.v = {i: backend.xp.zeros((n_blocks, NH, block_size, HS), dtype) for i in layers}
        self.pool = list(range(n_blocks))[::-1]  # free blocks (pop takes the lowest)
        self.table: list[list[int]] = [[] for _ in range(S)]
        self.length = np.zeros(S, dtype=np.int64)

    def _block(self, slot: int, j: int) -> int:
        """The block holding the slot's token j, taken from the pool when it is a new one."""
        table = self.table[slot]
        while len(table) <= j // self.bs:
            table.append(self._take())
        return table[j // self.bs]

    def _take(self) -> int:
        """A free block (refmp.inference.prefix's cache also evicts one)."""
        if not self.pool:
            raise MemoryError("the paged KV cache has no free block left")
        return self.pool.pop()

    def _release(self, block: int) -> None:
        """A block its slot no longer uses, back to the pool."""
        self.pool.append(block)

    def append(self, i: int, slot: int, k, v) -> None:
        n = int(self.length[slot])
        for j in range(k.shape[1]):  # token by token: a token never straddles two blocks
            b, at = self._block(slot, n + j), (n + j) % self.bs
            self.k[i][b, :, at] = k[:, j]
            self.v[i][b, :, at] = v[:, j]

    def advance(self, slot: int, t: int) -> None:
        self.length[slot] += t

    def view(self, i: int, slot: int, extra: int = 0):
        n = int(self.length[slot]) + extra
        ids = self.table[slot]
        NH, HS = self.k[i].shape[1], self.k[i].shape[3]

        def gather(pool):  # (blocks, NH, bs, HS) -> (NH, blocks * bs, HS), the first n tokens
            return pool[ids].transpose(1, 0, 2, 3).reshape(NH, len(ids) * self.bs, HS)[:, :n]

        return gather(self.k[i]), gather(self.v[i])

    def free(self, slot: int) -> None:
        self.truncate(slot, 0)

    def truncate(self, slot: int, n: int) -> None:
        """Keep the slot's first n tokens; the blocks past them go back."""
        keep = -(-n // self.bs)  # blocks that hold tokens 0..n-1
        for block in reversed(self.table[slot][keep:]):
            self._release(block)
        del self.table[slot][keep:]
        self.length[slot] = n

    def waste(self, slot: int) -> int:
        """Token places the slot's blocks hold but its tokens do not use (at most bs - 1)."""
        return len(self.table[slot]) * self.bs - int(self.length[slot])

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (*self.k.values(), *self.v.values()))


def cache_bytes(n_layers: int, S: int, tokens: int, C: int, tp: int, itemsize: int) -> int:
    """The formula: 2 x layers x S x tokens x C/tp x itemsize (the module docstring)."""
    return 2 * n_layers * S * tokens * (C // tp) * itemsize
