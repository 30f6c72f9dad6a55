"""``refmp generate --init DIR`` where DIR is a Hugging Face LlamaForCausalLM directory:
decoding with a grouped-query KV cache, text in and out with the directory's tokenizer.

The Llama model decodes through GPT-2's Decoder (refmp.inference.decoder), which asks the
model family for its pieces (refmp.inference.families): so it runs on every layout that
Decoder splits but ep, over ``mpiexec -n N`` with N = pp dp cp tp:

* tp: each rank its query heads and its key/value heads, or the one it replicates when
  tp > NKV (refmp.parallel.tensor.llama); the head is replicated, every rank its logits;
* pp: a stage its layers; the untied head (lm_head) on the last stage, wte on the first;
* cp: the prompt's prefill split in chunks (zig-zag or contiguous), ring attention passing
  NKV heads, the rotary tables at each token's global position; decoded tokens kept round
  robin over the cp ranks;
* dp: the prompts split over the dp ranks.

A rank reads only its share of the directory, slice by slice, the slices training reads
(refmp.checkpoint.llama_files.LlamaSource, refmp.parallel.family.LlamaFamily): never the
whole model.

The cache of a rank holds its layers, its key/value heads and its tokens:
2 L_stage B_dp T_cp max(NKV/tp, 1) HS w bytes. Sampling (temperature, top-k, top-p with
the seeded generator GPT-2's uses), a paged cache (--kv-block-size) and --no-kv-cache come
with the Decoder. Refused, with the reason, on every rank before any work: ep (a
LlamaForCausalLM directory has no experts to split), continuous batching and the serving
modes (their linears run row by row, GPT-2's Ops), a sharded --checkpoint and --device gpu.
"""

from __future__ import annotations

import argparse

from refmp.errors import ConfigError


def check_llama_args(args: argparse.Namespace) -> None:
    """Refuse what the Llama decoder does not do (pure: the same answer on every rank)."""
    refused = {f"--ep {args.ep}": (args.ep or 1) > 1,
               "--requests": args.requests is not None,
               "--checkpoint": args.checkpoint is not None,
               "--device gpu": args.device != "cpu"}
    from refmp.cli.serving import wanted

    mode = wanted(args)
    if mode is not None:
        refused[f"serving ({mode})"] = True
    bad = [k for k, v in refused.items() if v]
    if bad:
        raise ConfigError(f"--init {args.init}: a Llama directory decodes on the CPU from the "
                          f"directory's weights over tp, pp, cp and dp; {', '.join(bad)} is "
                          f"refused (a LlamaForCausalLM directory has no experts to split; "
                          f"continuous batching and serving run GPT-2's Ops)")


def run_llama(args: argparse.Namespace) -> dict | None:
    """Decode the prompts (collective over the world); world rank 0 prints (or --json) and
    returns the summary."""
    from refmp.checkpoint.llama_files import LlamaSource
    from refmp.checkpoint.tokenizer import TextTokenizer, tokenizer_files
    from refmp.cli.decoding import decode_prompts, report
    from refmp.distributed.faults import agreed
    from refmp.distributed.grid import ProcessGrid
    from refmp.inference.sampling import Sampler
    from refmp.parallel.tensor import llama as TPL

    check_llama_args(args)
    grid = ProcessGrid(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp)
    sampler = Sampler(args.temperature, args.top_k, args.top_p, args.seed)
    src = agreed(grid.world, lambda: LlamaSource(args.init))  # config.json, the headers
    cfg = src.cfg
    agreed(grid.world, lambda: TPL.check_tp(cfg, grid.sizes["tp"]))
    folder = args.tokenizer or args.init
    tok = TextTokenizer(folder) if args.prompt and tokenizer_files(folder) else None
    d = decode_prompts(args, grid, cfg, src, tok, sampler)  # reads this rank's share
    if grid.world.rank != 0:
        return None
    summary = {**d.summary(), "model": "llama", "n_kv_head": cfg.n_kv_head,
               "layout": grid.sizes}
    report(args, d.tokens, d.logits, tok, summary)
    return summary
