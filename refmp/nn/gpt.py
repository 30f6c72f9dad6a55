"""The GPT-2 model (Radford et al. 2019), serial reference, built from refmp.nn.layers.

Shapes: B batch, T time, C channels (n_embd), V vocabulary, L layers (n_layer).

Parameters carry GPT-2's checkpoint names and layouts (a linear weight is stored (in, out)):
``wte.weight`` (V, C), ``wpe.weight`` (T, C), ``h.{i}.ln_1.weight|bias`` (C,),
``h.{i}.attn.c_attn.weight`` (C, 3C), ``h.{i}.attn.c_proj.weight`` (C, C), ``h.{i}.ln_2.*``,
``h.{i}.mlp.c_fc.weight`` (C, 4C), ``h.{i}.mlp.c_proj.weight`` (4C, C), ``ln_f.weight|bias``.
The LM head is tied to ``wte``: logits = x @ wte^T.

The model is split into three kinds of piece, each a forward/backward pair, so that the
parallel strategies can reuse them: ``embed`` (tokens + positions), ``block`` (one
transformer layer) and ``head`` (final LayerNorm, tied LM head, cross-entropy).

Mixture of experts (``n_expert`` > 0): the MLP of block i is an MoE layer (refmp.nn.moe) when
i % moe_every == 0, with ``h.{i}.mlp.router.weight`` (C, E) and ``h.{i}.mlp.experts.{e}.*``
shaped like GPT-2's MLP. Its auxiliary losses are added to the model's loss.
"""

from __future__ import annotations

import math

from refmp import backend
from refmp.nn import layers as L
from refmp.nn import moe as M
from refmp.nn.params import (  # noqa: F401  (re-exported: refmp.nn.gpt is where readers look)
    GPTConfig,
    block_param_shapes,
    block_params,
    init_param,
    init_params,
    param_shapes,
)

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


SERIAL_ATTENTION = (L.attention_forward, L.attention_backward)


def mlp_forward(p: dict, h):
    """GPT-2's MLP: gelu(h W_fc + b_fc) W_proj + b_proj."""
    h, c_fc = L.linear_forward(h, p["mlp.c_fc.weight"], p["mlp.c_fc.bias"])  # (B, T, 4C)
    h, gelu = L.gelu_forward(h)  # (B, T, 4C)
    h, m_proj = L.linear_forward(h, p["mlp.c_proj.weight"], p["mlp.c_proj.bias"])  # (B, T, C)
    return h, (c_fc, gelu, m_proj)


def mlp_backward(dout, cache):
    c_fc, gelu, m_proj = cache
    g = {}
    dh, g["mlp.c_proj.weight"], g["mlp.c_proj.bias"] = L.linear_backward(dout, m_proj)
    dh = L.gelu_backward(dh, gelu)
    dh, g["mlp.c_fc.weight"], g["mlp.c_fc.bias"] = L.linear_backward(dh, c_fc)
    return dh, g


def block_forward(p: dict, x, n_head: int, moe: M.MoEContext | None = None,
                  attention=SERIAL_ATTENTION):
    """One pre-LN transformer block: x + attn(ln_1(x)), then + mlp(ln_2(.)).

    With ``moe``, the MLP is a mixture of experts (refmp.nn.moe); its cache carries its loss.
    ``attention`` is the (forward, backward) pair of the attention core; context parallelism
    passes its own (refmp.parallel.context), everything else in the block stays per token.
    """
    attn_forward, attn_backward = attention
    h, ln1 = L.layernorm_forward(x, p["ln_1.weight"], p["ln_1.bias"])  # (B, T, C)
    qkv, c_attn = L.linear_forward(h, p["attn.c_attn.weight"], p["attn.c_attn.bias"])  # (B, T, 3C)
    a, attn = attn_forward(qkv, n_head)  # (B, T, C)
    attn = (attn_backward, attn)
    a, a_proj = L.linear_forward(a, p["attn.c_proj.weight"], p["attn.c_proj.bias"])  # (B, T, C)
    x = x + a  # (B, T, C) residual
    h, ln2 = L.layernorm_forward(x, p["ln_2.weight"], p["ln_2.bias"])  # (B, T, C)
    h, mlp = mlp_forward(p, h) if moe is None else M.moe_forward(p, h, moe)  # (B, T, C)
    out = x + h  # (B, T, C) residual
    return out, (ln1, c_attn, attn, a_proj, ln2, mlp)


def block_backward(dout, cache, dloss: float = 1.0):
    """Mirror of block_forward; returns dx and the block's gradients (names inside the block).

    ``dloss`` scales the gradient of an MoE layer's own losses (1 for the plain loss).
    """
    ln1, c_attn, attn, a_proj, ln2, mlp = cache
    # forward was: out = x + h   (the residual passes dout to both branches)
    if isinstance(mlp, M.MoECache):
        dh, g = M.moe_backward(dout, mlp, dloss)
    else:
        dh, g = mlp_backward(dout, mlp)
    dx, g["ln_2.weight"], g["ln_2.bias"] = L.layernorm_backward(dh, ln2)
    dx += dout
    # forward was: x = x + a
    da, g["attn.c_proj.weight"], g["attn.c_proj.bias"] = L.linear_backward(dx, a_proj)
    attn_backward, attn = attn
    dqkv = attn_backward(da, attn)
    dh, g["attn.c_attn.weight"], g["attn.c_attn.bias"] = L.linear_backward(dqkv, c_attn)
    dh, g["ln_1.weight"], g["ln_1.bias"] = L.layernorm_backward(dh, ln1)
    return dx + dh, g


# The zero-bubble split of block_backward (Qi et al. 2023, sec. 2): B computes the gradient
# of the block's input, which the previous pipeline stage waits for; W computes the weight
# gradients of the four linears (half of the backward's matrix products), which nobody waits
# for and can be deferred to fill a bubble. LayerNorm gains' gradients are cheap sums that fall
# out of dx's computation, so B keeps them. Together B + W equal block_backward exactly.


def block_backward_input(dout, cache):
    """B pass: returns dx, the LayerNorm gradients, and what the W pass needs (dout per linear)."""
    ln1, c_attn, attn, a_proj, ln2, mlp = cache
    if isinstance(mlp, M.MoECache):
        raise ValueError("the zero-bubble B/W split is written for the dense MLP, not MoE")
    c_fc, gelu, m_proj = mlp
    g, w_todo = {}, []  # w_todo: (name, dout of that linear, its cache)
    # forward was: out = x + h
    w_todo.append(("mlp.c_proj", dout, m_proj))
    dh = L.gelu_backward(L.linear_backward_input(dout, m_proj), gelu)  # (B, T, 4C)
    w_todo.append(("mlp.c_fc", dh, c_fc))
    dx, g["ln_2.weight"], g["ln_2.bias"] = L.layernorm_backward(
        L.linear_backward_input(dh, c_fc), ln2)
    dx += dout
    # forward was: x = x + a
    w_todo.append(("attn.c_proj", dx, a_proj))
    attn_backward, attn = attn
    dqkv = attn_backward(L.linear_backward_input(dx, a_proj), attn)  # (B, T, 3C)
    w_todo.append(("attn.c_attn", dqkv, c_attn))
    dh, g["ln_1.weight"], g["ln_1.bias"] = L.layernorm_backward(
        L.linear_backward_input(dqkv, c_attn), ln1)
    return dx + dh, g, w_todo


def block_backward_weight(w_todo) -> dict:
    """W pass: the linears' weight gradients, dW = x^T dout, from what the B pass kept."""
    g = {}
    for name, dout, cache in w_todo:
        g[f"{name}.weight"], g[f"{name}.bias"] = L.linear_backward_weight(dout, cache)
    return g


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


def head_backward(dloss, cache):
    """Returns dx and the head's gradients (ln_f and its share of the tied wte)."""
    ln_f, h, wte, ce = cache
    dlogits = L.cross_entropy_backward(dloss, ce)  # (B, T, V)
    g = {}
    # forward was: logits = h @ wte^T
    dh = dlogits @ wte  # (B, T, C)
    g["wte.weight"] = dlogits.reshape(-1, dlogits.shape[-1]).T @ h.reshape(-1, h.shape[-1])  # (V, C)
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

    def forward(self, idx, targets=None, denom=None, stats_comm=None, dispatch=None):
        """(loss, cache) given targets (B, T); (logits, None) without them.

        MoE only: ``stats_comm`` sums the routing statistics over the ranks that share the
        global batch (dp); ``dispatch`` says where the experts run (default: all here).
        """
        cfg = self.cfg
        if targets is not None and denom is None:
            denom = idx.size  # the loss is the mean over these tokens
        moe = cfg.moe_context(denom if targets is not None else None, stats_comm, dispatch)
        x, emb = embed_forward(self.params, idx)  # (B, T, C)
        blocks = []
        for i in range(cfg.n_layer):
            x, c = block_forward(block_params(self.params, i), x, cfg.n_head,
                                 moe if cfg.is_moe(i) else None)
            blocks.append(c)
        out, head = head_forward(self.params, x, targets, denom)
        if targets is not None and cfg.n_expert:
            out = out + sum(c[-1].loss for c in blocks if isinstance(c[-1], M.MoECache))
        return out, (emb, blocks, head)

    def backward(self, cache, dloss=1.0, on_ready=None) -> None:
        """Accumulate gradients into self.grads (call zero_grad first for a fresh step).

        ``on_ready(names)``, if given, is called as soon as the gradients of ``names`` are
        complete (head, then blocks in reverse, then embeddings), so that a data-parallel
        runner can start reducing them while backward goes on (refmp.parallel.data).
        """
        ready = on_ready or (lambda names: None)
        emb, blocks, head = cache
        dx, g = head_backward(dloss, head)
        self._accumulate(g)
        ready([k for k in g if k != "wte.weight"])  # wte waits for the embedding's share
        for i in reversed(range(self.cfg.n_layer)):
            dx, g = block_backward(dx, blocks[i], dloss)
            self._accumulate({f"h.{i}.{k}": v for k, v in g.items()})
            ready([f"h.{i}.{k}" for k in g])
        g = embed_backward(dx, emb)
        self._accumulate(g)  # wte also gets the head's share: tied
        ready(list(g))

    def zero_grad(self) -> None:
        self.grads = {k: None for k in self.params}

    def _accumulate(self, g: dict) -> None:
        for k, v in g.items():
            self.grads[k] = v if self.grads[k] is None else self.grads[k] + v

    @staticmethod
    def moe_stats(cache) -> dict:
        """The MoE layers' global routing statistics of a forward (empty for a dense model)."""
        layers = [c[-1].stats for c in cache[1] if isinstance(c[-1], M.MoECache)]
        if not layers:
            return {}
        return {"moe": {"tokens_per_expert": [s["tokens_per_expert"] for s in layers],
                        "dropped": [s["dropped"] for s in layers],
                        "aux_loss": sum(s["aux_loss"] for s in layers),
                        "z_loss": sum(s["z_loss"] for s in layers)}}

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
