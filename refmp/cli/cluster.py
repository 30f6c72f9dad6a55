"""``refmp cluster``: run an MPI program across nodes on one machine (root only): nodes made of
network namespaces on a bridge, their links shaped to ``--link-gbit`` (refmp.cli.netns),
``--ranks-per-node`` ranks on each; at the end, the bytes each node sent and received over
its link; and the teardown, always (also on failure and Ctrl-C).

    sudo refmp cluster --nodes 2 --ranks-per-node 2 --link-gbit 1 -- refmp train --dp 2 --tp 2

Ranks are placed in blocks, 0..G-1 on node0, G..2G-1 on node1, ...: with Megatron's rank
order (tp fastest), tp stays inside a node and dp goes between nodes (docs/nodes.md).
``--rank-memory 4GiB`` runs each rank inside a kernel memory cgroup of that size
(refmp.runtime.cgroup): a rank past it is killed by the kernel, and the job ends with a
message that names the rank and its limit.
``--launcher ssh`` starts an OpenSSH server in each node and launches over ssh, as on a real
cluster (refmp.cli.netns_ssh).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time

from refmp.errors import ConfigError

LAUNCHERS = ("netns", "ssh")  # refmp.cli.netns's bootstrap script; refmp.cli.netns_ssh

def add_parser(sub) -> None:
    p = sub.add_parser("cluster", help="run an MPI program across nodes made on this machine "
                                       "(root)",
                       description="Run PROGRAM under mpiexec across NODES nodes made of "
                                   "network namespaces on this machine (root only), their "
                                   "links shaped to --link-gbit; print the bytes each node "
                                   "sent over its link; always remove the nodes at the end.")
    p.add_argument("--nodes", type=int, default=2, help="nodes (2)")
    p.add_argument("--ranks-per-node", type=int, default=1, help="MPI ranks on each node (1)")
    p.add_argument("--link-gbit", type=float, default=None,
                   help="each node's link in Gbit/s, each way (default: not shaped)")
    p.add_argument("--share", action="append", default=[], metavar="DIR",
                   help="a directory under /tmp that every node sees (each node's /tmp is its "
                        "own; the rest of the file system is shared); repeatable")
    p.add_argument("--launcher", choices=LAUNCHERS, default="netns",
                   help="how mpiexec starts its proxies on the nodes: netns, a script that "
                        "enters a node's namespaces (Hydra's -bootstrap-exec; the default), "
                        "or ssh, an OpenSSH server in each node with throwaway keys (Hydra's "
                        "-launcher ssh, as on a real cluster; needs openssh-server)")
    p.add_argument("--rank-memory", default=None, metavar="SIZE",
                   help="each rank's memory, a hard limit the kernel enforces (a memory "
                        "cgroup a rank), e.g. 4GiB, 512MiB, 1.5G; default: none")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="write the nodes and their link counters to FILE")
    p.add_argument("--clean", action="store_true",
                   help="remove the clusters whose run was killed (their owner is gone), and exit")
    p.add_argument("program", nargs=argparse.REMAINDER,
                   help="-- then the program and its arguments, as mpiexec takes them")
    p.set_defaults(run=run_cluster)


def run_cluster(args: argparse.Namespace) -> int:
    from refmp.cli import netns

    if args.clean:
        ids = netns.clean()
        print(f"refmp cluster: removed {len(ids)} cluster(s) {' '.join(ids)}".rstrip())
        return 0
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        raise ConfigError("give the program to run after --, e.g. "
                          "`refmp cluster --nodes 2 -- refmp train --dp 2`")
    if args.nodes < 1 or args.ranks_per_node < 1:
        raise ConfigError(f"--nodes and --ranks-per-node must be at least 1, got "
                          f"{args.nodes} and {args.ranks_per_node}")
    if args.link_gbit is not None and not args.link_gbit > 0:
        raise ConfigError(f"--link-gbit must be positive, got {args.link_gbit}")
    for d in args.share:
        real = os.path.realpath(d)
        if not os.path.isdir(real) or not (real == "/tmp" or real.startswith("/tmp/")):
            raise ConfigError(f"--share {d}: not a directory under /tmp (outside /tmp every "
                              f"node already sees the host's files)")
    rank_memory = check_rank_memory(args.rank_memory, args.nodes * args.ranks_per_node)
    why = netns.unavailable()
    if why:
        raise ConfigError(f"cannot make a cluster here: {why}")
    if args.launcher == "ssh":
        from refmp.cli import netns_ssh

        why = netns_ssh.unavailable()
        if why:
            raise ConfigError(f"--launcher ssh: {why}")
    signal.signal(signal.SIGTERM, _interrupt)  # while the nodes are made or removed
    try:
        return _run(args, program, rank_memory)
    except KeyboardInterrupt:  # during set-up or teardown: the with block removed the nodes
        print("refmp cluster: interrupted; the nodes are removed", file=sys.stderr, flush=True)
        return 130


def check_rank_memory(text: str | None, ranks: int) -> int | None:
    """--rank-memory in bytes (None without it), or one ConfigError that says what is wrong:
    not a size, not positive, more than the machine has, or no memory cgroups here."""
    from refmp.runtime import cgroup

    if text is None:
        return None
    try:
        limit = cgroup.parse_size(text)
    except ValueError as e:
        raise ConfigError(f"--rank-memory {e}") from None
    machine = cgroup.machine_bytes()
    if limit > machine:
        raise ConfigError(f"--rank-memory {text} ({cgroup.gib(limit)}) is more than this "
                          f"machine's memory, {cgroup.gib(machine)}")
    why = cgroup.unavailable()
    if why:
        raise ConfigError(f"--rank-memory {text}: {why}")
    if limit * ranks > machine:  # a limit each, not a promise of memory: the ranks may fit
        print(f"refmp cluster: warning: {ranks} ranks of {cgroup.gib(limit)} are "
              f"{cgroup.gib(limit * ranks)}, more than this machine's {cgroup.gib(machine)}",
              file=sys.stderr, flush=True)
    return limit


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _run(args: argparse.Namespace, program: list[str], rank_memory: int | None) -> int:
    from refmp.cli import netns

    stop = _Stop()
    with netns.Cluster(args.nodes, args.link_gbit, tuple(args.share), rank_memory,
                       args.ranks_per_node) as c:
        link = f"{args.link_gbit:g} Gbit/s each way (tbf)" if args.link_gbit else "not shaped"
        print(f"refmp cluster {c.id}: {args.nodes} node(s) on bridge {c.bridge}, "
              f"{args.ranks_per_node} rank(s) each, links {link}: "
              + ", ".join(f"{n.hostname} {n.ip}" for n in c.nodes), flush=True)
        with _launcher(args.launcher, c) as launch:  # (over ssh: its servers stop here)
            cmd = launch.mpiexec(args.ranks_per_node, program)
            if args.launcher == "ssh":
                print(f"refmp cluster {c.id}: sshd on each node; {shlex.join(cmd)}", flush=True)
            status = stop.wait(subprocess.Popen(cmd))
        memory = None
        if c.groups is not None:  # each rank's peak, and which ranks the kernel killed
            memory, status = _rank_memory(c.groups, args.rank_memory, status)
        counters = c.counters()
        for host, k in counters.items():
            print(f"refmp cluster: {host} sent {k['sent']:,} B and received "
                  f"{k['received']:,} B over its link", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"id": c.id, "link_gbit": args.link_gbit,
                           "ranks_per_node": args.ranks_per_node,
                           "nodes": {n.hostname: {"ip": n.ip, **counters[n.hostname]}
                                     for n in c.nodes}, "status": status,
                           "rank_memory": memory}, f, indent=1)
    return status


def _rank_memory(groups, given: str, status: int) -> tuple[dict, int]:
    """Print each rank's peak against its limit and name the ranks the kernel killed at
    their limit (mpiexec saw signal 9 and ended the job); their record for --json, and the
    status (never 0 when a rank was killed)."""
    from refmp.runtime.cgroup import gib

    peaks = [groups.peak(r) for r in range(groups.ranks)]
    kills = [groups.oom_kills(r) for r in range(groups.ranks)]
    print(f"refmp cluster: peak memory per rank (kernel cgroup, limit {gib(groups.limit)}): "
          + ", ".join(f"rank {r} {gib(p) if p is not None else '?'}"
                      for r, p in enumerate(peaks)), flush=True)
    killed = [r for r, k in enumerate(kills) if k]
    for r in killed:
        print(f"refmp cluster: rank {r} was killed by the kernel: it reached its memory limit "
              f"of {gib(groups.limit)} (--rank-memory {given}); the job ended with it "
              f"(exit status {status})", file=sys.stderr, flush=True)
    if killed and status == 0:
        status = 128 + signal.SIGKILL
    return {"limit": groups.limit, "peak": peaks, "oom_kills": kills}, status


def _launcher(name: str, cluster):
    """What builds the mpiexec command (``.mpiexec(ranks_per_node, program)``): the cluster
    itself (its bootstrap script), or sshd in each node (a context that stops them)."""
    if name == "ssh":
        from refmp.cli.netns_ssh import SshLaunch

        return SshLaunch(cluster)
    return contextlib.nullcontext(cluster)


class _Stop:
    """Ctrl-C and SIGTERM while the program runs: passed on to mpiexec as Ctrl-C (it ends its
    ranks), again after 2 s if it lingers, SIGKILL after 4 s; then the cluster comes down."""

    def __init__(self):
        self.since: float | None = None  # when the first signal came

    def wait(self, proc: subprocess.Popen) -> int:
        def forward(signum, frame):  # (only signals here: Popen.wait holds its lock)
            if self.since is None:
                self.since = time.time()
                print(f"refmp cluster: stopped by signal {signum}; removing the nodes",
                      file=sys.stderr, flush=True)
            proc.send_signal(signal.SIGINT)

        old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while True:
                try:
                    return proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    pass
                late = 0.0 if self.since is None else time.time() - self.since
                if late > 4:
                    proc.kill()
                elif late > 2:  # hydra's mpiexec may wait for a second Ctrl-C
                    proc.send_signal(signal.SIGINT)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
