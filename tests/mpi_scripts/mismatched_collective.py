"""Run by test_watchdog.py under `mpiexec -n 2`: the two ranks make mismatched collectives.

``sizes``: they all-reduce different sizes. MPICH completes rank 0's all-reduce and leaves
rank 1's waiting; rank 0 then waits in a barrier rank 1 never reaches, and the watchdog
(timeout 2 s) reports both ranks' calls. ``ops`` (run with REFMP_CHECK_CALLS=1): an
all-reduce against an all-gather of as many bytes, which MPICH completes with wrong values;
the check refuses it on both ranks first.
"""

import sys

import numpy as np
from mpi4py import MPI

from refmp.distributed.grid import ProcessGrid
from refmp.distributed.watchdog import Watchdog

grid = ProcessGrid()
Watchdog(MPI.COMM_WORLD, grid.recorder, 2.0, None).start()
if sys.argv[1] == "sizes":
    grid.world.allreduce(np.zeros(4 if grid.rank == 0 else 1000))
elif grid.rank == 0:
    grid.world.allreduce(np.zeros(4))
else:
    grid.world.allgather(np.zeros(2))
grid.world.barrier()
print("not reached", flush=True)
