"""Run by test_watchdog.py under `mpiexec -n 2`: the two ranks all-reduce different sizes.

MPICH completes rank 0's all-reduce and leaves rank 1's waiting; rank 0 then waits in a
barrier rank 1 never reaches. The watchdog (timeout 2 s) reports both ranks' calls.
"""

import numpy as np
from mpi4py import MPI

from refmp.distributed.grid import ProcessGrid
from refmp.distributed.watchdog import Watchdog

grid = ProcessGrid()
Watchdog(MPI.COMM_WORLD, grid.recorder, 2.0, None).start()
grid.world.allreduce(np.zeros(4 if grid.rank == 0 else 1000))  # the mismatch
grid.world.barrier()
print("not reached", flush=True)
