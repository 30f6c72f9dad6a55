"""Tensor (and sequence) parallelism equals the serial model, under real MPI (float64).

Level 2: each parallel layer against its serial twin, outputs and every gradient shard by
shard: the column/row linears, one block (refmp.nn.gpt.block_forward run through
refmp.parallel.ops.ParallelOps, whole and split for zero bubble), the vocab-parallel ends.
Level 3: whole training steps (AdamW, clipping, ZeRO, micro-batches, MoE) through the engine
against the serial run (tests/parity.py), tp x dp. Plus the ledger's bytes against the
analytic formula (refmp.cost.tensor.comm_bytes_per_step), and the activation memory of
one block and of the whole model with and without SP against the table of
docs/tensor_parallel.md.
"""

import numpy as np
import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_helpers import Mismatches, collective
from parity import assert_same_run

from refmp.cost.tensor import comm_bytes_per_step
from refmp.distributed.grid import ProcessGrid
from refmp.nn import gpt
from refmp.nn import layers as L
from refmp.parallel.ops import MEGATRON, ParallelOps
from refmp.parallel.placement import padded_vocab, place, tp_shard
from refmp.parallel.tensor import linear as tpl
from refmp.parallel.tensor import sequence, vocab
from refmp.runtime.arrays import activation_bytes
from refmp.training.datasets import Dataset
from refmp.training.trainer import TrainConfig, Trainer

pytestmark = pytest.mark.mpi

TOL = dict(rtol=1e-9, atol=1e-12)
close = np.testing.assert_allclose


def t_shard(a, comm, sp):
    """My T/tp positions of a (B, T, ...) array with SP; the whole array without."""
    if not sp:
        return a
    n = a.shape[1] // comm.size
    return a[:, comm.rank * n : (comm.rank + 1) * n]


_GRIDS: dict = {}

# no shrinking under MPI: a failing example is reported as drawn, at once (shrinking would
# build hundreds of grids and run out of MPI communicators before it finished)
NO_SHRINK = [Phase.explicit, Phase.reuse, Phase.generate]


def tp_grid(tp):
    """One grid per tp size for the whole file (each grid makes several communicators)."""
    if tp not in _GRIDS:
        _GRIDS[tp] = ProcessGrid(MPI.COMM_WORLD, tp=tp)
    return _GRIDS[tp]


def free(*trainers):
    """Give a trainer's communicators back to MPI (a test makes many grids)."""
    for tr in trainers:
        g = tr.grid
        for c in {id(c): c for c in (*g.comm.values(), g.group("dp", "cp"))}.values():
            c.mpi.Free()


# --- level 2: the layers ------------------------------------------------------------------


@pytest.mark.parallel(nprocs=[2, 4])
@settings(max_examples=4, phases=NO_SHRINK)
@given(B=st.integers(1, 2), t_per=st.integers(1, 2), c_in=st.integers(1, 3),
       c_out=st.integers(1, 3), sp=st.booleans(), seed=st.integers(0, 99))
@collective
def test_column_then_row_equal_serial_linears(B, t_per, c_in, c_out, sp, seed):
    """Y = X A (column), Z = Y B + b (row): outputs and gradients shard by shard."""
    comm = tp_grid(MPI.COMM_WORLD.size).comm["tp"]
    n = comm.size
    rng = np.random.default_rng(seed)
    T, C, H = t_per * n, c_in * n, c_out * n
    x, dz = rng.normal(size=(B, T, C)), rng.normal(size=(B, T, C))
    A, a, Bw, b = (rng.normal(size=s) for s in [(C, H), (H,), (H, C), (C,)])
    y, cy = L.linear_forward(x, A, a)  # serial twin
    z, cz = L.linear_forward(y, Bw, b)
    dy, dBw, db = L.linear_backward(dz, cz)
    dx, dA, da = L.linear_backward(dy, cy)
    cols = slice(comm.rank * H // n, (comm.rank + 1) * H // n)
    layers = sequence if sp else tpl  # SP: the same layers on T/tp shards
    py, pcy = layers.column_forward(t_shard(x, comm, sp), A[:, cols].copy(), a[cols].copy(), comm)
    pz, pcz = layers.row_forward(py, Bw[cols].copy(), b, comm)
    pdy, pdBw, pdb = layers.row_backward(t_shard(dz, comm, sp).copy(), pcz, comm)
    pdx, pdA, pda = layers.column_backward(pdy, pcy, comm)
    if sp:  # the bias saw my positions only: partial over tp
        pdb = comm.allreduce(pdb)
    bad = Mismatches()
    for name, got, want in [("y", py, y[..., cols]), ("z", pz, t_shard(z, comm, sp)),
                            ("dy", pdy, dy[..., cols]), ("dB", pdBw, dBw[cols]), ("db", pdb, db),
                            ("dx", pdx, t_shard(dx, comm, sp)), ("dA", pdA, dA[:, cols]),
                            ("da", pda, da[cols])]:
        bad.check(close, got, want, **TOL, err_msg=f"{name} rank {comm.rank}")
    bad.assert_none()


def _block_case(n, heads_per, hs, B, t_per, seed):
    rng = np.random.default_rng(seed)
    NH = heads_per * n
    cfg = gpt.GPTConfig(vocab_size=5, block_size=t_per * n, n_layer=1, n_head=NH, n_embd=NH * hs)
    full = {k: rng.normal(size=s) * 0.5 for k, s in gpt.block_param_shapes(cfg).items()}
    x = rng.normal(size=(B, cfg.block_size, cfg.n_embd))
    dout = rng.normal(size=x.shape)
    return cfg, full, x, dout


def block_elements(B, T, C, NH, tp=1, sp=False) -> int:
    """Activation elements one block's cache holds (the table in docs/tensor_parallel.md).

    Serial: LayerNorms 2 (BTC + BT), c_attn and c_fc inputs 2 BTC, qkv 3 BTC, attention's
    log-sum-exp B NH T (refmp.nn.flash keeps no T x T weights), c_proj input BTC (the
    attention's output), c_fc output, tanh and GELU output 12 BTC: 20 BTC + 2 BT + B NH T.
    TP splits all but the first two terms by tp; SP splits those too (Korthikanti et al. 2022,
    sec. 4.2: the c_attn/c_fc inputs are kept as T/tp shards).
    """
    BTC, BT, att = B * T * C, B * T, B * NH * T
    if sp:
        return (20 * BTC + 2 * BT + att) // tp
    return 4 * BTC + 2 * BT + (16 * BTC + att) // tp


def model_activation_bytes(B, T, C, NH, V, n_layer, tp=1, sp=False, w=8) -> int:
    """Bytes of one micro-batch's forward caches on a rank, parameters left out: what
    Engine.memory()["activations"] reports with one micro-batch in flight (pp = 1).

    The blocks (block_elements), then the two ends: ln_f's normalized input and output (the
    tied head's input) and rstd on my positions (T/tp with SP), my Vl = Vp/tp columns of the
    shifted logits and the log-sum-exp of every token; int64 token ids (the embedding's and
    the loss's) and positions (T,); with tp, the two masks of the ids my vocabulary shard
    owns (bool, one byte each).
    """
    BT, s = B * T, (T // tp if sp else T)
    Vl = padded_vocab(V, tp) // tp
    blocks = n_layer * w * block_elements(B, T, C, NH, tp, sp)
    head = w * (2 * B * s * C + B * s + BT * Vl + BT)
    ids = 8 * (2 * BT + T) + (2 * BT if tp > 1 else 0)
    return blocks + head + ids


def check_block_memory(bad, cfg, B, n, sp, serial, got):
    T, C, NH = cfg.block_size, cfg.n_embd, cfg.n_head
    want_serial, want = block_elements(B, T, C, NH), block_elements(B, T, C, NH, n, sp)
    bad.check(np.testing.assert_equal, serial // 8, want_serial, err_msg="serial block memory")
    bad.check(np.testing.assert_equal, got // 8, want, err_msg=f"block memory (sp={sp})")


@pytest.mark.parallel(nprocs=[2, 4])
@settings(max_examples=4, phases=NO_SHRINK)
@given(heads_per=st.integers(1, 2), hs=st.integers(1, 3), B=st.integers(1, 2),
       t_per=st.integers(1, 2), sp=st.booleans(), seed=st.integers(0, 99))
@collective
def test_block_equals_serial_block(heads_per, hs, B, t_per, sp, seed):
    """The one block of refmp.nn.gpt through ParallelOps: c_attn split by heads, c_proj by
    rows, MLP column/row; whole and split for zero bubble (B now, W later); and the
    activation memory its cache holds, with and without SP."""
    comm = tp_grid(MPI.COMM_WORLD.size).comm["tp"]
    cfg, full, x, dout = _block_case(comm.size, heads_per, hs, B, t_per, seed)
    out, cache = gpt.block_forward(full, x, gpt.Ops(cfg.n_head))
    dx, g = gpt.block_backward(dout, cache, gpt.Ops(cfg.n_head))
    ops = ParallelOps(cfg.n_head, cfg.vocab_size, comm, sequence.LAYERS if sp else MEGATRON)
    mine = {k: tp_shard(f"h.0.{k}", v, comm.rank, comm.size) for k, v in full.items()}
    pout, pcache = gpt.block_forward(mine, t_shard(x, comm, sp), ops)
    mem = activation_bytes(pcache, mine.values())
    pdx, pg = gpt.block_backward(t_shard(dout, comm, sp).copy(), pcache, ops)
    # zero bubble: the same block, its four linears' weight gradients deferred to W
    _, zcache = gpt.block_forward(mine, t_shard(x, comm, sp), ops)
    todo = []
    zdx, zg = gpt.block_backward(t_shard(dout, comm, sp).copy(), zcache, ops, todo)
    zg.update(gpt.block_backward_weight(todo, ops))
    for grads in (pg, zg):
        for k in sorted(grads):  # SP: replicated gradients are partial over tp (sorted: same order)
            if sp and place(f"h.0.{k}", sp).tp_split is None:
                grads[k] = comm.allreduce(grads[k])
    bad = Mismatches()
    check_block_memory(bad, cfg, B, comm.size, sp, serial=activation_bytes(cache, full.values()),
                       got=mem)
    bad.check(close, pout, t_shard(out, comm, sp), **TOL, err_msg="block output")
    bad.check(close, pdx, t_shard(dx, comm, sp), **TOL, err_msg="block dx")
    bad.check(np.testing.assert_array_equal, zdx, pdx, err_msg="zero-bubble dx")
    bad.check(np.testing.assert_equal, sorted(zg), sorted(pg), err_msg="zero-bubble names")
    for k, v in g.items():
        want = tp_shard(f"h.0.{k}", v, comm.rank, comm.size)
        bad.check(close, pg[k], want, **TOL, err_msg=f"gradient {k} rank {comm.rank}")
        bad.check(np.testing.assert_array_equal, zg.get(k), pg[k],
                  err_msg=f"zero-bubble gradient {k} rank {comm.rank}")
    bad.assert_none()


@pytest.mark.parallel(nprocs=[2, 4])
@settings(max_examples=4, phases=NO_SHRINK)
@example(V=5, C=2, B=2, t_per=1, sp=True, seed=3)  # at tp 4: rank 3 holds padding only
@given(V=st.integers(2, 11), C=st.integers(1, 4), B=st.integers(1, 2), t_per=st.integers(1, 2),
       sp=st.booleans(), seed=st.integers(0, 99))
@collective
def test_vocab_embedding_head_and_loss_equal_serial(V, C, B, t_per, sp, seed):
    """Masked lookup + sum, the tied head and the vocab-parallel cross-entropy; V padded."""
    comm = tp_grid(MPI.COMM_WORLD.size).comm["tp"]
    n = comm.size
    rng = np.random.default_rng(seed)
    T = t_per * n
    p = {"wte.weight": rng.normal(size=(V, C)), "wpe.weight": rng.normal(size=(T, C)),
         "ln_f.weight": rng.normal(size=C), "ln_f.bias": rng.normal(size=C)}
    idx, tg = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))
    dx_in = rng.normal(size=(B, T, C))
    denom = 3 * B * T  # a share, as with dp
    # serial twin
    x, ce = gpt.embed_forward(p, idx)
    loss, hc = gpt.head_forward(p, x, tg, denom)
    dx, gh = gpt.head_backward(1.0, hc)
    ge = gpt.embed_backward(dx_in, ce)
    # parallel
    mine = {k: tp_shard(k, v, comm.rank, n) for k, v in p.items()}  # wte padded to Vp rows
    ends = sequence if sp else vocab  # SP: the same ends on T/tp shards
    px, pce = ends.embed_forward(mine, idx, comm)
    ploss, phc = ends.head_forward(mine, t_shard(x, comm, sp), tg, denom, comm, V)
    pdx, pgh = ends.head_backward(1.0, phc, comm)
    pge = ends.embed_backward(t_shard(dx_in, comm, sp).copy(), pce, comm)
    if sp:  # replicated parameters saw my positions only
        for g in (pgh["ln_f.weight"], pgh["ln_f.bias"], pge["wpe.weight"]):
            comm.allreduce(g)
    logits, _ = vocab.logits_forward(mine, x, comm, V)  # for decoding: the last position's
    full = vocab.gather_logits(logits[:, -1], comm, V)  # (B, V), the padding dropped
    bad = Mismatches()
    bad.check(close, px, t_shard(x, comm, sp), **TOL, err_msg="embedding")
    bad.check(close, ploss, loss, **TOL, err_msg="loss")
    bad.check(close, pdx, t_shard(dx, comm, sp), **TOL, err_msg="head dx")
    want_wte = tp_shard("wte.weight", gh["wte.weight"], comm.rank, n)
    bad.check(close, pgh["wte.weight"], want_wte, **TOL, err_msg="head dwte")
    bad.check(close, pge["wte.weight"], tp_shard("wte.weight", ge["wte.weight"], comm.rank, n),
              **TOL, err_msg="embedding dwte")
    for k in ("ln_f.weight", "ln_f.bias"):
        bad.check(close, pgh[k], gh[k], **TOL, err_msg=k)
    bad.check(close, pge["wpe.weight"], ge["wpe.weight"], **TOL, err_msg="dwpe")
    serial_logits, _ = gpt.head_forward(p, x)
    bad.check(close, full, serial_logits[:, -1], **TOL, err_msg="gathered logits")
    bad.assert_none()


# --- level 3: whole training steps, through the engine ------------------------------------


@pytest.mark.parallel(nprocs=[2, 4])
@settings(max_examples=5, phases=NO_SHRINK)
@example(tp=2, heads_per=1, hs=2, V=7, t_per=2, sp=True, clip=0.05, M=2, zero=0, moe=False,
         seed=1)  # tp2 x dp2 at 4 ranks
@example(tp=2, heads_per=1, hs=2, V=6, t_per=2, sp=True, clip=0.05, M=1, zero=3, moe=True,
         seed=2)  # SP with MoE: each sequence's balance loss over its tp shards
@given(tp=st.sampled_from([2, 4]), heads_per=st.integers(1, 2), hs=st.integers(1, 2),
       V=st.integers(3, 13), t_per=st.integers(1, 2), sp=st.booleans(),
       clip=st.sampled_from([0.05, 10.0]), M=st.integers(1, 2), zero=st.integers(0, 3),
       moe=st.booleans(), seed=st.integers(0, 1000))
@collective
def test_tp_training_equals_serial(tp, heads_per, hs, V, t_per, sp, clip, M, zero, moe, seed):
    """3 AdamW steps: loss, norm, every gradient and weight (gathered, unpadded) == serial."""
    size = MPI.COMM_WORLD.size
    tp = min(tp, size)  # at 2 ranks: tp 2; at 4: tp 4, or tp 2 x dp 2
    dp = size // tp
    cfg = TrainConfig(n_layer=2, n_head=heads_per * tp, n_embd=heads_per * tp * hs,
                      block_size=t_per * tp, batch_size=2 * dp, steps=3, lr=0.02,
                      warmup_steps=1, grad_clip=clip, dtype="float64", seed=seed, tp=tp,
                      sequence_parallel=sp, microbatches=M, zero=zero,
                      n_expert=4 if moe else 0, top_k=2, progress=False)
    ds = Dataset(np.random.default_rng(seed).integers(0, V, 200), V, "random")
    free(assert_same_run(cfg, ds))


# --- communication and memory: the ledger and the caches against the formulas -------------


@pytest.mark.parallel(nprocs=[2, 4])
@settings(max_examples=5, phases=NO_SHRINK)
@given(n_layer=st.integers(1, 2), heads_per=st.integers(1, 2), hs=st.integers(1, 2),
       t_per=st.integers(1, 2), rows=st.integers(1, 2), V=st.integers(3, 9), sp=st.booleans(),
       dp=st.sampled_from([1, 2]), M=st.integers(1, 2))
@collective
def test_ledger_bytes_and_activations_equal_formula(n_layer, heads_per, hs, t_per, rows, V, sp,
                                                    dp, M):
    """Bytes per step on tp: (4L + 2) all-reduces of (b, s, h) and 3 of (b, s) without SP;
    the reduce-scatter/all-gather equivalents with SP. M micro-batches of b/M rows: same
    bytes, M times the calls (but one all-reduce of the replicated gradients per step). The
    dense gradients: one all-reduce per step on dp x cp. The peak activations: one
    micro-batch's caches (model_activation_bytes), serial and split."""
    size = MPI.COMM_WORLD.size
    dp = min(dp, size // 2)
    tp = size // dp
    h, s, b, w = heads_per * tp * hs, t_per * tp, rows * M, 8  # b: rows per dp rank
    cfg = TrainConfig(n_layer=n_layer, n_head=heads_per * tp, n_embd=h, block_size=s,
                      batch_size=b * dp, steps=2, dtype="float64", tp=tp, dp=dp,
                      sequence_parallel=sp, microbatches=M, progress=False)
    ds = Dataset(np.arange(100) % V, V, "cycle")
    tr = Trainer(cfg, dataset=ds)
    tr.grid.ledger.reset()
    for _ in range(cfg.steps):
        tr.step()
    led, L_, run = tr.grid.ledger, n_layer, tr.runner
    act = b * s * h * w  # one (b, s, h) activation in bytes
    # the replicated parameters (wpe, LayerNorms, c_proj biases): SP sums their gradients
    n_repl = sum(int(v.size) for k, v in run.params.items() if place(k, sp).tp_split is None)
    if sp:
        want = {"allgather": ((6 * L_ + 3) * act, (6 * L_ + 3) * M),
                "reduce_scatter": ((4 * L_ + 2) * act, (4 * L_ + 2) * M),
                "allreduce": (3 * b * s * w + n_repl * w, 3 * M + 1)}
    else:
        want = {"allgather": (0, 0), "reduce_scatter": (0, 0),
                "allreduce": ((4 * L_ + 2) * act + 3 * b * s * w, (4 * L_ + 2 + 3) * M)}
    got = {op: (led.bytes(op, "tp") // cfg.steps, led.count(op, "tp") // cfg.steps)
           for op in want}
    formula = comm_bytes_per_step(b, s, h, L_, sp, w, n_repl)
    n_params = sum(int(p.size) for p in run.params.values())  # my shards, wte padded
    dense = (led.bytes("allreduce", "dp"), led.count("allreduce", "dp"))
    NH = cfg.n_head
    mem = (run.memory()["activations"],
           model_activation_bytes(b // M, s, h, NH, V, L_, tp, sp, w))
    serial = Trainer(TrainConfig(**{**cfg.__dict__, "tp": 1, "dp": 1, "batch_size": b // M,
                                    "sequence_parallel": False, "microbatches": 1, "steps": 1}),
                     grid=ProcessGrid(MPI.COMM_SELF), dataset=ds)
    serial.step()
    serial_mem = (serial.runner.memory()["activations"],
                  model_activation_bytes(b // M, s, h, NH, V, L_, w=w))
    free(tr, serial)
    assert got == want, (got, want)
    assert formula == {op: bytes_ for op, (bytes_, _) in want.items()}, formula
    assert dense == ((cfg.steps * n_params * w, cfg.steps) if dp > 1 else (0, 0)), dense
    assert mem[0] == mem[1], f"activations {mem} (measured, formula; sp={sp})"
    assert serial_mem[0] == serial_mem[1], f"serial activations {serial_mem}"
