"""Tutorial 14: across nodes -- a cluster made on this machine, and the bytes on its slow link.

Run (as root):  python tutorials/14_across_nodes.py      (it makes the nodes and runs mpiexec)

1. Two nodes of two ranks each, made of network namespaces joined by a bridge, each node's
   link shaped to 0.5 Gbit/s (refmp.cli.netns, what `refmp cluster` runs). Each rank says
   its hostname and its node, as MPI's shared-memory split finds it.
2. Each rank holds a gradient of P float64. Flat: one all-reduce over the 4 ranks, in
   recursive doubling (pinned here: MPICH's algorithm for short messages), in which every
   rank sends its whole buffer to a rank on the other node. Hierarchical, by hand:
   reduce-scatter inside the node, all-reduce of the half across, all-gather inside.
   The bytes each node sent for each, read before and after: its TCP sockets' payload
   (`ss -ti`: bytes_sent less bytes_retrans, what the formula counts) and its eth0's
   counter (headers, acknowledgements and the retransmissions a full queue caused as well).
3. The engine's HierarchicalComm (--dp-reduce hierarchical) does the same: equal sums, bitwise.
Exit status 1 if a sum differs or the payload across was not G = 2 times less.
"""

import os
import re
import subprocess
import sys

import numpy as np

P = 1 << 20  # gradient elements (8 MiB in float64)

if "PMI_RANK" not in os.environ:  # the launcher: make the nodes, run this file on them
    from refmp.cli.netns import Cluster, unavailable

    if unavailable():
        sys.exit(f"tutorial 14 needs root and network namespaces: {unavailable()}")
    env = {**os.environ, "MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM": "sched_recursive_doubling",
           "OMP_NUM_THREADS": "1"}
    with Cluster(nodes=2, link_gbit=0.5) as c:
        status = subprocess.run(c.mpiexec(2, [sys.executable, __file__]), env=env).returncode
        print(f"the links' counters: {c.counters()} (PMI and output included)")
    sys.exit(status)

from mpi4py import MPI  # noqa: E402  (a rank, under mpiexec on the cluster)

from refmp.distributed import topology  # noqa: E402
from refmp.distributed.comm import Comm  # noqa: E402
from refmp.parallel.data.hierarchical import HierarchicalComm  # noqa: E402

world = MPI.COMM_WORLD
rank = world.rank
nodes = topology.node_ids(world)  # (0, 0, 1, 1): each rank's node
print(f"rank {rank} on {MPI.Get_processor_name()}, node {nodes[rank]}", flush=True)
flat = Comm(world, "dp")
inner = Comm(world.Split(nodes[rank], rank), "node")  # my node's 2 ranks
outer = Comm(world.Split(inner.rank, rank), "cross")  # the rank with my index on each node
grad = np.random.default_rng(rank).standard_normal(P)  # (P,) this rank's gradient


def sent() -> tuple[int, int]:  # bytes this node has sent: (TCP payload, eth0's counter)
    world.Barrier()
    sockets = subprocess.run(["ss", "-tinH"], capture_output=True, text=True).stdout
    payload = sum(int(n) for n in re.findall(r"bytes_sent:(\d+)", sockets))
    payload -= sum(int(n) for n in re.findall(r"bytes_retrans:(\d+)", sockets))
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:  # its namespace's own /sys
        return payload, int(f.read())


t0 = sent()
summed = flat.allreduce(grad.copy())  # (P,) every rank sends all P across: G x P a node
t1 = sent()
part = inner.reduce_scatter(grad.copy())  # (P/2,) my node's sum of my half
outer.allreduce(part)  # (P/2,) the only step across nodes: P/2 a rank, P a node
by_hand = inner.allgather(part)  # (P,) my node's two halves: the whole sum
t2 = sent()
engine = HierarchicalComm(flat, nodes).allreduce(grad.copy())  # the engine's, the same steps
moved = world.gather([(b - a, c - b) for a, b, c in zip(t0, t1, t2, strict=True)])
ok = world.allreduce(int(np.array_equal(summed, by_hand) and np.array_equal(summed, engine)),
                     op=MPI.MIN)
good = False
if rank == 0:
    (f, h), (f_link, h_link) = moved[0]  # node0's payload, then its link's counter
    print(f"node0 sent {f:,} B of payload for the flat all-reduce, {h:,} B for the "
          f"hierarchical ({f / h:.2f} x less; the formula: {8 * P:,} B = P x 8 hierarchical, "
          f"twice that flat)")
    print(f"its eth0 counted {f_link:,} B and {h_link:,} B ({f_link / h_link:.2f} x less)")
    print(f"the engine's ledger: {', '.join(flat.ledger.as_dict())}")
    good = bool(ok) and 1.9 < f / h < 2.1 and abs(h - 8 * P) < 8 * P / 100
    print("OK: the same sums; the slow link carries G = 2 times less" if good else "FAILED")
sys.exit(0 if world.bcast(good) else 1)
