"""``refmp generate``'s serving flags (docs/serving.md): prefix caching and chunked prefill
in continuous batching (--requests), speculative decoding (--draft), prefill/decode
disaggregation (--prefill-tp / --prefill-pp).

Each is checked before any work, from the flags and the layout alone (the same answer on
every rank: one message and exit 2 everywhere), and runs on the CPU.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from refmp.errors import ConfigError


def add_serving_args(g) -> None:
    s = g.add_argument_group("serving (docs/serving.md)")
    s.add_argument("--prefix-cache", action="store_true",
                   help="--requests: requests share the cached blocks of their common prompt "
                        "prefix (needs --kv-block-size)")
    s.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="--requests: prefill prompts N tokens a turn, batched with the decodes")
    s.add_argument("--draft", default=None, metavar="PATH|lookup",
                   help="speculative decoding: a smaller model's file or directory as the "
                        "draft, or 'lookup' (prompt lookup, no model)")
    s.add_argument("--gamma", type=int, default=4, help="draft tokens verified per pass (4)")
    s.add_argument("--prefill-tp", type=int, default=None, metavar="N",
                   help="disaggregation: the world's first N x --prefill-pp ranks prefill "
                        "(tp N), the others decode (--tp, --pp)")
    s.add_argument("--prefill-pp", type=int, default=None, metavar="N",
                   help="disaggregation: the prefill group's pipeline stages")


def wanted(args: argparse.Namespace) -> str | None:
    """The serving mode the flags ask for, if any (refused when they ask for several)."""
    modes = []
    if args.prefix_cache or args.prefill_chunk is not None:
        modes.append("chunked")
    if args.draft is not None:
        modes.append("speculative")
    if args.prefill_tp is not None or args.prefill_pp is not None:
        modes.append("disaggregated")
    if len(modes) > 1:
        raise ConfigError(f"--prefix-cache/--prefill-chunk, --draft and --prefill-tp/--prefill-pp"
                          f" are separate modes; these flags ask for {modes}")
    return modes[0] if modes else None


def check_serving(args: argparse.Namespace, mode: str, world_size: int) -> None:
    """Refuse the combinations a mode does not run (pure)."""
    if args.device == "gpu":
        raise ConfigError(f"--device gpu decodes plainly; {mode} serving runs on the CPU")
    if not args.kv_cache:
        raise ConfigError(f"{mode} serving extends a KV cache: drop --no-kv-cache")
    if args.cp > 1 or args.ep > 1:
        raise ConfigError(f"{mode} serving runs on tp, pp and dp: each cp rank holds a share of "
                          f"every request's tokens, each ep rank its own requests' (--cp "
                          f"{args.cp}, --ep {args.ep})")
    if mode == "chunked":
        if args.requests is None:
            raise ConfigError("--prefix-cache and --prefill-chunk serve --requests PATH.jsonl")
        if args.prefix_cache and args.kv_block_size is None:
            raise ConfigError("--prefix-cache shares blocks of a paged cache: give "
                              "--kv-block-size")
        if args.prefill_chunk is not None and args.prefill_chunk < 1:
            raise ConfigError(f"--prefill-chunk must be at least 1, got {args.prefill_chunk}")
    if mode == "speculative":
        if args.requests is not None:
            raise ConfigError("--draft decodes --prompts or --prompt, not --requests")
        if args.gamma < 1:
            raise ConfigError(f"--gamma must be at least 1, got {args.gamma}")
    if mode == "disaggregated":
        if args.requests is not None or args.dp not in (None, 1):
            raise ConfigError("disaggregation decodes --prompts or --prompt of equal lengths on "
                              "one replica per group: no --requests, no --dp")
        n = (args.prefill_tp or 1) * (args.prefill_pp or 1) + args.tp * args.pp
        if n != world_size:
            raise ConfigError(f"--prefill-tp {args.prefill_tp or 1} x --prefill-pp "
                              f"{args.prefill_pp or 1} prefill ranks and --tp {args.tp} x --pp "
                              f"{args.pp} decode ranks make {n}; the world has {world_size}")


def run_serving(args: argparse.Namespace, mode: str) -> dict | None:
    """The command in a serving mode (collective over the world)."""
    from mpi4py import MPI

    from refmp.distributed.comm import Comm
    from refmp.distributed.faults import agreed
    from refmp.inference.sampling import Sampler
    from refmp.inference.sources import read_prompts, weight_source

    world = Comm(MPI.COMM_WORLD)
    check_serving(args, mode, world.size)
    sampler = Sampler(args.temperature, args.top_k, args.top_p, args.seed)
    moe = {"top_k": args.moe_top_k, "moe_every": args.moe_every}
    text = args.prompt is not None or args.requests is not None
    mcfg, src, tok = agreed(world, lambda: weight_source(args.init, args.checkpoint, moe,
                                                         args.n_head, args.tokenizer, text))
    if mode == "chunked":
        return _chunked(args, mcfg, src, tok, sampler)
    prompts = agreed(world, lambda: read_prompts(args.prompts, args.prompt, tok,
                                                 mcfg.vocab_size))
    n_new = args.max_new_tokens or max(1, min(16, mcfg.block_size - max(map(len, prompts)) + 1))
    if max(map(len, prompts)) + n_new - 1 > mcfg.block_size:
        raise ConfigError(f"prompts of up to {max(map(len, prompts))} tokens and {n_new} new "
                          f"ones do not fit the model's {mcfg.block_size} positions")
    if mode == "speculative":
        draft = agreed(world, lambda: _draft(args, mcfg))
        return _speculative(args, mcfg, src, tok, sampler, prompts, n_new, draft)
    return _disaggregated(args, mcfg, src, tok, sampler, prompts, n_new)


def _draft(args, mcfg):
    """The draft: prompt lookup, or a smaller model read whole on every rank."""
    from mpi4py import MPI

    from refmp.distributed.grid import ProcessGrid
    from refmp.inference.decoder import Decoder
    from refmp.inference.sources import weight_source
    from refmp.inference.speculative import DraftModel, PromptLookup

    if args.draft == "lookup":
        return PromptLookup(mcfg.vocab_size)
    dcfg, dsrc, _ = weight_source(args.draft, None, None, None, None, False)
    if dcfg.vocab_size != mcfg.vocab_size:
        raise ConfigError(f"the draft's vocabulary ({dcfg.vocab_size}) is not the model's "
                          f"({mcfg.vocab_size})")
    if dcfg.block_size < mcfg.block_size:
        raise ConfigError(f"the draft has {dcfg.block_size} positions, fewer than the model's "
                          f"{mcfg.block_size}")
    return DraftModel(Decoder(dcfg, dsrc, ProcessGrid(MPI.COMM_SELF), dtype=args.dtype),
                      args.kv_block_size)


def _chunked(args, mcfg, src, tok, sampler) -> dict | None:
    from refmp.distributed.faults import agreed
    from refmp.distributed.grid import ProcessGrid
    from refmp.inference.decoder import Decoder
    from refmp.inference.scheduler import Request
    from refmp.inference.serving import serve_chunked
    from refmp.inference.sources import read_requests

    grid = ProcessGrid(dp=args.dp, tp=args.tp, pp=args.pp)
    reqs = agreed(grid.world, lambda: read_requests(args.requests, tok, mcfg.vocab_size))
    dec = Decoder(mcfg, src, grid, dtype=args.dtype)
    ids = list(range(grid.coords["dp"], len(reqs), grid.sizes["dp"]))
    mine = [Request(reqs[i]["prompt"], reqs[i]["max_new_tokens"], reqs[i]["arrival"])
            for i in ids]
    out = serve_chunked(dec, mine, sampler, args.max_batch, args.kv_block_size,
                        args.prefill_chunk, args.prefix_cache, ids)
    got = grid.world.allgather_obj((_holder(grid), ids, out.tokens, out.prefilled, out.saved,
                                    out.seconds))
    if grid.world.rank != 0:
        return None
    mine = [g for g in got if g[0]]  # one rank of each dp replica
    rows = {i: t for g in mine for i, t in zip(g[1], g[2], strict=True)}
    return _report(args, tok, [rows[i] for i in range(len(reqs))],
                   [r["prompt"] for r in reqs], max(g[5] for g in got),
                   {"prefill_tokens": sum(g[3] for g in mine),
                    "prefix_saved_tokens": sum(g[4] for g in mine)})


def _holder(grid) -> bool:
    """The rank that reports its dp replica's requests (every rank has their tokens)."""
    return grid.coords["tp"] == 0 and grid.coords["pp"] == 0


def _speculative(args, mcfg, src, tok, sampler, prompts, n_new, draft) -> dict | None:
    from refmp.cost.serving import tokens_per_pass
    from refmp.distributed.grid import ProcessGrid
    from refmp.inference.decoder import Decoder
    from refmp.inference.speculative import speculate

    grid = ProcessGrid(dp=args.dp, tp=args.tp, pp=args.pp)
    if len(prompts) < grid.sizes["dp"]:
        raise ConfigError(f"--dp {grid.sizes['dp']} ranks but {len(prompts)} prompts")
    dec = Decoder(mcfg, src, grid, dtype=args.dtype)
    ids = np.array_split(np.arange(len(prompts)), grid.sizes["dp"])[grid.coords["dp"]]
    out = speculate(dec, [prompts[i] for i in ids], n_new, sampler, draft, args.gamma,
                    args.kv_block_size, ids)
    got = grid.world.allgather_obj((_holder(grid), list(ids), out.tokens, out.passes,
                                    out.proposed, out.accepted, out.seconds))
    if grid.world.rank != 0:
        return None
    mine = [g for g in got if g[0]]  # one rank of each dp replica
    rows = {i: t for g in mine for i, t in zip(g[1], g[2], strict=True)}
    passes, proposed, accepted = (sum(g[k] for g in mine) for k in (3, 4, 5))
    a = accepted / proposed if proposed else 0.0
    return _report(args, tok, [rows[i] for i in range(len(prompts))], prompts,
                   max(x[6] for x in got),
                   {"target_passes": passes, "draft_proposed": proposed,
                    "draft_accepted": accepted, "acceptance": a,
                    "tokens_per_pass": (accepted + passes) / max(passes, 1),
                    "predicted_tokens_per_pass": tokens_per_pass(a, args.gamma)})


def _disaggregated(args, mcfg, src, tok, sampler, prompts, n_new) -> dict | None:
    from mpi4py import MPI

    from refmp.inference.disaggregate import disaggregated

    if len({len(p) for p in prompts}) > 1:
        raise ConfigError(f"disaggregation decodes prompts of equal lengths; got "
                          f"{sorted({len(p) for p in prompts})}")
    world = MPI.COMM_WORLD  # the two groups' ranks
    prefill = {"tp": args.prefill_tp or 1, "pp": args.prefill_pp or 1}
    out = disaggregated(world, prefill, {"tp": args.tp, "pp": args.pp}, mcfg, src,
                        np.array(prompts, dtype=np.int64), n_new, sampler,
                        args.kv_block_size or 16, args.dtype)
    got = world.gather((out.tokens, out.kv_bytes_sent, out.seconds), root=0)
    if world.rank != 0:
        return None
    tokens = next(g[0] for g in got if g[0] is not None)
    return _report(args, tok, list(tokens), prompts, max(g[2] for g in got),
                   {"kv_bytes_sent": sum(g[1] for g in got)})


def _report(args, tok, rows, prompts, seconds: float, extra: dict) -> dict:
    """Print and return the summary (world rank 0)."""
    new = [list(map(int, t[len(p):])) for t, p in zip(rows, prompts, strict=True)]
    summary = {"tokens_per_s": sum(map(len, new)) / seconds, "seconds": seconds, **extra,
               "new_tokens": new}
    if tok is not None:
        summary["texts"] = [tok.decode(t) for t in new]
    if args.save_tokens:
        np.save(args.save_tokens, np.array([np.asarray(t) for t in rows], dtype=object),
                allow_pickle=True)
    print(json.dumps(summary) if args.json else "\n".join(
        f"[{i}] {t!r}" for i, t in enumerate(summary.get("texts", new))), flush=True)
    return summary
