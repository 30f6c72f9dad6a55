"""refmp.runtime.cpu: row blocks in threads give bitwise the one-call result; the allocator setting.

LayerNorm, GELU and AdamW run their row-wise math through ``cpu.rows``. With one thread that is a
single call (the plain NumPy code); with several, each block of rows runs the same operations
at once. These tests split even tiny arrays (MIN_BLOCK = 1) into 2 and 3 blocks, on shapes
whose rows do not divide evenly, and require every output and every cached array to be equal
to the single-call result bit for bit, in float32 and float64.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from refmp.nn import fast as L
from refmp.runtime import backend, cpu
from refmp.training.optim import AdamW


@pytest.fixture
def split_everything(monkeypatch):
    monkeypatch.setattr(cpu, "MIN_BLOCK", 1)
    before = cpu.threads()
    yield
    cpu.set_threads(before)  # what this process had: later tests see the default again


def run_layers(dtype, seed=0):
    """Every threaded layer's forward, cache and backward on odd shapes (B 5, T 7, C 24, 4 heads)."""
    rng = np.random.default_rng(seed)
    B, T, C = 5, 7, 24
    x, d = (rng.standard_normal((B, T, C)).astype(dtype) for _ in range(2))
    w, b = (rng.standard_normal(C).astype(dtype) for _ in range(2))
    out = {}
    y, c = L.layernorm_forward(x, w, b)
    out["layernorm"] = (y, *c, *L.layernorm_backward(d, c))
    y, c = L.gelu_forward(x)
    out["gelu"] = (y, *c, L.gelu_backward(d, c))
    qkv = rng.standard_normal((B, T, 3 * C)).astype(dtype)
    for keep in (True, False):  # the softmax kept, or recomputed in the backward
        y, c = L.attention_forward(qkv, 4, keep_scores=keep)
        out[f"attention keep_scores={keep}"] = (y, *c[:4], L.attention_backward(d, c))
    params = {"w": rng.standard_normal((9, 4)).astype(dtype), "b": rng.standard_normal(5).astype(dtype)}
    grads = {k: rng.standard_normal(v.shape).astype(dtype) for k, v in params.items()}
    opt = AdamW(params, lr=1e-2, weight_decay=0.1)
    for _ in range(2):
        opt.step(grads)
    out["adamw"] = (*params.values(), *opt.m.values(), *opt.v.values())
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [2, 3])
def test_threads_are_bitwise_one_call(split_everything, dtype, n):
    cpu.set_threads(1)
    one = run_layers(dtype)
    cpu.set_threads(n)
    many = run_layers(dtype)
    for name, arrays in one.items():
        for i, (a, b) in enumerate(zip(arrays, many[name], strict=True)):
            if a is None:
                assert b is None, name
                continue
            assert a.dtype == b.dtype and a.shape == b.shape, (name, i)
            assert np.array_equal(a, b), f"{name}: array {i} differs with {n} threads"


def test_rows_splits_runs_in_threads_and_reraises(split_everything):
    cpu.set_threads(3)
    seen = []
    together = threading.Barrier(3, timeout=10)  # passes only if the 3 blocks run at once

    def fill(a, out):
        seen.append((len(a), threading.current_thread().name))
        together.wait()
        out[...] = 2 * a

    a = np.arange(7.0)
    out = np.empty_like(a)
    cpu.rows(fill, a, out)
    assert np.array_equal(out, 2 * a)
    assert sorted(n for n, _ in seen) == [2, 2, 3]  # 7 rows in 3 blocks
    assert len({t for _, t in seen}) == 3  # the caller's thread and two of the pool's
    together.reset()

    def fail(a):
        if a[0] > 0:
            raise ValueError("block failed")

    with pytest.raises(ValueError, match="block failed"):
        cpu.rows(fail, a)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        cpu.set_threads(0)


def test_blocks_are_sized_by_all_their_arrays(monkeypatch):
    """A block gets at least MIN_BLOCK elements, counted over every array it touches."""
    monkeypatch.setattr(cpu, "MIN_BLOCK", 12)
    before = cpu.threads()
    cpu.set_threads(4)
    try:
        for n_rows, n_arrays, blocks in ((6, 1, 1), (6, 2, 1), (12, 2, 2), (24, 2, 4), (100, 1, 4)):
            sizes: list[int] = []
            cpu.rows(lambda *a, seen=sizes: seen.append(len(a[0])),
                     *(np.zeros(n_rows) for _ in range(n_arrays)))
            assert len(sizes) == blocks and sum(sizes) == n_rows, (n_rows, n_arrays, sizes)
    finally:
        cpu.set_threads(before)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("ids", ["repeats", "distinct", "one index", "empty", "heavy"])
def test_scatter_add_is_bitwise_add_at(dtype, ids):
    """backend.scatter_add (rounds of distinct indices) against numpy.add.at, byte for byte."""
    rng = np.random.default_rng(0)
    V, N = 50, 200
    idx = {"repeats": rng.integers(0, V, N), "distinct": rng.permutation(V)[:30],
           "one index": np.full(N, 7), "empty": np.zeros(0, dtype=np.int64),
           "heavy": np.minimum(rng.zipf(1.5, N), V) - 1}[ids]
    values = rng.standard_normal((len(idx), 3)).astype(dtype)
    values[::5] *= 1e8  # magnitudes apart: another order of additions gives other bits
    start = rng.standard_normal((V, 3)).astype(dtype)
    want, got = start.copy(), start.copy()
    np.add.at(want, idx, values)
    backend.scatter_add(got, idx, values)
    assert got.tobytes() == want.tobytes()


def test_one_thread_and_non_numpy_arrays_run_in_one_call(split_everything):
    calls = []
    cpu.set_threads(1)
    cpu.rows(lambda a: calls.append(a.shape), np.zeros((6, 2)))
    cpu.set_threads(4)
    cpu.rows(lambda a: calls.append(a.shape), np.ma.zeros((6, 2)))  # not a plain ndarray
    assert calls == [(6, 2), (6, 2)]


@pytest.mark.skipif(not cpu.sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_memory_is_kept_on_glibc():
    """An array larger than glibc's largest mmap threshold (64 MB: the size of attention's
    scores at T 1024), freed and made again, lands on pages already mapped: no page fault."""
    import resource

    assert cpu.keep_freed_memory()
    for _ in range(2):  # the first round maps the pages
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        a = np.ones(1 << 24, dtype=np.float32)  # (16M,) 64 MB, every page touched
        del a
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    assert faults < 16, faults  # when not kept: 16,384 pages of 4 KiB, or 32 huge pages of 2 MiB


def test_threads_follow_what_the_command_line_sets():
    """`refmp` sets each rank's thread count (cli.limit_threads) before NumPy loads: importing
    refmp and its CLI must not load NumPy (OpenBLAS reads its thread count when it loads),
    and refmp.runtime.cpu must read the count when first used, not at import."""
    import subprocess
    import sys

    code = ("import os, sys, refmp, refmp.cli.main; assert 'numpy' not in sys.modules; "
            "refmp.cli.main.limit_threads(); from refmp.runtime import cpu; print(cpu.threads())")
    cores = cpu.cores()
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "REFMP_THREADS", "OPENBLAS_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "MPI_LOCALNRANKS": str(cores)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"  # one rank per core: one thread each
    out = subprocess.run([sys.executable, "-c", code], env={**env, "REFMP_THREADS": "3"},
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "3", out.stderr


def test_import_refmp_makes_idle_blas_threads_sleep_unless_the_user_chose():
    import subprocess
    import sys

    code = "import os, refmp; print(os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    for given, expect in ((None, "4"), ("12", "12")):
        extra = {} if given is None else {"OPENBLAS_THREAD_TIMEOUT": given}
        out = subprocess.run([sys.executable, "-c", code], env={**env, **extra},
                             capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == expect, out.stderr


def test_small_products_run_on_one_blas_thread():
    from threadpoolctl import threadpool_info

    def blas_threads():
        return {lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}

    before = blas_threads()
    with cpu.one_blas_thread(128, 128, 32, np.zeros(1)):
        assert blas_threads() == {1}  # a small product: one thread
    assert blas_threads() == before  # and back
    with cpu.one_blas_thread(1024, 1024, 64, np.zeros(1)):
        assert blas_threads() == before  # a large one keeps every thread
    with cpu.one_blas_thread(128, 128, 32, np.ma.zeros(1)):  # not NumPy's own array (CuPy)
        assert blas_threads() == before


def test_a_bad_thread_count_is_refused_with_one_message():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "refmp", "bench", "--preset", "tiny", "--steps", "1"],
                         env={**os.environ, "REFMP_THREADS": "two"}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    assert "REFMP_THREADS must be a whole number of threads >= 1, got 'two'" in out.stderr
    assert out.stderr.count("error:") == 1 and "Traceback" not in out.stderr
