"""The model families refmp trains, by name: GPT-2 (refmp.nn.params.GPTConfig) and Llama
(refmp.nn.llama.LlamaConfig). What a file that records a model (a sharded checkpoint's
manifest) or a command asks of a shape whatever its family: its name, its parameters' global
shapes, and the shape back from a name and its fields.

How each family is split over the ranks is refmp.parallel.family's.
"""

from __future__ import annotations

from refmp.errors import ConfigError
from refmp.nn import llama_params as LP
from refmp.nn import params as GP

CONFIGS = {"gpt2": GP.GPTConfig, "llama": LP.LlamaConfig}


def family_name(mcfg) -> str:
    """``"llama"`` for a LlamaConfig, else ``"gpt2"`` (a GPTConfig, or the planner's Family)."""
    return "llama" if isinstance(mcfg, LP.LlamaConfig) else "gpt2"


def is_llama(mcfg) -> bool:
    return isinstance(mcfg, LP.LlamaConfig)


def param_shapes(mcfg) -> dict[str, tuple[int, ...]]:
    """Every parameter's global shape, in the model's order, for either family."""
    return LP.param_shapes(mcfg) if is_llama(mcfg) else GP.param_shapes(mcfg)


def config_from(name: str, fields: dict):
    """The shape a manifest records (``family_name`` and ``asdict``), or a ConfigError."""
    if name not in CONFIGS:
        raise ConfigError(f"model family {name!r} is not one refmp trains "
                          f"({', '.join(CONFIGS)})")
    return CONFIGS[name](**fields)
