"""A rank with a memory size (``refmp cluster --rank-memory``, refmp.runtime.cgroup): the check
before any work that the layout's predicted peak fits the rank's limit, and the measured
peak a run reports beside that prediction.

The prediction is the planner's memory model (refmp.cost.memory.need_bytes of
estimate_memory: what the layout holds, by the formulas). The check adds what this process
holds already, measured (the runtime: Python, NumPy, MPI and refmp's modules, and the data),
and refuses, naming both figures, the limit, and a layout of the same ranks that fits
(refmp.cost.search's, checked with the same formulas), if there is one.
"""

from __future__ import annotations

from dataclasses import replace

from refmp.cost.machines import Machine
from refmp.cost.memory import estimate_memory, need_bytes, size
from refmp.cost.model import layout_flags, parallel_fields
from refmp.cost.search import search
from refmp.errors import ConfigError
from refmp.parallel.rules import check_layout
from refmp.runtime import cgroup

AXES = ("pp", "dp", "cp", "tp", "ep")


def predicted_peak(cfg, mcfg, sizes: dict, coords: dict) -> int:
    """The planner's peak for the rank at ``coords``: need_bytes(estimate_memory)."""
    return need_bytes(estimate_memory(cfg, mcfg, sizes, coords))


def check_rank_limit(cfg, mcfg, sizes: dict, coords: dict, rank: int) -> None:
    """Refuse (ConfigError) when this rank's predicted peak and what it holds already
    exceed its memory cgroup's limit; nothing without a limit. Pure but for the measurement:
    call it through refmp.distributed.faults.agreed (one message, every rank)."""
    limit = cgroup.rank_limit()
    if limit is None:
        return
    limit, folder = limit
    need, held = predicted_peak(cfg, mcfg, sizes, coords), cgroup.resident()
    if need + held <= limit:
        return
    n = _world(sizes)
    fit = layout_that_fits(cfg, mcfg, n, limit - held)
    ranks = f"{n} rank" + ("s" if n > 1 else "")
    hint = (f"a layout of these {ranks} that fits: {fit[0]} (predicted "
            f"{size(fit[1])})" if fit else
            f"no layout of {ranks} fits (refmp plan --machine cpu "
            f"--gpu-memory-gb {(limit - held) / 1e9:.3g} lists the candidates): use more ranks, "
            f"a larger --rank-memory, or a smaller model, batch or --block-size")
    raise ConfigError(
        f"rank {rank} does not fit its memory limit of {cgroup.gib(limit)} = {size(limit)} "
        f"(the kernel's cgroup {folder}, refmp cluster --rank-memory): the planner predicts a peak of "
        f"{size(need)} for this layout (refmp.cost.memory, docs/memory_at_scale.md), and the rank "
        f"holds {size(held)} already (Python, NumPy, MPI, the data): {size(need + held)}; "
        f"{hint}")


def _world(sizes: dict) -> int:
    n = 1
    for a in AXES[:4]:  # ep is carved out of dp x cp
        n *= sizes[a]
    return n


def layout_that_fits(cfg, mcfg, world: int, room: int) -> tuple[str, int] | None:
    """(train flags, predicted peak) of the fastest layout of ``world`` ranks, as refmp plan
    ranks them on a nominal CPU, whose peak on every stage fits ``room`` bytes; None if none
    does. The search keeps the run's precision; each candidate is checked with the run's own
    settings (optimizer, dtype, ...) at every pipeline stage."""
    T = cfg.block_size or mcfg.block_size
    nominal = Machine("cpu", world, room / 1e9, 0.1, 10.0, 1.0, 5.0, 5.0, 2.0, 2.0,
                      time_shared=True, overlaps_p2p=False)  # ranks the candidates alone
    fits, _ = search(replace(mcfg, block_size=T), cfg.batch_size, world, nominal,
                     {"mixed_precision": cfg.mixed_precision}, top=8, dtype=cfg.dtype)
    for row in fits:
        trial = replace(cfg, **parallel_fields(row, cfg.batch_size), stage_layers=None,
                        hpz_size=1)
        sizes = {a: row[a] for a in AXES}
        try:
            check_layout(trial, mcfg, world, sizes)
        except ConfigError:
            continue
        peak = max(predicted_peak(trial, mcfg, sizes, {**dict.fromkeys(AXES, 0), "pp": r})
                   for r in range(row["pp"]))
        if peak <= room:
            return layout_flags({**row, **parallel_fields(row, cfg.batch_size)}, short=True), peak
    return None


def measured(cfg, mcfg, sizes: dict, coords: dict) -> dict:
    """This rank's measured peaks (refmp.runtime.cgroup.peak: ``rss``, and under a rank
    cgroup ``cgroup`` and ``limit``) beside the planner's ``predicted`` peak."""
    return {**cgroup.peak(), "predicted": predicted_peak(cfg, mcfg, sizes, coords)}


def print_measured(rows: list[dict], model: str = "refmp.cost.memory") -> None:
    """The summary's lines: each rank's measured peak beside the prediction (by ``model``)."""
    print(f"measured peak memory per rank (ru_maxrss; the rank's cgroup) vs the prediction "
          f"({model}):")
    for r, m in enumerate(rows):
        under = (f", cgroup {size(m['cgroup'])} of {cgroup.gib(m['limit'])}"
                 if m.get("limit") else "")
        print(f"  rank {r}: measured {size(m['rss'])}{under}; predicted {size(m['predicted'])} "
              f"(measured - predicted {size(m['rss'] - m['predicted'])})")
