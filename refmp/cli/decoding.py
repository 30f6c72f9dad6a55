"""``refmp generate``'s prompts decoded, shared by its GPT-2 path (refmp.cli.generate) and
its Llama one (refmp.cli.generate_llama): the layout and the prompts checked (check_fits),
the dp ranks' rows decoded on any layout and gathered (decode_prompts), the tokens written
and printed (report).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import numpy as np

from refmp.errors import ConfigError


def check_fits(args: argparse.Namespace, mcfg, sizes: dict, prompts: list) -> None:
    """Refuse what this layout cannot split, or these prompts cannot do (pure)."""
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.kv_block_size is not None and args.kv_block_size < 1:
        raise ConfigError(f"--kv-block-size must be at least 1, got {args.kv_block_size}")
    if mcfg.n_head % sizes["tp"]:
        raise ConfigError(f"--tp {sizes['tp']} must divide the model's {mcfg.n_head} heads")
    if mcfg.n_layer < sizes["pp"]:
        raise ConfigError(f"--pp {sizes['pp']} stages but the model has {mcfg.n_layer} layers")
    if sizes["ep"] > 1 and (mcfg.n_expert == 0 or mcfg.n_expert % sizes["ep"]):
        raise ConfigError(f"--ep {sizes['ep']} must divide the model's {mcfg.n_expert} experts")
    if len(prompts) < sizes["dp"]:
        raise ConfigError(f"--dp {sizes['dp']} ranks but {len(prompts)} prompts: each dp rank "
                          f"decodes at least one")
    for p in prompts:
        if len(p) > mcfg.block_size:
            raise ConfigError(f"a prompt of {len(p)} tokens is longer than the model's "
                              f"{mcfg.block_size} positions")
    if sizes["cp"] > 1:
        if not args.kv_cache:
            raise ConfigError("--no-kv-cache recomputes sequences of every length; it runs "
                              "without --cp")
        chunks = 2 * sizes["cp"] if args.cp_balance == "zigzag" else sizes["cp"]
        if any(len(p) % chunks for p in prompts):
            raise ConfigError(f"--cp {sizes['cp']} ({args.cp_balance}) cuts each prompt into "
                              f"{chunks} equal chunks; the prompt lengths are "
                              f"{sorted({len(p) for p in prompts})}")


@dataclass
class Decoded:
    """What :func:`decode_prompts` decoded: this rank's prompts and cache length, and on world
    rank 0 the tokens (B, T0 + new) and the logits that chose the new ones (B, new, V)."""

    rows: int  # prompts this rank decoded (its dp share)
    positions: int  # a row's cache length, T0 + new - 1
    new: int  # new tokens a prompt
    kv: list  # every rank's KV cache bytes
    prefill_s: float  # the slowest rank's
    decode_s: float
    tokens: np.ndarray | None = None
    logits: np.ndarray | None = None

    def summary(self) -> dict:
        """The command's figures (world rank 0)."""
        return {"tokens_per_s": self.tokens.shape[0] * self.new / (self.prefill_s + self.decode_s),
                "prefill_s": self.prefill_s, "decode_s": self.decode_s, "kv_cache_bytes": self.kv,
                "new_tokens": self.tokens[:, -self.new:].tolist()}


def decode_prompts(args, grid, mcfg, src, tok, sampler, hint: str = "") -> Decoded:
    """--prompts / --prompt decoded on ``grid`` (collective over the world): the prompts read
    and held to the model (one message on every rank), each rank's share of the weights read
    from ``src`` (refmp.inference.decoder), the dp ranks' rows decoded and gathered on world
    rank 0. GPT-2's and the Llama family's alike; ``hint`` ends the refusal of prompts of
    different lengths."""
    from refmp.distributed.faults import agreed
    from refmp.inference.decoder import Decoder
    from refmp.inference.generate import generate
    from refmp.inference.sources import read_prompts
    from refmp.runtime import backend

    world = grid.world
    prompts = agreed(world, lambda: read_prompts(args.prompts, args.prompt, tok, mcfg.vocab_size))
    check_fits(args, mcfg, grid.sizes, prompts)
    if len({len(p) for p in prompts}) > 1:
        raise ConfigError(f"prompts of different lengths {sorted({len(p) for p in prompts})}{hint}")
    T0 = len(prompts[0])
    new = args.max_new_tokens or max(1, min(16, mcfg.block_size - T0 + 1))  # or the room left
    if T0 + new - 1 > mcfg.block_size:
        raise ConfigError(f"{T0} prompt tokens and --max-new-tokens {new} need {T0 + new - 1} "
                          f"positions; the model has {mcfg.block_size}")
    dec = Decoder(mcfg, src, grid, args.cp_balance, dtype=args.dtype)
    ids = np.array_split(np.arange(len(prompts)), grid.sizes["dp"])[grid.coords["dp"]]
    mine = backend.from_host(np.array(prompts, dtype=np.int64)[ids])  # on the run's device
    res = generate(dec, mine, new, sampler, ids, args.kv_cache, args.kv_block_size)
    holder = dec.last and grid.coords["tp"] == 0 and grid.coords["cp"] == 0
    got = world.allgather_obj((ids, backend.to_host(res.tokens), backend.to_host(res.logits))
                              if holder else None)
    kv = world.allgather_obj(res.kv_cache_bytes)
    prefill_s, decode_s = world.allreduce_metrics([res.prefill_s, res.decode_s], op="max")
    out = Decoded(len(ids), T0 + new - 1, new, kv, prefill_s, decode_s)
    if world.rank == 0:
        parts = sorted((g for g in got if g is not None), key=lambda g: g[0][0])
        out.tokens = np.concatenate([g[1] for g in parts])
        out.logits = np.concatenate([g[2] for g in parts])
    return out


def report(args, tokens, logits, tok, summary: dict) -> None:
    """Write --save-tokens / --save-logits; print the JSON object, or each prompt and its
    continuation (decoded for a text tokenizer)."""
    if args.save_tokens:
        np.save(args.save_tokens, tokens)
    if args.save_logits:
        np.save(args.save_logits, logits)
    if tok is not None:
        summary["texts"] = [tok.decode(t) for t in summary["new_tokens"]]
    if args.json:
        print(json.dumps(summary), flush=True)
        return
    for j, row in enumerate(tokens):
        prompt, new = row[: -len(summary["new_tokens"][j])], summary["new_tokens"][j]
        if tok is not None:
            print(f"[{j}] {tok.decode(prompt)!r} -> {summary['texts'][j]!r}")
        else:
            print(f"[{j}] {' '.join(map(str, prompt))} -> {' '.join(map(str, new))}")
    print(f"{summary['tokens_per_s']:,.0f} new tokens/s (prefill {summary['prefill_s']:.3f} s, "
          f"decode {summary['decode_s']:.3f} s); KV cache bytes per rank "
          f"{summary['kv_cache_bytes']}", flush=True)
    if "memory_measured" in summary:  # GPT-2's: refmp.cost.decode's prediction beside it
        from refmp.training.rank_memory import print_measured

        print_measured(summary["memory_measured"], "refmp.cost.decode")
