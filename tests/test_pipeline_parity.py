"""Pipeline-parallel training equals the serial run, under real MPI (float64), every schedule.

tests/parity.assert_same_run trains the serial model on rank 0 and the pipeline on every rank
(pp 2 or 4, pp 2 x dp 2, pp 2 x cp 2, with ZeRO 0-3; or pp 1: a one-stage schedule), step by
step, and compares the loss, the norm, the whole gradient and the whole model after every
step. Its check hook watches the later steps: every send on pp (the boundary traffic, the
tied-wte swap) and the ledger of the ZeRO group against the formulas, the executor's peak
micro-batches held against the simulator's, the buffers against ZeRO's memory formula, and
greedy decoding through the pipeline against the serial model's.
"""

import numpy as np
import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_helpers import Mismatches, collective, mpiexec, refmp, refused_each
from parity import assert_same_run

from refmp.cost.zero import comm_per_step, memory_per_rank, padded, unit_sizes
from refmp.nn import gpt
from refmp.parallel.engine import TIED_TAG
from refmp.parallel.pipeline.catalog import CATALOG
from refmp.parallel.pipeline.simulate import simulate_schedule
from refmp.training.datasets import Dataset
from refmp.training.evaluate import decoder
from refmp.training.trainer import TrainConfig

pytestmark = pytest.mark.mpi


class Watch:
    """The parity run's check hook. After the first step it wraps the parallel Trainer's
    step and its pp Comm's send, so that each later step records the ledger's bytes and
    every pp send (dest, tag, bytes) of that step alone (not the parity check's gathers);
    after the last step it gathers the model and decodes through the pipeline (collective:
    every rank is here, so a failure found later on one rank cannot hang the others)."""

    def __init__(self, steps: int, prompt):
        self.steps, self.prompt = steps, prompt
        self.ledgers, self.sends, self.full, self.decoded = [], [], None, None

    def __call__(self, par, s: int) -> None:
        if s == 0:
            pp, send, step = par.runner.pp, par.runner.pp.send, par.step
            log = []

            def spy(buf, dest, tag=0):
                log.append((dest, tag, int(buf.nbytes)))
                return send(buf, dest, tag)

            def watched():
                par.grid.ledger.reset()
                log.clear()
                rec = step()
                self.ledgers.append({k: v["bytes"] for k, v in par.grid.ledger.as_dict().items()})
                self.sends.append(list(log))
                return rec

            pp.send, par.step = spy, watched
        if s == self.steps - 1:
            self.full = par.runner.full_params()  # collective
            greedy = decoder(par.runner, par.grid, par.mcfg, par.T)  # collective
            self.decoded = greedy.generate(self.prompt, 2)  # collective


def check_pipeline_run(cfg: TrainConfig, ds: Dataset) -> None:
    T = cfg.block_size
    watch = Watch(cfg.steps, ds.tokens[: 2 * T].reshape(2, T)[:, : max(1, T - 2)])
    par = assert_same_run(cfg, ds, check=watch)
    run, grid, bad = par.runner, par.grid, Mismatches()
    m, P, r = par.mcfg, grid.sizes["pp"], run.pp.rank
    n_zero, axis = grid.size("dp", "cp"), grid.group("dp", "cp").axis  # the ZeRO group
    # greedy decoding through the pipeline is the serial model's, on the trained weights
    if grid.rank == 0:
        serial = gpt.GPT(m, watch.full).generate(watch.prompt, 2)
        bad.check(np.testing.assert_array_equal, watch.decoded, serial,
                  err_msg="greedy decoding through the pipeline")
    # the executor held exactly what the simulator says this schedule holds
    sim = simulate_schedule(cfg.schedule, P, cfg.microbatches, cfg.virtual_stages)
    bad.check(np.testing.assert_equal, run.executor.peak_held, sim.peak_held[r], err_msg="peak held")
    # ZeRO's memory formula on this rank's units (its stage's blocks, the ends it holds)
    blocks = [i for c in run.stage.chunks.values() for i in c]
    sizes = unit_sizes(m, 1, blocks, run.first, run.last)
    want = memory_per_rank(sizes, n_zero, cfg.zero, 8)
    mem = par.memory()
    for k in ("params", "grads", "optimizer"):
        bad.check(np.testing.assert_equal, mem[k], want[k], err_msg=f"memory {k}")
    # the watched steps: sends on pp (b rows of T/cp tokens), and the ZeRO group's traffic
    rows, C, Tl = cfg.batch_size // grid.sizes["dp"], m.n_embd, T // grid.sizes["cp"]
    boundaries = sum((c < run.n_chunks - 1) + (c > 0) for c in run.stage.chunks)
    # tied wte: the two ends swap the wte unit's owned gradient slice (all of it at ZeRO 0,
    # the padded 1/(dp cp) at ZeRO 1-3; the same flat layout at both ends: Engine.reduce_grads)
    n = n_zero if cfg.zero else 1
    tied = [((P - 1) if run.first else 0, TIED_TAG, padded(m.vocab_size * C, n) // n * 8)]
    tied = tied if run.first != run.last else []  # pp 1, or a V: both ends on one rank
    zero = comm_per_step(sizes, n_zero, cfg.zero, cfg.microbatches, 8, run.first, run.last)
    for s, (ledger, sends) in enumerate(zip(watch.ledgers, watch.sends, strict=True), 1):
        acts = [x for x in sends if x[1] != TIED_TAG]
        bad.check(np.testing.assert_equal, [x for x in sends if x[1] == TIED_TAG], tied,
                  err_msg=f"tied wte swap at step {s}")
        bad.check(np.testing.assert_equal, len(acts), boundaries * cfg.microbatches,
                  err_msg=f"boundary sends at step {s}")
        bad.check(np.testing.assert_equal, sum(x[2] for x in acts), boundaries * rows * Tl * C * 8,
                  err_msg=f"boundary bytes at step {s}")
        for op in ("send", "recv"):  # the ledger saw the same, and each send has its receive
            bad.check(np.testing.assert_equal, ledger.get(f"{op}@pp", 0),
                      sum(x[2] for x in sends), err_msg=f"{op}@pp at step {s}")
        for op, b in zero.items():
            bad.check(np.testing.assert_equal, ledger.get(f"{op}@{axis}", 0), b,
                      err_msg=f"{op}@{axis} at step {s} (ZeRO {cfg.zero})")
    assert len(watch.ledgers) == cfg.steps - 1
    bad.assert_none()


@pytest.mark.parallel(nprocs=[2, 4])
@settings(max_examples=3, phases=[Phase.explicit, Phase.generate])  # no shrinking: fail fast
@given(schedule=st.sampled_from(["naive", "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v",
                                 "dualpipev"]),
       layout=st.sampled_from(["pp", "pp2 x dp", "pp2 x cp"]), k=st.integers(1, 2),
       rows=st.integers(1, 2), extra_layers=st.integers(0, 1), explicit=st.booleans(),
       zero=st.integers(0, 3), V=st.integers(3, 11), T=st.integers(2, 5),
       clip=st.sampled_from([0.0, 0.05, 10.0]), seed=st.integers(0, 1000))
# always: every schedule, at the largest pp, at pp 2 x dp 2 and pp 2 x cp 2 (on 4 ranks; pp 2
# on 2), and pp = 1
@example(schedule="interleaved", layout="pp", k=1, rows=1, extra_layers=1, explicit=True,
         zero=0, V=5, T=3, clip=0.05, seed=7)
@example(schedule="zb-h1", layout="pp2 x dp", k=2, rows=1, extra_layers=1, explicit=False,
         zero=3, V=5, T=3, clip=0.05, seed=8)
@example(schedule="1f1b", layout="pp2 x dp", k=2, rows=2, extra_layers=0, explicit=False,
         zero=1, V=7, T=4, clip=10.0, seed=9)
@example(schedule="gpipe", layout="pp", k=1, rows=2, extra_layers=1, explicit=False,
         zero=2, V=4, T=2, clip=0.0, seed=10)
@example(schedule="naive", layout="pp2 x dp", k=1, rows=1, extra_layers=0, explicit=True,
         zero=0, V=6, T=3, clip=0.05, seed=11)
@example(schedule="interleaved", layout="pp2 x cp", k=1, rows=1, extra_layers=0,
         explicit=False, zero=3, V=6, T=4, clip=0.05, seed=13)
@example(schedule="zb-h1", layout="pp1", k=2, rows=1, extra_layers=0, explicit=False,
         zero=2, V=6, T=3, clip=0.05, seed=12)
@example(schedule="zb-v", layout="pp", k=2, rows=1, extra_layers=1, explicit=True,
         zero=1, V=5, T=3, clip=0.05, seed=14)
@example(schedule="dualpipev", layout="pp2 x dp", k=2, rows=1, extra_layers=0, explicit=False,
         zero=3, V=6, T=3, clip=0.05, seed=15)
@collective
def test_pipeline_training_equals_serial(schedule, layout, k, rows, extra_layers, explicit,
                                         zero, V, T, clip, seed):
    size = MPI.COMM_WORLD.size
    pp = {"pp": size, "pp1": 1}.get(layout, 2)
    cp = size // 2 if layout == "pp2 x cp" else 1
    T = 4 * cp if cp > 1 else T  # zig-zag: 2 cp chunks per rank
    v = 2 if schedule == "interleaved" and pp > 1 else 1
    schedule = schedule if v == 2 or schedule != "interleaved" else "1f1b"
    M = k * pp if schedule == "interleaved" else k + (pp > 1)  # 1 to 3 micro-batches
    chunks = pp * CATALOG[schedule].chunks_per_rank(v)  # the V schedules: 2 per rank
    n_layer = chunks + extra_layers
    split = [1] * chunks
    split[seed % chunks] += extra_layers
    cfg = TrainConfig(n_layer=n_layer, n_head=2, n_embd=4, block_size=T,
                      batch_size=(size // pp // cp) * M * rows, steps=3, lr=0.01, warmup_steps=1,
                      grad_clip=clip, dtype="float64", seed=seed, pp=pp, cp=cp, zero=zero,
                      microbatches=M, schedule=schedule, virtual_stages=v,
                      stage_layers=",".join(map(str, split)) if explicit else None,
                      progress=False)
    rng = np.random.default_rng(seed)
    check_pipeline_run(cfg, Dataset(rng.integers(0, V, 300), V, "random"))


@pytest.mark.parallel(nprocs=4)
@collective
def test_pp2_x_dp2_addition_task_equals_serial():
    """pp 2 x dp 2 on the built-in task, 1F1B, ZeRO-1, AdamW with clipping that bites."""
    from refmp.training.datasets import AdditionTask

    cfg = TrainConfig(n_layer=2, n_head=2, n_embd=8, batch_size=8, steps=3, grad_clip=0.5,
                      dtype="float64", pp=2, microbatches=2, zero=1, progress=False)
    ds = AdditionTask(3, seed=0, n_train=200, n_test=10).dataset()
    check_pipeline_run(TrainConfig(**{**cfg.__dict__, "block_size": ds.task.line_len}), ds)


BAD_PIPELINES = [
    (["--pp", "2", "--n-layer", "1"], "only 1 layers"),
    (["--pp", "2", "--n-layer", "4", "--microbatches", "3", "--batch-size", "6",
      "--schedule", "interleaved", "--virtual-stages", "2"], "multiple of --pp"),
    (["--pp", "2", "--n-layer", "2", "--microbatches", "3"], "every micro-batch has the same"),
    (["--pp", "2", "--n-layer", "2", "--stage-layers", "2,1"], "adds up to 3"),
]


@pytest.fixture(scope="module")
def bad_pipelines_runs():
    """BAD_PIPELINES's command lines, each refused on 2 ranks, all in one launch
    (mpi_helpers.refused)."""
    train = ["train", "--steps", "1", "--n-embd", "8", "--batch-size", "4"]
    return refused_each(2, train, BAD_PIPELINES)


@pytest.mark.parametrize("args, msg", BAD_PIPELINES)
def test_bad_pipeline_input_through_the_cli(bad_pipelines_runs, args, msg):
    out = bad_pipelines_runs[str(args)]
    assert out.returncode == 2, out.stderr
    assert msg in out.stderr
    assert out.stderr.count("error:") == 1  # one message, from rank 0


def test_train_trace_and_bench_report_the_bubble(tmp_path):
    import json

    trace = tmp_path / "trace.json"
    out = refmp(2, ["train", "--pp", "2", "--microbatches", "4", "--schedule", "zb-h1",
                    "--n-layer", "2", "--n-embd", "8", "--batch-size", "8", "--steps", "2",
                    "--no-progress", "--trace", str(trace)], timeout=60)
    assert out.returncode == 0, out.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    kinds = {e.get("cat") for e in events}
    assert {"F", "B", "W", "send", "recv"} <= kinds
    assert sum(e.get("cat") == "W" for e in events) == 2 * 4  # every rank, every micro-batch
    out = refmp(2, ["bench", "--preset", "tiny", "--pp", "2", "--microbatches", "4",
                    "--schedule", "1f1b", "--steps", "2", "--warmup", "1"], timeout=60)
    assert out.returncode == 0, out.stderr
    assert "bubble" in out.stdout and "theory 0.2000" in out.stdout
    assert "with the messages' costs" in out.stdout and "a message's cost (us): rank 0 send" \
        in out.stdout


def test_tutorial_runs_and_checks_itself():
    out = mpiexec(2, ["python", "tutorials/07_pipeline.py"], timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "matches the serial run" in out.stdout
    assert "1. by hand: pp = 2" in out.stdout



class ScalarChunks:
    """A Stage of S chunks, each out = tanh(inp * w_c) elementwise (w_c of shape (C,)), for
    running the executor alone at thousands of micro-batches in little time. Chunk 0 makes
    its input from the ids, inp = ids[..., None] * EMBED; the last chunk's output is the loss
    share sum(out * y[..., None]) / denom. Its weights' gradients are summed into ``grads``
    in the order the backwards (or their W passes) run."""

    EMBED = np.array([0.3, -0.2, 0.1])

    def __init__(self, w: np.ndarray, chunks: list[int]):
        self.w = w  # (S, C), every chunk's weights (this rank uses its own)
        self.n_chunks = len(w)
        self.chunks = chunks
        self.grads = np.zeros_like(w)

    def act_shape(self, b: int, T: int) -> tuple[int, int, int]:
        return (b, T, self.w.shape[1])

    def forward(self, c: int, inp, targets, denom):
        x = inp[..., None] * self.EMBED if c == 0 else inp  # (b, T, C)
        out = np.tanh(x * self.w[c])  # (b, T, C)
        if c == self.n_chunks - 1:
            return float((out * targets[..., None]).sum() / denom), (x, out, targets / denom)
        return out, (x, out, None)

    def backward(self, c: int, dout, cache, split: bool, final: bool):
        x, out, dloss = cache
        dout = dloss[..., None] * np.ones_like(out) if dout is None else dout  # (b, T, C)
        dh = dout * (1 - out * out)  # forward was: out = tanh(h), h = x * w_c
        todo = (c, dh, x)
        if not split:
            self.weight(todo, final)
        return (dh * self.w[c] if c > 0 else None), todo

    def weight(self, todo, final: bool) -> None:
        c, dh, x = todo
        self.grads[c] += (dh * x).sum(axis=(0, 1))


@pytest.mark.parallel(nprocs=2)
@collective
def test_the_executor_runs_thousands_of_micro_batches():
    """4,096 micro-batches through the synchronous executor on 2 ranks, interleaved and ZB-V
    with 4 chunks (a tag per micro-batch and chunk would pass MPI's guaranteed 32,767 here),
    on ScalarChunks: the loss and every chunk's weight gradient equal the serial run's
    exactly (each chunk adds its micro-batches in order). Every schedule's message order:
    test_pipeline_schedules.py."""
    from refmp.distributed.comm import Comm
    from refmp.parallel.pipeline.catalog import CATALOG
    from refmp.parallel.pipeline.executor import Executor

    M, S, T = 4096, 4, 2
    rng = np.random.default_rng(0)
    w = rng.normal(size=(S, 3))
    xs = [rng.integers(0, 5, (1 + i % 2, T)) for i in range(M)]  # two row counts: two sizes
    ys = [rng.normal(size=x.shape) for x in xs]
    denom = sum(x.size for x in xs)
    serial = ScalarChunks(w, list(range(S)))
    want = 0.0
    for i in range(M):  # each micro-batch forward through every chunk, then back
        h, caches = xs[i], []
        for c in range(S):
            h, cache = serial.forward(c, h, ys[i], denom)
            caches.append(cache)
        want += h
        d = None
        for c in reversed(range(S)):
            d, _ = serial.backward(c, d, caches[c], False, True)
    comm = Comm(MPI.COMM_WORLD, "pp")
    for name in ("interleaved", "zb-v"):
        sched = CATALOG[name]
        placed = sched.chunk_placement(2, 2)
        stage = ScalarChunks(w, placed.chunks(comm.rank))
        run = Executor(stage, comm, np.float64, placed=placed)
        loss = run.step(sched.actions(2, M, comm.rank, 2), xs, ys, denom, M)
        loss = comm.mpi.allreduce(loss)
        grads = comm.mpi.allreduce(stage.grads)  # each rank's chunks' rows, zeros elsewhere
        assert loss == want, (name, loss, want)
        np.testing.assert_array_equal(grads, serial.grads, err_msg=name)
