"""Published training runs the planner is held to (docs/published_runs.md; refmp plan
--published prints them): each run's model, machine, layout and figure as its source gives
them, the choices the source leaves unsaid (``assumed``), and what the planner predicts.

A row is reproduced when the prediction is within 15% of the published figure; a row that is
not keeps its ratio and names, in ``lacks``, the term the cost model does not have. Figures:
``mfu`` model FLOPs utilization in percent, ``tflops`` model TFLOP/s per GPU (the model FLOPs
of refmp.cost.flops over the step), ``tokens`` tokens per second per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from refmp.cost.machines import MACHINES
from refmp.cost.memory import memory, total
from refmp.cost.model import IMPLS, Layout, predict
from refmp.cost.presets import family
from refmp.cost.search import held_as, search

KORTHIKANTI = "Reducing Activation Recomputation in Large Transformer Models (Korthikanti et al., 2022)"
LLAMA3 = "The Llama 3 Herd of Models (Dubey et al., 2024), Table 4"
TITAN = "torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (the torchtitan team, 2024)"
PLAYBOOK = "The Ultra-Scale Playbook: Training LLMs on GPU Clusters (Tazi et al., 2025)"
TOLERANCE = 0.15


@dataclass(frozen=True)
class Run:
    key: str
    source: str  # the full title
    what: str  # the row as the source words it
    preset: str  # refmp.cost.presets.FAMILY
    machine: str
    gpus: int
    batch: int  # sequences per step
    layout: dict  # Layout fields, as the source gives them and as ``assumed`` completes them
    assumed: tuple  # the layout fields the source does not state
    figure: float  # the published figure, in ``unit``
    unit: str  # mfu | tflops | tokens
    impl: str = "refmp"
    over: dict = field(default_factory=dict)  # the model's fields the run changes
    machine_over: dict = field(default_factory=dict)  # the machine as the source describes it
    lacks: str = ""  # the term the cost model lacks, where the row is not within 15%
    top3: bool = False  # the layout must also be among refmp plan's best three


def _k(key, name, gpus, tp, pp, batch, mfu, **kw):
    lay = dict(tp=tp, pp=pp, dp=gpus // (tp * pp), sequence_parallel=True,
               recompute="selective", microbatch_size=1, zero=0)
    lay.update(kw.pop("lay", {}))
    assumed = ("schedule (1F1B)",) + (("dp 8 and batch 2,240: the 280-GPU row 8 times",)
                                      if gpus == 2240 else ())
    return Run(key, KORTHIKANTI, kw.pop("what"), name, "dgx-a100", gpus, batch, lay,
               assumed, mfu, "mfu", "megatron-2021", **kw)


def _l(key, gpus, dp, cp, batch, tflops, what, over=None):
    lay = dict(tp=8, pp=16, dp=dp, cp=cp, zero=1, sequence_parallel=True,
               recompute="selective", microbatch_size=1, schedule="interleaved",
               virtual_stages=2)
    return Run(key, LLAMA3, what, "llama3-405b", "h100", gpus, batch, lay,
               ("micro-batch 1", "interleaved, 2 chunks", "selective recomputation",
                "ZeRO-1 for Meta's sharded optimizer"), tflops, "tflops", "fused-attention",
               over or {}, lacks=MEMORY_405B)


MEMORY_405B = ("fits only beyond 80 GB in the planner's memory estimate (95-129 GB at "
               "selective recomputation): the run's memory balancing of its first stage "
               "(the paper's sec. 3.3.2) is not modelled; the time is within 15%")
TITAN_TERMS = ("the 500 W power limit (the source: peak 'between SXM and NVL', not known; "
               "the planner takes the SXM's 989 TFLOP/s) and Float8's scaling casts (the "
               "planner takes Float8 linears at twice the bf16 peak): both make the "
               "planner fast, by one factor of about 1.3 on all three rows")
PLAYBOOK_TERMS = ("nanotron's own efficiency: the planner's best layout is dp 8 at "
                  "54-64% MFU, the playbook measured its best at 44-47% (the playbook: "
                  "'performance heavily depends on implementation quality'); the planner "
                  "has no term for an implementation's kernels beyond the GEMM's e = 0.7")

RUNS = [
    _k("korthikanti-22b", "gpt-22b", 8, 8, 1, 4, 41.5, lay={"microbatch_size": 4},
       what="22B, tp 8, 8 GPUs, batch 4, selective recomputation and SP"),
    _k("korthikanti-175b", "gpt-175b", 64, 8, 8, 64, 51.4,
       what="175B, tp 8 x pp 8, 64 GPUs, batch 64"),
    _k("korthikanti-530b", "gpt-530b", 280, 8, 35, 280, 56.0,
       what="530B, tp 8 x pp 35, 280 GPUs, batch 280"),
    _k("korthikanti-1t", "gpt-1t", 512, 8, 64, 512, 56.3,
       what="1T, tp 8 x pp 64, 512 GPUs, batch 512"),
    _k("korthikanti-530b-2240", "gpt-530b", 2240, 8, 35, 2240, 54.2,
       what="530B on 2,240 GPUs (dp 8), selective recomputation and SP"),
    _k("korthikanti-530b-2240-full", "gpt-530b", 2240, 8, 35, 2240, 42.1,
       lay={"recompute": "full", "sequence_parallel": False},
       what="530B on 2,240 GPUs (dp 8), full recomputation, no SP"),
    _l("llama3-8k-8192", 8192, 64, 1, 2048, 430, "TP8 PP16 DP64, seq 8,192, 8,192 GPUs"),
    _l("llama3-8k-16384", 16384, 128, 1, 2048, 400, "TP8 PP16 DP128, seq 8,192, 16,384 GPUs"),
    _l("llama3-128k", 16384, 8, 16, 128, 380, "TP8 CP16 PP16 DP8, seq 131,072, 16,384 GPUs",
       {"block_size": 131072}),
    Run("torchtitan-405b-1f1b", TITAN, "405B, FSDP 8 TP 8 PP 8, 1F1B, 512 GPUs, local batch 32",
        "llama3-405b", "h100", 512, 256,
        dict(tp=8, pp=8, dp=8, zero=1, sequence_parallel=True, recompute="full",
             microbatch_size=4, schedule="1f1b"),
        ("ZeRO-1 for FSDP beside PP", "8 micro-batches of 4 (one per stage)"),
        100, "tokens", "torchtitan-fp8", machine_over={"gpu_memory_gb": 96, "hbm_gbs": 2400},
        lacks=TITAN_TERMS),
    Run("torchtitan-405b-interleaved", TITAN, "405B, FSDP 8 TP 8 PP 8, interleaved 1F1B",
        "llama3-405b", "h100", 512, 256,
        dict(tp=8, pp=8, dp=8, zero=1, sequence_parallel=True, recompute="full",
             microbatch_size=4, schedule="interleaved", virtual_stages=2),
        ("ZeRO-1 for FSDP beside PP", "8 micro-batches of 4", "2 chunks a rank"),
        128, "tokens", "torchtitan-fp8", machine_over={"gpu_memory_gb": 96, "hbm_gbs": 2400},
        lacks=TITAN_TERMS),
    Run("torchtitan-70b", TITAN, "70B, FSDP 32 TP 8, 256 GPUs, local batch 16", "llama3-70b",
        "h100", 256, 512, dict(tp=8, pp=1, dp=32, zero=3, sequence_parallel=True,
                               recompute="full", microbatch_size=16),
        ("ZeRO-3 for FSDP",), 829, "tokens", "torchtitan-fp8",
        machine_over={"gpu_memory_gb": 96, "hbm_gbs": 2400}, lacks=TITAN_TERMS),
    *[Run(f"playbook-{size}", PLAYBOOK, f"{size}B on one node: {words}", f"playbook-{size}b",
          "h100", 8, 256, dict(tp=1, dp=dp, pp=pp, zero=1, recompute="none", microbatch_size=b),
          ("no recomputation", "no SP (tp 1)"), mfu, "mfu", "fused-attention",
          lacks=PLAYBOOK_TERMS, top3=True)
      for size, words, dp, pp, b, mfu in (
          ("1.34", "DP 4 PP 2, MBS 4, ZeRO-1", 4, 2, 4, 44.32),
          ("3.57", "DP 4 PP 2, MBS 2, ZeRO-1", 4, 2, 2, 46.68),
          ("8.86", "DP 2 PP 4, MBS 1, ZeRO-1", 2, 4, 1, 45.22))],
]


def reproduce(run: Run) -> dict:
    """The planner on ``run``: its figure in the run's unit, the ratio to the published
    one, the memory estimate against the machine's, and for ``top3`` rows the place of the
    run's layout among refmp plan's best (None: not in the top 3)."""
    mcfg = family(run.preset, **run.over)
    mach = replace(MACHINES[run.machine], **run.machine_over)
    lay = Layout(**{"mixed_precision": "bf16", **run.layout})
    pred = predict(lay, mcfg, run.batch, mach, IMPLS[run.impl])
    got = {"mfu": 100 * pred["mfu"], "tflops": pred["mfu"] * mach.peak_tflops,
           "tokens": pred["tokens_per_s"] / run.gpus}[run.unit]
    held = total(memory(held_as(lay, IMPLS[run.impl]), mcfg, run.batch))
    out = {"figure": got, "ratio": got / run.figure, "memory_gb": held / 1e9,
           "fits": held <= mach.gpu_memory_gb * 1e9}
    if run.top3:
        fits, _ = search(mcfg, run.batch, run.gpus, mach, {}, 3, impl=IMPLS[run.impl])
        keys = ("tp", "pp", "dp", "zero", "microbatch_size")
        same = [i for i, r in enumerate(fits) if all(r[k] == lay.__dict__[k] for k in keys)]
        out["place"] = same[0] + 1 if same else None
    return out


def within(run: Run, got: dict) -> bool:
    return abs(got["ratio"] - 1) <= TOLERANCE and (not run.top3 or got["place"] is not None)


def command(run: Run) -> str:
    """The refmp plan command that predicts the run's layout."""
    flags = " ".join(f"--{k.replace('_', '-')} {'on' if v is True else 'off' if v is False else v}"
                     for k, v in run.layout.items())
    over = "".join(f" --{k.replace('_', '-')} {v}" for k, v in run.machine_over.items())
    seq = f" --block-size {run.over['block_size']}" if "block_size" in run.over else ""
    return (f"refmp plan --preset {run.preset}{seq} --machine {run.machine}{over} --gpus "
            f"{run.gpus} --global-batch {run.batch} {flags} --impl {run.impl}")
