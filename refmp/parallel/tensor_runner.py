"""The tensor-parallel runner: shards the GPT over tp, trains it, gathers it back.

Shapes: B batch, T time, C channels, NH heads, V vocabulary, Vp padded vocabulary, L layers;
tp tensor-parallel ranks, dp data-parallel ranks.

Which parameter is split how (rank r of tp; ``/tp`` marks the split axis):

    wte.weight           (Vp/tp, C)   rows: token ids [r Vp/tp, (r+1) Vp/tp), padding zero
    attn.c_attn.weight   (C, 3C/tp)   the q, k and v columns of my heads [r NH/tp, (r+1) NH/tp)
    attn.c_attn.bias     (3C/tp,)     same columns
    attn.c_proj.weight   (C/tp, C)    rows (row-parallel)
    mlp.c_fc.weight      (C, 4C/tp)   columns; its bias (4C/tp,) too
    mlp.c_proj.weight    (4C/tp, C)   rows (row-parallel)
    the rest             replicated   wpe, LayerNorms, the two c_proj biases

Communication per training step on tp, b = rows per dp rank, s = T, h = C, w bytes/element
(checked exactly against the ledger by tests/test_tensor_parallel.py). Every term but the
replicated gradients' is linear in b, so M micro-batches of b/M rows move the same bytes in
M times as many calls:

    without SP: allreduce       (4 L + 2) b s h w  +  3 b s w
                (per layer 2 forward (g) + 2 backward (f); the embedding's g; the head's f;
                 the cross-entropy's max, sum-exp and target logit)
    with SP:    reduce_scatter  (4 L + 2) b s h w
                allgather       (6 L + 3) b s h w   (2 per column layer, incl. the LM head,
                                                     are the re-gathers of Korthikanti 4.2.3)
                allreduce       3 b s w  +  w * (replicated parameters)
"""

from __future__ import annotations

from refmp import backend
from refmp.comm import Comm
from refmp.data import dp_rows
from refmp.errors import ConfigError
from refmp.nn.gpt import SERIAL_ATTENTION, block_params
from refmp.parallel import tensor as tpl
from refmp.parallel import vocab
from refmp.parallel.data import activation_bytes, allreduce_grads, flatten, unflatten_into

# how each sharded parameter is split: (axis, "heads" for c_attn's packed [q|k|v])
SPLITS = {
    "wte.weight": (0, None),
    "attn.c_attn.weight": (1, "heads"),
    "attn.c_attn.bias": (0, "heads"),
    "attn.c_proj.weight": (0, None),
    "mlp.c_fc.weight": (1, None),
    "mlp.c_fc.bias": (0, None),
    "mlp.c_proj.weight": (0, None),
}


def split_of(name: str):
    """(axis, kind) for a sharded parameter, None for a replicated one."""
    return SPLITS.get(name.split(".", 2)[-1] if name.startswith("h.") else name)


def check_tensor_parallel(n_head: int, tp: int, T: int, sp: bool) -> None:
    """Refuse layouts TP cannot split (same answer on every rank, before any communication)."""
    if n_head % tp:
        raise ConfigError(f"--tp {tp} must divide the number of heads n_head ({n_head}): "
                          f"each tensor-parallel rank computes whole heads")
    if sp and T % tp:
        raise ConfigError(f"--sequence-parallel: --tp {tp} must divide the sequence length "
                          f"T ({T}): each rank keeps T/tp positions")


def comm_bytes_per_step(b: int, s: int, h: int, n_layer: int, sp: bool, itemsize: int,
                        n_replicated: int = 0) -> dict[str, int]:
    """The bytes the ledger records on tp in one step, by collective (any micro-batching).

    b rows per dp rank, s = T, h = C; n_replicated: elements of the replicated parameters,
    whose gradients SP sums over tp. The formula in this module's docstring.
    """
    act, L_ = b * s * h * itemsize, n_layer  # one (b, s, h) activation
    loss = 3 * b * s * itemsize  # the cross-entropy's max, sum of exponentials, target logit
    if not sp:
        return {"allreduce": (4 * L_ + 2) * act + loss, "allgather": 0, "reduce_scatter": 0}
    return {"allreduce": loss + n_replicated * itemsize, "allgather": (6 * L_ + 3) * act,
            "reduce_scatter": (4 * L_ + 2) * act}


def shard(name: str, full, rank: int, tp: int, V_pad: int):
    """This rank's piece of the full parameter ``full`` (a copy)."""
    xp = backend.array_module(full)
    split = split_of(name)
    if split is None:
        return full.copy()
    axis, kind = split
    if name == "wte.weight" and full.shape[0] < V_pad:  # padding rows, zero
        pad = xp.zeros((V_pad - full.shape[0],) + full.shape[1:], full.dtype)
        full = xp.concatenate([full, pad])  # (Vp, C)
    if kind == "heads":  # (.., 3C) as (.., 3, C): my heads' columns of each of q, k and v
        C = full.shape[axis] // 3
        packed = full.reshape(full.shape[:-1] + (3, C))
        n = C // tp
        mine = xp.ascontiguousarray(packed[..., rank * n : (rank + 1) * n])  # (.., 3, C/tp)
        return mine.reshape(full.shape[:-1] + (3 * n,))  # (.., 3C/tp) = [q_r | k_r | v_r]
    n = full.shape[axis] // tp
    sl = [slice(None)] * full.ndim
    sl[axis] = slice(rank * n, (rank + 1) * n)
    return full[tuple(sl)].copy()


def unshard(name: str, pieces: list, V: int):
    """The full parameter from every rank's piece, in rank order (inverse of shard)."""
    xp = backend.array_module(pieces[0])
    split = split_of(name)
    if split is None:
        return pieces[0]
    axis, kind = split
    if kind == "heads":  # each piece is [q_r | k_r | v_r]: regroup as [q | k | v]
        packed = xp.stack([p.reshape(p.shape[:-1] + (3, -1)) for p in pieces], axis=-2)
        return packed.reshape(packed.shape[:-3] + (-1,))
    full = xp.concatenate(pieces, axis=axis)
    return full[:V] if name == "wte.weight" else full


class TensorParallel:
    """Megatron tensor parallelism (optionally with sequence parallelism) x data parallelism.

    The DataParallel runner interface (refmp/parallel/data.py): params and grads are this
    rank's shards, by GPT-2 name.
    """

    def __init__(self, model, grid, sequence_parallel: bool = False, microbatches: int = 1):
        cfg = model.cfg
        self.cfg, self.grid, self.sp, self.M = cfg, grid, sequence_parallel, microbatches
        self.tp, self.dp = grid.comm["tp"], grid.comm["dp"]
        self.eval_comm = self.dp  # a tp group decodes the same prompts together
        n, r = self.tp.size, self.tp.rank
        check_tensor_parallel(cfg.n_head, n, cfg.block_size, False)
        self.V_pad = vocab.padded_vocab(cfg.vocab_size, n)
        self.params = {k: shard(k, v, r, n, self.V_pad) for k, v in model.params.items()}
        self.replicated = [k for k in self.params if split_of(k) is None]
        self.grads: dict = {k: None for k in self.params}
        self.peak_activations = 0  # most bytes one micro-batch's caches held (memory report)
        self.reduce_dp = True  # False under ZeRO (zero_compose.py): it reduce-scatters over dp

    def batch_rows(self, B: int) -> slice:
        if self.M < 1 or B % (self.dp.size * self.M):
            raise ConfigError(f"--batch-size ({B}) must be divisible by dp * microbatches "
                              f"({self.dp.size} * {self.M})")
        return dp_rows(B, self.dp.size, self.dp.rank)

    def zero_grad(self) -> None:
        self.grads = {k: None for k in self.params}

    # --- the model, split ------------------------------------------------------------------

    def forward(self, idx, targets=None, denom=None, sp: bool | None = None, positions=None,
                attention=SERIAL_ATTENTION):
        """(loss share, cache) with targets; (my logits (B, T, Vl), None) without.
        ``positions`` and ``attention``: see refmp.parallel.context_tensor."""
        sp = self.sp if sp is None else sp
        p, tp = self.params, self.tp
        if sp and idx.shape[1] % tp.size:
            raise ConfigError(f"sequence parallelism: T ({idx.shape[1]}) not divisible by tp")
        x, emb = vocab.embed_forward(p, idx, tp, sp, positions)  # (B, T, C) or (B, T/tp, C)
        blocks = []
        for i in range(self.cfg.n_layer):
            x, c = tpl.block_forward(block_params(p, i), x, self.cfg.n_head, tp, sp, attention)
            blocks.append(c)
        if targets is None:
            logits, _ = vocab.logits_forward(p, x, tp, self.cfg.vocab_size, sp)
            return logits, None
        loss, head = vocab.head_forward(p, x, targets, denom, tp, self.cfg.vocab_size, sp)
        return loss, (emb, blocks, head)

    def backward(self, cache) -> None:
        emb, blocks, head = cache
        dx, g = vocab.head_backward(1.0, head, self.tp)
        self._accumulate(g)
        for i in reversed(range(self.cfg.n_layer)):
            dx, g = tpl.block_backward(dx, blocks[i], self.tp)
            self._accumulate({f"h.{i}.{k}": v for k, v in g.items()})
        self._accumulate(vocab.embed_backward(dx, emb, self.tp))

    def _accumulate(self, g: dict) -> None:
        for k, v in g.items():
            self.grads[k] = v if self.grads[k] is None else self.grads[k] + v

    # --- the runner interface --------------------------------------------------------------

    def forward_backward(self, x, y, denom: int) -> float:
        """Gradient accumulation over M micro-batches of consecutive rows; each adds its
        share (its tokens' loss sum / denom) to the loss and gradients."""
        share, b = 0.0, x.shape[0] // self.M
        for m in range(self.M):
            xm, ym = x[m * b : (m + 1) * b].copy(), y[m * b : (m + 1) * b].copy()  # (b/M, T)
            loss, cache = self.forward(xm, ym, denom)
            live = activation_bytes(cache, exclude=self.params.values())
            self.peak_activations = max(self.peak_activations, live)
            self.backward(cache)
            share += float(loss)
        return share

    def reduce_grads(self) -> None:
        if self.sp and self.tp.size > 1:
            # SP: LayerNorms, wpe and the c_proj biases saw T/tp positions on each rank, so
            # their gradients are partial over tp: one packed all-reduce sums them
            arrays = [self.grads[k] for k in self.replicated]
            flat = flatten(arrays)  # (replicated parameters,)
            self.tp.allreduce(flat)
            unflatten_into(flat, arrays)
        if self.reduce_dp:
            allreduce_grads(self.grads, self.dp)  # then the usual sum over data-parallel ranks

    def grad_sum_sq(self, local: float, grads: dict | None = None) -> float:
        """Shards' squares summed over tp; replicated gradients (identical on every tp rank)
        counted once. ``local`` mixes the two, so the split is recomputed here, over
        ``grads`` (default: this rank's; ZeRO passes its dp shard's pieces, by name)."""
        grads = self.grads if grads is None else grads
        repl = sum(float((g ** 2).sum()) for k, g in grads.items() if not split_of(k))
        sharded = sum(float((g ** 2).sum()) for k, g in grads.items() if split_of(k))
        return self.tp.allreduce_scalar(sharded) + repl

    def loss_total(self, share: float) -> float:
        return self.dp.allreduce_scalar(share)  # the share is the same on every tp rank

    def generate(self, idx, n: int):
        """Greedy decoding, the tp group together; without SP, so prompts of any length work
        (SP changes where activations live, not the numbers)."""
        xp = backend.array_module(idx)
        for _ in range(n):
            ctx = idx[:, -self.cfg.block_size:]
            logits, _ = self.forward(ctx, sp=False)  # (B, t, Vl)
            nxt = vocab.argmax_forward(xp.ascontiguousarray(logits[:, -1, :]), self.tp)  # (B,)
            idx = xp.concatenate([idx, nxt[:, None].astype(idx.dtype)], axis=1)
        return idx

    def memory(self) -> dict[str, int]:
        """This rank's peak activation bytes (the Trainer adds params, grads, optimizer)."""
        return {"activations": self.peak_activations}

    def full_params(self) -> dict | None:
        """The full model, unpadded, GPT-2 names, on world rank 0 (collective over tp)."""
        out = gather_shards(self.params, self.tp, self.cfg.vocab_size)
        return out if self.grid.rank == 0 else None


def gather_shards(params: dict, tp: Comm, V: int) -> dict:
    """Every parameter of ``params`` whole, unpadded, on every tp rank (all-gathers over tp)."""
    out = {}
    for k, v in params.items():
        if split_of(k) is None:
            out[k] = v
            continue
        xp, axis = backend.array_module(v), split_of(k)[0]
        moved = xp.moveaxis(v, axis, 0)  # split axis first
        got = tp.allgather(xp.ascontiguousarray(moved))  # (tp * n, ...) pieces in rank order
        pieces = [xp.moveaxis(a, 0, axis) for a in got.reshape((tp.size, -1) + moved.shape[1:])]
        out[k] = unshard(k, pieces, V)
    return out
