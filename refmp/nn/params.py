"""GPT-2's configuration, parameter names and shapes, and its layout-independent init.

Shapes: C channels (n_embd), V vocabulary, T block size, L layers, E experts.
Every parameter has a GPT-2 checkpoint name (``wte.weight``, ``h.{i}.attn.c_attn.weight``, ...)
and a global shape. Initial values depend on (seed, name, element) alone and are drawn in
bounded row blocks (init_slice), so a rank makes its shard without the whole tensor.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

from refmp.nn import moe as M
from refmp.nn.slices import BLOCK_BYTES, WHOLE, Index, cut, cut_shape, fill
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


def init_std(name: str, cfg: GPTConfig) -> float | None:
    """GPT-2's N(0, std) for a weight: 0.02, and 0.02 / sqrt(2 L) for the residual output
    projections (``c_proj``, experts' too); None for the constants (LayerNorm weights 1,
    biases 0: init_const)."""
    if name.endswith(".bias") or "ln_" in name:
        return None
    return 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.weight") else 0.02


def init_const(name: str) -> float:
    """A constant parameter's value: 0 for biases, 1 for LayerNorm weights."""
    return 0.0 if name.endswith(".bias") else 1.0


def init_block_rows(shape: tuple[int, ...]) -> int:
    """R, the rows of one random block of a tensor of ``shape``: as many as fill
    slices.BLOCK_BYTES with float64 draws (at least one row). A function of the global
    shape alone, so every layout draws the same blocks."""
    return max(1, BLOCK_BYTES // (8 * math.prod(shape[1:])))


def init_slice(name: str, shape: tuple[int, ...], cfg: GPTConfig, seed: int,
               index: Index = WHOLE, dtype="float64") -> np.ndarray:
    """The slice ``index`` (refmp.nn.slices.Index) of parameter ``name``'s initial values, at
    global ``shape``, in ``dtype`` on the host, made without the whole tensor.

    Values are a function of (seed, name, element): rows [b R, (b+1) R) of a weight are
    drawn by one generator seeded (seed, crc32(name), b) (init_block_rows' R), row after
    row, times init_std; constants are init_const. A rank draws only the blocks its slice
    touches, each up to the last row it needs, so its peak is the slice plus about one block
    (1 MiB); any layout starts where the serial model starts.
    """
    std = init_std(name, cfg)
    R = init_block_rows(shape)
    crc = zlib.crc32(name.encode())
    cshape = cut_shape(shape, index)

    def read_rows(g0: int, g1: int):
        if std is None:
            return np.full((g1 - g0,) + cshape[1:], init_const(name))
        b = g0 // R  # this chunk's block: rows [b R, b R + R)
        rng = np.random.default_rng([seed, crc, b])
        z = rng.standard_normal((g1 - b * R,) + tuple(shape[1:]))  # the block's rows up to g1
        z = z[g0 - b * R:]
        z *= std
        return cut(z, shape, index)  # (g1 - g0, *cshape[1:])

    return fill(shape, index, dtype, read_rows, R)


def init_param(name: str, shape: tuple[int, ...], cfg: GPTConfig, seed: int) -> np.ndarray:
    """GPT-2's initialization of one whole parameter, in float64 on the host: the one-rank
    case of init_slice."""
    return init_slice(name, shape, cfg, seed)


def init_params(cfg: GPTConfig, seed: int, dtype="float32") -> dict:
    """All parameters at full size, on the run's array module (the serial model's share)."""
    return {
        name: backend.from_host(init_slice(name, shape, cfg, seed, dtype=dtype))
        for name, shape in param_shapes(cfg).items()
    }


def block_params(params: dict, i: int) -> dict:
    """Block i's parameters keyed by their name inside the block (views, no copies)."""
    prefix = f"h.{i}."
    return {k[len(prefix):]: params[k] for k in params if k.startswith(prefix)}  # reads only these
