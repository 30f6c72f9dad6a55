"""The model family a run trains (``--arch``): GPT-2, or a Llama-family model
(refmp.nn.llama), and what the run's steps ask of it besides the Engine's family
(refmp.parallel.family): its shape from the flags or the ``--init`` directory, where its
initial weights come from, the shape the memory estimate reads, and how ``--save`` writes it.

A Llama shape is never guessed: a fresh model takes every setting of its family from the
flags (``--n-kv-head``, ``--ffn``, ``--rope-theta``, ``--rms-eps``, ``--head``), and a
``--init`` LlamaForCausalLM directory (or a sharded checkpoint of a Llama run) says all of
them, so those flags are refused beside it.
"""

from __future__ import annotations

import os

from refmp.config import TrainConfig, flag_name, saves_directory
from refmp.errors import ConfigError
from refmp.nn.families import is_llama
from refmp.nn.llama import LlamaConfig

LLAMA = ("n_kv_head", "ffn", "rope_theta", "rms_eps", "head")  # a fresh Llama's own flags
GPT2_ONLY = ("moe_every", "capacity_factor", "aux_loss_coef", "z_loss_coef")
MIXTRAL = ("n_expert", "top_k")  # a fresh Llama's MoE blocks (num_local_experts, per token)


def llama_checkpoint(path: str) -> dict | None:
    """The manifest of a sharded checkpoint of a Llama run at (or latest in) ``path``, else None."""
    from refmp.checkpoint.format import MANIFEST, complete_steps, find, read_manifest

    if not os.path.isdir(path) or not (os.path.isfile(os.path.join(path, MANIFEST))
                                       or complete_steps(path)):
        return None
    man = read_manifest(find(path))
    return man if man.get("family") == "llama" else None


def arch_of(cfg: TrainConfig) -> str:
    """``--arch``, or the weights' family: a LlamaForCausalLM --init directory, or a Llama
    run's checkpoint as --init or --resume, is llama; anything else gpt2."""
    from refmp.checkpoint.hf_llama import is_llama_dir

    if cfg.arch is not None:
        return cfg.arch
    if cfg.init is not None and (is_llama_dir(cfg.init) or llama_checkpoint(cfg.init)):
        return "llama"
    if cfg.resume is not None and llama_checkpoint(cfg.resume):
        return "llama"
    return "gpt2"


def check_family_flags(cfg: TrainConfig) -> None:
    """Refuse the Llama flags for GPT-2 (pure: every rank the same answer)."""
    if arch_of(cfg) == "gpt2":
        given = [flag_name(k) for k in LLAMA if getattr(cfg, k) is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} describe a Llama-family model: add --arch llama")


def llama_model(cfg: TrainConfig, ds) -> LlamaConfig:
    """The Llama shape of a run: the --init directory's (or checkpoint's) config, or the
    flags, every one given; the data's vocabulary and the block size checked by the caller."""
    from refmp.checkpoint.format import model_config
    from refmp.checkpoint.hf_llama import is_llama_dir, read_config

    moe = [flag_name(k) for k in GPT2_ONLY if getattr(cfg, k)]
    if moe:
        raise ConfigError(f"--arch llama: {', '.join(moe)} are GPT-2's MoE settings; a "
                          f"Mixtral-style model takes --n-expert and --top-k (no capacity "
                          f"limit, no auxiliary losses)")
    given = [flag_name(k) for k in LLAMA if getattr(cfg, k) is not None]
    given += [flag_name(k) for k in MIXTRAL if getattr(cfg, k)]
    if cfg.resume is not None and not given and (man := llama_checkpoint(cfg.resume)):
        return model_config(man)  # the shape the checkpoint was saved with
    if cfg.init is not None:
        if given or cfg.n_head is not None:
            said = given + (["--n-head"] if cfg.n_head is not None else [])
            raise ConfigError(f"--init {cfg.init} says the model's shape (its config.json); "
                              f"give no {', '.join(said)}")
        if is_llama_dir(cfg.init):
            mcfg = read_config(cfg.init)
        elif (man := llama_checkpoint(cfg.init)) is not None:
            mcfg = model_config(man)
        else:
            raise ConfigError(f"--arch llama --init {cfg.init}: not a LlamaForCausalLM "
                              f"directory (config.json with model_type llama) nor a Llama "
                              f"run's checkpoint")
        if cfg.block_size is not None and cfg.block_size > mcfg.block_size:
            raise ConfigError(f"--block-size {cfg.block_size} exceeds the block size "
                              f"{mcfg.block_size} of {cfg.init}")
        return mcfg
    missing = [flag_name(k) for k in LLAMA if getattr(cfg, k) is None]
    if missing:
        raise ConfigError(f"--arch llama builds a fresh model from flags, and refmp guesses no "
                          f"setting of it: give {', '.join(missing)} (or --init a "
                          f"LlamaForCausalLM directory)")
    T = cfg.block_size or (ds.task.line_len if ds.task else 64)
    moe = {"n_expert": cfg.n_expert, **({"top_k": cfg.top_k} if cfg.top_k else {})}
    mcfg = LlamaConfig(vocab_size=ds.vocab_size, block_size=T, n_layer=cfg.n_layer,
                       n_head=cfg.n_head or 4, n_kv_head=cfg.n_kv_head, n_embd=cfg.n_embd,
                       n_inner=cfg.ffn, rope_theta=cfg.rope_theta, rms_eps=cfg.rms_eps,
                       tied=cfg.head == "tied", **moe)
    mcfg.check()
    return mcfg


def llama_source(cfg: TrainConfig, mcfg: LlamaConfig):
    """Where a Llama run's initial weights come from: zeros for --resume (the checkpoint
    sets them), the --init directory (refmp.checkpoint.llama_files.LlamaSource) or
    checkpoint, or a fresh draw (refmp.nn.params.init_slice, by name: HF's N(0, 0.02))."""
    from refmp.checkpoint.source import InitSource, ZeroSource, open_source

    if cfg.resume:
        return ZeroSource(mcfg, cfg.seed)
    if cfg.init is None:
        return InitSource(mcfg, cfg.seed)
    from refmp.checkpoint.hf_llama import is_llama_dir
    from refmp.checkpoint.llama_files import LlamaSource

    return LlamaSource(cfg.init) if is_llama_dir(cfg.init) else open_source(cfg.init)


def cost_shape(mcfg):
    """The shape refmp.cost reads (its Family) of ``mcfg``; GPT-2's as it is."""
    if not is_llama(mcfg):
        return mcfg
    from refmp.cost.family import Family

    return Family(vocab_size=mcfg.vocab_size, block_size=mcfg.block_size,
                  n_layer=mcfg.n_layer, n_head=mcfg.n_head, n_embd=mcfg.n_embd,
                  n_kv_head=mcfg.n_kv_head, ffn=mcfg.n_inner, swiglu=True, tied=mcfg.tied,
                  n_expert=mcfg.n_expert, top_k=mcfg.top_k, capacity_factor=0.0,
                  aux_loss_coef=0.0, z_loss_coef=0.0)


def check_save(cfg: TrainConfig, mcfg) -> None:
    """A Llama model is saved as a LlamaForCausalLM directory, not one GPT-2 file."""
    if is_llama(mcfg) and cfg.save is not None and not saves_directory(cfg.save):
        raise ConfigError(f"--save {cfg.save}: a Llama model is written as a LlamaForCausalLM "
                          f"directory (a path not ending in .safetensors)")


def save_model(cfg: TrainConfig, mcfg, dtype, gather, vocab, tokenizer, write: bool) -> None:
    """``--save``, tensor by tensor (the gathers are collective): a Llama model as a
    LlamaForCausalLM directory, GPT-2's as refmp.checkpoint.weights.save_streamed."""
    if is_llama(mcfg):
        from refmp.checkpoint.llama_files import save_llama_streamed

        tok = cfg.init if cfg.init is not None and os.path.isdir(cfg.init) else cfg.tokenizer
        save_llama_streamed(cfg.save, mcfg, dtype, gather, tok, write)
        return
    from refmp.checkpoint.weights import save_streamed

    save_streamed(cfg.save, mcfg, dtype, gather, vocab, tokenizer, write=write)

