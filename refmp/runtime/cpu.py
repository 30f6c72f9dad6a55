"""What makes NumPy fast on the CPU without changing a digit of any result.

1. **Freed memory is kept.** A training step allocates its activations afresh (megabytes per
   layer) and frees them at the end. glibc returns large freed blocks to the kernel at once
   (they are ``mmap``-ed above a threshold that starts at 128 KiB), so every step touches new
   pages, and the kernel zero-fills each page on first touch: page faults cost a fifth of a
   small model's step, and at GPT-2's real shape (T 1024: attention's scores are 50 MB a
   layer, the head's logits 206 MB) a sixth of its CPU time. :func:`keep_freed_memory`
   tells glibc to ``mmap`` no block at all and to keep up to 2 GiB free at the top of its
   heap (``mallopt``; PyTorch keeps a caching allocator for the same reason), so the next
   step reuses the same, already mapped pages. It runs once, when refmp.runtime.backend (the
   array module) is imported.

2. **Row blocks in threads.** NumPy runs elementwise work on one core, while the matrix
   products use every BLAS thread. LayerNorm, GELU and attention are independent
   per row (per token; per batch element), so :func:`rows` splits their arrays along the first
   axis into one block per thread and runs the same code on each block at once (NumPy drops
   the GIL inside its loops). Each element or row is computed by exactly the operations it
   would be computed by in one call, so the result is bitwise the same for any number of
   threads (tests/test_cpu.py proves it). A block must hold at least MIN_BLOCK elements,
   counted over all the arrays it touches: handing a block to a thread costs tens of
   microseconds, more than a second thread saves on fewer elements. The thread count is
   ``REFMP_THREADS``, else ``OMP_NUM_THREADS`` (which ``refmp`` sets per rank under
   ``mpiexec``), else the cores, read at the first call (after the command line has set the
   environment).
   Only NumPy arrays are split; CuPy arrays run in one call (the GPU is already parallel).

3. **Small products on one BLAS thread.** OpenBLAS splits even a 128 x 128 x 32 product over
   its threads, and for attention's many small (per batch element and head) products the
   hand-off costs more than it saves. :func:`one_blas_thread` (threadpoolctl) runs such a
   section on one thread; the products are the same calls, so the same bits.

4. **Idle BLAS threads sleep at once.** After a product OpenBLAS's worker threads spin,
   waiting for the next one, for 2^28 clock cycles (about 0.1 s) by default, and a spinning
   worker holds the core that a row block of :func:`rows` needs next, taking back what the
   threads gain. ``import refmp`` sets ``OPENBLAS_THREAD_TIMEOUT=4`` (2^4 cycles, OpenBLAS's
   least) unless the user set it; it takes effect only if NumPy was not loaded before refmp.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import os
import sys

TRIM_THRESHOLD = (1 << 31) - 1  # keep up to 2 GiB of freed memory mapped (mallopt takes an int)
MIN_BLOCK = 1 << 19  # elements of all a block's arrays together: below it, one thread is faster
SMALL_PRODUCT = 1 << 22  # m * n * k below which a product runs faster on one BLAS thread


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed blocks mapped for reuse (see the module docstring): no block
    ``mmap``-ed (its mmap threshold cannot exceed 32 MiB, and larger arrays would be unmapped
    when freed), and the top of the heap trimmed only beyond TRIM_THRESHOLD.

    Returns whether it could (False off glibc, e.g. macOS or musl: nothing changes there).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
        return bool(libc.mallopt(m_mmap_max, 0)
                    and libc.mallopt(m_trim_threshold, TRIM_THRESHOLD))
    except (OSError, AttributeError):
        return False


def cores() -> int:
    """The cores this process may run on (its affinity, where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def local_ranks() -> int:
    """How many ranks the MPI launcher started on this node (1 outside mpiexec)."""
    local = os.environ.get("MPI_LOCALNRANKS") or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    return int(local) if local else 1


def _is_numpy(a) -> bool:
    """A host NumPy array (not CuPy's, nor a subclass). NumPy is imported here, not with this
    module: refmp.cli.main reads cores() and local_ranks() before NumPy may load."""
    import numpy as np  # noqa: PLC0415  (already loaded by whoever made ``a``)

    return type(a) is np.ndarray


def _env_threads() -> int:
    given = os.environ.get("REFMP_THREADS")
    if given is not None:
        if not (given.isdigit() and int(given) > 0):
            from refmp.errors import ConfigError  # noqa: PLC0415

            raise ConfigError(f"REFMP_THREADS must be a whole number of threads >= 1, got {given!r}")
        return int(given)
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    return cores()


_threads: int | None = None  # threads(): from the environment at first use
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def set_threads(n: int) -> None:
    """Use n threads for :func:`rows` from now on (1: every call runs in the caller's thread)."""
    global _threads, _pool
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    if _pool is not None and n != _threads:
        _pool.shutdown()
        _pool = None
    _threads = n


def threads() -> int:
    """The threads :func:`rows` uses (see the module docstring)."""
    global _threads
    if _threads is None:
        _threads = _env_threads()
    return _threads


def rows(fn, *arrays) -> None:
    """fn(*arrays), run as fn(*(a[lo:hi] for a in arrays)) on row blocks in parallel threads.

    ``fn`` must compute each row (index of the first axis) of its outputs from the same row of
    its inputs only, and write its outputs into the arrays it is given (they are views of the
    caller's). All ``arrays`` share their first axis. Blocks run at once in ``threads()``
    threads, the caller's included; an exception in any block is raised here.
    """
    n_rows = arrays[0].shape[0]
    n = min(threads(), n_rows, max(1, sum(a.size for a in arrays) // max(1, MIN_BLOCK)))
    if n <= 1 or not all(map(_is_numpy, arrays)):
        fn(*arrays)
        return
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(threads() - 1, thread_name_prefix="refmp")
    edges = [n_rows * i // n for i in range(n + 1)]
    blocks = [[a[lo:hi] for a in arrays] for lo, hi in zip(edges[:-1], edges[1:], strict=True)]
    others = [_pool.submit(fn, *block) for block in blocks[1:]]
    try:
        fn(*blocks[0])
    finally:
        for f in others:
            f.result()  # waits for every block; re-raises a block's exception


_blas = None  # threadpoolctl's controller of the loaded BLAS, made at first use


def one_blas_thread(m: int, n: int, k: int, a=None):
    """A context running BLAS on one thread while it lasts, if (m, n, k) products are small
    (m n k < SMALL_PRODUCT) and ``a`` is a NumPy array (or None); else a no-op context."""
    global _blas
    if m * n * k >= SMALL_PRODUCT or (a is not None and not _is_numpy(a)):
        return contextlib.nullcontext()
    if _blas is None:
        from threadpoolctl import ThreadpoolController  # noqa: PLC0415

        _blas = ThreadpoolController()
    return _blas.limit(limits=1, user_api="blas")


def cpu_model() -> str:
    """The CPU's model name, as ``lscpu`` prints it (read from /proc/cpuinfo on Linux; the
    platform's processor string elsewhere): which machine a timing came from."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform  # noqa: PLC0415

    return platform.processor() or platform.machine() or "unknown"


def blas_kernels() -> list[dict]:
    """Each loaded BLAS library: its name, version, threads and the kernel it chose for this
    CPU (threadpoolctl's ``architecture``, e.g. OpenBLAS's Haswell or SkylakeX)."""
    from threadpoolctl import threadpool_info  # noqa: PLC0415

    keys = ("internal_api", "version", "architecture", "num_threads")
    return [{k: i.get(k) for k in keys} for i in threadpool_info() if i.get("user_api") == "blas"]
