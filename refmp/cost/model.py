"""``refmp plan``'s cost model: memory per rank and step time of a layout (the search:
refmp.cost.search).

A pure computation (no MPI): the formulas the tests hold refmp's ledgers against, and a
machine description. Shapes: B global batch, b rows of a micro-batch, M micro-batches,
T sequence, Tl = T/cp, C channels, NH heads, V vocabulary, L blocks (Ls of a stage);
w bytes per element (c: the compute copy's, g: the gradients'); pp, dp, cp, tp, ep sizes;
G GPUs per node. docs/plan.md writes the cost model out, term by term.

Memory per rank (exact: it is refmp.cost.memory.estimate_memory, which tests/test_plan.py
holds to Trainer.memory()): params, grads, optimizer, activations, the max over pipeline
stages. With mixed precision the state follows zero_cost.memory_per_rank's c, g and 3 w
bytes (the engine's buffers), and the float caches take c bytes.

Time per step (seconds), per stage: busy = GEMMs + elementwise + tp + cp + ep + pp comm;
the pipeline runs at its slowest stage over (1 - bubble) (the simulator's bubble of the
schedule), then the exposed dp/ZeRO traffic and the optimizer's pass over its state:
  GEMM (m, k, n): max(2 m k n / (e peak), c (m k + k n + m n) / hbm)   (a roofline, e per
    machine), in whole waves of sms output tiles on a GPU
  elementwise: elementwise_bytes / hbm per block (each memory-bound kernel, one by one)
  a collective over n ranks of bytes X (the ledger's convention): all-reduce
    2 (n-1)/n X / bw + 2 (n-1) lat; reduce-scatter, all-gather, all-to-all (n-1)/n X / bw +
    (n-1) lat; send X / bw + lat. bw is intra-node while the group fits in a node (ranks
    are tp fastest, then cp, dp, pp), else inter-node.
Impl says what the timed implementation does beyond the layout (refmp's own by default;
MEGATRON_2021 for the published comparison).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import cache

from refmp.cli.bench import active_params, model_flops_per_step, recompute_flops_per_step
from refmp.cost.memory import estimate_memory
from refmp.cost.zero import comm_per_step, unit_sizes
from refmp.nn.params import GPTConfig
from refmp.parallel.pipeline.partition import partition, piece_costs
from refmp.parallel.pipeline.simulate import simulate_schedule
from refmp.parallel.placement import stage_chunks
from refmp.parallel.tensor.linear import comm_bytes_per_step
from refmp.training.trainer import TrainConfig

MODELS = {  # (n_layer, n_embd, n_head, vocab, block_size): GPT-2 (Radford 2019), GPT-3 (Brown 2020)
    "gpt2": (12, 768, 12, 50257, 1024), "gpt2-medium": (24, 1024, 16, 50257, 1024),
    "gpt2-large": (36, 1280, 20, 50257, 1024), "gpt2-xl": (48, 1600, 25, 50257, 1024),
    "gpt3-175b": (96, 12288, 96, 50257, 2048),
}


@dataclass(frozen=True)
class Machine:
    """One accelerator's peak and memory, and the links (GB/s per GPU, one direction)."""
    name: str
    gpus_per_node: int
    gpu_memory_gb: float
    peak_tflops: float  # dense bf16 (fp32 for cpu)
    hbm_gbs: float  # memory bandwidth, for the roofline and elementwise work
    gemm_efficiency: float  # e: a large GEMM's share of peak (cuBLAS, measured by vendors)
    intra_node_gbs: float
    inter_node_gbs: float
    intra_latency_us: float = 5.0
    inter_latency_us: float = 10.0
    sms: int = 0  # streaming multiprocessors: a GEMM's output tiles run sms at a time
    tile: int = 128  # cuBLAS's output tile (tile x tile) for large bf16 products
    # more ranks than cores (a CPU): a rank that waits sleeps and its core runs another rank,
    # so a pipeline's bubble costs no time (refmp.distributed.comm's waits; the step is the busy time)
    time_shared: bool = False


MACHINES = {  # NVIDIA's data sheets: A100 SXM 312 TFLOP/s bf16, 2.0 TB/s, NVLink 600 GB/s
    # both ways, one 200 Gb/s HDR NIC per GPU; H100 SXM 989 TFLOP/s, 3.35 TB/s, NVLink 900
    # GB/s, 400 Gb/s NDR. e = 0.7: cuBLAS's large bf16 GEMMs reach about 70% of peak.
    "dgx-a100": Machine("dgx-a100", 8, 80, 312, 2039, 0.7, 300, 25, sms=108),
    "dgx-h100": Machine("dgx-h100", 8, 80, 989, 3350, 0.7, 450, 50, sms=132),
}


def cpu_machine(ranks: int, links: tuple[float, float] | None = None) -> Machine:
    """This host: fp32 GEMM peak measured now (refmp.cli.bench.measure_peak), memory free now, and
    MPI's links: ``links`` (GB/s, us) as measure_links found them, else shared-memory MPI taken
    as 5 GB/s and 2 us (assumed: ``refmp plan`` runs without MPI).

    The peak is this process's, with its refmp.runtime.cpu.threads() threads; a rank gets its share
    of the cores, cores / ranks of them (under mpiexec refmp gives each rank that many
    threads, at least one: 4 ranks on 2 cores get half a core each).
    """
    from refmp.cli.bench import measure_peak
    from refmp.cost.memory import available_memory
    from refmp.runtime import cpu

    cores = cpu.cores()
    per_core = measure_peak("float32", 512, 3) / 1e12 / max(1, min(cpu.threads(), cores))
    peak = per_core * cores / ranks
    free = available_memory("cpu")[0] / 1e9
    gbs, us = links or (5.0, 2.0)
    return Machine("cpu", ranks, free / ranks, peak, 10, 1.0, gbs, gbs, us, us,
                   time_shared=ranks > cores)


def measure_links(comm, nbytes: int = 1 << 22, reps: int = 5) -> tuple[float, float]:
    """(GB/s, us) of ``comm``'s (an mpi4py communicator) links as collective() models them
    (collective: every rank calls it): an 8-byte all-reduce takes 2 (n-1) latencies, an
    nbytes one 2 (n-1)/n nbytes / bw more; medians of reps, the slowest rank's. Timed through
    refmp.distributed.comm.Comm, which waits the way training does (Test and sleep: with more ranks than
    cores, a wait includes being scheduled again)."""
    import numpy as np
    from mpi4py import MPI

    from refmp.distributed.comm import Comm

    n = comm.Get_size()
    if n == 1:
        return 5.0, 2.0
    ours = Comm(comm)

    def seconds(a) -> float:
        times = []
        for _ in range(reps + 1):  # the first is a warm-up
            comm.Barrier()
            t0 = time.perf_counter()
            ours.allreduce(a)
            times.append(time.perf_counter() - t0)
        return comm.allreduce(float(np.median(times[1:])), op=MPI.MAX)

    small, big = seconds(np.zeros(1)), seconds(np.zeros(nbytes // 8))
    lat = small / (2 * (n - 1))
    bw = 2 * (n - 1) / n * nbytes / max(big - small, 1e-9)
    return bw / 1e9, lat * 1e6


@dataclass(frozen=True)
class Layout:
    """One choice of every axis and option (``--json``'s keys); microbatch_size is b, rows
    per micro-batch on a dp rank, so M = B / (dp b)."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    recompute: str = "none"
    mixed_precision: str = "bf16"
    microbatch_size: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    cp_algo: str = "ring"  # with cp > 1: ring attention or Ulysses' all-to-all


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
                       tp=lay.tp, pp=lay.pp, dp=lay.dp, cp=lay.cp, ep=lay.ep, zero=lay.zero,
                       sequence_parallel=lay.sequence_parallel, recompute=lay.recompute,
                       mixed_precision=lay.mixed_precision, schedule=lay.schedule,
                       virtual_stages=lay.virtual_stages, cp_algo=lay.cp_algo,
                       microbatches=batch // (lay.dp * lay.microbatch_size), n_expert=mcfg.n_expert,
                       top_k=mcfg.top_k if mcfg.n_expert else None)


def memory(lay: Layout, mcfg: GPTConfig, batch: int, dtype: str = "float32") -> dict[str, int]:
    """Bytes per rank, the max over the pipeline stages of stage_memory; ``stage`` says
    which stage needs the most (params + grads + optimizer + activations)."""
    cfg = train_config(lay, mcfg, batch, dtype)
    sizes = {"pp": lay.pp, "dp": lay.dp, "cp": lay.cp, "tp": lay.tp, "ep": lay.ep}
    blocks = split(mcfg, lay.pp * lay.virtual_stages)
    held = [sum(len(blocks[c]) for c in stage_chunks(r, lay.pp, lay.virtual_stages))
            for r in range(lay.pp)]
    # the first stage keeps the most micro-batches in flight and the embeddings, the last the
    # head; a middle one can only exceed them by holding more blocks
    mems = [stage_memory(cfg, mcfg, sizes, r) for r in sorted({0, lay.pp - 1,
                                                                held.index(max(held))})]
    return max(mems, key=total)


def stage_memory(cfg: TrainConfig, mcfg: GPTConfig, sizes: dict, r: int) -> dict[str, int]:
    """refmp.cost.memory.estimate_memory of the rank at pipeline coordinate r (its tp, dp,
    cp and ep peers hold the same amounts). With mixed precision the engine keeps the
    compute copy in c bytes, gradients in g, and masters plus two moments in 3 w per owned
    element (zero_cost.memory_per_rank with compute=c, grad=g: linear in the bytes, so a
    rescaling of the estimate's one-precision figures), and its float caches in c bytes."""
    m = estimate_memory(cfg, mcfg, sizes, {"pp": r, "dp": 0, "cp": 0, "tp": 0, "ep": 0})
    w = 8 if cfg.dtype == "float64" else 4
    if cfg.mixed_precision != "none":
        c, g = 2, (4 if cfg.grad_dtype == "fp32" else 2)
        m["params"], m["grads"] = m["params"] * c // w, m["grads"] * g // w
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
    return m["params"] + m["grads"] + m["optimizer"] + m["activations"]


def collective(op: str, nbytes: float, calls: int, n: int, bw: float, lat: float) -> float:
    """Seconds of a ring collective (ledger bytes, see the module docstring)."""
    if n == 1 or nbytes == 0:
        return 0.0
    k = 2 if op == "allreduce" else 1
    share = 1.0 if op == "send" else k * (n - 1) / n
    return share * nbytes / bw + calls * (1 if op == "send" else k * (n - 1)) * lat


@cache
def bubble(name: str, pp: int, m: int, v: int) -> float:
    return simulate_schedule(name, pp, m, v).bubble() if pp > 1 else 0.0


def gemm(m: int, k: int, n: int, mach: Machine, c: int, count: int = 1) -> float:
    """``count`` (m, k) @ (k, n) products: a roofline, max(FLOPs / (e peak), bytes / HBM),
    with a GPU's wave quantization: the output is made in tile x tile blocks, sms at a time,
    so the products take whole waves (NVIDIA's "Matrix Multiplication Background" guide)."""
    t = 2 * m * k * n * count / (mach.gemm_efficiency * mach.peak_tflops * 1e12)
    if mach.sms:  # 0: no waves (a CPU)
        tiles = count * -(-m // mach.tile) * -(-n // mach.tile)
        t *= -(-tiles // mach.sms) * mach.sms / tiles
    return max(t, c * count * (m * k + k * n + m * n) / (mach.hbm_gbs * 1e9))


def elementwise_bytes(b: int, Tl: int, T: int, C: int, NH: int, tp: int, sp: bool,
                      recompute: str, dropout: bool, c: int) -> int:
    """Bytes one block's memory-bound kernels move in one micro-batch: each reads its inputs
    and writes its outputs once (c bytes an element, a dropout mask 1 byte). n = b s C the
    LayerNorm and residual region (s = Tl/tp with SP), h = 4 b Tl C/tp GELU's input, a = b Tl
    C/tp attention's output, S = b NH/tp Tl T the attention scores (made whole and masked).
      forward: 2 LayerNorms (2 n each), 2 residual adds with the bias (3 n), GELU (2 h),
        the softmax (2 S), the attention output's transpose (2 a);
      backward: 2 LayerNorms (3 n), the residual gradients (3 n), 2 bias gradients (n),
        GELU (3 h), the softmax (3 S), the transpose (2 a);
      recomputation: full, the forward again; selective, the softmax forward again;
      dropout (Megatron's, p = 0.1; refmp has none): on the probabilities 2 S and a mask S
        bytes each way, and the two hidden dropouts' masks (n bytes each way)."""
    n = b * (Tl // tp if sp else Tl) * C
    h, a, S = 4 * b * Tl * C // tp, b * Tl * C // tp, b * NH // tp * Tl * T
    fwd = c * (10 * n + 2 * h + 2 * a + 2 * S)
    bwd, soft = c * (14 * n + 3 * h + 2 * a + 3 * S), c * 2 * S
    if dropout:
        drop = c * 2 * S + S + 2 * n
        fwd, bwd, soft = fwd + drop, bwd + drop, soft + drop - 2 * n
    return fwd + bwd + {"none": 0, "selective": soft, "full": fwd}[recompute]


def cp_ledger(lay: Layout, bd: int, Tl: int, C: int, Ls: int, M: int, c: int) -> tuple:
    """(op, bytes, calls) the ledger records on cp in one step of a rank with Ls blocks and
    bd rows (tests/test_context_parallel.py's want_per_step): the ring sends each block's
    K/V (2 bd Tl C/tp) cp-1 times forward, again backward, and dK/dV back; Ulysses makes
    four all-to-alls per block, qkv and y forward and their gradients backward (8 bd Tl
    C/tp). Full recomputation repeats the forward's: 4 (cp-1) sends, 6 all-to-alls."""
    full, tp, cp = lay.recompute == "full", lay.tp, lay.cp
    if cp == 1:
        return "send", 0, 0
    if lay.cp_algo == "ulysses":
        k = 6 if full else 4
        return "alltoall", 2 * k * Ls * bd * Tl * (C // tp) * c, k * Ls * M
    k = 4 if full else 3
    return "send", k * (cp - 1) * Ls * 2 * bd * Tl * (C // tp) * c, k * (cp - 1) * Ls * M


@dataclass(frozen=True)
class Impl:
    """What the implementation timed does beyond the layout (refmp's own by default)."""
    dropout: bool = False  # elementwise_bytes' dropouts
    dp_overlap: bool = True  # ZeRO 0 / 2 reductions overlap the last micro-batch's backward
    pp_scatter_gather: bool = False  # a boundary message goes 1/tp per rank over the network,
    # then an all-gather over NVLink (Narayanan et al. 2021, sec. 4.1)


# Megatron-LM as Narayanan et al. 2021 ran it: dropout 0.1 (Megatron's default), the data-
# parallel all-reduce after the backward pass, and the scatter/gather boundary optimization
MEGATRON_2021 = Impl(dropout=True, dp_overlap=False, pp_scatter_gather=True)


def predict(lay: Layout, mcfg: GPTConfig, batch: int, mach: Machine,
            impl: Impl = Impl()) -> dict:
    """Seconds per step, by term, and the throughput figures (see the module docstring)."""
    L, C, NH, V, T = mcfg.n_layer, mcfg.n_embd, mcfg.n_head, mcfg.vocab_size, mcfg.block_size
    tp, pp, dp, cp, b, v = lay.tp, lay.pp, lay.dp, lay.cp, lay.microbatch_size, lay.virtual_stages
    c = 2 if lay.mixed_precision != "none" else 4
    M, Tl, G, bd = batch // (dp * b), T // cp, mach.gpus_per_node, batch // dp
    full, uly = lay.recompute == "full", cp > 1 and lay.cp_algo == "ulysses"
    hbm = mach.hbm_gbs * 1e9

    def link(span: int) -> tuple[float, float]:  # (bytes/s, s) of a group spanning span ranks
        inside = span <= G
        return ((mach.intra_node_gbs if inside else mach.inter_node_gbs) * 1e9,
                (mach.intra_latency_us if inside else mach.inter_latency_us) * 1e-6)

    m = b * Tl  # rows of every product
    # one block, one micro-batch, forward: four linears, two attention products per head
    # (Ulysses: NH/(tp cp) heads over the whole sequence; else NH/tp heads, Tl queries)
    f_mlp = gemm(m, C, 4 * C // tp, mach, c) + gemm(m, 4 * C // tp, C, mach, c)
    scores = (gemm(T, C // NH, T, mach, c, b * NH // (tp * cp)) if uly
              else gemm(Tl, C // NH, T, mach, c, b * NH // tp))
    f_block = gemm(m, C, 3 * C // tp, mach, c) + gemm(m, C // tp, C, mach, c) + f_mlp + 2 * scores
    # an MoE block: top_k experts' MLPs per token instead of one, and the router (m, C, E)
    K, E = mcfg.top_k, mcfg.n_expert
    f_moe = f_block + (K - 1) * f_mlp + (gemm(m, C, E, mach, c) if E else 0.0)
    elem = elementwise_bytes(b, Tl, T, C, NH, tp, lay.sequence_parallel, lay.recompute,
                             impl.dropout, c) / hbm
    Vl = -(-V // tp)
    head = gemm(m, C, Vl, mach, c)
    head_elem = 5 * 4 * m * Vl / hbm  # the loss in fp32: max, exp and sum, gradient, read twice
    blocks = split(mcfg, pp * v)
    act = bd * Tl * C * c  # one (b, Tl, C) activation, over the step's micro-batches
    stages = []
    for r in range(pp):
        mine = [i for ch in stage_chunks(r, pp, v) for i in blocks[ch]]
        first, last = r == 0, r == pp - 1
        Ls, n_moe = len(mine), sum(mcfg.is_moe(i) for i in mine)
        fwd = (Ls - n_moe) * f_block + n_moe * f_moe  # the stage's blocks, one micro-batch
        # selective: refmp recomputes q k^T for the softmax (bench.recompute_flops_per_step)
        again = {"none": 0.0, "selective": Ls * scores, "full": fwd}[lay.recompute]
        comp = M * (3 * fwd + again + (3 * head if last else 0))
        t_elem = M * (Ls * elem + (head_elem if last else 0))
        # tp: the ledger's collectives; full recomputation runs the forward's again (2 per
        # block: all-reduces, or with SP all-gathers and reduce-scatters)
        tpb = comm_bytes_per_step(bd, Tl, C, Ls, lay.sequence_parallel, c)
        if full:
            for op in (("allgather", "reduce_scatter") if lay.sequence_parallel else ("allreduce",)):
                tpb[op] += 2 * Ls * act
        t_tp = sum(collective(op, x, M * round(x / act), tp, *link(tp)) for op, x in tpb.items())
        # cp: Ulysses' all-to-alls block; the ring's sends travel while the attention core
        # computes, so only what the core does not cover is exposed
        op, nbytes, calls = cp_ledger(lay, bd, Tl, C, Ls, M, c)
        t_cp = collective(op, nbytes, calls, cp, *link(tp * cp))
        if op == "send":  # cp-1 transfers, each behind one of the core's cp steps
            core = M * Ls * 2 * (4 if full else 3) * scores  # q k^T, att v: fwd, 2 bwd, again
            t_cp = max(0.0, t_cp - (cp - 1) / cp * core)
        # experts: dispatch and combine, forward and backward (again with full
        # recomputation), K b Tl C each (ep carved from dp x cp: the group spans tp ep ranks)
        k = 6 if full else 4
        t_ep = collective("alltoall", k * M * n_moe * K * b * Tl * C * c, k * M * n_moe,
                          lay.ep, *link(tp * lay.ep))
        # pipeline boundaries: activations out and gradients back, b Tl C c per micro-batch
        # (neighbours are tp cp dp ranks apart); scatter/gather: 1/tp each, then all-gathered
        x, calls, span = 2 * v * M * b * Tl * C * c, 2 * v * M, 2 * tp * cp * dp
        t_pp = collective("send", x, calls, pp, *link(span))
        if impl.pp_scatter_gather and pp > 1 and tp > 1:
            t_pp = (collective("send", x / tp, calls, pp, *link(span))
                    + collective("allgather", x, calls, tp, *link(tp)))
        units = units_of(mcfg, tp, tuple(mine), first, last)
        g = comm_per_step(dict(units), dp * cp, lay.zero, M, c, first, last, c)
        n = dp * cp
        t_dp = sum(collective(op, x, 1 if lay.zero < 2 else M * len(units), n, *link(tp * n))
                   for op, x in g.items())
        if impl.dp_overlap and lay.zero in (0, 2):  # behind the last micro-batch's backward
            t_dp = max(0.0, t_dp - (2 * fwd + again + Ls * elem))
        owned = sum(units.values()) / (n if lay.zero else 1)
        # AdamW: reads masters, two moments and the gradient, writes them and the compute
        # copy, and the clipping norm reads the gradient again (w = 4; c = g)
        t_opt = (24 + 3 * c if lay.mixed_precision != "none" else 32) * owned / hbm
        stages.append({"compute": comp, "elementwise": t_elem, "tp": t_tp, "cp": t_cp,
                       "ep": t_ep, "pp": t_pp, "dp": t_dp, "optimizer": t_opt})
    busy = [sum(s[k] for k in ("compute", "elementwise", "tp", "cp", "ep", "pp")) for s in stages]
    slow = max(range(pp), key=lambda r: busy[r] + stages[r]["dp"] + stages[r]["optimizer"])
    frac = 0.0 if mach.time_shared else bubble(lay.schedule, pp, M, v)
    t = dict(stages[slow])
    t["bubble"] = busy[slow] * frac / (1 - frac)
    step = busy[slow] + t["bubble"] + t["dp"] + t["optimizer"]
    tokens, gpus = batch * T, tp * pp * dp * cp
    flops = model_flops_per_step(active_params(mcfg), L, T, C, tokens)
    n_blocks = active_params(mcfg) - V * C
    hw = flops + recompute_flops_per_step(lay.recompute, n_blocks, L, T, C, tokens)
    return {"step_seconds": step, "tokens_per_s": tokens / step, "seconds": t,
            "tflops_per_gpu": hw / step / gpus / 1e12,
            "mfu": flops / step / gpus / (mach.peak_tflops * 1e12)}


@cache
def units_of(mcfg: GPTConfig, tp: int, blocks: tuple, first: bool, last: bool) -> dict:
    return unit_sizes(mcfg, tp, list(blocks), first, last)
