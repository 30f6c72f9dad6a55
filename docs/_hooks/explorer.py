"""MkDocs hook: the layout explorer's table (docs/explorer.md), computed while the site is
built by refmp's own cost model, so the page shows what ``refmp plan`` computes and nothing
else; its script (docs/js/explorer.js) only looks figures up and draws them.

For each model of MODELS, one node of GPUS GPUs and a global batch of BATCH sequences in
MICROBATCHES micro-batches, every combination of CHOICES that `refmp plan` searches is one
layout (dp = GPUS / (tp pp), cp = ep = 1; b = BATCH / (dp M) rows a micro-batch), keyed by the
index of each choice, one digit a field ("0100210"), and for each the table holds either the
index of the reason refmp refuses it (config.check_sizes, parallel.layout.check_layout) in
``reasons``, or a row of ``columns``:

    dp, b     the data-parallel size and the rows of a micro-batch,
    memory    refmp.cost.memory.memory: bytes per rank of the stage that needs the most
              (``memory_columns``: params, grads, optimizer, activations, workspace, stage),
    need      what `refmp plan` holds to a GPU's memory (all of it plus the workspace),
    bytes     refmp.cost.model.predict's ledger bytes per step of a rank of stage 0, by axis
              and operation (those that move any),
    time      per machine (refmp.cost.machines.MACHINES), ``time_columns``: predict's
              milliseconds per step and by term (TERMS), tokens/s, MFU, and 1 where ``need``
              fits the machine's memory,

and TIMELINES the schedules simulated (refmp.parallel.pipeline.simulate.simulate_schedule)
for each pp and schedule offered, with their bubble. It is written as explorer/table.js
(one assignment, so the page works opened from disk, where a script may not fetch a file).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time

from mkdocs.structure.files import File

from refmp.config import check_sizes
from refmp.cost.machines import MACHINES
from refmp.cost.machines import MODELS as SHAPES
from refmp.cost.memory import memory, total
from refmp.cost.model import Layout, predict, train_config
from refmp.errors import ConfigError
from refmp.nn.params import GPTConfig, param_shapes
from refmp.parallel.layout import check_layout
from refmp.parallel.pipeline.simulate import simulate_schedule

GPUS = 8  # one node of a machine preset
MICROBATCHES = 8
BATCH = 64
# refmp bench --preset tiny's shape (tests/test_site.py holds it to refmp.cli.bench.PRESETS),
# then refmp plan's presets (refmp.cost.machines.MODELS: n_layer, n_embd, n_head, vocab, T)
TINY = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)
MODELS = {"tiny": TINY, **{name: GPTConfig(n_layer=L, n_embd=C, n_head=NH, vocab_size=V, block_size=T)
                           for name in ("gpt2", "gpt2-xl", "gpt3-6.7b")
                           for L, C, NH, V, T in [SHAPES[name]]}}
CHOICES = {"tp": (1, 2, 4, 8), "pp": (1, 2, 4), "sequence_parallel": (False, True),
           "zero": (0, 1, 2, 3), "recompute": ("none", "selective", "full"),
           "mixed_precision": ("none", "bf16"), "schedule": ("1f1b", "interleaved")}
TERMS = ("compute", "elementwise", "tp", "pp", "dp", "optimizer", "bubble")

log = logging.getLogger("mkdocs.hooks.explorer")


MEMORY = ("params", "grads", "optimizer", "activations", "workspace", "stage")
COLUMNS = ("dp", "b", "memory", "need", "bytes", "time")
TIME = ("ms", "tokens_per_s", "mfu", "fits") + TERMS


def key(choice: dict) -> str:
    return "".join(str(CHOICES[k].index(v)) for k, v in choice.items())


def sig(x: float) -> float | int:
    """Four significant digits (what the page shows), an int where that is whole."""
    x = float(f"{x:.4g}")
    return int(x) if x.is_integer() else x


def price(mcfg: GPTConfig, choice: dict) -> list | str:
    """One layout's figures, or the reason refmp refuses it."""
    tp, pp = choice["tp"], choice["pp"]
    try:
        dp = check_sizes(GPUS, pp, None, 1, tp, 1)["dp"]
        if BATCH % (dp * MICROBATCHES):
            raise ConfigError(f"the batch {BATCH} is not a multiple of dp * microbatches")
        lay = Layout(**choice, dp=dp, microbatch_size=BATCH // (dp * MICROBATCHES),
                     virtual_stages=2 if choice["schedule"] == "interleaved" else 1)
        check_layout(train_config(lay, mcfg, BATCH), mcfg, GPUS)
    except ConfigError as e:
        return str(e)
    mem = memory(lay, mcfg, BATCH)
    need = total(mem) + mem["workspace"]  # refmp plan's figure on a GPU (refmp.cost.search)
    preds = {name: predict(lay, mcfg, BATCH, mach) for name, mach in MACHINES.items()}
    stage0 = next(iter(preds.values()))["bytes"][0]  # bytes do not depend on the machine
    moved = {axis: {op: b for op, b in ops.items() if b}
             for axis, ops in stage0.items() if any(ops.values())}
    times = {}
    for name, p in preds.items():
        fits = need <= MACHINES[name].gpu_memory_gb * 1e9
        times[name] = [sig(1e3 * p["step_seconds"]), sig(p["tokens_per_s"]), sig(p["mfu"]), int(fits),
                       *(sig(1e3 * p["seconds"][k]) for k in TERMS)]
    return [dp, lay.microbatch_size, [mem[k] for k in MEMORY], need, moved, times]


def timelines() -> dict:
    """Each pipeline offered, simulated: events (rank, kind, micro-batch, chunk, start, end)."""
    out = {}
    for pp, name in itertools.product(CHOICES["pp"][1:], CHOICES["schedule"]):
        tl = simulate_schedule(name, pp, MICROBATCHES, 2 if name == "interleaved" else 1)
        out[f"{pp}/{name}"] = {"bubble": tl.bubble(), "makespan": tl.makespan, "v": tl.v,
                               "events": [[e.rank, e.kind, e.mb, e.chunk, e.start, e.end]
                                          for e in tl.events]}
    return out


def offered(choice: dict) -> bool:
    """The layouts `refmp plan` searches (refmp.cost.search.candidates): ZeRO 2 and 3 without a
    pipeline, sequence parallelism with tp > 1; a schedule only with a pipeline."""
    return ((choice["zero"] < 2 or choice["pp"] == 1)
            and (choice["tp"] > 1 or not choice["sequence_parallel"])
            and (choice["pp"] > 1 or choice["schedule"] == "1f1b"))


def table() -> dict:
    layouts = {}
    reasons = {}
    for name, mcfg in MODELS.items():
        every = (dict(zip(CHOICES, v, strict=True)) for v in itertools.product(*CHOICES.values()))
        layouts[name] = {}
        for c in every:
            if offered(c):
                got = price(mcfg, c)
                if isinstance(got, str):  # a reason, stored once
                    got = reasons.setdefault(got, len(reasons))
                layouts[name][key(c)] = got
    models = {name: {"n_layer": m.n_layer, "n_embd": m.n_embd, "n_head": m.n_head,
                     "vocab_size": m.vocab_size, "block_size": m.block_size,
                     "params": sum(math.prod(s) for s in param_shapes(m).values())}
              for name, m in MODELS.items()}
    machines = {name: {"gpu_memory_gb": m.gpu_memory_gb, "peak_tflops": m.peak_tflops,
                       "intra_node_gbs": m.intra_node_gbs} for name, m in MACHINES.items()}
    return {"gpus": GPUS, "batch": BATCH, "microbatches": MICROBATCHES, "choices": CHOICES,
            "columns": COLUMNS, "memory_columns": MEMORY, "time_columns": TIME,
            "models": models, "machines": machines, "layouts": layouts, "reasons": list(reasons),
            "timelines": timelines()}


def on_files(files, config, **kwargs):
    t0 = time.perf_counter()
    text = "window.REFMP_EXPLORER = " + json.dumps(table(), separators=(",", ":")) + ";\n"
    files.append(File.generated(config, "explorer/table.js", content=text))
    log.info(f"explorer: {len(text) / 1e3:.0f} kB table in {time.perf_counter() - t0:.1f} s")
    return files
