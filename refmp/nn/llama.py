"""A Llama-family model (Touvron et al. 2023), serial reference, built from
refmp.nn.llama_layers: pre-RMSNorm blocks, grouped-query attention with rotary positions,
a SwiGLU MLP, no biases, a tied or untied head.

Shapes: B batch, T time, C channels (n_embd), V vocabulary, L layers, NH query heads,
NKV key/value heads, HS head size (C/NH), F the MLP's width (n_inner).

Parameter names follow refmp's GPT-2 names where the piece is the same (``wte``, ``h.{i}.``,
``ln_1``, ``ln_2``, ``ln_f``) and Hugging Face Llama's projection names inside a block; a
linear weight is stored (in, out) as everywhere in refmp (refmp.checkpoint.hf_llama
transposes to and from a LlamaForCausalLM directory):

    wte.weight (V, C)                      h.{i}.ln_1.weight (C,)     (input_layernorm)
    h.{i}.attn.q_proj.weight (C, NH HS)    h.{i}.attn.k_proj.weight (C, NKV HS)
    h.{i}.attn.v_proj.weight (C, NKV HS)   h.{i}.attn.o_proj.weight (NH HS, C)
    h.{i}.ln_2.weight (C,)                 (post_attention_layernorm)
    h.{i}.mlp.gate_proj.weight (C, F)      h.{i}.mlp.up_proj.weight (C, F)
    h.{i}.mlp.down_proj.weight (F, C)      ln_f.weight (C,)            (model.norm)
    lm_head.weight (V, C)                  only when the head is untied

With ``n_expert`` (Mixtral) each block's MLP is ``h.{i}.mlp.router.weight`` (C, E) and
``h.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``. The configuration, the shapes and the
initialization are refmp.nn.llama_params.
"""

from __future__ import annotations

import math
from collections import namedtuple

from refmp.nn import layers as L
from refmp.nn import llama_layers as LL
from refmp.nn import moe as M
from refmp.nn.llama_params import (  # noqa: F401  (re-exported: refmp.nn.llama is where readers look)
    LlamaConfig,
    block_param_shapes,
    init_params,
    param_shapes,
)
from refmp.nn.params import block_params
from refmp.runtime import backend
from refmp.runtime.precision import autocast

# --- the pieces: block and head -------------------------------------------------------------


class Ops:
    """What a layout changes in a Llama block, serial here (refmp.parallel.tensor.llama
    splits it over tp): the heads this rank computes (``n_head`` query, ``n_kv_head``
    key/value), Megatron's f and g around the parallel region (``enter`` before the q, k, v
    and gate, up projections, ``leave`` after o_proj and down_proj: identity here), the
    attention (refmp.nn.llama_layers.gqa_forward over ``core``, the serial core or cp's) and
    the global ``positions`` (T,) of the tokens (None: 0 .. T-1) for the rotary tables;
    ``sequence`` the tokens the residual stream keeps (sequence parallelism: T/tp)."""

    sequence_shards = 1  # sequence parallelism: the residual stream holds T/tp tokens

    def __init__(self, n_head: int, n_kv_head: int, core=None, positions=None):
        self.n_head = n_head
        self.n_kv_head = n_kv_head
        self.core = LL.SerialCore() if core is None else core
        self.positions = positions

    def sequence(self, a):
        return a  # the tokens of (B, T, ...) the residual stream holds here: all

    def enter(self, h):
        return h  # f forward

    def enter_backward(self, dh):
        return dh  # f backward

    def leave(self, z):
        return z  # g forward

    def leave_backward(self, dz):
        return dz  # g backward

    def attention(self, q, k, v, cos, sin):
        return LL.gqa_forward(q, k, v, self.n_head, self.n_kv_head, cos, sin, self.core)

    def attention_backward(self, da, cache):
        return LL.gqa_backward(da, cache)  # dq, dk, dv


# What one block's backward needs, in forward order
AttnCache = namedtuple("AttnCache", "ln_1 q k v core o")
MLPCache = namedtuple("MLPCache", "ln_2 gate up swiglu down")
MoEMLPCache = namedtuple("MoEMLPCache", "ln_2 moe")  # moe: refmp.nn.moe.MoECache
BlockCache = namedtuple("BlockCache", "attn mlp")


def block_forward(p: dict, x, cfg: LlamaConfig, cos, sin, ops: Ops, moe=None):
    """x + attn(rmsnorm_1(x)), then + mlp(rmsnorm_2(.)); rotary tables (T, HS) of x's tokens.
    Under tp the projections hold this rank's heads and columns (``/tp`` below). ``moe``
    (LlamaConfig.moe_context): the MLP is Mixtral's mixture of SwiGLU experts (its cache
    carries its loss)."""
    h, ln_1 = LL.rmsnorm_forward(x, p["ln_1.weight"], cfg.rms_eps)  # (B, T, C)
    h = ops.enter(h)
    q, cq = L.linear_forward(h, p["attn.q_proj.weight"])  # (B, T, NH HS /tp)
    k, ck = L.linear_forward(h, p["attn.k_proj.weight"])  # (B, T, NKV HS /tp)
    v, cv = L.linear_forward(h, p["attn.v_proj.weight"])  # (B, T, NKV HS /tp)
    a, core = ops.attention(q, k, v, cos, sin)  # (B, T, NH HS /tp)
    a, co = L.linear_forward(a, p["attn.o_proj.weight"])  # (B, T, C) partial over tp
    x = x + ops.leave(a)  # residual
    h, ln_2 = LL.rmsnorm_forward(x, p["ln_2.weight"], cfg.rms_eps)  # (B, T, C)
    attn = AttnCache(ln_1, cq, ck, cv, core, co)
    if moe is not None:
        h, mc = M.moe_forward(p, h, moe)  # (B, T, C)
        return x + h, BlockCache(attn, MoEMLPCache(ln_2, mc))
    h = ops.enter(h)
    g, cg = L.linear_forward(h, p["mlp.gate_proj.weight"])  # (B, T, F /tp)
    u, cu = L.linear_forward(h, p["mlp.up_proj.weight"])  # (B, T, F /tp)
    s, sw = LL.swiglu_forward(g, u)  # (B, T, F /tp)
    h, cd = L.linear_forward(s, p["mlp.down_proj.weight"])  # (B, T, C) partial over tp
    cache = BlockCache(attn, MLPCache(ln_2, cg, cu, sw, cd))
    return x + ops.leave(h), cache  # residual


def block_backward(dout, cache: BlockCache, ops: Ops, dloss: float = 1.0):
    """Mirror of block_forward; returns dx and the block's gradients (names inside it).
    ``dloss`` scales the gradient of an MoE layer's own losses."""
    g = {}
    m, a = cache.mlp, cache.attn
    # forward was: out = x + leave(h)   (the residual passes dout to both branches)
    if isinstance(m, MoEMLPCache):
        dh, gm = M.moe_backward(dout, m.moe, dloss)
        g.update(gm)
        dx, g["ln_2.weight"] = LL.rmsnorm_backward(dh, m.ln_2)
    else:
        ds, g["mlp.down_proj.weight"], _ = L.linear_backward(ops.leave_backward(dout), m.down)
        dg, du = LL.swiglu_backward(ds, m.swiglu)  # (B, T, F /tp)
        dh, g["mlp.gate_proj.weight"], _ = L.linear_backward(dg, m.gate)  # (B, T, C) partial
        dhu, g["mlp.up_proj.weight"], _ = L.linear_backward(du, m.up)
        dx, g["ln_2.weight"] = LL.rmsnorm_backward(ops.enter_backward(dh + dhu), m.ln_2)
    dx += dout
    # forward was: x = x + leave(a)
    da, g["attn.o_proj.weight"], _ = L.linear_backward(ops.leave_backward(dx), a.o)
    dq, dk, dv = ops.attention_backward(da, a.core)
    dh, g["attn.q_proj.weight"], _ = L.linear_backward(dq, a.q)  # (B, T, C) partial
    dhk, g["attn.k_proj.weight"], _ = L.linear_backward(dk, a.k)
    dhv, g["attn.v_proj.weight"], _ = L.linear_backward(dv, a.v)
    dh, g["ln_1.weight"] = LL.rmsnorm_backward(ops.enter_backward(dh + dhk + dhv), a.ln_1)
    return dx + dh, g


def head_weight_name(cfg: LlamaConfig) -> str:
    """The (V, C) matrix the logits are read with: wte when tied, else lm_head."""
    return "wte.weight" if cfg.tied else "lm_head.weight"


@autocast
def head_forward(p: dict, x, cfg: LlamaConfig, targets=None, denom=None):
    """Final RMSNorm, logits = h W^T (W: head_weight_name), cross-entropy if targets given."""
    w = p[head_weight_name(cfg)]
    h, ln_f = LL.rmsnorm_forward(x, p["ln_f.weight"], cfg.rms_eps)  # (B, T, C)
    logits = h @ w.T  # (B, T, V)
    if targets is None:
        return logits, None
    loss, ce = L.cross_entropy_forward(logits, targets, denom)
    return loss, (ln_f, h, w, ce)


@autocast
def head_backward(dloss, cache, cfg: LlamaConfig):
    """Returns dx and the head's gradients (ln_f and the head matrix)."""
    ln_f, h, w, ce = cache
    dlogits = L.cross_entropy_backward(dloss, ce)  # (B, T, V)
    g = {}
    # forward was: logits = h @ w^T
    dh = dlogits @ w  # (B, T, C)
    g[head_weight_name(cfg)] = dlogits.reshape(-1, w.shape[0]).T @ h.reshape(-1, h.shape[-1])
    dx, g["ln_f.weight"] = LL.rmsnorm_backward(dh, ln_f)
    return dx, g


# --- the whole model -------------------------------------------------------------------------


class Llama:
    """Holds parameters and their gradients; forward returns a cache that backward consumes
    (the interface of refmp.nn.gpt.GPT)."""

    def __init__(self, cfg: LlamaConfig, params: dict):
        self.cfg = cfg
        self.params = params
        self.grads = {k: None for k in params}

    @classmethod
    def create(cls, cfg: LlamaConfig, seed: int = 0, dtype="float32") -> Llama:
        return cls(cfg, init_params(cfg, seed, dtype))

    def num_params(self) -> int:
        return sum(math.prod(s) for s in param_shapes(self.cfg).values())

    def rope(self, positions):
        """The rotary tables (T, HS) of the tokens at ``positions`` (T,)."""
        dtype = self.params["wte.weight"].dtype
        return LL.rope_tables(positions, self.cfg.head_size, self.cfg.rope_theta, dtype)

    def ops(self) -> Ops:
        """The serial Ops: every head here."""
        return Ops(self.cfg.n_head, self.cfg.n_kv_head)

    def forward(self, idx, targets=None, denom=None, ops: Ops | None = None, dispatch=None):
        """(loss, cache) given targets (B, T); (logits, cache) without them. ``denom``: the
        token count the loss is a mean over (default: these B T tokens; a rank holding part
        of the batch or of the sequence passes the global count, so its loss is its share).
        ``ops``: a layout's (default the serial Ops); ``dispatch``: where an MoE model's
        experts run (LlamaConfig.moe_context)."""
        cfg = self.cfg
        ops = self.ops() if ops is None else ops
        xp = backend.array_module(self.params["wte.weight"])
        if targets is not None and denom is None:
            denom = idx.size
        positions = xp.arange(idx.shape[1]) if ops.positions is None else ops.positions
        cos, sin = self.rope(positions)  # (T, HS) each, at the tokens' global positions
        x, emb = L.embedding_forward(idx, self.params["wte.weight"])  # (B, T, C)
        moe = cfg.moe_context(denom if targets is not None else None, dispatch)
        blocks = []
        for i in range(cfg.n_layer):
            x, c = block_forward(block_params(self.params, i), x, cfg, cos, sin, ops, moe)
            blocks.append(c)
        out, head = head_forward(self.params, x, cfg, targets, denom)
        if targets is not None and moe is not None:  # the MoE layers' loss shares (0 here)
            out = out + sum(c.mlp.moe.loss for c in blocks)
        return out, (emb, blocks, head, ops)

    def backward(self, cache, dloss=1.0) -> None:
        """Accumulate gradients into self.grads (zero_grad first for a fresh step)."""
        emb, blocks, head, ops = cache
        dx, g = head_backward(dloss, head, self.cfg)
        self.accumulate(g)
        for i in reversed(range(self.cfg.n_layer)):
            dx, g = block_backward(dx, blocks[i], ops, dloss)
            self.accumulate(g, prefix=f"h.{i}.")
        # a tied head has already added its share to wte's gradient
        self.accumulate({"wte.weight": L.embedding_backward(dx, emb)})

    def zero_grad(self) -> None:
        self.grads = {k: None for k in self.params}

    def accumulate(self, g: dict, prefix: str = "") -> None:
        for k, v in g.items():
            name = prefix + k
            self.grads[name] = v if self.grads[name] is None else self.grads[name] + v
