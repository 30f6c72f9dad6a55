"""A cluster on one machine, for ``refmp cluster`` and the tests that run refmp across nodes:
nodes made of Linux network namespaces, joined by a bridge, their links shaped. Root only.

Each node is a network namespace with its own address and a veth pair to the bridge; a
process in it also gets the node's hostname (a UTS namespace: MPI's ``Get_processor_name``
and refmp's reports tell the nodes apart) and the node's own ``/tmp`` (a mount namespace, as
on a real cluster; ``share`` makes directories under /tmp common, a shared file system's
stand-in, and this Python's environment, refmp's source and the working directory are shared
that way too when they lie under /tmp, and the cluster's own :attr:`Cluster.common`, for a
launcher's files; the rest of the file system is shared, as a cluster's home is). A node's
link is shaped both ways by a token bucket (``tc qdisc ... tbf rate R``) on each end of its
veth.

Hydra (the ``mpich`` wheel's mpiexec) starts a proxy on each host through ssh; here
``-bootstrap-exec`` names a script, written for the cluster, called as ssh is (``script -x
HOST COMMAND``), that runs the command in that node's namespaces. Two traps, handled by
:meth:`Cluster.mpiexec`: the proxies reach mpiexec only through the bridge (``-iface``), and
UCX (MPICH's network layer) recognizes processes of one machine whatever their hostnames and
would move their data through shared memory, past the veth (``UCX_TLS=tcp,self``). The veth
counters say what crossed: check them. Over TCP, UCX's default rendezvous sometimes runs the
two directions of an exchange one after the other (the veth counters: one node's bytes, then
the other's), doubling a crossing; the receiver pulling instead (``UCX_RNDV_SCHEME=get_zcopy``)
keeps both directions busy at once, as the planner prices an exchange. And the nodes share
this machine's cores: where the cluster's ranks outnumber them, a rank that spins while it
waits (refmp.distributed.waiting, which counts only its own node's ranks) takes the core
another node's rank computes on, so every rank is told ``REFMP_SPIN_US=0`` unless the
environment sets it (:func:`rank_env`).
``refmp cluster --launcher ssh`` launches over ssh instead, to an sshd in each node
(refmp.cli.netns_ssh).

With ``rank_memory`` each rank also runs inside a kernel memory cgroup of that size
(refmp.runtime.cgroup: made in :meth:`Cluster.up`, the hierarchy mounted in each node, whose
fresh /sys has none; refmp.runtime.rank_launch puts each rank into its own).

Teardown always runs (:meth:`Cluster.down`: leaving the ``with`` block, an exception,
Ctrl-C); a run killed outright leaves its nodes to the next cluster (:func:`clean`: those
whose owner process is gone) or to ``refmp cluster --clean``. Names are unique per run.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from refmp.runtime import cgroup, cpu

STATE = "refmp-cluster-"  # the state directory's prefix, in the host's temporary directory
NETNS = "refmp-"  # a node's namespace: refmp-<id>-node<i>
LINK = "rfmp"  # the bridge rfmp<id>, a node's host-side veth rfmp<id>v<i> (15 characters at most)
SUBNETS = [f"10.213.{k}" for k in range(256)]  # one /24 per cluster


def run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command; with ``check``, a failure raises with its stderr."""
    out = subprocess.run(cmd, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)}: {out.stderr.strip() or out.returncode}")
    return out


def unavailable() -> str | None:
    """Why a cluster cannot be made here (None: it can): root, ``ip``, ``tc``, ``unshare``,
    and a network namespace made and removed."""
    if os.geteuid() != 0:
        return "a cluster of network namespaces needs root (ip netns, tc, mount)"
    for tool in ("ip", "tc", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command on this machine"
    probe = f"{NETNS}probe-{secrets.token_hex(3)}"
    made = run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add fails here: {made.stderr.strip()}"
    run("ip", "netns", "del", probe, check=False)
    return None


@dataclass(frozen=True)
class Node:
    """One node: its hostname, namespace, address, host-side veth and private /tmp."""
    hostname: str
    netns: str
    ip: str
    veth: str
    tmp: str


def shared_dirs(share) -> tuple[str, ...]:
    """``share``, and what every node needs to run refmp where it lies under /tmp (which each
    node has its own of): this Python's environment, refmp's source and the working directory.
    Outermost first, none inside another."""
    needed = [sys.prefix, str(Path(__file__).resolve().parents[2]), os.getcwd()]
    dirs = {os.path.realpath(d) for d in share}
    dirs |= {os.path.realpath(d) for d in needed
             if os.path.realpath(d).startswith("/tmp/")}
    return tuple(d for d in sorted(dirs)
                 if not any(d.startswith(other + "/") for other in dirs))


class Scoped:
    """A ``with`` block around ``up()`` and ``down()``: down runs whatever happens, also after
    an up that failed part way (down removes whatever state up reached)."""

    def __enter__(self):
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()


class Cluster(Scoped):
    """``nodes`` namespaces on a bridge, links shaped to ``link_gbit`` Gbit/s each way (None:
    unshaped); ``share``: directories (under /tmp) every node sees as the host does.

    ``with Cluster(2, 1.0) as c: subprocess.run(c.mpiexec(2, ["python", "x.py"]))``.
    """

    def __init__(self, nodes: int, link_gbit: float | None = None, share: tuple = (),
                 rank_memory: int | None = None, ranks_per_node: int = 1):
        if nodes < 1:
            raise ValueError(f"a cluster needs at least one node, not {nodes}")
        if link_gbit is not None and not link_gbit > 0:
            raise ValueError(f"the link rate must be positive, not {link_gbit}")
        self.id = secrets.token_hex(3)
        self.link_gbit = link_gbit
        self.share = shared_dirs(share)
        self.dir = ""  # the state directory (the bootstrap script, the nodes' /tmp)
        self.common = ""  # in it, a directory every node sees (a launcher's files)
        self.bridge = f"{LINK}{self.id}"
        self.subnet = ""
        self.nodes: list[Node] = []
        self.n = nodes
        # a memory cgroup of rank_memory bytes for each rank (made in up())
        self.groups = (cgroup.RankGroups(self.id, nodes * ranks_per_node, rank_memory)
                       if rank_memory is not None else None)
        self.cgroups = ""  # their directory, once made (recorded: clean() removes it)

    @classmethod
    def recorded(cls, state: dict, folder: str) -> Cluster:
        """The cluster a state directory's record describes (to remove it)."""
        c = cls(max(1, len(state["nodes"])))
        c.id = state["id"]
        c.bridge = state["bridge"]
        c.dir = folder
        c.nodes = [Node(**n) for n in state["nodes"]]
        c.cgroups = state.get("cgroups", "")
        return c

    # --- up and down -------------------------------------------------------------------------

    def up(self) -> None:
        """Make the bridge, the nodes and their links, the bootstrap script, and the
        directory every node sees (:attr:`common`; partial state is for :meth:`down` to
        remove: call it whatever happens)."""
        clean()  # what killed runs left
        self.dir = tempfile.mkdtemp(prefix=f"{STATE}{self.id}-")
        self._save()
        self.common = os.path.join(self.dir, "common")
        os.mkdir(self.common, mode=0o700)
        self.share = shared_dirs((*self.share, self.common))
        lock = os.open(tempfile.gettempdir(), os.O_RDONLY)  # two clusters starting at once
        try:  # take two subnets: one chooses and takes its own while the other waits
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.subnet = free_subnet()
            run("ip", "link", "add", self.bridge, "type", "bridge")
            self._save()
            run("ip", "addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        finally:
            os.close(lock)
        run("ip", "link", "set", self.bridge, "up")
        if self.groups is not None:
            self.cgroups = self.groups.dir
            self._save()
            self.groups.make()
        for i in range(self.n):
            node = Node(f"node{i}", f"{NETNS}{self.id}-node{i}", f"{self.subnet}.{i + 1}",
                        f"{LINK}{self.id}v{i}", os.path.join(self.dir, f"node{i}-tmp"))
            self.nodes.append(node)
            self._save()
            self._add(node)
        self._write_bootstrap()

    def _add(self, node: Node) -> None:
        ns = node.netns
        os.makedirs(node.tmp, mode=0o1777)
        os.chmod(node.tmp, 0o1777)  # a /tmp: everyone writes, only owners delete
        run("ip", "netns", "add", ns)
        run("ip", "link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        run("ip", "link", "set", node.veth, "master", self.bridge, "up")
        run("ip", "-n", ns, "addr", "add", f"{node.ip}/24", "dev", "eth0")
        run("ip", "-n", ns, "link", "set", "eth0", "up")
        run("ip", "-n", ns, "link", "set", "lo", "up")
        if self.link_gbit is not None:  # into the node (host side) and out of it (node side)
            run("tc", "qdisc", "add", "dev", node.veth, "root", *tbf(self.link_gbit))
            run("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", *tbf(self.link_gbit))

    def down(self) -> None:
        """Remove everything :meth:`up` made, whatever state it reached: end the processes
        left in the nodes, delete the namespaces (their veths go with them), the bridge and
        the state directory. Raises if anything is still there afterwards."""
        for node in self.nodes:
            stop_processes(node.netns)
            run("ip", "netns", "del", node.netns, check=False)
            run("ip", "link", "del", node.veth, check=False)  # if its namespace never came
        run("ip", "link", "del", self.bridge, check=False)
        if self.cgroups:  # the ranks' memory cgroups (their processes ended first)
            cgroup.remove_tree(self.cgroups)
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        left = leftovers(self.id)
        if left:
            raise RuntimeError(f"refmp cluster {self.id}: could not remove {', '.join(left)}")

    def _save(self) -> None:
        """The state directory's record: who owns the cluster, and its names (for clean())."""
        with open(os.path.join(self.dir, "cluster.json"), "w") as f:
            json.dump({"id": self.id, "pid": os.getpid(), "bridge": self.bridge,
                       "nodes": [vars(n) for n in self.nodes], "cgroups": self.cgroups}, f)

    # --- running on it ----------------------------------------------------------------------

    def _write_bootstrap(self) -> None:
        """The script hydra calls as ``ssh -x HOST COMMAND``: the command runs in HOST's
        namespaces, with its hostname and its own /tmp (``share``'s directories bound into
        it), as ssh would run it (its words joined and read by a shell)."""
        cases = []
        for node in self.nodes:
            binds = []
            for s in self.share:
                if s == "/tmp" or s.startswith("/tmp/"):
                    inner = node.tmp + s[len("/tmp"):]
                    binds += [f"mkdir -p {shlex.quote(inner)}",
                              f"mount --bind {shlex.quote(s)} {shlex.quote(inner)}"]
            mount = self.groups.ctl.mount() if self.groups is not None else []
            setup = "; ".join([f"hostname {node.hostname}", *binds, *mount,
                               f"mount --rbind {shlex.quote(node.tmp)} /tmp", 'exec sh -c "$0"'])
            cases.append(f"  {node.ip}) exec ip netns exec {node.netns} unshare --uts --mount "
                         f"--propagation private sh -c {shlex.quote(setup)} \"$*\" ;;")
        script = "\n".join([
            "#!/bin/sh",
            f"# refmp cluster {self.id}: run a command on a node, called as ssh is (-bootstrap-exec)",
            'while [ "${1#-}" != "$1" ]; do shift; done  # ssh options (-x)',
            'host="$1"; shift',
            'case "$host" in', *cases,
            '  *) echo "refmp cluster: no node $host" >&2; exit 255 ;;',
            "esac", ""])
        Path(self.bootstrap).write_text(script)
        os.chmod(self.bootstrap, 0o755)

    @property
    def bootstrap(self) -> str:
        """The script that runs a command on a node: ``bootstrap -x HOST COMMAND``."""
        return os.path.join(self.dir, "bootstrap")

    def mpiexec(self, ranks_per_node: int, program: list[str]) -> list[str]:
        """The mpiexec command that runs ``program`` as ``ranks_per_node`` ranks on each node,
        ranks 0..G-1 on node0, then node1 (so with tp = G, tp stays inside a node)."""
        return ["mpiexec", "-iface", self.bridge, "-bootstrap-exec", self.bootstrap,
                "-hosts", ",".join(n.ip for n in self.nodes), "-ppn", str(ranks_per_node),
                "-n", str(ranks_per_node * len(self.nodes)),
                *rank_env(ranks_per_node * len(self.nodes)), *self.rank_program(program)]

    def rank_program(self, program: list[str]) -> list[str]:
        """What mpiexec starts for each rank: ``program``, with --rank-memory first put into
        the rank's memory cgroup (refmp.runtime.rank_launch)."""
        if self.groups is None:
            return list(program)
        return [sys.executable, "-m", "refmp.runtime.rank_launch", self.groups.dir, "--",
                *program]

    def counters(self) -> dict[str, dict[str, int]]:
        """Bytes each node sent and received over its link so far (its veth's counters, read
        on the host side: what the node received is what the host side sent)."""
        out = {}
        for node in self.nodes:
            stats = Path("/sys/class/net", node.veth, "statistics")
            out[node.hostname] = {"sent": int((stats / "rx_bytes").read_text()),
                                  "received": int((stats / "tx_bytes").read_text())}
        return out


def rank_env(ranks: int) -> list[str]:
    """mpiexec's ``-genv`` settings for a cluster of ``ranks`` ranks (module docstring): UCX
    over TCP between the nodes, receivers that pull, and no spinning in waits where the ranks
    outnumber this machine's cores (and the environment does not say)."""
    env = ["-genv", "UCX_TLS", "tcp,self", "-genv", "UCX_RNDV_SCHEME", "get_zcopy"]
    if ranks > cpu.cores() and "REFMP_SPIN_US" not in os.environ:
        env += ["-genv", "REFMP_SPIN_US", "0"]
    return env


def tbf(gbit: float) -> list[str]:
    """A token bucket of ``gbit`` Gbit/s: a burst of 1 ms of the rate (at least 64 KiB,
    a large segment's worth), and a queue that holds 50 ms of it (at least 1 MiB) before it
    drops."""
    rate = gbit * 1e9 / 8  # bytes/s
    burst = max(int(rate * 1e-3), 64 << 10)
    limit = max(int(rate * 50e-3), 1 << 20)
    return ["tbf", "rate", f"{int(gbit * 1e9)}bit", "burst", str(burst), "limit", str(limit)]


def free_subnet() -> str:
    """A 10.213.k.0/24 that no address or route of this machine uses (under the lock)."""
    used = run("ip", "-4", "-o", "addr", "show").stdout + run("ip", "-4", "route").stdout
    for s in SUBNETS:
        if f" {s}." not in used and f"\n{s}." not in used and not used.startswith(f"{s}."):
            return s
    raise RuntimeError("refmp cluster: every 10.213.k.0/24 is in use")


def stop_processes(netns: str) -> None:
    """End the processes still in a node (this cluster started them): SIGTERM, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(p) for p in run("ip", "netns", "pids", netns, check=False).stdout.split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.time() + 2.0
        while pids and time.time() < deadline and run(
                "ip", "netns", "pids", netns, check=False).stdout.split():
            time.sleep(0.05)


def leftovers(cluster_id: str) -> list[str]:
    """The namespaces, links and state directories of cluster ``cluster_id`` that exist."""
    names = [n.split()[0] for n in run("ip", "netns", "list", check=False).stdout.splitlines()
             if n.startswith(f"{NETNS}{cluster_id}-")]
    links = run("ip", "-o", "link", "show", check=False).stdout.splitlines()
    names += [ln.split(":")[1].strip().split("@")[0] for ln in links
              if f" {LINK}{cluster_id}" in ln]
    names += [str(p) for p in Path(tempfile.gettempdir()).glob(f"{STATE}{cluster_id}-*")]
    ctl = cgroup.controller()
    if ctl is not None and os.path.isdir(os.path.join(ctl.root, f"{cgroup.PREFIX}{cluster_id}")):
        names.append(os.path.join(ctl.root, f"{cgroup.PREFIX}{cluster_id}"))
    return names


def clean() -> list[str]:
    """Remove the clusters whose owner process is gone (a run killed outright); their ids."""
    removed = []
    for record in Path(tempfile.gettempdir()).glob(f"{STATE}*/cluster.json"):
        try:
            state = json.loads(record.read_text())
        except (OSError, ValueError):
            continue
        if Path(f"/proc/{state['pid']}").exists():  # its owner still runs
            continue
        c = Cluster.recorded(state, str(record.parent))
        try:
            c.down()
        except RuntimeError as e:
            print(e, file=sys.stderr)
        removed.append(state["id"])
    return removed

