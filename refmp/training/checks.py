"""The memory check before the first step: the estimate of what a rank will hold
(refmp.cost.memory) against what its node, or its GPU, has free now (refmp.distributed.faults
says how a refused run ends; docs/faults.md how close the estimate is).
"""

from __future__ import annotations

import os

from mpi4py import MPI

from refmp.cost.memory import estimate_memory, need_bytes, size
from refmp.errors import ConfigError
from refmp.training.rank_memory import check_rank_limit


def available_memory(device: str = "cpu") -> tuple[int, str]:
    """(bytes free, where that figure comes from): the GPU's free memory for --device gpu;
    else /proc/meminfo's MemAvailable (or physical memory), capped by a cgroup limit."""
    if device == "gpu":
        import cupy

        return int(cupy.cuda.runtime.memGetInfo()[0]), "free on this GPU"
    free, source = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "physical memory"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free, source = int(line.split()[1]) * 1024, "MemAvailable"
    except OSError:
        pass
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit) as f1, open(usage) as f2:
                room = int(f1.read().strip()) - int(f2.read().strip())
        except (OSError, ValueError):  # no such cgroup file, or "max"
            continue
        if room < free:
            free, source = room, "the cgroup's memory limit"
    return free, source


def check_memory(cfg, mcfg, grid) -> None:
    """Refuse a layout whose estimated memory exceeds what this node (or GPU) has free.

    Collective over grid.world (a split by node and GPU, one all-reduce): the ranks that
    share the memory add up their needs. Raises on the ranks of a node that does not fit;
    call it through refmp.distributed.faults.agreed so that every rank stops.
    """
    mem = estimate_memory(cfg, mcfg, grid.sizes, grid.coords)
    need = need_bytes(mem)
    device = 0
    if cfg.device == "gpu":  # refmp.runtime.device.use_gpu chose this rank's GPU
        import cupy

        device = cupy.cuda.Device().id
    node = grid.world.mpi.Split_type(MPI.COMM_TYPE_SHARED)
    share = node.Split(device, node.Get_rank())
    try:
        total, n = share.allreduce(need), share.Get_size()
    finally:
        share.Free()
        node.Free()
    # a rank with a memory size (refmp cluster --rank-memory): its own limit first
    check_rank_limit(cfg, mcfg, grid.sizes, grid.coords, grid.rank)
    free, source = available_memory(cfg.device)
    if total > free:
        kept = ("params", "grads", "optimizer") + (("error_feedback",) if mem["error_feedback"] else ())
        parts = ", ".join(f"{k.replace('_', ' ')} {size(mem[k])}" for k in kept)
        where = "GPU" if cfg.device == "gpu" else "node"
        raise ConfigError(
            f"not enough memory: rank {grid.rank} needs about {size(need)} ({parts}, peak "
            f"activations {size(mem['activations'] + mem['workspace'])}, the full model at set-up "
            f"{size(mem['setup'])}); the {n} rank(s) on this {where} need {size(total)}, "
            f"but {size(free)} is available ({source}). Use a smaller --block-size or "
            f"--batch-size, more --microbatches, or more ranks (an estimate: docs/faults.md)")
