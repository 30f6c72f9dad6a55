"""Which ranks share a node, and which groups of the grid cross between nodes.

MPI knows which ranks share memory: ``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`` splits the
world into one communicator per node. A rank's node is numbered by the lowest world rank on
it, so nodes count 0, 1, ... in rank order. A group of ranks is *intra*-node when all its
ranks are on one node, else *inter*-node: its traffic crosses the links between nodes
(InfiniBand or Ethernet, 10-20 times slower than NVLink inside a node; docs/nodes.md).

With Megatron's rank order (tp fastest, then cp, dp, pp) and ranks placed on nodes in
blocks, tp and cp stay inside a node while tp * cp divides the ranks of a node, and dp and
pp go between nodes: the layout a slow link wants, since tp's and cp's traffic is per
layer and per micro-batch, dp's once a step (:func:`crossing` names the axes that cross).

``REFMP_RANKS_PER_NODE=k`` (a testing hook, the same on every rank) takes nodes of k
consecutive ranks instead of asking MPI, so one machine can run what several nodes would.
"""

from __future__ import annotations

import os

from mpi4py import MPI

NODE_SIZE = "REFMP_RANKS_PER_NODE"


def node_ids(world: MPI.Comm) -> tuple[int, ...]:
    """The node of every world rank (collective over ``world``; communicator set-up, like
    the grid's Split, is not ledgered)."""
    pretend = os.environ.get(NODE_SIZE)
    if pretend:
        return tuple(r // int(pretend) for r in range(world.Get_size()))
    shared = world.Split_type(MPI.COMM_TYPE_SHARED)
    first = shared.allreduce(world.Get_rank(), op=MPI.MIN)  # the lowest world rank of my node
    shared.Free()
    firsts = world.allgather(first)
    number = {f: i for i, f in enumerate(sorted(set(firsts)))}
    return tuple(number[f] for f in firsts)


def span(world_ranks, nodes: tuple[int, ...]) -> str:
    """"intra" when the ranks are on one node, else "inter"."""
    return "intra" if len({nodes[r] for r in world_ranks}) == 1 else "inter"


def members(rank: int, sizes: dict[str, int], axes: tuple[str, ...]) -> list[int]:
    """The world ranks of ``rank``'s group along ``axes`` (Megatron's order, as the grid's:
    rank = ((pp dp + dp_i) cp + cp_i) tp + tp_i); pure, for checks before any grid."""
    strides = {"tp": 1, "cp": sizes["tp"], "dp": sizes["tp"] * sizes["cp"],
               "pp": sizes["tp"] * sizes["cp"] * sizes["dp"]}
    out = [rank]
    for a in axes:
        here = rank // strides[a] % sizes[a]  # my coordinate along a
        out = [r + (i - here) * strides[a] for r in out for i in range(sizes[a])]
    return sorted(out)


def crossing(sizes: dict[str, int], nodes: tuple[int, ...]) -> list[str]:
    """The axes among tp and cp whose groups span more than one node (any rank's)."""
    return [a for a in ("tp", "cp") if sizes[a] > 1 and any(
        span(members(r, sizes, (a,)), nodes) == "inter" for r in range(len(nodes)))]


def crossing_notes(sizes: dict[str, int], nodes: tuple[int, ...]) -> list[str]:
    """A warning per axis among tp and cp that crosses nodes, with the reason (what
    ``refmp plan`` says when it keeps tp inside a node)."""
    n = len(set(nodes))
    per_node = nodes.count(0)
    why = {"tp": "its all-reduces (4 per block and micro-batch, each the size of the block's "
                 "activations) cross the link between nodes; refmp plan searches tp only "
                 "within a node",
           "cp": "its ring passes every block's keys and values, every micro-batch, over the "
                 "link between nodes; refmp plan times it at the link's bandwidth"}
    return [f"--{a} {sizes[a]} spans nodes ({n} nodes of {per_node} ranks here): {why[a]}. "
            f"Keep {a} inside a node (tp * cp dividing {per_node}) and put dp or pp between "
            f"nodes (docs/nodes.md)" for a in crossing(sizes, nodes)]
