"""Model weights as safetensors, with GPT-2's parameter names.

``save_model`` writes the full model (host arrays, the model's dtype) plus metadata giving
the shape that the tensors alone do not say (n_head). ``load_model`` reads refmp's files and
GPT-2 state dicts saved as safetensors: a ``transformer.`` prefix is stripped, and the
attention-mask buffers and the tied ``lm_head.weight`` are ignored.
"""

from __future__ import annotations

import os
import re

import numpy as np

from refmp import backend
from refmp.errors import ConfigError
from refmp.nn.gpt import GPT, GPTConfig, param_shapes

MOE_META = ("top_k", "moe_every", "capacity_factor", "aux_loss_coef", "z_loss_coef")


def save_model(path: str, params: dict, cfg: GPTConfig) -> None:
    """Write full (unsharded) parameters, GPT-2 names, to ``path``, atomically."""
    from safetensors.numpy import save_file

    tensors = {k: np.ascontiguousarray(backend.to_host(v)) for k, v in params.items()}
    meta = {"format": "refmp", "n_head": str(cfg.n_head)}
    if cfg.n_expert:  # the MoE settings the tensors do not say
        meta.update({k: str(getattr(cfg, k)) for k in MOE_META})
    tmp = f"{path}.tmp{os.getpid()}"
    save_file(tensors, tmp, metadata=meta)
    os.replace(tmp, path)  # never leave a half-written file under the real name


def read_tensors(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors by GPT-2 name, metadata) from a safetensors file; clear errors if unreadable."""
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise ConfigError(f"--init {path}: no such file")
    try:
        with safe_open(path, framework="numpy") as f:
            meta = f.metadata() or {}
            raw = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise ConfigError(f"--init {path}: not a readable safetensors file ({e})") from e
    tensors = {}
    for k, v in raw.items():
        k = k.removeprefix("transformer.")
        if k == "lm_head.weight" or re.fullmatch(r"h\.\d+\.attn\.(masked_)?bias", k):
            continue  # tied head, causal-mask buffers: not parameters
        tensors[k] = v
    return tensors, meta


def load_model(path: str, n_head: int | None = None, dtype: str = "float32") -> GPT:
    """A GPT whose shape is read from the tensors; heads from ``n_head`` or the metadata."""
    tensors, meta = read_tensors(path)
    if "wte.weight" not in tensors or "wpe.weight" not in tensors:
        raise ConfigError(f"--init {path}: no wte.weight / wpe.weight; is this a GPT-2 model?")
    V, C = tensors["wte.weight"].shape
    T = tensors["wpe.weight"].shape[0]
    n_layer = len({int(m.group(1)) for k in tensors if (m := re.match(r"h\.(\d+)\.", k))})
    heads = n_head if n_head is not None else int(meta.get("n_head", 4))
    routers = sorted(int(m.group(1)) for k in tensors
                     if (m := re.fullmatch(r"h\.(\d+)\.mlp\.router\.weight", k)))
    moe = {}
    if routers:  # mixture of experts: E from the router, the rest from the metadata
        moe = {"n_expert": tensors[f"h.{routers[0]}.mlp.router.weight"].shape[1],
               "moe_every": routers[1] - routers[0] if len(routers) > 1 else n_layer}
        for k in MOE_META:
            if k in meta:
                moe[k] = type(getattr(GPTConfig, k))(meta[k])
    cfg = GPTConfig(V, T, n_layer, heads, C, **moe)
    cfg.check()
    expected = param_shapes(cfg)
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ConfigError(f"--init {path}: names do not match a {n_layer}-layer GPT-2 "
                          f"(missing {missing[:4]}, unexpected {extra[:4]})")
    for k, shape in expected.items():
        if tuple(tensors[k].shape) != shape:
            raise ConfigError(f"--init {path}: {k} has shape {tuple(tensors[k].shape)}, "
                              f"expected {shape}")
    return GPT(cfg, {k: backend.from_host(tensors[k].astype(dtype)) for k in expected})
