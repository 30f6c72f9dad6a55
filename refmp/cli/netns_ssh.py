"""The local cluster launched over ssh (``refmp cluster --launcher ssh``): an OpenSSH server in
each node, and MPICH's Hydra starting its proxies through ssh, as on a real cluster.

Each node runs its own ``sshd`` (started through the cluster's bootstrap script, so it has
the node's address, hostname and /tmp, and everything a command started by it gets),
listening on the node's address only. Everything it needs is throwaway and lies in the
cluster's directory that every node sees (:attr:`Cluster.common`, a shared home's
stand-in), made for the run and removed with it:

    ssh/host_key          the servers' host key (ed25519)
    ssh/client_key        the key mpiexec's ssh logs in with
    ssh/authorized_keys   that key, from the cluster's subnet only, no forwarding, no tty
    ssh/known_hosts       node0, node1, ... with the host key: ssh checks it strictly
    ssh/sshd_config       key login only, for the user who runs the cluster
    ssh/config            ``Host nodeI`` -> the node's address, the key, the known hosts,
                          BatchMode (never a prompt) and a connection timeout
    ssh/ssh               ``ssh -F ssh/config "$@"``: the command Hydra runs as ssh

Nothing is written to ~/.ssh or /etc/ssh. The launch is the recipe for a real cluster
(docs/nodes.md, "On a real cluster"), with ssh pointed at that configuration:

    mpiexec -hosts node0,node1 -ppn G -n 2G -iface BRIDGE -launcher ssh -launcher-exec ssh/ssh

Hydra hands each rank mpiexec's environment (``-genvall``, its default), so the ranks run
the same Python and refmp as over the bootstrap script, though a command run over ssh starts
with a login's environment. sshd's privilege separation needs its empty directory
(``/run/sshd`` on Debian); where it is missing it is made, as the system's ssh service makes
it at start. The system's service itself is neither started nor used.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

from refmp.cli.netns import Cluster, Scoped, rank_env, run

SBIN = "/usr/sbin:/usr/local/sbin:/sbin"  # where sshd lies, often off a user's PATH
READY_S = 10.0  # how long a node's sshd may take to listen


def sshd_path() -> str | None:
    return shutil.which("sshd", path=os.environ.get("PATH", "") + ":" + SBIN)


def user() -> str:
    """Who runs the cluster (its uid's name: under sudo, root), whom ssh logs in as."""
    return pwd.getpwuid(os.geteuid()).pw_name


def unavailable() -> str | None:
    """Why the cluster cannot be launched over ssh here (None: it can)."""
    if sshd_path() is None:
        return "no OpenSSH server (sshd) on this machine: install the openssh-server package"
    for tool in ("ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on this machine: install the openssh-client package"
    return None


class SshLaunch(Scoped):
    """An sshd in each node of ``cluster``, and the mpiexec that launches over them.

    ``with Cluster(2) as c, SshLaunch(c) as s: subprocess.run(s.mpiexec(2, program))``;
    leaving the block stops every sshd and removes the keys (the cluster's own teardown
    ends whatever else runs in its nodes).
    """

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.dir = os.path.join(cluster.common, "ssh")
        self.servers: list[subprocess.Popen] = []

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def up(self) -> None:
        """Keys and configurations, then an sshd in each node, listening."""
        c = self.cluster
        os.mkdir(self.dir, mode=0o700)
        for key in ("host_key", "client_key"):
            run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"refmp cluster {c.id}",
                "-f", self.path(key))
        client = Path(self.path("client_key.pub")).read_text().strip()
        Path(self.path("authorized_keys")).write_text(
            f'restrict,from="{c.subnet}.0/24" {client}\n')
        host = " ".join(Path(self.path("host_key.pub")).read_text().split()[:2])
        Path(self.path("known_hosts")).write_text(
            "".join(f"{n.hostname},{n.ip} {host}\n" for n in c.nodes))
        Path(self.path("sshd_config")).write_text(self._sshd_config())
        Path(self.path("config")).write_text(self._ssh_config())
        wrapper = self.path("ssh")
        Path(wrapper).write_text(
            f"#!/bin/sh\n# refmp cluster {c.id}: ssh to its nodes (-launcher-exec)\n"
            f'exec ssh -F {shlex.quote(self.path("config"))} "$@"\n')
        os.chmod(wrapper, 0o755)
        check_config(self.path("sshd_config"))
        for node in c.nodes:
            cmd = "exec " + shlex.join([sshd_path(), "-D", "-e", "-f", self.path("sshd_config"),
                                        "-o", f"ListenAddress={node.ip}"])  # the Popen's pid
            with open(self.path(f"sshd-{node.hostname}.log"), "w") as log:
                self.servers.append(subprocess.Popen(
                    [c.bootstrap, "-x", node.ip, cmd], stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True))  # not Ctrl-C's
        for node, server in zip(c.nodes, self.servers, strict=True):
            self._wait_listening(node.ip, node.hostname, server)

    def _sshd_config(self) -> str:
        return "\n".join([
            f"# refmp cluster {self.cluster.id}: a node's sshd (ListenAddress on its command line)",
            "Port 22",
            f"HostKey {self.path('host_key')}",
            f"AuthorizedKeysFile {self.path('authorized_keys')}",
            f"AllowUsers {user()}",
            "StrictModes no",  # the keys lie under /tmp, which everyone may write
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password",
            "UsePAM no",
            "UseDNS no",
            "X11Forwarding no",
            "AllowTcpForwarding no",
            "PrintMotd no",
            "PrintLastLog no",
            "PidFile none",
            "LoginGraceTime 10",
            "MaxStartups 64",  # a proxy per node, and any connections a tree launch adds
            ""])

    def _ssh_config(self) -> str:
        hosts = [f"Host {n.hostname} {n.ip}\n    HostName {n.ip}" for n in self.cluster.nodes]
        return "\n".join([
            f"# refmp cluster {self.cluster.id}: ssh to its nodes", *hosts,
            "Host *",
            f"    User {user()}",
            f"    IdentityFile {self.path('client_key')}",
            "    IdentitiesOnly yes",
            "    IdentityAgent none",
            f"    UserKnownHostsFile {self.path('known_hosts')}",
            "    GlobalKnownHostsFile /dev/null",
            "    StrictHostKeyChecking yes",  # the host key is ours, known in advance
            "    BatchMode yes",  # a refused key fails at once instead of asking a password
            "    ConnectTimeout 5",
            "    ForwardX11 no",
            "    LogLevel ERROR",
            ""])

    def _wait_listening(self, ip: str, hostname: str, server: subprocess.Popen) -> None:
        """Until the node's sshd says it listens (its log; a test connection would leave a
        child of sshd behind for a while)."""
        log_file = Path(self.path(f"sshd-{hostname}.log"))
        deadline = time.time() + READY_S
        while time.time() < deadline and server.poll() is None:
            if f"Server listening on {ip} port 22" in log_file.read_text():
                return
            time.sleep(0.02)
        log = log_file.read_text().strip()
        state = "did not listen" if server.poll() is None else f"exited ({server.returncode})"
        raise RuntimeError(f"refmp cluster {self.cluster.id}: sshd on {hostname} {state} "
                           f"within {READY_S:g} s: {log or 'nothing logged'}")

    def mpiexec(self, ranks_per_node: int, program: list[str]) -> list[str]:
        """Hydra over ssh: the recipe for a real cluster, with this cluster's ssh, bridge and
        the ranks' settings (refmp.cli.netns.rank_env) given."""
        c = self.cluster
        return ["mpiexec", "-hosts", ",".join(n.hostname for n in c.nodes),
                "-ppn", str(ranks_per_node), "-n", str(ranks_per_node * len(c.nodes)),
                "-iface", c.bridge, "-launcher", "ssh", "-launcher-exec", self.path("ssh"),
                *rank_env(ranks_per_node * len(c.nodes)), *c.rank_program(program)]

    def down(self) -> None:
        """Stop every sshd (SIGTERM, SIGKILL after 2 s) and remove the keys; raise if a
        process of this launch (an sshd, an ssh) is still there."""
        for server in self.servers:
            with contextlib.suppress(ProcessLookupError):
                server.terminate()
        for server in self.servers:
            try:
                server.wait(timeout=2)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        for pid in lingering(self.dir, 2.0):  # a connection's sshd, an ssh: ending by now
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)
        left = lingering(self.dir, 1.0)
        if left:
            raise RuntimeError(f"refmp cluster {self.cluster.id}: processes of its ssh launch "
                               f"still run: {', '.join(map(str, left))}")


def processes(mark: str) -> list[int]:
    """The running processes whose command line names ``mark`` (the ssh directory: every
    sshd's configuration and every ssh's -F name it); not zombies (ended, and waiting for
    their parent or init to collect their status)."""
    out = run("pgrep", "-f", re.escape(mark), check=False).stdout.split()
    running = []
    for pid in out:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        if stat.rsplit(")", 1)[1].split()[0] != "Z":
            running.append(int(pid))
    return running


def lingering(mark: str, seconds: float) -> list[int]:
    """:func:`processes` naming ``mark`` still there after up to ``seconds``."""
    deadline = time.time() + seconds
    left = processes(mark)
    while left and time.time() < deadline:
        time.sleep(0.05)
        left = processes(mark)
    return left


def check_config(config: str) -> None:
    """sshd's test of ``config``, after making sshd's privilege separation directory where it
    is missing (the path sshd names when it refuses to start without it; root's, empty,
    0755, as the system's ssh service makes it); raise with sshd's words if it fails."""
    test = [sshd_path(), "-t", "-f", config]
    out = subprocess.run(test, capture_output=True, text=True)
    missing = re.search(r"Missing privilege separation directory: (\S+)", out.stderr)
    if missing:
        os.makedirs(missing.group(1), mode=0o755, exist_ok=True)
        out = subprocess.run(test, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{shlex.join(test)}: {out.stderr.strip() or out.returncode}")
