"""The plan's tflops_per_gpu for Megatron-LM 2021 Table 1's rows (docs/plan.md's table).

Narayanan et al. 2021, Table 1: GPT on DGX A100s, T 2048, V 51,200, full recomputation.
Run: python benchmarks/plan_megatron.py
"""

from refmp import plan
from refmp.nn.params import GPTConfig

# params (B), heads, hidden, layers, tp, pp, GPUs, batch, achieved TFLOP/s per GPU
ROWS = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
        (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
        (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
        (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
        (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
        (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
        (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]


def main() -> None:
    mach = plan.MACHINES["dgx-a100"]
    for P, nh, C, L, tp, pp, n, B, paper in ROWS:
        mcfg = GPTConfig(n_layer=L, n_embd=C, n_head=nh, vocab_size=51200, block_size=2048)
        dp, best = n // (tp * pp), None
        for sched, v in [("1f1b", 1), ("interleaved", 2)]:
            if (pp == 1 and v > 1) or L % (pp * v):
                continue
            lay = plan.Layout(tp=tp, pp=pp, dp=dp, recompute="full", mixed_precision="bf16",
                              microbatch_size=1, schedule=sched, virtual_stages=v)
            p = plan.predict(lay, mcfg, B, mach)
            if best is None or p["step_seconds"] < best[0]["step_seconds"]:
                best = (p, sched)
        p, sched = best
        got = p["tflops_per_gpu"]
        print(f"| {P} | {tp} | {pp} | {dp} | {n} | {B} | {sched} | {paper} | {got:.0f} | "
              f"{100 * (got / paper - 1):+.0f}% |")


if __name__ == "__main__":
    main()
