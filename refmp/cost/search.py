"""``refmp plan``'s search: every layout the fixed choices allow, checked, timed, sized and
ranked (refmp.cost.model times a layout, refmp.cost.memory sizes it), and the table the
command prints (docs/plan.md; the command itself: refmp.cli.plan). On nodes that share one
link (``--link-gbit``) refmp.cost.nodes times it, and each layout gets the faster of the flat
and the hierarchical data-parallel all-reduce (its ``dp_reduce``).
"""

from __future__ import annotations

from dataclasses import fields, replace

from refmp.cost.machines import Machine
from refmp.cost.memory import memory, need_bytes, size, total
from refmp.cost.model import Impl, Layout, predict, train_config
from refmp.cost.nodes import best_reduce
from refmp.errors import ConfigError
from refmp.nn.params import GPTConfig
from refmp.parallel.pipeline.catalog import CATALOG
from refmp.parallel.rules import check_layout


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(mcfg: GPTConfig, batch: int, gpus: int, mach: Machine, fixed: dict,
               selective: bool = True):
    """Every layout the fixed choices allow (the rest searched; docs/plan.md says which).
    ``selective``: selective recomputation is a choice of its own (False where it runs what
    none runs: Impl.attention_recomputes, refmp's attention)."""
    def pick(key, options):
        return [fixed[key]] if fixed.get(key) is not None else options

    gpu = mach.name != "cpu"
    codec = {k: fixed[k] for k in ("grad_compress", "compress_rank", "compress_ratio",
                                   "weight_gather", "quant_block", "fp8") if fixed.get(k) is not None}
    for tp in pick("tp", [d for d in divisors(gpus) if d <= mach.gpus_per_node]):
        for pp in pick("pp", [d for d in divisors(gpus // tp) if d <= mcfg.n_layer]):
            cps = [(cp, algo, U) for cp in pick("cp", [1])
                   for algo in pick("cp_algo", ["ring", "ulysses"] if cp > 1 else ["ring"])
                   for U in pick("cp_ulysses", hierarchical_cp(cp, algo))]
            for cp, algo, U in cps:
                dp = fixed.get("dp") or max(1, gpus // (tp * pp * cp))
                if fixed.get("microbatches") and batch % (dp * fixed["microbatches"]) == 0:
                    sizes = [batch // (dp * fixed["microbatches"])]  # b from --microbatches M
                elif fixed.get("microbatches"):
                    sizes = [0]  # refused by search: --global-batch not a multiple of dp M
                else:
                    sizes = pick("microbatch_size", [1, 2, 4, 8])
                etp = fixed.get("etp") or 0  # folding: ep x etp over the stage's tp cp dp
                stage = dp * cp * tp // etp if etp and (dp * cp * tp) % etp == 0 else dp * cp
                eps = [e for e in divisors(stage) if mcfg.n_expert % e == 0] \
                    if mcfg.n_expert else [1]
                for ep in pick("ep", eps):
                    for zero, shard in [(z, n) for z in pick("zero", [0, 1, 2, 3] if pp == 1 else [0, 1])
                                        for n in pick("dp_shard", hsdp(z, dp, tp * cp, mach))]:
                        for sp in pick("sequence_parallel", [False, True] if tp > 1 else [False]):
                            for rc in pick("recompute", ["none", "selective", "full"]
                                           if selective else ["none", "full"]):
                                for b in sizes:
                                    for sched, v in schedules(pp, fixed):
                                        yield Layout(tp, pp, dp, cp, ep, zero, sp, rc,
                                                     fixed.get("mixed_precision")
                                                     or ("bf16" if gpu else "none"), b, sched, v,
                                                     algo, cp_ulysses=U, dp_shard=shard, etp=etp,
                                                     **codec)


def hierarchical_cp(cp: int, algo: str) -> list[int]:
    """--cp-ulysses choices: 1, and with the ring every U between 1 and cp that divides cp."""
    return [1] + (divisors(cp)[1:-1] if algo == "ring" else [])


def hsdp(zero: int, dp: int, per: int, mach: Machine) -> list[int]:
    """--dp-shard choices: 0 (all of dp), and with ZeRO, where dp spans nodes, HSDP with the
    dp ranks of one node (``per``: the tp cp ranks of each) in a shard group."""
    N = mach.gpus_per_node // per
    return [0] + ([N] if zero and 1 <= N < dp and dp % N == 0 and per * N == mach.gpus_per_node
                  else [])


def schedules(pp: int, fixed: dict) -> list[tuple[str, int]]:
    if fixed.get("schedule") or fixed.get("virtual_stages"):
        named = CATALOG.get(fixed.get("schedule"))  # interleaved: 2 chunks per rank unless given
        v = fixed.get("virtual_stages") or (2 if named and named.chunks is None else 1)
        return [(fixed.get("schedule") or ("interleaved" if v > 1 else "1f1b"), v)]
    return [("1f1b", 1)] + ([("interleaved", 2)] if pp > 1 else [])


def timed(lay: Layout, mcfg: GPTConfig, batch: int, mach: Machine, impl: Impl) -> dict:
    """The step-time prediction of ``lay``; on a shared link, with its ``dp_reduce``."""
    if not mach.shared_link:
        return predict(lay, mcfg, batch, mach, impl)
    reduce, pred = best_reduce(lay, mcfg, batch, mach, impl)
    return {**pred, "dp_reduce": reduce}


def search(mcfg: GPTConfig, batch: int, gpus: int, mach: Machine, fixed: dict | None = None,
           top: int = 10, dtype: str = "float32",
           impl: Impl | None = None) -> tuple[list[dict], list[dict]]:
    """(feasible rows, best first, at most ``top``; infeasible rows, each with its reason),
    timed as ``impl`` runs them (its own fixed choices are the caller's to add to ``fixed``).

    Every candidate is checked by refmp.parallel.rules.check_layout, then timed; memory is
    computed in order of predicted time until ``top`` fit (a faster layout that does not fit
    is reported with what does not fit)."""
    ok, bad, fixed, impl = [], [], fixed or {}, impl or Impl()
    for lay in candidates(mcfg, batch, gpus, mach, fixed, not impl.attention_recomputes):
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
        ok.append((timed(lay, mcfg, batch, mach, impl), lay))
    ok.sort(key=lambda x: x[0]["step_seconds"])
    fits, cap = [], mach.gpu_memory_gb * 1e9
    for pred, lay in ok:
        mem = memory(held_as(lay, impl), mcfg, batch, dtype)
        # refmp on this host also holds the full model at set-up (its own check, need_bytes)
        need = need_bytes(mem) if mach.name == "cpu" else total(mem) + mem["workspace"]
        r = row(lay, mem, pred, None)
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


def held_as(lay: Layout, impl: Impl) -> Layout:
    """The layout whose caches ``impl`` keeps: fused attention keeps no scores, as refmp's
    selective recomputation does not (refmp.cost.memory.block_cache_elements)."""
    if impl.flash_attention and lay.recompute == "none":
        return replace(lay, recompute="selective")
    return lay


def row(lay: Layout, mem: dict | None, pred: dict | None, reason: str | None) -> dict:
    """One layout as --json prints it (the issue's keys), plus the seconds by term."""
    r = {**lay.__dict__}
    if mem is not None:
        r["memory_bytes"] = {k: mem[k] for k in ("params", "grads", "optimizer", "error_feedback",
                                                 "activations")}
    if pred is not None:
        keys = ("step_seconds", "tokens_per_s", "tflops_per_gpu", "mfu", "dp_reduce")
        r.update({k: pred[k] for k in keys if k in pred})
        r["seconds"] = pred["seconds"]
    if reason is not None:
        r["reason"] = reason
    return r


def describe(r: dict) -> str:
    return " ".join(f"{f.name}={r[f.name]}" for f in fields(Layout))


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
    reduce = any("dp_reduce" in r for r in fits)  # nodes on a shared link: flat or hierarchical
    # the two-level options, where a row takes one: Ulysses groups of cp, HSDP's shard groups
    levels = [k for k in ("cp_ulysses", "dp_shard") if any(r[k] > 1 - (k == "dp_shard") for r in fits)]
    lines = [head + "".join(f" {k.replace('_', '-'):>10}" for k in levels)
             + (f" {'dp-reduce':>12}" if reduce else "")]
    for i, r in enumerate(fits):
        gb = sum(r["memory_bytes"].values()) / 1e9
        lines.append(f"{i + 1:>2} {r['tp']:>3} {r['pp']:>3} {r['dp']:>4} {r['cp']:>3} "
                     f"{r['ep']:>3} {r['zero']:>4} {'y' if r['sequence_parallel'] else 'n':>3} "
                     f"{r['recompute']:>9} {r['mixed_precision']:>4} {r['microbatch_size']:>2} "
                     f"{r['schedule']:>11} {r['virtual_stages']:>2} {gb:>8.2f} "
                     f"{r['step_seconds']:>8.3f} {r['tokens_per_s']:>10.0f} "
                     f"{r['tflops_per_gpu']:>8.3g} {100 * r['mfu']:>5.1f}%"
                     + "".join(f" {r[k]:>10}" for k in levels)
                     + (f" {r['dp_reduce']:>12}" if reduce else ""))
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
