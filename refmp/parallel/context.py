"""Context parallelism: every sample's sequence split across the cp ranks.

Shapes: B global batch, b = B/dp rows on this rank, T sequence (block size), Tl = T/cp tokens
per rank, c chunk length, C channels, NH heads, HS head size; cp and dp group sizes.

Every layer except attention treats tokens independently, so each rank runs embeddings,
LayerNorms, MLPs and the loss on its own Tl tokens of every sample. Attention mixes tokens;
two algorithms exchange what it needs (``--cp-algo``):

* ``ring`` (refmp.parallel.context_ring): K/V blocks travel around the ring, overlapped with
  the block products, merged with the online-softmax rule (Liu et al. 2023);
* ``ulysses`` (refmp.parallel.context_ulysses): all-to-all from sequence- to head-sharded
  and back (Jacobs et al. 2023).

Which tokens a rank holds (``--cp-balance``, :class:`ChunkLayout`): causal attention gives
late tokens more work than early ones (token t attends to t+1 keys). ``contiguous`` gives
rank r the r-th of cp equal chunks, so the last rank works cp times harder than the first;
``zigzag`` cuts 2*cp chunks and gives rank r chunks r and 2cp-1-r, pairing an early chunk
with a late one so every rank does the same work (Megatron-LM's context parallelism).

Positions: the position embedding uses each token's global position (its chunk's offset).
The loss is each rank's share of the global mean (its tokens' loss sum over B*T), so summing
shares and gradients over cp and dp gives the serial loss and gradient exactly (as in
refmp.parallel.data). Weights are replicated: every rank holds the full model.
"""

from __future__ import annotations

import numpy as np

from refmp import backend
from refmp.data import dp_rows
from refmp.errors import ConfigError
from refmp.nn import gpt
from refmp.parallel.context_ring import RingAttention
from refmp.parallel.context_ulysses import UlyssesAttention
from refmp.parallel.data import allreduce_grads

ALGOS = ("ring", "ulysses")
BALANCES = ("zigzag", "contiguous")


class ChunkLayout:
    """Which chunks of the sequence each cp rank holds (contiguous: 1 each; zigzag: 2)."""

    def __init__(self, T: int, cp: int, balance: str = "zigzag"):
        if balance not in BALANCES:
            raise ConfigError(f"--cp-balance must be one of {', '.join(BALANCES)}, got {balance!r}")
        self.T, self.cp, self.balance = T, cp, balance
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


def ring_attention_flops(layout: ChunkLayout, r: int, B: int, n_head: int, hs: int) -> int:
    """Attention FLOPs rank r executes in ring attention's forward (a closed form).

    A block of c queries over c keys costs 4 B NH c^2 HS (q k^T and p v, 2 FLOPs per
    multiply-add); diagonal blocks are computed in full, then masked. Contiguous: rank r
    computes r full blocks and its diagonal. Zigzag: its early chunk r sees r earlier chunks,
    its late chunk 2cp-1-r sees 2cp-1-r, plus two diagonals: 2cp+1 blocks on every rank.
    """
    blocks = r + 1 if layout.balance == "contiguous" else 2 * layout.cp + 1
    return blocks * 4 * B * n_head * layout.c ** 2 * hs


def nbytes_of(obj) -> int:
    """Bytes of every array in a (nested) cache tuple: the activation memory it holds."""
    if isinstance(obj, (tuple, list)):
        return sum(nbytes_of(o) for o in obj)
    return int(getattr(obj, "nbytes", 0))


class ContextParallel:
    """The runner (interface: refmp.parallel.data.DataParallel) for cp x dp layouts.

    Generation for evaluation runs the full, replicated model on every rank (prompts are a
    few tokens: splitting them would cost more messages than it saves); the cp ranks of a dp
    group decode the same prompts, so ``eval_comm`` is dp.
    """

    def __init__(self, model, grid, T: int, algo: str = "ring", balance: str = "zigzag"):
        self.model, self.grid = model, grid
        self.cp, self.dp = grid.comm["cp"], grid.comm["dp"]
        self.eval_comm = self.dp
        self.layout = ChunkLayout(T, self.cp.size, balance)
        n_head = model.cfg.n_head
        if algo not in ALGOS:
            raise ConfigError(f"--cp-algo must be one of {', '.join(ALGOS)}, got {algo!r}")
        if algo == "ulysses" and n_head % self.cp.size:
            raise ConfigError(f"--cp-algo ulysses gives each of the {self.cp.size} cp ranks "
                              f"n_head/cp heads, but n_head ({n_head}) is not divisible by "
                              f"--cp {self.cp.size}")
        cls = RingAttention if algo == "ring" else UlyssesAttention
        self.attn = cls(self.cp, self.layout)
        self.positions = backend.from_host(self.layout.positions(self.cp.rank))  # (Tl,)
        self.attn_bytes = 0  # activation bytes the attention caches held in the last step

    @property
    def params(self) -> dict:
        return self.model.params

    @property
    def grads(self) -> dict:
        return self.model.grads

    def batch_rows(self, B: int) -> slice:
        return dp_rows(B, self.dp.size, self.dp.rank)  # cp ranks of a dp group share rows

    def zero_grad(self) -> None:
        self.model.zero_grad()

    def forward_backward(self, x, y, denom: int) -> float:
        p, n_head, attention = self.params, self.model.cfg.n_head, (self.attn.forward,
                                                                    self.attn.backward)
        x, y = x[:, self.positions], y[:, self.positions]  # (b, Tl) my tokens of every row
        h, emb = gpt.embed_forward(p, x, positions=self.positions)  # (b, Tl, C) global positions
        blocks = []
        for i in range(self.model.cfg.n_layer):
            h, c = gpt.block_forward(gpt.block_params(p, i), h, n_head, attention=attention)  # (b, Tl, C)
            blocks.append(c)
        self.attn_bytes = sum(nbytes_of(c[2][1]) for c in blocks)  # the attention caches
        loss, head = gpt.head_forward(p, h, y, denom)  # my tokens' loss sum / (B*T): a share
        dh, g = gpt.head_backward(1.0, head)
        self._accumulate(g)
        for i in reversed(range(self.model.cfg.n_layer)):
            dh, g = gpt.block_backward(dh, blocks[i])
            self._accumulate({f"h.{i}.{k}": v for k, v in g.items()})
        self._accumulate(gpt.embed_backward(dh, emb))  # wpe: only my positions' rows are nonzero
        return float(loss)

    def _accumulate(self, g: dict) -> None:
        grads = self.model.grads
        for k, v in g.items():
            grads[k] = v if grads[k] is None else grads[k] + v

    def reduce_grads(self) -> None:
        # the cp ranks saw different tokens of the same rows, the dp ranks different rows:
        # both hold shares of the global gradient, so sum over both (one all-reduce each)
        allreduce_grads(self.model.grads, self.cp)
        allreduce_grads(self.model.grads, self.dp)

    def grad_sum_sq(self, local: float) -> float:
        return local  # replicated after reduce_grads: count once

    def loss_total(self, share: float) -> float:
        return self.dp.allreduce_scalar(self.cp.allreduce_scalar(share))

    def generate(self, idx, n: int):
        return self.model.generate(idx, n)  # the full model, on every rank (see the docstring)

    def full_params(self) -> dict | None:
        return self.model.params if self.grid.rank == 0 else None
