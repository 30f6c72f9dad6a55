"""The plan's tflops_per_gpu for Megatron-LM 2021 Table 1's rows (docs/plan.md's table).

Narayanan et al. 2021, Table 1: GPT on DGX A100s, T 2048, V 51,200, full recomputation,
mixed precision. The shapes, model-parallel sizes, GPUs, batches and achieved TFLOP/s are
those of NVIDIA/Megatron-LM's README at commit 50a4b5fa02 (8 April 2021,
images/cases_april2021.png, the same table); tp = min(8, model-parallel size), pp the rest.

Two columns: the plan as refmp would run each layout (refmp.cost.model.Impl()), and as
Megatron-LM 2021 ran it (MEGATRON_2021: dropout, the data-parallel all-reduce after the
backward pass, the scatter/gather boundary optimization). Micro-batch size 1 (the table does
not say), the faster of 1F1B and interleaved (2 chunks) where the layers divide.
Then Table 2 of the same paper: PTD-P (tp x pp x dp) rows as Megatron-LM 2021, and ZeRO-3
without model parallelism rows as DeepSpeed ran them (DEEPSPEED_ZERO3), with the table's own
micro-batch sizes.
Run: python benchmarks/plan_megatron.py (--terms: each implementation term's effect)
"""

import sys
from dataclasses import replace

from refmp.cost.machines import MACHINES, Machine
from refmp.cost.model import DEEPSPEED_ZERO3, MEGATRON_2021, Impl, Layout, predict
from refmp.nn.params import GPTConfig

# params (B), heads, hidden, layers, tp, pp, GPUs, batch, achieved TFLOP/s per GPU, % of peak
ROWS = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44),
        (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46),
        (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43),
        (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44),
        (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45),
        (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47),
        (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50),
        (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52),
        (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52)]


def best(row, impl: Impl) -> tuple[dict, str]:
    """The faster schedule's prediction for one row, and its name."""
    P, nh, C, L, tp, pp, n, B, *_ = row
    mcfg = GPTConfig(n_layer=L, n_embd=C, n_head=nh, vocab_size=51200, block_size=2048)
    out = None
    for sched, v in [("1f1b", 1), ("interleaved", 2)]:
        if (pp == 1 and v > 1) or L % (pp * v):
            continue
        lay = Layout(tp=tp, pp=pp, dp=n // (tp * pp), recompute="full",
                     mixed_precision="bf16", microbatch_size=1, schedule=sched,
                     virtual_stages=v)
        p = predict(lay, mcfg, B, MACHINES["dgx-a100"], impl)
        if out is None or p["step_seconds"] < out[0]["step_seconds"]:
            out = (p, sched)
    return out


# Table 2 of the same paper (a copy of it: cli99/llm-analysis, figures/megatron-lm-2nd-table-2.png,
# commit d841e40; its outputs give tp 8 x pp 12 and tp 8 x pp 35 for the model-parallel sizes
# 96 and 280): (params (B), heads, hidden, layers, tp, pp, GPUs, batch, micro-batch, TFLOP/s)
GPT175 = (174.6, 96, 12288, 96)
GPT530 = (529.6, 128, 20480, 105)
PTD = [(*GPT175, 8, 12, 384, 1536, 1, 153), (*GPT175, 8, 12, 768, 1536, 1, 149),
       (*GPT175, 8, 12, 1536, 1536, 1, 141), (*GPT530, 8, 35, 560, 2240, 1, 171),
       (*GPT530, 8, 35, 1120, 2240, 1, 167), (*GPT530, 8, 35, 2240, 2240, 1, 159)]
ZERO3 = [(*GPT175, 1, 1, 384, 1536, 4, 144), (*GPT175, 1, 1, 768, 1536, 2, 88),
         (*GPT175, 1, 1, 1536, 1536, 1, 44), (*GPT530, 1, 1, 640, 2560, 4, 138),
         (*GPT530, 1, 1, 1120, 2240, 2, 98), (*GPT530, 1, 1, 2240, 2240, 1, 48)]


def table2_row(row, impl: Impl, mach: Machine = MACHINES["dgx-a100"]) -> tuple[dict, str]:
    """Table 2's row: the given micro-batch size; ZeRO-3 rows (tp = pp = 1) at stage 3."""
    P, nh, C, L, tp, pp, n, B, b, _ = row
    mcfg = GPTConfig(n_layer=L, n_embd=C, n_head=nh, vocab_size=51200, block_size=2048)
    dp, out = n // (tp * pp), None
    for sched, v in [("1f1b", 1), ("interleaved", 2)]:
        if (pp == 1 and v > 1) or L % (pp * v) or (v > 1 and B // (dp * b) % pp):
            continue
        lay = Layout(tp=tp, pp=pp, dp=dp, zero=3 if pp * tp == 1 else 0, recompute="full",
                     mixed_precision="bf16", microbatch_size=b, schedule=sched,
                     virtual_stages=v)
        p = predict(lay, mcfg, B, mach, impl)
        if out is None or p["step_seconds"] < out[0]["step_seconds"]:
            out = (p, sched)
    return out


# each implementation term added in turn (docs/plan.md): Table 1 from refmp's own to
# MEGATRON_2021, Table 2's ZeRO-3 rows from every gather exposed to DEEPSPEED_ZERO3
TERMS_1 = [("refmp", Impl()), ("+ dropout", Impl(dropout=True)),
           ("+ dp after backward", Impl(dropout=True, dp_overlap=False)),
           ("+ scatter/gather", MEGATRON_2021)]
EXPOSED = Impl(dropout=True, dp_overlap=False)
TERMS_2 = [("exposed", EXPOSED, MACHINES["dgx-a100"]),
           ("+ prefetch", DEEPSPEED_ZERO3, replace(MACHINES["dgx-a100"], comm_sms=0)),
           ("+ SMs held by NCCL", DEEPSPEED_ZERO3, MACHINES["dgx-a100"])]


def terms() -> None:
    """Each term's effect: TFLOP/s per GPU by row, as each term is added."""
    print("| Table 1 row (B) | paper | " + " | ".join(n for n, _ in TERMS_1) + " |")
    print("| --- " * (2 + len(TERMS_1)) + "|")
    for row in ROWS[:-1]:
        got = [best(row, impl)[0]["tflops_per_gpu"] for _, impl in TERMS_1]
        print(f"| {row[0]} | {row[8]} | " + " | ".join(f"{g:.0f}" for g in got) + " |")
    print("\n| Table 2 ZeRO-3 row (B, GPUs, b) | paper | "
          + " | ".join(n for n, *_ in TERMS_2) + " |")
    print("| --- " * (2 + len(TERMS_2)) + "|")
    for row in ZERO3:
        got = [table2_row(row, impl, mach)[0]["tflops_per_gpu"] for _, impl, mach in TERMS_2]
        print(f"| {row[0]}, {row[6]}, {row[8]} | {row[-1]} | "
              + " | ".join(f"{g:.0f}" for g in got) + " |")


def main() -> None:
    print("| params (B) | tp | pp | dp | GPUs | batch | schedule | paper TFLOP/s (% of peak) "
          "| plan, as refmp | plan, as Megatron-LM 2021 | plan vs paper |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in ROWS:
        P, _, _, _, tp, pp, n, B, paper, pct = row
        own = best(row, Impl())[0]["tflops_per_gpu"]
        p, sched = best(row, MEGATRON_2021)
        got = p["tflops_per_gpu"]
        print(f"| {P} | {tp} | {pp} | {n // (tp * pp)} | {n} | {B} | {sched} | {paper} ({pct}%) "
              f"| {own:.0f} | {got:.0f} | {100 * (got / paper - 1):+.0f}% |")
    print("\nTable 2:\n")
    print("| scheme | params (B) | tp | pp | dp | GPUs | batch | b | schedule | paper TFLOP/s "
          "| plan TFLOP/s | plan vs paper |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for scheme, rows, impl in [("PTD", PTD, MEGATRON_2021),
                               ("ZeRO-3", ZERO3, DEEPSPEED_ZERO3)]:
        for row in rows:
            P, _, _, _, tp, pp, n, B, b, paper = row
            p, sched = table2_row(row, impl)
            got = p["tflops_per_gpu"]
            print(f"| {scheme} | {P} | {tp} | {pp} | {n // (tp * pp)} | {n} | {B} | {b} | "
                  f"{sched} | {paper} | {got:.0f} | {100 * (got / paper - 1):+.0f}% |")


if __name__ == "__main__":
    terms() if "--terms" in sys.argv else main()
