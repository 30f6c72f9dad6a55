"""Placement: for every parameter, which axis splits it, which axes sum its gradient.

Shapes: C channels, NH heads, V vocabulary, Vp = V padded to a multiple of tp, E experts,
El = E/ep experts per rank; pp, dp, cp, tp, ep (and edp = dp cp / ep) group sizes.

This table is the only place that knows how a layout cuts the model. The engine reads each
shard it holds from a Source with it (held_shards: a ShardReader of held_indices), the
Sharder reads which group reduces each unit, clipping reads who counts each element once,
``--save`` reads how to glue shards back:

    parameter            split              gradient summed over     copies (counted once)
    wte.weight           tp rows (Vp/tp)    dp cp                    dp cp; pp ends (tied)
    c_attn w/b           tp heads (q|k|v)   dp cp                    dp cp
    c_proj.weight (x2)   tp rows            dp cp                    dp cp
    c_fc w/b             tp columns         dp cp                    dp cp
    experts.{e}.*        ep (whole experts) edp (+ tp with SP)       edp tp
    everything else      -                  dp cp (+ tp with SP)     dp cp tp

With MoE parallel folding (--etp >= 1, refmp.parallel.folding) the experts' rows are the
experts' own grid's (refmp.distributed.grid), and each token is dispatched once, so no sum
over tp, with or without SP:

    experts.{e}.c_fc w/b     etp columns, ep    edp                  edp
    experts.{e}.c_proj.w     etp rows, ep       edp                  edp
    experts.{e}.c_proj.b     ep                 edp                  edp etp

(wpe, the LayerNorms, the two c_proj biases and the router are replicated over tp: every tp
rank computes them on the same tokens, or with sequence parallelism on its T/tp of them, and
then their gradients are partial over tp.) Pipeline stages hold disjoint blocks (which
chunks, and their blocks: refmp.parallel.pipeline.partition.rank_chunks); wte lives on the
first stage (embedding) and, with pp > 1, as a copy on the last (the tied head).

Neither two-level strategy changes a row. Hierarchical cp (refmp.parallel.context.hybrid)
splits tokens, not parameters. HSDP (refmp.parallel.data.hsdp) sums the "dp cp" rows in two
levels, a shard group of dp-shard x cp ranks and then its replicas, and the Sharder's slices
of them are owned within a shard group, the same slice by every replica (so clipping counts
it on the first replica: counts_in_norm's ``replicas``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from refmp.nn import experts as M
from refmp.nn.params import param_shapes
from refmp.nn.slices import WHOLE, Index, slice_shape, tp_index
from refmp.runtime import backend

# etp splits of an expert's parameters (folding): name inside the expert -> (dim, kind)
ETP_SPLITS = {"c_fc.weight": (1, None), "c_fc.bias": (0, None), "c_proj.weight": (0, None)}

# tp splits: name inside a block (or the top-level name) -> (dim, kind)
TP_SPLITS = {
    "wte.weight": (0, "vocab"),
    "attn.c_attn.weight": (1, "heads"),
    "attn.c_attn.bias": (0, "heads"),
    "attn.c_proj.weight": (0, None),
    "mlp.c_fc.weight": (1, None),
    "mlp.c_fc.bias": (0, None),
    "mlp.c_proj.weight": (0, None),
}


class Place(NamedTuple):
    tp_split: tuple | None  # (dim, kind) when split over tp, else None
    expert: int | None  # the expert index, for expert parameters
    reduce: tuple[str, ...]  # grid axes (or "edp") its gradient is summed over
    copies: tuple[str, ...]  # axes holding identical copies after the sums (count once)


def local_name(name: str) -> str:
    """The name inside a block (``attn.c_attn.weight``), or the top-level name."""
    return name.split(".", 2)[-1] if name.startswith("h.") else name


def place(name: str, sp: bool, folded: bool = False) -> Place:
    """The row of the table above for ``name`` (sp: sequence parallelism is on; folded: MoE
    parallel folding, --etp >= 1)."""
    m = M.EXPERT.search(name)
    tp_extra = ("tp",) if sp else ()
    if m is not None and folded:
        whole = expert_split(name) is None  # c_proj.bias: a copy on every etp rank
        return Place(None, int(m.group(1)), ("edp",), ("edp", "etp") if whole else ("edp",))
    if m is not None:
        return Place(None, int(m.group(1)), ("edp", *tp_extra), ("edp", "tp"))
    split = TP_SPLITS.get(local_name(name))
    if split is not None:
        return Place(split, None, ("dp", "cp"), ("dp", "cp"))
    return Place(None, None, ("dp", "cp", *tp_extra), ("dp", "cp", "tp"))


def expert_split(name: str):
    """(dim, kind) of an expert parameter's split over etp, or None (c_proj.bias: whole)."""
    return ETP_SPLITS.get(name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1])


def padded_vocab(V: int, tp: int) -> int:
    """V rounded up to a multiple of tp (wte's rows are split evenly; the extra rows are 0)."""
    return -(-V // tp) * tp


# --- who holds what: the ownership rules (the engine, the memory estimate and the planner) ---


def expert_coords(sizes: dict[str, int], coords: dict[str, int]) -> dict[str, int]:
    """A rank's place on the experts' grid (refmp.distributed.grid), and the edp group's size:
    without folding (no ``sizes["etp"]``) ep and edp from dp x cp; with it, etp, ep and edp
    refolded from the stage's l = (dp_i cp + cp_i) tp + tp_i."""
    ep, etp, cp, tp = sizes["ep"], sizes.get("etp", 0), sizes["cp"], sizes["tp"]
    f = coords["dp"] * cp + coords["cp"]
    if not etp:
        return {"etp": 0, "ep": f % ep, "edp": f // ep, "edp_size": sizes["dp"] * cp // ep}
    ell = f * tp + coords["tp"]
    return {"etp": ell % etp, "ep": ell // etp % ep, "edp": ell // (etp * ep),
            "edp_size": sizes["dp"] * cp * tp // (etp * ep)}


def expert_owner(e: int, n_expert: int, ep: int) -> int:
    """The ep rank holding expert e: experts [r El, (r+1) El) on ep rank r (El = E/ep)."""
    return e // (n_expert // ep)


def holds(name: str, blocks, first: bool, last: bool, ep_rank: int = 0, n_expert: int = 0,
          ep: int = 1) -> bool:
    """Whether a rank running ``blocks`` (the first stage: ``first``, the last: ``last``) at
    this ep rank holds parameter ``name`` (its tp shard): its blocks' weights, wte and wpe on
    the first stage, ln_f and the tied wte on the last, and only its own experts."""
    top = name.split(".")[0]
    if top == "h":
        if int(name.split(".")[1]) not in blocks:
            return False
    elif not ((top in ("wte", "wpe") and first) or (top in ("wte", "ln_f") and last)):
        return False
    e = place(name, False).expert
    return e is None or expert_owner(e, n_expert, ep) == ep_rank


def shards_held(params: dict, blocks, first: bool, last: bool, tp, ep, n_expert: int = 0) -> dict:
    """From the whole model ``params``: this rank's tp shard (tp_shard) of every parameter it
    holds (holds), in the model's order. ``tp``, ``ep``: the rank's groups (their rank and
    size). The engine's and the decoder's selection."""
    return {k: tp_shard(k, v, tp.rank, tp.size) for k, v in params.items()
            if holds(k, blocks, first, last, ep.rank, n_expert, ep.size)}


def shard_index(name: str, shape: tuple[int, ...], rank: int, tp: int, etp_rank: int = 0,
                etp: int = 1) -> Index:
    """The refmp.nn.slices.Index of tp rank ``rank``'s shard of parameter ``name`` (global
    ``shape``): exactly tp_shard's piece, padded vocabulary rows included; an expert's,
    its etp rank ``etp_rank``'s piece (folding; etp 1: the whole expert)."""
    if M.EXPERT.search(name) is not None:
        split = expert_split(name)
        return WHOLE if split is None or etp == 1 else tp_index(shape, *split, etp_rank, etp)
    split = TP_SPLITS.get(local_name(name))
    return WHOLE if split is None else tp_index(shape, *split, rank, tp)


def held_indices(shapes: dict, blocks, first: bool, last: bool, tp, ep,
                 n_expert: int = 0, etp=None) -> dict[str, Index]:
    """shards_held without the arrays: for every parameter this rank holds (``shapes``: the
    global shapes, in the model's order), the Index of its tp shard (an expert's: its etp
    shard, with ``etp`` the rank's etp group), what a Source reads."""
    e_rank, e_size = (0, 1) if etp is None else (etp.rank, etp.size)
    return {k: shard_index(k, s, tp.rank, tp.size, e_rank, e_size) for k, s in shapes.items()
            if holds(k, blocks, first, last, ep.rank, n_expert, ep.size)}


class ShardReader:
    """This rank's tp shard of every parameter it holds, read from a Source one at a time:
    what the Sharder builds its units from (as refmp.parallel.data.sharder.InMemory).
    ``indices``: name -> the Index of its shard (held_indices); ``shapes`` the
    shards' shapes; ``read(name, flat)`` the shard, or elements [a, b) of it flattened
    (ZeRO-3's owned range), in ``dtype`` on the backend's device."""

    def __init__(self, source, shapes: dict, indices: dict, dtype):
        self.source = source
        self.indices = indices
        self.dtype = np.dtype(dtype)
        self.shapes = {k: slice_shape(shapes[k], i) for k, i in indices.items()}
        self.xp = backend.xp

    def read(self, name: str, flat: tuple[int, int] | None = None):
        index = self.indices[name]
        if flat is not None:
            index = index._replace(flat=flat)
        return backend.from_host(self.source.read(name, index, self.dtype))


def held_shards(mcfg, source, chunks: dict[int, range], first: bool, last: bool, grid,
                dtype) -> ShardReader:
    """The reader of this rank's share (placement.holds: its chunks' blocks, the ends' wte,
    wpe and ln_f, its experts; each parameter's tp shard) of ``source``."""
    blocks = {i for c in chunks.values() for i in c}
    shapes = param_shapes(mcfg)
    indices = held_indices(shapes, blocks, first, last, grid.comm["tp"], grid.comm["ep"],
                           mcfg.n_expert, grid.comm["etp"])
    return ShardReader(source, shapes, indices, dtype)


def unit_of(name: str) -> str:
    """The Sharder unit of a parameter: ``wte``, ``wpe``, ``h.{i}``, ``h.{i}.experts``, ``ln_f``
    (a Llama model's untied head: ``lm_head``).

    wte is a unit of its own so that the two pipeline ends hold it with the same flat layout
    (its tied gradient is then summed shard by shard, whatever the ZeRO stage)."""
    if not name.startswith("h."):
        return name.split(".")[0]
    block = ".".join(name.split(".")[:2])
    return f"{block}.experts" if M.EXPERT.search(name) else block


def units_of(names) -> dict[str, list[str]]:
    """The Sharder units of these parameter names (unit -> its names, both in order)."""
    units: dict[str, list[str]] = {}
    for k in names:
        units.setdefault(unit_of(k), []).append(k)
    return units


def counts_in_norm(pieces, local: dict, coords: dict[str, int], sp: bool, partitioned: bool,
                   first: bool, last: bool, row=place,
                   replicas: dict | None = None) -> dict[str, bool]:
    """Whether a rank counts each owned piece in the global norm: on the rank of its copies
    (the table's "copies" axes, less dp, cp and edp when the Sharder ``partitioned`` them) at
    coordinate 0, and the tied wte on the first stage only; padding (gradient 0) everywhere.
    ``row``: a model family's place (refmp.parallel.family), default GPT-2's. ``replicas``:
    unit -> the group of ranks that own the same slice of it (HSDP's replicas, the Sharder's
    ``replicas``): a piece of such a unit counts on the group's rank 0 only."""
    split_axes = {"dp", "cp", "edp"} if partitioned else set()
    replicas = replicas or {}
    counts = {}
    for k in pieces:
        padding = k.endswith(".padding")
        full = k.rsplit(".padding", 1)[0] if padding else k
        copies = () if full not in local else row(full, sp).copies
        across = replicas.get(full if padding else unit_of(k))  # a padding piece: its unit's
        counts[k] = (all(coords[a] == 0 for a in copies if a not in split_axes)
                     and (across is None or across.rank == 0)
                     and not (k == "wte.weight" and last and not first))
    return counts


# --- slicing a full parameter to this rank's shard, and gluing shards back -------------------


def tp_shard(name: str, full, rank: int, tp: int):
    """This tp rank's piece of the full parameter (a copy)."""
    xp = backend.array_module(full)
    split = TP_SPLITS.get(local_name(name))
    if split is None or tp == 1:
        return full.copy()
    dim, kind = split
    if kind == "vocab" and full.shape[0] % tp:  # padding rows, zero
        pad = xp.zeros((padded_vocab(full.shape[0], tp) - full.shape[0],) + full.shape[1:],
                       full.dtype)
        full = xp.concatenate([full, pad])  # (Vp, C)
    if kind == "heads":  # (.., 3C) as (.., 3, C): my heads' columns of each of q, k and v
        C = full.shape[dim] // 3
        packed = full.reshape(full.shape[:-1] + (3, C))
        n = C // tp
        shard = xp.ascontiguousarray(packed[..., rank * n : (rank + 1) * n])  # (.., 3, C/tp)
        return shard.reshape(full.shape[:-1] + (3 * n,))  # (.., 3C/tp) = [q_r | k_r | v_r]
    n = full.shape[dim] // tp
    sl = [slice(None)] * full.ndim
    sl[dim] = slice(rank * n, (rank + 1) * n)
    return full[tuple(sl)].copy()


def tp_unshard(name: str, pieces: list, V: int):
    """The full parameter from every tp rank's piece, in rank order (inverse of tp_shard)."""
    xp = backend.array_module(pieces[0])
    split = TP_SPLITS.get(local_name(name))
    if split is None or len(pieces) == 1:
        return pieces[0]
    dim, kind = split
    if kind == "heads":  # each piece is [q_r | k_r | v_r]: regroup as [q | k | v]
        packed = xp.stack([p.reshape(p.shape[:-1] + (3, -1)) for p in pieces], axis=-2)
        return packed.reshape(packed.shape[:-3] + (-1,))
    full = xp.concatenate(pieces, axis=dim)
    return full[:V] if kind == "vocab" else full


def gather_tp(params: dict, tp, V: int) -> dict:
    """Every parameter of ``params`` whole, unpadded, on every tp rank (all-gathers over tp)."""
    out = {}
    for k, v in params.items():
        split = TP_SPLITS.get(local_name(k))
        if split is None or tp.size == 1:
            out[k] = v
            continue
        xp = backend.array_module(v)
        dim = split[0]
        moved = xp.moveaxis(v, dim, 0)  # split axis first
        got = tp.allgather(xp.ascontiguousarray(moved))  # (tp * n, ...) pieces in rank order
        pieces = [xp.moveaxis(a, 0, dim) for a in got.reshape((tp.size, -1) + moved.shape[1:])]
        out[k] = tp_unshard(k, pieces, V)
    return out


def gather_etp(params: dict, etp) -> dict:
    """``params`` with every expert's etp pieces glued back whole (all-gathers over etp)."""
    out = dict(params)
    for k, v in params.items():
        split = expert_split(k) if M.EXPERT.search(k) else None
        if split is None or etp.size == 1:
            continue
        xp = backend.array_module(v)
        moved = xp.moveaxis(v, split[0], 0)  # split axis first
        got = etp.allgather(xp.ascontiguousarray(moved))  # (etp * n, ...) in rank order
        out[k] = xp.moveaxis(got, 0, split[0])
    return out


def gather_experts(params: dict, ep, n_expert: int) -> dict:
    """``params`` with every MoE layer's experts (any family's) gathered over ep (collective)."""
    xp = backend.xp
    out = dict(params)
    layers = sorted({k.split(".")[1] for k in params if M.EXPERT.search(k)}, key=int)
    for i in layers:
        pre = f"h.{i}.mlp.experts."
        ids = sorted({int(M.EXPERT.search(k).group(1)) for k in params if k.startswith(pre)})
        for s in dict.fromkeys(M.EXPERT.split(k)[-1] for k in params if k.startswith(pre)):
            stacked = ep.allgather(xp.stack([params[f"{pre}{e}.{s}"] for e in ids]))  # (E, ...)
            out.update({f"{pre}{e}.{s}": stacked[e] for e in range(n_expert)})
    return out
