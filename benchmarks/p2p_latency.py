"""How long refmp's Comm.recv takes for a message that is already waiting (a pipeline hop).

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/p2p_latency.py [--kib 128] [--trials 60]

Rank 1 starts sending and then computes (it stays out of MPI, as a pipeline stage does
between actions); rank 0 calls ``Comm.recv`` once the message has been waiting for 5 ms and
times the call. The default size is one micro-batch's activation of the `small` preset at
8 micro-batches (1 x 128 x 256 float32 = 128 KiB). Prints the median and the slowest, in
microseconds, as JSON. Run it from two checkouts to compare their receive paths.

``--burst N``: rank 1 sends N messages at once, and rank 0, after 5 ms of compute, receives
them one after another: the first receive against the median of the others (``burst_first_us``,
``burst_rest_us``), what is a fixed cost of the first MPI call after compute and what the
message itself costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from mpi4py import MPI

from refmp.distributed.comm import Comm
from refmp.distributed.waiting import wait


def busy(seconds: float) -> None:
    """Compute (outside MPI) for ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kib", type=int, default=128, help="message size in KiB (128)")
    ap.add_argument("--trials", type=int, default=60, help="messages timed (60)")
    ap.add_argument("--burst", type=int, default=0,
                    help="also time N waiting messages received back to back (0: no)")
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    if world.size != 2:
        raise SystemExit("run under mpiexec -n 2")
    comm = Comm(world, "pp")
    x = np.ones(args.kib * 256, dtype=np.float32)
    times = []
    for trial in range(args.trials):
        world.Barrier()
        if world.rank == 1:
            req = comm.send(x, dest=0, tag=trial)
            busy(0.010)
            wait(req)
        else:
            busy(0.005)  # the message is posted meanwhile
            t0 = time.perf_counter()
            comm.recv(x.shape, x.dtype, source=1, tag=trial)
            times.append(time.perf_counter() - t0)
    out = {}
    if world.rank == 0:
        us = [1e6 * t for t in times[5:]]  # the first few warm MPI up
        out = {"kib": args.kib, "trials": len(us), "median_us": round(statistics.median(us)),
               "max_us": round(max(us))}
    if args.burst:
        world.Barrier()
        if world.rank == 1:
            for req in [comm.send(x, dest=0, tag=10**6 + i) for i in range(args.burst)]:
                wait(req)
        else:
            busy(0.005)
            burst = []
            for i in range(args.burst):
                t0 = time.perf_counter()
                comm.recv(x.shape, x.dtype, source=1, tag=10**6 + i)
                burst.append(1e6 * (time.perf_counter() - t0))
            out.update(burst_first_us=round(burst[0]),
                       burst_rest_us=round(statistics.median(burst[1:])))
    if world.rank == 0:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
