"""``refmp plan``: memory per rank and step time of every layout of a model on a machine, the
fastest that fit (refmp.cost: a pure computation; docs/plan.md); ``refmp train --layout auto``:
the plan for this host (--machine cpu: its rates, free memory and MPI links, measured by
refmp.cli.calibrate).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields, replace

from refmp.cli.calibrate import cpu_machine, measure_links
from refmp.config import TrainConfig, flag_name
from refmp.cost.family import Family
from refmp.cost.machines import MACHINES, MODELS, Machine
from refmp.cost.memory import size
from refmp.cost.model import IMPLS, SEARCHED, Layout, layout_flags, parallel_fields
from refmp.cost.nodes import cluster
from refmp.cost.presets import FAMILY, family
from refmp.cost.search import search, table
from refmp.errors import ConfigError
from refmp.nn.params import GPTConfig


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="predict memory and step time of layouts; search the best",
                       description="Predict memory per rank and step time of every layout of "
                                   "a model on a machine, and print the fastest that fit "
                                   "(a pure computation, no MPI: docs/plan.md).")
    add_plan_args(p)
    p.set_defaults(run=run_plan)


def add_plan_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--preset", choices=sorted(MODELS) + sorted(FAMILY), default=None,
                   help="a published shape (default gpt2 when no --n-layer is given; the "
                        "Llama family and the published runs': refmp.cost.presets)")
    for name in ("n_layer", "n_embd", "n_head", "vocab", "block_size", "n_expert", "top_k",
                 "n_kv_head", "ffn"):
        g.add_argument(flag_name(name), type=int, default=None, help="override the preset")
    g.add_argument("--block", choices=["gpt2", "llama"], default=None,
                   help="the block: GPT-2's, or the Llama family's (SwiGLU, RMSNorm, rotary, "
                        "no biases); default the preset's")
    g.add_argument("--head", choices=["tied", "untied"], default=None,
                   help="the LM head: wte (tied) or a matrix of its own; default the preset's")
    g.add_argument("--global-batch", type=int, default=512, help="sequences per step (512)")
    g = p.add_argument_group("machine")
    g.add_argument("--machine", choices=sorted(MACHINES) + ["cpu"], default="dgx-a100")
    g.add_argument("--gpus", type=int, default=None, help="ranks in all (default one node)")
    for name in ("gpus_per_node", "gpu_memory_gb", "peak_tflops", "hbm_gbs", "gemm_efficiency",
                 "intra_node_gbs", "inter_node_gbs", "intra_latency_us", "inter_latency_us"):
        g.add_argument(flag_name(name), type=float, default=None, help="override the machine's")
    g.add_argument("--link-gbit", type=float, default=None,
                   help="nodes with one link each, of this many Gbit/s each way, shared by "
                        "their --gpus-per-node ranks (refmp cluster's): --inter-node-gbs is "
                        "a rank's share of it (docs/nodes.md)")
    g.add_argument("--link-measured-gbs", type=float, default=None,
                   help="with --link-gbit: a rank's share of the link as measured (GB/s, "
                        "every pair crossing at once), taken where below the set rate's "
                        "(refmp.cost.nodes.cluster; docs/published_runs.md)")
    g = p.add_argument_group("layout (each fixes that choice; the rest is searched)")
    for f in fields(Layout):  # refmp.config's searched fields (refmp.cost.model)
        m, plan = f.metadata, f.metadata["plan"]
        if m["kind"] is bool:
            g.add_argument(flag_name(f.name), choices=["on", "off"], nargs="?", const="on",
                           default=None, help="on (the flag alone) or off")
        else:
            g.add_argument(flag_name(f.name), type=m["kind"], default=None,
                           choices=plan.get("choices", m["choices"]), help=plan.get("help"))
    p.add_argument("--impl", choices=sorted(IMPLS), default="refmp",
                   help="the implementation the step time models (refmp.cost.model.IMPLS; "
                        "docs/plan.md): refmp's own (default), Megatron-LM as Narayanan et al. "
                        "2021 ran it, or DeepSpeed's ZeRO-3; it fixes the choices it has no "
                        "other of (megatron-2021: --zero 0; deepspeed-zero3: --zero 3 --pp 1)")
    p.add_argument("--top", type=int, default=10, help="layouts printed (10)")
    p.add_argument("--json", action="store_true", help='print {"layouts": [...]}, best first')
    p.add_argument("--published", action="store_true",
                   help="the published runs the planner is held to, each against its figure "
                        "(docs/published_runs.md); the other flags are not read")


def model_of(args) -> GPTConfig:
    """The preset's shape with the flags given: a GPTConfig for GPT-2's block, a Family
    (refmp.cost.family) where a flag or the preset asks for more."""
    if args.preset in FAMILY:
        m = vars(family(args.preset))
    else:
        L, C, NH, V, T = MODELS[args.preset or "gpt2"]
        m = dict(n_layer=L, n_embd=C, n_head=NH, vocab_size=V, block_size=T)
    given = {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head,
             "vocab_size": args.vocab, "block_size": args.block_size,
             "n_kv_head": args.n_kv_head, "ffn": args.ffn,
             "swiglu": None if args.block is None else args.block == "llama",
             "tied": None if args.head is None else args.head == "tied"}
    m.update({k: v for k, v in given.items() if v is not None})
    if args.n_expert:
        m.update(n_expert=args.n_expert, top_k=args.top_k or 2)
    if set(m) <= set(GPTConfig.__dataclass_fields__):
        return GPTConfig(**m)
    cfg = Family(**m)
    kv = cfg.n_kv_head or cfg.n_head
    if kv < 1 or cfg.n_head % kv or cfg.ffn < 0:
        raise ConfigError(f"--n-kv-head ({kv}) must divide --n-head ({cfg.n_head}), and "
                          f"--ffn ({cfg.ffn}) be positive (0: 4 n_embd)")
    return cfg


def machine_of(args) -> Machine:
    mach = cpu_machine(args.gpus or 1) if args.machine == "cpu" else MACHINES[args.machine]
    over = {k: v for k, v in vars(args).items() if k in Machine.__dataclass_fields__
            and k != "name" and v is not None}
    if "gpus_per_node" in over:
        over["gpus_per_node"] = int(over["gpus_per_node"])
    mach = replace(mach, **over)
    if args.link_gbit is not None:
        if "inter_node_gbs" in over or not args.link_gbit > 0:
            raise ConfigError("--link-gbit (positive) sets --inter-node-gbs: give one of them")
        mach = cluster(mach, mach.gpus_per_node, args.link_gbit, mach.inter_latency_us,
                       args.link_measured_gbs)
    return mach


def run_plan(args: argparse.Namespace) -> dict:
    if args.published:
        from refmp.cli.plan_published import run_published
        return run_published(args.json)
    mcfg, mach = model_of(args), machine_of(args)
    gpus = args.gpus or mach.gpus_per_node
    fixed = {f.name: getattr(args, f.name) for f in fields(Layout)
             if getattr(args, f.name) is not None}
    if "sequence_parallel" in fixed:
        fixed["sequence_parallel"] = fixed["sequence_parallel"] == "on"
    impl = IMPLS[args.impl]
    for k, v in impl.fixed:
        if fixed.setdefault(k, v) != v:
            raise ConfigError(f"--impl {args.impl} runs {flag_name(k)} {v} only, not {fixed[k]}")
    fits, bad = search(mcfg, args.global_batch, gpus, mach, fixed, args.top, impl=impl)
    if args.json:
        print(json.dumps({"layouts": fits, "infeasible": bad[:args.top]}, indent=1))
    else:
        print(f"{mcfg.n_layer} layers, C {mcfg.n_embd}, {mcfg.n_head} heads{describe_family(mcfg)}, "
              f"V {mcfg.vocab_size}, "
              f"T {mcfg.block_size}, batch {args.global_batch} on {gpus} x {mach.name} "
              f"({mach.peak_tflops:g} TFLOP/s, {mach.gpu_memory_gb:g} GB, "
              f"{mach.gpus_per_node} per node), timed as {args.impl} runs it")
        print(table(fits, bad))
    if not fits:
        raise ConfigError("no layout fits: " + (bad[0]["reason"] if bad else "no candidates"))
    return {"layouts": fits}


def describe_family(mcfg: GPTConfig) -> str:
    """The heading's words for the Llama family's shape ('' for GPT-2's block)."""
    if not isinstance(mcfg, Family):
        return ""
    kv = mcfg.n_kv_head or mcfg.n_head
    return (f" ({kv} key/value), FFN {mcfg.ffn or 4 * mcfg.n_embd}"
            f"{' SwiGLU' if mcfg.swiglu else ''}, {'tied' if mcfg.tied else 'untied'} head")


# the train flag --layout auto cannot honour (the layout flags given are fixed choices)
TRAIN_REFUSED = {"stage_layers": "--stage-layers fixes the blocks of each stage, which "
                                 "--layout auto chooses: give --pp instead (the planner splits "
                                 "the blocks as the engine does by default)"}


def plan_train(cfg: TrainConfig, given: set[str], comm) -> tuple[TrainConfig, dict]:
    """``refmp train --layout auto``: the fastest layout that fits ``comm``'s ranks (refmp
    plan with --machine cpu), as the TrainConfig to run and the planner's row.

    ``given``: the TrainConfig fields set on the command line; the searched layout fields
    among them (refmp.cost.model.SEARCHED) are fixed choices, and --stage-layers is
    refused. Rank 0 plans (the cpu machine measures this host's GEMM peak, so ranks could
    disagree) and broadcasts the row, or the reason nothing fits: a ConfigError on every
    rank. The cpu machine's links are measured on ``comm`` first (measure_links).
    """
    from refmp.training.checks import build_dataset, model_config

    refused = [TRAIN_REFUSED[k] for k in sorted(given) if k in TRAIN_REFUSED]
    if refused:  # a pure function of the flags: the same on every rank
        raise ConfigError(refused[0])
    fixed = {k: getattr(cfg, k) for k in given if k in SEARCHED}
    links = measure_links(comm)  # every rank: MPI's bandwidth and latency on this host
    best, err = None, None
    if comm.Get_rank() == 0:
        try:
            mcfg = model_config(cfg, build_dataset(cfg))
            n = comm.Get_size()
            fits, bad = search(mcfg, cfg.batch_size, n, cpu_machine(n, links), fixed, 1,
                               cfg.dtype)
            if not fits:
                what = "; ".join(f"{k}={v}" for k, v in sorted(fixed.items())) or "no flags"
                raise ConfigError(f"--layout auto: no layout fits {n} rank(s) ({what} fixed): "
                                  + (bad[0]["reason"] if bad else "no candidates"))
            best = fits[0]
        except ConfigError as e:
            err = str(e)
    best, err = comm.bcast((best, err), root=0)
    if err is not None:
        raise ConfigError(err)
    chosen = parallel_fields(best, cfg.batch_size)
    return replace(cfg, **chosen), {**best, "microbatches": chosen["microbatches"]}


def stage_layers_auto(cfg: TrainConfig, comm, dataset=None) -> TrainConfig:
    """``--stage-layers auto``: the counts refmp.parallel.pipeline.partition.auto_stage_layers
    measures on this host for a micro-batch of this run (other configs pass unchanged)."""
    if cfg.stage_layers != "auto":
        return cfg
    from refmp.parallel.pipeline.partition import auto_stage_layers
    from refmp.training.checks import build_dataset, model_config

    mcfg = model_config(cfg, dataset or build_dataset(cfg))
    dp = cfg.dp or max(1, comm.Get_size() // (cfg.tp * cfg.pp * cfg.cp))  # None: the rest
    rows = max(1, cfg.batch_size // (dp * cfg.microbatches))
    return replace(cfg, stage_layers=auto_stage_layers(mcfg, cfg.pp * cfg.virtual_stages, rows,
                                                       cfg.dtype, comm))


def describe_train(best: dict, ranks: int) -> str:
    """The line refmp train --layout auto prints: the layout as train flags, the prediction."""
    flags = layout_flags(best)
    mem = sum(best["memory_bytes"].values())
    return (f"refmp train: --layout auto on {ranks} ranks (refmp plan --machine cpu) chose "
            f"{flags}: predicted {1e3 * best['step_seconds']:.3g} ms/step, {size(mem)} per rank")
