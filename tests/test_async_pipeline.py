"""Asynchronous pipelines: PipeDream-2BW (--schedule 2bw) and PipeDream's weight stashing
(--schedule pipedream), float64.

The rule (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training", sec. 3.1):
update t applies batch t's gradient taken at W(t-1), W(-1) = W(0), the whole optimizer step
(clipping by the global norm, AdamW) working on that gradient and on W(t). With pp = 1 the
flag is the serial delayed-update reference; every layout equals it, and it is not the
synchronous run (staleness is real).

PipeDream's rule (Narayanan et al. 2019, sec. 3.3, one update per batch): stage s computes
batch t's forward and backward on W(max(t - (pp - 1 - s), 0)); update t applies the sum of
those gradients to W(t). async_reference.pipedream_reference states it serially, piece by
piece of the model (gpt2_gradient); the pipeline equals it.
"""

from dataclasses import replace

import numpy as np
import pytest
from async_reference import assert_same_delayed_run, gpt2_gradient, pipedream_reference, run_against
from mpi4py import MPI
from mpi_helpers import collective

from refmp.distributed.grid import ProcessGrid
from refmp.nn import gpt
from refmp.training.datasets import Dataset, get_batch
from refmp.training.trainer import TrainConfig, Trainer

pytestmark = pytest.mark.mpi
TIGHT = dict(rtol=1e-12, atol=1e-12)
SMALL = dict(n_layer=4, n_head=2, n_embd=4, block_size=3, batch_size=4, lr=0.05, warmup_steps=1,
             grad_clip=0.05, dtype="float64", seed=3, microbatches=2, progress=False)


def data(seed: int = 0) -> Dataset:
    return Dataset(np.random.default_rng(seed).integers(0, 7, 300), 7, "random")


def serial(cfg: TrainConfig) -> Trainer:
    return Trainer(cfg, grid=ProcessGrid(MPI.COMM_SELF), dataset=data())


class Open:
    """The check hook: after each step, what this rank's executor keeps open for the next
    (caches of the next batch's forwards, its stashed gradients, sends) and whether a
    forward of the next batch ran before the step's last backward (no flush)."""

    def __init__(self):
        self.steps = []

    def __call__(self, par, s: int) -> None:
        ex, m = par.runner.executor, par.cfg.microbatches
        kinds = [(e.kind, e.mb) for e in ex.events if e.kind in "FB"]
        last_b = max((j for j, (k, i) in enumerate(kinds) if k == "B" and i < m), default=-1)
        early = any(k == "F" and i >= m for k, i in kinds[:last_b])
        self.steps.append((len(ex.carry), ex.stash_bytes, len(ex.pending), bool(ex.stash.sums),
                           early))


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("layout", [dict(pp=4), dict(pp=4, microbatches=1),
                                    dict(pp=2, dp=2, zero=1, recompute="full"),
                                    dict(pp=2, tp=2), dict(pp=4, wrong=True), dict(pp=2, dp=2, zero=3)])
@collective
def test_pipedream_equals_its_serial_reference(layout, monkeypatch):
    """Loss, norm and weights after each of 6 AdamW steps with clipping, pp 4 (with one
    micro-batch: PipeDream's own case, every input a mini-batch), pp 2 x dp 2
    (ZeRO-1, full recomputation: the recomputed forward runs on the stashed version too),
    pp 2 x tp 2 and pp 2 x dp 2 with ZeRO-3 (a stashed version is the rank's shards, gathered
    again for the backward) against :func:`pipedream_reference`; stage s keeps pp - 1 - s stashed
    versions besides the current one (the memory report's ``versions``). ``wrong``: a
    backward attaches the current weights instead of its forward's version (no stashing),
    and the run differs."""
    check_pipedream(layout, monkeypatch)


@pytest.mark.parallel(nprocs=6)
@collective
def test_pipedream_at_pp_3_with_dp_and_zero_2(monkeypatch):
    """pp 3 x dp 2, ZeRO-2 (gradients reduce-scattered each micro-batch: all of batch t's
    backwards run in step t), one block per stage."""
    check_pipedream(dict(pp=3, dp=2, zero=2, n_layer=3), monkeypatch)


def check_pipedream(layout, monkeypatch):
    from refmp.parallel.pipeline.asynchronous import PipeDream

    layout = dict(layout)
    wrong = layout.pop("wrong", False)
    if wrong:
        monkeypatch.setattr(PipeDream, "stashed", lambda self, version: None)
    cfg = TrainConfig(**{**SMALL, **layout}, steps=6, schedule="pipedream")
    par, bad = run_against(cfg, data(), gpt2_gradient, TIGHT)
    if wrong:
        with pytest.raises(AssertionError, match="after"):
            bad.assert_none(MPI.COMM_WORLD)
        return
    bad.assert_none(MPI.COMM_WORLD)
    mem, lag = par.memory(), cfg.pp - 1 - par.runner.pp.rank
    assert mem["versions"] == lag * mem["params"] and mem["params"] > 0, mem


def test_pipedream_reference_at_pp_1_is_the_synchronous_run_and_at_pp_2_is_not():
    """The serial statement checked itself: with one stage every version is W(t), and it
    equals the Trainer's synchronous run; with two, stage 0 runs a step behind from step 1."""
    cfg = TrainConfig(**SMALL, steps=3)
    sync = serial(cfg)
    recs = [sync.step() for _ in range(3)]
    ref = pipedream_reference(replace(cfg, pp=1), data())
    for (loss, norm, _), rec in zip(ref, recs, strict=True):
        np.testing.assert_allclose([loss, norm], [rec["loss"], rec["grad_norm"]], **TIGHT)
    final = sync.runner.full_params()
    for k, v in ref[-1][2].items():
        np.testing.assert_allclose(v, final[k], **TIGHT, err_msg=k)
    stale = [loss for loss, _, _ in pipedream_reference(replace(cfg, pp=2), data())]
    np.testing.assert_allclose(stale[0], recs[0]["loss"], **TIGHT)  # W(0) everywhere
    assert abs(stale[1] - recs[1]["loss"]) > 1e-6


def test_pipedream_backward_asserts_its_forward_version(monkeypatch):
    """The executor checks each backward's version against the rule, stated apart from the
    forward's choice: a rule that disagrees (here at pp 1, where every batch runs on the
    current weights) stops the step."""
    from refmp.parallel.pipeline import asynchronous

    monkeypatch.setattr(asynchronous, "pipedream_version", lambda pp, rank, t: t + 1)
    cfg = TrainConfig(**SMALL, steps=1, schedule="pipedream")
    with pytest.raises(AssertionError, match=r"backward on W\(1\), its forward on W\(0\)"):
        serial(cfg).step()


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("layout", [dict(pp=4, microbatches=4), dict(pp=4), dict(pp=2, dp=2, zero=1),
                                    dict(pp=2, tp=2), dict(pp=1, dp=2, tp=2, zero=1)])
@collective
def test_2bw_equals_the_serial_delayed_update(layout):
    check_2bw(layout)


@pytest.mark.parallel(nprocs=6)
@collective
def test_2bw_with_a_whole_batch_run_ahead():
    """pp 3 x dp 2, ZeRO-0 with buckets, one micro-batch: the last stage runs all of the
    next batch's backwards before the update, so the stash completes its units (their
    bucketed all-reduces start from it, at the next step's start)."""
    check_2bw(dict(pp=3, dp=2, microbatches=1, n_layer=3, batch_size=2))


def check_2bw(layout):
    """pp 4 (4 micro-batches: later stages run the next batch's first backwards before the
    update; 2: the step boundaries capped), pp 2 x dp 2 with ZeRO-1, pp 2 x tp 2, dp 2 x
    tp 2: loss, norm, gradient and weights after each of 4 AdamW steps with clipping that
    bites, against 2bw at pp 1. No flush: stage 0 runs forwards of the next batch before the
    step's last backward and carries their caches over the boundary; the last step drains
    (nothing carried, stashed or sent after it)."""
    cfg, hook = TrainConfig(**{**SMALL, **layout}, steps=4, schedule="2bw"), Open()
    par = assert_same_delayed_run(cfg, data(), TIGHT, check=hook)
    # the memory report holds the second weight version: as many bytes as the parameters
    mem = par.memory()
    assert mem["versions"] == mem["params"] > 0
    *steady, last = hook.steps
    assert last == (0, last[1], 0, False, False), "the last step drains the pipeline"
    r, P = par.runner.pp.rank, cfg.pp
    if P > 1 and r == 0:
        assert all(carried > 0 and early for carried, _, _, _, early in steady), hook.steps
    if layout.get("microbatches") == 4 and r == P - 1:  # next-batch backwards: stashed
        assert all(stash > 0 and held for _, stash, _, held, _ in steady), hook.steps
        assert mem["grad_stash"] == max(stash for _, stash, _, _, _ in hook.steps)


def test_2bw_is_the_delayed_rule_and_not_the_synchronous_run():
    """SGD without clipping: W(t+1) = W(t) - lr g_t(W(t-1)), the gradient of batch t taken
    by the serial model at the weights of two steps back; 1F1B's run differs from step 1."""
    cfg = TrainConfig(**{**SMALL, "grad_clip": 0.0}, steps=3, optimizer="sgd", weight_decay=0.0,
                      lr_schedule="constant")
    delayed, sync = serial(replace(cfg, schedule="2bw")), serial(cfg)
    history = [delayed.runner.full_params()]  # W(0)
    for t in range(3):
        rec, rec_sync = delayed.step(), sync.step()
        x, y = get_batch(delayed.ds.tokens, t, cfg.batch_size, cfg.block_size, perm=delayed.perm)
        model = gpt.GPT(delayed.mcfg, {k: v.copy() for k, v in history[max(t - 1, 0)].items()})
        loss, cache = model.forward(x, y, denom=cfg.batch_size * cfg.block_size)
        model.backward(cache)  # g_t at W(t-1)
        np.testing.assert_allclose(rec["loss"], float(loss), **TIGHT)
        now = delayed.runner.full_params()
        for k, w in history[t].items():
            np.testing.assert_allclose(now[k], w - rec["lr"] * model.grads[k], **TIGHT, err_msg=k)
        history.append(now)
        key = "h.0.attn.c_attn.weight"
        same = np.array_equal(now[key], sync.runner.full_params()[key])
        assert same == (t == 0), f"step {t}: 2BW's and the synchronous weights"  # W(-1) = W(0)
        assert (rec["loss"] == rec_sync["loss"]) == (t == 0)  # batch 1: at W(0), not W(1)
