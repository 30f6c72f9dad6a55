"""Pipeline-parallel training equals the serial run, under real MPI (float64), every schedule.

Every rank trains the serial model itself (COMM_SELF, whole batch, one micro-batch) and its
stage of the pipeline (COMM_WORLD, pp x dp), step by step, and compares the loss, the norm,
the gradients of the parameters it holds (after the tied-wte exchange, the dp all-reduce and
clipping) and the updated weights. Then it checks the ledger against the analytic bytes and
the executor's peak activations against the simulator's.
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_helpers import Mismatches, collective, mpiexec, refmp

from refmp.data import Dataset
from refmp.grid import ProcessGrid
from refmp.parallel.pipeline.simulate import simulate_schedule
from refmp.train import TrainConfig, Trainer

pytestmark = pytest.mark.mpi

TOL = dict(rtol=1e-9, atol=1e-12)


def assert_same_run(cfg: TrainConfig, ds: Dataset) -> None:
    serial_cfg = dataclasses.replace(cfg, pp=1, dp=None, microbatches=1, schedule="1f1b",
                                     virtual_stages=1, stage_layers=None)
    serial = Trainer(serial_cfg, grid=ProcessGrid(MPI.COMM_SELF), dataset=ds)
    pipe = Trainer(cfg, grid=ProcessGrid(MPI.COMM_WORLD, pp=cfg.pp), dataset=ds)
    try:
        check_same_run(cfg, serial, pipe)
    finally:  # MPI has a few thousand communicators: free each example's
        for grid in (serial.grid, pipe.grid):
            for comm in grid.comm.values():
                comm.mpi.Free()


def check_same_run(cfg: TrainConfig, serial: Trainer, pipe: Trainer) -> None:
    run, close, bad = pipe.runner, np.testing.assert_allclose, Mismatches()
    for s in range(cfg.steps):
        a, b = serial.step(), pipe.step()
        bad.check(close, b["loss"], a["loss"], **TOL, err_msg=f"loss at step {s}")
        bad.check(close, b["grad_norm"], a["grad_norm"], **TOL, err_msg=f"norm at step {s}")
        for k in run.params:
            bad.check(close, run.grads[k], serial.model.grads[k], **TOL,
                      err_msg=f"gradient {k} at step {s} on rank {pipe.grid.rank}")
            bad.check(close, run.params[k], serial.model.params[k], **TOL,
                      err_msg=f"weight {k} after step {s} on rank {pipe.grid.rank}")
    sent, reduced = pipe.grid.ledger.bytes("send", "pp"), pipe.grid.ledger.bytes("allreduce", "dp")
    full = run.full_params()  # collective over pp
    prompt = serial.ds.tokens[: 2 * pipe.T].reshape(2, pipe.T)[:, : max(1, pipe.T - 2)]
    decoded = run.generate(prompt, 2)  # collective over pp
    bad.check(np.testing.assert_array_equal, decoded, serial.model.generate(prompt, 2),
              err_msg="greedy decoding through the pipeline")
    bad.assert_none()
    # every parameter is held somewhere, and the gathered model is the serial one
    if pipe.grid.rank == 0:
        assert list(full) == list(serial.model.params)
        for k, v in full.items():
            close(v, serial.model.params[k], **TOL, err_msg=f"full_params {k}")
    # the executor held exactly what the simulator says this schedule holds
    sim = simulate_schedule(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual_stages)
    assert run.exe.peak_held == sim.peak_held[run.pp.rank]
    # ledger: activations and gradients cross each chunk boundary once per row, plus the tied
    # wte gradient swapped between the two ends; one dp all-reduce of this rank's gradients
    m, S, r = pipe.model.cfg, run.S, run.pp.rank
    rows = cfg.batch_size // pipe.grid.dp
    boundaries = sum((c < S - 1) + (c > 0) for c in run.stage.chunks)
    tied = m.vocab_size * m.n_embd * 8 if r in (0, cfg.pp - 1) else 0
    want = cfg.steps * (boundaries * rows * pipe.T * m.n_embd * 8 + tied)
    assert sent == want
    n_own = sum(p.size for p in run.params.values())
    assert reduced == (cfg.steps * 8 * n_own if pipe.grid.dp > 1 else 0)


@pytest.mark.parallel(nprocs=[2, 4])
@settings(max_examples=8, phases=[Phase.explicit, Phase.generate])  # no shrinking: fail fast
@given(schedule=st.sampled_from(["naive", "gpipe", "1f1b", "interleaved", "zb-h1"]),
       big_pp=st.booleans(), k=st.integers(1, 2), extra_rows=st.integers(0, 1),
       v=st.integers(1, 2), extra_layers=st.integers(0, 1), explicit=st.booleans(),
       V=st.integers(3, 11), T=st.integers(2, 5), clip=st.sampled_from([0.0, 0.05, 10.0]),
       seed=st.integers(0, 1000))
@example(schedule="interleaved", big_pp=True, k=1, extra_rows=1, v=2, extra_layers=1,
         explicit=True, V=5, T=3, clip=0.05, seed=7)  # always: interleaved at the largest pp
@example(schedule="zb-h1", big_pp=True, k=2, extra_rows=1, v=1, extra_layers=1,
         explicit=False, V=5, T=3, clip=0.05, seed=8)  # always: zb-h1, uneven micro-batches
@collective
def test_pipeline_training_equals_serial(schedule, big_pp, k, extra_rows, v, extra_layers,
                                         explicit, V, T, clip, seed):
    size = MPI.COMM_WORLD.size
    pp = size if big_pp else 2
    v = v if schedule == "interleaved" else 1
    M = k * pp if schedule == "interleaved" else k + (pp - 1) * extra_rows
    n_layer = pp * v + extra_layers
    split = [1] * (pp * v)
    split[seed % (pp * v)] += extra_layers
    cfg = TrainConfig(n_layer=n_layer, n_head=2, n_embd=4, block_size=T,
                      batch_size=(size // pp) * (M + extra_rows), steps=3, lr=0.01,
                      warmup_steps=1, grad_clip=clip, dtype="float64", seed=seed, pp=pp,
                      microbatches=M, schedule=schedule, virtual_stages=v,
                      stage_layers=",".join(map(str, split)) if explicit else None,
                      progress=False)
    rng = np.random.default_rng(seed)
    assert_same_run(cfg, Dataset(rng.integers(0, V, 300), V, "random"))


@pytest.mark.parallel(nprocs=4)
@collective
def test_pp2_x_dp2_addition_task_equals_serial():
    """pp 2 x dp 2 on the built-in task, 1F1B, AdamW with clipping that bites."""
    from refmp.data import AdditionTask

    cfg = TrainConfig(n_layer=2, n_head=2, n_embd=8, batch_size=8, steps=3, grad_clip=0.5,
                      dtype="float64", pp=2, microbatches=2, progress=False)
    assert_same_run(cfg, AdditionTask(3, seed=0, n_train=200, n_test=10).dataset())


@pytest.mark.parametrize("args, msg", [
    (["--pp", "2", "--n-layer", "1"], "only 1 layers"),
    (["--pp", "2", "--n-layer", "4", "--microbatches", "3", "--schedule", "interleaved",
      "--virtual-stages", "2"], "multiple of --pp"),
    (["--pp", "2", "--n-layer", "2", "--stage-layers", "2,1"], "adds up to 3"),
])
def test_bad_pipeline_input_through_the_cli(args, msg):
    out = refmp(2, ["train", "--steps", "1", "--n-embd", "8", "--batch-size", "4", *args],
                timeout=60)
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


def test_tutorial_runs_and_checks_itself():
    out = mpiexec(2, ["python", "tutorials/03_pipeline.py"], timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "matches the serial run" in out.stdout
