"""Context parallelism: every sample's sequence split across the cp ranks.

Shapes: B global batch, b = B/dp rows on this rank, T sequence (block size), Tl = T/cp tokens
per rank, c chunk length, C channels, NH heads, HS head size; cp and dp group sizes.

Every layer except attention treats tokens independently, so each rank runs embeddings,
LayerNorms, MLPs and the loss on its own Tl tokens of every sample. Attention mixes tokens;
two algorithms exchange what it needs (``--cp-algo``):

* ``ring`` (refmp.parallel.context.ring): K/V blocks travel around the ring, overlapped with
  the block products, merged with the online-softmax rule (Liu et al. 2023);
* ``ulysses`` (refmp.parallel.context.ulysses): all-to-all from sequence- to head-sharded
  and back (Jacobs et al. 2023).

Which tokens a rank holds (``--cp-balance``, :class:`SequenceChunks`): causal attention gives
late tokens more work than early ones (token t attends to t+1 keys). ``contiguous`` gives
rank r the r-th of cp equal chunks, so the last rank works cp times harder than the first;
``zigzag`` cuts 2*cp chunks and gives rank r chunks r and 2cp-1-r, pairing an early chunk
with a late one so every rank does the same work (Megatron-LM's context parallelism).

Positions: the position embedding uses each token's global position (its chunk's offset).
The loss is each rank's share of the global mean (its tokens' loss sum over B*T), so summing
shares and gradients over cp and dp gives the serial loss and gradient exactly (as in
refmp.parallel.data.accumulate): dense gradients are summed over grid.group("dp", "cp").

In the engine (refmp.parallel.engine) context parallelism is two things only: the tokens a
rank takes from each row (``SequenceChunks.positions``) and the attention core of its Ops
(refmp.parallel.ops): everything else composes with it unchanged (tp, SP, pipelines, ZeRO,
experts).
"""

from __future__ import annotations

import numpy as np

from refmp.errors import ConfigError

ALGOS = ("ring", "ulysses")
BALANCES = ("zigzag", "contiguous")


class SequenceChunks:
    """Which chunks of the sequence each cp rank holds (contiguous: 1 each; zigzag: 2)."""

    def __init__(self, T: int, cp: int, balance: str = "zigzag"):
        if balance not in BALANCES:
            raise ConfigError(f"--cp-balance must be one of {', '.join(BALANCES)}, got {balance!r}")
        self.T = T
        self.cp = cp
        self.balance = balance
        self.n_chunks = 2 * cp if balance == "zigzag" else cp
        if T % self.n_chunks:
            raise ConfigError(
                f"--cp {cp} with --cp-balance {balance} cuts the sequence into {self.n_chunks} "
                f"equal chunks, but the block size {T} is not divisible by {self.n_chunks}")
        self.c = T // self.n_chunks  # tokens per chunk

    def chunks(self, r: int) -> list[int]:
        """Chunk ids of rank r, in the order its tokens are held."""
        return [r, 2 * self.cp - 1 - r] if self.balance == "zigzag" else [r]

    def positions(self, r: int) -> np.ndarray:
        """Global positions of rank r's tokens, (Tl,)."""
        return np.concatenate([np.arange(k * self.c, (k + 1) * self.c) for k in self.chunks(r)])
