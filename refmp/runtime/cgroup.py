"""A rank with a memory size: a kernel memory cgroup around its process (root only), and what
a process measures of its own memory.

The kernel's memory controller, either version (the first found):
  v1  mounted at /sys/fs/cgroup/memory: ``memory.limit_in_bytes``, ``memory.max_usage_in_bytes``
      (the peak), ``memory.oom_control``'s ``oom_kill`` (kills so far), ``cgroup.procs``;
  v2  the unified hierarchy at /sys/fs/cgroup with the ``memory`` controller: ``memory.max``,
      ``memory.peak``, ``memory.events``' ``oom_kill``, ``cgroup.procs``.
A process written into ``cgroup.procs`` has every page it touches from then on charged to
that cgroup; past the limit the kernel reclaims what it can, then kills the process (SIGKILL:
mpiexec sees signal 9). :class:`RankGroups` makes one cgroup a rank under
``refmp-<id>`` at the hierarchy's root (``refmp cluster --rank-memory``, refmp.cli.netns);
refmp.runtime.rank_launch puts a rank into its own and names it in ``REFMP_RANK_CGROUP``,
which :func:`rank_limit` and :func:`peak` read; :func:`headroom` reads the root's limit (a
container's), what refmp.training.checks.available_memory caps a node's free memory with.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import signal
import time
from dataclasses import dataclass
from pathlib import Path

V1 = "/sys/fs/cgroup/memory"
V2 = "/sys/fs/cgroup"
PREFIX = "refmp-"  # a cluster's cgroups: refmp-<id>/rank<r>
ENV = "REFMP_RANK_CGROUP"  # the rank's own cgroup directory (refmp.runtime.rank_launch)
# multipliers of a size's unit, lower case: k, m, g, t alone are binary (as the kernel's
# memory.limit_in_bytes and Docker read them), kB, MB, GB, TB decimal, KiB ... TiB binary
UNITS = {"": 1, "b": 1, **{p: 1024 ** (i + 1) for i, p in enumerate("kmgt")},
         **{p + "ib": 1024 ** (i + 1) for i, p in enumerate("kmgt")},
         **{p + "b": 1000 ** (i + 1) for i, p in enumerate("kmgt")}}


def parse_size(text: str) -> int:
    """Bytes of a size such as ``4GiB``, ``512MiB``, ``1.5G``, ``4GB`` or ``1000000``
    (``UNITS``); a ValueError that says why for anything else, zero or negative."""
    m = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if m is None or m.group(2) not in UNITS:
        raise ValueError(f"{text!r} is not a size: a number and a unit, e.g. 4GiB, 512MiB, "
                         f"1.5G (binary), 4GB (decimal) or a count of bytes")
    n = int(float(m.group(1)) * UNITS[m.group(2)])
    if n <= 0:
        raise ValueError(f"{text!r}: a memory size must be positive")
    return n


def gib(n: int) -> str:
    """Bytes in binary units, as limits are given: 4 GiB, 512 MiB."""
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k:
            return f"{n / (1 << k):.4g} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class Controller:
    """Where the memory controller is mounted, and the names of its files in that version."""
    version: int
    root: str

    @property
    def limit(self) -> str:
        return "memory.limit_in_bytes" if self.version == 1 else "memory.max"

    @property
    def usage(self) -> str:
        return "memory.usage_in_bytes" if self.version == 1 else "memory.current"

    @property
    def peak(self) -> str:
        return "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"

    @property
    def events(self) -> str:  # the file whose oom_kill line counts the kills
        return "memory.oom_control" if self.version == 1 else "memory.events"

    def mount(self) -> list[str]:
        """Shell commands that show this hierarchy at ``root`` in a new mount namespace whose
        /sys was made afresh (``ip netns exec`` mounts a sysfs of the namespace: no cgroups)."""
        if self.version == 2:
            return [f"mount -t cgroup2 refmp-cgroup {V2}"]
        return [f"mount -t tmpfs -o mode=755 refmp-cgroup {V2}", f"mkdir -p {V1}",
                f"mount -t cgroup -o memory refmp-cgroup {V1}"]


def controller() -> Controller | None:
    """The memory controller of this machine (v1 first), None without one."""
    if os.path.exists(os.path.join(V1, "memory.limit_in_bytes")):
        return Controller(1, V1)
    with contextlib.suppress(OSError):
        if "memory" in Path(V2, "cgroup.controllers").read_text().split():
            return Controller(2, V2)
    return None


def unavailable() -> str | None:
    """Why ranks cannot be given a memory size here (None: they can): root, a memory
    controller, and a limited cgroup made and removed there."""
    if os.geteuid() != 0:
        return "a memory cgroup per rank needs root"
    ctl = controller()
    if ctl is None:
        return (f"no kernel memory controller: neither {V1} (cgroup v1) nor the memory "
                f"controller in {V2}/cgroup.controllers (cgroup v2)")
    probe = RankGroups(f"probe-{os.getpid()}", 1, 1 << 30, ctl)
    try:
        probe.make()
    except OSError as e:
        return f"cannot make a memory cgroup in {ctl.root}: {e.strerror or e}"
    finally:
        with contextlib.suppress(OSError):
            probe.remove()
    return None


def machine_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _read_int(path: str) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(Path(path).read_text().strip())
    return None  # no such file, or v2's "max"


def limit(folder: str, ctl: Controller) -> int | None:
    """Bytes of the memory limit of the cgroup at ``folder`` (``ctl``'s file:
    memory.limit_in_bytes or memory.max); None without that file or without a limit (v2's
    "max"). The one reader of a limit: a rank's own (rank_limit, peak) and the hierarchy's
    root (headroom)."""
    return _read_int(os.path.join(folder, ctl.limit))


def headroom() -> int | None:
    """Bytes left under the memory limit of the hierarchy's root cgroup (a container's own,
    under a cgroup namespace): its limit less its usage, the smaller of v2's and v1's where
    both are there; None where neither has a limit."""
    rooms = []
    for ctl in (Controller(2, V2), Controller(1, V1)):
        cap, used = limit(ctl.root, ctl), _read_int(os.path.join(ctl.root, ctl.usage))
        if cap is not None and used is not None:
            rooms.append(cap - used)
    return min(rooms, default=None)


def _oom_kills(path: str) -> int:
    with contextlib.suppress(OSError):
        for line in Path(path).read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    return 0


class RankGroups:
    """One cgroup a rank, ``refmp-<ident>/rank<r>`` at the hierarchy's root, each limited to
    ``limit`` bytes (swap included where the kernel accounts it). ``make`` creates them,
    ``remove`` ends what runs in them and removes them (also a killed run's, by path)."""

    def __init__(self, ident: str, ranks: int, limit: int, ctl: Controller | None = None):
        self.ctl = ctl or controller()
        self.dir = os.path.join(self.ctl.root, f"{PREFIX}{ident}")
        self.ranks = ranks
        self.limit = limit

    def path(self, rank: int) -> str:
        return os.path.join(self.dir, f"rank{rank}")

    def make(self) -> None:
        os.mkdir(self.dir)
        if self.ctl.version == 2:  # the children get the controller (the root's own first)
            for d in (self.ctl.root, self.dir):
                Path(d, "cgroup.subtree_control").write_text("+memory")
        for r in range(self.ranks):
            os.mkdir(self.path(r))
            Path(self.path(r), self.ctl.limit).write_text(str(self.limit))
            swap = "memory.memsw.limit_in_bytes" if self.ctl.version == 1 else "memory.swap.max"
            if os.path.exists(os.path.join(self.path(r), swap)):  # no escape into swap
                Path(self.path(r), swap).write_text(str(self.limit if self.ctl.version == 1
                                                        else 0))

    def peak(self, rank: int) -> int | None:
        return _read_int(os.path.join(self.path(rank), self.ctl.peak))

    def oom_kills(self, rank: int) -> int:
        return _oom_kills(os.path.join(self.path(rank), self.ctl.events))

    def remove(self) -> None:
        """End the processes left in the rank cgroups (a killed run's), remove them."""
        remove_tree(self.dir)


def remove_tree(folder: str) -> None:
    """Remove a cgroup directory and the cgroups under it, first ending their processes
    (SIGKILL: these are ranks of a run that is over). Silent when it is gone already."""
    if not os.path.isdir(folder):
        return
    children = [os.path.join(folder, d) for d in os.listdir(folder)
                if os.path.isdir(os.path.join(folder, d))]
    for child in children:
        remove_tree(child)
    deadline = time.time() + 5.0
    while True:
        procs = Path(folder, "cgroup.procs").read_text().split()
        for pid in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        try:
            os.rmdir(folder)
            return
        except OSError:  # busy until the killed processes are gone
            if time.time() > deadline:
                raise
            time.sleep(0.05)


# --- what a rank measures of itself ------------------------------------------------------------


def rank_cgroup() -> str | None:
    """This process's own cgroup (refmp.runtime.rank_launch's), None outside one."""
    folder = os.environ.get(ENV)
    return folder if folder and os.path.isdir(folder) else None


def rank_limit() -> tuple[int, str] | None:
    """(bytes, cgroup directory) of this rank's memory limit; None without one."""
    folder, ctl = rank_cgroup(), controller()
    if folder is None or ctl is None:
        return None
    cap = limit(folder, ctl)
    return None if cap is None else (cap, folder)


def resident() -> int:
    """Bytes resident in this process now (/proc/self/statm's second field)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak() -> dict[str, int | None]:
    """This process's measured peaks: ``rss``, its peak resident memory
    (getrusage(RUSAGE_SELF).ru_maxrss, KiB on Linux); under a rank cgroup ``cgroup``, the
    cgroup's peak usage (memory.max_usage_in_bytes / memory.peak: the page cache of the files
    it wrote and read too) and ``limit``; else None for both."""
    out = {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "cgroup": None, "limit": None}
    folder, ctl = rank_cgroup(), controller()
    if folder is not None and ctl is not None:
        out["cgroup"] = _read_int(os.path.join(folder, ctl.peak))
        out["limit"] = limit(folder, ctl)
    return out
