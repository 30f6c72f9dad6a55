"""``refmp bench``: time training steps and report ms/step, tokens/s, FLOP/s, MFU and bytes.

It takes every layout flag of ``refmp train`` (--dp --tp --pp --cp --ep, --zero, the pipeline,
cp and MoE options: refmp.cli.train makes them for both commands) on a model from a preset.

Model FLOPs per step, and with --recompute the hardware FLOPs beyond them (reported apart:
``recompute_gflops``, ``hardware_gflops``; MFU stays model FLOPs over peak): refmp.cost.flops.

With --mixed-precision bf16 or fp16 the products still run in fp32 on the CPU (BLAS has no
bf16 kernel; refmp.runtime.precision), on operands rounded to the compute dtype: the peak is the
fp32 product's, and what mixed precision changes here is the bytes (memory, the ledger).

MFU divides the achieved FLOP/s by a peak that the command measures itself: every rank
times a large float32/float64 matrix product at the same moment (so oversubscribed ranks
see the cores they really share), and the peaks are summed.

Communication: rank 0's byte ledger (refmp.distributed.ledger.Ledger) over the timed steps only, grouped
by axis ("tp", "dp", "dp+cp", ...), then by operation: the figures a ledger entry counts, as
seen from one rank (with --pp, other stages' sends and receives may differ).

Memory, every rank's: what it holds (Trainer.memory: parameters, gradients, optimizer state,
the peak of its activations) beside the formulas' figures for its stage
(refmp.cost.memory.stage_memory, what ``refmp plan`` sizes a layout by, and their peak,
need_bytes), and the process's peak resident set (the operating system's count: the
interpreter, NumPy, MPI and every temporary included).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict
from dataclasses import fields

import numpy as np

from refmp.cli.flags import add_layout_args, add_moe_args
from refmp.config import ParallelConfig, flag_name
from refmp.cost.flops import active_params, model_flops_per_step, recompute_flops_per_step
from refmp.cost.memory import need_bytes, size, stage_memory
from refmp.runtime.device import measure_peak
from refmp.training.datasets import Dataset

PRESETS = {
    "small": dict(n_layer=4, n_embd=256, n_head=8, block_size=128, batch_size=8, vocab=256,
                  dtype="float32"),
    "tiny": dict(n_layer=2, n_embd=64, n_head=4, block_size=64, batch_size=8, vocab=256,
                 dtype="float32"),
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12, block_size=1024, batch_size=1, vocab=50257,
                 dtype="float32"),  # GPT-2 small's real shape, 124M parameters
}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="time training steps: ms/step, tokens/s, FLOP/s, MFU",
                       description="Time training steps of a model and report ms/step, "
                                   "tokens/s, model FLOP/s and MFU against a measured peak.")
    # the model preset and the timing; the rest is train's own flags
    p.add_argument("--preset", choices=sorted(PRESETS), default="small",
                   help="small: 4 layers, n_embd 256, 8 heads, block 128, batch 8, vocab 256, "
                        "float32 (default); tiny: 2 layers, n_embd 64, 4 heads, block 64; "
                        "gpt2: GPT-2 small, 12 layers, n_embd 768, 12 heads, block 1024, "
                        "batch 1, vocab 50257")
    for name in ("n_layer", "n_embd", "n_head", "block_size", "batch_size", "vocab"):
        p.add_argument(flag_name(name), type=int, default=None, help="override the preset")
    p.add_argument("--dtype", choices=["float32", "float64"], default=None)
    p.add_argument("--device", choices=["cpu", "gpu"], default=os.environ.get("REFMP_DEVICE", "cpu"),
                   help="cpu (NumPy) or gpu (CuPy); default $REFMP_DEVICE or cpu")
    p.add_argument("--steps", type=int, default=20, help="timed steps (20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (3)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_moe_args(p)
    add_layout_args(p)
    p.set_defaults(run=run_bench)


# the MoE flags bench takes from train's own (refmp.cli.train.add_moe_args)
MOE = ("n_expert", "top_k", "moe_every", "capacity_factor", "aux_loss_coef", "z_loss_coef")


def ledger_by_axis(entries: dict[tuple[str, str], list[int]]) -> dict[str, dict[str, dict]]:
    """{(op, axis): [bytes, count]} as {axis: {op: {"bytes": .., "count": ..}}}, sorted."""
    out: dict[str, dict[str, dict]] = {}
    for (op, axis), (b, c) in sorted(entries.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        out.setdefault(axis, {})[op] = {"bytes": b, "count": c}
    return out


def run_bench(args) -> dict:
    from refmp.errors import ConfigError
    from refmp.runtime.cpu import blas_kernels, cpu_model
    from refmp.training.trainer import TrainConfig, Trainer

    spec = dict(PRESETS[args.preset])
    for k in list(spec):
        if getattr(args, k, None) is not None:
            spec[k] = getattr(args, k)
    if args.steps < 1 or args.warmup < 0:
        raise ConfigError("--steps must be at least 1 and --warmup at least 0")
    cfg = TrainConfig(n_layer=spec["n_layer"], n_head=spec["n_head"], n_embd=spec["n_embd"],
                      block_size=spec["block_size"], batch_size=spec["batch_size"],
                      steps=args.warmup + args.steps, dtype=spec["dtype"], device=args.device,
                      lr_schedule="constant", lr=1e-4, progress=False, trace=args.trace,
                      **{k: getattr(args, k) for k in MOE},
                      **{f.name: getattr(args, f.name) for f in fields(ParallelConfig)})
    rng = np.random.default_rng(1)
    n_tok = (spec["batch_size"] * (args.warmup + args.steps) + 1) * spec["block_size"] + 1
    ds = Dataset(rng.integers(0, spec["vocab"], n_tok), spec["vocab"], "random tokens")
    if cfg.stage_layers == "auto":  # measured here, the same split on every rank
        from mpi4py import MPI

        from refmp.cli.plan import stage_layers_auto

        cfg = stage_layers_auto(cfg, MPI.COMM_WORLD, ds)
    tr = Trainer(cfg, dataset=ds)
    world, ledger = tr.grid.world, tr.grid.ledger
    for _ in range(args.warmup):
        tr.step()
    times, sent = [], defaultdict(lambda: [0, 0])  # sent: the timed steps' ledger entries
    cpu_s = []  # this rank's CPU seconds (user and kernel) in each timed step
    timelines = []  # with a pipeline: each timed step's measured timeline
    for _ in range(args.steps):
        world.barrier()  # time whole-job steps: every rank starts together
        ledger.reset()  # count this step's communication only, not the timing's
        t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        tr.step()
        dt, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        cpu_s.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
        for key, (b, c) in ledger.entries.items():
            sent[key][0] += b
            sent[key][1] += c
        times.append(world.allreduce_scalar(dt, op="max"))
        if args.pp > 1:
            timelines.append(tr.runner.timeline())  # collective over pp, after the timing
    n = 8192 if args.device == "gpu" else 1024  # big enough to reach the peak
    peak = world.allreduce_scalar(measure_peak(spec["dtype"], n))  # summed over ranks
    sec = float(np.median(times))
    m = tr.mcfg
    tokens = cfg.batch_size * tr.T
    n_active = active_params(m)
    flops = model_flops_per_step(n_active, m.n_layer, tr.T, m.n_embd, tokens)
    n_blocks = n_active - m.vocab_size * m.n_embd - 2 * m.n_embd  # less wte (the head), ln_f
    extra = recompute_flops_per_step(cfg.recompute, n_blocks, m.n_layer, tr.T, m.n_embd, tokens)
    out = {
        "ms_per_step": 1e3 * sec, "tokens_per_s": tokens / sec, "gflops": flops / sec / 1e9,
        "mfu": flops / sec / peak, "peak_gflops": peak / 1e9, "params": tr.num_params,
        "active_params": n_active, "world_size": world.size, "steps": args.steps,
        "model": {**spec, **({k: getattr(m, k) for k in MOE} if m.n_expert else {})},
        "layout": cfg.as_dict(tr.grid.sizes),
        "device": tr.device_info,
        "cpu": {"model": cpu_model(), "blas": blas_kernels()},  # where the figures came from
        "ms_per_step_min": 1e3 * min(times), "ms_per_step_max": 1e3 * max(times),
        # every rank's CPU time a step (median), its waits' polling included
        "cpu_ms_per_step": world.allgather_obj(1e3 * float(np.median(cpu_s))),
        "ledger": ledger_by_axis(sent),  # rank 0's, summed over the timed steps
        "recompute": cfg.recompute, "recompute_gflops": extra / sec / 1e9,
        "hardware_gflops": (flops + extra) / sec / 1e9,
        "memory_per_rank": world.allgather_obj(memory_report(tr, cfg)),
    }
    if args.pp > 1:  # the timed steps' measured timelines against the schedule's formula
        out.update(pipeline_report(timelines, args))
        if args.trace and world.rank == 0:
            timelines[-1].write_trace(args.trace)
    if world.rank == 0:
        if args.json:
            print(json.dumps(out))
        else:
            print_report(out, args)
    return out


def memory_report(tr, cfg) -> dict:
    """This rank's bytes: held (Trainer.memory), the formulas' for its stage, and its peak
    resident set (see the module docstring)."""
    formula = stage_memory(cfg, tr.mcfg, tr.grid.sizes, tr.grid.coords["pp"])
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"measured": tr.memory(), "formula": formula, "formula_peak": need_bytes(formula),
            "peak_rss": rss if sys.platform == "darwin" else 1024 * rss}


def pipeline_report(timelines: list, args) -> dict:
    """The bubble of the median step (by bubble), and where it goes.

    ``bubble_theory`` is the formula (every F, B, W of equal cost); ``bubble_at_costs`` the
    schedule simulated with that step's measured median F, B, W times per rank, messages free:
    the bubble the schedule itself implies for these costs. The rest of the measured bubble is
    ``idle``: receives waiting, sends, and the gaps between actions. ``bubble_with_hops``
    simulates the same costs with each message's measured cost to its two ranks as well
    (``hops_us``, Timeline.hops: the sender's median send, the receiver's shortest receive);
    ``bubble_replayed`` the step itself, each action at its own measured time, with those
    hops (a flushed schedule's; None for 2bw and pipedream, whose step is a window of a run).
    What the measured bubble has beyond the replay is waiting that neither the schedule nor
    a message's cost explains.
    """
    from refmp.parallel.pipeline.catalog import CATALOG
    from refmp.parallel.pipeline.simulate import bubble_formula, simulate_schedule

    tl = sorted(timelines, key=lambda t: t.bubble())[len(timelines) // 2]
    shape, costs, hops = (args.schedule, args.pp, args.microbatches, args.virtual_stages), \
        tl.costs(), tl.hops()
    replayed = (None if not CATALOG[args.schedule].flushes else simulate_schedule(
        *shape, costs={**costs, **tl.action_costs()}, hops=hops).bubble())
    return {"bubble": tl.bubble(), "bubble_theory": bubble_formula(*shape),
            "bubble_at_costs": simulate_schedule(*shape, costs=costs).bubble(),
            "bubble_with_hops": simulate_schedule(*shape, costs=costs, hops=hops).bubble(),
            "bubble_replayed": replayed,
            "hops_us": {r: {"send": 1e6 * s, "recv": 1e6 * rv} for r, (s, rv) in hops.items()},
            "idle": tl.idle(),
            "costs_ms": {f"{kind}@{r}": 1e3 * t for (r, kind), t in sorted(costs.items())}}


def print_report(out: dict, args) -> None:
    lay = out["layout"]
    axes = " x ".join(f"{a}={lay[a]}" for a in ("pp", "dp", "cp", "tp", "ep"))
    extra = [f"zero {lay['zero']}"] if lay["zero"] else []
    extra += [f"hpZ in blocks of {lay['hpz_size']}"] if lay["hpz_size"] > 1 else []
    extra += ["sequence parallel"] if lay["sequence_parallel"] else []
    extra += [f"HSDP, shards over {lay['dp_shard']} dp"] if lay["dp_shard"] not in (0, lay["dp"]) else []
    U = lay["cp_ulysses"]  # hierarchical cp: Ulysses U x ring cp/U
    algo = f"Ulysses {U} x ring {lay['cp'] // U}" if U > 1 else lay["cp_algo"]
    extra += [f"cp {algo} {lay['cp_balance']}"] if lay["cp"] > 1 else []
    extra += [f"{lay['microbatches']} micro-batches"] if lay["microbatches"] > 1 else []
    extra += [f"recompute {lay['recompute']}"] if lay["recompute"] != "none" else []
    extra += ([f"mixed precision {lay['mixed_precision']} (gradients {lay['grad_dtype']})"]
              if lay["mixed_precision"] != "none" else [])
    moe = out["model"]
    print(f"refmp bench: preset {args.preset} {moe}, {out['params']:,} parameters, "
          f"{out['world_size']} rank(s)")
    blas = ", ".join(f"{b['internal_api']} {b['version']} {b['architecture']} kernels, "
                     f"{b['num_threads']} thread(s)" for b in out["cpu"]["blas"]) or "no BLAS found"
    print(f"  cpu {out['cpu']['model']}; {blas}")
    print(f"  layout {', '.join([axes, *extra])}")
    if moe.get("n_expert"):
        print(f"  mixture of experts: {moe['n_expert']} experts, top-{moe['top_k']}; FLOPs "
              f"count {out['active_params']:,.0f} active parameters (experts at top_k/n_expert)")
    print(f"  {out['ms_per_step']:.1f} ms/step (median of {args.steps}; "
          f"min {out['ms_per_step_min']:.1f}, max {out['ms_per_step_max']:.1f})")
    print(f"  CPU time a step, by rank: {', '.join(f'{c:.1f}' for c in out['cpu_ms_per_step'])} "
          f"ms (user and kernel, waits included)")
    print(f"  {out['tokens_per_s']:,.0f} tokens/s, {out['gflops']:.2f} GFLOP/s model, "
          f"peak {out['peak_gflops']:.1f} GFLOP/s measured, MFU {100 * out['mfu']:.1f}%")
    if out["recompute"] != "none":
        print(f"  recompute {out['recompute']}: {out['recompute_gflops']:.2f} GFLOP/s more "
              f"executed ({out['hardware_gflops']:.2f} GFLOP/s hardware, model FLOPs above)")
    if "bubble" in out:
        idle = out["idle"]
        costs = ", ".join(f"{k} {v:.2f}" for k, v in out["costs_ms"].items())
        print(f"  pipeline {args.schedule}, pp {args.pp}, {args.microbatches} "
              f"micro-batches: bubble {out['bubble']:.4f} measured (median step), "
              f"theory {out['bubble_theory']:.4f}, {out['bubble_at_costs']:.4f} simulated at "
              f"the measured costs, {out['bubble_with_hops']:.4f} with the messages' costs"
              + ("" if out["bubble_replayed"] is None else
                 f", {out['bubble_replayed']:.4f} replaying the step"))
        hops = ", ".join(f"rank {r} send {h['send']:.0f} recv {h['recv']:.0f}"
                         for r, h in out["hops_us"].items())
        print(f"    measured costs (ms, action@rank): {costs}")
        print(f"    a message's cost (us): {hops}")
        print(f"    idle: recv {idle['recv']:.4f}, send {idle['send']:.4f}, "
              f"between actions {idle['other']:.4f}")
    print("  memory per rank, held (formula): params, grads, optimizer, activations; peak "
          "resident (the formulas' peak)")
    for r, mem in enumerate(out["memory_per_rank"]):
        held = ", ".join(f"{size(mem['measured'].get(k, 0))} ({size(mem['formula'][k])})"
                         for k in ("params", "grads", "optimizer", "activations"))
        print(f"    rank {r}: {held}; {size(mem['peak_rss'])} ({size(mem['formula_peak'])})")
    print("  communication per step, rank 0 (bytes; calls by operation):")
    for axis, ops in out["ledger"].items():
        total = sum(v["bytes"] for v in ops.values()) // args.steps
        calls = ", ".join(f"{op} {v['count'] // args.steps}" for op, v in ops.items())
        print(f"    {axis:<8} {total:>14,} B  ({calls})")
