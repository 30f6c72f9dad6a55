"""A run's GPUs: CuPy and one GPU per rank, with CUDA-aware MPI detected and agreed
(refmp train --device gpu, refmp generate --device gpu; docs/gpu.md)."""

from __future__ import annotations

from refmp.distributed.faults import agreed
from refmp.distributed.grid import ProcessGrid


def start_gpu(grid: ProcessGrid) -> dict:
    """CuPy and this rank's GPU; CUDA-awareness detected, agreed, and set on every axis."""
    from refmp.runtime.device import agree_cuda_aware, detect_cuda_aware, use_gpu

    info = agreed(grid.world, lambda: use_gpu(grid.world.mpi))
    answer, source = detect_cuda_aware()
    aware = agree_cuda_aware(grid.world, answer)
    grid.set_cuda_aware(aware)
    return {**info, "device": f"gpu {info['device']}", "cuda_aware": aware,
            "cuda_aware_source": source}
