"""Hugging Face LlamaForCausalLM directories: ``config.json`` + ``model.safetensors`` (+ a
tokenizer's files), read and written.

Shapes: V vocabulary, C channels, L layers, NH query heads, NKV key/value heads, HS head size,
F the MLP's width.

A directory is what ``transformers.LlamaForCausalLM.from_pretrained`` loads and
``save_pretrained`` writes. Its linears are torch's (out, in); refmp keeps (in, out), so
every projection is transposed on the way in and out:

    refmp (refmp.nn.llama)          the directory
    wte.weight                      model.embed_tokens.weight
    h.{i}.ln_1.weight               model.layers.{i}.input_layernorm.weight
    h.{i}.attn.{q,k,v,o}_proj.w^T   model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    h.{i}.ln_2.weight               model.layers.{i}.post_attention_layernorm.weight
    h.{i}.mlp.{gate,up,down}_proj^T model.layers.{i}.mlp.{gate,up,down}_proj.weight
    ln_f.weight                     model.norm.weight
    lm_head.weight                  lm_head.weight (absent when tie_word_embeddings)

The configuration is never guessed: a setting refmp's Llama does not compute (rope scaling,
a sliding window, attention or MLP biases, another activation, a head size other than C/NH,
...) is refused with its name, rather than run as a different model.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

from refmp.checkpoint.tokenizer import tokenizer_files
from refmp.errors import ConfigError
from refmp.nn.llama import LlamaConfig, param_shapes

CONFIG = "config.json"
WEIGHTS = "model.safetensors"

# LlamaConfig keys that change the numbers, and the value refmp computes (absent: this value)
COMPUTES = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "rope_scaling": None, "sliding_window": None, "pretraining_tp": 1,
            "attention_dropout": 0.0}
# config.json key -> LlamaConfig field
SIZES = {"vocab_size": "vocab_size", "max_position_embeddings": "block_size",
         "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
         "hidden_size": "n_embd", "intermediate_size": "n_inner"}


def rope_theta(conf: dict, where: str) -> float:
    """The rotary base: ``rope_theta``, or ``rope_parameters`` of rope_type default."""
    rp = conf.get("rope_parameters")
    if rp is None:
        return float(conf.get("rope_theta", 10000.0))
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind != "default":
        raise ConfigError(f"{where} has rope_parameters rope_type {kind!r}; refmp computes "
                          f"the default rotary embedding only")
    return float(rp.get("rope_theta", conf.get("rope_theta", 10000.0)))


def llama_config(conf: dict, where: str = CONFIG) -> LlamaConfig:
    """The LlamaConfig of a LlamaForCausalLM ``config.json`` (a dict), or a ConfigError naming
    the key refmp does not compute."""
    if conf.get("model_type") != "llama":
        raise ConfigError(f"{where} describes a {conf.get('model_type')!r} model; refmp's "
                          f"Llama reads model_type llama")
    missing = [k for k in SIZES if not isinstance(conf.get(k), int)]
    if missing:
        raise ConfigError(f"{where} has no {', '.join(missing)} (positive integers)")
    for k, want in COMPUTES.items():
        if conf.get(k, want) != want:
            raise ConfigError(f"{where} has {k} {conf[k]!r}; refmp's Llama computes {k} "
                              f"{want!r}")
    sizes = {field: conf[k] for k, field in SIZES.items()}
    head = sizes["n_embd"] // max(sizes["n_head"], 1)
    if conf.get("head_dim", head) not in (head, None):
        raise ConfigError(f"{where} has head_dim {conf['head_dim']}; refmp's Llama computes "
                          f"hidden_size / num_attention_heads = {head}")
    cfg = LlamaConfig(**sizes, n_kv_head=conf.get("num_key_value_heads") or sizes["n_head"],
                      rope_theta=rope_theta(conf, where), rms_eps=float(conf.get("rms_norm_eps", 1e-6)),
                      tied=bool(conf.get("tie_word_embeddings", False)))
    cfg.check()
    return cfg


def hf_config(cfg: LlamaConfig, dtype: str) -> dict:
    """The ``config.json`` of a LlamaForCausalLM with ``cfg``'s shape and refmp's settings."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            **{k: getattr(cfg, field) for k, field in SIZES.items()},
            "num_key_value_heads": cfg.n_kv_head, "head_dim": cfg.head_size,
            "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_eps,
            "tie_word_embeddings": cfg.tied, **COMPUTES,
            "bos_token_id": None, "eos_token_id": None, "dtype": dtype}


def hf_name(name: str) -> tuple[str, bool]:
    """The directory's name for refmp parameter ``name``, and whether it is transposed."""
    if name == "wte.weight":
        return "model.embed_tokens.weight", False
    if name == "ln_f.weight":
        return "model.norm.weight", False
    if name == "lm_head.weight":
        return name, False
    _, i, rest = name.split(".", 2)
    inner = {"ln_1.weight": "input_layernorm.weight",
             "ln_2.weight": "post_attention_layernorm.weight"}.get(rest)
    if inner is not None:
        return f"model.layers.{i}.{inner}", False
    return f"model.layers.{i}.{rest.replace('attn.', 'self_attn.')}", True


def read_config(folder: str, flag: str = "--init") -> LlamaConfig:
    file = os.path.join(folder, CONFIG)
    try:
        with open(file) as f:
            conf = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{flag} {folder}: {file} is not readable JSON ({e})") from e
    return llama_config(conf, f"{flag} {folder}: {file}")


def is_llama_dir(folder: str) -> bool:
    """Whether ``folder`` holds a config.json saying model_type llama."""
    file = os.path.join(folder, CONFIG)
    if not os.path.isfile(file):
        return False
    try:
        with open(file) as f:
            return json.load(f).get("model_type") == "llama"
    except (OSError, ValueError, AttributeError):
        return False


def load_llama(folder: str, dtype="float64", flag: str = "--init") -> tuple[LlamaConfig, dict]:
    """(config, parameters under refmp's names, (in, out) linears, host arrays in ``dtype``)."""
    from safetensors.numpy import load_file

    cfg = read_config(folder, flag)
    try:
        tensors = load_file(os.path.join(folder, WEIGHTS))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{flag} {folder}: cannot read {WEIGHTS} ({e})") from e
    params = {}
    for name, shape in param_shapes(cfg).items():
        key, transposed = hf_name(name)
        if key not in tensors:
            raise ConfigError(f"{flag} {folder}: {WEIGHTS} has no {key}")
        a = tensors[key].T if transposed else tensors[key]
        if a.shape != shape:
            raise ConfigError(f"{flag} {folder}: {key} is {a.shape[::-1] if transposed else a.shape}"
                              f"; config.json makes it {shape[::-1] if transposed else shape}")
        params[name] = np.ascontiguousarray(a, dtype=dtype)
    return cfg, params


def save_llama(out: str, cfg: LlamaConfig, params: dict, tokenizer: str | None = None,
               flag: str = "--save") -> None:
    """Write full host ``params`` (refmp names) as the LlamaForCausalLM directory ``out``, with
    the tokenizer files of the directory ``tokenizer`` copied beside them."""
    from safetensors.numpy import save_file

    from refmp.checkpoint.format import write_json

    dtype = str(next(iter(params.values())).dtype)
    tensors = {}
    for name in param_shapes(cfg):
        key, transposed = hf_name(name)
        tensors[key] = np.ascontiguousarray(params[name].T if transposed else params[name])
    try:
        os.makedirs(out, exist_ok=True)
        save_file(tensors, os.path.join(out, WEIGHTS), metadata={"format": "pt"})
        write_json(os.path.join(out, CONFIG), hf_config(cfg, dtype))
        for name in (tokenizer_files(tokenizer) or []) if tokenizer is not None else []:
            if os.path.abspath(os.path.dirname(name)) != os.path.abspath(out):
                shutil.copyfile(name, os.path.join(out, os.path.basename(name)))
    except OSError as e:
        raise ConfigError(f"{flag} {out}: cannot write it ({e.strerror or e})") from e
