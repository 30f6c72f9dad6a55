"""refmp across nodes, for tests/test_nodes.py: ``across_nodes.py cluster OUT`` on 2 nodes of
2 ranks (refmp cluster), then ``across_nodes.py host OUT`` on one host, 4 ranks, and
``across_nodes.py ssh OUT`` on 2 nodes of 2 ranks launched over ssh (refmp cluster
--launcher ssh).

cluster (4 ranks on node0, node0, node1, node1):
  1. dp 2 x tp 2 (tp inside a node, dp between): 4 steps, a checkpoint after step 2; each
     step's loss and gradient norm and the final weights (as hex floats and hashes); the
     ledger of the steps; the bytes each node's eth0 sent during them (its veth counter)
     and the TCP segments it sent again.
  2. dp 4, --dp-reduce flat then hierarchical, 3 steps each: results and bytes sent.
  3. topology: the nodes the grid found, the axes that cross nodes for a few layouts.
  4. rank 3 (on node1) stops calling MPI; the others wait in a barrier; the watchdog
     (--trace-dir OUT/trace, a directory every node shares) names rank 3 and ends the job.
host: the same dp 2 x tp 2 run from scratch, and from the checkpoint the cluster wrote after
  step 2; each compared bitwise with the cluster's: a mismatch exits 1.
ssh: the same dp 2 x tp 2 run from scratch, compared bitwise with the cluster's; the ledger
  and the bytes and resent segments of each node's eth0 during its steps; each rank's host,
  Python, refmp and the variables the test set for mpiexec.
Results: OUT/cluster.json, OUT/host.json, OUT/ssh.json (rank 0).
"""

import hashlib
import json
import os
import sys
import time
from dataclasses import replace

import numpy as np
from mpi4py import MPI

import refmp
from refmp.distributed import recorder, topology
from refmp.distributed.watchdog import Watchdog
from refmp.training.trainer import TrainConfig, Trainer

mode, out = sys.argv[1], sys.argv[2]
world = MPI.COMM_WORLD
BASE = TrainConfig(dp=2, tp=2, n_layer=2, n_embd=64, n_head=4, batch_size=8, steps=4,
                   dtype="float64", digits=2, progress=False, collective_timeout=0, lr=1e-2,
                   warmup_steps=1)


def sent() -> int:
    """Bytes this node's eth0 has sent (its namespace's own /sys)."""
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


def resent() -> int:
    """TCP segments this node has sent again (RetransSegs of its namespace's own
    /proc/net/snmp): a segment the busy receiving side dropped crosses the link twice."""
    with open("/proc/net/snmp") as f:
        names, values = (line.split() for line in f if line.startswith("Tcp:"))
    return int(values[names.index("RetransSegs")])


def hashes(tr: Trainer) -> dict | None:
    """sha256 of every whole weight, on rank 0 (collective)."""
    full = tr.runner.full_params()
    if full is None:
        return None
    return {k: hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()
            for k, v in sorted(full.items())}


def train(tr: Trainer, steps: int) -> list:
    """``steps`` steps: [[loss, norm] as hex floats]."""
    recs = []
    for _ in range(steps):
        rec = tr.step()
        recs.append([float(rec["loss"]).hex(), float(rec["grad_norm"]).hex()])
    return recs


def measured(tr: Trainer, steps: int) -> dict:
    """Train, counting what this node sent meanwhile (the first rank of each node reads)."""
    tr.grid.world.barrier()
    tr.grid.ledger.reset()
    before = (sent(), resent()) if mode != "host" else (0, 0)
    recs = train(tr, steps)
    tr.grid.world.barrier()
    after = (sent(), resent()) if mode != "host" else (0, 0)
    ledger = tr.grid.ledger.as_dict()
    return {"steps": recs, "ledger": world.allgather(ledger),
            "sent": world.allgather(after[0] - before[0]),
            "resent": world.allgather(after[1] - before[1]), "weights": hashes(tr)}


UCX = ("UCX_TLS", "UCX_RNDV_SCHEME", "REFMP_SPIN_US")  # refmp.cli.netns.rank_env's


def cluster() -> dict:
    result = {"hosts": world.allgather(MPI.Get_processor_name()),
              "rank_env": world.allgather({k: os.environ.get(k) for k in UCX})}
    ckpt = os.path.join(out, "ckpt")
    tr = Trainer(BASE)
    result["nodes"] = list(tr.grid.nodes)
    m = tr.mcfg
    result["model"] = {"vocab_size": m.vocab_size, "block_size": m.block_size,
                       "n_layer": m.n_layer, "n_head": m.n_head, "n_embd": m.n_embd}
    result["crossing"] = {"dp2tp2": topology.crossing(tr.grid.sizes, tr.grid.nodes)}
    result["dp2tp2"] = measured(tr, 2)
    tr.save_checkpoint(ckpt)
    result["dp2tp2_rest"] = measured(tr, 2)
    for red in ("flat", "hierarchical"):
        t = Trainer(replace(BASE, dp=4, tp=1, dp_reduce=red, steps=3))
        result[red] = measured(t, 3)
    result["crossing"]["tp4"] = topology.crossing({"pp": 1, "dp": 1, "cp": 1, "tp": 4}, tr.grid.nodes)
    result["crossing"]["cp2tp2"] = topology.crossing({"pp": 1, "dp": 1, "cp": 2, "tp": 2},
                                                     tr.grid.nodes)
    result["notes"] = topology.crossing_notes({"pp": 1, "dp": 1, "cp": 1, "tp": 4}, tr.grid.nodes)
    return result


def host() -> dict:
    with open(os.path.join(out, "cluster.json")) as f:
        there = json.load(f)
    fresh = Trainer(BASE)
    mine = train(fresh, 4)
    weights = hashes(fresh)
    resumed = Trainer(replace(BASE, resume=os.path.join(out, "ckpt")))
    start = resumed.step_num
    again = train(resumed, 4 - start)
    return {"nodes": list(fresh.grid.nodes), "start": start,
            "fresh_equal": mine == there["dp2tp2"]["steps"] + there["dp2tp2_rest"]["steps"],
            "weights_equal": weights == there["dp2tp2_rest"]["weights"],
            "resumed_equal": again == there["dp2tp2_rest"]["steps"],
            "resumed_weights_equal": hashes(resumed) == there["dp2tp2_rest"]["weights"]}


SET_BY_TEST = ("MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM", "OMP_NUM_THREADS", "PYTHONPATH", *UCX)


def over_ssh() -> dict:
    with open(os.path.join(out, "cluster.json")) as f:
        there = json.load(f)
    m = measured(Trainer(BASE), 4)
    return {"hosts": world.allgather(MPI.Get_processor_name()),
            "python": world.allgather(sys.executable), "refmp": world.allgather(refmp.__file__),
            "env": world.allgather({k: os.environ.get(k) for k in SET_BY_TEST}),
            "ledger": m["ledger"], "sent": m["sent"], "resent": m["resent"],
            "steps_equal": m["steps"] == there["dp2tp2"]["steps"] + there["dp2tp2_rest"]["steps"],
            "weights_equal": m["weights"] == there["dp2tp2_rest"]["weights"]}


rec = recorder.Recorder()
recorder.install(rec)  # every grid records into it: the watchdog reads it
trace = os.path.join(out, "trace")  # on a directory every node shares (refmp cluster --share)
watchdog = Watchdog(world, rec, 20.0, trace).start()  # a hang in the runs above ends the job
result = {"cluster": cluster, "host": host, "ssh": over_ssh}[mode]()
if world.rank == 0:
    with open(os.path.join(out, f"{mode}.json"), "w") as f:
        json.dump(result, f, indent=1)
watchdog.stop()
if mode == "cluster":  # rank 3, on node1, stops calling MPI: a short watchdog names it
    from refmp.distributed.grid import ProcessGrid

    grid = ProcessGrid(dp=4)
    Watchdog(world, rec, 2.0, trace).start()
    if world.rank == 3:
        while True:
            time.sleep(1)
    grid.world.barrier()
ok = mode == "cluster" or all(v for k, v in result.items() if k.endswith("equal"))
sys.exit(0 if world.bcast(ok, root=0) else 1)  # rank 0 holds the weights' hashes
