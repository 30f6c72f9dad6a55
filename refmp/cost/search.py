"""``refmp plan``'s search: every layout the fixed flags allow, checked, timed, sized and
ranked (refmp.cost.model has the cost model), the table and the command's flags (docs/plan.md).
"""

from __future__ import annotations

from dataclasses import replace

from refmp.cost.memory import need_bytes, size
from refmp.cost.model import (
    MACHINES,
    MODELS,
    Layout,
    Machine,
    cpu_machine,
    measure_links,
    memory,
    predict,
    total,
    train_config,
)
from refmp.errors import ConfigError
from refmp.nn.params import GPTConfig
from refmp.parallel.layout import check_layout


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(mcfg: GPTConfig, batch: int, gpus: int, mach: Machine, fixed: dict):
    """Every layout the fixed choices allow (the rest searched; docs/plan.md says which)."""
    def pick(key, options):
        return [fixed[key]] if fixed.get(key) is not None else options

    gpu = mach.name != "cpu"
    for tp in pick("tp", [d for d in divisors(gpus) if d <= mach.gpus_per_node]):
        for pp in pick("pp", [d for d in divisors(gpus // tp) if d <= mcfg.n_layer]):
            cps = [(cp, algo) for cp in pick("cp", [1])
                   for algo in pick("cp_algo", ["ring", "ulysses"] if cp > 1 else ["ring"])]
            for cp, algo in cps:
                dp = fixed.get("dp") or max(1, gpus // (tp * pp * cp))
                if fixed.get("microbatches") and batch % (dp * fixed["microbatches"]) == 0:
                    sizes = [batch // (dp * fixed["microbatches"])]  # b from --microbatches M
                elif fixed.get("microbatches"):
                    sizes = [0]  # refused by search: --global-batch not a multiple of dp M
                else:
                    sizes = pick("microbatch_size", [1, 2, 4, 8])
                eps = [e for e in divisors(dp * cp) if mcfg.n_expert % e == 0] \
                    if mcfg.n_expert else [1]
                for ep in pick("ep", eps):
                    for zero in pick("zero", [0, 1, 2, 3] if pp == 1 else [0, 1]):
                        for sp in pick("sequence_parallel", [False, True] if tp > 1 else [False]):
                            for rc in pick("recompute", ["none", "selective", "full"]):
                                for b in sizes:
                                    for sched, v in schedules(pp, fixed):
                                        yield Layout(tp, pp, dp, cp, ep, zero, sp, rc,
                                                     fixed.get("mixed_precision")
                                                     or ("bf16" if gpu else "none"), b, sched, v,
                                                     algo)


def schedules(pp: int, fixed: dict) -> list[tuple[str, int]]:
    if fixed.get("schedule") or fixed.get("virtual_stages"):
        v = fixed.get("virtual_stages") or (2 if fixed.get("schedule") == "interleaved" else 1)
        return [(fixed.get("schedule") or ("interleaved" if v > 1 else "1f1b"), v)]
    return [("1f1b", 1)] + ([("interleaved", 2)] if pp > 1 else [])


def search(mcfg: GPTConfig, batch: int, gpus: int, mach: Machine, fixed: dict | None = None,
           top: int = 10, dtype: str = "float32") -> tuple[list[dict], list[dict]]:
    """(feasible rows, best first, at most ``top``; infeasible rows, each with its reason).

    Every candidate is checked by refmp.parallel.layout.check_layout, then timed; memory is
    computed in order of predicted time until ``top`` fit (a faster layout that does not fit
    is reported with what does not fit)."""
    ok, bad, fixed = [], [], fixed or {}
    for lay in candidates(mcfg, batch, gpus, mach, fixed):
        if lay.microbatch_size == 0:
            bad.append(row(lay, None, None, f"the batch {batch} is not a multiple of dp * "
                                            f"microbatches ({lay.dp} * {fixed['microbatches']})"))
            continue
        if batch % (lay.dp * lay.microbatch_size):
            bad.append(row(lay, None, None, f"--global-batch {batch} is not a multiple of dp * "
                                            f"microbatch_size ({lay.dp} * {lay.microbatch_size})"))
            continue
        try:
            check_layout(train_config(lay, mcfg, batch, dtype), mcfg, gpus)
        except ConfigError as e:
            bad.append(row(lay, None, None, str(e)))
            continue
        ok.append((predict(lay, mcfg, batch, mach)["step_seconds"], lay))
    ok.sort(key=lambda x: x[0])
    fits, cap = [], mach.gpu_memory_gb * 1e9
    for _, lay in ok:
        mem = memory(lay, mcfg, batch, dtype)
        # refmp on this host also holds the full model at set-up (its own check, need_bytes)
        need = need_bytes(mem) if mach.name == "cpu" else total(mem) + mem["workspace"]
        r = row(lay, mem, predict(lay, mcfg, batch, mach), None)
        if need > cap:
            r["reason"] = (f"needs {size(need)} per rank on stage {mem['stage']} (params "
                           f"{size(mem['params'])}, grads {size(mem['grads'])}, optimizer "
                           f"{size(mem['optimizer'])}, activations {size(mem['activations'])}, "
                           f"workspace and set-up {size(need - total(mem))}) of {size(cap)}")
            bad.append(r)
        else:
            fits.append(r)
        if len(fits) >= top:
            break
    return fits, bad


def row(lay: Layout, mem: dict | None, pred: dict | None, reason: str | None) -> dict:
    """One layout as --json prints it (the issue's keys), plus the seconds by term."""
    r = {**lay.__dict__}
    if mem is not None:
        r["memory_bytes"] = {k: mem[k] for k in ("params", "grads", "optimizer", "activations")}
    if pred is not None:
        r.update({k: pred[k] for k in ("step_seconds", "tokens_per_s", "tflops_per_gpu", "mfu")})
        r["seconds"] = pred["seconds"]
    if reason is not None:
        r["reason"] = reason
    return r


KEYS = ("tp", "pp", "dp", "cp", "ep", "zero", "sequence_parallel", "recompute",
        "mixed_precision", "microbatch_size", "schedule", "virtual_stages", "cp_algo")


def describe(r: dict) -> str:
    return " ".join(f"{k}={r[k]}" for k in KEYS)


def why(best: dict, second: dict) -> str:
    """Which term of the step makes the best layout faster than the runner-up."""
    a, b = best["seconds"], second["seconds"]
    term = max(a, key=lambda k: b[k] - a[k])
    if second["step_seconds"] - best["step_seconds"] < 1e-9:
        return "the best and the runner-up tie: the same predicted step time"
    return (f"the best is {1e3 * (second['step_seconds'] - best['step_seconds']):.1f} ms/step "
            f"faster than the runner-up, mostly in {term} ({1e3 * a[term]:.1f} vs "
            f"{1e3 * b[term]:.1f} ms)")


def table(fits: list[dict], bad: list[dict]) -> str:
    head = (f"{'#':>2} {'tp':>3} {'pp':>3} {'dp':>4} {'cp':>3} {'ep':>3} {'zero':>4} {'sp':>3} "
            f"{'recompute':>9} {'mp':>4} {'b':>2} {'schedule':>11} {'v':>2} {'GB/rank':>8} "
            f"{'s/step':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6}")
    lines = [head]
    for i, r in enumerate(fits):
        gb = sum(r["memory_bytes"].values()) / 1e9
        lines.append(f"{i + 1:>2} {r['tp']:>3} {r['pp']:>3} {r['dp']:>4} {r['cp']:>3} "
                     f"{r['ep']:>3} {r['zero']:>4} {'y' if r['sequence_parallel'] else 'n':>3} "
                     f"{r['recompute']:>9} {r['mixed_precision']:>4} {r['microbatch_size']:>2} "
                     f"{r['schedule']:>11} {r['virtual_stages']:>2} {gb:>8.2f} "
                     f"{r['step_seconds']:>8.3f} {r['tokens_per_s']:>10.0f} "
                     f"{r['tflops_per_gpu']:>8.3g} {100 * r['mfu']:>5.1f}%")
    if len(fits) >= 2:
        lines.append(why(fits[0], fits[1]))
    if not fits:
        lines.append("no layout fits:")
        for r in bad[:5]:
            lines.append(f"  {describe(r)}: {r['reason']}")
    else:
        lines.append(f"{len(bad)} layouts left out (divisibility, or faster but not fitting)")
        for r in [r for r in bad if "step_seconds" in r][:3]:
            lines.append(f"  {describe(r)}: {r['reason']}")
    return "\n".join(lines)


def add_plan_args(p) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--preset", choices=sorted(MODELS), default=None,
                   help="a published shape (default gpt2 when no --n-layer is given)")
    for name in ("n_layer", "n_embd", "n_head", "vocab", "block_size", "n_expert", "top_k"):
        g.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                       help="override the preset")
    g.add_argument("--global-batch", type=int, default=512, help="sequences per step (512)")
    g = p.add_argument_group("machine")
    g.add_argument("--machine", choices=sorted(MACHINES) + ["cpu"], default="dgx-a100")
    g.add_argument("--gpus", type=int, default=None, help="ranks in all (default one node)")
    for name in ("gpus_per_node", "gpu_memory_gb", "peak_tflops", "hbm_gbs", "gemm_efficiency",
                 "intra_node_gbs", "inter_node_gbs", "intra_latency_us", "inter_latency_us"):
        g.add_argument(f"--{name.replace('_', '-')}", type=float, default=None,
                       help="override the machine's")
    g = p.add_argument_group("layout (each fixes that choice; the rest is searched)")
    for name in ("tp", "pp", "dp", "cp", "ep", "microbatch_size", "virtual_stages"):
        g.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    g.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=None)
    g.add_argument("--sequence-parallel", choices=["on", "off"], nargs="?", const="on",
                   default=None, help="on (the flag alone) or off")
    g.add_argument("--recompute", choices=["none", "selective", "full"], default=None)
    g.add_argument("--mixed-precision", choices=["none", "bf16", "fp16"], default=None)
    g.add_argument("--schedule", choices=["1f1b", "gpipe", "interleaved", "zb-h1"], default=None)
    g.add_argument("--cp-algo", choices=["ring", "ulysses"], default=None,
                   help="with --cp > 1 (default: both searched)")
    p.add_argument("--top", type=int, default=10, help="layouts printed (10)")
    p.add_argument("--json", action="store_true", help='print {"layouts": [...]}, best first')


def model_of(args) -> GPTConfig:
    L, C, NH, V, T = MODELS[args.preset or "gpt2"]
    given = {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head,
             "vocab_size": args.vocab, "block_size": args.block_size}
    m = dict(n_layer=L, n_embd=C, n_head=NH, vocab_size=V, block_size=T)
    m.update({k: v for k, v in given.items() if v is not None})
    if args.n_expert:
        m.update(n_expert=args.n_expert, top_k=args.top_k or 2)
    return GPTConfig(**m)


def machine_of(args) -> Machine:
    mach = cpu_machine(args.gpus or 1) if args.machine == "cpu" else MACHINES[args.machine]
    over = {k: v for k, v in vars(args).items() if k in Machine.__dataclass_fields__
            and k != "name" and v is not None}
    if "gpus_per_node" in over:
        over["gpus_per_node"] = int(over["gpus_per_node"])
    return replace(mach, **over)


def run_plan(args) -> dict:
    import json

    mcfg, mach = model_of(args), machine_of(args)
    gpus = args.gpus or mach.gpus_per_node
    fixed = {k: getattr(args, k) for k in KEYS if getattr(args, k, None) is not None}
    if "sequence_parallel" in fixed:
        fixed["sequence_parallel"] = fixed["sequence_parallel"] == "on"
    fits, bad = search(mcfg, args.global_batch, gpus, mach, fixed, args.top)
    if args.json:
        print(json.dumps({"layouts": fits, "infeasible": bad[:args.top]}, indent=1))
    else:
        print(f"{mcfg.n_layer} layers, C {mcfg.n_embd}, {mcfg.n_head} heads, V {mcfg.vocab_size}, "
              f"T {mcfg.block_size}, batch {args.global_batch} on {gpus} x {mach.name} "
              f"({mach.peak_tflops:g} TFLOP/s, {mach.gpu_memory_gb:g} GB, "
              f"{mach.gpus_per_node} per node)")
        print(table(fits, bad))
    if not fits:
        raise ConfigError("no layout fits: " + (bad[0]["reason"] if bad else "no candidates"))
    return {"layouts": fits}


# refmp train's flags that --layout auto keeps as fixed choices of the search (TrainConfig
# field: the planner's key), and the one it cannot honour
TRAIN_FIXED = {"tp": "tp", "pp": "pp", "dp": "dp", "cp": "cp", "ep": "ep", "zero": "zero",
               "sequence_parallel": "sequence_parallel", "recompute": "recompute",
               "mixed_precision": "mixed_precision", "schedule": "schedule",
               "virtual_stages": "virtual_stages", "cp_algo": "cp_algo",
               "microbatches": "microbatches"}
TRAIN_REFUSED = {"stage_layers": "--stage-layers fixes the blocks of each stage, which "
                                 "--layout auto chooses: give --pp instead (the planner splits "
                                 "the blocks as the engine does by default)"}


def plan_train(cfg, given: set[str], comm) -> tuple:
    """``refmp train --layout auto``: the fastest layout that fits ``comm``'s ranks (refmp
    plan with --machine cpu), as the TrainConfig to run and the planner's row.

    ``given``: the TrainConfig fields set on the command line; the layout flags among them
    are fixed choices of the search (TRAIN_FIXED), and --stage-layers is refused. Rank 0
    plans (the cpu machine measures this host's GEMM peak, so ranks could disagree) and
    broadcasts the row, or the reason nothing fits: a ConfigError on every rank. The cpu
    machine's links are measured on ``comm`` first (plan.measure_links).
    """
    from refmp.training.trainer import build_dataset, model_config

    refused = [TRAIN_REFUSED[k] for k in sorted(given) if k in TRAIN_REFUSED]
    if refused:  # a pure function of the flags: the same on every rank
        raise ConfigError(refused[0])
    fixed = {TRAIN_FIXED[k]: getattr(cfg, k) for k in given if k in TRAIN_FIXED}
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
    chosen = {k: best[k] for k in ("tp", "pp", "dp", "cp", "ep", "zero", "sequence_parallel",
                                   "recompute", "mixed_precision", "schedule",
                                   "virtual_stages", "cp_algo")}
    chosen["microbatches"] = cfg.batch_size // (best["dp"] * best["microbatch_size"])
    return replace(cfg, **chosen), {**best, "microbatches": chosen["microbatches"]}


def describe_train(best: dict, ranks: int) -> str:
    """The line refmp train --layout auto prints: the layout as train flags, the prediction."""
    flags = (f"--tp {best['tp']} --pp {best['pp']} --dp {best['dp']} --cp {best['cp']} "
             f"--ep {best['ep']} --zero {best['zero']}"
             + (" --sequence-parallel" if best["sequence_parallel"] else "")
             + f" --recompute {best['recompute']} --mixed-precision {best['mixed_precision']}"
             f" --microbatches {best['microbatches']} --schedule {best['schedule']}"
             f" --virtual-stages {best['virtual_stages']}"
             + (f" --cp-algo {best['cp_algo']}" if best["cp"] > 1 else ""))
    mem = sum(best["memory_bytes"].values())
    return (f"refmp train: --layout auto on {ranks} ranks (refmp plan --machine cpu) chose "
            f"{flags}: predicted {1e3 * best['step_seconds']:.3g} ms/step, {size(mem)} per rank")
