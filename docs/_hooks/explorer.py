"""MkDocs hook: the layout explorer's table (docs/explorer.md), computed while the site is
built by refmp's own cost model, so the page shows what ``refmp plan`` computes and nothing
else; its script (docs/js/explorer.js) only looks figures up and draws them.

For each model of MODELS, one node of GPUS GPUs and a global batch of BATCH sequences, every
combination of CHOICES that offered() admits is one layout (dp = GPUS / (tp pp cp), ep
carved from dp x cp, or with folding (etp >= 1) from tp x cp x dp; b = BATCH / (dp M) rows
a micro-batch), keyed by the index of each choice, one digit a field ("0100210100"), and
for each the table holds either the index of the reason refmp refuses it
(config.check_sizes, parallel.layout.check_layout) in ``reasons``, or a row of ``columns``:

    dp, b     the data-parallel size and the rows of a micro-batch,
    memory    refmp.cost.memory.memory: bytes per rank of the stage that needs the most
              (``memory_columns``: the index in ``states`` of its params, grads and
              optimizer bytes, which many layouts share, then activations, workspace, stage),
    need      what `refmp plan` holds to a GPU's memory (all of it plus the workspace),
    bytes     the index in ``bytes`` of refmp.cost.model.predict's ledger bytes per step of a
              rank of stage 0, by axis and operation (those that move any; many layouts
              move the same, stored once),
    time      per machine (refmp.cost.machines.MACHINES, in ``machines``' order), ``time_columns``: predict's
              milliseconds per step and by term (TERMS), tokens/s, MFU, and 1 where ``need``
              fits the machine's memory,

and TIMELINES the schedules simulated (refmp.parallel.pipeline.simulate.simulate_schedule)
for each pp, schedule and micro-batch count offered, with their bubble. The models' layouts
are written one file a model, explorer/<model>.js, which the page loads when that model is
chosen; the rest is explorer/table.js (each one assignment, so the page works opened from
disk, where a script may not fetch a file).
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import replace

from mkdocs.structure.files import File

from refmp.config import check_sizes
from refmp.cost.family import is_gpt2, n_params
from refmp.cost.machines import MACHINES as ALL_MACHINES
from refmp.cost.machines import MODELS as SHAPES
from refmp.cost.memory import memory, total
from refmp.cost.model import Layout, predict, train_config
from refmp.cost.presets import family
from refmp.errors import ConfigError
from refmp.nn.params import GPTConfig
from refmp.parallel.pipeline.simulate import simulate_schedule
from refmp.parallel.rules import check_layout

GPUS = 8  # one node of a machine preset
BATCH = 64
# refmp bench --preset tiny's shape (tests/test_site.py holds it to refmp.cli.bench.PRESETS),
# the same with 4 experts in every block (bench --n-expert 4), then refmp plan's presets
# (refmp.cost.machines.MODELS: n_layer, n_embd, n_head, vocab, T), and Llama 3 8B (the Llama
# family: grouped-query attention, SwiGLU, an untied head; refmp.cost.presets)
TINY = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)
MODELS = {"tiny": TINY, "tiny-moe": replace(TINY, n_expert=4),
          **{name: GPTConfig(n_layer=L, n_embd=C, n_head=NH, vocab_size=V, block_size=T)
             for name in ("gpt2", "gpt2-xl", "gpt3-6.7b") for L, C, NH, V, T in [SHAPES[name]]},
          "llama3-8b": family("llama3-8b")}
# the machines the page times on (the planner's h100 is dgx-h100 by another name)
MACHINES = {k: ALL_MACHINES[k] for k in ("dgx-a100", "dgx-h100")}
BENCH = ("tiny", "tiny-moe")  # refmp bench's presets: float32, as bench runs them
CHOICES = {"tp": (1, 2, 4, 8), "pp": (1, 2, 4), "cp": (1, 2, 4), "ep": (1, 2, 4),
           "microbatches": (4, 8, 16), "sequence_parallel": (False, True),
           "zero": (0, 1, 2, 3), "recompute": ("none", "selective", "full"),
           "mixed_precision": ("none", "bf16"), "schedule": ("1f1b", "interleaved"),
           "cp_ulysses": (1, 2), "dp_shard": (0, 2), "etp": (0, 1, 2),
           "fp8": ("none", "tensor", "delayed", "mxfp8"), "weight_gather": ("none", "fp8")}
TERMS = ("compute", "elementwise", "tp", "cp", "ep", "pp", "dp", "optimizer", "bubble")

log = logging.getLogger("mkdocs.hooks.explorer")


STATE = ("params", "grads", "optimizer")
MEMORY = ("state", "activations", "workspace", "stage")
COLUMNS = ("dp", "b", "memory", "need", "bytes", "time")
TIME = ("ms", "tokens_per_s", "mfu", "fits") + TERMS


def key(choice: dict) -> str:
    return "".join(str(CHOICES[k].index(v)) for k, v in choice.items())


def sig(x: float) -> float | int:
    """Four significant digits (what the page shows), an int where that is whole."""
    x = float(f"{x:.4g}")
    return int(x) if x.is_integer() else x


def layout(mcfg: GPTConfig, choice: dict) -> Layout:
    """The planner's Layout of a choice, or refmp's ConfigError."""
    c = dict(choice)
    M = c.pop("microbatches")
    dp = check_sizes(GPUS, c["pp"], None, c["cp"], c["tp"], c["ep"], c["etp"])["dp"]
    if BATCH % (dp * M):
        raise ConfigError(f"the batch {BATCH} is not a multiple of dp * microbatches ({dp} * {M})")
    lay = Layout(**c, dp=dp, microbatch_size=BATCH // (dp * M),
                 virtual_stages=2 if c["schedule"] == "interleaved" else 1)
    check_layout(train_config(lay, mcfg, BATCH), mcfg, GPUS)
    return lay


def price(mcfg: GPTConfig, lay: Layout, moves: dict, states: dict) -> list:
    """One layout's figures (``moves``, ``states``: each distinct bytes-by-axis and params,
    grads, optimizer bytes, to its index)."""
    mem = memory(lay, mcfg, BATCH)
    need = total(mem) + mem["workspace"]  # refmp plan's figure on a GPU (refmp.cost.search)
    preds = {name: predict(lay, mcfg, BATCH, mach) for name, mach in MACHINES.items()}
    stage0 = next(iter(preds.values()))["bytes"][0]  # bytes do not depend on the machine
    moved = json.dumps({axis: {op: b for op, b in ops.items() if b}
                        for axis, ops in stage0.items() if any(ops.values())})
    times = []
    for name, p in preds.items():
        fits = need <= MACHINES[name].gpu_memory_gb * 1e9
        times.append([sig(1e3 * p["step_seconds"]), sig(p["tokens_per_s"]), sig(p["mfu"]), int(fits),
                       *(sig(1e3 * p["seconds"][k]) for k in TERMS)])
    state = states.setdefault(json.dumps([mem[k] for k in STATE]), len(states))
    return [lay.dp, lay.microbatch_size, [state, *(mem[k] for k in MEMORY[1:])], need,
            moves.setdefault(moved, len(moves)), times]


def timelines() -> dict:
    """Each pipeline offered, simulated: events (rank, kind, micro-batch, chunk, start, end)."""
    out = {}
    for pp, name, M in itertools.product(CHOICES["pp"][1:], CHOICES["schedule"],
                                         CHOICES["microbatches"]):
        tl = simulate_schedule(name, pp, M, 2 if name == "interleaved" else 1)
        out[f"{pp}/{name}/{M}"] = {"bubble": tl.bubble(), "makespan": tl.makespan, "v": tl.v,
                                   "events": [[e.rank, e.kind, e.mb, e.chunk, e.start, e.end]
                                              for e in tl.events]}
    return out


def offered(name: str, mcfg: GPTConfig, choice: dict) -> bool:
    """The layouts the page offers: those `refmp plan` searches (refmp.cost.search.candidates:
    ZeRO 2 and 3 without a pipeline, sequence parallelism with tp > 1, a schedule only with a
    pipeline, ep > 1 only with experts), tp pp cp at most the node's GPUS, and, to keep the
    table small, micro-batch counts other than 8 only with a pipeline, cp > 1 only with 8
    micro-batches, the bench presets in float32; hierarchical cp (Ulysses 2 x ring 2) with
    cp = 4, HSDP (shard groups of 2 dp ranks) with ZeRO-3, dp >= 4 and neither cp nor ep;
    MoE parallel folding (etp >= 1: ep x etp over the stage's tp cp dp ranks) with experts
    over ep > 1, one stage, no cp, no recomputation and no HSDP (``c`` without the FP8
    fields: fp8_variants offers those)."""
    c = choice
    return ((c["zero"] < 2 or c["pp"] == 1)
            and (c["tp"] > 1 or not c["sequence_parallel"])
            and (c["pp"] > 1 or c["schedule"] == "1f1b")
            and (mcfg.n_expert > 0 or c["ep"] == 1)
            and c["tp"] * c["pp"] * c["cp"] <= GPUS
            and (c["pp"] > 1 or c["microbatches"] == 8)
            and (c["cp"] == 1 or c["microbatches"] == 8)
            and (name not in BENCH or c["mixed_precision"] == "none")
            and (c["cp_ulysses"] == 1 or c["cp"] == 4)
            and (c["dp_shard"] == 0 or (c["zero"] == 3 and c["cp"] == c["ep"] == 1
                                        and GPUS // (c["tp"] * c["pp"]) >= 4))
            and (c["etp"] == 0 or (mcfg.n_expert > 0 and c["ep"] > 1 and c["pp"] == c["cp"] == 1
                                   and c["recompute"] == "none" and c["dp_shard"] == 0)))


FP8 = ("fp8", "weight_gather")  # the last fields of CHOICES, offered by fp8_variants


def fp8_variants(name: str, mcfg: GPTConfig, c: dict) -> list[dict]:
    """The FP8 choices offered with the other fields ``c``: none, or (refmp.parallel.fp8,
    and ZeRO-3's FP8 weight gathers) where refmp.cost.memory counts the FP8 caches (GPT-2's
    linears; no SP, no cp, no full recomputation), kept few for the table's size: one stage,
    no experts over ranks, no recomputation, one level of everything, over bf16 (the bench
    presets: fp32, as they run); the FP8 gathers with ZeRO-3."""
    off = [{"fp8": "none", "weight_gather": "none"}]
    if not (is_gpt2(mcfg) and c["pp"] == c["cp"] == c["ep"] == c["cp_ulysses"] == 1
            and c["etp"] == 0
            and not c["sequence_parallel"] and c["recompute"] == "none" and c["dp_shard"] == 0
            and (c["mixed_precision"] == "bf16" or name in BENCH)):
        return off
    return [{"fp8": f, "weight_gather": g} for g in CHOICES["weight_gather"]
            for f in CHOICES["fp8"] if g == "none" or c["zero"] == 3]


def model_table(name: str, mcfg: GPTConfig) -> dict:
    """One model's layouts: key -> row, or the index of refmp's reason in ``reasons``."""
    layouts = {}
    reasons = {}
    moves = {}
    states = {}
    fields = [k for k in CHOICES if k not in FP8]
    for v in itertools.product(*(CHOICES[k] for k in fields)):
        base = dict(zip(fields, v, strict=True))
        if not offered(name, mcfg, base):
            continue
        for c in ({**base, **f} for f in fp8_variants(name, mcfg, base)):
            try:
                got = price(mcfg, layout(mcfg, c), moves, states)
            except ConfigError as e:  # a reason, stored once
                got = reasons.setdefault(str(e), len(reasons))
            layouts[key(c)] = got
    return {"layouts": layouts, "reasons": list(reasons), "bytes": [json.loads(m) for m in moves],
            "states": [json.loads(m) for m in states]}


def table() -> dict:
    models = {name: {"n_layer": m.n_layer, "n_embd": m.n_embd, "n_head": m.n_head,
                     "vocab_size": m.vocab_size, "block_size": m.block_size,
                     "n_expert": m.n_expert, "top_k": m.top_k if m.n_expert else 0,
                     "params": n_params(m)}
              for name, m in MODELS.items()}
    machines = {name: {"gpu_memory_gb": m.gpu_memory_gb, "peak_tflops": m.peak_tflops,
                       "intra_node_gbs": m.intra_node_gbs} for name, m in MACHINES.items()}
    return {"gpus": GPUS, "batch": BATCH, "choices": CHOICES, "bench": BENCH,
            "columns": COLUMNS, "state_columns": STATE, "memory_columns": MEMORY, "time_columns": TIME,
            "models": models, "machines": machines, "layouts": {}, "timelines": timelines()}


def script(text: str) -> str:
    return text + ";\n"


def on_files(files, config, **kwargs):
    t0 = time.perf_counter()
    sizes = []
    texts = {"explorer/table.js": "window.REFMP_EXPLORER = " + json.dumps(table(), separators=(",", ":"))}
    for name, mcfg in MODELS.items():
        texts[f"explorer/{name}.js"] = (f"window.REFMP_EXPLORER.layouts[{json.dumps(name)}] = "
                                        + json.dumps(model_table(name, mcfg), separators=(",", ":")))
    for path, text in texts.items():
        files.append(File.generated(config, path, content=script(text)))
        sizes.append(len(text))
    log.info(f"explorer: {sum(sizes) / 1e3:.0f} kB in {len(sizes)} files "
             f"in {time.perf_counter() - t0:.1f} s")
    return files
