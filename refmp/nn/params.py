"""GPT-2's configuration, parameter names and shapes, and its layout-independent init.

Shapes: C channels (n_embd), V vocabulary, T block size, L layers, E experts.
Every parameter has a GPT-2 checkpoint name (``wte.weight``, ``h.{i}.attn.c_attn.weight``, ...)
and a global shape; a parallel layout slices its shard from the full tensor drawn here.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

from refmp.nn import moe as M
from refmp.runtime import backend


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    n_expert: int = 0  # experts per MoE layer; 0: a dense model
    top_k: int = 2  # experts per token
    moe_every: int = 1  # block i is MoE when i % moe_every == 0
    capacity_factor: float = 1.25  # slots per expert = ceil(CF K T / E) per sequence; 0: no limit
    aux_loss_coef: float = 0.01  # alpha of the load-balancing loss
    z_loss_coef: float = 0.001  # beta of the router z-loss

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    def is_moe(self, i: int) -> bool:
        """Is block i's MLP a mixture of experts?"""
        return self.n_expert > 0 and i % self.moe_every == 0

    def moe_context(self, denom=None, dispatch=None, seq=None) -> M.MoEContext:
        """An MoE layer's settings for one forward call (see refmp.nn.moe.MoEContext)."""
        ctx = M.MoEContext(self.n_expert, self.top_k, self.capacity_factor, self.aux_loss_coef,
                           self.z_loss_coef, denom, seq=seq)
        if dispatch is not None:
            ctx.dispatch = dispatch
        return ctx

    def check(self) -> None:
        """Refuse shapes that cannot make a GPT (a ConfigError with the reason)."""
        from refmp.errors import ConfigError

        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if self.n_expert < 0:
            raise ConfigError(f"--n-expert must be 0 (dense) or more, got {self.n_expert}")
        if self.n_expert:
            if not 1 <= self.top_k <= self.n_expert:
                raise ConfigError(f"--top-k ({self.top_k}) must be between 1 and --n-expert "
                                  f"({self.n_expert})")
            if self.moe_every < 1:
                raise ConfigError(f"--moe-every must be at least 1, got {self.moe_every}")
            if self.capacity_factor < 0:
                raise ConfigError(f"--capacity-factor must be 0 (no limit) or positive, got "
                                  f"{self.capacity_factor}")


def block_param_shapes(cfg: GPTConfig, i: int = 0) -> dict[str, tuple[int, ...]]:
    """Shapes of block i's parameters, by their name inside the block."""
    C = cfg.n_embd
    if cfg.is_moe(i):
        mlp = M.moe_param_shapes(C, cfg.n_expert)
    else:
        mlp = {"mlp.c_fc.weight": (C, 4 * C), "mlp.c_fc.bias": (4 * C,),
               "mlp.c_proj.weight": (4 * C, C), "mlp.c_proj.bias": (C,)}
    return {
        "ln_1.weight": (C,),
        "ln_1.bias": (C,),
        "attn.c_attn.weight": (C, 3 * C),
        "attn.c_attn.bias": (3 * C,),
        "attn.c_proj.weight": (C, C),
        "attn.c_proj.bias": (C,),
        "ln_2.weight": (C,),
        "ln_2.bias": (C,),
        **mlp,
    }


def param_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's global (unsharded) shape, in GPT-2's order."""
    shapes = {"wte.weight": (cfg.vocab_size, cfg.n_embd), "wpe.weight": (cfg.block_size, cfg.n_embd)}
    for i in range(cfg.n_layer):
        for name, shape in block_param_shapes(cfg, i).items():
            shapes[f"h.{i}.{name}"] = shape
    shapes["ln_f.weight"] = (cfg.n_embd,)
    shapes["ln_f.bias"] = (cfg.n_embd,)
    return shapes


def init_param(name: str, shape: tuple[int, ...], cfg: GPTConfig, seed: int) -> np.ndarray:
    """GPT-2's initialization of one parameter, at its global shape, in float64 on the host.

    The generator is seeded by (seed, crc32(name)), so a parameter's values depend on nothing
    but its name: any layout slices its shard from the same full tensor and starts where the
    serial model starts. LayerNorm weights are 1, biases 0, weights N(0, 0.02), and the
    residual output projections (``c_proj``, experts' too) N(0, 0.02 / sqrt(2 L)).
    """
    if name.endswith(".bias"):
        return np.zeros(shape)
    if "ln_" in name:
        return np.ones(shape)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
    return rng.normal(0.0, std, size=shape)


def init_params(cfg: GPTConfig, seed: int, dtype="float32") -> dict:
    """All parameters at full size, on the run's array module."""
    return {
        name: backend.from_host(init_param(name, shape, cfg, seed).astype(dtype))
        for name, shape in param_shapes(cfg).items()
    }


def block_params(params: dict, i: int) -> dict:
    """Block i's parameters keyed by their name inside the block (views, no copies)."""
    prefix = f"h.{i}."
    return {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}
