"""``refmp plan``'s cost model: the planner's layout (Layout: the ParallelConfig fields it
searches, with a micro-batch as its rows b where a run counts M = B / (dp b)), and the seconds
of one step of a layout, by term (the search: refmp.cost.search; the memory:
refmp.cost.memory.memory).

A pure computation (no MPI): the formulas the tests hold refmp's ledgers against, and a
machine description (refmp.cost.machines). Shapes: B global batch, b rows of a micro-batch,
M micro-batches, T sequence, Tl = T/cp, C channels, NH heads, V vocabulary, L blocks (Ls of
a stage); w bytes per element (c: the compute copy's, g: the gradients'); pp, dp, cp, tp, ep
sizes; G GPUs per node. docs/plan.md writes the cost model out, term by term.

Time per step (seconds), per stage: busy = GEMMs + elementwise + tp + cp + ep + pp comm;
the pipeline runs at its slowest stage over (1 - bubble) (the simulator's bubble of the
schedule), then the exposed dp/ZeRO traffic and the optimizer's pass over its state:
  GEMM (m, k, n): max(2 m k n / (e peak), c (m k + k n + m n) / hbm)   (a roofline, e per
    machine), in whole waves of sms output tiles on a GPU; on a CPU times 1 + hm/m + hk/k + hn/n
  elementwise: elementwise_bytes / hbm per block (each memory-bound kernel, one by one)
  calls (a CPU): numpy_calls per block and micro-batch, times the machine's call_us
  a collective over n ranks of bytes X (the ledger's convention): all-reduce
    2 (n-1)/n X / bw + 2 (n-1) lat; reduce-scatter, all-gather, all-to-all (n-1)/n X / bw +
    (n-1) lat; send X / bw + lat. bw is intra-node while the group fits in a node (ranks
    are tp fastest, then cp, dp, pp), else inter-node.
  pp: a send per micro-batch and boundary each way (b Tl C c), and on the first and the last
    stage the tied wte's gradient, swapped between them once a step (V C / tp g; ZeRO: owned)
Impl says what the timed implementation does beyond the layout (refmp's own by default;
MEGATRON_2021 for the published comparison).
"""

from __future__ import annotations

from dataclasses import Field, dataclass, field, fields, make_dataclass, replace
from functools import cache, partial

from refmp.config import ParallelConfig, TrainConfig, flag_name
from refmp.cost.context import cp_ledger, hybrid_cp_ledger
from refmp.cost.expert import folded_per_step
from refmp.cost.family import ffn, is_llama, kv_heads, tied
from refmp.cost.flops import active_params, model_flops_per_step, recompute_flops_per_step
from refmp.cost.fp8 import amax_allreduces
from refmp.cost.machines import Machine
from refmp.cost.tensor import comm_bytes_per_step
from refmp.cost.terms import bubble, collective, elementwise_bytes, gemm, numpy_calls
from refmp.cost.zero import (
    comm_per_step,
    compressed_per_step,
    hsdp_per_step,
    local_shapes,
    prefetched,
    ring_pass,
    unit_sizes,
    zero3_uses,
)
from refmp.nn.params import GPTConfig
from refmp.parallel.pipeline.catalog import CATALOG
from refmp.parallel.pipeline.partition import partition, piece_costs

SEARCHED = tuple(f.name for f in fields(ParallelConfig) if f.metadata["plan"] is not None)
# a plan's defaults where they are not a run's: dp a number, and bf16 (a GPU plan runs in
# mixed precision, as Narayanan et al. 2021 and Korthikanti et al. 2022 do)
PLAN_DEFAULTS = {"dp": 1, "mixed_precision": "bf16"}


def _planned(f: Field) -> tuple:
    if f.name == "microbatches":
        return "microbatch_size", "int", field(default=1, metadata=f.metadata)
    return f.name, f.type, field(default=PLAN_DEFAULTS.get(f.name, f.default), metadata=f.metadata)


Layout = make_dataclass(
    "Layout", [_planned(f) for f in fields(ParallelConfig) if f.name in SEARCHED], frozen=True,
    namespace={"__module__": __name__, "__doc__": "One choice of every axis and option the "
               "planner searches (``--json``'s keys); microbatch_size is b, rows per "
               "micro-batch on a dp rank, so M = B / (dp b)."})


def parallel_fields(lay: dict, batch: int) -> dict:
    """The ParallelConfig fields of a planned layout (a Layout's fields, or a row of the
    search): the searched ones, with M = B / (dp b) micro-batches."""
    chosen = {k: lay[k] for k in SEARCHED if k != "microbatches"}
    return {**chosen, "microbatches": batch // (lay["dp"] * lay["microbatch_size"])}


def layout_flags(lay: dict, short: bool = False) -> str:
    """A planned layout (a Layout's fields, or a row of the search) as refmp train's flags:
    a switch when on; --cp-algo only with cp. ``short``: tp, pp, dp and the flags whose value
    is not refmp train's default."""
    default = {f.name: f.default for f in fields(ParallelConfig)}
    flags = []
    for k in SEARCHED:
        if short and k not in ("tp", "pp", "dp") and lay[k] == default[k]:
            continue
        if isinstance(lay[k], bool):
            flags += [flag_name(k)] * lay[k]
        elif k != "cp_algo" or lay["cp"] > 1:
            flags.append(f"{flag_name(k)} {lay[k]}")
    return " ".join(flags)


@cache
def split(mcfg: GPTConfig, chunks: int) -> tuple[tuple[int, ...], ...]:
    """The blocks of each chunk, as the engine splits them (partition's balanced split)."""
    C, T, V = mcfg.n_embd, mcfg.block_size, mcfg.vocab_size
    return tuple(tuple(c) for c in partition(mcfg.n_layer, chunks, piece_costs(C, T, V)))


def train_config(lay: Layout, mcfg: GPTConfig, batch: int, dtype: str = "float32",
                 stage_layers: bool = True) -> TrainConfig:
    """The TrainConfig that runs this layout (what check_layout and estimate_memory read);
    ``stage_layers``: spell out the balanced split (the same blocks; saves recomputing it)."""
    S = lay.pp * lay.virtual_stages
    chunks = split(mcfg, S) if stage_layers and 1 < S <= mcfg.n_layer else None
    return TrainConfig(stage_layers=",".join(str(len(c)) for c in chunks) if chunks else None,
                       n_layer=mcfg.n_layer, n_head=mcfg.n_head, n_embd=mcfg.n_embd,
                       block_size=mcfg.block_size, batch_size=batch, dtype=dtype,
                       **parallel_fields(vars(lay), batch), n_expert=mcfg.n_expert,
                       grad_dtype="fp32" if lay.grad_compress != "none" and lay.mixed_precision != "none"
                       else "compute",
                       top_k=mcfg.top_k if mcfg.n_expert else None)


@dataclass(frozen=True)
class Impl:
    """What the implementation timed does beyond the layout (refmp's own by default)."""
    dropout: bool = False  # elementwise_bytes' dropouts
    dp_overlap: bool = True  # ZeRO 0 / 2 reductions overlap the last micro-batch's backward
    pp_scatter_gather: bool = False  # a boundary message goes 1/tp per rank over the network,
    # then an all-gather over NVLink (Narayanan et al. 2021, sec. 4.1)
    zero3_prefetch: bool = False  # stage 3 as DeepSpeed runs it (refmp.cost.zero.prefetched)
    fixed: tuple = ()  # (field, value): the layout choices the implementation has no other of
    # fused attention (FlashAttention): the scores stay on chip, so the softmax's elementwise
    # bytes (S) go, and the causal mask's blocks above the diagonal are skipped: the
    # attention products at half (the model FLOPs still count them whole, 12 L T C)
    flash_attention: bool = False
    fp8_linears: bool = False  # the blocks' linears in Float8 (twice the bf16 peak)
    # the backward makes the probabilities again from each row's log-sum-exp whatever
    # --recompute (refmp.nn.flash, the ring: no (T, T) square kept), so selective costs what
    # none does; False: kept, and made again by selective alone (Megatron's, the published)
    attention_recomputes: bool = True


# Megatron-LM as Narayanan et al. 2021 ran it: dropout 0.1 (Megatron's default), the data-
# parallel all-reduce after the backward pass, the scatter/gather boundary optimization, and
# no ZeRO (its distributed optimizer came later)
MEGATRON_2021 = Impl(dropout=True, dp_overlap=False, pp_scatter_gather=True,
                     fixed=(("zero", 0),), attention_recomputes=False)
# DeepSpeed's ZeRO-3 on Megatron's model (Narayanan et al. 2021, Table 2): dropout, and each
# weight gathered for every use with the next one prefetched (zero.prefetched); no pipeline
DEEPSPEED_ZERO3 = Impl(dropout=True, dp_overlap=False, zero3_prefetch=True,
                       fixed=(("zero", 3), ("pp", 1)), attention_recomputes=False)
# the published runs' own (docs/published_runs.md): Llama 3's (Dubey et al. 2024) and
# torchtitan's fused attention, torchtitan's Float8 linears
FUSED = Impl(flash_attention=True, attention_recomputes=False)
TORCHTITAN = Impl(flash_attention=True, fp8_linears=True, attention_recomputes=False)
IMPLS = {"refmp": Impl(), "megatron-2021": MEGATRON_2021, "deepspeed-zero3": DEEPSPEED_ZERO3,
         "fused-attention": FUSED, "torchtitan-fp8": TORCHTITAN}


def predict(lay: Layout, mcfg: GPTConfig, batch: int, mach: Machine,
            impl: Impl = Impl()) -> dict:
    """Seconds per step, by term, and the throughput figures (see the module docstring);
    ``bytes``: per pipeline stage, the ledger bytes one of its ranks moves in a step, by axis
    (tp, cp, ep, pp, dp: its dp x cp group) and operation, as the terms time them;
    ``stages``: per pipeline stage, its seconds by term (``seconds`` is the slowest stage's
    with the bubble, or the mean stage's on a time-shared machine)."""
    L, C, NH, V, T = mcfg.n_layer, mcfg.n_embd, mcfg.n_head, mcfg.vocab_size, mcfg.block_size
    tp, pp, dp, cp, b, v = lay.tp, lay.pp, lay.dp, lay.cp, lay.microbatch_size, lay.virtual_stages
    c = 2 if lay.mixed_precision != "none" else 4
    M, Tl, G, bd = batch // (dp * b), T // cp, mach.gpus_per_node, batch // dp
    full, uly = lay.recompute == "full", cp > 1 and lay.cp_algo == "ulysses"
    # the backward makes q k^T and the softmax again: refmp's always, else with selective
    rescored = impl.attention_recomputes or lay.recompute == "selective"
    hbm = mach.hbm_gbs * 1e9

    def link(span: int) -> tuple[float, float]:  # (bytes/s, s) of a group spanning span ranks
        inside = span <= G
        return ((mach.intra_node_gbs if inside else mach.inter_node_gbs) * 1e9,
                (mach.intra_latency_us if inside else mach.inter_latency_us) * 1e-6)

    m = b * Tl  # rows of every product
    # one block, one micro-batch, forward: four linears, two attention products per head
    # (Ulysses: NH/(tp cp) heads over the whole sequence; else NH/tp heads, Tl queries)
    # the family (refmp.cost.family): SwiGLU's gate and up in one (C, 2F) product; q and
    # the KV heads (each tp rank at least one, replicated when tp > KV)
    F, KV, llama = ffn(mcfg), kv_heads(mcfg), is_llama(mcfg)
    lin = replace(mach, peak_tflops=2 * mach.peak_tflops) if impl.fp8_linears else mach
    f_mlp = gemm(m, C, (2 if llama else 1) * F // tp, lin, c) + gemm(m, F // tp, C, lin, c)
    qkv = (NH // tp + 2 * max(1, KV // tp)) * (C // NH)
    scores = (gemm(T, C // NH, T, mach, c, b * NH // (tp * cp)) if uly
              else gemm(Tl, C // NH, T, mach, c, b * NH // tp))
    scores *= 0.5 if impl.flash_attention else 1.0  # the causal half, skipped
    f_block = gemm(m, C, qkv, lin, c) + gemm(m, C // tp, C, lin, c) + f_mlp + 2 * scores
    # an MoE block: top_k experts' MLPs per token instead of one, and the router (m, C, E)
    K, E = mcfg.top_k, mcfg.n_expert
    f_moe = f_block + (K - 1) * f_mlp + (gemm(m, C, E, mach, c) if E else 0.0)
    elem = elementwise_bytes(b, Tl, 0 if impl.flash_attention else T, C, NH, tp,
                             lay.sequence_parallel, lay.recompute, impl.dropout, c, F,
                             llama, rescored) / hbm
    # an MoE block: GELU on K rows a token (5 h each), the dispatch's gather and combine (4 n K)
    moe_elem = (K - 1) * 5 * c * 4 * m * C // tp / hbm + 4 * K * c * m * C / hbm if E else 0.0
    Vl = -(-V // tp)
    head = gemm(m, C, Vl, mach, c)
    head_elem = 5 * 4 * m * Vl / hbm  # the loss in fp32: max, exp and sum, gradient, read twice
    blocks = split(mcfg, pp * v)
    act = bd * Tl * C * c  # one (b, Tl, C) activation, over the step's micro-batches
    stages = []
    moved = []  # per stage: ledger bytes per step of one of its ranks, by axis and operation
    placed = CATALOG[lay.schedule].chunk_placement(pp, v)
    for r in range(pp):
        stage_blocks = [i for ch in placed.chunks(r) for i in blocks[ch]]
        first, last = r == 0, r == pp - 1
        Ls, n_moe = len(stage_blocks), sum(mcfg.is_moe(i) for i in stage_blocks)
        fwd = (Ls - n_moe) * f_block + n_moe * f_moe  # the stage's blocks, one micro-batch
        # the forward again (full), q k^T again (rescored: flops.recompute_flops_per_step)
        again = (fwd if full else 0.0) + (Ls * scores if rescored else 0.0)
        comp = M * (3 * fwd + again + (3 * head if last else 0))
        t_elem = M * (Ls * elem + n_moe * moe_elem + (head_elem if last else 0))
        t_calls = M * mach.call_us * 1e-6 * sum(
            numpy_calls(lay, mcfg.is_moe(i), K) for i in stage_blocks)
        # tp: the ledger's collectives; full recomputation runs the forward's again (2 per
        # block: all-reduces, or with SP all-gathers and reduce-scatters)
        tpb = comm_bytes_per_step(bd, Tl, C, Ls, lay.sequence_parallel, c)
        if full:
            for op in (("allgather", "reduce_scatter") if lay.sequence_parallel else ("allreduce",)):
                tpb[op] += 2 * Ls * act
        t_tp = sum(collective(op, x, M * round(x / act), tp, *link(tp)) for op, x in tpb.items())
        moved.append({"tp": {op: x * (tp > 1) for op, x in tpb.items()}})  # a group of one: none
        # cp: Ulysses' all-to-alls block; the ring's sends travel while the attention core
        # computes, so only what the core does not cover is exposed
        op, nbytes, calls = cp_ledger(lay, bd, Tl, C, Ls, M, c, KV / NH)
        t_cp = collective(op, nbytes, calls, cp, *link(tp * cp))
        moved[r]["cp"] = {op: nbytes}
        if lay.cp_ulysses > 1:  # hierarchical: all-to-alls in groups of U, the ring across
            U, lv = lay.cp_ulysses, hybrid_cp_ledger(lay, bd, Tl, C, Ls, M, c, KV / NH)
            (a2a, a_calls), (nbytes, calls) = lv["alltoall", "cp.ulysses"], lv["send", "cp.ring"]
            t_cp = collective("alltoall", a2a, a_calls, U, *link(tp * U)) + collective(
                "send", nbytes, calls, cp // U, *link(tp * cp))
            moved[r]["cp"] = {"alltoall": a2a, "send": nbytes}
        if op == "send" and mach.overlaps_p2p:  # R-1 transfers (R = cp/U), behind the core
            # q k^T and att v: forward, backward (2), full's forward again; q k^T rescored
            core = M * Ls * (2 * (4 if full else 3) + rescored) * scores
            t_cp = max(0.0, t_cp - (1 - lay.cp_ulysses / cp) * core)
        # experts: dispatch and combine, forward and backward (again with full
        # recomputation), K b Tl C each (ep carved from dp x cp: the group spans tp ep ranks)
        k = 6 if full else 4
        moved[r]["ep"] = {"alltoall": k * M * n_moe * K * b * Tl * C * c * (lay.ep > 1)}
        t_ep = collective("alltoall", moved[r]["ep"]["alltoall"], k * M * n_moe,
                          lay.ep, *link(tp * lay.ep))
        if lay.etp:  # folding: each token dispatched once, the experts cut over etp
            fold = folded_per_step(tp, lay.etp, lay.sequence_parallel, k * M * n_moe,
                                   K * b * Tl * C * c)
            group = {"ep": (lay.ep, lay.etp * lay.ep), "etp": (lay.etp,) * 2, "tp": (tp, tp)}
            t_ep = sum(collective(op, x, k * M * n_moe // (1 if op == "alltoall" else 2),
                                  group[a][0], *link(group[a][1]))  # (ranks, span)
                       for a, ops in fold.items() for op, x in ops.items())
            moved[r]["ep"], moved[r]["etp"] = fold["ep"], fold.get("etp", {})
            for op, x in fold.get("tp", {}).items():  # the MoE's share of the tp ledger
                moved[r]["tp"][op] = moved[r]["tp"].get(op, 0) + x
        # pipeline boundaries: activations out and gradients back, b Tl C c per micro-batch
        # (neighbours are tp cp dp ranks apart); scatter/gather: 1/tp each, then all-gathered
        x, calls, span = 2 * v * M * b * Tl * C * c, 2 * v * M, 2 * tp * cp * dp
        t_pp = collective("send", x, calls, pp, *link(span))
        moved[r]["pp"] = {"send": x * (pp > 1)}
        if impl.pp_scatter_gather and pp > 1 and tp > 1:
            t_pp = (collective("send", x / tp, calls, pp, *link(span))
                    + collective("allgather", x, calls, tp, *link(tp)))
        units = units_of(mcfg, tp, tuple(stage_blocks), first, last)
        # --grad-compress (refmp.cost.zero's formulas): a codec takes fp32 gradients
        # HSDP (--dp-shard N): ZeRO over a shard group of N cp ranks, the slice summed across
        n, codec = (lay.dp_shard or dp) * cp, lay.grad_compress
        gw = {"none": c, "bf16": 2}.get(codec, 4)
        block, scale = {"int8": (lay.quant_block, 4), "fp8": (32, 1)}.get(lay.weight_gather, (0, 4))
        g = comm_per_step(dict(units), n, lay.zero, M, gw, first, last, c, block, scale)
        if codec in ("powersgd", "topk"):  # after backward, no overlap
            g = compressed_per_step(local_shapes(mcfg, tp, stage_blocks, first, last), n, codec,
                                    lay.compress_rank, lay.compress_ratio, gw)
        moved[r]["dp"] = dict(g)
        t_dp = sum(collective(op, x, 1 if lay.zero < 2 else M * len(units), n, *link(tp * n))
                   for op, x in g.items())
        across = hsdp_per_step(dict(units), n, dp * cp // n, gw) if lay.zero else 0
        moved[r]["dp"]["allreduce"] += across  # HSDP: once a step, after backward (below)
        if pp > 1 and (first or last) and "wte" in units and tied(mcfg):  # wte's two copies
            # swap their gradients after the sums (refmp.parallel.engine's tied embedding; a
            # codec's: before, whole): a send each way, of what the rank owns
            owned_wte = units["wte"] / (n if lay.zero and codec not in ("powersgd", "topk") else 1)
            t_pp += collective("send", owned_wte * gw, 1, pp, *link(pp * tp * cp * dp))
            moved[r]["pp"]["send"] += owned_wte * gw
        # behind the last micro-batch's backward (PowerSGD and top-k: after it)
        if impl.dp_overlap and lay.zero in (0, 2) and codec in ("none", "bf16"):
            t_dp = max(0.0, t_dp - (2 * fwd + again + Ls * elem))
        if impl.zero3_prefetch and lay.zero == 3 and n > 1:  # exposed beyond the compute
            span = tp * n
            hop = link(span)[1] if span <= G else (
                ((G - 1) * mach.intra_latency_us + mach.inter_latency_us) * 1e-6 / G)

            ring = partial(ring_pass, n=n, c=c, bw=link(span)[0], hop=hop)
            block_t = [3 * f + (f if full else 0.0) + (scores if rescored else 0.0) + elem
                       for f in (f_moe if mcfg.is_moe(i) else f_block for i in stage_blocks)]
            slow = mach.sms / (mach.sms - mach.comm_sms) if mach.sms else 1.0
            t_dp = prefetched(zero3_uses(units, stage_blocks, block_t, 3 * head + head_elem,
                                         full, ring) * M, slow) - comp - t_elem
        t_dp += collective("allreduce", across, len(units), dp * cp // n, *link(tp * dp * cp))
        owned = sum(units.values()) / (n if lay.zero else 1)
        # AdamW: reads masters, two moments and the gradient, writes them and the compute
        # copy, and the clipping norm reads the gradient again (w = 4; c = g)
        t_opt = ((24 + 3 * c if lay.mixed_precision != "none" else 32) * owned
                 / (mach.stream_gbs * 1e9 or hbm))
        t_amax = {"tp": 0.0, "cp": 0.0, "dp": 0.0}  # FP8's amax all-reduces (refmp.cost.fp8)
        for axis, (x, calls, n, span) in amax_allreduces(lay.fp8, Ls - n_moe, n_moe, M, lay.sequence_parallel,
                                                         tp, cp, dp * cp).items():
            moved[r][axis]["allreduce"] = moved[r][axis].get("allreduce", 0) + x
            t_amax[axis] = collective("allreduce", x, calls, n, *link(span))
        stages.append({"compute": comp, "elementwise": t_elem, "calls": t_calls, "tp": t_tp + t_amax["tp"],
                       "cp": t_cp + t_amax["cp"], "ep": t_ep, "pp": t_pp, "dp": t_dp + t_amax["dp"],
                       "optimizer": t_opt})
    busy = [sum(s[k] for k in ("compute", "elementwise", "calls", "tp", "cp", "ep", "pp"))
            for s in stages]
    slow = max(range(pp), key=lambda r: busy[r] + stages[r]["dp"] + stages[r]["optimizer"])
    frac = 0.0 if mach.time_shared else bubble(lay.schedule, pp, M, v)
    t = dict(stages[slow])
    if mach.time_shared:  # a stage's idle share of the cores runs the others: the mean stage
        t = {k: sum(st[k] for st in stages) / pp for k in t}
    t["bubble"] = busy[slow] * frac / (1 - frac)
    step = sum(t[k] for k in t if k != "bubble") + t["bubble"]
    tokens, gpus = batch * T, tp * pp * dp * cp
    flops = model_flops_per_step(active_params(mcfg), L, T, C, tokens)
    n_blocks = active_params(mcfg) - V * C
    hw = flops + recompute_flops_per_step(lay.recompute, n_blocks, L, T, C, tokens, rescored)
    return {"step_seconds": step, "tokens_per_s": tokens / step, "seconds": t,
            "tflops_per_gpu": hw / step / gpus / 1e12,
            "mfu": flops / step / gpus / (mach.peak_tflops * 1e12), "bytes": moved,
            "stages": stages}


@cache
def units_of(mcfg: GPTConfig, tp: int, blocks: tuple, first: bool, last: bool) -> dict:
    return unit_sizes(mcfg, tp, list(blocks), first, last)
