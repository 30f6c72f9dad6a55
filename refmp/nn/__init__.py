"""The serial reference: GPT-2's layers (forward/backward pairs) and the model."""

from refmp.nn.gpt import GPT, GPTConfig, init_params, param_shapes

__all__ = ["GPT", "GPTConfig", "init_params", "param_shapes"]
