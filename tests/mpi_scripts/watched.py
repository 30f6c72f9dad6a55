"""Run a Python program under refmp's watchdog: ``watched.py SECONDS program.py ARGS...`` or
``watched.py SECONDS -m module ARGS...``, under mpiexec (tests/mpi_helpers.mpiexec runs every
program of more than one rank this way).

Every grid the program makes records into one flight recorder (refmp.distributed.recorder
.install), which the watchdog reads: a rank without progress for SECONDS ends the job with
the watchdog's report on stderr (which rank has not entered which call) and status 5, instead
of the test's timeout ending it with nothing said. The program runs as ``python program.py``
or ``python -m module`` would run it (its sys.argv and sys.path[0]).
"""

import os
import runpy
import sys

from mpi4py import MPI

from refmp.distributed import recorder
from refmp.distributed.watchdog import Watchdog

seconds, target, *args = sys.argv[1:]
rec = recorder.Recorder()
recorder.install(rec)
watchdog = Watchdog(MPI.COMM_WORLD, rec, float(seconds), None).start()
try:
    if target == "-m":
        sys.argv, sys.path[0] = [args[0], *args[1:]], os.getcwd()
        runpy.run_module(args[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv, sys.path[0] = [target, *args], os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")
finally:
    watchdog.stop()  # rank 0 removes the side channel's temporary directory
