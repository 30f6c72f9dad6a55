"""Measuring this host for ``refmp plan --machine cpu`` and ``refmp train --layout auto``:
NumPy's rates as refmp's step uses them (calibrate), MPI's links (measure_links), one set of
rates for ranks that measured beside each other (slowest), and the machine they make
(cpu_machine). What each rate is and how the plan does with it: docs/plan_checks.md.
"""

from __future__ import annotations

import contextlib
import time
from functools import partial

import numpy as np

from refmp.cost.machines import Machine
from refmp.cost.model import Layout
from refmp.cost.terms import elementwise_bytes, gemm, numpy_calls
from refmp.nn import gpt
from refmp.nn.params import GPTConfig, init_params
from refmp.runtime import cpu
from refmp.training.checks import available_memory
from refmp.training.optim import AdamW


def cpu_machine(ranks: int, links: tuple[float, float] | None = None,
                calib: dict | None = None) -> Machine:
    """This host: NumPy's rates (calibrate: the GEMM peak and its short-product rows, the
    elementwise bandwidth, an operation's time, AdamW's rate), memory free now, and MPI's links:
    ``links`` (GB/s, us) as measure_links found them, else shared-memory MPI taken as 5 GB/s
    and 2 us (assumed: ``refmp plan`` runs without MPI).

    ``calib``: calibrate's dict as a rank of the run measured it, beside the other ranks
    (benchmarks/plan_vs_bench.py); else measured now in this process (BLAS on one thread
    where a rank would have at most one core; the block's rows in refmp.runtime.cpu.threads()
    threads), and a rank gets its share of the cores, cores / ranks of them (under mpiexec
    refmp gives each rank that many threads, at least one: 4 ranks on 2 cores get half a
    core each, and an operation's Python, on one thread, takes twice as long).
    """
    cores = cpu.cores()
    if calib is None:  # this process's rates: a rank of a run gets cores / ranks of them
        one = cores // ranks <= 1  # its BLAS on one thread, as such a rank runs it
        with cpu.one_blas_thread(1, 1, 1) if one else contextlib.nullcontext():
            calib = calibrate()
        t = max(1, min(cpu.threads(), cores))  # the block's rows ran in t threads
        share = {"gflops": 1 if one else t, "gbs": t, "stream_gbs": t}
        calib = {**calib, **{k: calib[k] * cores / ranks / d for k, d in share.items()},
                 "call_us": calib["call_us"] * max(1.0, ranks / cores)}
    free = available_memory("cpu")[0] / 1e9
    gbs, us = links or (5.0, 2.0)
    return Machine("cpu", ranks, free / ranks, calib["gflops"] / 1e3, calib["gbs"], 1.0, gbs,
                   gbs, us, us, time_shared=ranks > cores, call_us=calib["call_us"],
                   gemm_short=tuple(calib["short"]), stream_gbs=calib["stream_gbs"],
                   overlaps_p2p=False)


def _mean_seconds(fn, seconds: float, sync=None) -> float:
    """fn's mean seconds over as many calls as fill ``seconds`` (after one warm-up): a mean,
    not a best, so that a shared machine's waits count as they do in a step. ``sync``: a
    communicator whose ranks all time the same function, starting together."""
    fn()
    if sync is not None:
        sync.Barrier()
    n, t0 = 0, time.perf_counter()
    while (t := time.perf_counter() - t0) < seconds or n < 3:
        fn()
        n += 1
    return t / n


# the products calibrate times, (m, k, n): a linear's of 1024 and 128 rows, and attention's
# q k^T (k short) and att v (n short) of 2 rows, 8 heads 32 wide, on refmp's strided views
SHAPES = ((1024, 256, 1024), (128, 256, 1024), (128, 32, 128), (128, 128, 32))


def calibrate(seconds: float = 0.1, sync=None) -> dict:
    """NumPy's rates in this process, as refmp's step uses them (float32):
    ``gflops``, the large product's rate (the peak), and ``short`` (hm, hk, hn) from
    t = 2 m k n / peak (1 + hm/m + hk/k + hn/n) on the others, a side at a time (SHAPES);
    ``gbs``: elementwise_bytes of refmp's own block (4 rows of 128 tokens, C 256, 8 heads),
    forward and backward, over its seconds less its products' (at those rates: the block's
    time is the model's, and the layouts' differences are the model's to predict);
    ``stream_gbs``: refmp's AdamW step (refmp.training.optim) on 1M weights, as the 32 bytes
    a weight of the plan's optimizer term (its thirteen passes, a weight without decay, move
    about four times that);
    ``call_us``: one NumPy operation as refmp's block runs it, the Python around it included:
    the block forward and backward at a shape whose arithmetic vanishes (1 row of 8 tokens,
    C 16, 2 heads), over the operations numpy_calls counts in it but the accumulations. The
    block's seconds above less its products' and these calls' are the elementwise bytes'
    (each term once).
    ``sync``: a communicator over ranks that calibrate beside each other (a run's): each
    measurement starts on all of them at once, so that every rank times each function while
    the others run the same one, as a step's ranks compute side by side."""
    rng = np.random.default_rng(0)
    y = []
    qkv = rng.standard_normal((2, 128, 3, 8, 32), np.float32)
    q, k, v = qkv.transpose(2, 0, 3, 1, 4)  # (2, 8, 128, 32) each, as attention_forward's
    att = rng.standard_normal((2, 8, 128, 128), np.float32)
    pairs = [(rng.standard_normal((m, 256), np.float32), rng.standard_normal((256, 1024),
              np.float32)) for m in (1024, 128)] + [(q, k.transpose(0, 1, 3, 2)), (att, v)]
    def product(a, b, out):  # attention's as refmp runs them: rows in threads, BLAS on one
        with cpu.one_blas_thread(*out.shape[-2:], a.shape[-1], a):
            cpu.rows(lambda a, b, out: np.matmul(a, b, out=out), a, b, out)

    for i, ((m, k, n), (a, b)) in enumerate(zip(SHAPES, pairs, strict=True)):
        out = np.empty(a.shape[:-1] + b.shape[-1:], np.float32)
        run = partial(product, a, b, out) if i > 1 else partial(np.matmul, a, b, out=out)
        y.append(_mean_seconds(run, seconds, sync) / (2 * m * k * n * a.size // (m * k)))
    inv, m = y[0], SHAPES[1][0]  # the large product's rate is the peak; a side at a time:
    hm = max(0.0, (y[1] / inv - 1) * m)  # rows, then q k^T's k and att v's n
    short = [hm] + [max(0.0, (t / inv - 1 - hm / m) * 32) for t in y[2:]]
    b, T, C, NH = 4, 128, 256, 8  # a block of refmp bench's small preset, 4 rows
    p = {k[4:]: v for k, v in init_params(GPTConfig(32, T, 1, NH, C), 0).items() if "h.0." in k}
    x = rng.standard_normal((b, T, C), np.float32)

    def block():  # refmp's own block, forward and backward (refmp.nn.gpt)
        y, cache = gpt.block_forward(p, x, gpt.Ops(NH))
        gpt.block_backward(y, cache, gpt.Ops(NH))

    mach = Machine("fit", 1, 1, 1e-12 / inv, 1e9, 1.0, 1, 1, gemm_short=tuple(short))  # TFLOP/s
    gemms = 3 * (gemm(b * T, C, 3 * C, mach, 4) + gemm(b * T, C, C, mach, 4)  # the linears
                 + 2 * gemm(b * T, C, 4 * C, mach, 4) + 2 * gemm(T, C // NH, T, mach, 4, b * NH))
    gemms += gemm(T, C // NH, T, mach, 4, b * NH)  # q k^T again in the backward (refmp.nn.flash)
    tiny = {k[4:]: v for k, v in init_params(GPTConfig(32, 8, 1, 2, 16), 0).items() if "h.0." in k}
    xt = rng.standard_normal((1, 8, 16), np.float32)

    def tiny_block():
        y, cache = gpt.block_forward(tiny, xt, gpt.Ops(2))
        gpt.block_backward(y, cache, gpt.Ops(2))

    # numpy_calls counts one accumulation a parameter too, which the block leaves to its caller
    ops = numpy_calls(Layout()) - len(tiny)
    call = _mean_seconds(tiny_block, seconds, sync) / ops
    rest = max(_mean_seconds(block, 3 * seconds, sync) - gemms - ops * call, 0.1 * gemms)
    n = 1 << 20
    weights = {"w": rng.standard_normal(n, np.float32)}
    grads = {"w": rng.standard_normal(n, np.float32)}
    adamw = AdamW(weights, lr=1e-6)
    stream = _mean_seconds(lambda: adamw.step(grads), seconds, sync)
    return {"gflops": float(1e-9 / inv), "short": short,
            "gbs": elementwise_bytes(b, T, T, C, NH, 1, False, "none", False, 4,
                                     rescored=True) / rest / 1e9,
            "stream_gbs": 32 * n / stream / 1e9, "call_us": 1e6 * call}


def slowest(calibs: list[dict]) -> dict:
    """One set of rates for ranks that calibrated beside each other: each rate the slowest
    rank's (the least GFLOP/s, elementwise and optimizer GB/s, the most microseconds an
    operation), and each short side the ranks' median. A short side is a ratio of one rank's
    own timings, one after another: it comes out low on a rank whose large product ran in a
    busier moment than its short ones, which is the rank whose peak came out least."""
    short = np.median([c["short"] for c in calibs], axis=0)
    return {"gflops": min(c["gflops"] for c in calibs), "short": [float(h) for h in short],
            "gbs": min(c["gbs"] for c in calibs),
            "stream_gbs": min(c["stream_gbs"] for c in calibs),
            "call_us": max(c["call_us"] for c in calibs)}


def measure_links(comm, nbytes: int = 1 << 22, reps: int = 5, sync=None) -> tuple[float, float]:
    """(GB/s, us) of ``comm``'s (an mpi4py communicator) links as collective() models them
    (collective: every rank calls it): an 8-byte all-reduce takes 2 (n-1) latencies, an
    nbytes one 2 (n-1)/n nbytes / bw more; medians of reps, the slowest rank's. Timed through
    refmp.distributed.comm.Comm, which waits the way training does (Test and sleep: with more
    ranks than cores, a wait includes being scheduled again). ``sync``: a communicator over
    every rank that measures at once (default ``comm``), whose barrier starts each repetition
    and whose slowest rank's median counts: groups that share a link start together, as a
    step's collectives do, so a group that finishes first leaves the link to the others
    instead of starting its next repetition beside them."""
    from mpi4py import MPI

    from refmp.distributed.comm import Comm

    n = comm.Get_size()
    if n == 1:
        return 5.0, 2.0
    ours, sync = Comm(comm), sync or comm

    def seconds(a) -> float:
        times = []
        for _ in range(reps + 1):  # the first is a warm-up
            sync.Barrier()
            t0 = time.perf_counter()
            ours.allreduce(a)
            times.append(time.perf_counter() - t0)
        return sync.allreduce(float(np.median(times[1:])), op=MPI.MAX)

    small, big = seconds(np.zeros(1)), seconds(np.zeros(nbytes // 8))
    lat = small / (2 * (n - 1))
    bw = 2 * (n - 1) / n * nbytes / max(big - small, 1e-9)
    return bw / 1e9, lat * 1e6
