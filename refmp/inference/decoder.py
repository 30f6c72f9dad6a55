"""The decoder: prefill and KV-cached decode steps of GPT-2 on any layout, pp x dp x cp x tp
with experts, through the same block (refmp.nn.gpt.block_forward) and Ops as training; and
of a Llama-family model on pp x dp x cp x tp, whose pieces (block, Ops, shards, cached core,
head) the model's family gives (refmp.inference.families; refmp.nn.llama's block).

Shapes: B rows (requests) on this rank, T0 prompt tokens, t tokens of one call (T0 in the
prefill, 1 in a decode step), Tl = T0/cp prompt tokens per cp rank, C channels, NH = n_head/tp
heads here, HS head size, V vocabulary, Vl = Vp/tp vocabulary rows here.

A call runs this pipeline stage's blocks on t new tokens per row, on the blocks and shards
training selects (refmp.parallel.pipeline.partition.rank_chunks, placement.held_indices) and
through the Ops training builds (refmp.parallel.ops.make_ops: their embedding, blocks and head). The only
piece that differs is the attention core, refmp.inference.attention.CachedAttention, handed
to each block's Ops as their ``attn`` with the call's frozen record (``Call``): it appends the
new keys and values to the cache and attends over everything cached. Each axis splits what it
splits in training, and the cache with it:

* tp: the linears are column/row parallel (Megatron); a rank keeps the k, v of its NH/tp heads;
  the logits (B, Vl) of the last position are all-gathered into (B, V) to pick the token;
* pp: a stage keeps its layers' cache; activations (B, t, C) go stage to stage, the last
  stage picks the token and sends its id to the first (B int64);
* dp: each dp rank decodes its own rows (refmp.parallel.data: whole requests);
* ep: the MoE MLP sends each token to its experts by all-to-all (refmp.parallel.expert);
  without a capacity limit (unless asked: ``capacity``), so that a token's output does not
  depend on the tokens beside it;
* cp: the prompt is sharded (SequenceChunks, zig-zag or contiguous) and prefilled by ring
  attention; decoded token j is appended on cp rank j mod cp (round robin), every cp rank
  computes the new token's q and its partial attention over the keys it holds, and the
  partial results merge by log-sum-exp (refmp.nn.blockwise.attention_merge, as ring
  attention merges its blocks): one all-gather of (B, NH, 1, HS + 1) per layer.

Messages of one decode step, B rows on a dp rank, w bytes per element, L blocks on the stage
(``decode_step_bytes``; tests/test_inference_parallel.py holds the ledger to it):

    tp: allreduce (2 L + [first stage]) B C w,  allgather [last stage] B Vp w
    cp: allgather L cp B NH (HS + 1) w
    pp: send/recv B C w to/from the neighbouring stages, and the token ids, B 8 bytes
    ep: per MoE layer, alltoall E 8 bytes of counts and alltoallv (M + R) C w of rows, M and
        R from the routing (refmp.cost.expert.alltoallv_bytes, the forward half)
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from mpi4py import MPI

from refmp.distributed.grid import ProcessGrid
from refmp.distributed.waiting import wait
from refmp.inference.attention import Call
from refmp.inference.cache import KVCache, PagedKVCache
from refmp.inference.families import family_of
from refmp.parallel.context.chunks import SequenceChunks
from refmp.parallel.pipeline.partition import rank_chunks
from refmp.parallel.pipeline.schedules import ChunkPlacement
from refmp.parallel.placement import padded_vocab
from refmp.runtime import backend
from refmp.runtime.backend import array_module

TAG_ACT = 21  # activations stage to stage
TAG_TOKEN = 22  # the token ids, last stage to first
SPLIT = ("tp", "pp", "cp", "ep")  # the axes a Decoder may split the model over


class Decoder:
    """This rank's share of the model (its stage's blocks, its tp shard, its experts) and the
    calls that run it on cached tokens. ``weights``: where the share comes from, either a
    Source (refmp.checkpoint.source: a file, a Hugging Face directory, a checkpoint of any
    layout, a LlamaForCausalLM directory), of which it reads only its slices (the family's,
    training's: ``read(name, tp_index, dtype)``), in ``dtype`` (None: the source's);
    or the whole model as a dict (GPT-2 names; host arrays, or device arrays on a GPU: a
    test's, a tutorial's), of which it keeps its shards (placement.shards_held); or a Mapping
    that is not a dict: its own shards already (evaluation's, read in place). ``grid``:
    a refmp.distributed.grid.ProcessGrid; ``axes``: the grid axes the model is split over
    (tp, pp, cp, ep), the others decode prompts of their own (each axis left out is taken
    from a grid of one rank). ``capacity``: route to the
    experts with the model's capacity limit, as training and GPT.generate do (a token's
    output then depends on the tokens of its sequence, so only decoding without the cache is
    exact). ``T``: the block size the pipeline split (training's rank_chunks) is costed at:
    a run's ``--block-size`` (default the model's, as in training), so that a stage holds
    the blocks it trains. ``placed`` and ``stage_layers``: where the model's chunks run
    (default one chunk per pp rank, in order) and --stage-layers, as training has them: with
    several chunks a rank (interleaved, the V schedules) a call's activations go round the
    ranks chunk by chunk, as a step's forward does."""

    def __init__(self, mcfg, weights, grid, cp_balance: str = "zigzag",
                 axes: tuple[str, ...] = SPLIT, capacity: bool = False, T: int | None = None,
                 dtype=None, placed: ChunkPlacement | None = None,
                 stage_layers: str | None = None):
        self.mcfg = mcfg
        self.cp_balance = cp_balance
        alone = ProcessGrid(MPI.COMM_SELF) if set(SPLIT) - set(axes) else None
        self.tp = (grid if "tp" in axes else alone).comm["tp"]
        self.pp = (grid if "pp" in axes else alone).comm["pp"]
        self.cp = (grid if "cp" in axes else alone).comm["cp"]
        self.ep = (grid if "ep" in axes else alone).comm["ep"]
        self.placed = placed or ChunkPlacement(self.pp.size)
        S = self.placed.pp * self.placed.v  # chunks in all
        # training's split: chunk -> its blocks, the chunks this rank runs
        self.chunks = rank_chunks(mcfg, T or mcfg.block_size, self.pp.rank, self.placed,
                                  stage_layers)
        self.blocks = [i for blocks in self.chunks.values() for i in blocks]
        self.first = 0 in self.chunks  # embeds the tokens
        self.last = S - 1 in self.chunks  # the head: picks the tokens
        self.last_rank = self.placed.rank(S - 1)
        self.family = family_of(mcfg)  # GPT-2's pieces or the Llama family's
        self.params = self._shards(weights, dtype)  # as the engine's (refmp.parallel.placement)
        self.dtype = next(iter(self.params.values())).dtype
        self.nh = self.family.cache_heads(self.tp)  # key/value heads the cache keeps here
        # experts: every token to its top-k (no capacity limit unless asked), over ep if split
        self.moe = self.family.moe(grid if "ep" in axes else alone, capacity)
        self.cache = None  # this rank's KV cache: new_cache makes it, each call fills it

    def _shards(self, weights, dtype) -> dict:
        """This rank's tp shard of every parameter it holds: read slice by slice from a
        Source, cut from the whole model (a dict) by the family, or, given a Mapping that is
        not a dict, the caller's own shards, taken as they are (evaluation's:
        refmp.training.evaluate)."""
        if isinstance(weights, Mapping) and not isinstance(weights, dict):
            return weights
        return self.family.shards(weights, self.blocks, self.first, self.last, self.tp,
                                  self.ep, dtype)

    def new_cache(self, S: int, tokens: int, block_size: int | None = None):
        """A new cache of this rank's layers and heads for S slots of ``tokens`` each, which
        the calls from now on fill: contiguous, or paged in blocks of ``block_size`` tokens
        (a pool that holds S full slots). Returns it."""
        hs = self.mcfg.n_embd // self.mcfg.n_head
        if block_size is None:
            self.cache = KVCache(self.blocks, S, self.nh, tokens, hs, self.dtype)
        else:
            n_blocks = S * -(-tokens // block_size)
            self.cache = PagedKVCache(self.blocks, S, self.nh, n_blocks, block_size, hs,
                                      self.dtype)
        return self.cache

    def use_cache(self, cache) -> None:
        """The calls from now on fill ``cache`` (a cache new_cache does not make: serving's,
        refmp.inference.prefix)."""
        self.cache = cache

    def kv_tokens(self, T0: int, n_decoded: int) -> int:
        """Tokens of one row this rank's cache holds: its Tl of the prompt and its share of
        the n_decoded tokens run back through the model (round robin over cp)."""
        cp, r = self.cp.size, self.cp.rank
        return T0 // cp + len(range(r, n_decoded, cp))

    def owner(self, j: int) -> int:
        """The cp rank that keeps decoded token j (its position T0 + j)."""
        return j % self.cp.size

    # --- one call: this stage's blocks on t new tokens of each row -------------------------

    def forward(self, ids, slots: list[int], positions, prefill: bool, decoded=None,
                sends: list | None = None, rows_apart: bool = False):
        """Run this stage on the rows ``slots`` (-1: a free slot, skipped by attention).

        ``ids`` (B, t) token ids (first stage; None elsewhere); ``positions`` their global
        positions, (t,) or (B, t) (host integers); ``decoded`` (B,) in a decode step: the
        index j of each row's new token (it decides the cp rank that keeps it). Returns the
        full logits (B, V) of each row's last position on the last stage, None elsewhere.
        ``sends``: a list that takes the send to the next stage, (request, buffer), for the
        caller to wait on; without it the send is waited here. ``rows_apart``: the linears
        and the head run row by row (RowByRow).
        """
        B = len(slots)
        t = np.shape(positions)[-1] if prefill else 1
        cp = self.cp
        held = np.asarray(positions)
        ring = None  # prefill over cp: ring attention
        owns = None  # decode: whether this cp rank keeps each row's new token
        if prefill and cp.size > 1:  # my chunks of every prompt (SequenceChunks), ring attention
            chunks = SequenceChunks(t, cp.size, self.cp_balance)
            ring = self.family.ring(cp, chunks)
            held = chunks.positions(cp.rank)
        if not prefill:
            owns = np.array([self.owner(j) == cp.rank for j in decoded])
        call = Call(self.cache, cp, slots, prefill, ring, owns)  # what the attention reads
        t_here = len(held) if prefill else 1
        # the layout's Ops (make_ops, as training's) at these positions; each block's around
        # the cached attention of its layer
        where = backend.from_host(held)
        ops = self._ops(where)
        x = None
        for c, blocks in self.chunks.items():  # in model order
            if c == 0:
                x = self.family.embed(ops, self.params,
                                      ids if not prefill or cp.size == 1 else ids[:, where])  # (B, t, C)
            elif c - 1 not in self.chunks:  # the chunk before ran on another rank
                x = self.pp.recv((B, t_here, self.mcfg.n_embd), self.dtype,
                                 self.placed.rank(c - 1), TAG_ACT)
            for i in blocks:  # each block's Ops around the cached attention of its layer
                block_ops = self._ops(where, self.family.core(call, i))
                x = self.family.block(self.params, i, x, block_ops, self.moe, rows_apart)
            if c + 1 in self.chunks or c == self.placed.pp * self.placed.v - 1:
                continue  # the next chunk is this rank's, or this was the last
            x = array_module(x).ascontiguousarray(x)
            req = self.pp.send(x, self.placed.rank(c + 1), TAG_ACT)
            if sends is None:
                wait(req)
            else:  # the buffer stays alive until the caller waits
                sends.append((req, x))
        for b, slot in enumerate(slots):
            if slot >= 0:
                self.cache.advance(slot, t_here if prefill else int(owns[b]))
        if not self.last:
            return None
        xp = array_module(x)
        x_last = x[:, -1:, :]  # (B, 1, C)
        if prefill and cp.size > 1:  # the prompt's last token lives on one cp rank
            root = next(r for r in range(cp.size) if t - 1 in chunks.positions(r))
            x_last = (xp.ascontiguousarray(x[:, list(held).index(t - 1)][:, None])
                      if cp.rank == root else xp.empty_like(x_last))
            x_last = cp.bcast(x_last, root)
        return self._logits(ops, x_last, rows_apart)

    def _ops(self, positions, attn=None):
        """The Ops of this layout (the family's, as training's) for tokens at ``positions``,
        around the attention core ``attn`` (None: the serial core)."""
        return self.family.ops(self.tp, positions, attn)

    def _logits(self, ops, x_last, rows_apart: bool = False):
        """The full logits (B, V) of x_last (B, 1, C): the family's head (GPT-2's ln_f and
        tied head, with tp the all-gather of the vocabulary shards)."""
        if rows_apart and len(x_last) > 1:
            rows = [self._logits(ops, x_last[i : i + 1]) for i in range(len(x_last))]
            return array_module(x_last).concatenate(rows)
        return self.family.logits(ops, self.params, x_last, self.tp)  # (B, V)

    # --- the pipeline's token hand-back ---------------------------------------------------

    def token_to_first(self, tokens, B: int):
        """The last stage's token ids (B,) to the first stage (returned there; None between)."""
        if self.last_rank == 0:  # one rank, or a V: both ends on pp rank 0
            return tokens
        if self.last:
            tokens = array_module(tokens).ascontiguousarray(tokens.astype(np.int64))
            wait(self.pp.send(tokens, 0, TAG_TOKEN))
            return None
        if self.first:
            return self.pp.recv((B,), np.int64, self.last_rank, TAG_TOKEN)
        return None


def decode_step_bytes(B: int, C: int, V: int, n_head: int, blocks: int, first: bool, last: bool,
                      tp: int, cp: int, pp: int, itemsize: int) -> dict[str, int]:
    """Ledger bytes of one decode step on one rank, by "op@axis" (the module docstring)."""
    out = {}
    if tp > 1:
        out["allreduce@tp"] = (2 * blocks + first) * B * C * itemsize
        if last:
            out["allgather@tp"] = B * padded_vocab(V, tp) * itemsize
    if cp > 1:
        hs = C // n_head
        out["allgather@cp"] = blocks * cp * B * (n_head // tp) * (hs + 1) * itemsize
    if pp > 1:
        out["send@pp"] = (0 if last else B * C * itemsize) + (B * 8 if last else 0)
        out["recv@pp"] = (0 if first else B * C * itemsize) + (B * 8 if first else 0)
    return {k: v for k, v in out.items() if v}
