"""``refmp generate --init DIR`` where DIR is a Hugging Face LlamaForCausalLM directory: greedy
decoding with a grouped-query KV cache (refmp.inference.llama_decode), text in and out with
the directory's tokenizer.

A Llama directory decodes on one rank or over tp ranks (``mpiexec -n N ... --tp N``: each
rank its query heads and its key/value heads, or the one it replicates when tp > NKV,
refmp.parallel.tensor.llama); the other layouts of ``refmp generate`` (pp, cp, dp, ep) split
GPT-2's decoder (refmp.inference.decoder) and are refused with that reason, on every rank,
before any work. So are sampling, a paged cache and continuous batching, which the Llama
decoder does not have.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from refmp.errors import ConfigError

GPT2_ONLY = {"--pp": "pp", "--cp": "cp", "--dp": "dp", "--ep": "ep"}


def check_llama_args(args: argparse.Namespace, world_size: int) -> None:
    """Refuse what the Llama decoder does not do (pure: the same answer on every rank)."""
    split = [f"{flag} {getattr(args, a)}" for flag, a in GPT2_ONLY.items()
             if (getattr(args, a) or 1) > 1]
    if split:
        raise ConfigError(f"--init {args.init}: a Llama directory decodes on one rank or over "
                          f"--tp ranks ({', '.join(split)} asked); generate's other layouts "
                          f"split GPT-2's decoder")
    if (args.tp or 1) != world_size:
        raise ConfigError(f"--init {args.init}: a Llama directory decodes over --tp ranks, all "
                          f"of them: --tp {args.tp or 1} on {world_size} ranks")
    refused = {"--temperature": args.temperature != 0.0, "--top-k": args.top_k != 0,
               "--top-p": args.top_p != 1.0, "--kv-block-size": args.kv_block_size is not None,
               "--requests": args.requests is not None, "--checkpoint": args.checkpoint is not None,
               "--device gpu": args.device != "cpu"}
    from refmp.cli.serving import wanted

    mode = wanted(args)
    if mode is not None:
        refused[f"serving ({mode})"] = True
    bad = [k for k, v in refused.items() if v]
    if bad:
        raise ConfigError(f"--init {args.init}: a Llama directory decodes greedily on the CPU "
                          f"from the directory's weights; {', '.join(bad)} is for GPT-2")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")


def run_llama(args: argparse.Namespace, world_size: int) -> dict | None:
    """Decode the prompts greedily (collective over the world); world rank 0 prints (or
    --json) and returns the summary."""
    import os

    from refmp.checkpoint.hf_llama import load_llama
    from refmp.checkpoint.tokenizer import TextTokenizer, tokenizer_files
    from refmp.distributed.faults import agreed
    from refmp.distributed.grid import ProcessGrid
    from refmp.inference.llama_decode import generate
    from refmp.inference.sources import read_prompts
    from refmp.nn.llama import Llama
    from refmp.parallel.tensor import llama as TPL

    check_llama_args(args, world_size)
    grid = ProcessGrid(tp=world_size)
    world, tp = grid.world, grid.comm["tp"]
    cfg, params = agreed(world, lambda: load_llama(args.init, args.dtype))
    agreed(world, lambda: TPL.check_tp(cfg, tp.size))
    folder = args.tokenizer or args.init
    tok = TextTokenizer(folder) if args.prompt and tokenizer_files(folder) else None
    prompts = agreed(world, lambda: read_prompts(args.prompts, args.prompt, tok, cfg.vocab_size))
    if len({len(p) for p in prompts}) > 1:
        raise ConfigError(f"prompts of different lengths {sorted({len(p) for p in prompts})}")
    T0 = len(prompts[0])
    n = args.max_new_tokens or max(1, min(16, cfg.block_size - T0 + 1))
    if T0 + n - 1 > cfg.block_size:
        raise ConfigError(f"{T0} prompt tokens and --max-new-tokens {n} need {T0 + n - 1} "
                          f"positions; the model has {cfg.block_size}")
    mine = {k: TPL.shard(k, v, cfg, tp.rank, tp.size) for k, v in params.items()}
    ops = TPL.TensorOps(cfg, tp) if tp.size > 1 else None
    tokens, steps, cache = generate(Llama(cfg, mine), np.array(prompts, dtype=np.int64), n,
                                    args.kv_cache, ops)
    kv = world.allgather_obj(cache.nbytes)
    if world.rank != 0:
        return None
    logits = np.stack(steps, axis=1)  # (B, N, V), the same on every tp rank
    summary = {"new_tokens": tokens[:, T0:].tolist(), "kv_cache_bytes": kv,
               "model": "llama", "n_kv_head": cfg.n_kv_head, "tp": tp.size}
    if tok is not None:
        summary["texts"] = [tok.decode(t) for t in summary["new_tokens"]]
    if args.save_tokens:
        np.save(args.save_tokens, tokens)
    if args.save_logits:
        np.save(args.save_logits, logits)
    if args.json:
        print(json.dumps(summary), flush=True)
    else:
        for j, new in enumerate(summary.get("texts", summary["new_tokens"])):
            print(f"[{j}] {os.path.basename(args.init)} -> {new!r}", flush=True)
    return summary
