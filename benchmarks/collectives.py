"""Time refmp's collectives (refmp.distributed.comm.Comm) and fit the alpha-beta model to them.

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/collectives.py [--max-mib 16] [--reps 20]
        [--json docs/data/collectives.json]

For each operation and message size (from 8 bytes to --max-mib, by factors of 16) every rank
calls the operation --reps times after a barrier; the median time of rank 0 is kept. Then one
latency alpha and one inverse bandwidth beta are fitted, by least squares over every
operation and size, to the ring model

    time = steps * alpha + wire * beta,

where ``steps`` is the number of sequential message rounds of a ring algorithm (2 (n-1) for
an all-reduce, n-1 for a reduce-scatter, all-gather or all-to-all, 1 for a send) and
``wire`` the bytes each rank sends (2 (n-1)/n of the buffer for an all-reduce, (n-1)/n for
the others, all of it for a send). Prints, as Markdown, the measured and modelled times and
the fitted alpha and bandwidth (docs/collectives.md); ``--json PATH`` also writes them as
{"ranks", "alpha_s", "beta_s_per_byte", "rows": [[op, bytes, seconds], ...]}, which the site
draws beside the model's lines (docs/_hooks/measured.py).
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


def ring(op: str, n: int, nbytes: int) -> tuple[int, float]:
    """(message rounds, bytes each rank sends) of a ring algorithm on ``nbytes`` ledger bytes."""
    if op == "send":
        return 1, float(nbytes)
    k = 2 if op == "allreduce" else 1
    return k * (n - 1), k * (n - 1) / n * nbytes


def run(comm: Comm, op: str, x: np.ndarray):
    """One call of ``op`` on ``x`` (the ledger's bytes: x itself, or the gathered result)."""
    if op == "allreduce":
        comm.allreduce(x)
    elif op == "reduce_scatter":
        comm.reduce_scatter(x)
    elif op == "allgather":
        comm.allgather(x[: x.size // comm.size])
    elif op == "alltoall":
        comm.alltoall(x)
    elif comm.rank == 0:  # send: a round trip between ranks 0 and 1, timed as two sends
        wait(comm.send(x, 1))
        comm.recv(x.shape, x.dtype, 1)
    elif comm.rank == 1:
        wait(comm.send(comm.recv(x.shape, x.dtype, 0), 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-mib", type=float, default=16, help="largest message, MiB (16)")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per size (20)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the rows and the fit")
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    comm, n = Comm(world), world.size
    if n < 2:
        raise SystemExit("run under mpiexec -n 2 (or more)")
    sizes = [8 * n * 16**i for i in range(10) if 8 * n * 16**i <= args.max_mib * 2**20]
    rows = []  # (op, bytes, seconds)
    for op in ("allreduce", "reduce_scatter", "allgather", "alltoall", "send"):
        for nbytes in sizes:
            x = np.ones(nbytes // 8, dtype=np.float64)
            run(comm, op, x)  # warm-up
            times = []
            for _ in range(args.reps):
                world.Barrier()
                t0 = time.perf_counter()
                run(comm, op, x)
                times.append(time.perf_counter() - t0)
            t = statistics.median(times) / (2 if op == "send" else 1)  # send: half a round trip
            rows.append((op, nbytes, t))
    if world.rank != 0:
        return
    a = np.array([ring(op, n, b) for op, b, _ in rows])  # (rows, 2) steps, wire bytes
    t = np.array([s for _, _, s in rows])
    # least squares on relative error: every size weighs the same, small or large
    (alpha, beta), *_ = np.linalg.lstsq(a / t[:, None], np.ones_like(t), rcond=None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": n, "alpha_s": float(alpha), "beta_s_per_byte": float(beta),
                       "rows": [[op, b, s] for op, b, s in rows]}, f, indent=0)
    print(f"{n} ranks; fitted alpha = {alpha * 1e6:.1f} us, bandwidth 1/beta = "
          f"{1 / beta / 1e9:.2f} GB/s\n")
    print("| operation | bytes (ledger) | measured us | alpha-beta model us |")
    print("| --- | ---: | ---: | ---: |")
    for (op, nbytes, sec), (steps, wire) in zip(rows, a, strict=True):
        print(f"| {op} | {nbytes:,} | {sec * 1e6:,.1f} | {(steps * alpha + wire * beta) * 1e6:,.1f} |")


if __name__ == "__main__":
    main()
