"""What FP8 training (refmp.parallel.fp8) adds: the amaxes' all-reduces, the memory it saves.

Per step, L dense blocks on a rank, M micro-batches, one amax = one float64 (8 bytes):

* ``tensor`` scaling reduces each amax of a tensor tp splits (max over tp), per linear and
  micro-batch: without SP a column linear's W and dY, a row linear's X and W (8 a block);
  with SP also the column's X and the row's dY (12 a block). With cp, every X and dY over
  cp (8 a block). So tp: 8 (8 or 12) L M bytes, cp: 8 * 8 L M bytes.
* ``delayed`` scaling does that on its first step only; after each step it reduces its
  (sites, 3) amaxes, 4 L sites, once over tp and once over dp x cp: 8 * 12 L bytes each.
* ``mxfp8`` reduces nothing (its blocks stay inside a shard when C/tp is a multiple of 32).

An MoE block runs two of these linears (attention's), half a dense block's amaxes.

Memory: a linear's cache keeps X (and a reference to W) in FP8, 1 byte an element plus the
scales, where the run without FP8 keeps X in the activations' dtype: the activations
a linear caches shrink by that factor (refmp.cost.memory's per-block terms); MXFP8 adds one
scale byte per 32 elements.
"""

from __future__ import annotations

AMAX_BYTES = 8  # the amaxes travel as float64


def amax_bytes_per_step(recipe: str, n_layer: int, microbatches: int, sp: bool, tp: int,
                        cp: int = 1, dense: int = 1, first_step: bool = True,
                        n_moe: int = 0) -> dict[str, int]:
    """Ledger bytes of the amax all-reduces in one step, by axis ("tp", "cp", and "dense" for
    delayed scaling's history), for ``n_layer`` dense blocks and ``n_moe`` MoE blocks (their
    two attention linears alone: half a dense block's sites) on this rank; ``dense`` the
    dp x cp ranks (the ledger labels that group by its axes of more than one rank)."""
    out = {"tp": 0, "cp": 0, "dense": 0}
    pairs = 2 * n_layer + n_moe  # (column, row) pairs of linears
    per_use = recipe == "tensor" or (recipe == "delayed" and first_step)
    if per_use:
        if tp > 1:
            out["tp"] += AMAX_BYTES * (6 if sp else 4) * pairs * microbatches
        if cp > 1:
            out["cp"] += AMAX_BYTES * 4 * pairs * microbatches
    if recipe == "delayed":
        history = AMAX_BYTES * 3 * 2 * pairs  # (sites, roles) once a step
        if tp > 1:
            out["tp"] += history
        if dense > 1:
            out["dense"] += history
    return out


def amax_allreduces(recipe: str, n_layer: int, n_moe: int, microbatches: int, sp: bool, tp: int,
                    cp: int, dense: int) -> dict[str, tuple[int, int, int, int]]:
    """What refmp.cost.model.predict times of a step after the first: by its axis ("tp", "cp",
    "dp" for the dp x cp group), (bytes, all-reduces, ranks, the ranks the group spans),
    those that move anything. Current scaling reduces each amax alone (8 bytes a call),
    delayed scaling its history in one call a group."""
    if recipe == "none":
        return {}
    got = amax_bytes_per_step(recipe, n_layer, microbatches, sp, tp, cp, dense, False, n_moe)
    groups = {"tp": ("tp", tp, tp), "cp": ("cp", cp, tp * cp), "dp": ("dense", dense, tp * dense)}
    return {axis: (got[k], got[k] // AMAX_BYTES if recipe == "tensor" else 1, n, span)
            for axis, (k, n, span) in groups.items() if got[k]}


def cached_linear_input_bytes(elements: int, itemsize: int, recipe: str) -> int:
    """Bytes a linear's cache holds for an input of ``elements``: ``itemsize`` each without
    FP8, 1 each with it (plus one scale byte per 32 with MXFP8)."""
    if recipe == "none":
        return elements * itemsize
    return elements + (-(-elements // 32) if recipe == "mxfp8" else 1)


def _fp8_bytes(rows: int, cols: int, recipe: str) -> int:
    """Bytes of a (rows, cols) tensor in FP8, blocks (MXFP8) along ``cols``: one byte a value
    and one a scale (MXFP8 pads each row to whole blocks)."""
    if recipe == "mxfp8":
        return rows * -(-cols // 32) * 33
    return rows * cols + 1


def block_cache_delta(b: int, Tl: int, C: int, tp: int, w: int, recipe: str, moe: bool = False) -> int:
    """What FP8 changes in one block's forward cache, in bytes (tp without SP, cp 1, no full
    recomputation): each linear's input X (b Tl, K) is kept in FP8 instead of in ``w``
    bytes, and its weight's FP8 copy (K, N) joins it (without FP8 the cache refers to the
    weight itself, not an activation). Column linears c_attn (C, 3C/tp) and c_fc (C, 4C/tp),
    row linears attn.c_proj (C/tp, C) and mlp.c_proj (4C/tp, C); an MoE block's experts
    stay in the run's dtype. MXFP8 blocks X along K and W along K too. attn.c_proj's input
    is attention's output, which attention's own cache keeps (refmp.nn.flash: its backward
    needs it), so there the FP8 copy adds to the cache and frees nothing."""
    linears = [(C, 3 * C // tp, True), (C // tp, C, False)]  # (K, N, whether X is freed)
    linears += [] if moe else [(C, 4 * C // tp, True), (4 * C // tp, C, True)]
    N = b * Tl
    return sum(_fp8_bytes(N, K, recipe) + _fp8_bytes(n, K, recipe) - freed * w * N * K
               for K, n, freed in linears)
