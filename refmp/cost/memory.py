"""What a rank will hold: an estimate of its bytes from the shapes alone (estimate_memory:
refmp.training.checks compares it with what the node has free before the first step,
docs/faults.md says how close it is), and the planner's figure for a layout (memory: the
stage that needs the most).

Shapes: B global batch, b = B/(dp M) rows of one micro-batch on a rank, M micro-batches,
T sequence, Tl = T/cp tokens per rank, s = Tl/tp with sequence parallelism (else Tl),
C channels, NH heads, V vocabulary (Vl = Vp/tp columns per rank), E experts, K top_k,
L blocks; w bytes per element; pp, dp, cp, tp, ep group sizes.

Parameters, gradients and optimizer state come from the same formulas the memory ledger is
tested against (refmp.cost.zero); activations from the caches' shapes, added up
over the rank's own schedule, micro-batch by micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import cache

from refmp.config import TrainConfig
from refmp.cost.family import cache_extra, is_gpt2
from refmp.cost.family import shapes as family_shapes
from refmp.cost.fp8 import block_cache_delta
from refmp.cost.model import Layout, split, train_config
from refmp.cost.zero import hpz_per_step, local_shapes, memory_per_rank
from refmp.nn.params import GPTConfig
from refmp.nn.slices import BLOCK_BYTES
from refmp.parallel.data.compress import compresses
from refmp.parallel.pipeline.catalog import CATALOG, run_of_steps
from refmp.parallel.pipeline.partition import rank_chunks
from refmp.parallel.placement import expert_coords, padded_vocab


def block_cache_elements(b: int, Tl: int, T: int, C: int, NH: int, tp: int = 1, sp: bool = False,
                         cp_algo: str = "ring", cp: int = 1, recompute: str = "none") -> int:
    """Elements one block's forward cache keeps (docs/tensor_parallel.md's table, with cp).

    Serial: 20 BTC + 2 BT + B NH T (the LayerNorm outputs and rstd, the c_attn and c_fc
    inputs, qkv, the attention output, c_fc's output, tanh and GELU, and attention's
    log-sum-exp: refmp.nn.flash keeps no T x T weights); tp splits the 16 BTC inside the
    column/row pairs and the lse, SP the rest too. With cp each rank holds Tl tokens;
    Ulysses runs that attention on its NH/cp heads over the whole sequence: the lse
    (b, NH/(tp cp), T) and its output before the all-to-all back, BTC/tp; ring attention
    keeps its running output y and lse (b NH Tl (HS + 1) / tp: q and K/V are its copies of
    qkv, counted as qkv; y is the attention output's own buffer when a rank has one head).
    docs/memory.md's recomputation: full keeps the block's input alone; selective changes
    nothing (no softmax weights are kept to drop).
    """
    BTC, BT = b * Tl * C, b * Tl
    if recompute == "full":
        return BTC // tp if sp else BTC  # (b, s, C)
    if cp > 1 and cp_algo == "ring":
        # the ring's lse and its running output y (b, NH/tp, Tl, HS); with one head per rank
        # (or one token) the output y.transpose(0, 2, 1, 3).reshape(b, Tl, C/tp) that c_proj
        # keeps is a view of y, not a copy: the same buffer, counted once (as the output)
        att = b * NH * Tl + (BTC if NH // tp > 1 and Tl > 1 else 0)
    else:  # the lse; Ulysses' output before its all-to-all back is a buffer of its own
        att = b * NH * Tl + (BTC if cp > 1 else 0)
    if sp:
        return (20 * BTC + 2 * BT + att) // tp
    return 4 * BTC + 2 * BT + (16 * BTC + att) // tp


def moe_extra_bytes(b: int, Tl: int, T: int, C: int, E: int, K: int, cf: float, tp: int = 1,
                    sp: bool = False, w: int = 4, ep: int = 1) -> int:
    """Bytes an MoE MLP's cache keeps beyond a dense MLP's (refmp.nn.moe; an estimate).

    N = b Tl tokens on the rank (b Tl/tp with SP). The experts keep, for each row they run
    on, its input, c_fc's output and GELU's two arrays: 13 C. Without expert parallelism the
    rows are the M kept assignments: K N when nothing is dropped (CF = 0, and mostly with a
    capacity); with a capacity factor an expert takes at most cap = ceil(CF K T/E)
    assignments of a sequence, so M <= min(K N, E b cap), the bound used. Over ep ranks a
    rank's experts run on what every peer sends them, R <= min(ep K N, E b cap): a bound
    again, since routing is not known before it runs. The rest: the combined outputs
    (N, K, C), probabilities (N, E), gates and choices (N, K), the log-sum-exp (N,), and
    int64 indices (N K + M). The dense MLP's c_fc output, tanh and GELU (12 N C, over tp
    without SP) are taken back; the router's input is the c_fc input a dense block keeps
    too. And the rank's E/ep experts' weights, stacked into (E/ep, C, 4C) ... arrays:
    8 C^2 + 5 C each.
    """
    N = b * Tl // tp if sp else b * Tl
    cap = math.ceil(cf * K * T / E)
    kept = min(K * N, E * b * cap) if cf > 0 else K * N  # M, this rank's kept assignments
    rows = min(ep * K * N, E * b * cap) if cf > 0 else ep * K * N  # what its experts run on
    floats = 13 * rows * C + K * N * C + N * E + 2 * N * K + N + E // ep * (8 * C * C + 5 * C)
    return w * (floats - 12 * b * Tl * C // tp) + 8 * (N * K + kept)


def head_cache_bytes(b: int, Tl: int, C: int, V: int, tp: int = 1, sp: bool = False,
                     w: int = 4) -> int:
    """The head's cache (tests/test_tensor_parallel.py's model_activation_bytes, less the
    embedding's): ln_f's input, output and rstd on s positions, Vl columns of the logits and
    the log-sum-exp, the int64 targets (with tp, a bool mask of those my shard owns)."""
    s, BT = (Tl // tp if sp else Tl), b * Tl
    Vl = padded_vocab(V, tp) // tp
    return w * (2 * b * s * C + b * s + BT * Vl + BT) + 8 * BT + (BT if tp > 1 else 0)


def embed_cache_bytes(b: int, Tl: int, tp: int = 1) -> int:
    """The embedding's cache: int64 token ids and positions (with tp, the owned-ids mask)."""
    return 8 * (b * Tl + Tl) + (b * Tl if tp > 1 else 0)


def codec_bytes(shapes: dict[str, dict], codec: str, rank: int = 4, itemsize: int = 4,
                feedback: bool = True) -> int:
    """Bytes a rank's gradient codec keeps between steps (refmp.parallel.data.compress), on
    ``local_shapes``' units, each parameter an n_r x m matrix (its first axis by the rest):

        powersgd  w (n_r m + m R) per matrix it compresses (``compresses``): the error share
                  e_i (with error feedback) and the warm-start Q (always); other tensors 0
        topk      w n_r m per tensor: its error e_i (with error feedback)
        bf16      0 (nothing is kept: each step's rounding is lost)
    """
    tensors = [s for unit in shapes.values() for s in unit.values()]
    if codec == "powersgd":
        return itemsize * sum(math.prod(s) * feedback + rank * math.prod(s[1:])
                              for s in tensors if compresses(s, rank))
    return itemsize * sum(math.prod(s) for s in tensors) if codec == "topk" and feedback else 0


def held_peak(actions, chunk_bytes: dict, shared: dict | None = None) -> int:
    """Peak bytes of the caches a rank's action list keeps alive: F makes chunk c's cache of a
    micro-batch, B frees it (W does, when the schedule splits backward). ``shared``: bytes
    that every micro-batch's cache of chunk c references (one array, not one each), counted
    once while any of them is alive."""
    split = {(a.mb, a.chunk) for a in actions if a.kind == "W"}  # B's whose W is listed
    shared = shared or {}
    live = peak = 0  # bytes of the caches alive now
    alive = dict.fromkeys(chunk_bytes, 0)  # caches of each chunk alive now
    for a in actions:
        if a.kind == "F":
            live += chunk_bytes[a.chunk] + (shared.get(a.chunk, 0) if not alive[a.chunk] else 0)
            alive[a.chunk] += 1
        elif a.kind == "W" or (a.kind == "B" and (a.mb, a.chunk) not in split):
            alive[a.chunk] -= 1
            live -= chunk_bytes[a.chunk] + (shared.get(a.chunk, 0) if not alive[a.chunk] else 0)
        peak = max(peak, live)
    return peak


def estimate_memory(cfg, mcfg, sizes: dict, coords: dict) -> dict[str, int]:
    """Bytes one rank (at ``coords`` of a grid of ``sizes``) will hold, estimated.

    ``params``, ``grads``, ``optimizer``: refmp.cost.zero.memory_per_rank on the
    rank's units (local_shapes: its tp shards of its stage's blocks, its E/ep experts), dense
    units over dp x cp, expert units over edp = dp cp/ep (AdamW: 2 moments; SGD: 1 with
    momentum, else 0). ``activations``: the caches its schedule keeps alive at once
    (held_peak over its action list; a chunk's cache is its blocks' block_cache_elements,
    plus the embedding's on the first chunk and the head's on the last): what
    Engine.memory()["activations"] measures.
    ``error_feedback``: the gradient codec's buffers (codec_bytes), in the steady state.
    ``versions``: older weight versions kept, each a copy of the compute weights as held
    (with hpZ the secondary slices alone, Sharder.snapshot): 2BW's W(t-1), and pipedream's
    pp - 1 - s on stage s (the schedule catalog's ``versions``, less the current one).
    ``workspace``: a backward's temporaries (the gradients of a cache's arrays), taken as
    one more whole cache of the largest piece, as recomputation rebuilds it (with ZeRO-3,
    plus the largest unit, gathered whole while it runs), and the largest set of gradients
    one backward returns at once (grads_at_once). ``setup``: what building adds to
    the state for a moment (setup_bytes): the rank reads its share one parameter at a time.
    """
    w = 8 if cfg.dtype == "float64" else 4
    pp, dp, cp, tp, ep = (sizes[a] for a in ("pp", "dp", "cp", "tp", "ep"))
    T = cfg.block_size or mcfg.block_size
    C, NH, V, M = mcfg.n_embd, mcfg.n_head, mcfg.vocab_size, cfg.microbatches
    sched = CATALOG[cfg.schedule]
    placed = sched.chunk_placement(pp, cfg.virtual_stages)
    S, r = pp * placed.v, coords["pp"]
    chunks = rank_chunks(mcfg, T, r, placed, cfg.stage_layers)
    stage_blocks = [i for c in chunks.values() for i in c]
    ex = expert_coords(sizes, coords)  # refmp.distributed.grid: the experts' ep (and etp) rank
    shapes = local_shapes(mcfg, tp, stage_blocks, 0 in chunks, S - 1 in chunks, ep, ex["ep"],
                          sizes.get("etp") or 1)
    units = {u: sum(math.prod(s) for s in unit.values()) for u, unit in shapes.items()}
    dense = {u: n for u, n in units.items() if not u.endswith(".experts")}
    expert = {u: n for u, n in units.items() if u.endswith(".experts")}
    shard = (cfg.dp_shard or dp) * cp  # the dense units' ZeRO group (HSDP: a shard group)
    mem = memory_per_rank(dense, shard, cfg.zero, w)
    version = mem["params"]  # a weight version copies the weights as held
    if cfg.hpz_size > 1:  # hpZ: the secondary slices too, and a version keeps those alone
        hpz = hpz_per_step(dense, dp * cp, cfg.hpz_size, w)
        mem["params"] = hpz["params"]
        version = hpz["secondary"]
    held = memory_per_rank(expert, ex["edp_size"], cfg.zero, w)  # expert units, over edp
    for k, n in held.items():
        mem[k] += n
    version += held["params"]
    if cfg.optimizer == "sgd":
        mem["optimizer"] = mem["optimizer"] // 2 if cfg.momentum else 0
    # the codec's buffers, in the gradients' dtype (a codec takes fp32 gradients)
    mem["error_feedback"] = codec_bytes(shapes, cfg.grad_compress, cfg.compress_rank,
                                        w if cfg.mixed_precision == "none" else 4,
                                        not cfg.no_error_feedback)
    mem["versions"] = (sched.versions(pp, r) - 1) * version  # beyond the current weights
    # activations: one micro-batch's cache per chunk, then the schedule's peak
    b, Tl = cfg.batch_size // (dp * M), T // cp
    sp, cf = cfg.sequence_parallel, mcfg.capacity_factor
    rebuilt = w * block_cache_elements(b, Tl, T, C, NH, tp, sp, cfg.cp_algo, cp)
    block = w * block_cache_elements(b, Tl, T, C, NH, tp, sp, cfg.cp_algo, cp, cfg.recompute)
    block += w * cache_extra(mcfg, b, Tl, tp, sp, cfg.recompute)  # GQA, SwiGLU (refmp.cost.family)
    rebuilt += w * cache_extra(mcfg, b, Tl, tp, sp, "none")
    moe = moe_extra_bytes(b, Tl, T, C, mcfg.n_expert, mcfg.top_k, cf, tp, sp, w, ep) \
        if mcfg.n_expert else 0
    kept_moe = 0 if cfg.recompute == "full" else moe
    if cfg.fp8 != "none" and cfg.recompute != "full" and not sp and cp == 1 and is_gpt2(mcfg):
        fp8 = {i: block_cache_delta(b, Tl, C, tp, w, cfg.fp8, mcfg.is_moe(i)) for i in stage_blocks}
    else:  # (refmp.cost.fp8's GPT-2 linears; with SP or cp the FP8 caches are not counted)
        fp8 = dict.fromkeys(stage_blocks, 0)
    head = head_cache_bytes(b, Tl, C, V, tp, sp, w)
    embed = embed_cache_bytes(b, Tl, tp)
    # with cp the positions (Tl,) are the engine's one array of this rank's token positions,
    # which every micro-batch's embedding cache references: counted once, not per micro-batch
    shared = {0: 8 * Tl} if cp > 1 and 0 in chunks else {}
    chunk_bytes = {c: sum(block + fp8[i] + (kept_moe if mcfg.is_moe(i) else 0) for i in chunks[c])
                   + (embed - 8 * Tl * (cp > 1) if c == 0 else 0)
                   + (head if c == S - 1 else 0) for c in chunks}
    # 2bw and pipedream carry caches from step to step: the peak over a run of 2 pp steps
    acts = (sched.actions(pp, M, r, placed.v) if sched.flushes
            else run_of_steps(cfg.schedule, pp, M, r, 2 * pp))
    mem["activations"] = held_peak(acts, chunk_bytes, shared)
    # a backward rebuilds what recomputation dropped: the whole cache of the block it runs
    mem["workspace"] = max([rebuilt + moe] + ([head] if S - 1 in chunks else []))
    if cfg.zero == 3:  # and the whole unit gathered for the forward or backward running now
        mem["workspace"] += w * max(units.values())
    # and the gradients a backward returns at once, before the Sharder adds them in: a
    # block's (its dense unit and its experts), or the embedding's (wte, wpe), the head's
    mem["workspace"] += w * grads_at_once(units, 0 in chunks, S - 1 in chunks)
    if cfg.zero >= 2:  # and a unit's whole gradient (Pp,), summed into until its reduce-scatter
        mem["workspace"] += w * max(units.values())
    mem["setup"] = setup_bytes(cfg, shapes, dp * cp, ex["edp_size"], w, shard)
    return mem


def grads_at_once(units: dict, first: bool, last: bool) -> int:
    """Elements of the largest set of gradients one backward returns together (Stage's
    block_backward, embed_backward, head_backward): a block's dense unit plus its experts',
    wte and wpe on the first stage, wte and ln_f on the last."""
    blocks = [n + units.get(f"{u}.experts", 0) for u, n in units.items()
              if u.startswith("h.") and not u.endswith(".experts")]
    head = units.get("lm_head", units.get("wte", 0))  # an untied head: lm_head
    ends = ([units["wte"] + units.get("wpe", 0)] if first else []) + (
        [head + units["ln_f"]] if last else [])
    return max(blocks + ends, default=0)


def setup_bytes(cfg: TrainConfig, shapes: dict, n: int, edp: int, w: int,
                shard: int | None = None) -> int:
    """What a rank holds beyond its state while it builds (placement.ShardReader and the
    Sharder, one unit at a time): its largest single read, a parameter's tp shard (at
    ZeRO-3 without hpZ, only the part of it its slice owns: at most S elements of its unit),
    and two read chunks (the block drawn or read and its cut, slices.BLOCK_BYTES each); one
    whole unit's flat buffer in w bytes where it is not kept (mixed precision before its
    rounding to the compute copy; ZeRO-3 with hpZ before it keeps its slices).
    ``shapes``: unit -> {name: tp shard shape} (local_shapes); ``n`` the dense units' group
    (dp cp), ``edp`` the experts' (n/ep; with folding dp cp tp/(etp ep)); ``shard`` the
    dense units' ZeRO group where HSDP makes it smaller (default n)."""
    owned = cfg.zero == 3 and cfg.hpz_size <= 1
    one, unit = 0, 0
    for u, ks in shapes.items():
        P = sum(math.prod(s) for s in ks.values())
        biggest = max(math.prod(s) for s in ks.values())
        group = edp if u.endswith(".experts") else shard or n
        one = max(one, min(biggest, -(-P // group)) if owned else biggest)
        unit = max(unit, P)
    whole_unit = (cfg.mixed_precision != "none" and cfg.zero < 3) or (
        cfg.zero == 3 and not owned)
    return w * (one + (unit if whole_unit else 0)) + 2 * BLOCK_BYTES


@cache
def model_elements(mcfg: GPTConfig) -> int:
    """Elements of the whole model, every parameter (remembered: the planner asks per layout)."""
    return sum(math.prod(s) for s in family_shapes(mcfg).values())


def need_bytes(mem: dict) -> int:
    """The peak of a rank: its state, plus the larger of the set-up's transient (one read,
    freed before the first step) and the step's activations and workspace."""
    step = mem["activations"] + mem["workspace"]
    state = mem["params"] + mem["grads"] + mem["optimizer"] + mem.get("error_feedback", 0) \
        + mem.get("versions", 0)
    return state + max(mem["setup"], step)


def size(n: float) -> str:
    """Bytes for people: 3 significant digits and a decimal unit (30.8 TB)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000:
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} PB"


def memory(lay: Layout, mcfg: GPTConfig, batch: int, dtype: str = "float32") -> dict[str, int]:
    """Bytes per rank, the max over the pipeline stages of stage_memory; ``stage`` says
    which stage needs the most (params + grads + optimizer + activations)."""
    cfg = train_config(lay, mcfg, batch, dtype)
    sizes = {"pp": lay.pp, "dp": lay.dp, "cp": lay.cp, "tp": lay.tp, "ep": lay.ep,
             **({"etp": lay.etp} if lay.etp else {})}  # folding: the experts' own grid
    blocks = split(mcfg, lay.pp * lay.virtual_stages)
    placed = CATALOG[lay.schedule].chunk_placement(lay.pp, lay.virtual_stages)
    n_blocks = [sum(len(blocks[c]) for c in placed.chunks(r)) for r in range(lay.pp)]  # per stage
    # the first stage keeps the most micro-batches in flight and the embeddings, the last the
    # head; a middle one can only exceed them by holding more blocks
    mems = [stage_memory(cfg, mcfg, sizes, r)
            for r in sorted({0, lay.pp - 1, n_blocks.index(max(n_blocks))})]
    return max(mems, key=total)


def stage_memory(cfg: TrainConfig, mcfg: GPTConfig, sizes: dict, r: int) -> dict[str, int]:
    """estimate_memory of the rank at pipeline coordinate r (its tp, dp, cp and ep peers
    hold the same amounts). With mixed precision the engine keeps the compute copy in c
    bytes, gradients in g, and masters plus two moments in 3 w per owned element
    (refmp.cost.zero.memory_per_rank with compute=c, grad=g: linear in the bytes, so a
    rescaling of the estimate's one-precision figures), and its float caches in c bytes."""
    m = estimate_memory(cfg, mcfg, sizes, {"pp": r, "dp": 0, "cp": 0, "tp": 0, "ep": 0})
    w = 8 if cfg.dtype == "float64" else 4
    if cfg.mixed_precision != "none":
        c, g = 2, (4 if cfg.grad_dtype == "fp32" else 2)
        m["params"], m["grads"] = m["params"] * c // w, m["grads"] * g // w
        m["versions"] = m["versions"] * c // w  # copies of the compute weights
        m["optimizer"] = m["optimizer"] * 3 // 2 if cfg.optimizer == "adamw" else m["optimizer"]
        # the caches' floats take c bytes, their int64 ids and targets stay 8: the estimate at
        # both one-precision widths (4 A + I, 8 A + I) separates the two
        other = estimate_memory(replace(cfg, dtype="float64" if w == 4 else "float32"), mcfg,
                                sizes, {"pp": r, "dp": 0, "cp": 0, "tp": 0, "ep": 0})
        for k in ("activations", "workspace"):
            e4, e8 = (m[k], other[k]) if w == 4 else (other[k], m[k])
            m[k] = c * (e8 - e4) // 4 + 2 * e4 - e8
    m["stage"] = r
    return m


def total(m: dict) -> int:
    return m["params"] + m["grads"] + m["optimizer"] + m.get("error_feedback", 0) + m["activations"]
