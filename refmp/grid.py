"""ProcessGrid: world rank <-> (pp, dp, cp, tp) coordinates and one communicator per axis.

Ranks are laid out with tp fastest, then cp, then dp, and pp slowest (Megatron-LM's order),
so tensor-parallel peers are neighbours (on one node, where the links are fastest):

    rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i

Expert parallelism is carved out of the data-parallel ranks: ``ep`` divides ``dp``, and the
ep group of a rank is the block of ``ep`` consecutive dp ranks containing it. Non-expert
weights stay data parallel over all of dp.

The grid is an object passed explicitly; there is no module-level global. Validation is a
pure function of the sizes (:func:`check_layout`), so every rank refuses a bad layout with the
same message before any communication.
"""

from __future__ import annotations

from mpi4py import MPI

from refmp.comm import Comm, Ledger
from refmp.errors import ConfigError

AXES = ("pp", "dp", "cp", "tp")  # slowest to fastest


def check_layout(world_size: int, pp: int = 1, dp: int | None = None, cp: int = 1, tp: int = 1,
                 ep: int = 1) -> dict[str, int]:
    """Validate the layout and return the axis sizes (dp filled in when None)."""
    for name, v in (("pp", pp), ("cp", cp), ("tp", tp), ("ep", ep)):
        if v < 1:
            raise ConfigError(f"--{name} must be at least 1, got {v}")
    if dp is None:
        other = pp * cp * tp
        if world_size % other:
            raise ConfigError(
                f"pp*cp*tp = {pp}*{cp}*{tp} = {other} does not divide the world size {world_size}"
            )
        dp = world_size // other
    if dp < 1:
        raise ConfigError(f"--dp must be at least 1, got {dp}")
    if pp * dp * cp * tp != world_size:
        raise ConfigError(
            f"layout pp*dp*cp*tp = {pp}*{dp}*{cp}*{tp} = {pp * dp * cp * tp} does not match the "
            f"{world_size} MPI processes; launch with `mpiexec -n {pp * dp * cp * tp}` "
            f"or change the sizes"
        )
    if dp % ep:
        raise ConfigError(f"--ep ({ep}) must divide --dp ({dp}): experts are carved from dp ranks")
    return {"pp": pp, "dp": dp, "cp": cp, "tp": tp, "ep": ep}


class ProcessGrid:
    """This rank's coordinates on the grid and a :class:`Comm` per axis.

    ``grid.comm["dp"]`` reaches the ranks that differ from this one only in dp, and so on;
    ``grid.comm["ep"]`` and ``grid.comm["edp"]`` are the expert-parallel group and the
    matching expert-data-parallel group; ``grid.world`` is everyone. All share one ledger.
    """

    def __init__(self, world: MPI.Comm | None = None, *, pp: int = 1, dp: int | None = None,
                 cp: int = 1, tp: int = 1, ep: int = 1):
        world = MPI.COMM_WORLD if world is None else world
        self.sizes = check_layout(world.Get_size(), pp, dp, cp, tp, ep)
        self.ledger = Ledger()
        self.world = Comm(world, "world", self.ledger)
        self.rank = world.Get_rank()
        self.coords = self.coords_of(self.rank)
        self.comm: dict[str, Comm] = {}
        for axis in AXES:
            # colour: the rank with this axis' coordinate zeroed; key: the coordinate
            colour = self.rank_of(**{**self.coords, axis: 0})
            self.comm[axis] = Comm(world.Split(colour, self.coords[axis]), axis, self.ledger)
        # ep: blocks of ep consecutive dp ranks; edp: the dp ranks holding the same experts.
        # Colours must be unique per group: base (< world size) names the (pp, cp, tp) slice.
        ep_size, dp_i, n = self.sizes["ep"], self.coords["dp"], world.Get_size()
        base = self.rank_of(**{**self.coords, "dp": 0})
        self.comm["ep"] = Comm(world.Split(base + (dp_i // ep_size) * n, dp_i % ep_size),
                               "ep", self.ledger)
        self.comm["edp"] = Comm(world.Split(base + (dp_i % ep_size) * n, dp_i // ep_size),
                                "edp", self.ledger)

    def set_cuda_aware(self, aware: bool) -> None:
        """Tell every axis' Comm whether device arrays may go to MPI directly."""
        for c in (self.world, *self.comm.values()):
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

    def __getattr__(self, name: str) -> int:
        # grid.dp, grid.tp, ...: axis sizes; grid.dp_rank, ...: this rank's coordinates
        sizes = self.__dict__.get("sizes", {})
        if name in sizes:
            return sizes[name]
        if name.endswith("_rank") and name[:-5] in AXES:
            return self.__dict__["coords"][name[:-5]]
        raise AttributeError(name)

    def describe(self) -> str:
        return " x ".join(f"{a}={self.sizes[a]}" for a in ("pp", "dp", "cp", "tp", "ep"))
