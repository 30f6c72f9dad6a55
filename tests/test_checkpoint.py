"""Sharded checkpoints (refmp.checkpoint): save on one layout, resume on any.

* On the same layout, a run stopped, saved and resumed is bitwise the uninterrupted run
  (float32 and float64; ZeRO stages, pipeline, experts, SGD momentum and AdamW, delayed FP8
  scaling's amax history).
* Into another layout (hypothesis draws pairs over 4 ranks, dense and MoE, ZeRO stages,
  AdamW and SGD): equal to the serial uninterrupted run to float64 rounding.
* The command: --checkpoint-dir, --save-every, --keep, --resume; refmp convert both ways and
  --info; bad checkpoints refused with one message naming the file, no traceback, no hang.
"""

import json
import os
import shutil
import tempfile
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_helpers import Mismatches, collective, mpiexec, refmp, refused
from parity import TOL, host, serial_config
from safetensors import safe_open
from safetensors.numpy import load_file

from refmp.checkpoint import format as ckpt_format
from refmp.checkpoint.weights import read_model
from refmp.cli.main import main
from refmp.distributed.grid import ProcessGrid
from refmp.errors import ConfigError
from refmp.training.datasets import Dataset
from refmp.training.trainer import TrainConfig, Trainer

pytestmark = pytest.mark.mpi


def config(**kw) -> TrainConfig:
    base = dict(n_layer=2, n_head=4, n_embd=16, block_size=8, batch_size=4, steps=4,
                lr=0.01, warmup_steps=1, grad_clip=0.05, dtype="float64", seed=3,
                progress=False, capacity_factor=1.0, top_k=2)
    return TrainConfig(**{**base, **kw})


def data(V: int = 17) -> Dataset:
    return Dataset(np.random.default_rng(0).integers(0, V, 400), V, "random")


def shared_dir() -> str:
    """A fresh directory, the same on every rank (made by rank 0)."""
    world = MPI.COMM_WORLD
    return world.bcast(tempfile.mkdtemp(prefix="refmp-ckpt-") if world.rank == 0 else None)


def train(cfg: TrainConfig, steps: int, ds: Dataset, grid=None) -> tuple[Trainer, list]:
    tr = Trainer(cfg, grid=grid, dataset=ds)
    return tr, [tr.step()["loss"] for _ in range(steps)]


def optimizer_state(tr: Trainer) -> tuple[dict, dict]:
    """({kind, t[, loss_scale]}, {moment: {piece: array}}): what the optimizer and fp16's
    loss scaler carry from step to step, as the manifest's "optimizer" entry says it."""
    state = tr.opt.state()
    scale = {"loss_scale": tr.scaler.state()} if tr.scaler is not None else {}
    return {"kind": state["kind"], "t": state["t"], **scale}, state["moments"]


# --- the same layout: bitwise -------------------------------------------------------------------

SAME_LAYOUT = [
    ("float32", dict(tp=2, pp=2, zero=1, microbatches=2)),
    ("float64", dict(dp=2, pp=2, zero=3, microbatches=2, optimizer="sgd", momentum=0.9)),
    ("float32", dict(n_expert=4, dp=2, cp=2, ep=2, zero=2)),
    ("float64", dict(dp=4, zero=0)),
    # fp16: the fp32 masters and the loss scale (2^40 overflows, halving, in the first steps)
    ("float32", dict(tp=2, dp=2, zero=1, mixed_precision="fp16", loss_scale_init=2.0**40)),
    # delayed FP8 scaling: the amax history of the last steps scales the next ones
    ("float64", dict(fp8="delayed", tp=2, pp=2, microbatches=2)),
]


@pytest.mark.parallel(nprocs=4)
@collective
def test_resume_on_the_same_layout_is_bitwise_the_uninterrupted_run():
    bad, ds = Mismatches(), data()
    for dtype, kw in SAME_LAYOUT:
        cfg, where = config(dtype=dtype, **kw), f"{dtype} {kw}"
        whole, losses = train(cfg, 4, ds)
        first, before = train(cfg, 2, ds)
        d = shared_dir()
        first.save_checkpoint(d)
        second, after = train(replace(cfg, resume=d), 2, ds)
        bad.check(np.testing.assert_equal, before + after, losses, err_msg=f"losses, {where}")
        bad.check(np.testing.assert_equal, second.step_num, 4)
        # this rank's optimizer state, piece by piece (the same layout: the same pieces)
        (k1, m1), (k2, m2) = optimizer_state(whole), optimizer_state(second)
        bad.check(np.testing.assert_equal, k2, k1, err_msg=where)
        for m in m1:
            for k in m1[m]:
                bad.check(np.testing.assert_array_equal, m2[m][k], m1[m][k],
                          err_msg=f"{m} of {k}, {where}")
        if kw.get("fp8") == "delayed":  # this rank's blocks' amax history, bitwise
            h1, h2 = whole.runner.fp8.state(), second.runner.fp8.state()
            bad.check(np.testing.assert_equal, h2["steps"], h1["steps"], err_msg=where)
            for k in h1["amax"]:
                bad.check(np.testing.assert_array_equal, h2["amax"][k], h1["amax"][k],
                          err_msg=f"amax history of {k}, {where}")
        want, got = whole.runner.full_params(), second.runner.full_params()
        if want is not None:
            for k in want:
                bad.check(np.testing.assert_array_equal, got[k], want[k],
                          err_msg=f"{k}, {where}")
        if MPI.COMM_WORLD.rank == 0:
            shutil.rmtree(d)
    bad.assert_none()


def test_save_and_resume_hold_one_piece_at_a_time_measured(tmp_path):
    """tracemalloc's peaks while a run saves a checkpoint and loads it: its state is already
    allocated, and each adds a piece or two at a time (written as it is cut out, read
    straight into the array it sets, the elements' global indices computed a unit at a
    time), not the state again (copying every piece first, with every piece's int64
    indices, held more than the whole state again). One rank, the pytest process."""
    import tracemalloc

    from refmp.nn.slices import BLOCK_BYTES

    cfg = config(n_layer=8, n_embd=64, steps=2)
    tr, _ = train(cfg, 2, data(), grid=ProcessGrid(MPI.COMM_SELF))
    largest = max(int(p.nbytes) for p in tr.runner.params.values())
    state = sum(int(p.nbytes) for p in tr.runner.params.values()) + tr.opt.state_bytes()
    bound = 4 * largest + 2 * BLOCK_BYTES + 2**18  # verify's sha256 reads a block at a time
    assert bound < 0.5 * state, (bound, state)  # the bound says something
    for what, call in (("save", tr.save_checkpoint), ("resume", tr.resume)):
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            call(str(tmp_path))
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        assert peak < bound, (what, peak, bound, state)


# --- another layout: float64 rounding ------------------------------------------------------------


@st.composite
def layout(draw, moe: bool, world: int = 4) -> dict:
    """A layout of ``world`` ranks for config(batch_size=4) and the options that fit it."""
    pp = draw(st.sampled_from([1, 2]))
    tp = draw(st.sampled_from([t for t in (1, 2, 4) if pp * t <= world]))
    cp = draw(st.sampled_from([c for c in (1, 2, 4) if world % (pp * tp * c) == 0]))
    dp = world // (pp * tp * cp)
    ep = draw(st.sampled_from([e for e in (1, 2, 4) if (dp * cp) % e == 0])) if moe else 1
    mb = draw(st.sampled_from([m for m in (1, 2) if 4 % (dp * m) == 0]))
    return dict(pp=pp, tp=tp, cp=cp, dp=dp, ep=ep, zero=draw(st.integers(0, 3)), microbatches=mb,
                sequence_parallel=tp > 1 and draw(st.booleans()))


@st.composite
def two_layouts(draw):
    moe = draw(st.booleans())
    opt = draw(st.sampled_from([dict(optimizer="adamw"), dict(optimizer="sgd", momentum=0.9)]))
    return dict(n_expert=4 if moe else 0, **opt), draw(layout(moe)), draw(layout(moe))


LAYOUT = dict(pp=1, tp=1, cp=1, dp=1, ep=1, zero=0, microbatches=1, sequence_parallel=False)


@pytest.mark.parallel(nprocs=4)
@settings(max_examples=4, phases=[Phase.explicit, Phase.generate])  # no shrinking under MPI
@given(case=two_layouts())
@example(case=({"n_expert": 0, "optimizer": "adamw"}, {**LAYOUT, "tp": 2, "pp": 2, "zero": 1},
               {**LAYOUT, "dp": 2, "cp": 2, "zero": 2}))
@example(case=({"n_expert": 4, "optimizer": "sgd", "momentum": 0.9},
               {**LAYOUT, "dp": 4, "ep": 4, "zero": 3},
               {**LAYOUT, "ep": 2, "pp": 2, "dp": 2, "microbatches": 2}))
@collective
def test_resume_into_another_layout_equals_the_uninterrupted_run(case):
    """Save after 2 of 4 steps on layout a, resume on layout b, and on one rank alone: every
    loss and the final weights equal the serial run's (which no checkpoint interrupted) to
    float64 rounding."""
    model, a, b = case
    world, ds, bad = MPI.COMM_WORLD, data(), Mismatches()
    cfg = config(**model)
    serial = None
    if world.rank == 0:
        serial, losses = train(serial_config(cfg), 4, ds, grid=ProcessGrid(MPI.COMM_SELF))
    first, before = train(replace(cfg, **a), 2, ds)
    d = shared_dir()
    first.save_checkpoint(d)
    second, after = train(replace(cfg, **b, resume=d), 2, ds)
    got = second.runner.full_params()
    if serial is not None:
        alone, after_alone = train(replace(serial_config(cfg), resume=d), 2, ds,
                                   grid=ProcessGrid(MPI.COMM_SELF))
        bad.check(np.testing.assert_allclose, before + after, losses, **TOL, err_msg="losses")
        bad.check(np.testing.assert_allclose, after_alone, losses[2:], **TOL, err_msg="alone")
        want = host(serial.runner.full_params())
        for k, v in host(got).items():
            bad.check(np.testing.assert_allclose, v, want[k], **TOL, err_msg=k)
        for k, v in host(alone.runner.full_params()).items():
            bad.check(np.testing.assert_allclose, v, want[k], **TOL, err_msg=f"{k}, alone")
        shutil.rmtree(d)
    bad.assert_none()


# Layouts whose shards do not line up with the saved ones. n_embd 9 (odd) makes ZeRO's padded
# partitions over 3 and 4 ranks meet one element apart: a saved piece starts on the last
# element of a wanted slice, or ends on its first. tp 4 and 3 pad the vocabulary (17) to 20 and
# 18 rows; the pipelines cut 3 layers 1 + 2 and 2 + 1.
ODD = dict(n_layer=2, n_head=3, n_embd=9, batch_size=12)
WIDE = dict(n_layer=2, n_head=12, n_embd=24, batch_size=12)
DEEP = dict(n_layer=3, n_head=2, n_embd=8, batch_size=12, microbatches=2)
UNALIGNED = [  # (model and optimizer, (ranks, layout saved), (ranks, layout resumed))
    (ODD, (3, dict(dp=3, zero=1)), (4, dict(dp=4, zero=2))),
    ({**ODD, "optimizer": "sgd", "momentum": 0.9}, (4, dict(dp=4, zero=3)), (3, dict(dp=3, zero=1))),
    (WIDE, (4, dict(tp=4)), (3, dict(tp=3))),
    (WIDE, (4, dict(tp=2, dp=2, zero=1)), (3, dict(tp=3, zero=0))),
    (DEEP, (4, dict(pp=2, dp=2, stage_layers="1,2")), (4, dict(pp=2, tp=2, stage_layers="2,1"))),
]


def pieces(ckpt: str) -> list[dict]:
    """Per rank file of the checkpoint in ``ckpt``: {name: (first, last)} global flat index."""
    man = ckpt_format.read_manifest(ckpt_format.find(ckpt))
    return [{k: (p["first"], p["last"]) for k, p in f["pieces"].items()}
            for f in man["files"].values()]


def touching(saved: list[dict], wanted: list[dict]) -> set[str]:
    """How saved pieces meet wanted ones at a single element: "starts on the last" (a saved
    piece's first element is a wanted slice's last), "ends on the first"."""
    out = set()
    for s, w in ((s, w) for s in saved for w in wanted):
        for k in s.keys() & w.keys():
            (first, last), (lo, hi) = s[k], w[k]
            if first == hi != lo:
                out.add("starts on the last")
            if last == lo != hi:
                out.add("ends on the first")
    return out


def sub_world(n: int):
    """The first ``n`` ranks of the world (collective over the world); None on the others."""
    world = MPI.COMM_WORLD
    comm = world.Split(0 if world.rank < n else MPI.UNDEFINED, world.rank)
    return None if comm == MPI.COMM_NULL else comm


def grid_sizes(layout: dict) -> dict:
    """The grid's sizes among a layout's fields."""
    return {k: v for k, v in layout.items() if k in ("pp", "dp", "cp", "tp", "ep")}


@pytest.mark.parallel(nprocs=4)
@collective
def test_resume_where_the_shards_do_not_line_up():
    """Save after 1 of 2 steps on layout a, resume on layout b: the loss and the final
    weights equal the serial uninterrupted run's to float64 rounding. Every case runs on
    every rank's schedule of world collectives (a failure is collected, not raised)."""
    bad, ds, met = Mismatches(), data(), set()
    for model, (na, a), (nb, b) in UNALIGNED:
        cfg, where = config(**model), f"{a} -> {b}"
        serial = None
        if MPI.COMM_WORLD.rank == 0:
            serial, losses = train(serial_config(cfg), 2, ds, grid=ProcessGrid(MPI.COMM_SELF))
        d, again = shared_dir(), shared_dir()
        world_a, world_b = sub_world(na), sub_world(nb)
        try:
            if world_a is not None:
                first, before = train(replace(cfg, **a), 1, ds, grid=ProcessGrid(world_a, **grid_sizes(a)))
                first.save_checkpoint(d)
            if world_b is not None:
                second, after = train(replace(cfg, **b, resume=d), 1, ds,
                                      grid=ProcessGrid(world_b, **grid_sizes(b)))
                second.save_checkpoint(again)
                got = second.runner.full_params()
                if serial is not None:
                    bad.check(np.testing.assert_allclose, before + after, losses, **TOL,
                              err_msg=f"losses, {where}")
                    want = host(serial.runner.full_params())
                    for k, v in host(got).items():
                        bad.check(np.testing.assert_allclose, v, want[k], **TOL,
                                  err_msg=f"{k}, {where}")
                    met |= touching(pieces(d), pieces(again))
        except (AssertionError, ConfigError) as e:
            bad.errors.append(f"{where}: {type(e).__name__}: {e}")
        for comm in (world_a, world_b):
            if comm is not None:
                comm.Free()
        if MPI.COMM_WORLD.rank == 0:
            shutil.rmtree(d)
            shutil.rmtree(again)
    if MPI.COMM_WORLD.rank == 0:
        bad.check(np.testing.assert_equal, sorted(met), ["ends on the first", "starts on the last"],
                  err_msg="the cases no longer meet the wanted slices' bounds")
    bad.assert_none()


# --- finding checkpoints, and the slices' runs (one process) --------------------------------------


def test_keep_and_what_is_not_a_checkpoint(tmp_path):
    """--keep K keeps the last K; a directory without a manifest (half-written, or a
    temporary name) is not a checkpoint; the runs of a piece give its indices back."""
    tr = Trainer(config(n_layer=1, steps=3), grid=ProcessGrid(MPI.COMM_SELF), dataset=data())
    root = str(tmp_path / "ck")
    for _ in range(3):
        tr.step()
        tr.save_checkpoint(root, keep=2)
    assert ckpt_format.complete_steps(root) == [2, 3]
    os.makedirs(os.path.join(root, "step-00000009"))  # a step directory with no manifest
    os.makedirs(os.path.join(root, ".step-00000010.tmp"))  # one still being written
    assert ckpt_format.find(root) == os.path.join(root, "step-00000003")
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        ckpt_format.find(str(tmp_path))
    index = np.array([3, 4, 5, 9, 10, 20], np.int64)
    assert ckpt_format.runs_of(index).tolist() == [[3, 3], [9, 2], [20, 1]]
    np.testing.assert_array_equal(ckpt_format.index_of(ckpt_format.runs_of(index)), index)


# --- the command ---------------------------------------------------------------------------------

SMALL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "8", "--batch-size", "4",
         "--dtype", "float64", "--no-progress"]


def same_file(a: str, b: str) -> None:
    """Two GPT-2 files hold the same tensors, bitwise, and the same metadata."""
    ta, tb = load_file(a), load_file(b)
    assert set(ta) == set(tb)
    for k in ta:
        np.testing.assert_array_equal(ta[k], tb[k], err_msg=k)
    with safe_open(a, "numpy") as fa, safe_open(b, "numpy") as fb:
        assert fa.metadata() == fb.metadata()


def test_save_every_keep_resume_and_convert(tmp_path):
    """Train on tp2 with a checkpoint every step (keep 2) and --save; convert the last
    checkpoint: the --save file, and a Hugging Face directory of the same tensors. Drop it
    (as if the run died after step 3) and resume: on tp2 the same weights bitwise, on dp2 to
    float64 rounding. Convert the file back to a 1-rank checkpoint and resume from that: the
    run --init would make."""
    d, a = str(tmp_path / "ck"), str(tmp_path / "a.safetensors")
    r = refmp(2, ["train", "--tp", "2", *SMALL, "--steps", "4", "--checkpoint-dir", d,
                  "--save-every", "1", "--keep", "2", "--save", a])
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(d)) == ["step-00000003", "step-00000004"]
    c = str(tmp_path / "c.safetensors")
    r = mpiexec(1, ["python", "-m", "refmp", "convert", d, c])
    assert r.returncode == 0, r.stderr
    same_file(a, c)
    h = str(tmp_path / "hf")  # OUT not ending in .safetensors: a Hugging Face directory
    assert main(["convert", d, h]) == 0
    hf_cfg, hf_params = read_model(h)  # its config.json gives the heads
    assert hf_cfg.n_head == 2 and sorted(os.listdir(h)) == ["config.json", "model.safetensors"]
    for k, v in load_file(a).items():
        np.testing.assert_array_equal(hf_params[k], v, err_msg=k)
    r = mpiexec(1, ["python", "-m", "refmp", "convert", "--info", d])
    assert r.returncode == 0, r.stderr
    assert "step 4" in r.stdout and "tp=2" in r.stdout and "rank-00001.safetensors" in r.stdout
    assert "h.0.attn.c_attn.weight" in r.stdout and "who holds which slice" in r.stdout

    for flags, name in ((["--tp", "2"], "b"), (["--dp", "2"], "c")):
        shutil.rmtree(os.path.join(d, "step-00000004"))  # as if the run died after step 3
        b = str(tmp_path / f"{name}.safetensors")
        r = refmp(2, ["train", *flags, *SMALL, "--steps", "4", "--resume", d, "--save", b,
                      "--checkpoint-dir", d, "--keep", "2"])
        assert r.returncode == 0, r.stderr
        assert "resuming from" in r.stdout and "at step 3 of 4" in r.stdout
        assert sorted(os.listdir(d)) == ["step-00000003", "step-00000004"]
        ta, tb = load_file(a), load_file(b)
        for k in ta:  # the same layout: bitwise; another: float64 rounding
            (np.testing.assert_array_equal(tb[k], ta[k], err_msg=k) if name == "b" else
             np.testing.assert_allclose(tb[k], ta[k], **TOL, err_msg=k))

    e = str(tmp_path / "e")  # back: the --save file as a 1-rank checkpoint, weights only
    r = mpiexec(1, ["python", "-m", "refmp", "convert", a, e])
    assert r.returncode == 0, r.stderr
    f = str(tmp_path / "f.safetensors")
    assert mpiexec(1, ["python", "-m", "refmp", "convert", e, f]).returncode == 0
    same_file(a, f)
    g = str(tmp_path / "g.safetensors")
    r = refmp(2, ["train", "--dp", "2", *SMALL, "--steps", "1", "--resume", e, "--save", g])
    assert r.returncode == 0, r.stderr
    cfg = TrainConfig(init=a, batch_size=4, steps=1, dtype="float64", progress=False)
    tr, _ = train(cfg, 1, None, grid=ProcessGrid(MPI.COMM_SELF))
    tg = load_file(g)
    for k, v in tr.runner.full_params().items():
        np.testing.assert_allclose(tg[k], v, **TOL, err_msg=k)


# --- bad checkpoints -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A checkpoint of a 2-rank run (dp 2, ZeRO 1: both files hold pieces)."""
    d = str(tmp_path_factory.mktemp("saved") / "ck")
    r = refmp(2, ["train", "--dp", "2", "--zero", "1", *SMALL, "--steps", "1",
                  "--checkpoint-dir", d])
    assert r.returncode == 0, r.stderr
    return d


def truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def flip_last_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))


def drop_from_manifest(path: str, name: str) -> None:
    """Remove one file's entry from a manifest (its slices are then held by no file)."""
    with open(path) as f:
        man = json.load(f)
    del man["files"][name]
    with open(path, "w") as f:
        json.dump(man, f)


STEP = "step-00000001"
BAD = [  # (what to do to the checkpoint, extra flags, the file the message names, its words)
    pytest.param(lambda d: truncate(f"{d}/{STEP}/rank-00001.safetensors"), [],
                 "rank-00001.safetensors", "truncated", id="truncated-rank-file"),
    pytest.param(lambda d: flip_last_byte(f"{d}/{STEP}/rank-00000.safetensors"), [],
                 "rank-00000.safetensors", "sha256", id="altered-rank-file"),
    pytest.param(lambda d: os.remove(f"{d}/{STEP}/rank-00001.safetensors"), [],
                 "rank-00001.safetensors", "missing", id="missing-rank-file"),
    pytest.param(lambda d: truncate(f"{d}/{STEP}/manifest.json"), [], "manifest.json",
                 "not valid JSON", id="truncated-manifest"),
    pytest.param(lambda d: drop_from_manifest(f"{d}/{STEP}/manifest.json",
                                              "rank-00001.safetensors"), [],
                 "manifest.json", "no file holds", id="manifest-without-a-file"),
    pytest.param(lambda d: None, ["--n-embd", "16"], "manifest.json", "n_embd 8",
                 id="another-model-shape"),
    pytest.param(lambda d: None, ["--optimizer", "sgd"], "manifest.json",
                 "optimizer is adamw", id="another-optimizer"),
    pytest.param(lambda d: shutil.rmtree(f"{d}/{STEP}"), [], "ck", "no complete checkpoint",
                 id="no-checkpoint"),
    pytest.param(lambda d: None, ["--init", "w.safetensors"], "w.safetensors",
                 "both give the starting weights", id="init-and-resume"),
]


@pytest.fixture(scope="module")
def bad_resumes(saved, tmp_path_factory):
    """A copy of the checkpoint spoiled as each of BAD says, resumed on 2 ranks: every case
    in one launch (mpi_helpers.refused). Case id -> result."""
    cases = {}
    for case in BAD:
        spoil, flags, _, _ = case.values
        d = str(tmp_path_factory.mktemp(case.id) / "ck")
        shutil.copytree(saved, d)
        spoil(d)
        cases[case.id] = ["train", "--dp", "2", *SMALL, "--steps", "2", "--resume", d, *flags]
    return refused(2, cases)


@pytest.mark.parametrize("spoil,flags,name,words", BAD)
def test_a_bad_checkpoint_is_refused_with_one_message(bad_resumes, request, spoil, flags, name,
                                                      words):
    r = bad_resumes[request.node.callspec.id]
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, r.stderr  # one message (rank 0's), every rank exits 2
    assert name in errors[0] and words in errors[0], errors[0]


def test_a_truncated_init_file_and_convert_input(saved, tmp_path):
    a = str(tmp_path / "a.safetensors")
    assert mpiexec(1, ["python", "-m", "refmp", "convert", saved, a]).returncode == 0
    truncate(a)
    r = refmp(2, ["train", "--dp", "2", *SMALL, "--steps", "1", "--init", a], timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert a in r.stderr and "truncated" in r.stderr, r.stderr
    d = str(tmp_path / "ck")
    shutil.copytree(saved, d)
    truncate(f"{d}/{STEP}/rank-00000.safetensors")
    r = mpiexec(1, ["python", "-m", "refmp", "convert", d, str(tmp_path / "b.safetensors")])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "rank-00000.safetensors" in r.stderr and "truncated" in r.stderr, r.stderr


@pytest.mark.tutorial
def test_tutorial_11_checkpoints():
    r = mpiexec(4, ["python", "tutorials/11_checkpoints.py"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: resumed on another layout == the uninterrupted run" in r.stdout
