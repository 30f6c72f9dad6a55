"""What the Decoder (refmp.inference.decoder) asks of a model family: GPT-2's block
(refmp.nn.gpt) or the Llama family's (refmp.nn.llama), chosen by the model's configuration.

Shapes: B rows on this rank, t tokens of one call, C channels, NH = n_head/tp query heads
here, NKV key/value heads here, HS head size, V vocabulary, Vl = Vp/tp vocabulary rows here.

The Decoder keeps the machinery every family shares: the pipeline's chunks and the
activations sent stage to stage, the cp chunks of a prompt and the rank that keeps each
decoded token, the cache's slots, the last stage's token handed back to the first, dp's rows.
A family answers the rest, for this rank's share:

* ``shards``: the parameters a rank holds (its blocks, the ends of its stage), tp-sharded,
  read slice by slice from a Source or cut from a whole model;
* ``cache_heads``: the key/value heads its cache keeps (NH/tp for GPT-2; NKV/tp, or the one
  replicated head when tp > NKV, for Llama);
* ``ops`` and ``core``: the layout's Ops around the cached attention core of one layer
  (refmp.inference.attention.CachedAttention: GPT-2's [q | k | v], or on heads for Llama's
  grouped-query attention), and ``ring``: cp's ring attention for a prefill;
* ``embed``, ``block``, ``logits``: the tokens in, one block, the full logits (B, V) out;
* ``moe``: the expert layers' MoE context, each token to its top-k experts, sent over ep to
  the ranks that hold them (GPT-2's MLPs, or a Mixtral-style model's SwiGLU experts).

Llama's rotary tables come from each call's global positions (a cp rank's zig-zag chunks in
a prefill, T0 + j for decoded token j), as training's cp does (refmp.parallel.context.gqa_ring):
a cached key is rotated once, at its own position, and never again.
"""

from __future__ import annotations

import dataclasses

from refmp.errors import ConfigError
from refmp.inference.attention import CachedAttention, RowByRow
from refmp.nn import gpt, swiglu_experts
from refmp.nn import llama as LM
from refmp.nn import llama_layers as LL
from refmp.nn.llama import LlamaConfig
from refmp.nn.params import block_params
from refmp.parallel.context.gqa_ring import GQARingAttention
from refmp.parallel.context.ring import RingAttention
from refmp.parallel.family import LlamaFamily as TrainFamily
from refmp.parallel.folding import dispatch_for
from refmp.parallel.ops import make_ops
from refmp.parallel.placement import held_indices, shards_held
from refmp.parallel.tensor import llama as TPL
from refmp.parallel.tensor import vocab
from refmp.runtime import backend


def family_of(mcfg):
    """The family of a model configuration: LlamaConfig -> Llama, GPTConfig -> GPT-2."""
    return LlamaFamily(mcfg) if isinstance(mcfg, LlamaConfig) else GPT2Family(mcfg)


class GPT2Family:
    """GPT-2's pieces as training splits them (refmp.parallel.ops.make_ops, placement)."""

    def __init__(self, mcfg):
        self.mcfg = mcfg

    def shards(self, weights, blocks, first: bool, last: bool, tp, ep, dtype) -> dict:
        """This rank's tp shard of every parameter it holds: read slice by slice from a Source,
        or cut from the whole model (a dict)."""
        cfg = self.mcfg
        if isinstance(weights, dict):
            held = shards_held(weights, blocks, first, last, tp, ep, cfg.n_expert)
            return held if dtype is None else {k: v.astype(dtype) for k, v in held.items()}
        want = held_indices(gpt.param_shapes(cfg), blocks, first, last, tp, ep, cfg.n_expert)
        return {k: backend.from_host(weights.read(k, index, dtype)) for k, index in want.items()}

    def cache_heads(self, tp) -> int:
        return self.mcfg.n_head // tp.size  # NH/tp: multi-head attention

    def moe(self, grid, capacity: bool):
        """The MoE context of every expert layer: each token to its top-k (no capacity limit
        unless asked), over ``grid``'s ep (folded over etp with --etp) if split; None for a
        dense model."""
        mcfg = self.mcfg
        if not mcfg.n_expert:
            return None
        dispatch = dispatch_for(grid, mcfg.n_expert, False)
        routing = mcfg if capacity else dataclasses.replace(mcfg, capacity_factor=0.0)
        return routing.moe_context(None, dispatch)

    def ring(self, cp, chunks):
        return RingAttention(cp, chunks)

    def core(self, call, layer: int):
        return CachedAttention(call, layer)

    def ops(self, tp, positions, attn=None):
        return make_ops(self.mcfg.n_head, self.mcfg.vocab_size, tp, attn=attn,
                        positions=positions)

    def embed(self, ops, params: dict, ids):
        p = {k: params[k] for k in ("wte.weight", "wpe.weight")}
        return ops.embed(p, ids)[0]  # (B, t, C): token and position embeddings

    def block(self, params: dict, i: int, x, ops, moe, rows_apart: bool = False):
        ops = RowByRow(ops) if rows_apart else ops
        moe = moe if self.mcfg.is_moe(i) else None
        return gpt.block_forward(block_params(params, i), x, ops, moe)[0]  # (B, t, C)

    def logits(self, ops, params: dict, x_last, tp):
        """ln_f and the tied head on x_last (B, 1, C); with tp the vocabulary shards
        all-gathered: (B, V)."""
        p = {k: params[k] for k in ("ln_f.weight", "ln_f.bias", "wte.weight")}
        logits, _ = ops.head(p, x_last)  # (B, 1, V); with tp my shard (B, 1, Vl)
        if tp.size == 1:
            return logits[:, 0]  # (B, V)
        return vocab.gather_logits(logits[:, 0], tp, self.mcfg.vocab_size)  # (B, V)


class DecoderGQA(CachedAttention):
    """The cached core on heads, for grouped-query attention (the core of
    refmp.nn.llama_layers.gqa_forward: ``forward(q, k, v)`` with q (B, NH, t, HS) and k, v
    (B, NKV, t, HS), already rotated at their global positions): a prefill appends k, v and
    attends serially or by cp's ring (NKV heads travel); a decode step is CachedAttention's."""

    def forward(self, q, k, v):
        call = self.call
        if not call.prefill:
            return self.decode(q, k, v), None  # (B, NH, 1, HS)
        call.cache.append_rows(self.layer, call.slots, k, v)  # this rank's tokens, rotated
        core = LL.SerialCore() if call.ring is None else call.ring
        return core.forward(q, k, v)[0], None  # (B, NH, t, HS)


class LlamaFamily:
    """The Llama family's pieces (refmp.nn.llama; tp's split: refmp.parallel.tensor.llama).
    The RMSNorms, the embedding and the head are replicated over tp: every tp rank computes
    the full logits."""

    def __init__(self, cfg: LlamaConfig):
        self.mcfg = cfg

    def shards(self, weights, blocks, first: bool, last: bool, tp, ep, dtype) -> dict:
        """This rank's share as training holds it (refmp.parallel.family.LlamaFamily: the
        blocks this rank runs, of a Mixtral block's experts only its ep rank's, wte on the
        first stage (and the last, when the head is tied), ln_f and lm_head on the last;
        each parameter's tp shard, the one key/value head it replicates when tp > NKV):
        read slice by slice from a Source (a LlamaForCausalLM directory:
        refmp.checkpoint.llama_files.LlamaSource, ``read(name, index, dtype)``), or cut
        from the whole model (a dict of refmp.nn.llama's names,
        refmp.parallel.tensor.llama.shard)."""
        cfg = self.mcfg
        TPL.check_tp(cfg, tp.size)
        split = TrainFamily(cfg)  # which parameters a rank holds, and its tp shard's Index
        mine = set(blocks)
        if not isinstance(weights, dict):
            want = {k: split.shard_index(k, shape, tp.rank, tp.size)
                    for k, shape in split.shapes().items()
                    if split.holds(k, mine, first, last, ep.rank, ep.size)}
            return {k: backend.from_host(weights.read(k, index, dtype))
                    for k, index in want.items()}
        out = {}
        for k, v in weights.items():
            if split.holds(k, mine, first, last, ep.rank, ep.size):
                w = TPL.shard(k, v, cfg, tp.rank, tp.size)
                out[k] = w if dtype is None else w.astype(dtype)
        return out

    def cache_heads(self, tp) -> int:
        return len(TPL.kv_heads(self.mcfg, tp.rank, tp.size))  # NKV/tp, or 1 replicated

    def moe(self, grid, capacity: bool):
        """Mixtral's MoE context (no capacity limit: ``capacity`` has nothing to ask), its
        SwiGLU experts dispatched over ``grid``'s ep by all-to-all if split, as training's
        (refmp.parallel.folding.dispatch_for); None for a dense model."""
        cfg = self.mcfg
        if not cfg.n_expert:
            return None
        if grid.folded:
            raise ConfigError("a Mixtral-style model's experts do not fold over etp (folding "
                              "splits GPT-2's c_fc and c_proj)")
        return cfg.moe_context(None, dispatch_for(grid, cfg.n_expert, False, kind=swiglu_experts))

    def ring(self, cp, chunks):
        return GQARingAttention(cp, chunks)  # the K/V blocks travel with NKV heads

    def core(self, call, layer: int):
        return DecoderGQA(call, layer)

    def ops(self, tp, positions, attn=None):
        cfg = self.mcfg
        if tp.size > 1:
            return TPL.TensorOps(cfg, tp, attn, positions)
        return LM.Ops(cfg.n_head, cfg.n_kv_head, attn, positions)

    def embed(self, ops, params: dict, ids):
        return params["wte.weight"][ids]  # (B, t, C): no position embedding (rotary)

    def block(self, params: dict, i: int, x, ops, moe, rows_apart: bool = False):
        if rows_apart:
            raise ConfigError("a Llama model's linears do not run row by row (continuous "
                              "batching's RowByRow is GPT-2's)")
        cfg = self.mcfg
        cos, sin = LL.rope_tables(ops.positions, cfg.head_size, cfg.rope_theta, x.dtype)  # (t, HS)
        return LM.block_forward(block_params(params, i), x, cfg, cos, sin, ops, moe)[0]

    def logits(self, ops, params: dict, x_last, tp):
        """The final RMSNorm and the head (lm_head, or wte when tied) on x_last (B, 1, C):
        (B, V), the same on every tp rank."""
        return LM.head_forward(params, x_last, self.mcfg)[0][:, 0]
