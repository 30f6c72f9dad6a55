"""Step time on nodes that each have one link to the others (refmp cluster's namespaces, or
nodes with one network card): refmp.cost.model's prediction, with the collectives whose
groups cross nodes priced at that link. docs/nodes.md holds it against measured steps.

Shapes: N nodes of G ranks, R a node's link in bytes/s each way, X the bytes a rank's call
moves (the ledger's), n ranks in a group with g of them on each of its N_g = n/g nodes
(Megatron's order puts tp, then cp, dp and pp, on consecutive ranks: a group of stride k has
g = max(1, G/k) on a node).

A node's G ranks are in G groups of each kind that all cross at once (tp peers sum their own
shards over dp, stages send their own activations), so a rank has R/G of the link: that is
the planner's per-GPU ``inter_node_gbs`` of this machine (:func:`cluster`). What crosses is
the algorithm's, and MPI's flat all-reduce is not the planner's ring:

    all-reduce, recursive doubling (MPICH's for short messages; the runs below pin it for
      every size, MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM=sched_recursive_doubling): log2(n)
      steps, each exchanging X with the rank 2^i away: log2(g) inside the node, log2(N_g)
      across, so log2(N_g) X crosses per rank, in log2(N_g) link latencies;
    all-reduce, hierarchical (refmp.parallel.data.hierarchical): a reduce-scatter and an
      all-gather inside the node, 2 (g-1)/g X on the node's links, and 2 (N_g-1)/N_g X/g
      across (a ring over the N_g nodes, 2 (N_g-1) latencies), one after the other;
    send (pipeline boundaries): X, as the planner prices it (``collective``).

The data-parallel sums are priced whole, after backward: a gradient within one bucket
(--bucket-mb 25) starts its all-reduce when backward ends, and the hierarchical one runs its
steps then too. The rest of the step (products, elementwise work, calls, intra-node
collectives, the bubble) is the planner's (refmp.cost.model.predict).
"""

from __future__ import annotations

import math
from dataclasses import replace

from refmp.cost.machines import Machine
from refmp.cost.model import Impl, Layout, predict, split, units_of
from refmp.cost.tensor import comm_bytes_per_step
from refmp.cost.zero import comm_per_step
from refmp.nn.params import GPTConfig
from refmp.parallel.pipeline.catalog import CATALOG

PAYLOAD = 1448 / 1514  # TCP over Ethernet: a full frame's data, without its 66 header bytes


def cluster(host: Machine, ranks_per_node: int, link_gbit: float,
            link_latency_us: float, measured_gbs: float | None = None) -> Machine:
    """``host``'s rates (refmp plan --machine cpu: measured), as nodes of ``ranks_per_node``
    ranks, each node's link ``link_gbit`` each way (the tbf rate: frames, so PAYLOAD of it
    is data, as a shaped link paces TCP into full frames), its G ranks a share each.

    ``measured_gbs``: a rank's share as refmp.cli.calibrate.measure_links finds it across the
    nodes, every pair exchanging at once: the rank's share is the smaller of the two. On
    refmp cluster's nodes TCP runs on the cores the ranks compute on (the kernel's copies,
    the veth pair, the token bucket), so a rank can get less than the set rate's share
    (docs/nodes.md): the set rate alone makes every crossing optimistic."""
    share = link_gbit / 8 * PAYLOAD / ranks_per_node
    if measured_gbs is not None:
        share = min(share, measured_gbs)
    return replace(host, gpus_per_node=ranks_per_node, inter_node_gbs=share,
                   inter_latency_us=link_latency_us, shared_link=True)


def allreduce_across(X: float, n: int, g: int, mach: Machine, hierarchical: bool) -> float:
    """Seconds of one all-reduce of X bytes over n ranks, g on each node (module docstring)."""
    N = n // g
    bw, lat = mach.inter_node_gbs * 1e9, mach.inter_latency_us * 1e-6
    ibw, ilat = mach.intra_node_gbs * 1e9, mach.intra_latency_us * 1e-6
    if hierarchical:
        inside = 2 * (g - 1) / g * X / ibw + 2 * (g - 1) * ilat if g > 1 else 0.0
        return inside + 2 * (N - 1) / N * X / g / bw + 2 * (N - 1) * lat
    steps_in, steps_out = math.log2(g), math.log2(N)
    return steps_in * (X / ibw + ilat) + steps_out * (X / bw + lat)


def predict_on_nodes(lay: Layout, mcfg: GPTConfig, batch: int, mach: Machine,
                     dp_reduce: str = "flat", impl: Impl | None = None) -> dict:
    """refmp.cost.model.predict, with tp's and dp's all-reduces re-priced where their groups
    cross nodes (``mach``: :func:`cluster`'s). Same keys; ``seconds`` by term."""
    pred = predict(lay, mcfg, batch, mach, impl or Impl())
    t = dict(pred["seconds"])
    G, tp, pp, n = mach.gpus_per_node, lay.tp, lay.pp, lay.dp * lay.cp
    c = 2 if lay.mixed_precision != "none" else 4
    M, Tl, bd = batch // (lay.dp * lay.microbatch_size), mcfg.block_size // lay.cp, batch // lay.dp
    blocks = split(mcfg, pp * lay.virtual_stages)
    stages = []
    placed = CATALOG[lay.schedule].chunk_placement(pp, lay.virtual_stages)
    for r in range(pp):  # the tp and dp terms of each stage, re-priced where they cross
        mine = [i for ch in placed.chunks(r) for i in blocks[ch]]
        first, last = r == 0, r == pp - 1
        t_tp = None
        if tp > G:  # tp's all-reduces cross nodes (no SP here: comm_bytes_per_step's)
            act = bd * Tl * mcfg.n_embd * c
            x = comm_bytes_per_step(bd, Tl, mcfg.n_embd, len(mine), False, c)["allreduce"]
            calls = M * round(x / act)
            t_tp = calls * allreduce_across(x / calls, tp, G, mach, False)
        t_dp = None
        if n > 1 and tp * n > G and lay.zero == 0:  # dp's all-reduce crosses nodes
            units = units_of(mcfg, tp, tuple(mine), first, last)
            X = comm_per_step(dict(units), n, 0, M, c, first, last)["allreduce"]
            g = max(1, G // tp)
            t_dp = allreduce_across(X, n, g, mach, dp_reduce == "hierarchical")
        stages.append((t_tp, t_dp))
    for k, i in (("tp", 0), ("dp", 1)):
        priced = [s[i] for s in stages]
        if any(p is not None for p in priced):  # the mean stage (a time-shared CPU) or slowest
            new = sum(priced) / pp if mach.time_shared else max(priced)
            pred["step_seconds"] += new - t[k]
            t[k] = new
    pred["seconds"] = t
    pred["tokens_per_s"] = batch * mcfg.block_size / pred["step_seconds"]
    return pred


def best_reduce(lay: Layout, mcfg: GPTConfig, batch: int, mach: Machine,
                impl: Impl | None = None) -> tuple[str, dict]:
    """(--dp-reduce, prediction): the faster of the flat and the hierarchical all-reduce for
    ``lay`` on ``mach``'s nodes (flat where they tie: dp inside a node, or ZeRO, whose
    collectives are not all-reduces)."""
    flat = predict_on_nodes(lay, mcfg, batch, mach, "flat", impl)
    if lay.zero or lay.dp * lay.cp * lay.tp <= mach.gpus_per_node:
        return "flat", flat
    hier = predict_on_nodes(lay, mcfg, batch, mach, "hierarchical", impl)
    return ("hierarchical", hier) if hier["step_seconds"] < flat["step_seconds"] else ("flat", flat)
