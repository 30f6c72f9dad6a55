"""One engine, any layout: pp x dp x cp x tp with experts, ZeRO 0-3, SP and micro-batches.

Level 2/3 parity (float64, 3 AdamW steps with clipping: loss, every gradient and every weight
equal to the serial run, tests/parity.py) over layouts drawn by hypothesis on 8 ranks, the
layouts where two axes meet in one piece (COMPOSED), and one 16-rank 4D run with experts;
then the ledger and the memory of a composed layout against the single-axis formulas, scaled
by the other axes; then that each rank builds only its share: its step-0 weights are the
serial init's (or the --init file's) slices in every layout kind, and tracemalloc's peak
while it builds is its share plus one read.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_helpers import Mismatches, collective, refmp, refused
from parity import assert_same_run

from refmp.cost.tensor import comm_bytes_per_step
from refmp.cost.zero import comm_per_step, memory_per_rank, unit_sizes
from refmp.distributed.grid import ProcessGrid
from refmp.training.datasets import Dataset
from refmp.training.trainer import TrainConfig, Trainer

pytestmark = pytest.mark.mpi


def config(**kw) -> TrainConfig:
    base = dict(n_layer=2, n_head=4, n_embd=16, block_size=8, batch_size=4, steps=3,
                lr=0.01, warmup_steps=1, grad_clip=0.05, dtype="float64", seed=3,
                progress=False, capacity_factor=1.0, top_k=2)
    return TrainConfig(**{**base, **kw})


def data(V: int = 17, seed: int = 0) -> Dataset:
    return Dataset(np.random.default_rng(seed).integers(0, V, 400), V, "random")


@st.composite
def layouts(draw, world: int = 8):
    """A layout of ``world`` ranks and the options that fit it (every rule of check_layout)."""
    sizes = [1, 2, 4]
    pp = draw(st.sampled_from(sizes))
    tp = draw(st.sampled_from([t for t in sizes if pp * t <= world]))
    cp = draw(st.sampled_from([c for c in sizes if world % (pp * tp * c) == 0]))
    dp = world // (pp * tp * cp)
    moe = draw(st.booleans())
    ep = draw(st.sampled_from([e for e in sizes if (dp * cp) % e == 0])) if moe else 1
    kw = dict(pp=pp, tp=tp, cp=cp, dp=dp, ep=ep, zero=draw(st.integers(0, 3)),
              microbatches=draw(st.sampled_from([1, 2])), n_expert=4 if moe else 0,
              top_k=draw(st.sampled_from([1, 2])),
              capacity_factor=draw(st.sampled_from([0.0, 1.0])),
              cp_algo=draw(st.sampled_from(["ring", "ulysses"] if (4 // tp) % cp == 0
                                           else ["ring"])),
              cp_balance=draw(st.sampled_from(["zigzag", "contiguous"])),
              sequence_parallel=tp > 1 and draw(st.booleans()))
    if pp > 1:
        kw["schedule"] = draw(st.sampled_from(["1f1b", "gpipe", "zb-h1", "interleaved"]))
        if kw["schedule"] == "interleaved":
            kw.update(virtual_stages=2, microbatches=pp, n_layer=2 * pp)
        kw.setdefault("n_layer", max(2, pp))
    kw["batch_size"] = dp * kw["microbatches"]
    return kw, draw(st.sampled_from([16, 17]))  # vocabulary divisible by tp, or not


@pytest.mark.parallel(nprocs=8)
@settings(max_examples=6)
@given(layout=layouts())
@collective
def test_any_layout_of_8_ranks_equals_serial(layout):
    kw, V = layout
    assert_same_run(config(**kw), data(V))


# layouts where two axes meet in one piece (cp with pp, ZeRO-2 or accumulation; ...), on 4 ranks
COMPOSED = [
    dict(pp=2, cp=2, microbatches=2),
    dict(cp=2, dp=2, zero=2),
    dict(cp=2, dp=2, microbatches=2),
    dict(tp=2, pp=2, zero=1, microbatches=2),
    dict(tp=2, pp=2, zero=2, microbatches=2, schedule="zb-h1"),
    dict(pp=2, dp=2, zero=3, microbatches=2),
    dict(tp=2, cp=2, zero=1, cp_algo="ulysses"),
    dict(tp=2, cp=2, sequence_parallel=True),
    dict(n_expert=4, tp=2, dp=2, ep=2, sequence_parallel=True),
    dict(n_expert=4, pp=2, dp=2, ep=2, microbatches=2, schedule="zb-h1"),
    dict(n_expert=4, cp=2, dp=2, ep=4),
    dict(n_expert=4, dp=4, ep=2, zero=3, microbatches=2, batch_size=8),
]


@pytest.mark.parallel(nprocs=4)
@collective
def test_layouts_refused_before_now_equal_serial():
    for kw in COMPOSED:
        assert_same_run(config(**kw), data())


@pytest.mark.parallel(nprocs=16)
@collective
def test_5d_pp2_dp2_cp2_tp2_with_experts_and_zero1():
    kw = dict(pp=2, dp=2, cp=2, tp=2, ep=2, n_expert=4, zero=1, microbatches=2, steps=2)
    assert_same_run(config(**kw), data())


@pytest.mark.parallel(nprocs=8)
@collective
def test_composed_ledger_and_memory_equal_the_single_axis_formulas():
    """tp2 x cp2 x dp2 with ZeRO-1 and 2 micro-batches: each axis moves what its own formula
    says, with the other axes' splits put in (b = B/dp rows, s = T/cp tokens, C/tp heads)."""
    cfg = config(tp=2, cp=2, dp=2, zero=1, microbatches=2, batch_size=4, steps=2)
    tr = Trainer(cfg, dataset=data(16))
    tr.grid.ledger.reset()
    for _ in range(cfg.steps):
        tr.step()
    led, m, w = tr.grid.ledger, tr.runner.mcfg, 8
    b, s, C, L = cfg.batch_size // 2, cfg.block_size // 2, m.n_embd, m.n_layer
    tp_want = comm_bytes_per_step(b, s, C, L, False, w)["allreduce"]
    sizes = unit_sizes(m, tp=2)
    zero_want = comm_per_step(sizes, 4, 1, cfg.microbatches, w)
    # the ring: per layer (cp-1) K/V blocks forward, again backward, and the dK/dV shares
    ring_want = 3 * (2 - 1) * L * 2 * b * s * (C // 2) * w
    bad = Mismatches()
    bad.check(np.testing.assert_equal, led.bytes("allreduce", "tp"), cfg.steps * tp_want)
    for op in ("reduce_scatter", "allgather"):
        bad.check(np.testing.assert_equal, led.bytes(op, "dp+cp"), cfg.steps * zero_want[op],
                  err_msg=op)
    bad.check(np.testing.assert_equal, led.bytes("allreduce", "dp+cp"), 0)
    bad.check(np.testing.assert_equal, led.bytes("send", "cp"), cfg.steps * ring_want)
    mem, want = tr.memory(), memory_per_rank(sizes, 4, 1, itemsize=w)
    for k in ("params", "grads", "optimizer"):
        bad.check(np.testing.assert_equal, mem[k], want[k], err_msg=k)
    bad.assert_none()


def test_grid_groups_are_cached_and_named_by_their_axes():
    from refmp.distributed.grid import ProcessGrid

    g = ProcessGrid(MPI.COMM_SELF)
    assert g.group("dp", "cp") is g.group("cp", "dp")  # one communicator per group
    assert g.group("dp", "cp").axis == "dp" and g.size("dp", "cp") == 1
    assert not hasattr(g, "dp")  # sizes and coordinates are data: g.sizes, g.coords


ARITHMETIC = [
    (2, ["--tp", "2", "--n-head", "3", "--n-embd", "12"], "must divide the number of heads"),
    (4, ["--cp", "2", "--tp", "2", "--cp-algo", "ulysses", "--n-head", "2",
         "--block-size", "8"], "must be divisible by --cp 2"),
    (2, ["--ep", "2"], "needs a mixture-of-experts model"),
    (2, ["--ep", "4", "--n-expert", "4"], "must divide dp * cp"),
    (2, ["--sequence-parallel"], "it needs --tp > 1"),
    (2, ["--tp", "2", "--cp", "1", "--sequence-parallel", "--block-size", "7"],
     "must divide the tokens each rank"),
]


@pytest.fixture(scope="module")
def arithmetic_runs():
    """ARITHMETIC's command lines, refused on 2 or 4 ranks: one launch per rank count
    (mpi_helpers.refused)."""
    runs = {}
    for n in sorted({n for n, _, _ in ARITHMETIC}):
        cases = {str(args): ["train", "--no-progress", "--steps", "1", *args]
                 for m, args, _ in ARITHMETIC if m == n}
        runs.update({(n, k): r for k, r in refused(n, cases).items()})
    return runs


@pytest.mark.cli
@pytest.mark.parametrize("n,args,message", ARITHMETIC)
def test_arithmetic_refusals_are_one_message_on_every_rank(arithmetic_runs, n, args, message):
    r = arithmetic_runs[n, str(args)]
    assert r.returncode != 0
    assert r.stderr.count(message) == 1, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.cli
def test_cli_runs_a_4d_layout_with_experts(tmp_path):
    """pp2 x cp2 x tp2 (8 ranks) from the command line, --save equal to the serial run's."""
    out = tmp_path / "m.safetensors"
    args = ["--n-layer", "2", "--n-head", "4", "--n-embd", "16", "--block-size", "8",
            "--digits", "2", "--batch-size", "4", "--steps", "2", "--dtype", "float64",
            "--n-expert", "4", "--no-progress"]
    r = refmp(8, ["train", *args, "--pp", "2", "--cp", "2", "--tp", "2", "--ep", "2",
                  "--zero", "2", "--microbatches", "2", "--save", str(out)], timeout=240)
    assert r.returncode == 0, r.stderr
    assert "pp=2 x dp=1 x cp=2 x tp=2 x ep=2" in r.stdout
    from safetensors.numpy import load_file

    cfg = TrainConfig(n_layer=2, n_head=4, n_embd=16, block_size=8, digits=2, batch_size=4,
                      steps=2, dtype="float64", n_expert=4, progress=False)  # the CLI's run
    from refmp.distributed.grid import ProcessGrid

    serial = Trainer(cfg, grid=ProcessGrid(MPI.COMM_SELF))
    for _ in range(cfg.steps):
        serial.step()
    want, got = serial.runner.full_params(), load_file(str(out))
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-9, atol=1e-12, err_msg=k)


@pytest.mark.tutorial
def test_tutorial_09_any_layout():
    from mpi_helpers import mpiexec

    r = mpiexec(8, ["python", "tutorials/09_any_layout.py"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: any layout == serial" in r.stdout
    assert r.stdout.count("ZeRO-1 owns") == 1 and r.stdout.count("\n7 ") == 1  # 8 rows


@pytest.mark.parametrize("sizes", [dict(pp=2, dp=2, cp=2, tp=1, ep=2), dict(pp=3, dp=1, cp=2, tp=2, ep=1),
                                   dict(pp=1, dp=4, cp=1, tp=2, ep=4)])
def test_who_holds_numbers_the_ranks_as_the_grid_does(sizes):
    """holdings.who_holds (the guide's pictures) puts each rank where ProcessGrid does;
    tutorial 9 checks the rest (blocks, tokens, experts) against a running engine."""
    from refmp.distributed.grid import ProcessGrid
    from refmp.nn.params import GPTConfig
    from refmp.parallel.holdings import who_holds

    grid = object.__new__(ProcessGrid)  # coords_of and rank_of read the sizes alone
    grid.sizes = sizes
    mcfg = GPTConfig(vocab_size=16, block_size=8, n_layer=6, n_head=4, n_embd=8, n_expert=4)
    rows = who_holds(mcfg, sizes, 8)
    assert [r["rank"] for r in rows] == list(range(len(rows)))
    for row in rows:
        coords = {a: row[a] for a in ("pp", "dp", "cp", "tp")}
        assert coords == grid.coords_of(row["rank"]) and grid.rank_of(**coords) == row["rank"]


# --- each rank builds only its share: the step-0 weights are the serial init's slices ------

# every layout kind on 4 ranks: (source, layout, vocabulary); "init" a fresh init, "file" an
# --init GPT-2 file, "hf" an --init Hugging Face directory
BUILT = [
    ("init", dict(dp=4), 16),
    ("init", dict(dp=2, tp=2, zero=1), 17),  # tp with a padded vocabulary
    ("init", dict(dp=4, zero=2), 16),
    ("init", dict(dp=4, zero=3), 17),
    ("init", dict(dp=4, zero=3, hpz_size=2), 16),
    ("init", dict(pp=2, schedule="zb-v", microbatches=2, n_layer=5, stage_layers="2,1,1,1"), 16),
    ("init", dict(tp=2, pp=2, microbatches=2), 17),
    ("init", dict(cp=2, dp=2, zero=3), 16),
    ("init", dict(n_expert=4, dp=4, ep=4, zero=1), 16),
    ("init", dict(n_expert=4, dp=2, tp=2, ep=2, zero=3), 17),
    ("file", dict(dp=4, zero=3), 17),
    ("file", dict(tp=2, pp=2, microbatches=2, stage_layers="1,1"), 17),
    ("hf", dict(dp=2, tp=2, zero=1), 17),
    ("hf", dict(pp=2, dp=2, zero=3, microbatches=2, stage_layers="1,1"), 16),
]


def step0_mismatches(tr, whole: dict) -> list[str]:
    """Where this rank's owned pieces (the optimizer's view, before any step) differ from the
    same elements of ``whole``, the serial model's weights: which elements, from placement's
    tp_shard of the whole positions (not the engine's own Index), cut as the Sharder owns
    them; and where the engine's piece_index (what a checkpoint stores) differs from that."""
    from refmp.parallel.placement import tp_shard
    from refmp.runtime import backend

    run, index = tr.runner, {}
    for unit in run.sharder.units.values():
        for k in unit.shapes:
            at = np.arange(whole[k].size).reshape(whole[k].shape) + 1
            index[k] = tp_shard(k, at, run.tp.rank, run.tp.size) - 1  # padding: -1
    index = run.sharder.owned_index(index.__getitem__)
    stored = run.piece_index()
    bad = [f"piece_index {k}" for k in index if not np.array_equal(stored[k], index[k])]
    for k, piece in run.params.items():
        idx = index[k]
        src = whole.get(k)  # None: a unit's padding, zeros
        want = (np.zeros(idx.shape) if src is None
                else np.where(idx >= 0, src.reshape(-1)[np.maximum(idx, 0)], 0.0))
        if not np.array_equal(backend.to_host(piece), want):
            bad.append(k)
    return bad


def shared_dir() -> str:
    """A temporary directory rank 0 makes and every rank is told."""
    import tempfile

    return MPI.COMM_WORLD.bcast(tempfile.mkdtemp() if MPI.COMM_WORLD.rank == 0 else None)


@pytest.mark.parallel(nprocs=4)
@collective
def test_each_rank_builds_the_serial_models_slices_in_every_layout_kind():
    """Fresh init, an --init file and an HF directory: every owned piece equals the serial
    model's elements (dp, ZeRO 1-3 and hpZ, tp with a padded vocabulary, pp with uneven
    stages and a V schedule, cp, ep); no Trainer keeps a whole model."""
    import os
    import shutil

    from refmp.checkpoint.hf import save_hf
    from refmp.checkpoint.weights import save_model
    from refmp.nn.params import init_params
    from refmp.training.checks import model_config

    world, d = MPI.COMM_WORLD, shared_dir()
    bad = []
    try:
        for source, kw, V in BUILT:
            cfg = config(**{"batch_size": 4, **kw})
            ds = data(V)
            mcfg = model_config(cfg, ds)  # the shape alone, as the run computes it
            whole = init_params(mcfg, cfg.seed if source == "init" else 11, "float64")
            if source != "init":
                path = os.path.join(d, f"{source}{V}{mcfg.n_layer}")
                if world.rank == 0 and not os.path.exists(path):
                    (save_model(path, whole, mcfg) if source == "file"
                     else save_hf(path, whole, mcfg))
                world.barrier()
                cfg = config(**{"batch_size": 4, **kw, "init": path})
            tr = Trainer(cfg, dataset=ds)
            assert not hasattr(tr, "model")
            bad += [f"{source} {kw}: {k}" for k in step0_mismatches(tr, whole)]
    finally:
        world.barrier()
        if world.rank == 0:
            shutil.rmtree(d)
    assert not bad, bad[:8]


def built_peak(cfg: TrainConfig, ds: Dataset) -> tuple[int, int, int, int]:
    """(tracemalloc's peak while this rank builds an Engine from a fresh init, the bytes the
    engine keeps, the largest single read it makes, the whole model's bytes): measured, not
    from refmp.cost's formulas."""
    import math
    import tracemalloc

    from refmp.checkpoint.source import InitSource
    from refmp.distributed.grid import ProcessGrid
    from refmp.nn.params import param_shapes
    from refmp.parallel.data.sharder import owned
    from refmp.parallel.engine import Engine
    from refmp.training.checks import model_config

    mcfg = model_config(cfg, ds)
    grid = ProcessGrid(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, ep=cfg.ep)
    source = InitSource(mcfg, cfg.seed)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        eng = Engine(mcfg, source, grid, cfg.parallel, mcfg.block_size, cfg.seed, cfg.dtype)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    mem, sh, w = eng.memory(), eng.sharder, np.dtype(cfg.dtype).itemsize
    kept = mem["params"] + mem["grads"] + mem["masters"]
    reads = [b - a for u in sh.units.values() for k in u.shapes if (r := owned(u, k))
             for a, b in [r]] if sh.stage == 3 else [
        math.prod(s) for u in sh.units.values() for s in u.shapes.values()]
    whole = sum(math.prod(s) for s in param_shapes(mcfg).values()) * w
    return peak, kept, max(reads) * w, whole


@pytest.mark.parallel(nprocs=4)
@collective
def test_building_holds_the_share_plus_one_read_measured():
    """ZeRO-3 over 4 ranks and tp 2 x pp 2: tracemalloc's peak while a rank builds its engine
    (NumPy reports every allocation to it) is at most what the engine keeps, plus the largest
    single read (a tp shard; at ZeRO-3 an owned range) and two read chunks
    (slices.BLOCK_BYTES: the drawn block and its cut), plus 256 KiB of small objects; and
    well under the whole model."""
    from refmp.nn.slices import BLOCK_BYTES

    for kw in (dict(dp=4, zero=3), dict(tp=2, pp=2, microbatches=2)):
        cfg = config(n_layer=4, n_embd=256, batch_size=4, **kw)
        peak, kept, one, whole = built_peak(cfg, data(512))
        bound = kept + one + 2 * BLOCK_BYTES + 2**18
        print(f"rank {MPI.COMM_WORLD.rank} {kw}: peak {peak:,} kept {kept:,} read {one:,} "
              f"bound {bound:,} whole model {whole:,}")
        assert peak <= bound, (kw, peak, bound, kept, one)
        assert bound < 0.75 * whole, (kw, bound, whole)  # the bound says something


EVALUATED = [  # 4 ranks; each decodes with what it trains, nothing more
    dict(dp=4, zero=3),
    dict(dp=4, ep=2, zero=3, n_expert=4),  # the experts stay on their ep ranks
    dict(pp=2, dp=2, zero=3, schedule="zb-v", microbatches=2),  # a V: two chunks a rank
    dict(tp=2, pp=2, microbatches=2, schedule="interleaved", virtual_stages=2),
    # a Llama model (the Decoder asks its family): 2 key/value heads, copied over tp 4
    dict(tp=4, arch="llama", n_kv_head=2, ffn=256, rope_theta=10000.0, rms_eps=1e-5,
         head="untied", capacity_factor=None, top_k=None),
    # Mixtral-style (no capacity limit, decoded with the cache): each ep rank its experts,
    # gathered unit by unit over edp with ZeRO-3
    dict(dp=4, ep=2, zero=3, arch="llama", n_expert=4, top_k=2, n_kv_head=2, ffn=64,
         rope_theta=10000.0, rms_eps=1e-5, head="untied", capacity_factor=None),
]


@pytest.mark.parallel(nprocs=4)
@collective
def test_evaluation_decodes_what_each_rank_holds_measured():
    """tracemalloc's peak while the addition task is evaluated, in layouts where the
    decoder's split could differ from training's (a V, interleaving: training's chunks are
    decoded as trained) or hold more than a share (ZeRO-3: units gathered as read; ep:
    experts left on their ranks), stays under half the whole model (with ZeRO-3 alone,
    gathering every unit held 1.3 times it); 3 prompts over 4 dp ranks, so one decodes a
    stand-in batch in lockstep. The accuracy, and the greedy tokens of the evaluation's
    decoder, are the ones the whole model gives (decoded alone on each rank from
    Engine.full_params, the check only)."""
    import tracemalloc

    from refmp.inference.decoder import Decoder
    from refmp.inference.generate import Greedy
    from refmp.parallel.family import family_of
    from refmp.training.datasets import AdditionTask
    from refmp.training.evaluate import decoder, evaluate

    task = AdditionTask(digits=2, seed=0, n_train=200, n_test=3)
    for kw in EVALUATED:
        cfg = config(n_layer=8, n_embd=128, block_size=10, batch_size=4, steps=1, **kw)
        grid = ProcessGrid(MPI.COMM_WORLD, **{a: kw.get(a, 1) for a in ("dp", "tp", "pp", "ep")})
        tr = Trainer(cfg, grid=grid, dataset=task.dataset())
        tr.step()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            got = evaluate(tr.runner, tr.grid, tr.mcfg, tr.T, task)
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        whole = sum(math.prod(s) for s in family_of(tr.mcfg).shapes().values()) * 8  # float64
        full = MPI.COMM_WORLD.bcast(tr.runner.full_params(), root=0)  # the check's reference
        alone = ProcessGrid(MPI.COMM_SELF)
        dropping = tr.mcfg.n_expert > 0 and tr.mcfg.capacity_factor > 0  # without the cache
        model = Greedy(Decoder(tr.mcfg, full, alone, axes=("tp", "pp"), capacity=dropping),
                       use_cache=not dropping)
        want = task.score(model, task.test_pairs)
        prompts = task.encode(task.test_pairs)[:, : 2 * task.digits + 2]  # "aa+bb="
        tokens = decoder(tr.runner, tr.grid, tr.mcfg, tr.T).generate(prompts, 3)  # lockstep
        np.testing.assert_array_equal(tokens, model.generate(prompts, 3), err_msg=str(kw))
        print(f"rank {MPI.COMM_WORLD.rank} {kw}: evaluation peak {peak:,} of a "
              f"{whole:,}-byte model")
        assert got == want, (kw, got, want)
        held = 0.5 if kw.get("zero") == 3 else 0.1  # ZeRO-3: a unit or two; else read in place
        assert peak < held * whole, (kw, peak, whole)
