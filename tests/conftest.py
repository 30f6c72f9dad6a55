"""Test set-up shared by every test file.

* One BLAS/OpenMP thread per process: MPI tests run several ranks on few cores.
* The hypothesis profile for MPI: every rank must draw the same examples,
  so the profile is derandomized, keeps no example database and has no deadline. It is
  loaded explicitly here, for serial and parallel tests alike.
* The parallel tests of a file that want the same number of ranks run in one mpiexec
  launch, each test watched by refmp's watchdog (tests/mpi_batch.py: its hooks, imported
  here, are this conftest's).
* One cache of compiled modules for every process the suite starts: the suite starts
  hundreds of Python processes (mpiexec's ranks), and each would otherwise compile refmp's
  modules from source again wherever PYTHONDONTWRITEBYTECODE is set (a tenth of a second
  of CPU each). The first pytest makes a temporary directory, points PYTHONPYCACHEPREFIX at
  it for the processes it starts (so nothing is written into the source tree) and removes
  it at the end.
"""

import atexit
import os
import shutil
import tempfile

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

if "PYTHONPYCACHEPREFIX" not in os.environ:  # the first pytest: its processes inherit it
    os.environ["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="refmp-tests-pycache-")
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    atexit.register(shutil.rmtree, os.environ["PYTHONPYCACHEPREFIX"], True)

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "mpi",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=10,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("mpi")

from mpi_batch import (  # noqa: E402, F401  (pytest finds hooks by name in a conftest)
    pytest_collection_finish,
    pytest_pyfunc_call,
    pytest_runtest_logreport,
    pytest_runtest_logstart,
    pytest_runtest_protocol,
    pytest_timeout_cancel_timer,
    pytest_timeout_set_timer,
)
