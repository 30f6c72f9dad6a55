"""ProcessGrid: world rank <-> (pp, dp, cp, tp) coordinates and a communicator per axis group.

Ranks are laid out with tp fastest, then cp, then dp, and pp slowest (Megatron-LM's order),
so tensor-parallel peers are neighbours (on one node, where the links are fastest):

    rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i

Expert parallelism is carved out of the dp x cp ranks (Megatron's MoE parallel folding):
number the dp x cp ranks of one (pp, tp) slice f = dp_i * cp + cp_i; ``ep`` divides dp * cp,
the ep group of a rank is the block of ``ep`` consecutive f containing it, and ``edp`` (the
ranks holding the same experts, which sum their gradients) is the rest of dp x cp:

    ep rank = f % ep,   edp rank = f // ep

Non-expert weights stay replicated over all of dp x cp.

With ``etp`` >= 1 the experts get a grid of their own over a stage's ranks, etp x ep x edp
(MoE parallel folding: refmp.distributed.expert_grid); else ``comm["etp"]`` is this rank.

On several nodes (``nodes``, refmp.distributed.topology) a group's ledger label says whether
it stays inside a node or crosses between nodes: ``dp[inter]``.

The grid is an object passed explicitly; there is no module-level global. Validation is a
pure function of the sizes (:func:`check_sizes`), so every rank refuses a bad layout with the
same message before any communication.
"""

from __future__ import annotations

from mpi4py import MPI

from refmp.config import check_sizes
from refmp.distributed import topology
from refmp.distributed.comm import Comm
from refmp.distributed.expert_grid import fold
from refmp.distributed.ledger import Ledger
from refmp.distributed.recorder import for_new_grid

AXES = ("pp", "dp", "cp", "tp")  # slowest to fastest


class ProcessGrid:
    """This rank's coordinates on the grid and a :class:`Comm` per axis and group of axes.

    ``grid.comm["dp"]`` reaches the ranks that differ from this one only in dp, and so on;
    ``grid.group("dp", "cp")`` those that differ only in dp and cp (made once, then cached;
    its ledger label is "dp+cp", naming only the axes of size > 1); ``grid.comm["ep"]`` and
    ``grid.comm["edp"]`` are the expert-parallel group and the matching expert-data-parallel
    group; ``grid.world`` is everyone. All share one ledger and one flight recorder.
    """

    def __init__(self, world: MPI.Comm | None = None, *, pp: int = 1, dp: int | None = None,
                 cp: int = 1, tp: int = 1, ep: int = 1, etp: int = 0):
        world = MPI.COMM_WORLD if world is None else world
        self.mpi = world
        self.sizes = check_sizes(world.Get_size(), pp, dp, cp, tp, ep, etp)
        self.folded = etp > 0
        self.ledger = Ledger()
        self.recorder = for_new_grid()
        self.nodes = topology.node_ids(world)  # each world rank's node (MPI's shared memory)
        self.world = self._comm(world, "world")
        self.rank = world.Get_rank()
        self.coords = self.coords_of(self.rank)
        self._groups: dict[tuple[str, ...], Comm] = {}
        self.comm: dict[str, Comm] = {axis: self.group(axis) for axis in AXES}
        if self.folded:  # the experts' own etp, ep and edp groups
            self.comm.update({a: self._comm(c, a) for a, c in fold(self, etp).items()})
            return
        # ep / edp: carved from the dp x cp ranks of this (pp, tp) slice (module docstring)
        ep_size, n = self.sizes["ep"], world.Get_size()
        f = self.coords["dp"] * self.sizes["cp"] + self.coords["cp"]
        base = self.rank_of(**{**self.coords, "dp": 0, "cp": 0})  # names the (pp, tp) slice
        self.comm["ep"] = self._comm(world.Split(base + (f // ep_size) * n, f % ep_size), "ep")
        self.comm["edp"] = self._comm(world.Split(base + (f % ep_size) * n, f // ep_size), "edp")
        self.comm["etp"] = self._comm(world.Split(self.rank, 0), "etp")  # this rank alone

    def group(self, *axes: str) -> Comm:
        """The ranks that differ from this one only along ``axes`` (cached; collective the
        first time: every rank must ask for the same groups in the same order)."""
        key = tuple(a for a in AXES if a in axes)
        if key not in self._groups:
            # colour: my rank with these axes' coordinates zeroed; key: my index inside
            colour = self.rank_of(**{**self.coords, **{a: 0 for a in key}})
            index = 0
            for a in key:
                index = index * self.sizes[a] + self.coords[a]
            label = "+".join(a for a in key if self.sizes[a] > 1) or key[0]
            self._groups[key] = self._comm(self.mpi.Split(colour, index), label)
            self._groups[key].cuda_aware = self.world.cuda_aware
        return self._groups[key]

    def _comm(self, mpi_comm: MPI.Comm, label: str) -> Comm:
        comm = Comm(mpi_comm, label, self.ledger, self.recorder)
        if len(set(self.nodes)) > 1:  # on several nodes: "intra" or "inter" in the ledger
            self.ledger.spans[label] = topology.span(comm.world_ranks, self.nodes)
        return comm

    def size(self, *axes: str) -> int:
        """How many ranks ``group(*axes)`` holds (no communication)."""
        out = 1
        for a in axes:
            out *= self.sizes[a]
        return out

    def set_cuda_aware(self, aware: bool) -> None:
        """Tell every Comm whether device arrays may go to MPI directly."""
        for c in (self.world, *self.comm.values(), *self._groups.values()):
            c.cuda_aware = aware

    def coords_of(self, rank: int) -> dict[str, int]:
        s = self.sizes
        rank, tp_i = divmod(rank, s["tp"])
        rank, cp_i = divmod(rank, s["cp"])
        pp_i, dp_i = divmod(rank, s["dp"])
        return {"pp": pp_i, "dp": dp_i, "cp": cp_i, "tp": tp_i}

    def rank_of(self, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        s = self.sizes
        return ((pp * s["dp"] + dp) * s["cp"] + cp) * s["tp"] + tp

    def describe(self) -> str:
        return " x ".join(f"{a}={n}" for a, n in self.sizes.items())  # (etp with folding)
