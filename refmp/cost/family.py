"""The model family the planner describes: GPT-2's block, or the Llama family's (grouped-query
attention, a SwiGLU MLP, RMSNorm and rotary positions, no biases, a tied or untied head).

A Family is a GPTConfig with the shape a Llama-family configuration adds; a plain GPTConfig
is GPT-2 (its defaults below), so every GPT-2 figure of refmp.cost is unchanged. Shapes: C
channels, NH heads, KV key/value heads (NH/KV queries share one), hs = C/NH, F the MLP's
hidden width, V vocabulary, L blocks.

Parameters of one block (``shapes``, under GPT-2's names so that refmp.parallel.placement
splits them over tp as it splits GPT-2's):
  attention: c_attn (C, (NH + 2 KV) hs) holds q, k and v; c_proj (C, C)
  MLP: GELU c_fc (C, F), c_proj (F, C); SwiGLU c_fc (C, 2F) holds the gate and up
    projections (both column-parallel), c_proj (F, C)
  norms: LayerNorm weight and bias; RMSNorm a weight alone (the family has no biases)
  embeddings: wte (V, C); wpe (T, C) only with learned positions (rotary has none); an
    untied head ``lm_head`` (V, C) on the last stage, a unit of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from refmp.nn.params import GPTConfig, param_shapes


@dataclass(frozen=True)
class Family(GPTConfig):
    """GPTConfig with the Llama family's shape (defaults: GPT-2's)."""
    n_kv_head: int = 0  # key/value heads; 0: n_head (multi-head attention)
    ffn: int = 0  # the MLP's hidden width F; 0: 4 n_embd
    swiglu: bool = False  # the Llama block: SwiGLU MLP, RMSNorm, rotary positions, no biases
    tied: bool = True  # the head is wte (GPT-2); False: lm_head, a matrix of its own


def kv_heads(cfg: GPTConfig) -> int:
    return getattr(cfg, "n_kv_head", 0) or cfg.n_head


def ffn(cfg: GPTConfig) -> int:
    return getattr(cfg, "ffn", 0) or 4 * cfg.n_embd


def is_llama(cfg: GPTConfig) -> bool:
    return getattr(cfg, "swiglu", False)


def tied(cfg: GPTConfig) -> bool:
    return getattr(cfg, "tied", True)


def qkv_width(cfg: GPTConfig) -> int:
    """c_attn's output columns: q's NH heads and k's and v's KV heads, hs wide each."""
    return (cfg.n_head + 2 * kv_heads(cfg)) * cfg.head_size


def is_gpt2(cfg: GPTConfig) -> bool:
    return (kv_heads(cfg) == cfg.n_head and ffn(cfg) == 4 * cfg.n_embd and not is_llama(cfg)
            and tied(cfg))


def _mlp(C: int, F: int, llama: bool, prefix: str = "mlp.") -> dict:
    fc = 2 * F if llama else F
    out = {f"{prefix}c_fc.weight": (C, fc), f"{prefix}c_proj.weight": (F, C)}
    if not llama:
        out.update({f"{prefix}c_fc.bias": (fc,), f"{prefix}c_proj.bias": (C,)})
    return dict(sorted(out.items(), key=lambda kv: ("c_proj" in kv[0], kv[0].endswith("bias"))))


def block_shapes(cfg: GPTConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Block i's parameters, by their name inside the block (the module docstring)."""
    C, llama, F = cfg.n_embd, is_llama(cfg), ffn(cfg)
    norm = (lambda n: {f"{n}.weight": (C,)}) if llama else (
        lambda n: {f"{n}.weight": (C,), f"{n}.bias": (C,)})
    attn = {"attn.c_attn.weight": (C, qkv_width(cfg)), "attn.c_proj.weight": (C, C)}
    if not llama:
        attn = {"attn.c_attn.weight": (C, qkv_width(cfg)), "attn.c_attn.bias": (qkv_width(cfg),),
                "attn.c_proj.weight": (C, C), "attn.c_proj.bias": (C,)}
    if cfg.is_moe(i):
        mlp = {"mlp.router.weight": (C, cfg.n_expert)}
        for e in range(cfg.n_expert):
            mlp.update(_mlp(C, F, llama, f"mlp.experts.{e}."))
    else:
        mlp = _mlp(C, F, llama)
    return {**norm("ln_1"), **attn, **norm("ln_2"), **mlp}


def shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's global shape: GPT-2's param_shapes for GPT-2, else the family's."""
    if is_gpt2(cfg):
        return param_shapes(cfg)
    C = cfg.n_embd
    out = {"wte.weight": (cfg.vocab_size, C)}
    if not is_llama(cfg):
        out["wpe.weight"] = (cfg.block_size, C)
    for i in range(cfg.n_layer):
        out.update({f"h.{i}.{k}": s for k, s in block_shapes(cfg, i).items()})
    out["ln_f.weight"] = (C,)
    if not is_llama(cfg):
        out["ln_f.bias"] = (C,)
    if not tied(cfg):
        out["lm_head.weight"] = (cfg.vocab_size, C)
    return out


def n_params(cfg: GPTConfig) -> int:
    """All parameters (an untied head counted apart from wte)."""
    return sum(math.prod(s) for s in shapes(cfg).values())


def cache_extra(cfg: GPTConfig, b: int, Tl: int, tp: int, sp: bool, recompute: str) -> int:
    """Elements one block's forward cache keeps beyond GPT-2's block_cache_elements
    (refmp.cost.memory), for the family: inside the tp pairs GPT-2 keeps qkv (3), the
    attention output (1), and c_fc's output, tanh and GELU (3 F/C) per b Tl C; the family
    keeps q, k and v ((NH + 2 KV)/NH), the output (1), and SwiGLU's gate and up (2 F/C), the
    gate's SiLU and the product (2 F/C). Full recomputation keeps the block's input alone."""
    if recompute == "full" or is_gpt2(cfg):
        return 0
    C, NH, F = cfg.n_embd, cfg.n_head, ffn(cfg)
    inside = (NH + 2 * kv_heads(cfg)) / NH + 1 + (4 if is_llama(cfg) else 3) * F / C
    return int((inside - 16) * b * Tl * C) // tp
