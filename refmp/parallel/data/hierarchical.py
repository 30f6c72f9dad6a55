"""Hierarchical all-reduce: a data-parallel group that spans nodes sums inside each node first.

Shapes: P elements of the gradient, n = N G ranks in the group, G of them on each of N nodes,
Pp = P padded up to a multiple of G, S = Pp/G the slice a rank owns between the steps.

    flat          all-reduce over the n ranks                                   (P,)
    hierarchical  1. reduce-scatter inside the node (G ranks):   (Pp,) -> (S,) my slice of
                     my node's sum
                  2. all-reduce of the slice across the nodes (N ranks, the one with my
                     index on each node):                         (S,)  every node's sum
                  3. all-gather inside the node:                  (S,) -> (Pp,) the whole sum

Only step 2 crosses nodes, and it carries S = P/G per rank: a node sends 2 (N-1)/N P over its
link in all (a ring's or recursive doubling's share over N ranks, G ranks each carrying
1/G). A flat algorithm in which every rank exchanges its whole buffer with a rank on another
node (recursive doubling, MPICH's choice for short messages) sends G times that; a ring over
all n ranks crosses each node boundary once, 2 (n-1)/n P (on 2 nodes of 2 ranks: 3/2 the
hierarchical bytes); recursive halving whose first steps stay inside a node (MPICH's choice
for long messages, with a node's ranks consecutive) already sends what the hierarchy does.
The hierarchy holds whatever algorithm MPI picks (docs/nodes.md has the counts measured on
the veth of refmp cluster). Its cost: two more steps inside the node (NVLink's, fast), and
the steps run one after the other when a bucket is ready (no overlap with backward).

Sums: every element is the node sums added across nodes, ((g0 + g1) + (g2 + g3)) on 2 nodes
of 2 ranks, the order of MPICH's recursive doubling and halving when N and G are powers of
two: bitwise the flat result there; against a ring's order (each element added rank after
rank) equal to float64's rounding (tests/test_nodes.py holds 1e-12).

A Comm whose all-reduce takes these three steps and whose other calls are the flat group's:
the Sharder (refmp.parallel.data.sharder) and the codecs use it as they use the flat group.
ZeRO 1-3 partition over the flat group's rank order, so they keep its reduce-scatter and
all-gather (refmp.parallel.rules refuses --dp-reduce hierarchical with --zero > 0).
"""

from __future__ import annotations

from refmp.distributed import topology
from refmp.distributed.comm import Comm
from refmp.errors import ConfigError
from refmp.runtime import backend


def check_nodes(sizes: dict[str, int], nodes: tuple[int, ...], axes: tuple[str, ...]) -> None:
    """Every group along ``axes`` must have the same number of ranks on each of its nodes
    (pure: the same answer on every rank, before any communicator is split)."""
    for r in range(len(nodes)):
        where = [nodes[m] for m in topology.members(r, sizes, axes)]
        if len({where.count(n) for n in where}) > 1:
            raise ConfigError(f"--dp-reduce hierarchical: the {'+'.join(axes)} group of rank "
                              f"{r} has {', '.join(str(where.count(n)) for n in dict.fromkeys(where))}"
                              f" ranks on its nodes; it needs the same number on each")


def two_levels(flat: Comm, block: int, index: int, names: tuple[str, str],
               nodes: tuple[int, ...]) -> tuple[Comm, Comm]:
    """(inner, outer): ``flat``'s ranks split into blocks, ``block`` mine and ``index`` my
    place in it. inner: my block's ranks, in index order; outer: the ranks with my index in
    their blocks, in block order. Ledger labels ``{axis}.{names[0]}`` and
    ``{axis}.{names[1]}``, with ``[intra]`` / ``[inter]`` where the grid spans several
    ``nodes``. Used by the hierarchical all-reduce (blocks: nodes) and by ZeRO++'s hpZ
    (refmp.parallel.data.hpz; blocks: G consecutive ranks)."""
    inner = Comm(flat.mpi.Split(block, index), f"{flat.axis}.{names[0]}", flat.ledger,
                 flat.recorder)
    outer = Comm(flat.mpi.Split(index, block), f"{flat.axis}.{names[1]}", flat.ledger,
                 flat.recorder)
    for c in (inner, outer):
        c.cuda_aware = flat.cuda_aware
        if len(set(nodes)) > 1:  # the ledger says which level crosses nodes
            flat.ledger.spans[c.axis] = topology.span(c.world_ranks, nodes)
    return inner, outer


class HierarchicalComm(Comm):
    """``flat``'s ranks, with an all-reduce in three steps (module docstring): ``inner`` the
    G ranks of my node, ``outer`` the N ranks with my index on theirs. ``nodes``: the node of
    each world rank (ProcessGrid.nodes)."""

    def __init__(self, flat: Comm, nodes: tuple[int, ...]):
        super().__init__(flat.mpi, flat.axis, flat.ledger, flat.recorder)
        self.cuda_aware = flat.cuda_aware
        where = [nodes[w] for w in self.world_ranks]  # each member's node, in group order
        order = list(dict.fromkeys(where))  # the group's nodes
        node = order.index(where[self.rank])
        local = where[: self.rank].count(where[self.rank])  # my index on my node
        inner, outer = two_levels(flat, node, local, ("node", "cross"), nodes)
        self.inner = inner  # the G ranks of my node
        self.outer = outer  # the N ranks with my index on theirs

    def allreduce(self, buf, op: str = "sum"):
        """In-place sum of ``buf`` over the group, in three steps (other ops: flat)."""
        if op != "sum":
            return super().allreduce(buf, op)
        G = self.inner.size
        P = buf.size
        flat = buf.reshape(-1)  # (P,) a view: buf is contiguous
        padded = backend.array_module(buf).zeros(-(-P // G) * G, dtype=buf.dtype)  # (Pp,)
        padded[:P] = flat
        part = self.inner.reduce_scatter(padded)  # (S,) my slice of my node's sum
        self.outer.allreduce(part)  # (S,) my slice of the whole sum: the only step across
        flat[...] = self.inner.allgather(part)[:P]  # (P,) every slice, from my node's ranks
        return buf

    def allreduce_start(self, buf, op: str = "sum"):
        """The three steps, now (they do not overlap with backward); nothing left to wait for."""
        self.allreduce(buf, op)
        return None
