"""``refmp bench``: time training steps and report ms/step, tokens/s, FLOP/s and MFU.

Model FLOPs per step (the work a dense implementation must do, as in Chowdhery et al. 2022,
appendix B): 6 * N * tokens for the matrix products of N parameters (forward 2, backward 4),
where N leaves out wpe (a lookup, no product) but keeps wte (it is the LM head's matrix),
plus 12 * L * T * C * tokens for attention's q k^T and att v (refmp computes the full T x T
products, masked, so this is work done, not an upper bound).

MFU divides the achieved FLOP/s by a peak that the command measures itself: every rank
times a large float32/float64 matrix product at the same moment (so oversubscribed ranks
see the cores they really share), and the peaks are summed.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from refmp import backend
from refmp.data import Dataset

PRESETS = {
    "small": dict(n_layer=4, n_embd=256, n_head=8, block_size=128, batch_size=8, vocab=256,
                  dtype="float32"),
    "tiny": dict(n_layer=2, n_embd=64, n_head=4, block_size=64, batch_size=8, vocab=256,
                 dtype="float32"),
}


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default="small",
                   help="small: 4 layers, n_embd 256, 8 heads, block 128, batch 8, vocab 256, "
                        "float32 (default)")
    for name in ("n_layer", "n_embd", "n_head", "block_size", "batch_size", "vocab"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                       help="override the preset")
    p.add_argument("--dtype", choices=["float32", "float64"], default=None)
    p.add_argument("--device", choices=["cpu", "gpu"], default=os.environ.get("REFMP_DEVICE", "cpu"),
                   help="cpu (NumPy) or gpu (CuPy); default $REFMP_DEVICE or cpu")
    p.add_argument("--steps", type=int, default=20, help="timed steps (20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (3)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel ranks (default: all)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (1)")
    p.add_argument("--microbatches", type=int, default=1, help="pipeline micro-batches (1)")
    from refmp.parallel.pipeline.schedules import SCHEDULES

    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="with --pp (1f1b)")
    p.add_argument("--virtual-stages", type=int, default=1, help="for interleaved (1)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def model_flops_per_step(n_params_dense: int, n_layer: int, T: int, C: int, tokens: int) -> float:
    """6 N tokens + 12 L T C tokens (see the module docstring)."""
    return 6.0 * n_params_dense * tokens + 12.0 * n_layer * T * C * tokens


def measure_peak(dtype: str, n: int = 1024, reps: int = 5) -> float:
    """FLOP/s of this process's best n x n matrix product (median of reps)."""
    xp = backend.xp
    rng = np.random.default_rng(0)
    a = backend.from_host(rng.standard_normal((n, n)).astype(dtype))
    b = backend.from_host(rng.standard_normal((n, n)).astype(dtype))
    a @ b  # warm-up (thread pools, caches)
    times = []
    for _ in range(reps):
        backend.sync()
        t0 = time.perf_counter()
        xp.matmul(a, b)
        backend.sync()
        times.append(time.perf_counter() - t0)
    return 2.0 * n**3 / float(np.median(times))


def run_bench(args) -> dict:
    from refmp.errors import ConfigError
    from refmp.train import TrainConfig, Trainer

    spec = dict(PRESETS[args.preset])
    for k in list(spec):
        if getattr(args, k, None) is not None:
            spec[k] = getattr(args, k)
    if args.steps < 1 or args.warmup < 0:
        raise ConfigError("--steps must be at least 1 and --warmup at least 0")
    cfg = TrainConfig(n_layer=spec["n_layer"], n_head=spec["n_head"], n_embd=spec["n_embd"],
                      block_size=spec["block_size"], batch_size=spec["batch_size"],
                      steps=args.warmup + args.steps, dtype=spec["dtype"], dp=args.dp,
                      device=args.device,
                      pp=args.pp, microbatches=args.microbatches, schedule=args.schedule,
                      virtual_stages=args.virtual_stages,
                      lr_schedule="constant", lr=1e-4, progress=False)
    rng = np.random.default_rng(1)
    n_tok = (spec["batch_size"] * (args.warmup + args.steps) + 1) * spec["block_size"] + 1
    ds = Dataset(rng.integers(0, spec["vocab"], n_tok), spec["vocab"], "random tokens")
    tr = Trainer(cfg, dataset=ds)
    world = tr.grid.world
    for _ in range(args.warmup):
        tr.step()
    times = []
    for _ in range(args.steps):
        world.barrier()  # time whole-job steps: every rank starts together
        t0 = time.perf_counter()
        tr.step()
        times.append(world.allreduce_scalar(time.perf_counter() - t0, op="max"))
    n = 8192 if args.device == "gpu" else 1024  # big enough to reach the peak
    peak = world.allreduce_scalar(measure_peak(spec["dtype"], n))  # summed over ranks
    sec = float(np.median(times))
    m = tr.model.cfg
    tokens = cfg.batch_size * tr.T
    dense = tr.model.num_params() - m.block_size * m.n_embd  # leave out wpe
    flops = model_flops_per_step(dense, m.n_layer, tr.T, m.n_embd, tokens)
    out = {
        "ms_per_step": 1e3 * sec, "tokens_per_s": tokens / sec, "gflops": flops / sec / 1e9,
        "mfu": flops / sec / peak, "peak_gflops": peak / 1e9, "params": tr.model.num_params(),
        "world_size": world.size, "steps": args.steps, "model": spec, "device": tr.device_info,
        "ms_per_step_min": 1e3 * min(times), "ms_per_step_max": 1e3 * max(times),
    }
    if args.pp > 1:  # the last step's measured timeline against the simulated formula
        from refmp.parallel.pipeline.simulate import bubble_formula

        out["bubble"] = tr.runner.timeline().bubble()
        out["bubble_theory"] = bubble_formula(args.schedule, args.pp, args.microbatches,
                                              args.virtual_stages)
    if world.rank == 0:
        if args.json:
            print(json.dumps(out))
        else:
            print(f"refmp bench: preset {args.preset} {spec}, {out['params']:,} parameters, "
                  f"{world.size} rank(s)")
            print(f"  {out['ms_per_step']:.1f} ms/step (median of {args.steps}; "
                  f"min {out['ms_per_step_min']:.1f}, max {out['ms_per_step_max']:.1f})")
            print(f"  {out['tokens_per_s']:,.0f} tokens/s, {out['gflops']:.2f} GFLOP/s model, "
                  f"peak {out['peak_gflops']:.1f} GFLOP/s measured, MFU {100 * out['mfu']:.1f}%")
            if "bubble" in out:
                print(f"  pipeline {args.schedule}, pp {args.pp}, {args.microbatches} "
                      f"micro-batches: bubble {out['bubble']:.4f} measured (last step), "
                      f"theory {out['bubble_theory']:.4f}")
    return out
