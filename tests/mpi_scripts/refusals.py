"""Many command lines that refmp must refuse, in one launch: ``refusals.py CASES.json OUT_DIR``
(tests/mpi_helpers.refused runs it under mpiexec and the watchdog).

CASES.json maps a case's name to its argv (what follows ``refmp``). Every rank runs each case
through refmp.cli.main.main, as ``python -m refmp ARGV`` would, with its stdout and stderr
captured (argparse's usage errors included), and writes, per case, its exit status, its output
and its seconds to OUT_DIR/rank-R.json. A refusal ends before any work, so the cases can
follow one another in one process: Python, NumPy and MPI start once, not once per case. A
barrier after each case keeps the ranks on the same case: a case one rank refuses while
another goes on waits there, and the watchdog ends the launch, naming the rank.
"""

import contextlib
import io
import json
import os
import sys
import time

from mpi4py import MPI

from refmp.cli.main import main
from refmp.distributed.comm import Comm

cases_file, out_dir = sys.argv[1:]
with open(cases_file) as f:
    cases = json.load(f)
world = Comm(MPI.COMM_WORLD)  # its barrier is in the watchdog's flight recorder
results = {}
for name, argv in cases.items():
    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as e:  # argparse's usage errors, --help
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    seconds = time.perf_counter() - t0
    results[name] = {"status": status, "stdout": out.getvalue(), "stderr": err.getvalue(),
                     "seconds": seconds}
    world.barrier()
with open(os.path.join(out_dir, f"rank-{MPI.COMM_WORLD.rank}.json"), "w") as f:
    json.dump(results, f)
