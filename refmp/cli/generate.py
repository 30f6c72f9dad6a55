"""``refmp generate``: decode new tokens after prompts, from trained or downloaded weights, on
any layout (docs/inference.md).

Every rank reads the weights and the prompts, checks that the layout fits them (the same
answer everywhere: bad input is one message and exit 2 on every rank), keeps its share of
the model (refmp.inference.decoder), and decodes its dp rows; world rank 0 gathers the tokens
and the logits that chose them, writes and prints them.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from refmp.cli.decoding import check_fits, decode_prompts, report
from refmp.cli.flags import add_layout_args, add_moe_args
from refmp.cli.serving import add_serving_args, run_serving, wanted
from refmp.errors import ConfigError


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="decode from a model with a KV cache, on any layout",
                       description="Generate tokens after prompts with a KV cache split like "
                                   "the model (tp heads, pp layers, cp tokens); e.g. `refmp "
                                   "generate --init model.safetensors --prompt 123+456=`.")
    w = g.add_argument_group("weights and prompts")
    w.add_argument("--init", default=None, metavar="PATH",
                   help="a GPT-2-named safetensors file (refmp train --save), or a Hugging "
                        "Face model directory (config.json, model.safetensors and its "
                        "tokenizer's files)")
    w.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="a sharded checkpoint (refmp train --checkpoint-dir), any layout")
    w.add_argument("--n-head", type=int, default=None, metavar="N",
                   help="attention heads of an --init file that does not say them (a GPT-2 "
                        "file from another implementation); refmp's files, Hugging Face "
                        "directories and a config.json beside the file say them")
    w.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a Hugging Face tokenizer (tokenizer.json, or vocab.json and "
                        "merges.txt; the text extra) for --prompt TEXT and the printed "
                        "continuation; default: the one the weights name or their directory "
                        "holds")
    w.add_argument("--prompts", default=None, metavar="PATH.npy",
                   help="token ids, an integer array (B, T0)")
    w.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help="a prompt as text (repeatable; equal lengths in tokens), in the "
                        "weights' tokenizer: the addition task's characters, bytes, or a "
                        "Hugging Face tokenizer (--tokenizer, or the weights' directory's)")
    w.add_argument("--requests", default=None, metavar="PATH.jsonl",
                   help="continuous batching: one request a line, {\"prompt\": ids or text, "
                        "\"max_new_tokens\": N, \"arrival\": step}")
    d = g.add_argument_group("decoding")
    d.add_argument("--max-new-tokens", type=int, default=None,
                   help="new tokens per prompt (default 16, or as many as the positions left)")
    d.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    d.add_argument("--top-k", type=int, default=0, help="sample from the k most likely (0: all)")
    d.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: all)")
    d.add_argument("--seed", type=int, default=0, help="sampling seed (0)")
    d.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    d.add_argument("--device", choices=["cpu", "gpu"], default=os.environ.get("REFMP_DEVICE", "cpu"),
                   help="cpu (NumPy) or gpu (CuPy, one GPU per rank); default $REFMP_DEVICE or cpu")
    d.add_argument("--no-kv-cache", dest="kv_cache", action="store_false",
                   help="recompute the whole sequence for every token (the baseline)")
    d.add_argument("--kv-block-size", type=int, default=None, metavar="N",
                   help="a paged cache of N-token blocks (PagedAttention); default contiguous")
    d.add_argument("--max-batch", type=int, default=8,
                   help="continuous batching: requests decoded together (8)")
    add_layout_args(g, only=("tp", "pp", "dp", "cp", "ep", "cp_balance"))
    add_moe_args(g, decoding=True)
    add_serving_args(g)
    o = g.add_argument_group("output")
    o.add_argument("--save-tokens", default=None, metavar="PATH.npy", help="tokens (B, T0+N)")
    o.add_argument("--save-logits", default=None, metavar="PATH.npy",
                   help="the logits that chose each new token (B, N, V)")
    o.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(run=run_generate)


def run_generate(args: argparse.Namespace) -> dict | None:
    """The command (collective over the world); the summary on world rank 0."""

    from refmp.checkpoint.hf_llama import is_llama_dir
    from refmp.cost.decode import decode_memory
    from refmp.distributed.faults import agreed
    from refmp.distributed.gpu import start_gpu
    from refmp.distributed.grid import ProcessGrid
    from refmp.inference.sampling import Sampler
    from refmp.inference.sources import weight_source
    from refmp.runtime.cgroup import peak

    if args.init is not None and is_llama_dir(args.init):  # a Llama directory: the same Decoder
        from refmp.cli.generate_llama import run_llama

        return run_llama(args)
    mode = wanted(args)
    if mode is not None:  # prefix caching, chunked prefill, speculative, disaggregated
        return run_serving(args, mode)
    grid = ProcessGrid(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep)
    world = grid.world
    if args.device == "gpu":
        if args.requests is not None:
            raise ConfigError("--device gpu decodes --prompts or --prompt; --requests "
                              "(continuous batching) runs on the CPU")
        start_gpu(grid)  # before any array: the Decoder's shards go straight to the GPU
    sampler = Sampler(args.temperature, args.top_k, args.top_p, args.seed)
    moe = {"top_k": args.moe_top_k, "moe_every": args.moe_every}
    text = args.prompt is not None or args.requests is not None  # prompts that may be text
    # the weights' Source: each rank reads only its slices (Decoder), never the whole model
    mcfg, src, tok = agreed(world, lambda: weight_source(args.init, args.checkpoint, moe,
                                                         args.n_head, args.tokenizer, text))
    if args.requests is not None:
        return run_requests(args, grid, mcfg, src, tok, sampler)
    d = decode_prompts(args, grid, mcfg, src, tok, sampler,
                       ": give them as --requests PATH.jsonl (continuous batching)")
    # each rank's measured peak beside the prediction (refmp.cost.decode)
    pred = decode_memory(mcfg, grid.sizes, grid.coords, d.rows, d.positions,
                         np.dtype(args.dtype).itemsize, src.read("ln_f.weight").itemsize)
    peaks = world.allgather_obj({**peak(), "predicted": pred["peak"]})
    if world.rank != 0:
        return None
    summary = {**d.summary(), "layout": grid.sizes, "kv_cache": args.kv_cache,
               "memory_measured": peaks}
    report(args, d.tokens, d.logits, tok, summary)
    return summary


def run_requests(args, grid, mcfg, src, tok, sampler) -> dict | None:
    """``--requests``: continuous batching; request i is served by dp rank i mod dp."""
    from refmp.distributed.faults import agreed
    from refmp.inference.decoder import Decoder
    from refmp.inference.scheduler import Request, serve
    from refmp.inference.sources import read_requests

    world, s = grid.world, grid.sizes
    reqs = agreed(world, lambda: read_requests(args.requests, tok, mcfg.vocab_size))
    check_fits(args, mcfg, s, [r["prompt"] for r in reqs])
    if s["cp"] > 1 or s["ep"] > 1:
        raise ConfigError("--requests (continuous batching) runs on tp, pp and dp; the cp and "
                          "ep ranks would have to decode the same requests in step")
    if args.max_batch < 1:
        raise ConfigError(f"--max-batch must be at least 1, got {args.max_batch}")
    dec = Decoder(mcfg, src, grid, dtype=args.dtype)
    ids = list(range(grid.coords["dp"], len(reqs), s["dp"]))
    mine = [Request(reqs[i]["prompt"], reqs[i]["max_new_tokens"], reqs[i]["arrival"])
            for i in ids]
    out = serve(dec, mine, sampler, args.max_batch, args.kv_block_size, ids)
    holder = dec.last and grid.coords["tp"] == 0
    got = world.allgather_obj((ids, out.tokens) if holder else None)
    kv = world.allgather_obj(out.kv_cache_bytes)
    seconds = world.allreduce_metrics([out.seconds], op="max")[0]
    if world.rank != 0:
        return None
    tokens = dict(zip(*(sum((list(g[k]) for g in got if g is not None), []) for k in (0, 1)),
                      strict=True))
    rows = [tokens[i] for i in range(len(reqs))]
    n_new = sum(r["max_new_tokens"] for r in reqs)
    summary = {"tokens_per_s": n_new / seconds, "seconds": seconds, "kv_cache_bytes": kv,
               "layout": s, "requests": len(reqs),
               "new_tokens": [t[len(r["prompt"]):].tolist() for t, r in zip(rows, reqs,
                                                                              strict=True)]}
    if tok is not None:
        summary["texts"] = [tok.decode(t) for t in summary["new_tokens"]]
    if args.save_tokens:  # requests of different lengths: an object array
        np.save(args.save_tokens, np.array(rows, dtype=object), allow_pickle=True)
    print(json.dumps(summary) if args.json else "\n".join(
        f"[{i}] {t!r}" for i, t in enumerate(summary.get("texts", summary["new_tokens"]))))
    return summary
