"""The Llama model split over real MPI ranks equals the serial model (float64): tp with
grouped-query attention (tp larger than the key/value heads: replicated heads, their
gradients summed over the copies), cp (ring and Ulysses, zig-zag chunks) with the rotary
tables at each token's global position, pp with an untied head under the catalog's flush
schedules (refmp.parallel.pipeline.llama_stage, the real executor), dp, and products.

Every rank runs the serial model on the whole batch itself (the same weights: the same
draw), then its share of the layout: its dp rows, its cp tokens (SequenceChunks), its
pipeline chunks, its tp shard of each parameter (refmp.parallel.tensor.llama.shard). After
each step the loss (the shares summed) and every gradient and weight piece it holds are
compared with the serial run's; two AdamW steps. The ledger's tp bytes are held to
Megatron's four all-reduces per block and the key/value copies' sums.
"""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest
from extras import reason
from mpi4py import MPI
from mpi_helpers import Mismatches, collective

from refmp.checkpoint.hf_llama import load_llama, save_llama
from refmp.distributed.grid import ProcessGrid
from refmp.nn import llama as LM
from refmp.nn.llama_layers import RepeatedCore
from refmp.parallel.context.chunks import SequenceChunks
from refmp.parallel.context.gqa_ring import GQARingAttention
from refmp.parallel.context.ulysses import UlyssesAttention
from refmp.parallel.data.sharder import Sharder
from refmp.parallel.family import LlamaFamily
from refmp.parallel.pipeline.catalog import CATALOG
from refmp.parallel.pipeline.executor import Executor
from refmp.parallel.pipeline.llama_stage import LlamaStage
from refmp.parallel.placement import units_of
from refmp.parallel.tensor import llama as TPL
from refmp.runtime.precision import BF16
from refmp.training.optim import AdamW

pytestmark = pytest.mark.mpi

TOL = dict(rtol=1e-9, atol=1e-12)
U_BF16 = 2.0**-8  # bf16's unit roundoff
GRAD_K, LOSS_K = 8, 1  # as tests/test_mixed_precision.py holds them
B, T, V = 4, 8, 23


def whole_params(sharder, grid, cfg: LM.LlamaConfig) -> dict | None:
    """The whole model, gathered to world rank 0 (None elsewhere; collective over the world):
    each rank's local parameters (Sharder.full_local: ZeRO's slices all-gathered), its tp
    ranks' shards glued (refmp.parallel.tensor.llama.unshard), one tp group of each stage
    sending its part: this test's check of a layout's weights, a simple gather of Python
    objects for toy models (refmp train --save DIR streams tensor by tensor instead)."""
    from refmp.parallel.tensor.llama import unshard
    from refmp.runtime import backend

    local = {k: backend.to_host(v) for k, v in sharder.full_local().items()}
    shards = grid.comm["tp"].allgather_obj(local)  # each tp rank's shards, in rank order
    mine = {k: unshard(k, [s[k] for s in shards], cfg) for k in local}
    sender = grid.coords["dp"] == 0 and grid.coords["cp"] == 0 and grid.coords["tp"] == 0
    parts = grid.world.allgather_obj(mine if sender else None)
    if grid.rank != 0:
        return None
    whole = {k: v for part in parts if part is not None for k, v in part.items()}
    return {k: whole[k] for k in LM.param_shapes(cfg)}  # the model's order


def config(n_kv_head: int, n_layer: int = 2, tied: bool = False) -> LM.LlamaConfig:
    return LM.LlamaConfig(vocab_size=V, block_size=T, n_layer=n_layer, n_head=4,
                          n_kv_head=n_kv_head, n_embd=16, n_inner=24, rope_theta=100.0,
                          tied=tied)


def attention_core(grid, seq, algo: str):
    """cp's core for grouped-query attention: the ring passing NKV heads, or Ulysses on
    the repeated heads (its all-to-all splits heads, which NKV may not cover)."""
    if grid.sizes["cp"] == 1:
        return None
    cp = grid.comm["cp"]
    return GQARingAttention(cp, seq) if algo == "ring" else RepeatedCore(UlyssesAttention(cp, seq))


def run_layout(cfg: LM.LlamaConfig, algo: str = "ring", schedule: str = "1f1b", m: int = 1,
               virtual: int = 1, zero: int = 0, sp: bool = False, recompute: bool = False,
               mixed: bool = False, init: dict | None = None, save: str | None = None,
               **sizes) -> None:
    """``cfg`` trained two steps on a grid of ``sizes`` and serially in float64, compared
    step by step (module docstring). ``mixed``: bf16 compute and fp32 masters, compared as
    tests/test_mixed_precision.py does (the first gradient within GRAD_K u, each loss
    within u, and the compute copy the masters rounded, bitwise). ``init``: the starting
    weights (default the seed-3 draw); ``save``: a directory the trained model is gathered
    into (whole_params) and written to as a LlamaForCausalLM directory, after comparing it
    with the serial run's weights."""
    grid = ProcessGrid(MPI.COMM_WORLD, **sizes)
    dp, cp, tp, pp = (grid.sizes[a] for a in ("dp", "cp", "tp", "pp"))
    d, c, t = (grid.coords[a] for a in ("dp", "cp", "tp"))
    serial = (LM.Llama.create(cfg, seed=3, dtype="float64") if init is None
              else LM.Llama(cfg, {k: v.copy() for k, v in init.items()}))
    seq = SequenceChunks(T, cp, "zigzag")
    pos = seq.positions(c)
    core = attention_core(grid, seq, algo)
    if tp > 1:
        ops = (TPL.SequenceOps if sp else TPL.TensorOps)(cfg, grid.comm["tp"], core, pos)
    else:
        ops = LM.Ops(cfg.n_head, cfg.n_kv_head, core, pos)
    sched = CATALOG[schedule]
    placed = sched.chunk_placement(pp, virtual)
    S, fam = pp * placed.v, LlamaFamily(cfg)  # chunks in all; the Engine's rules of holding
    blocks = {c: range(c * cfg.n_layer // S, (c + 1) * cfg.n_layer // S)
              for c in placed.chunks(grid.coords["pp"])}  # L/S consecutive blocks a chunk
    mine = {i for r in blocks.values() for i in r}
    names = [k for k in LM.param_shapes(cfg) if fam.holds(k, mine, 0 in blocks, S - 1 in blocks)]
    dtype = np.float32 if mixed else np.float64  # the masters'
    local = {k: TPL.shard(k, serial.params[k], cfg, t, tp).astype(dtype) for k in names}
    units = units_of(names)
    dpcp = grid.group("dp", "cp")
    sharder = Sharder(local, units, {u: dpcp for u in units}, zero, bucket_mb=0,
                      compute=BF16 if mixed else None)
    stage = LlamaStage(cfg, blocks, S, ops, sharder, recompute)
    executor = Executor(stage, grid.comm["pp"], sharder.compute, placed=placed)
    kv = TPL.kv_group(grid.comm["tp"], cfg)
    opts = [AdamW(serial.params, lr=1e-2, weight_decay=0.1),
            AdamW(sharder.params, lr=1e-2, weight_decay=0.1, decay=sharder.decay)]
    bad = Mismatches()
    rng = np.random.default_rng(7)
    rows = slice(d * B // dp, (d + 1) * B // dp)
    for step in range(2):
        idx, tgt = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))
        loss, cache = serial.forward(idx, tgt)
        serial.zero_grad()
        serial.backward(cache)
        xs = np.array_split(idx[rows][:, pos], m)  # micro-batches of my rows and tokens
        ys = np.array_split(tgt[rows][:, pos], m)
        sharder.zero_grad()
        acts = sched.actions(pp, m, grid.coords["pp"], placed.v, fill=True, ahead=0)
        share = executor.step(acts, xs, ys, B * T, m)
        sharder.finish()  # the shares of every token: summed over dp x cp (ZeRO's way)
        TPL.reduce_kv_grads(sharder.grads, kv)
        if sp:
            TPL.reduce_sp_grads(sharder.grads, grid.comm["tp"])
        # the loss: on the last stage, each tp rank's whole share, or with SP its T/tp's
        total = grid.world.allreduce(np.array([share]))[0] / (1 if sp else tp)
        grads = sharder.master_grads() if mixed else sharder.grads  # mixed: fp32, unscaled
        if mixed:
            check_mixed(bad, sharder, total, loss, serial.grads, cfg, t, tp, step)
        else:
            bad.check(np.testing.assert_allclose, total, loss, **TOL, err_msg=f"loss at {step}")
            for k, g in sharder.full_local(grads=True).items():
                want = TPL.shard(k, serial.grads[k], cfg, t, tp)
                bad.check(np.testing.assert_allclose, g, want, **TOL, err_msg=f"gradient {k} at {step}")
        opts[0].step(serial.grads)
        opts[1].step(grads)
        sharder.after_step()
        if mixed:  # the compute copy is the masters rounded, bitwise
            for u in units:
                masters = sharder.whole_unit(u)
                for k, w in sharder.weights(u, exact=True).items():
                    bad.check(np.testing.assert_array_equal, w, masters[k].astype(BF16),
                              err_msg=f"compute copy of {k} at {step}")
            continue
        for k, w in sharder.full_local().items():
            want = TPL.shard(k, serial.params[k], cfg, t, tp)
            bad.check(np.testing.assert_allclose, w, want, **TOL, err_msg=f"weight {k} at {step}")
    # the ledger: Megatron's four all-reduces of (b, T/cp, C) per block (the blocks here),
    # and the copies' key/value gradients (C, HS), k and v, per block, when tp > NKV (two
    # steps of each)
    n_blocks = sum(len(r) for r in blocks.values())
    w = sharder.compute.itemsize  # what crosses on tp: the compute dtype's
    act = (B // dp) * (T // cp) * cfg.n_embd * w
    act = act * 6 // 4 if recompute else act  # the forward's two all-reduces run again
    if sp:  # f and g as four all-gathers and four reduce-scatters of (b, T/cp, C) a block
        for op in ("allgather", "reduce_scatter"):
            bad.check(np.testing.assert_equal, grid.ledger.bytes(op, "tp"), 2 * n_blocks * 4 * act,
                      err_msg=f"SP {op} bytes")
    else:
        want = 2 * n_blocks * 4 * act if tp > 1 else 0
        bad.check(np.testing.assert_equal, grid.ledger.bytes("allreduce", "tp"), want,
                  err_msg="tp all-reduce bytes")
    kv_want = 2 * n_blocks * 2 * cfg.n_embd * cfg.head_size * w if tp > cfg.n_kv_head else 0
    if zero and kv_want:  # ZeRO: each rank sums the part of the copies it owns
        kv_want = 2 * sum(g.nbytes for k, g in sharder.grads.items()
                          if k.split(".", 2)[-1] in TPL.KV)
    bad.check(np.testing.assert_equal, grid.ledger.bytes("allreduce", "tp-kv"), kv_want,
              err_msg="key/value copies' all-reduce bytes")
    if cp > 1 and algo == "ring":  # 3 (cp - 1) sends of a K/V block of NKV heads a block
        kv_block = 2 * (B // dp) * max(cfg.n_kv_head // tp, 1) * (T // cp) * cfg.head_size * w
        per_block = 3 + (1 if recompute else 0)  # full recomputation: the forward's again
        bad.check(np.testing.assert_equal, grid.ledger.bytes("send", "cp"),
                  2 * n_blocks * per_block * (cp - 1) * kv_block, err_msg="ring bytes")
    if pp > 1 and not cfg.tied:  # no parameter on two stages: wte and lm_head apart
        bad.check(np.testing.assert_equal, ("wte.weight" in names, "lm_head.weight" in names),
                  (grid.coords["pp"] == 0, grid.coords["pp"] == pp - 1) if placed.kind == "loop"
                  else (grid.coords["pp"] == 0, grid.coords["pp"] == 0), err_msg="the ends")
    if save is not None:  # --save DIR from this layout: the whole model, on rank 0
        whole = whole_params(sharder, grid, cfg)
        if grid.rank == 0:
            for k, v in serial.params.items():
                bad.check(np.testing.assert_allclose, whole[k], v, **TOL, err_msg=f"saved {k}")
            save_llama(save, cfg, whole)
    bad.assert_none(MPI.COMM_WORLD)


def check_mixed(bad, sharder, total, loss, serial_grads, cfg, t, tp, step) -> None:
    """A bf16 step against the float64 one: the loss within LOSS_K u, and (the first step,
    from the same weights but rounded) every gradient within GRAD_K u in relative norm."""
    bad.check(np.testing.assert_array_less, abs(total - loss) / loss, LOSS_K * U_BF16,
              err_msg=f"loss at {step}")
    if step:
        return
    for k, g in sharder.full_local(grads=True).items():
        want = TPL.shard(k, serial_grads[k], cfg, t, tp)
        err = float(np.linalg.norm(g - want) / np.linalg.norm(want))
        if not err <= GRAD_K * U_BF16:
            bad.errors.append(f"gradient {k} off by {err:.3g} > {GRAD_K} u")


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("n_kv_head", [1, 2])
@collective
def test_tp4_with_fewer_kv_heads_than_ranks(n_kv_head):
    run_layout(config(n_kv_head), tp=4)


@pytest.mark.parallel(nprocs=4)
@collective
def test_cp4_rotary_at_global_positions():
    run_layout(config(2), "ring", cp=4)


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("schedule,virtual,zero", [("gpipe", 1, 0), ("interleaved", 2, 1),
                                                   ("zb-v", 1, 3)])
@collective
def test_pp2_untied_head(schedule, virtual, zero):
    """pp 2 x dp 2, two micro-batches of one row; four layers (four chunks under the
    interleaved and V schedules); ZeRO over dp. (1F1B runs in the other pipeline tests.)"""
    run_layout(config(2, n_layer=4), schedule=schedule, m=2, virtual=virtual, zero=zero, pp=2,
               dp=2)


@pytest.mark.parallel(nprocs=4)
@collective
def test_tied_head_on_a_v_pipeline():
    """ZB-V puts chunk 0 and the last chunk on rank 0: a tied head stays on one rank."""
    run_layout(config(1, n_layer=4, tied=True), schedule="zb-v", m=4, pp=2, tp=2)


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("sizes,n_kv_head,algo,zero", [
    (dict(cp=2, tp=2), 1, "ring", 0),  # tp > NKV under cp
    (dict(dp=2, tp=2), 1, "ring", 2),  # ZeRO-2: each rank sums the part of the copies it owns
    (dict(dp=2, cp=2), 2, "ulysses", 3),
])
@collective
def test_products_and_zero(sizes, n_kv_head, algo, zero):
    run_layout(config(n_kv_head), algo, zero=zero, **sizes)


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("sizes,n_kv_head,zero", [(dict(tp=2, cp=2), 2, 0),
                                                  (dict(pp=2, tp=2), 1, 3)])
@collective
def test_sequence_parallel(sizes, n_kv_head, zero):
    """SP: RMSNorms, residuals, embedding and head on T/tp tokens; tp = NKV with cp; pp x
    ZeRO-3 with tp > NKV."""
    run_layout(config(n_kv_head), m=2 if "pp" in sizes else 1, zero=zero, sp=True, **sizes)


@pytest.mark.parallel(nprocs=4)
@collective
def test_full_recomputation_under_pp_and_tp():
    """Each block keeps its input and runs its forward (and its tp all-reduces) again."""
    run_layout(config(1), m=2, recompute=True, pp=2, tp=2)


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("n_kv_head", [1, 2])
@collective
def test_tp4_decoding_with_the_gqa_cache(n_kv_head):
    """Greedy decoding on tp 4 (each rank its query head, its key/value head held or
    replicated): the serial Decoder's tokens and logits; a rank's cache holds one head,
    2 L B T HS w bytes (L 2, B 2, T 7 cached, HS 4, float64)."""
    from refmp.inference.decoder import Decoder
    from refmp.inference.generate import generate
    from refmp.inference.sampling import Sampler

    cfg = config(n_kv_head)
    grid = ProcessGrid(MPI.COMM_WORLD, tp=4)
    serial = LM.Llama.create(cfg, seed=5, dtype="float64")
    idx = np.random.default_rng(2).integers(0, V, (2, 3))
    want = generate(Decoder(cfg, serial.params, ProcessGrid(MPI.COMM_SELF)), idx, 5, Sampler())
    got = generate(Decoder(cfg, serial.params, grid), idx, 5, Sampler())  # its shards cut
    bad = Mismatches()
    bad.check(np.testing.assert_array_equal, got.tokens, want.tokens, err_msg="tokens")
    bad.check(np.testing.assert_allclose, got.logits, want.logits, **TOL, err_msg="logits")
    bad.check(np.testing.assert_equal, got.kv_cache_bytes, 2 * 2 * 2 * 7 * 1 * 4 * 8,
              err_msg="one head")
    bad.check(np.testing.assert_equal, want.kv_cache_bytes, 2 * 2 * 2 * 7 * n_kv_head * 4 * 8,
              err_msg="the serial cache")
    bad.assert_none(MPI.COMM_WORLD)


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("sizes,zero", [(dict(dp=2, tp=2), 1), (dict(pp=2, cp=2), 3)])
@collective
def test_mixed_precision(sizes, zero):
    """bf16 compute, fp32 masters: tp > NKV under dp with ZeRO-1; pp x cp with ZeRO-3."""
    run_layout(config(1), m=2 if "pp" in sizes else 1, zero=zero, mixed=True, **sizes)


@pytest.mark.parallel(nprocs=4)
@collective
def test_save_from_one_layout_and_train_on_another(tmp_path):
    """pp 2 x tp 2 (tp > NKV) trains and writes its whole model as a LlamaForCausalLM
    directory; dp 2 x cp 2 with ZeRO-3 reads it (each rank its share) and goes on, equal to
    the serial run from the same weights: resharding through a directory."""
    folder = MPI.COMM_WORLD.bcast(str(tmp_path / "llama") if MPI.COMM_WORLD.rank == 0 else None)
    run_layout(config(1), m=2, pp=2, tp=2, save=folder)
    MPI.COMM_WORLD.barrier()
    cfg, params = load_llama(folder)
    assert cfg == config(1)
    run_layout(cfg, "ulysses", zero=3, init=params, dp=2, cp=2)


def transformers_directory(world, folder: str, prompts, n: int):
    """A toy LlamaForCausalLM made by transformers (tests/mpi_scripts/transformers_generate.py,
    run by rank 0 in a process of its own while every rank of ``world``, a refmp Comm whose
    calls the watchdog sees, polls it collectively), written to ``folder``/llama, and its
    ``generate``'s greedy tokens (B, T0 + n) of ``prompts``."""
    import subprocess
    import sys
    import time

    script = Path(__file__).parent / "mpi_scripts" / "transformers_generate.py"
    job = None
    if world.rank == 0:
        np.save(f"{folder}/prompts.npy", prompts)
        job = subprocess.Popen([sys.executable, str(script), f"{folder}/llama",
                                f"{folder}/prompts.npy", str(n), f"{folder}/hf.npy"])
    while not all(world.allgather_obj(job is None or job.poll() is not None)):
        time.sleep(0.2)  # each allgather is a call: the watchdog sees progress
    assert all(world.allgather_obj(job is None or job.returncode == 0)), \
        "transformers_generate.py failed (its stderr above)"
    return np.load(f"{folder}/hf.npy")


def count_reads(monkeypatch) -> list:
    """Every (name, array) a LlamaSource's ``read`` returns on this rank from now on."""
    from refmp.checkpoint.llama_files import LlamaSource

    reads = []
    real = LlamaSource.read

    def read(self, name, *args, **kwargs):
        a = real(self, name, *args, **kwargs)
        reads.append((name, a))
        return a

    monkeypatch.setattr(LlamaSource, "read", read)
    return reads


def share_elements(cfg: LM.LlamaConfig, tp: int, pp: int, stage: int) -> int:
    """The elements of a rank's share: its stage's L/pp blocks (two norms, q and o C C/tp,
    k and v C max(NKV/tp, 1) HS, gate, up and down C F/tp), wte (V C) on the first stage,
    ln_f (C) and the untied lm_head (V C) on the last."""
    C, F, HS, V_ = cfg.n_embd, cfg.n_inner, cfg.head_size, cfg.vocab_size
    block = 2 * C + 2 * C * C // tp + 2 * C * max(cfg.n_kv_head // tp, 1) * HS + 3 * C * F // tp
    ends = (V_ * C if stage == 0 else 0) + (C + V_ * C if stage == pp - 1 else 0)
    return cfg.n_layer // pp * block + ends


def check_reads(bad: Mismatches, reads: list, cfg, params: dict, flags) -> None:
    """What ``refmp generate`` read on this rank (``reads``) is its share: each parameter it
    holds once, bitwise the slice the Decoder cuts from the whole model (``params``), as many
    elements as share_elements counts, below the whole model's where tp or pp split it."""
    from refmp.inference.decoder import Decoder

    sizes = {f[2:]: int(n) for f, n in zip(flags[::2], flags[1::2], strict=True)}
    grid = ProcessGrid(MPI.COMM_WORLD, **sizes)
    want = Decoder(cfg, params, grid).params
    bad.check(np.testing.assert_equal, sorted(k for k, _ in reads), sorted(want),
              err_msg=f"{flags}: the names read")
    for k, a in reads:
        bad.check(np.testing.assert_array_equal, a, want.get(k), err_msg=f"{flags}: read {k}")
    got = sum(a.size for _, a in reads)
    tp, pp = grid.sizes["tp"], grid.sizes["pp"]
    bad.check(np.testing.assert_equal, got, share_elements(cfg, tp, pp, grid.coords["pp"]),
              err_msg=f"{flags}: the elements read")
    if tp * pp > 1:
        bad.check(np.testing.assert_array_less, got, sum(v.size for v in params.values()),
                  err_msg=f"{flags}: read the whole model")


GENERATE_LAYOUTS = {  # layout flags -> each rank's cache bytes 2 L B T max(NKV/tp, 1) HS w
    # pp 2 x dp 2: one layer, one prompt, the 9 tokens
    ("--pp", "2", "--dp", "2"): [2 * 1 * 1 * 9 * 1 * 4 * 8] * 4,
    # tp 2 (> NKV: the one head replicated) x pp 2: one layer, both prompts
    ("--tp", "2", "--pp", "2"): [2 * 1 * 2 * 9 * 1 * 4 * 8] * 4,
    # cp 2 x dp 2: both layers, one prompt; T0/cp = 2 prompt tokens and decoded tokens
    # 0, 2, 4 on cp rank 0, 1, 3 on cp rank 1 (round robin)
    ("--cp", "2", "--dp", "2"): [2 * 2 * 1 * t * 1 * 4 * 8 for t in (5, 4, 5, 4)],
    # tp 4: every layer and prompt, the one head replicated
    ("--tp", "4"): [2 * 2 * 2 * 9 * 1 * 4 * 8] * 4,
}


@pytest.mark.parallel(nprocs=4)
@pytest.mark.timeout(120)  # importing torch (in its own process) is slow on a loaded machine
@pytest.mark.skipif(not (find_spec("torch") and find_spec("transformers")),
                    reason=reason("transformers", "hf"))
@collective
def test_refmp_generate_equals_transformers_on_every_layout(tmp_path, capsys, monkeypatch):
    """``mpiexec -n 4 refmp generate --init LLAMA_DIR`` over pp 2 x dp 2, tp 2 x pp 2,
    cp 2 x dp 2 and tp 4: transformers' greedy tokens on its own directory, each rank's cache
    2 L B T max(NKV/tp, 1) HS w bytes of its layers, prompts, tokens and heads, and each
    rank read only its share of the directory (check_reads). Sampling (temperature, top-k,
    top-p) with a paged cache over tp 2 x pp 2 picks the serial Decoder's tokens; expert
    parallelism is refused on every rank (exit 2)."""
    from refmp.cli.main import main
    from refmp.inference.decoder import Decoder
    from refmp.inference.generate import generate
    from refmp.inference.sampling import Sampler

    comm = MPI.COMM_WORLD
    folder = comm.bcast(str(tmp_path) if comm.rank == 0 else None)
    prompts = np.random.default_rng(4).integers(0, 37, (2, 4))
    want = transformers_directory(ProcessGrid(comm).world, folder, prompts, 6)
    cfg, params = load_llama(f"{folder}/llama", "float64")
    reads = count_reads(monkeypatch)
    argv = ["generate", "--init", f"{folder}/llama", "--prompts", f"{folder}/prompts.npy",
            "--max-new-tokens", "6", "--dtype", "float64", "--json"]
    bad = Mismatches()
    for flags, kv in GENERATE_LAYOUTS.items():
        capsys.readouterr()
        reads.clear()
        assert main([*argv, *flags]) == 0
        check_reads(bad, reads, cfg, params, flags)
        said = comm.bcast(capsys.readouterr().out.strip().splitlines()[-1]
                          if comm.rank == 0 else None)
        summary = json.loads(said)
        bad.check(np.testing.assert_array_equal, summary["new_tokens"], want[:, 4:],
                  err_msg=str(flags))
        bad.check(np.testing.assert_equal, summary["kv_cache_bytes"], kv,
                  err_msg=f"{flags}: cache bytes")
    sampled = ["--temperature", "0.9", "--top-k", "20", "--top-p", "0.95", "--seed", "3"]
    assert main([*argv, *sampled, "--tp", "2", "--pp", "2", "--kv-block-size", "4",
                 "--save-tokens", f"{folder}/sampled.npy"]) == 0
    comm.barrier()
    alone = Decoder(cfg, params, ProcessGrid(MPI.COMM_SELF))
    serial = generate(alone, prompts, 6, Sampler(0.9, 20, 0.95, 3)).tokens
    bad.check(np.testing.assert_array_equal, np.load(f"{folder}/sampled.npy"), serial,
              err_msg="sampled")
    capsys.readouterr()
    assert main([*argv, "--dp", "4", "--ep", "4"]) == 2
    assert comm.rank or "--ep 4 is refused" in capsys.readouterr().err  # not --dp's refusal
    bad.assert_none(comm)


@pytest.mark.parallel(nprocs=4)
@collective
def test_ep4_swiglu_experts():
    """Mixtral-style MoE on ep 4 (carved from dp 4): each rank its row and its expert of each
    layer, tokens sent to their experts by all-to-all; the serial run's loss, gradients."""
    from refmp.nn import swiglu_experts
    from refmp.parallel.expert import ExpertDispatch, expert_index, is_expert

    cfg = LM.LlamaConfig(vocab_size=V, block_size=T, n_layer=2, n_head=4, n_kv_head=2,
                         n_embd=16, n_inner=24, n_expert=4, top_k=2)
    grid = ProcessGrid(MPI.COMM_WORLD, dp=4, ep=4)
    serial = LM.Llama.create(cfg, seed=3, dtype="float64")
    ep = grid.comm["ep"]
    mine = LM.Llama(cfg, {k: v.copy() for k, v in serial.params.items()
                          if not is_expert(k) or expert_index(k) == ep.rank})
    dispatch = ExpertDispatch(ep, cfg.n_expert, kind=swiglu_experts)
    idx, tgt = (np.random.default_rng(s).integers(0, V, (B, T)) for s in (1, 2))
    loss, cache = serial.forward(idx, tgt)
    serial.backward(cache)
    r = grid.coords["dp"]
    share, cache = mine.forward(idx[r : r + 1], tgt[r : r + 1], B * T, dispatch=dispatch)
    mine.backward(cache)
    dp = grid.comm["dp"]
    for k, g in mine.grads.items():
        if not is_expert(k):  # dense: summed over dp; an expert's: whole on its owner
            dp.allreduce(g)
    bad = Mismatches()
    bad.check(np.testing.assert_allclose, dp.allreduce(np.array([share]))[0], loss, **TOL,
              err_msg="loss")
    for k, g in mine.grads.items():
        bad.check(np.testing.assert_allclose, g, serial.grads[k], **TOL, err_msg=f"gradient {k}")
    bad.assert_none(MPI.COMM_WORLD)


@pytest.mark.parallel(nprocs=4)
@collective
def test_mixtral_decoding_splits_its_experts_over_ep():
    """The Decoder on tp 2 x dp 2 with ep 2 (carved from dp): each rank holds, from a whole
    dict or read from a Source, its tp shards and only its ep rank's experts; its dp rank's
    own prompts go to the experts by all-to-all, with the cache; the serial Decoder's tokens
    and logits on those prompts; a folded grid (--etp) is refused."""
    from refmp.checkpoint.source import InitSource
    from refmp.errors import ConfigError
    from refmp.inference.decoder import Decoder
    from refmp.inference.generate import generate
    from refmp.inference.sampling import Sampler
    from refmp.parallel.expert import expert_index, is_expert
    from refmp.parallel.placement import expert_owner

    class Counted(InitSource):
        """A fresh model's Source that records the names a rank reads."""

        def read(self, name, *index_dtype):
            self.names.append(name)
            return super().read(name, *index_dtype)

    cfg = LM.LlamaConfig(vocab_size=V, block_size=T, n_layer=2, n_head=4, n_kv_head=2,
                         n_embd=16, n_inner=24, rope_theta=100.0, n_expert=4, top_k=2)
    grid = ProcessGrid(MPI.COMM_WORLD, tp=2, dp=2, ep=2)
    source = Counted(cfg, 5)
    source.names = []
    whole = {k: source.read(k) for k in source.shapes()}
    source.names.clear()
    r, ep = grid.coords["dp"], grid.comm["ep"]
    idx = np.random.default_rng(2).integers(0, V, (4, 3))[2 * r : 2 * r + 2]  # its prompts
    want = generate(Decoder(cfg, whole, ProcessGrid(MPI.COMM_SELF)), idx, 5, Sampler())
    mine = {k for k in whole if not is_expert(k)
            or expert_owner(expert_index(k), cfg.n_expert, ep.size) == ep.rank}
    bad = Mismatches()
    for weights in (whole, source):
        dec = Decoder(cfg, weights, grid)
        got = generate(dec, idx, 5, Sampler())
        said = type(weights).__name__
        bad.check(np.testing.assert_equal, sorted(dec.params), sorted(mine), err_msg=said)
        bad.check(np.testing.assert_array_equal, got.tokens, want.tokens, err_msg=said)
        bad.check(np.testing.assert_allclose, got.logits, want.logits, **TOL, err_msg=said)
    bad.check(np.testing.assert_equal, sorted(source.names), sorted(mine), err_msg="reads")
    bad.assert_none(MPI.COMM_WORLD)
    with pytest.raises(ConfigError, match="do not fold over etp"):  # folding is GPT-2's
        Decoder(cfg, whole, ProcessGrid(MPI.COMM_SELF, etp=1))


# --- the engine: `refmp train --arch llama` on a layout equals the serial `refmp train` -------


def engine_config(**kw):
    """A fresh Llama run's TrainConfig (every setting of the family given: nothing guessed)."""
    from refmp.training.trainer import TrainConfig

    base = dict(arch="llama", n_layer=2, n_head=4, n_kv_head=1, n_embd=16, ffn=24,
                rope_theta=100.0, rms_eps=1e-6, head="untied", block_size=T, batch_size=4,
                steps=3, lr=0.01, warmup_steps=1, grad_clip=0.05, dtype="float64", seed=3,
                progress=False)
    return TrainConfig(**{**base, **kw})


def engine_data():
    from refmp.training.datasets import Dataset

    return Dataset(np.random.default_rng(0).integers(0, V, 400), V, "random")


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("kw", [
    dict(tp=4, n_kv_head=2, sequence_parallel=True),  # tp > NKV: replicated heads, SP
    dict(pp=2, dp=2, zero=3, microbatches=2, n_layer=4),  # untied head, ZeRO-3 over dp
    dict(cp=2, tp=2, recompute="full"),  # ring with rotary at global positions, tp > NKV
    dict(dp=2, cp=2, cp_algo="ulysses", n_kv_head=2, zero=2),
])
@collective
def test_engine_runs_llama(kw):
    """The Engine on a Llama model (refmp.parallel.family): two clipped AdamW steps whose
    loss, norm, every gradient and every weight equal the serial Trainer's (tests/parity.py;
    the serial Trainer against transformers: tests/test_llama_hf.py)."""
    from parity import assert_same_run

    assert_same_run(engine_config(**kw, steps=2), engine_data())


def llama_gradient(mcfg, version, stage_of: dict, x, y, denom: int) -> tuple[float, dict]:
    """An untied Llama model under PipeDream's rule (async_reference.pipedream_reference):
    every parameter lives on one stage (wte the first's, a block its stage's, ln_f and
    lm_head the last's), so batch t is the serial model's forward and backward on the
    weights that take each parameter from its stage's version."""
    last = max(stage_of.values())

    def stage(k: str) -> int:
        top = k.split(".")
        return stage_of[int(top[1])] if top[0] == "h" else 0 if top[0] == "wte" else last

    model = LM.Llama(mcfg, {k: version(stage(k))[k].copy() for k in LM.param_shapes(mcfg)})
    loss, cache = model.forward(x, y, denom)
    model.backward(cache)
    return float(loss), model.grads


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("schedule,kw", [
    ("2bw", dict(tp=2, recompute="full")),  # tp > NKV; the recomputed forward on W(t-1) too
    ("pipedream", dict(dp=2, zero=3)),  # a stashed version: the rank's shards, gathered again
    ("2bw", dict(pp=4, microbatches=4, n_layer=4)),  # the next batch's backwards: stashed
    ("2bw", dict(dp=2, ep=2, n_expert=4, top_k=2, n_kv_head=2)),  # the next batch's figures
])
@collective
def test_engine_runs_llama_without_a_flush(schedule, kw):
    """PipeDream-2BW and PipeDream's weight stashing on pp 2 (untied head, grouped-query
    attention), three clipped AdamW steps: 2BW equals 2bw at pp 1, the delayed rule (every
    loss, norm, gradient and weight; tests/async_reference.py), PipeDream its serial rule
    with each stage's version (loss, norm, weights); the memory report holds the versions
    each stage keeps (2BW: one copy of its parameters; PipeDream: pp - 1 - s)."""
    from async_reference import assert_same_delayed_run, run_against

    cfg = engine_config(**{"pp": 2, "microbatches": 2, **kw}, schedule=schedule, steps=3)
    if schedule == "2bw":
        par = assert_same_delayed_run(cfg, engine_data(), TOL)
        lag = 1
    else:
        par, bad = run_against(cfg, engine_data(), llama_gradient, TOL)
        bad.assert_none(MPI.COMM_WORLD)
        lag = cfg.pp - 1 - par.runner.pp.rank
    mem = par.memory()
    assert mem["versions"] == lag * mem["params"] and mem["params"] > 0, mem


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("kw", [
    dict(dp=4, ep=2, zero=2),  # edp 2: each expert's gradient summed over its copies (ZeRO-2)
    dict(dp=2, tp=2, ep=2, sequence_parallel=True),  # experts whole per tp rank, partial with SP
    dict(pp=2, dp=2, ep=2, microbatches=2, recompute="full"),  # all-to-alls recomputed under 1F1B
])
@collective
def test_engine_runs_mixtral(kw):
    """A Mixtral-style model (4 SwiGLU experts, top-2, grouped-query attention) in the
    Engine: whole experts on their ep rank, tokens sent to them by all-to-all; two clipped
    AdamW steps whose loss, norm, tokens per expert, every gradient and every weight equal
    the serial Trainer's; and the first loss is ``Llama.forward``'s (whose MoE blocks
    tests/test_llama_hf.py holds to transformers' Mixtral) from the same weights."""
    from parity import assert_same_run

    from refmp.training.datasets import get_batch

    cfg, ds = engine_config(n_embd=32, n_kv_head=2, n_expert=4, top_k=2, steps=2, **kw), engine_data()
    model = LM.LlamaConfig(vocab_size=V, block_size=T, n_layer=2, n_head=4, n_kv_head=2,
                           n_embd=32, n_inner=24, rope_theta=100.0, n_expert=4, top_k=2)
    want = LM.Llama.create(model, seed=3, dtype="float64").forward(*get_batch(ds.tokens, 0, B, T))[0]

    def first_loss(par, step):
        got = par.runner.loss_total()  # collective over the world
        if step == 0:
            np.testing.assert_allclose(got, want, **TOL, err_msg="Llama.forward's loss")

    assert_same_run(cfg, ds, check=first_loss)


@pytest.mark.parallel(nprocs=4)
@collective
def test_engine_init_checkpoint_resume_save_convert(tmp_path):
    """``--init LLAMA_DIR`` on pp 2 x tp 2 (tp > NKV) for two steps with a sharded
    checkpoint; ``--resume`` on dp 2 x cp 2 with ZeRO-3 for the third and ``--save DIR``:
    every loss the serial run's from the same directory, the saved directory its weights;
    ``refmp convert`` turns the checkpoint into a LlamaForCausalLM directory and back."""
    import json

    from refmp.checkpoint.convert import from_gpt2, to_gpt2
    from refmp.cli.train import run
    from refmp.training.trainer import Trainer

    comm = MPI.COMM_WORLD
    folder = comm.bcast(str(tmp_path) if comm.rank == 0 else None)
    cfg = config(1)
    common = dict(arch=None, n_kv_head=None, ffn=None, rope_theta=None, rms_eps=None,
                  head=None, n_head=None, data=f"{folder}/data.npy")
    serial_losses, serial, mid, failed = [], None, {}, None
    if comm.rank == 0:  # the serial run; an error here is raised on every rank below
        try:
            np.save(f"{folder}/data.npy", np.random.default_rng(0).integers(0, V, 400))
            save_llama(f"{folder}/init", cfg, LM.Llama.create(cfg, seed=9, dtype="float64").params)
            serial = Trainer(engine_config(**common, init=f"{folder}/init"),
                             grid=ProcessGrid(MPI.COMM_SELF))
            serial_losses = [serial.step()["loss"] for _ in range(2)]
            mid = {k: np.asarray(v) for k, v in serial.runner.full_params().items()}
            serial_losses.append(serial.step()["loss"])
        except Exception as e:  # noqa: BLE001
            failed = f"the serial run: {type(e).__name__}: {e}"
    failed = comm.bcast(failed)
    assert failed is None, failed
    run(engine_config(**common, init=f"{folder}/init", steps=2, pp=2, tp=2, microbatches=2,
                      checkpoint_dir=f"{folder}/ck", log_json=f"{folder}/a.json",
                      save=f"{folder}/mid"))
    run(engine_config(**common, resume=f"{folder}/ck", dp=2, cp=2, zero=3,
                      save=f"{folder}/out", log_json=f"{folder}/b.json"))
    if comm.rank == 0:
        losses = [json.loads(line)["loss"] for f in ("a", "b") for line in
                  open(f"{folder}/{f}.json") if '"step"' in line and "summary" not in line]
        np.testing.assert_allclose(losses, serial_losses, **TOL)
        want = {k: np.asarray(v) for k, v in serial.runner.full_params().items()}
        for out, weights in (("mid", mid), ("out", want)):  # --save from tp x pp, dp x cp
            saved_cfg, saved = load_llama(f"{folder}/{out}")
            assert saved_cfg == cfg
            for k, v in saved.items():
                np.testing.assert_allclose(v, weights[k], **TOL, err_msg=f"{out}: saved {k}")
        to_gpt2(f"{folder}/ck", f"{folder}/hf")  # the checkpoint of step 2 as a directory
        from_gpt2(f"{folder}/hf", f"{folder}/back")  # and that directory as a checkpoint
        to_gpt2(f"{folder}/back", f"{folder}/hf2")
        a, b = load_llama(f"{folder}/hf")[1], load_llama(f"{folder}/hf2")[1]
        for k in a:
            np.testing.assert_allclose(a[k], mid[k], **TOL, err_msg=f"converted {k}")
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"converted back {k}")


@pytest.mark.parallel(nprocs=4)
@collective
def test_engine_refuses_what_it_would_guess_or_cannot_split(capsys):
    """Bad Llama runs end on every rank with one message and status 2, before any step."""
    from refmp.cli.main import main

    fresh = ["train", "--arch", "llama", "--n-head", "4", "--n-embd", "16", "--n-kv-head",
             "1", "--ffn", "24", "--rope-theta", "100", "--rms-eps", "1e-6", "--steps", "1",
             "--batch-size", "4", "--block-size", "8", "--no-progress"]
    cases = {
        "--rope-theta": fresh[:10] + fresh[12:] + ["--head", "untied"],  # not given: refused
        "add --arch llama": ["train", "--n-kv-head", "2", "--steps", "1"],
        "dualpipev": fresh + ["--head", "tied", "--pp", "2", "--microbatches", "2"],
        "rank holds both ends": fresh + ["--head", "tied", "--pp", "2", "--schedule", "2bw"],
        "counted in the wrong step": fresh + ["--head", "untied", "--n-expert", "4", "--pp", "2",
                                              "--schedule", "pipedream"],
        "--fp8 tensor": fresh + ["--head", "untied", "--fp8", "tensor"],
        "LlamaForCausalLM directory": fresh + ["--head", "untied", "--save", "m.safetensors"],
        "n_inner (6)": fresh + ["--head", "untied", "--tp", "4", "--ffn", "6", "--n-layer", "2"],
        "--etp 2 (MoE parallel folding)": fresh + ["--head", "untied", "--n-expert", "4",
                                                   "--dp", "4", "--ep", "2", "--etp", "2"],
        "--capacity-factor are GPT-2's": fresh + ["--head", "untied", "--n-expert", "4",
                                                  "--capacity-factor", "1.0"],
    }
    for says, argv in cases.items():
        assert main(argv) == 2, says  # every rank
        err = capsys.readouterr().err
        assert MPI.COMM_WORLD.rank or says in err, (says, err)  # said once, by rank 0
