"""The per-term costs of refmp.cost.model's step time: a ring collective's seconds, the
pipeline bubble of a schedule (the simulator's), a GEMM's roofline, the bytes one block's
memory-bound kernels move, and the NumPy calls one block runs on a CPU (shapes and letters
as refmp.cost.model's docstring; docs/plan.md writes each out).
"""

from __future__ import annotations

from functools import cache

from refmp.cost.machines import Machine
from refmp.parallel.pipeline.simulate import simulate_schedule


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
    hm, hk, hn = mach.gemm_short  # a CPU's short products (0 on a GPU)
    t *= 1 + hm / m + hk / k + hn / n
    if mach.sms:  # 0: no waves (a CPU)
        tiles = count * -(-m // mach.tile) * -(-n // mach.tile)
        t *= -(-tiles // mach.sms) * mach.sms / tiles
    return max(t, c * count * (m * k + k * n + m * n) / (mach.hbm_gbs * 1e9))


def elementwise_bytes(b: int, Tl: int, T: int, C: int, NH: int, tp: int, sp: bool,
                      recompute: str, dropout: bool, c: int, F: int = 0,
                      swiglu: bool = False, rescored: bool = False) -> int:
    """Bytes one block's memory-bound kernels move in one micro-batch: each reads its inputs
    and writes its outputs once (c bytes an element, a dropout mask 1 byte). n = b s C the
    LayerNorm and residual region (s = Tl/tp with SP), h = 4 b Tl C/tp GELU's input, a = b Tl
    C/tp attention's output, S = b NH/tp Tl T the attention scores (made whole and masked).
      forward: 2 LayerNorms (2 n each), 2 residual adds with the bias (3 n), GELU (2 h),
        the softmax (2 S), the attention output's transpose (2 a);
      backward: 2 LayerNorms (3 n), the residual gradients (3 n), 2 bias gradients (n),
        GELU (3 h), the softmax (3 S), the transpose (2 a);
      recomputation: full, the forward again; the softmax forward again with selective, or
        with ``rescored`` whatever ``recompute`` (an attention whose backward makes its
        probabilities again from each row's log-sum-exp: refmp's, Impl.attention_recomputes);
      dropout (Megatron's, p = 0.1; refmp has none): on the probabilities 2 S and a mask S
        bytes each way, and the two hidden dropouts' masks (n bytes each way).
    The Llama family (refmp.cost.family): h = b Tl F/tp, and SwiGLU instead of GELU, SiLU
    and the product forward (4 h), their gradients backward (6 h); RMSNorm as LayerNorm, and
    rotary's passes over q and k left out (a few percent of the block's elementwise bytes)."""
    n = b * (Tl // tp if sp else Tl) * C
    h, a, S = b * Tl * (F or 4 * C) // tp, b * Tl * C // tp, b * NH // tp * Tl * T
    act_f, act_b = (4, 6) if swiglu else (2, 3)
    fwd = c * (10 * n + act_f * h + 2 * a + 2 * S)
    bwd, soft = c * (14 * n + act_b * h + 2 * a + 3 * S), c * 2 * S
    if dropout:
        drop = c * 2 * S + S + 2 * n
        fwd, bwd, soft = fwd + drop, bwd + drop, soft + drop - 2 * n
    again = soft if rescored or recompute == "selective" else 0
    return fwd + bwd + again + (fwd if recompute == "full" else 0)


def numpy_calls(lay, moe: bool = False, top_k: int = 2) -> int:
    """NumPy operations one block runs in one micro-batch (``lay``: the planner's Layout),
    forward and backward: ufuncs (operators and reductions among them), array functions,
    reshapes, transposes and indexing, as tests/test_plan.py counts them on a serial block
    (refmp.nn.gpt, attention in one block of queries): 76 forward, 112 backward, and 12
    gradient accumulations (one a parameter). A layout adds (estimated, not counted): tp,
    4 collectives a block of 6 calls (a buffer, the reduction, a wait, a copy back); cp's
    ring, 10 calls a step of its cp steps forward and 16 backward; Ulysses, 4 all-to-alls of
    8; an MoE block, a router and dispatch of 40 calls and 20 an expert visit (top_k) each
    way; full recomputation, the forward again. Selective recomputation adds none: refmp's
    attention (refmp.nn.flash) makes its probabilities again in every backward, so selective
    runs the calls counted here."""
    fwd, bwd = 76, 112 + 12
    if lay.tp > 1:
        fwd, bwd = fwd + 12, bwd + 12
    if lay.cp > 1:
        fwd += 32 if lay.cp_algo == "ulysses" else 10 * lay.cp
        bwd += 32 if lay.cp_algo == "ulysses" else 16 * lay.cp
    if moe:
        fwd, bwd = fwd + 40 + 20 * top_k, bwd + 40 + 20 * top_k
    return fwd + bwd + (fwd if lay.recompute == "full" else 0)
