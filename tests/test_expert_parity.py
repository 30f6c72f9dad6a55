"""Level 2/3 for mixture of experts: MoE training on every layout equals the serial run.

tests/parity.assert_same_run trains the serial MoE model on rank 0 and the layout on every
rank (float64), and compares after every step the loss, the MoE aux loss and tokens per
expert, the norm, the whole gradient and the whole model. Layouts: experts over ep ranks
carved from dp x cp (ep2 x dp2, ep4), with and without dropping, top-1 and top-2, ZeRO 0-3
and micro-batches; and MoE composed with tp (with and without sequence parallelism), with
pipelines (1f1b, zb-h1) and with cp (a sequence's capacity rule spans its cp ranks); MoE
parallel folding (--etp: ep across tp ranks, experts split over etp, with pp, ZeRO and SP,
and a checkpoint resumed in another folding). The
check hook holds the all-to-all(v) bytes of every step against what the routing implies
(alltoallv_bytes, from the serial model's routing on the same weights), and the dropped
fraction against the capacity arithmetic.
"""

import math
import shutil
import tempfile
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_helpers import Mismatches, collective, mpiexec, refmp, refused_each
from parity import TOL, assert_same_run, host, serial_config

from refmp.cost.expert import alltoallv_bytes, folded_bytes
from refmp.cost.memory import estimate_memory
from refmp.distributed.grid import ProcessGrid
from refmp.nn import gpt
from refmp.nn import moe as M
from refmp.parallel.context.chunks import SequenceChunks
from refmp.parallel.data.accumulate import dp_rows
from refmp.parallel.expert import expert_index, is_expert
from refmp.parallel.holdings import who_holds
from refmp.training.datasets import Dataset, get_batch
from refmp.training.trainer import TrainConfig, Trainer

pytestmark = pytest.mark.mpi


def token_owners(grid: ProcessGrid, cfg: TrainConfig, B: int, T: int):
    """owner (B, T): the dp x cp index f = dp_i cp + cp_i of the rank holding each token
    (the ep folding, refmp.distributed.grid), and mask (B, T): the tokens the ranks of my tp coordinate
    hold (all of them, unless sequence parallelism gives each tp rank T/tp)."""
    s, tp_i = grid.sizes, grid.coords["tp"]
    owner, mask = np.zeros((B, T), dtype=int), np.zeros((B, T), dtype=bool)
    layout = SequenceChunks(T, s["cp"], cfg.cp_balance) if s["cp"] > 1 else None
    for d in range(s["dp"]):
        rows = dp_rows(B, s["dp"], d)
        for c in range(s["cp"]):
            held = layout.positions(c) if layout else np.arange(T)  # (T/cp,) positions
            if cfg.sequence_parallel:  # my tp coordinate's T/(cp tp) of them
                n = len(held) // s["tp"]
                held = held[tp_i * n : (tp_i + 1) * n]
            owner[rows, held[:, None]] = d * s["cp"] + c
            mask[rows, held[:, None]] = True
    return owner, mask


class RoutingWatch:
    """The parity run's check hook: after every step, this rank's all-to-all(v) bytes in the
    ledger against alltoallv_bytes of the serial model's routing of that step's batch on the
    weights the step started from (the initial ones, then the gathered model), and the
    step's dropped fractions (collective: every rank calls it after every step)."""

    def __init__(self, cfg: TrainConfig, ds: Dataset):
        self.cfg, self.ds = cfg, ds
        self.weights, self.before, self.bytes, self.dropped = None, 0, [], []

    def __call__(self, par, s: int) -> None:
        cfg, grid, run, m = self.cfg, par.grid, par.runner, par.mcfg
        if self.weights is None:  # layout-independent initialization: no communication
            self.weights = gpt.init_params(m, cfg.seed, cfg.dtype)
        B, T = cfg.batch_size, par.T
        x, y = get_batch(self.ds.tokens, s, B, T)
        _, cache = gpt.GPT(m, self.weights).forward(x, y)
        owner, mask = token_owners(grid, cfg, B, T)
        f = grid.coords["dp"] * grid.sizes["cp"] + grid.coords["cp"]  # my index in dp x cp
        mine = {i for c in run.stage.chunks.values() for i in c}  # my stage's blocks
        want = 0
        for i, c in enumerate(cache[1]):
            if i in mine and isinstance(c.mlp, M.MoECache) and grid.sizes["ep"] > 1:
                order = c.mlp.order  # kept assignments a = n K + k, over the global batch
                tok, expert = order // m.top_k, c.mlp.top.reshape(-1)[order]
                held = mask.reshape(-1)[tok]
                want += alltoallv_bytes(owner.reshape(-1)[tok][held], expert[held], f,
                                        grid.sizes["ep"], m.n_expert, m.n_embd, 8)
        got = grid.ledger.bytes("alltoallv", "ep")
        self.bytes.append((got - self.before, want))
        self.before = got
        self.dropped.append(run.stats["moe"]["dropped"])  # collective
        if s < cfg.steps - 1:  # the weights the next step starts from, on every rank
            self.weights = grid.world.mpi.bcast(run.full_params(), root=0)


def check_moe_run(cfg: TrainConfig, ds: Dataset) -> None:
    watch = RoutingWatch(cfg, ds)
    par = assert_same_run(cfg, ds, check=watch)
    grid, run, m, bad = par.grid, par.runner, par.mcfg, Mismatches()
    for s, (got, want) in enumerate(watch.bytes):
        bad.check(np.testing.assert_equal, got, want, err_msg=f"all-to-all(v) bytes, step {s}")
    # per dispatch (each MoE layer of my stage, each micro-batch): one all-to-all of the E
    # int64 counts and four all-to-all(v) (tokens out and back, gradients out and back)
    n_moe = sum(m.is_moe(i) for c in run.stage.chunks.values() for i in c)
    calls = cfg.steps * n_moe * cfg.microbatches if grid.sizes["ep"] > 1 else 0
    led = grid.ledger
    bad.check(np.testing.assert_equal, led.count("alltoall", "ep"), calls, err_msg="alltoall calls")
    bad.check(np.testing.assert_equal, led.bytes("alltoall", "ep"), calls * m.n_expert * 8,
              err_msg="alltoall bytes")
    bad.check(np.testing.assert_equal, led.count("alltoallv", "ep"), 4 * calls,
              err_msg="alltoallv calls")
    # my experts are E/ep of each MoE layer: ep rank r holds [r El, (r + 1) El)
    El, r = m.n_expert // grid.sizes["ep"], grid.comm["ep"].rank
    for u, unit in run.sharder.units.items():
        experts_here = sorted({expert_index(k) for k in unit.shapes if is_expert(k)})
        if experts_here:  # an expert unit (placement.unit_of)
            bad.check(np.testing.assert_equal, experts_here, list(range(r * El, (r + 1) * El)),
                      err_msg=f"experts of {u}")
    # dropping: none without a capacity; certain when a sequence's K T assignments exceed
    # the E cap slots (a sequence split over cp or SP ranks counts as a whole)
    T = par.T
    if not cfg.capacity_factor:
        bad.check(np.testing.assert_equal, max(max(d) for d in watch.dropped), 0.0)
    elif m.n_expert * M.capacity(cfg.capacity_factor, m.top_k, T, m.n_expert) < m.top_k * T:
        assert min(min(d) for d in watch.dropped if d) > 0, watch.dropped
    bad.assert_none()


def moe_config(size: int, E: int, K: int, cf: float, T: int, rows: int, seed: int,
               **layout) -> TrainConfig:
    """A small MoE run: ``rows`` sequences per data-parallel rank and micro-batch."""
    dp = size // (layout.get("pp", 1) * layout.get("cp", 1) * layout.get("tp", 1))
    return TrainConfig(n_layer=2, n_head=2, n_embd=8, block_size=T,
                       batch_size=dp * rows * layout.get("microbatches", 1), steps=3, lr=0.01,
                       warmup_steps=1, grad_clip=0.05, dtype="float64", seed=seed,
                       n_expert=E, top_k=K, moe_every=layout.pop("moe_every", 1),
                       capacity_factor=cf, aux_loss_coef=0.1, z_loss_coef=0.01,
                       progress=False, **layout)


def dataset(seed: int) -> Dataset:
    return Dataset(np.random.default_rng(seed).integers(0, 11, 300), 11, "random")


@pytest.mark.parallel(nprocs=[2, 4])
@settings(max_examples=3, phases=[Phase.explicit, Phase.generate])  # no shrinking: fail fast
@given(ep=st.sampled_from([1, 2, 4]), per_rank=st.sampled_from([1, 2]), K=st.integers(1, 2),
       cf=st.sampled_from([0.0, 1.0, 0.5]), moe_every=st.integers(1, 2), T=st.integers(2, 6),
       rows=st.integers(1, 2), zero=st.integers(0, 3), microbatches=st.integers(1, 2),
       seed=st.integers(0, 1000))
# always: ep2 x dp2 dropping, top-2 (on 4 ranks; ep2 on 2); ep4 dropless, top-1 (ep2 on 2)
@example(ep=2, per_rank=2, K=2, cf=1.0, moe_every=1, T=6, rows=2, zero=0, microbatches=1,
         seed=7)
@example(ep=4, per_rank=1, K=1, cf=0.0, moe_every=2, T=5, rows=1, zero=0, microbatches=1,
         seed=8)
@collective
def test_moe_data_and_expert_parallel_equals_serial(ep, per_rank, K, cf, moe_every, T, rows,
                                                    zero, microbatches, seed):
    size = MPI.COMM_WORLD.size
    ep = min(ep, size)  # (no assume() here: @collective would see it as a failure)
    E = max(2, ep * per_rank)  # divisible by ep
    cfg = moe_config(size, E, min(K, E), cf, T, rows, seed, moe_every=moe_every, ep=ep,
                     zero=zero, microbatches=microbatches)
    check_moe_run(cfg, dataset(seed))


LAYOUTS = {  # MoE composed with each other axis; ep takes what dp x cp allows
    "tp2": dict(tp=2),
    "tp2 sp": dict(tp=2, sequence_parallel=True),
    "pp2 1f1b": dict(pp=2, schedule="1f1b", microbatches=2),
    "pp2 zb-h1": dict(pp=2, schedule="zb-h1", microbatches=2),
    "cp2": dict(cp=2),
    "cp2 ulysses": dict(cp=2, cp_algo="ulysses"),
}


@pytest.mark.parallel(nprocs=[2, 4])
@settings(max_examples=2, phases=[Phase.explicit, Phase.generate])
@given(layout=st.sampled_from(sorted(LAYOUTS)), big_ep=st.booleans(), K=st.integers(1, 2),
       cf=st.sampled_from([0.5, 1.0, 0.0]), zero=st.integers(0, 3),
       microbatches=st.integers(1, 2), seed=st.integers(0, 1000))
# always: each layout once, with dropping (cf 0.5 drops for sure: 4 x 2 slots < 16), ZeRO
# 1, 2 and 3 and micro-batches spread over them
@example(layout="tp2", big_ep=True, K=2, cf=0.5, zero=1, microbatches=2, seed=1)
@example(layout="tp2 sp", big_ep=True, K=2, cf=0.5, zero=3, microbatches=1, seed=2)
@example(layout="pp2 1f1b", big_ep=True, K=2, cf=0.5, zero=2, microbatches=2, seed=3)
@example(layout="pp2 zb-h1", big_ep=True, K=1, cf=1.0, zero=0, microbatches=2, seed=4)
@example(layout="cp2", big_ep=True, K=2, cf=0.5, zero=0, microbatches=2, seed=5)
@example(layout="cp2 ulysses", big_ep=False, K=1, cf=0.5, zero=3, microbatches=1, seed=6)
@collective
def test_moe_with_every_layout_equals_serial(layout, big_ep, K, cf, zero, microbatches, seed):
    size, kw = MPI.COMM_WORLD.size, dict(LAYOUTS[layout])
    kw.setdefault("microbatches", microbatches)
    folded = size // (kw.get("pp", 1) * kw.get("tp", 1))  # dp x cp: where experts go
    kw["ep"] = folded if big_ep else 1
    n_head = 4 if kw.get("cp_algo") == "ulysses" else 2
    cfg = moe_config(size, 4, K, cf, 8, 1, seed, zero=zero, **kw)
    cfg = TrainConfig(**{**cfg.__dict__, "n_head": n_head})
    check_moe_run(cfg, dataset(seed))


FOLDINGS = [  # MoE parallel folding (--etp): the experts' own grid over each stage's ranks
    dict(tp=2, ep=4, etp=1),  # ep spans tp: four ranks, four different experts
    dict(tp=2, ep=1, etp=2, zero=3, microbatches=2),  # split over 2 ranks, edp 2 (ZeRO-3)
    dict(pp=2, tp=2, ep=2, etp=1, schedule="1f1b", microbatches=2, zero=1),
    dict(tp=2, ep=2, etp=2, sequence_parallel=True),  # etp 2 x ep 2; SP: each rank its T/tp
]


class KeptWatch:
    """The parity run's check hook: the kept assignments A of every step (the routing
    figures, summed over the world), what refmp.cost.expert.folded_bytes needs."""

    def __init__(self):
        self.A = 0

    def __call__(self, par, s: int) -> None:
        self.A += sum(map(sum, par.runner.stats["moe"]["tokens_per_expert"]))  # collective


@pytest.mark.parallel(nprocs=4)
@collective
def test_moe_parallel_folding_equals_serial_and_its_formulas():
    """Each folding trains as the serial model does (loss, gradients, weights every step);
    the world's ledger on ep, etp and tp equals folded_bytes of the run's kept assignments;
    a rank holds E/ep experts of its MoE layers, each 1/etp of an expert but c_proj's bias;
    --save's gatherer gives each parameter whole, as the gathered model; who_holds places
    the rank as its grid does; the memory estimate's state equals the engine's. Then a
    checkpoint saved in one
    folding resumes in another (the experts re-cut from 1 to 2 etp shards) as the serial
    run goes on."""
    world = MPI.COMM_WORLD
    for kw in FOLDINGS:
        cfg = replace(moe_config(4, 4, 2, 1.0, 8, 1, 5, **kw), steps=2)
        watch = KeptWatch()
        par = assert_same_run(cfg, dataset(5), check=watch)
        grid, run, m, bad = par.grid, par.runner, par.mcfg, Mismatches()
        C, E, ep, etp = m.n_embd, m.n_expert, grid.sizes["ep"], grid.sizes["etp"]
        calls = m.n_layer * cfg.microbatches * cfg.steps  # every block is MoE (moe_every 1)
        want = folded_bytes(watch.A, C, 8, E, calls, grid.sizes, cfg.sequence_parallel)
        for (op, axis), nbytes in sorted(want.items()):
            got = world.allreduce(grid.ledger.bytes(op, axis))
            bad.check(np.testing.assert_equal, got, nbytes, err_msg=f"{op}@{axis} {kw}")
        held = sum(math.prod(shape) for unit in run.sharder.units.values()
                   for k, shape in unit.shapes.items() if is_expert(k))
        n_moe = sum(m.is_moe(i) for c in run.stage.chunks.values() for i in c)
        per_expert = 2 * C * 4 * C // etp + 4 * C // etp + C
        bad.check(np.testing.assert_equal, held, n_moe * E // ep * per_expert,
                  err_msg=f"expert elements held {kw}")
        whole, gather = run.full_params(), run.param_gatherer()  # --save's, name by name
        whole = host(whole) if whole is not None else None  # world rank 0's
        for k in gpt.param_shapes(m):
            got = gather(k)
            if whole is not None:
                bad.check(np.testing.assert_array_equal, got, whole[k], err_msg=f"save {k}")
        row = who_holds(m, grid.sizes, par.T)[grid.rank]  # the guide's who-holds-what
        mine = sorted({expert_index(k) for u in run.sharder.units.values() for k in u.shapes
                       if is_expert(k)})
        bad.check(np.testing.assert_equal, [row[a] for a in ("ep", "etp", "edp", "experts")],
                  [grid.comm["ep"].rank, grid.comm["etp"].rank, grid.comm["edp"].rank, mine],
                  err_msg=f"who_holds {kw}")
        got, est = par.memory(), estimate_memory(cfg, m, grid.sizes, grid.coords)
        for k in ("params", "grads", "optimizer"):
            bad.check(np.testing.assert_equal, est[k], got[k], err_msg=f"memory {k} {kw}")
        bad.assert_none(world)
    resume_in_another_folding(world)


def resume_in_another_folding(world) -> None:
    """Save after step 1 on tp 2 x ep 4 (etp 1), resume on etp 2 x ep 2 with ZeRO 1: step 2's
    loss and weights equal the serial run's."""
    cfg = replace(moe_config(4, 4, 2, 1.0, 8, 1, 6, tp=2, ep=4, etp=1), steps=2)
    ds, bad = dataset(6), Mismatches()
    serial = Trainer(serial_config(cfg), grid=ProcessGrid(MPI.COMM_SELF), dataset=ds) \
        if world.rank == 0 else None
    losses = [serial.step()["loss"] for _ in range(2)] if serial is not None else None
    first = Trainer(cfg, dataset=ds)
    first.step()
    d = world.bcast(tempfile.mkdtemp(prefix="refmp-etp-") if world.rank == 0 else None)
    first.save_checkpoint(d)
    second = Trainer(replace(cfg, ep=2, etp=2, zero=1, resume=d), dataset=ds)
    loss = second.step()["loss"]
    got = second.runner.full_params()
    if serial is not None:
        bad.check(np.testing.assert_allclose, loss, losses[1], **TOL, err_msg="resumed loss")
        want = host(serial.runner.full_params())
        for k, v in host(got).items():
            bad.check(np.testing.assert_allclose, v, want[k], **TOL, err_msg=f"resumed {k}")
        shutil.rmtree(d)
    bad.assert_none(world)


@pytest.mark.parallel(nprocs=3)  # 3: blocks of every size 0..2 between every pair
@collective
def test_comm_alltoallv_uneven_and_empty_blocks():
    from refmp.distributed.comm import Comm

    c = Comm(MPI.COMM_WORLD, "ep")
    r, n = c.rank, c.size
    send = [(r + j) % 3 for j in range(n)]  # some blocks are empty
    buf = np.concatenate([np.full((send[j], 2), 10.0 * r + j) for j in range(n)])
    recv = c.alltoall(np.array(send, dtype=np.int64))
    out = c.alltoallv(buf, send, recv)
    expect = np.concatenate([np.full(((s + r) % 3, 2), 10.0 * s + r) for s in range(n)])
    np.testing.assert_array_equal(out, expect)
    assert c.ledger.bytes("alltoallv", "ep") == buf.nbytes  # the send buffer, this rank
    assert c.ledger.bytes("alltoall", "ep") == 8 * n


SMALL = ["train", "--n-layer", "1", "--n-head", "2", "--n-embd", "8", "--batch-size", "4",
         "--steps", "2", "--no-progress"]


BAD_EXPERTS = [
    (["--ep", "2", "--n-expert", "3"], "--n-expert (3) must be divisible by --ep (2)"),
    (["--n-expert", "2", "--top-k", "3"], "--top-k (3) must be between 1 and --n-expert (2)"),
    (["--ep", "2"], "--ep 2 needs a mixture-of-experts model"),
    (["--ep", "4", "--n-expert", "4"], "--ep (4) must divide dp * cp (2 * 1)"),
    (["--ep", "4", "--n-expert", "4", "--cp", "2", "--block-size", "8"],
     "--ep (4) must divide dp * cp (1 * 2)"),
    (["--etp", "1"], "--etp 1 folds the experts' grid: it needs a mixture-of-experts model"),
    (["--ep", "2", "--etp", "2", "--n-expert", "4"],
     "--ep x --etp (2 x 2) must divide a stage's ranks, tp * cp * dp (1 * 1 * 2)"),
    (["--etp", "-1", "--n-expert", "2"], "--etp must be 0 (experts copied over tp) or at least 1"),
]


@pytest.fixture(scope="module")
def bad_experts_runs():
    """BAD_EXPERTS's command lines, each refused on 2 ranks, all in one launch
    (mpi_helpers.refused)."""
    return refused_each(2, SMALL, BAD_EXPERTS)


@pytest.mark.parametrize("args, message", BAD_EXPERTS)
def test_bad_expert_layouts_are_refused_on_every_rank(bad_experts_runs, args, message):
    r = bad_experts_runs[str(args)]
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and r.stderr.count("error:") == 1, r.stderr
    assert "Traceback" not in r.stderr


def test_etp_must_divide_the_experts_hidden_size():
    """check_layout, the pure rule every rank applies before any work: 4C = 32 over etp 3."""
    from refmp.errors import ConfigError
    from refmp.parallel.rules import check_layout

    cfg = moe_config(3, 3, 1, 0.0, 6, 1, 0, etp=3, ep=1)
    with pytest.raises(ConfigError, match=r"--etp 3 must divide the experts' hidden size 4C = 32"):
        check_layout(cfg, gpt.GPTConfig(n_layer=2, n_head=2, n_embd=8, n_expert=3), 3)


def test_cli_expert_parallel_run_saves_the_full_model_and_reports_stats(tmp_path):
    import json

    from safetensors.numpy import load_file

    from refmp.checkpoint.weights import load_model

    log, a = tmp_path / "log.jsonl", tmp_path / "a.safetensors"
    moe = ["--n-expert", "4", "--top-k", "2", "--capacity-factor", "0.5", "--moe-every", "1"]
    r = refmp(2, [*SMALL, "--ep", "2", *moe, "--dtype", "float64", "--log-json", str(log),
                  "--save", str(a)], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "tokens per expert" in r.stdout and "alltoallv@ep" in r.stdout
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert all("moe" in x for x in lines)
    assert 0 < lines[0]["moe"]["dropped"][0] < 1  # capacity 0.5 drops some
    # the file holds the full model with every expert, equal to the serial run's
    cfg = TrainConfig(n_layer=1, n_head=2, n_embd=8, batch_size=4, steps=2, dtype="float64",
                      n_expert=4, top_k=2, capacity_factor=0.5, progress=False)
    tr = Trainer(cfg, grid=ProcessGrid(MPI.COMM_SELF))
    for _ in range(2):
        tr.step()
    saved, want = load_file(str(a)), tr.runner.full_params()
    assert set(saved) == set(want) and "h.0.mlp.experts.3.c_fc.weight" in saved
    for k, v in want.items():
        np.testing.assert_allclose(saved[k], v, rtol=1e-9, atol=1e-12, err_msg=k)
    loaded = load_model(str(a), dtype="float64")  # --init reads the MoE shape back
    assert (loaded.cfg.n_expert, loaded.cfg.top_k, loaded.cfg.capacity_factor) == (4, 2, 0.5)


@pytest.mark.tutorial
@pytest.mark.parametrize("n", [2, 4])
def test_tutorial_08_experts(n):
    r = mpiexec(n, ["python", "tutorials/08_experts.py"], timeout=200)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: expert parallel == serial" in r.stdout and "DROP" in r.stdout
    assert "Part 1. by hand: ep = " in r.stdout
    assert r.stdout.count("step 3:") == 1  # rank 0 alone narrates
