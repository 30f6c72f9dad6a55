"""What mpiexec starts for each rank of ``refmp cluster --rank-memory``: a few lines that put
this process into its rank's memory cgroup, then become the program (exec: the same process,
so every page the program touches is charged to the rank's cgroup).

    python -m refmp.runtime.rank_launch /sys/fs/cgroup/memory/refmp-ID -- PROGRAM ARGS...

The rank comes from the process manager's environment (Hydra's ``PMI_RANK``; PMIx's and Open
MPI's names too); the rank's cgroup is ``DIR/rank<r>`` (refmp.runtime.cgroup.RankGroups), and
the program finds it in ``REFMP_RANK_CGROUP``. Imports nothing heavy: it runs before each rank.
"""

from __future__ import annotations

import os
import sys

RANK_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m refmp.runtime.rank_launch CGROUP_DIR -- PROGRAM...",
              file=sys.stderr)
        return 2
    folder, program = argv[0], argv[2:]
    rank = next((os.environ[v] for v in RANK_VARS if v in os.environ), None)
    if rank is None:
        print(f"refmp rank_launch: no rank in the environment ({', '.join(RANK_VARS)}): run "
              f"it under mpiexec", file=sys.stderr)
        return 2
    mine = os.path.join(folder, f"rank{int(rank)}")
    try:
        with open(os.path.join(mine, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    except OSError as e:
        print(f"refmp rank_launch: rank {rank} cannot enter its memory cgroup {mine}: "
              f"{e.strerror or e}", file=sys.stderr)
        return 2
    os.environ["REFMP_RANK_CGROUP"] = mine  # refmp.runtime.cgroup.ENV
    try:
        os.execvp(program[0], program)
    except OSError as e:
        print(f"refmp rank_launch: cannot run {program[0]}: {e.strerror or e}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
