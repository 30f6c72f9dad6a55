"""Context parallelism x tensor parallelism (x data parallelism): both splits at once.

Shapes: B global batch, b = B/dp rows on this rank, T sequence, Tl = T/cp tokens on this rank,
C channels, NH heads, HS head size, L layers, V vocabulary; cp, tp and dp group sizes.

The two splits cut different axes, so they stack (Megatron-LM's "CP x TP"):

* **tokens over cp** (refmp.parallel.context): each rank holds Tl tokens of every row, the
  chunks of ``--cp-balance`` (zig-zag or contiguous), embedded at their global positions;
* **heads and columns over tp** (refmp.parallel.tensor): the block's linears are column /
  row parallel over tp with f = ``copy_to_tp`` and g = ``reduce_from_tp`` around them; the
  embedding, tied head and cross-entropy are vocabulary-parallel (refmp.parallel.vocab), on
  the rank's own Tl tokens.

Attention is where they meet: after the column-parallel c_attn a rank holds q, k, v of its
NH/tp heads for its Tl tokens, (b, Tl, 3C/tp). The cp ranks of a tp index hold the *same*
heads for the other tokens, so the CP attention (ring or Ulysses) runs unchanged over
``grid.comm["cp"]`` on those NH/tp heads: ``tensor.block_forward`` takes it as its attention
(forward, backward) pair, as ``refmp.nn.gpt.block_forward`` does. Ulysses then splits the
NH/tp heads again over cp, so (NH/tp) must be divisible by cp.

Gradients: the cp (and dp) replicas of a tp shard saw different tokens (rows), so every
gradient is summed over cp, then dp; TP shards stay sharded over tp. The clipping norm adds
the shards' squares over tp and counts the replicated parameters once (as in TensorParallel;
after the sums, the cp and dp replicas are equal and counted once). The loss share of a rank
is its tokens' loss sum / (B*T): summed over cp and dp (not tp: every tp rank has it whole).

Communication per step, w bytes per element (tests/test_context_tensor.py checks the ledger):

    tp  allreduce  (4 L + 2) b Tl C w  +  3 b Tl w     (TP's formula with s = Tl)
    cp  ring: send 3 (cp-1) L K/V blocks of 2 b Tl (C/tp) w   (forward, backward again, dK/dV)
        Ulysses: alltoall 4 L, of 2 L b Tl (4C/tp) w in all
        allreduce  the local gradients, once
    dp  allreduce  the local gradients, once (if dp > 1)

Sequence parallelism with cp is refused: SP would shard the Tl tokens again over tp, and the
column layers' all-gathers would have to rebuild this rank's zig-zag chunks; it is not done.
"""

from __future__ import annotations

from refmp import backend
from refmp.errors import ConfigError
from refmp.parallel.context import ALGOS, ChunkLayout
from refmp.parallel.context_ring import RingAttention
from refmp.parallel.context_ulysses import UlyssesAttention
from refmp.parallel.data import allreduce_grads
from refmp.parallel.tensor_runner import TensorParallel


def check_context_tensor(n_head: int, tp: int, cp: int, T: int, algo: str, balance: str,
                         sp: bool) -> ChunkLayout:
    """Refuse what cp x tp cannot split (the same answer on every rank, before any message)."""
    if sp:
        raise ConfigError("--sequence-parallel with --cp: not implemented (SP would split "
                          "each rank's cp chunks again over tp); drop one of them")
    if algo not in ALGOS:
        raise ConfigError(f"--cp-algo must be one of {', '.join(ALGOS)}, got {algo!r}")
    layout = ChunkLayout(T, cp, balance)  # refuses a T the chunks cannot split
    if algo == "ulysses" and (n_head // tp) % cp:
        raise ConfigError(f"--cp-algo ulysses with --tp {tp}: each tp rank holds n_head/tp = "
                          f"{n_head // tp} heads, which must be divisible by --cp {cp}")
    return layout


class ContextTensorParallel(TensorParallel):
    """cp x tp x dp: the TensorParallel runner on this rank's Tl tokens, with CP attention.

    The DataParallel runner interface; params and grads are this rank's tp shards.
    Generation for evaluation runs the tp-split model on the whole prompt, with serial
    attention over the local heads (as ContextParallel does: prompts are short); the cp
    ranks of a dp group decode the same prompts, so ``eval_comm`` is dp.
    """

    def __init__(self, model, grid, T: int, algo: str = "ring", balance: str = "zigzag",
                 microbatches: int = 1):
        self.cp = grid.comm["cp"]
        self.layout = check_context_tensor(model.cfg.n_head, grid.comm["tp"].size, self.cp.size,
                                           T, algo, balance, False)
        super().__init__(model, grid, sequence_parallel=False, microbatches=microbatches)
        attn = (RingAttention if algo == "ring" else UlyssesAttention)(self.cp, self.layout)
        self.attn, self.attention = attn, (attn.forward, attn.backward)
        self.positions = backend.from_host(self.layout.positions(self.cp.rank))  # (Tl,)

    def forward(self, idx, targets=None, denom=None, sp=None, positions=None, attention=None):
        """With targets: my Tl tokens of every row, CP attention; without: the whole prompt."""
        if targets is None:  # generation (see the class docstring)
            return super().forward(idx, sp=False)
        idx, targets = idx[:, self.positions], targets[:, self.positions]  # (b, Tl) mine
        return super().forward(idx, targets, denom, sp=False, positions=self.positions,
                               attention=self.attention)

    def reduce_grads(self) -> None:
        # the cp ranks saw other tokens of the same rows, the dp ranks other rows: each holds
        # a share of its tp shard's gradient, so sum over both (tp shards stay apart)
        allreduce_grads(self.grads, self.cp)
        allreduce_grads(self.grads, self.dp)

    def loss_total(self, share: float) -> float:
        return self.dp.allreduce_scalar(self.cp.allreduce_scalar(share))  # one per tp rank
