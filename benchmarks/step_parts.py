"""Where a serial training step's wall time goes, layer by layer (ms per step).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/step_parts.py [--steps 30]
        [--warmup 3] [--preset small|tiny|gpt2] [--plain]

Wraps each layer function the model runs (refmp.nn.fast; with ``--plain``, the plain
formulas of refmp.nn.layers in their place) and the optimizer and clipping in a
perf_counter timer, runs training steps of a `refmp bench` preset (default `small`) in one
process (its threads:
REFMP_THREADS / OMP_NUM_THREADS, else every core) and prints the median step and each part's
mean share of it. Nested parts (the LM head holds a LayerNorm) are counted in both. With
``--torch`` it prints PyTorch eager's operator table for the same model instead
(torch.profiler, the model of benchmarks/torch_anchor.py).
"""

from __future__ import annotations  # noqa: I001  (refmp before NumPy, below)

import refmp  # noqa: F401  (first: it sets OpenBLAS's thread spin before NumPy loads)

import argparse
import collections
import statistics
import time

import numpy as np

from refmp.cli.bench import PRESETS
from refmp.nn import GPT, GPTConfig
from refmp.nn import gpt as G
from refmp.nn import fast as F
from refmp.nn import layers as L
from refmp.training.optim import AdamW, clip_grad_norm

PARTS = {F: ["linear_forward", "linear_backward_input", "linear_backward_weight",
             "attention_forward", "attention_backward", "layernorm_forward",
             "layernorm_backward", "gelu_forward", "gelu_backward", "cross_entropy_forward",
             "cross_entropy_backward", "tied_head_backward"],
         G: ["head_forward", "head_backward", "embed_forward", "embed_backward"],
         # linear_backward (the plain one, which refmp.nn.fast re-exports) calls these two
         L: ["linear_backward_input", "linear_backward_weight"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps (30)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (3)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small",
                    help="refmp bench's presets (gpt2: GPT-2 small's real shape)")
    ap.add_argument("--torch", action="store_true", help="PyTorch's operator table instead")
    ap.add_argument("--plain", action="store_true",
                    help="run refmp.nn.layers' plain forms in place of refmp.nn.fast's")
    args = ap.parse_args()
    s = PRESETS[args.preset]
    cfg = GPTConfig(s["vocab"], s["block_size"], s["n_layer"], s["n_head"], s["n_embd"])
    model = GPT.create(cfg, seed=0, dtype="float32")
    rng = np.random.default_rng(1)
    x = rng.integers(0, s["vocab"], (s["batch_size"], s["block_size"]))
    y = rng.integers(0, s["vocab"], (s["batch_size"], s["block_size"]))
    if args.torch:
        return torch_table(model, cfg, x, y, args.steps, args.warmup)
    spent: dict[str, float] = collections.defaultdict(float)

    def timed(name, fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            spent[name] += time.perf_counter() - t0
            return out
        return run

    for module, names in PARTS.items():
        for name in names:
            fn = getattr(L, name) if args.plain and module is F else getattr(module, name)
            setattr(module, name, timed(name, fn))
    opt = AdamW(model.params, lr=1e-4, weight_decay=0.1)
    adamw, clip = timed("adamw", opt.step), timed("clip_grad_norm", clip_grad_norm)

    def step():
        model.zero_grad()
        loss, cache = model.forward(x, y)
        model.backward(cache)
        clip(model.grads, 1.0)
        adamw(model.grads)

    for _ in range(args.warmup):
        step()
    spent.clear()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    print(f"step {1e3 * statistics.median(times):.1f} ms (median of {args.steps})")
    for name, t in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name:24s} {1e3 * t / args.steps:6.1f}")


def torch_table(model, cfg, x, y, steps: int, warmup: int) -> None:
    import torch  # noqa: PLC0415
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415
    from torch_anchor import TorchGPT, torch_adamw  # noqa: PLC0415  (benchmarks/ is on the path)

    host = {k: v.copy() for k, v in model.params.items()}
    tm = TorchGPT(host, cfg.n_head, cfg.n_layer)
    opt = torch_adamw(tm, 1e-4, 0.1, (0.9, 0.999))
    tx, ty = torch.tensor(x), torch.tensor(y)

    def step():
        opt.zero_grad(set_to_none=True)
        tm(tx, ty).backward()
        torch.nn.utils.clip_grad_norm_(tm.parameters(), 1.0)
        opt.step()

    for _ in range(warmup):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    print(f"PyTorch {torch.__version__}, {torch.get_num_threads()} threads, {steps} steps "
          "(divide the times by the steps):")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
