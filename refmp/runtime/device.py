"""GPUs: which device a rank uses, and whether MPI can read device memory (CUDA-awareness).

* Device: each rank uses GPU ``local_rank % device_count``, where the local rank is its rank
  among the processes on the same node (MPI's shared-memory split, MPI_COMM_TYPE_SHARED).
* CUDA-awareness, first answer wins: the environment (``REFMP_CUDA_AWARE=1|0``), the MPI-4.1
  info key ``mpi_memory_alloc_kinds`` (lists ``cuda`` when device memory is supported), then
  ``MPIX_Query_cuda_support()`` from the MPI library (Open MPI and MPICH export it), else
  unknown, which means "stage through the host". All ranks then agree (a MIN-reduction): one
  rank that cannot pass device memory makes everyone stage.
* The peak: the FLOP/s of this process's best matrix product, on the device it computes on
  (measure_peak: refmp bench's MFU, refmp plan's cpu machine).
"""

from __future__ import annotations

import ctypes
import os
import time

import numpy as np
from mpi4py import MPI

from refmp.errors import ConfigError
from refmp.runtime import backend


def local_rank(world: MPI.Comm) -> tuple[int, int]:
    """(rank, size) among the processes sharing this node's memory."""
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def device_for(local: int, device_count: int) -> int:
    """GPU index for a local rank: round robin over the node's devices."""
    if device_count < 1:
        raise ConfigError("--device gpu: no CUDA device is visible on this node")
    return local % device_count


def use_gpu(world: MPI.Comm) -> dict:
    """Select CuPy and this rank's GPU. Clear errors when CuPy or a GPU is missing."""
    try:
        import cupy  # noqa: PLC0415
    except ImportError as e:
        raise ConfigError("--device gpu needs CuPy: pip install -e \".[gpu]\" "
                          "(cupy-cuda12x needs an NVIDIA driver for CUDA 12)") from e
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError when there is no driver or no device
        raise ConfigError(f"--device gpu: CuPy cannot reach a GPU ({e})") from e
    local, _ = local_rank(world)
    dev = device_for(local, count)
    cupy.cuda.Device(dev).use()
    backend.use("cupy")
    return {"device": dev, "local_rank": local, "device_count": count}


def _mpix_query_cuda_support() -> bool | None:
    """MPIX_Query_cuda_support() from the loaded MPI library, or None if it has none."""
    try:
        with open("/proc/self/maps") as f:
            libs = sorted({ln.split()[-1] for ln in f if "libmpi" in ln and ".so" in ln})
    except OSError:
        return None
    for path in libs:
        fn = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
        if fn is not None:
            return bool(fn())
    return None


def detect_cuda_aware(env: dict | None = None) -> tuple[bool | None, str]:
    """(answer, where it came from); answer None means unknown (treated as not aware)."""
    env = os.environ if env is None else env
    if env.get("REFMP_CUDA_AWARE", "") in ("0", "1"):
        return env["REFMP_CUDA_AWARE"] == "1", "REFMP_CUDA_AWARE"
    try:
        kinds = MPI.COMM_WORLD.Get_info().Get("mpi_memory_alloc_kinds")
    except Exception:  # an MPI without MPI-4.1 info keys
        kinds = None
    if kinds:
        if "cuda" in kinds:
            return True, "mpi_memory_alloc_kinds"
    answer = _mpix_query_cuda_support()
    if answer is not None:
        return answer, "MPIX_Query_cuda_support"
    if kinds:
        return False, "mpi_memory_alloc_kinds"
    return None, "unknown"


def agree_cuda_aware(world, answer: bool | None) -> bool:
    """True only if every rank's MPI can take device memory (``world`` is a refmp Comm)."""
    return world.allreduce_scalar(1.0 if answer else 0.0, op="min") == 1.0


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
