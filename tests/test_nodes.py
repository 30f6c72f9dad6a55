"""refmp across nodes (docs/nodes.md): the topology rules (pure), and on a cluster made of
network namespaces on this machine (refmp cluster; root only, skipped elsewhere with the
reason): the cluster always comes down, training on 2 nodes x 2 ranks equals the one-host
run bitwise, a checkpoint written on 2 nodes resumes on one host, the watchdog names a stuck
rank on the other node, and the bytes on each node's link are what the ledger and the
formulas say, halved by the hierarchical all-reduce; launched over ssh (an sshd in each node;
skipped without sshd), the same training equals it bitwise and no sshd is left. Simulated
nodes on one host: tests/test_dp_parity.py."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from mpi_helpers import REPO

import refmp
from refmp.cli import cluster, netns, netns_ssh
from refmp.cost.zero import comm_per_step, unit_sizes
from refmp.distributed import topology
from refmp.distributed.ledger import Ledger
from refmp.errors import ConfigError
from refmp.nn.params import GPTConfig
from refmp.parallel.data.hierarchical import check_nodes
from refmp.parallel.rules import check_layout
from refmp.runtime import cpu
from refmp.training.trainer import TrainConfig

pytestmark = pytest.mark.cli
WHY = netns.unavailable()
needs_cluster = pytest.mark.skipif(WHY is not None, reason=f"no local cluster: {WHY}")
WHY_SSH = netns_ssh.unavailable()
needs_ssh = pytest.mark.skipif(WHY_SSH is not None, reason=f"no launch over ssh: {WHY_SSH}")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def sizes(**axes) -> dict:
    return {"pp": 1, "dp": 1, "cp": 1, "tp": 1, "ep": 1, **axes}


def test_which_groups_cross_nodes():
    two = (0, 0, 1, 1)  # 2 nodes of 2 ranks
    assert topology.members(1, sizes(dp=2, tp=2), ("dp",)) == [1, 3]
    assert topology.members(2, sizes(pp=2, dp=2), ("pp", "dp")) == [0, 1, 2, 3]
    assert topology.crossing(sizes(dp=2, tp=2), two) == []  # tp inside, dp between
    assert topology.crossing(sizes(tp=4), two) == ["tp"]
    assert topology.crossing(sizes(cp=2, tp=2), two) == ["cp"]
    assert topology.crossing(sizes(tp=4), (0, 0, 0, 0)) == []
    note = topology.crossing_notes(sizes(tp=4), two)
    assert len(note) == 1 and "--tp 4 spans nodes" in note[0] and "refmp plan" in note[0]
    assert topology.span([0, 1], two) == "intra" and topology.span([1, 2], two) == "inter"
    check_nodes(sizes(dp=4), two, ("dp", "cp"))  # 2 and 2: fine
    with pytest.raises(ConfigError, match="same number"):
        check_nodes(sizes(dp=3), (0, 0, 1), ("dp", "cp"))
    with pytest.raises(ConfigError, match="ZeRO 0's all-reduce"):  # ZeRO 1-3: refused
        check_layout(TrainConfig(dp=4, zero=1, dp_reduce="hierarchical"),
                     GPTConfig(13, 13, 2, 4, 64), 4)


def test_the_ledger_says_intra_or_inter_only_on_several_nodes():
    led = Ledger()
    led.record("allreduce", "tp", 8)
    led.spans["dp"] = "inter"
    led.record("allreduce", "dp", 16)
    assert led.as_dict() == {"allreduce@dp[inter]": {"bytes": 16, "count": 1},
                             "allreduce@tp": {"bytes": 8, "count": 1}}
    assert led.bytes("allreduce", "dp") == led.bytes("allreduce", "dp[inter]") == 16


def launch(*args: str, env: dict = ENV) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "refmp", "cluster", *args], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def cluster_id(proc: subprocess.Popen) -> str:
    """The id refmp cluster prints first ("refmp cluster ID: ...")."""
    line = proc.stdout.readline()
    assert line.startswith("refmp cluster "), line
    return line.split()[2].rstrip(":")


@needs_cluster
def test_the_cluster_comes_down_whatever_happens(monkeypatch):
    # a failure while the nodes are made: what was made goes
    real = netns.run

    def failing(*cmd, check=True):
        if cmd[:2] == ("tc", "-n"):  # the first node's link, shaped from inside
            raise RuntimeError("planted failure")
        return real(*cmd, check=check)

    c = netns.Cluster(2, 1.0)
    with monkeypatch.context() as m:
        m.setattr(netns, "run", failing)
        with pytest.raises(RuntimeError, match="planted"):
            with c:
                pass
    assert netns.leftovers(c.id) == []
    # the program fails: its status, each node its own hostname and /tmp (it does not see a
    # file of the host's /tmp)
    mark = tempfile.NamedTemporaryFile(prefix="refmp-host-only-", dir="/tmp")
    p = launch("--nodes", "2", "--", "sh", "-c",
               "echo host $(hostname) $(ls /tmp | grep -c refmp-host-only-); exit 3")
    ident = cluster_id(p)
    out = p.communicate(timeout=60)[0]
    mark.close()
    assert p.returncode == 3, out
    assert "host node0 0" in out and "host node1 0" in out, out
    assert netns.leftovers(ident) == []
    # two at once: their own names and subnets; Ctrl-C ends one, SIGKILL the other (its
    # nodes stay until clean(), which every new cluster runs first)
    a = launch("--nodes", "2", "--link-gbit", "1", "--", "sleep", "60")
    b = launch("--nodes", "2", "--", "sleep", "60")
    ids = [cluster_id(a), cluster_id(b)]
    assert ids[0] != ids[1]
    deadline = time.time() + 30
    while time.time() < deadline and not all(len(netns.leftovers(i)) == 6 for i in ids):
        time.sleep(0.1)  # 2 namespaces, 2 veths, a bridge, a state directory each
    assert [len(netns.leftovers(i)) for i in ids] == [6, 6]
    a.send_signal(signal.SIGINT)
    b.kill()
    out = a.communicate(timeout=60)[0]
    b.wait(timeout=60)  # (its orphaned mpiexec keeps the pipe open until clean() below)
    b.stdout.close()
    assert a.returncode != 0 and "removing the nodes" in out, out
    assert netns.leftovers(ids[0]) == []
    assert netns.leftovers(ids[1]) != []  # SIGKILL: nothing could run
    assert ids[1] in netns.clean()
    assert netns.leftovers(ids[1]) == []


@needs_cluster
@needs_ssh
def test_each_node_has_its_own_sshd_until_the_launch_ends():
    home_ssh = os.path.expanduser("~/.ssh")
    had = os.path.exists(home_ssh) and sorted(os.listdir(home_ssh))
    mark = tempfile.NamedTemporaryFile(prefix="refmp-host-only-", dir="/tmp")
    with mark, netns.Cluster(2) as c:
        with netns_ssh.SshLaunch(c) as s:
            sshd = [Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
                    for pid in netns_ssh.processes(s.dir)]  # an sshd a node, on its address
            assert sorted(cmd.split("ListenAddress=")[1].split()[0] for cmd in sshd) == [
                n.ip for n in c.nodes]
            for node in c.nodes:  # the node answers over ssh, by name, as itself
                there = subprocess.run([s.path("ssh"), node.hostname, "hostname; ls /tmp"],
                                       capture_output=True, text=True, timeout=20)
                assert there.returncode == 0, there.stderr
                assert there.stdout.split()[0] == node.hostname
                assert "refmp-host-only" not in there.stdout  # its own /tmp
            refused = subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
                                      "-o", "StrictHostKeyChecking=no", "-o",
                                      "UserKnownHostsFile=/dev/null", c.nodes[0].ip, "true"],
                                     capture_output=True, text=True, timeout=20)
            assert refused.returncode == 255  # without the cluster's key: refused at once
        assert netns_ssh.processes(s.dir) == [] and not os.path.exists(s.dir)
    assert (os.path.exists(home_ssh) and sorted(os.listdir(home_ssh))) == had


def crossing_bytes(ledger: dict, group_sizes: dict) -> int:
    """What one rank's collectives on groups that span nodes send to another node, from its
    ledger: a group of 2 (one rank a node) sends each all-reduce's buffer once (any
    algorithm: ring, recursive doubling or halving); a group of 4 on the 2 nodes in
    recursive doubling (DOUBLING) too, in the one of its two steps that crosses; a metric
    of the world its buffer once."""
    total = 0
    for key, v in ledger.items():
        op, label = key.split("@")
        if label.endswith("[inter]"):
            n = group_sizes[label[: -len("[inter]")]]
            assert n in (2, 4) or op == "metric", key  # a formula for these only
            total += v["bytes"]
    return total


FRAME = 1514  # an Ethernet frame's most bytes: what a TCP segment sent again adds at most


def carried(m: dict, run: str, ranks: tuple[int, int], group_sizes: dict) -> int:
    """The payload the ledgers of a node's ``ranks`` say crosses its link during ``run``
    (across_nodes.py's measured ``m``), held to what the node's veth counted: at least the
    payload, at most 3% more (headers, acknowledgements) and 16 KiB (MPI's own messages),
    and a frame for each TCP segment the node sent again (a segment dropped by the busy
    receiver crosses twice)."""
    want = sum(crossing_bytes(m["ledger"][q], group_sizes) for q in ranks)
    got, again = m["sent"][ranks[0]], m["resent"][ranks[0]]
    assert want <= got <= 1.03 * want + 16384 + again * FRAME, (run, ranks, got, want, again)
    return want


# what refmp.cli.netns.rank_env gives the 4 ranks: TCP between the nodes, receivers that pull
# (an exchange's two directions at once), and no spinning in waits where the 2 nodes' ranks
# outnumber this machine's cores (unless the environment sets it)
RANK_ENV = {"UCX_TLS": "tcp,self", "UCX_RNDV_SCHEME": "get_zcopy",
            "REFMP_SPIN_US": os.environ.get("REFMP_SPIN_US", "0" if 4 > cpu.cores() else None)}

# the flat all-reduce of dp 4 as recursive doubling: every rank exchanges its whole buffer
# with a rank on the other node (MPICH's choice for short messages)
DOUBLING = {**ENV, "MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM": "sched_recursive_doubling"}


def finish(p: subprocess.Popen, timeout: float) -> str:
    """The output of a ``refmp cluster`` run; past ``timeout`` it is stopped (Ctrl-C: its
    nodes come down) and the test fails."""
    try:
        return p.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGINT)
        text = p.communicate(timeout=30)[0]
        pytest.fail(f"refmp cluster still ran after {timeout} s:\n{text}")


@pytest.fixture(scope="module")
def across(tmp_path_factory):
    """across_nodes.py's cluster part on 2 nodes of 2 ranks (the default launcher): its
    directory, the cluster's id, status and output."""
    out = str(tmp_path_factory.mktemp("across"))
    p = launch("--nodes", "2", "--ranks-per-node", "2", "--share", out, "--", sys.executable,
               "tests/mpi_scripts/across_nodes.py", "cluster", out, env=DOUBLING)
    ident = cluster_id(p)
    text = finish(p, 150)
    return out, ident, p.returncode, text


@needs_cluster
@pytest.mark.timeout(180)
def test_training_across_nodes_equals_one_host(across):
    out, ident, status, text = across
    assert netns.leftovers(ident) == []
    # the watchdog ended the job at the planted hang, naming rank 3 on node1
    assert status == 5, text
    assert "rank 3 has not entered barrier@world" in text, text
    assert "rank 3 on node1 is not in MPI" in text, text
    with open(os.path.join(out, "cluster.json")) as f:
        r = json.load(f)
    assert r["hosts"] == ["node0", "node0", "node1", "node1"] and r["nodes"] == [0, 0, 1, 1]
    assert r["rank_env"] == [RANK_ENV] * 4
    assert r["crossing"] == {"dp2tp2": [], "tp4": ["tp"], "cp2tp2": ["cp"]}
    # bytes on the link: the ledger's, and the formula's (refmp.cost.zero)
    mcfg = GPTConfig(**r["model"])
    per_rank = comm_per_step(unit_sizes(mcfg, tp=2), 2, 0, itemsize=8)["allreduce"]  # a step
    for run in ("dp2tp2", "dp2tp2_rest"):
        m = r[run]
        assert m["ledger"][0]["allreduce@dp[inter]"]["bytes"] == 2 * per_rank
        assert "[intra]" in next(k for k in m["ledger"][0] if k.startswith("allreduce@tp"))
        for ranks in ((0, 1), (2, 3)):
            want = carried(m, run, ranks, {"dp": 2, "world": 4})
            assert abs(want - 2 * 2 * per_rank) < 1024  # 2 ranks, 2 steps, and the metrics
    # flat and hierarchical: the same sums bitwise; the link carries 1/G of the flat bytes:
    # the payloads (the ledgers', each held to the veth's count), not the counts, whose
    # headers and resent segments vary from run to run
    flat, hier = r["flat"], r["hierarchical"]
    assert flat["steps"] == hier["steps"] and flat["weights"] == hier["weights"]
    whole = comm_per_step(unit_sizes(mcfg, tp=1), 4, 0, itemsize=8)["allreduce"]  # P w
    for ranks in ((0, 1), (2, 3)):
        h = carried(hier, "hierarchical", ranks, {"dp.cross": 2, "world": 4})
        assert abs(h - 3 * whole) < 1024  # 2 (N-1)/N P w a node, 3 steps, and the metrics
        f = carried(flat, "flat", ranks, {"dp": 4, "world": 4})
        assert abs(f - 6 * whole) < 1024  # each rank's whole P w, 3 steps, and the metrics
        sums = [sum(run["ledger"][q][key]["bytes"] for q in ranks) for run, key in (
            (flat, "allreduce@dp[inter]"), (hier, "allreduce@dp.cross[inter]"))]
        assert sums[0] == 2 * sums[1], sums  # G = 2
    # the one-host run: the same from scratch, and from the checkpoint written on 2 nodes
    q = subprocess.run(["mpiexec", "-n", "4", sys.executable, "tests/mpi_scripts/across_nodes.py",
                        "host", out], cwd=REPO, env=ENV, capture_output=True, text=True,
                       timeout=120)
    assert q.returncode == 0, q.stdout + q.stderr
    with open(os.path.join(out, "host.json")) as f:
        h = json.load(f)
    assert h == {"nodes": [0, 0, 0, 0], "start": 2, "fresh_equal": True, "weights_equal": True,
                 "resumed_equal": True, "resumed_weights_equal": True}


@needs_cluster
@needs_ssh
@pytest.mark.timeout(240)
def test_training_launched_over_ssh_equals_the_cluster_run(across):
    # the recipe for a real cluster: Hydra over ssh, to an sshd in each node; dp 2 x tp 2
    # from scratch, against the default launch's run (which equals the one-host run)
    out = across[0]
    counters = os.path.join(out, "ssh-counters.json")
    p = launch("--launcher", "ssh", "--nodes", "2", "--ranks-per-node", "2", "--share", out,
               "--json", counters, "--", sys.executable, "tests/mpi_scripts/across_nodes.py",
               "ssh", out, env=DOUBLING)
    ident = cluster_id(p)
    text = finish(p, 60)
    assert p.returncode == 0, text
    assert f"mpiexec -hosts node0,node1 -ppn 2 -n 4 -iface rfmp{ident} -launcher ssh" in text
    assert netns.leftovers(ident) == []
    assert netns_ssh.processes(f"{netns.STATE}{ident}-") == [], "an sshd or ssh is left"
    with open(os.path.join(out, "ssh.json")) as f:
        r = json.load(f)
    assert r["hosts"] == ["node0", "node0", "node1", "node1"]
    assert r["python"] == [sys.executable] * 4  # mpiexec's environment reached the ranks
    assert r["refmp"] == [refmp.__file__] * 4
    passed = ("MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM", "OMP_NUM_THREADS", "PYTHONPATH")
    assert r["env"] == [{**{k: DOUBLING.get(k) for k in passed}, **RANK_ENV}] * 4
    assert r["steps_equal"] and r["weights_equal"]
    # the bytes crossed the link: what the ledger says, on each node's eth0 during the steps
    # and on its veth over the whole run (with ssh's and MPI's own traffic)
    with open(counters) as f:
        veth = json.load(f)["nodes"]
    for node, ranks in (("node0", (0, 1)), ("node1", (2, 3))):
        want = carried(r, "ssh", ranks, {"dp": 2, "world": 4})
        assert want > 0
        assert veth[node]["sent"] >= want and veth[node]["received"] >= want, (node, veth)


def test_the_ssh_launcher_is_refused_without_sshd_before_any_node(monkeypatch):
    made = []
    monkeypatch.setattr(netns, "unavailable", lambda: None)
    monkeypatch.setattr(netns, "Cluster", lambda *a, **k: made.append(a))
    monkeypatch.setattr(netns_ssh, "sshd_path", lambda: None)
    args = argparse.Namespace(clean=False, program=["--", "true"], nodes=2, ranks_per_node=1,
                              link_gbit=None, share=[], launcher="ssh", json=None,
                              rank_memory=None)
    with pytest.raises(ConfigError, match="--launcher ssh: no OpenSSH server .* openssh-server"):
        cluster.run_cluster(args)
    assert made == []
