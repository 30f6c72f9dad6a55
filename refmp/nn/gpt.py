"""The GPT-2 model (Radford et al. 2019), serial reference, built from refmp.nn.layers.

Shapes: B batch, T time, C channels (n_embd), V vocabulary, L layers (n_layer).

Parameters carry GPT-2's checkpoint names and layouts (a linear weight is stored (in, out)):
``wte.weight`` (V, C), ``wpe.weight`` (T, C), ``h.{i}.ln_1.weight|bias`` (C,),
``h.{i}.attn.c_attn.weight`` (C, 3C), ``h.{i}.attn.c_proj.weight`` (C, C), ``h.{i}.ln_2.*``,
``h.{i}.mlp.c_fc.weight`` (C, 4C), ``h.{i}.mlp.c_proj.weight`` (4C, C), ``ln_f.weight|bias``.
The LM head is tied to ``wte``: logits = x @ wte^T.

The model is split into three kinds of piece, each a forward/backward pair, so that the
parallel strategies can reuse them: ``embed`` (tokens + positions), ``block`` (one
transformer layer) and ``head`` (final LayerNorm, tied LM head, cross-entropy). The block is
written once, against an :class:`Ops` object that runs its linears and its attention core:
the serial Ops here, or refmp.parallel.ops.ParallelOps for every parallel layout.

Mixture of experts (``n_expert`` > 0): the MLP of block i is an MoE layer (refmp.nn.moe) when
i % moe_every == 0, with ``h.{i}.mlp.router.weight`` (C, E) and ``h.{i}.mlp.experts.{e}.*``
shaped like GPT-2's MLP. Its auxiliary losses are added to the model's loss.
"""

from __future__ import annotations

import math
from collections import namedtuple

from refmp.nn import fast as L  # refmp.nn.layers' formulas, run fast (refmp.nn.fast)
from refmp.nn import moe as M
from refmp.nn.params import (  # noqa: F401  (re-exported: refmp.nn.gpt is where readers look)
    GPTConfig,
    block_param_shapes,
    block_params,
    init_param,
    init_params,
    param_shapes,
)
from refmp.runtime import backend
from refmp.runtime.precision import autocast

# --- the pieces -----------------------------------------------------------------------------


def embed_forward(p: dict, idx, pos_offset: int = 0, positions=None):
    """x = wte[idx] + wpe[positions]; positions start at ``pos_offset``, or are given (T,)."""
    xp = backend.array_module(p["wte.weight"])
    T = idx.shape[1]
    if positions is None:
        positions = xp.arange(pos_offset, pos_offset + T)  # (T,)
    tok, tok_cache = L.embedding_forward(idx, p["wte.weight"])  # (B, T, C)
    pos, pos_cache = L.embedding_forward(positions, p["wpe.weight"])
    return tok + pos, (tok_cache, pos_cache)  # (B, T, C)


def embed_backward(dx, cache) -> dict:
    tok_cache, pos_cache = cache
    return {
        "wte.weight": L.embedding_backward(dx, tok_cache),
        "wpe.weight": L.embedding_backward(dx.sum(axis=0), pos_cache),  # positions shared by B
    }


class Ops:
    """The pieces one block is made of, serial; refmp.parallel.ops.ParallelOps splits them.

    ``column`` and ``row`` are the linears that enter and leave a parallel region (here plain
    linears, y = x W + b); ``attention`` is the core softmax(q k^T / sqrt(HS)) v on this rank's
    ``n_head`` heads; ``embed`` and ``head`` are the model's two ends. A block written against
    these (block_forward below) runs unchanged under tensor, sequence, context and expert
    parallelism: only the Ops change.
    """

    def __init__(self, n_head: int, keep_scores: bool = True):
        self.n_head = n_head  # heads this rank computes
        self.keep_scores = keep_scores  # False: selective recomputation of the softmax

    def column(self, x, w, b):
        return L.linear_forward(x, w, b)  # (B, T, out)

    def row(self, x, w, b):
        return L.linear_forward(x, w, b)  # (B, T, out)

    def linear_backward(self, dout, cache):
        return L.linear_backward(dout, cache)  # dx, dw, db

    def linear_backward_input(self, dout, cache):
        """Zero bubble's B half: dx now, and what the W half needs."""
        return L.linear_backward_input(dout, cache), (dout, cache)

    def linear_backward_weight(self, item):
        """Zero bubble's W half: dw, db."""
        return L.linear_backward_weight(*item)

    def attention(self, qkv):
        return L.attention_forward(qkv, self.n_head, self.keep_scores)  # (B, T, C)

    def attention_backward(self, da, cache):
        return L.attention_backward(da, cache)  # (B, T, 3C)

    def embed(self, p: dict, idx):
        return embed_forward(p, idx)  # (B, T, C)

    def embed_backward(self, dx, cache) -> dict:
        return embed_backward(dx, cache)

    def head(self, p: dict, x, targets=None, denom=None):
        return head_forward(p, x, targets, denom)  # loss share, or logits (B, T, V)

    def head_backward(self, dloss, cache):
        return head_backward(dloss, cache)


# What one block's backward needs: each piece's cache, in forward order; ``mlp`` is an
# MLPCache (c_fc, gelu, c_proj), or with a mixture of experts an MoECache (with its loss).
MLPCache = namedtuple("MLPCache", "c_fc gelu c_proj")
BlockCache = namedtuple("BlockCache", "ln_1 c_attn attn a_proj ln_2 mlp")


def block_forward(p: dict, x, ops: Ops, moe: M.MoEContext | None = None):
    """One pre-LN transformer block: x + attn(ln_1(x)), then + mlp(ln_2(.)).

    With ``moe``, the MLP is a mixture of experts (refmp.nn.moe); its cache carries its loss.
    ``ops`` runs the linears and the attention core (serial here; see Ops).
    """
    h, ln1 = L.layernorm_forward(x, p["ln_1.weight"], p["ln_1.bias"])  # like x
    qkv, c_attn = ops.column(h, p["attn.c_attn.weight"], p["attn.c_attn.bias"])  # (B, T, 3C)
    a, attn = ops.attention(qkv)  # (B, T, C)
    a, a_proj = ops.row(a, p["attn.c_proj.weight"], p["attn.c_proj.bias"])  # like x
    x = x + a  # residual
    h, ln2 = L.layernorm_forward(x, p["ln_2.weight"], p["ln_2.bias"])  # like x
    if moe is None:  # GPT-2's MLP: gelu(h W_fc + b_fc) W_proj + b_proj
        h, c_fc = ops.column(h, p["mlp.c_fc.weight"], p["mlp.c_fc.bias"])  # (B, T, 4C)
        h, gelu = L.gelu_forward(h)  # (B, T, 4C)
        h, m_proj = ops.row(h, p["mlp.c_proj.weight"], p["mlp.c_proj.bias"])  # like x
        mlp = MLPCache(c_fc, gelu, m_proj)
    else:
        h, mlp = M.moe_forward(p, h, moe)  # like x
    return x + h, BlockCache(ln1, c_attn, attn, a_proj, ln2, mlp)  # residual


def block_backward(dout, cache: BlockCache, ops: Ops, todo: list | None = None, dloss: float = 1.0):
    """Mirror of block_forward; returns dx and the block's gradients (names inside the block).

    ``todo``: the zero-bubble split (Qi et al. 2023, sec. 2). Given a list, the four linears'
    weight gradients are not computed but their inputs appended to it, for
    block_backward_weight to do later (W); everything else, dx included (B), is done now.
    An MoE MLP does its whole backward in B. ``dloss`` scales the gradient of an MoE layer's
    own losses (1 for the plain loss).
    """
    g = {}

    def linear(name: str, d, c):
        if todo is None:
            dx, g[f"{name}.weight"], g[f"{name}.bias"] = ops.linear_backward(d, c)
            return dx
        dx, item = ops.linear_backward_input(d, c)
        todo.append((name, item))
        return dx

    # forward was: out = x + h   (the residual passes dout to both branches)
    mlp = cache.mlp
    if isinstance(mlp, M.MoECache):
        dh, gm = M.moe_backward(dout, mlp, dloss)
        g.update(gm)
    else:
        dh = L.gelu_backward(linear("mlp.c_proj", dout, mlp.c_proj), mlp.gelu)  # (B, T, 4C)
        dh = linear("mlp.c_fc", dh, mlp.c_fc)  # like x
    dx, g["ln_2.weight"], g["ln_2.bias"] = L.layernorm_backward(dh, cache.ln_2)
    dx += dout
    # forward was: x = x + a
    dqkv = ops.attention_backward(linear("attn.c_proj", dx, cache.a_proj), cache.attn)  # (B, T, 3C)
    dh = linear("attn.c_attn", dqkv, cache.c_attn)
    dh, g["ln_1.weight"], g["ln_1.bias"] = L.layernorm_backward(dh, cache.ln_1)
    return dx + dh, g


def block_backward_weight(todo: list, ops: Ops) -> dict:
    """Zero bubble's W pass: dW = x^T dout (and db) of the linears block_backward deferred."""
    g = {}
    for name, item in todo:
        g[f"{name}.weight"], g[f"{name}.bias"] = ops.linear_backward_weight(item)
    return g


@autocast
def head_forward(p: dict, x, targets=None, denom=None):
    """Final LayerNorm, tied LM head (logits = x wte^T), and cross-entropy if targets given.

    Returns (loss, cache) with targets, else (logits, cache).
    """
    h, ln_f = L.layernorm_forward(x, p["ln_f.weight"], p["ln_f.bias"])  # (B, T, C)
    logits = h @ p["wte.weight"].T  # (B, T, V)
    if targets is None:
        return logits, None
    loss, ce = L.cross_entropy_forward(logits, targets, denom)
    return loss, (ln_f, h, p["wte.weight"], ce)


@autocast
def head_backward(dloss, cache):
    """Returns dx and the head's gradients (ln_f and its share of the tied wte)."""
    ln_f, h, wte, ce = cache
    g = {}
    # forward was: logits = h @ wte^T, then the cross-entropy
    dh, g["wte.weight"] = L.tied_head_backward(dloss, ce, h, wte)  # (B, T, C), (V, C)
    dx, g["ln_f.weight"], g["ln_f.bias"] = L.layernorm_backward(dh, ln_f)
    return dx, g


# --- the whole model -------------------------------------------------------------------------


class GPT:
    """Holds parameters and their gradients; forward returns a cache that backward consumes."""

    def __init__(self, cfg: GPTConfig, params: dict):
        self.cfg = cfg
        self.params = params
        self.grads = {k: None for k in params}

    @classmethod
    def create(cls, cfg: GPTConfig, seed: int = 0, dtype="float32") -> GPT:
        return cls(cfg, init_params(cfg, seed, dtype))

    def num_params(self) -> int:
        return sum(math.prod(s) for s in param_shapes(self.cfg).values())  # also when sharded

    def forward(self, idx, targets=None, denom=None, dispatch=None, ops: Ops | None = None):
        """(loss, cache) given targets (B, T); (logits, cache) without them.

        ``denom``: the token count the loss is a mean over (default: these B T tokens; a
        rank holding part of the batch passes the global count, so its loss is its share).
        ``ops``: the pieces the model runs on (default the serial Ops; a layout's
        refmp.parallel.ops.ParallelOps, with ``self.params`` holding this rank's shards,
        runs the model split). MoE only: ``dispatch`` says where the experts run (default:
        all here).
        """
        cfg = self.cfg
        ops = Ops(cfg.n_head) if ops is None else ops
        if targets is not None and denom is None:
            denom = idx.size  # the loss is the mean over these tokens
        moe = cfg.moe_context(denom if targets is not None else None, dispatch)
        x, emb = ops.embed(self.params, idx)  # (B, T, C)
        blocks = []
        for i in range(cfg.n_layer):
            x, c = block_forward(block_params(self.params, i), x, ops,
                                 moe if cfg.is_moe(i) else None)
            blocks.append(c)
        out, head = ops.head(self.params, x, targets, denom)
        if targets is not None and cfg.n_expert:
            out = out + sum(c.mlp.loss for c in blocks if isinstance(c.mlp, M.MoECache))
        return out, (emb, blocks, head)

    def backward(self, cache, dloss=1.0, ops: Ops | None = None) -> None:
        """Accumulate gradients into self.grads (call zero_grad first for a fresh step).

        ``ops``: the Ops the forward ran on (default the serial Ops).
        """
        ops = Ops(self.cfg.n_head) if ops is None else ops
        emb, blocks, head = cache
        dx, g = ops.head_backward(dloss, head)
        self.accumulate(g)
        for i in reversed(range(self.cfg.n_layer)):
            dx, g = block_backward(dx, blocks[i], ops, dloss=dloss)
            self.accumulate(g, prefix=f"h.{i}.")
        self.accumulate(ops.embed_backward(dx, emb))  # wte also gets the head's share: tied

    def zero_grad(self) -> None:
        self.grads = {k: None for k in self.params}

    def accumulate(self, g: dict, prefix: str = "") -> None:
        """Add gradients ``g`` into self.grads; ``prefix`` + name is the parameter's name
        (``h.{i}.`` for a block's gradients, named inside the block)."""
        for k, v in g.items():
            name = prefix + k
            self.grads[name] = v if self.grads[name] is None else self.grads[name] + v

    def generate(self, idx, max_new_tokens: int, dispatch=None):
        """Greedy decoding: append the most likely next token, max_new_tokens times.

        Recomputes the whole prefix each step (no KV cache): simple, and fine for the short
        answers refmp decodes.
        """
        xp = backend.array_module(idx)
        for _ in range(max_new_tokens):
            ctx = idx[:, -self.cfg.block_size :]
            logits, _ = self.forward(ctx, dispatch=dispatch)
            nxt = logits[:, -1, :].argmax(axis=-1)  # (B,)
            idx = xp.concatenate([idx, nxt[:, None].astype(idx.dtype)], axis=1)
        return idx

