"""Tensor parallelism inside pipeline stages (tp x pp) equals the serial run (float64, MPI).

tp 2 x pp 2 on 4 ranks, every schedule (zero bubble and interleaved included), SP on and
off, through the engine: tests/parity.py trains the serial model on rank 0 next to the
layout and compares the loss, the norm, every gradient and every weight, gathered, after
each step (the tied wte summed between the two ends, SP's sum of the replicated gradients,
clipping). After the last step, one more with the ledger reset: its bytes and calls on tp
per stage against the analytic formula and its bytes on pp; the gathered model in GPT-2
order; greedy decoding through the stages and the vocabulary shards against the serial
model's, on the shards training holds (no whole model gathered, nothing broadcast). --save's
stream (Engine.param_gatherer, one whole tensor onto rank 0 at a time) writes the gathered
model, bitwise, with a traced peak on the writing rank of a few tensors, not the model.
"""

import os
import tempfile
from unittest import mock

import numpy as np
import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_helpers import Mismatches, collective, refmp, refused_each
from parity import assert_same_run
from safetensors.numpy import load_file
from test_init_slices import traced_peak

from refmp.checkpoint.weights import save_streamed
from refmp.distributed.grid import ProcessGrid
from refmp.nn import gpt
from refmp.parallel.placement import padded_vocab, place
from refmp.training.datasets import Dataset
from refmp.training.evaluate import decoder
from refmp.training.trainer import TrainConfig, Trainer

pytestmark = pytest.mark.mpi

TOL = dict(rtol=1e-9, atol=1e-12)
close = np.testing.assert_allclose


def free(*trainers):
    """Give a trainer's communicators back to MPI (each example makes a grid)."""
    for tr in trainers:
        g = tr.grid
        for c in {id(c): c for c in (*g.comm.values(), g.group("dp", "cp"))}.values():
            c.mpi.Free()


def expected_ledger(cfg, run, b, T, C) -> dict:
    """(bytes, calls) per step on tp for this stage, and the bytes it sends on pp.

    Per micro-batch, refmp.cost.tensor.comm_bytes_per_step restricted to what this stage
    holds: L_r blocks, the embedding if first (its g), the head and loss if last (its f and
    the cross-entropy's three (b, s) sums). With SP the all-reduces become reduce-scatters and
    all-gathers (6 per block: 2 gathers, 2 re-gathers, 2 of g's backward; the embedding's
    backward 1; the head's gather and re-gather 2), plus one all-reduce of the replicated
    gradients per step.
    """
    L_r = sum(len(run.stage.chunks[c]) for c in run.stage.chunks)
    first, last, M, w = int(run.first), int(run.last), cfg.microbatches, 8
    act, loss = b * T * C * w, 3 * b * T * w
    n = run.tp.size
    if cfg.sequence_parallel:  # the replicated parameters this stage holds
        n_repl = sum(int(v.size) for k, v in run.params.items() if place(k, True).tp_split is None)
        k_rs, k_ag = 4 * L_r + first + last, 6 * L_r + first + 2 * last
        tp = {"reduce_scatter": (k_rs * act, k_rs * M), "allgather": (k_ag * act, k_ag * M),
              "allreduce": (last * loss + n_repl * w, 3 * M * last + 1)}
    else:
        k = 4 * L_r + first + last
        tp = {"reduce_scatter": (0, 0), "allgather": (0, 0),
              "allreduce": (k * act + last * loss, (k + 3 * last) * M)}
    boundaries = sum((c < run.n_chunks - 1) + (c > 0) for c in run.stage.chunks)
    Vp = padded_vocab(run.mcfg.vocab_size, n)
    tied = (Vp // n) * C * w if (first or last) else 0  # my wte shard, to my tp peer's stage
    sent = boundaries * act // (n if cfg.sequence_parallel else 1) + tied
    return {"tp": tp, "sent": sent}


def check_ledger_model_and_decoding(par, bad: Mismatches) -> None:
    """One more step, ledger reset: tp and pp traffic per stage against expected_ledger; the
    gathered model (rank 0, GPT-2 names and order, None elsewhere); greedy decoding through
    the pipeline against the serial model on the same weights (collectives on every rank;
    mismatches go to ``bad``)."""
    cfg, run, grid = par.cfg, par.runner, par.grid
    grid.ledger.reset()
    par.step()
    led, m = grid.ledger, run.mcfg
    got = {op: (led.bytes(op, "tp"), led.count(op, "tp"))
           for op in ("reduce_scatter", "allgather", "allreduce")}
    sent = led.bytes("send", "pp")
    want = expected_ledger(cfg, run, cfg.batch_size // grid.sizes["dp"], par.T, m.n_embd)
    full = run.full_params()  # collective over tp and pp
    prompt = par.ds.tokens[: 2 * par.T].reshape(2, par.T)[:, : max(1, par.T - 2)]
    bcasts = led.count("bcast", "world")
    whole = AssertionError("evaluation gathered the whole model")
    with mock.patch.object(type(run), "full_params", side_effect=whole):
        greedy = decoder(run, grid, m, par.T)  # collective: the Decoder over tp and pp
    bad.check(np.testing.assert_equal, led.count("bcast", "world"), bcasts,
              err_msg="evaluation broadcast the model")
    decoded = greedy.generate(prompt, 2)  # collective
    if run.v == 1:  # one chunk per rank: the decoder's stage holds the blocks it trains
        trained = [i for c in run.stage.chunks.values() for i in c]
        bad.check(np.testing.assert_equal, list(greedy.dec.blocks), trained,
                  err_msg=f"the decoder's blocks on rank {grid.rank}")
    bad.check(np.testing.assert_equal, got, want["tp"], err_msg=f"tp ledger rank {grid.rank}")
    bad.check(np.testing.assert_equal, sent, want["sent"], err_msg=f"pp bytes sent rank {grid.rank}")
    if grid.rank == 0:  # the whole model, unpadded, GPT-2 names and order
        bad.check(np.testing.assert_equal, list(full), list(gpt.param_shapes(m)))
        serial = gpt.GPT(m, full).generate(prompt, 2)
        bad.check(np.testing.assert_array_equal, decoded, serial,
                  err_msg="greedy decoding through the tp x pp pipeline")
    else:
        bad.check(np.testing.assert_equal, full, None)


@pytest.mark.parallel(nprocs=4)
@settings(max_examples=3, phases=[Phase.explicit, Phase.generate])  # no shrinking under MPI
@example(schedule="gpipe", sp=True, V=7, k=2, extra_layers=1,
         heads_per=1, clip=0.05, rows=1, seed=1)
@example(schedule="1f1b", sp=False, V=7, k=1, extra_layers=0,
         heads_per=2, clip=0.05, rows=2, seed=2)
@example(schedule="1f1b", sp=True, V=6, k=2, extra_layers=1,
         heads_per=1, clip=10.0, rows=1, seed=3)
@example(schedule="interleaved", sp=True, V=5, k=1, extra_layers=0,
         heads_per=1, clip=0.05, rows=2, seed=4)
@example(schedule="zb-h1", sp=True, V=7, k=2, extra_layers=1,
         heads_per=1, clip=0.05, rows=1, seed=5)
@example(schedule="zb-h1", sp=False, V=6, k=1, extra_layers=0,
         heads_per=2, clip=0.05, rows=2, seed=6)
@given(schedule=st.sampled_from(["naive", "gpipe", "1f1b", "interleaved", "zb-h1"]),
       sp=st.booleans(),
       V=st.integers(3, 11), k=st.integers(1, 2), extra_layers=st.integers(0, 1),
       heads_per=st.integers(1, 2), clip=st.sampled_from([0.05, 10.0]), rows=st.integers(1, 2),
       seed=st.integers(0, 999))
@collective
def test_tp2_x_pp2_training_equals_serial(schedule, sp, V, k, extra_layers, heads_per, clip,
                                          rows, seed):
    """tp 2 x pp 2, several AdamW steps with clipping; V odd pads the vocabulary shards;
    M micro-batches of ``rows`` rows."""
    tp, pp = 2, 2
    v = 2 if schedule == "interleaved" else 1
    M = k * pp if schedule == "interleaved" else k + 1
    cfg = TrainConfig(n_layer=pp * v + extra_layers, n_head=heads_per * tp, n_embd=4 * heads_per,
                      block_size=2 * tp, batch_size=M * rows, steps=3, lr=0.02, warmup_steps=1,
                      grad_clip=clip, dtype="float64", seed=seed, tp=tp, pp=pp,
                      sequence_parallel=sp, microbatches=M, schedule=schedule,
                      virtual_stages=v, progress=False)
    rng = np.random.default_rng(seed)
    bad = Mismatches()

    def after(par, step):  # on every rank, before parity asserts: no rank fails alone
        if step == cfg.steps - 1:
            check_ledger_model_and_decoding(par, bad)

    free(assert_same_run(cfg, Dataset(rng.integers(0, V, 200), V, "random"), check=after))
    bad.assert_none()


def saved_peak(tr, path: str):
    """--save's stream of ``tr``'s model to ``path`` (collective): the traced peak of what
    the writing rank (world rank 0) allocated meanwhile, None elsewhere."""
    rank0 = tr.grid.rank == 0
    out, peak = traced_peak(lambda: save_streamed(path, tr.runner.mcfg, tr.runner.weight_dtype,
                                                  tr.runner.param_gatherer(), write=rank0))
    return peak if rank0 else None


SAVES = [dict(tp=2, pp=2, microbatches=2), dict(dp=2, pp=2, zero=3, microbatches=2),
         dict(dp=4, zero=3, mixed_precision="bf16")]


@pytest.mark.parallel(nprocs=4)
@collective
def test_save_streams_each_tensor_through_rank_0_alone():
    """tp x pp, ZeRO-3 over pp, and ZeRO-3's bf16 masters: the streamed file is the gathered
    model, bitwise; the writing rank's traced peak is at most one ZeRO unit (a step gathers
    it too) and four copies of the largest tensor (tp's contiguous piece, its all-gather,
    the glued tensor, one more in flight), well under the model."""
    world = MPI.COMM_WORLD
    bad = Mismatches()
    folder = world.bcast(tempfile.mkdtemp(prefix="refmp-save-") if world.rank == 0 else None)
    for j, layout in enumerate(SAVES):
        cfg = TrainConfig(n_layer=8, n_head=4, n_embd=64, block_size=16, batch_size=4, steps=1,
                          dtype="float32" if "mixed_precision" in layout else "float64",
                          progress=False, **layout)
        tr = Trainer(cfg)
        tr.step()
        full = tr.runner.full_params()  # collective: the reference
        path = os.path.join(folder, f"{j}.safetensors")
        peak = saved_peak(tr, path)
        if world.rank == 0:
            saved = load_file(path)
            bad.check(np.testing.assert_equal, sorted(saved), sorted(full), err_msg=str(layout))
            for k, v in full.items():
                bad.check(np.testing.assert_array_equal, saved[k], v, err_msg=f"{layout} {k}")
            sizes = sorted(v.nbytes for v in full.values())
            unit = 12 * cfg.n_embd ** 2 * full["wte.weight"].itemsize if cfg.zero == 3 else 0
            bound = unit + 4 * sizes[-1] + 65536
            bad.check(np.testing.assert_array_less, peak, bound, err_msg=f"{layout}: peak")
            bad.check(np.testing.assert_array_less, bound, sum(sizes) / 2,
                      err_msg=f"{layout}: the bound says nothing")
        free(tr)
    world.barrier()
    if world.rank == 0:
        for f in os.listdir(folder):
            os.remove(os.path.join(folder, f))
        os.rmdir(folder)
    bad.assert_none(world)


@pytest.mark.cli
@pytest.mark.parametrize("layout", [["--schedule", "1f1b"],
                                    ["--schedule", "zb-h1", "--sequence-parallel"]])
def test_cli_tp2_x_pp2_trains_saves_and_evaluates(tmp_path, layout):
    out = tmp_path / "m.safetensors"
    shape = ["--n-layer", "2", "--n-head", "2", "--n-embd", "8", "--batch-size", "4",
             "--block-size", "12", "--steps", "3", "--dtype", "float64", "--grad-clip", "0.1"]
    r = refmp(4, ["train", "--tp", "2", "--pp", "2", "--microbatches", "2", *layout, *shape,
                  "--no-progress", "--save", str(out)], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "pp=2 x dp=1 x cp=1 x tp=2" in r.stdout
    assert "held-out exact match" in r.stdout  # decoding through stages and vocab shards
    assert ("reduce_scatter@tp" in r.stdout) == ("--sequence-parallel" in layout)
    cfg = TrainConfig(n_layer=2, n_head=2, n_embd=8, batch_size=4, block_size=12, steps=3,
                      dtype="float64", grad_clip=0.1, progress=False)
    tr = Trainer(cfg, grid=ProcessGrid(MPI.COMM_SELF))
    for _ in range(3):
        tr.step()
    saved, want = load_file(str(out)), tr.runner.full_params()
    assert set(saved) == set(want)
    for k, v in want.items():  # full (vocab 13, unpadded), GPT-2 names
        assert saved[k].shape == v.shape, k
        np.testing.assert_allclose(saved[k], v, rtol=1e-9, atol=1e-12, err_msg=k)


BAD_TP_PP = [
    (["--n-head", "3", "--n-embd", "12"], "--tp 2 must divide the number of heads"),
    (["--sequence-parallel", "--block-size", "5"], "must divide the tokens each rank holds"),
]


@pytest.fixture(scope="module")
def bad_tp_pp_runs():
    """BAD_TP_PP's command lines, each refused on 4 ranks, all in one launch
    (mpi_helpers.refused)."""
    train = ["train", "--tp", "2", "--pp", "2", "--n-layer", "2", "--n-embd", "8",
             "--batch-size", "4", "--steps", "1", "--no-progress"]
    return refused_each(4, train, BAD_TP_PP)


@pytest.mark.cli
@pytest.mark.parametrize("args,message", BAD_TP_PP)
def test_tp_x_pp_bad_input_fails_cleanly(bad_tp_pp_runs, args, message):
    r = bad_tp_pp_runs[str(args)]
    assert r.returncode == 2, r.stderr
    assert message in r.stderr, r.stderr
    assert r.stderr.count(message) == 1 and "Traceback" not in r.stderr
