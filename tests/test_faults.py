"""No rank fails alone (refmp.distributed.faults): bad input, a diverging run, a failing or killed rank.

Every case runs the real command under mpiexec, as a user would, with a timeout: a job that
hangs fails the test instead of hanging it. The bad-input cases run a few at a time (each is
mostly start-up), and each is timed on its own.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import REPO, mpiexec, refmp, refused

from refmp.checkpoint.weights import save_model
from refmp.cost.memory import estimate_memory, need_bytes
from refmp.distributed.faults import check_finite, check_writable_dir, check_writable_file
from refmp.distributed.grid import ProcessGrid
from refmp.errors import ConfigError, TrainingError
from refmp.nn import GPT, GPTConfig
from refmp.training.trainer import TrainConfig, Trainer

pytestmark = pytest.mark.cli

SMALL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "8", "--batch-size", "4", "--no-progress"]
MOE = ["--n-expert", "2", "--top-k", "1"]


def bad_cases(tmp) -> dict[str, tuple[list[str], str]]:
    """name: (flags, what the one message must say). Paths under ``tmp`` are made here."""
    os.makedirs(f"{tmp}/a_dir", exist_ok=True)
    os.makedirs(f"{tmp}/a_dir.safetensors", exist_ok=True)  # --save's name says: one file
    trunc = f"{tmp}/truncated.safetensors"
    save_model(trunc, GPT.create(GPTConfig(13, 13, 1, 2, 8), 0).params, GPTConfig(13, 13, 1, 2, 8))
    data = open(trunc, "rb").read()
    with open(trunc, "wb") as f:
        f.write(data[: len(data) // 2])
    return {
        "lr nan": (["--lr", "nan"], "--lr must be positive and finite, got nan"),
        "lr inf": (["--lr", "inf"], "--lr must be positive and finite, got inf"),
        "lr negative": (["--lr", "-1"], "--lr must be positive"),
        "beta1 1.5": (["--beta1", "1.5"], "--beta1 must be in [0, 1), got 1.5"),
        "beta2 1": (["--beta2", "1"], "--beta2 must be in [0, 1), got 1.0"),
        "weight decay -1": (["--weight-decay", "-1"], "--weight-decay must be >= 0"),
        "weight decay nan": (["--weight-decay", "nan"], "--weight-decay must be >= 0 and finite"),
        "grad clip -1": (["--grad-clip", "-1"], "--grad-clip must be >= 0"),
        "grad clip inf": (["--grad-clip", "inf"], "--grad-clip must be >= 0 and finite, got inf"),
        "momentum 1": (["--optimizer", "sgd", "--momentum", "1"], "--momentum must be in [0, 1)"),
        "capacity nan": ([*MOE, "--capacity-factor", "nan"], "--capacity-factor must be >= 0"),
        "aux loss -1": ([*MOE, "--aux-loss-coef", "-1"], "--aux-loss-coef must be >= 0"),
        "warm-up > steps": (["--warmup-steps", "10", "--steps", "5"], "is more than --steps 5"),
        "warm-up < 0": (["--warmup-steps", "-1"], "--warmup-steps must be >= 0"),
        "min lr ratio 2": (["--min-lr-ratio", "2"], "--min-lr-ratio must be between 0 and 1"),
        "seed -1": (["--seed", "-1"], "--seed must be >= 0"),
        "bucket nan": (["--bucket-mb", "nan"], "--bucket-mb must be >= 0 and finite"),
        "save: no dir": (["--save", "/nonexistent/dir/x.safetensors"],
                         "--save /nonexistent/dir/x.safetensors: the directory /nonexistent/dir"),
        "save: a dir": (["--save", f"{tmp}/a_dir.safetensors"], "is a directory"),
        "save: read-only": (["--save", "/proc/refmp.safetensors"], "cannot write in /proc"),
        "log: no dir": (["--log-json", "/nonexistent/l.jsonl"], "--log-json /nonexistent/l.jsonl"),
        "log: a dir": (["--log-json", f"{tmp}/a_dir"], "is a directory"),
        "checkpoints: read-only": (["--checkpoint-dir", "/proc/refmp-ckpt"], "cannot write in /proc"),
        "trace: no dir": (["--trace", "/nonexistent/t.json"], "--trace /nonexistent/t.json"),
        "memory: T": (["--block-size", "100000", "--batch-size", "100000"], "not enough memory"),
        "memory: C": (["--n-embd", "65536", "--n-head", "1"], "not enough memory"),
        "init truncated": (["--init", trunc], f"--init {trunc}: truncated"),
    }


NAMES = [  # the keys of bad_cases, in order (pytest ids)
    "lr nan", "lr inf", "lr negative", "beta1 1.5", "beta2 1", "weight decay -1",
    "weight decay nan", "grad clip -1", "grad clip inf", "momentum 1", "capacity nan",
    "aux loss -1", "warm-up > steps", "warm-up < 0", "min lr ratio 2", "seed -1",
    "bucket nan", "save: no dir", "save: a dir", "save: read-only", "log: no dir",
    "log: a dir", "checkpoints: read-only", "trace: no dir", "memory: T", "memory: C",
    "init truncated"]


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory):
    """Every bad-input case under mpiexec -n 2, all in one launch (mpi_helpers.refused):
    name -> (result, seconds, the words its message must have); result None if the launch
    ended before the case did (a hang)."""
    cases = bad_cases(str(tmp_path_factory.mktemp("bad")))
    assert sorted(cases) == sorted(NAMES)
    runs = refused(2, {name: ["train", *SMALL, *cases[name][0]] for name in NAMES})
    return {name: (None if r.statuses is None else r, r.seconds, cases[name][1])
            for name, r in runs.items()}


@pytest.mark.parametrize("name", NAMES)
def test_bad_input_one_message_exit_2(bad_runs, name):
    """Non-zero (2) within 10 s, before any step: one message with "error" and what is wrong,
    no traceback, nothing trained (no banner)."""
    r, seconds, message = bad_runs[name]
    assert r is not None, f"{name}: no exit within 60 s"
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert seconds < 10, f"{name}: {seconds:.1f} s"
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("refmp train: error: "), r.stderr
    assert message in lines[0], lines[0]
    assert "Traceback" not in r.stderr and "refmp train:" not in r.stdout


def test_exception_on_one_rank_aborts_the_job():
    """Rank 1 of 4 raises at step 2 (the REFMP_FAULT_RANK hook): its traceback, prefixed with
    its rank, and MPI_Abort ends the job in seconds. Without the abort the three other ranks
    would wait in the step's all-reduce until the run's many steps' worth of time out."""
    t0 = time.perf_counter()
    r = refmp(4, ["train", *SMALL, "--steps", "100000"], timeout=30,
              env={"REFMP_FAULT_RANK": "1", "REFMP_FAULT_STEP": "2"})
    seconds = time.perf_counter() - t0
    assert r.returncode != 0 and seconds < 30
    assert "[rank 1] Traceback (most recent call last):" in r.stderr, r.stderr
    assert "[rank 1] RuntimeError: injected fault on rank 1 at step 2" in r.stderr, r.stderr
    for other in (0, 2, 3):  # the others are ended, not failing on their own
        assert f"[rank {other}]" not in r.stderr, r.stderr
    assert "done:" not in r.stdout


def test_exception_alone_is_a_plain_traceback():
    """One rank: no abort needed, Python's own traceback and exit status 1."""
    r = refmp(1, ["train", *SMALL, "--steps", "5"], timeout=30,
              env={"REFMP_FAULT_RANK": "0", "REFMP_FAULT_STEP": "1"})
    assert r.returncode == 1 and "[rank" not in r.stderr, r.stderr
    assert "RuntimeError: injected fault on rank 0 at step 1" in r.stderr


def test_killed_rank_ends_the_job(tmp_path):
    """kill -9 of rank 1 mid-run: MPICH's mpiexec ends the others and exits non-zero."""
    log = tmp_path / "log.jsonl"
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "refmp", "train", *SMALL,
           "--steps", "100000", "--log-json", str(log)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "REFMP_TEST_PID_DIR": str(tmp_path)}
    job = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 30
        while time.time() < deadline and not (log.exists() and log.read_text().count("\n") >= 2):
            time.sleep(0.1)  # until training runs (rank 0 logs its steps)
        assert job.poll() is None, "the job ended before the kill"
        pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in (0, 1)]
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.perf_counter()
        rc = job.wait(timeout=30)
        seconds = time.perf_counter() - t0
    finally:
        if job.poll() is None:
            job.kill()
        job.communicate()
    assert rc != 0 and seconds < 30
    with pytest.raises(ProcessLookupError):  # rank 0 is gone too
        os.kill(pids[0], 0)


def test_non_finite_loss_stops_every_rank(tmp_path):
    """--lr 1e6 without clipping diverges in float32 within a few steps: one message naming the
    step and the quantity, exit status 3, before that step's update; the log ends with it."""
    log = tmp_path / "log.jsonl"
    r = refmp(2, ["train", *SMALL, "--lr", "1e6", "--grad-clip", "0", "--warmup-steps", "0",
                  "--steps", "50", "--log-json", str(log)], timeout=30)
    assert r.returncode == 3, (r.returncode, r.stderr)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr and "Warning" not in r.stderr, r.stderr
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    step = recs[-1]["step"]
    assert 0 < step < 50 and [x["step"] for x in recs[:-1]] == list(range(step))
    assert all(math.isfinite(x["loss"]) and math.isfinite(x["grad_norm"]) for x in recs[:-1])
    what = "loss" if "loss is" in lines[0] else "gradient norm"
    assert lines[0].startswith(f"refmp train: error: step {step}: {what} is "), lines[0]
    assert recs[-1]["error"] in lines[0]


def test_check_finite_names_step_and_quantity():
    check_finite(0, 1.5, 2.0)
    with pytest.raises(TrainingError, match=r"^step 3: loss is nan"):
        check_finite(3, float("nan"), 1.0)
    with pytest.raises(TrainingError, match=r"^step 7: gradient norm is inf"):
        check_finite(7, 1.0, float("inf"))


def test_writable_paths(tmp_path):
    """The helpers --save / --log-json / --trace and --checkpoint-dir use."""
    check_writable_file(str(tmp_path / "x.safetensors"), "--save")
    (tmp_path / "old.jsonl").write_text("kept")
    check_writable_file(str(tmp_path / "old.jsonl"), "--log-json")
    assert (tmp_path / "old.jsonl").read_text() == "kept"  # checked, not truncated
    check_writable_dir(str(tmp_path / "new" / "deeper"), "--checkpoint-dir")  # to be made
    assert not (tmp_path / "new").exists() and os.listdir(tmp_path) == ["old.jsonl"]
    for bad, fn, says in [
        (tmp_path, check_writable_file, "is a directory"),
        (tmp_path / "no" / "x", check_writable_file, "does not exist"),
        ("/proc/x", check_writable_file, "cannot write in /proc"),
        (tmp_path / "old.jsonl", check_writable_dir, "is not a directory"),
        (tmp_path / "old.jsonl" / "sub", check_writable_dir, "is not a directory"),
        ("/proc/refmp-ckpt", check_writable_dir, "cannot write in /proc"),
    ]:
        with pytest.raises(ConfigError, match=says):
            fn(str(bad), "--flag")


@pytest.mark.parametrize("kw", [
    {}, {"dtype": "float64", "n_layer": 3, "microbatches": 2},
    {"optimizer": "sgd", "momentum": 0.9}, {"recompute": "selective"}, {"recompute": "full"},
    {"n_expert": 4, "top_k": 2}, {"n_expert": 4, "top_k": 1, "capacity_factor": 0.0},
    {"schedule": "2bw"},
])
def test_memory_estimate_against_the_measured_serial(kw):
    """The estimate's state is what the engine holds, exactly; its activations are the
    measured peak of live caches, exactly for dense blocks, within 5% for MoE (the kept
    assignments are bounded, not known, when a capacity drops some)."""
    cfg = TrainConfig(**{"n_layer": 2, "n_head": 2, "n_embd": 16, "batch_size": 8, "steps": 2,
                         "progress": False, **kw})
    tr = Trainer(cfg, grid=ProcessGrid(MPI.COMM_SELF))
    for _ in range(2):
        tr.step()
    got, est = tr.memory(), estimate_memory(cfg, tr.mcfg, tr.grid.sizes, tr.grid.coords)
    for k in ("params", "grads", "optimizer"):
        assert est[k] == got[k], k
    assert est["versions"] == got.get("versions", 0)
    if cfg.n_expert:
        assert 0.95 * got["activations"] <= est["activations"] <= 1.05 * got["activations"]
    else:
        assert est["activations"] == got["activations"]
    kinds = ("params", "grads", "optimizer", "activations")
    assert need_bytes(est) >= sum(got[k] for k in kinds)


ESTIMATE_SCRIPT = """
from mpi4py import MPI
from refmp.training.trainer import TrainConfig, Trainer
from refmp.cost.memory import estimate_memory, need_bytes
for kw in LAYOUTS:
    cfg = TrainConfig(**{"n_layer": 2, "n_head": 2, "n_embd": 16, "batch_size": 16, "steps": 1,
                         "progress": False, **kw})
    tr = Trainer(cfg)
    while tr.step_num < cfg.steps:
        tr.step()
    got, est = tr.memory(), estimate_memory(cfg, tr.mcfg, tr.grid.sizes, tr.grid.coords)
    bad = [k for k in ("params", "grads", "optimizer", "versions") if est[k] != got.get(k, 0)]
    ratio = est["activations"] / got["activations"]
    exact = not cfg.n_expert and cfg.schedule != "zb-h1"  # else a bound: 0.9 to 3 x
    if bad or (ratio != 1 if exact else not 0.9 <= ratio <= 3):
        print(f"rank {tr.grid.rank} {kw}: state {bad} differ, activations x{ratio:.4f}")
MPI.COMM_WORLD.barrier()
print("checked")
"""


def test_memory_estimate_against_the_measured_layouts(tmp_path):
    """On 4 ranks: ZeRO 1-3, pp x tp (1F1B), dp x cp ring, cp x tp Ulysses with SP,
    interleaved, recomputation, zero-bubble, experts over ep, 2bw and pipedream's weight
    versions: the state exactly; dense
    activations exactly, MoE and zero-bubble ones within [0.9, 3] x measured (bounds there:
    routing is not known before it runs, and W frees only part of a cache)."""
    layouts = [
        {"pp": 2, "tp": 2, "microbatches": 4, "zero": 1, "recompute": "full"},
        {"tp": 2, "dp": 2, "sequence_parallel": True, "block_size": 16, "recompute": "selective"},
        {"dp": 2, "cp": 2, "block_size": 16, "zero": 2},
        {"cp": 2, "tp": 2, "cp_algo": "ulysses", "sequence_parallel": True, "block_size": 16,
         "n_head": 4},
        {"pp": 2, "dp": 2, "schedule": "interleaved", "virtual_stages": 2, "n_layer": 4,
         "microbatches": 4, "zero": 3},
        {"dp": 4, "ep": 2, "n_expert": 4, "zero": 2},
        {"pp": 2, "dp": 2, "schedule": "zb-h1", "microbatches": 4},
        {"pp": 2, "tp": 2, "schedule": "2bw", "microbatches": 2},
        {"pp": 4, "schedule": "pipedream", "microbatches": 2, "n_layer": 4, "steps": 6},
    ]
    script = tmp_path / "estimate.py"
    script.write_text(f"LAYOUTS = {layouts!r}\n" + ESTIMATE_SCRIPT)
    r = mpiexec(4, ["python", str(script)], timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("checked") == 4 and "rank" not in r.stdout, r.stdout


def test_memory_refusal_says_both_numbers():
    """The in-process check: what it needs and what there is, in one message; refused long
    before anything of that size is allocated (the model is not even built)."""
    cfg = TrainConfig(block_size=100000, batch_size=100000, steps=1, progress=False)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=r"needs about .* but .* is available") as e:
        Trainer(cfg, grid=ProcessGrid(MPI.COMM_SELF))
    assert time.perf_counter() - t0 < 10 and "TB" in str(e.value)


def test_truncated_init_names_the_file(tmp_path):
    """Cut anywhere, an --init file is refused by name, never a traceback."""
    path = tmp_path / "model.safetensors"
    cfg = GPTConfig(13, 13, 1, 2, 8)
    save_model(str(path), GPT.create(cfg, 0).params, cfg)
    data = path.read_bytes()
    for n in (0, 5, 100, len(data) // 2, len(data) - 1):
        path.write_bytes(data[:n])
        with pytest.raises(ConfigError, match=f"--init {path}: truncated"):
            Trainer(TrainConfig(init=str(path), steps=1, progress=False),
                    grid=ProcessGrid(MPI.COMM_SELF))
    path.write_bytes(data)  # whole again: it loads
    tr = Trainer(TrainConfig(init=str(path), steps=1, progress=False), grid=ProcessGrid(MPI.COMM_SELF))
    np.testing.assert_array_equal(tr.runner.full_params()["wpe.weight"],
                                  GPT.create(cfg, 0).params["wpe.weight"])


def test_killed_rank_then_resume_is_bitwise_the_uninterrupted_run(tmp_path):
    """Checkpoints every 50 steps; kill -9 of rank 1 once one is complete; --resume on the
    same layout: the final weights equal those of the run nobody killed, bitwise."""
    from safetensors.numpy import load_file

    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    run = [*SMALL, "--data", str(text), "--block-size", "8", "--steps", "300", "--dtype",
           "float64"]
    whole, resumed, ck = tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "ck"
    assert refmp(2, ["train", *run, "--save", str(whole)], timeout=120).returncode == 0
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "refmp", "train", *run,
           "--checkpoint-dir", str(ck), "--save-every", "50"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "REFMP_TEST_PID_DIR": str(tmp_path)}
    job = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not (ck / "step-00000100" / "manifest.json").exists():
            time.sleep(0.05)  # until two checkpoints are complete (200 steps to go, ~0.5 s)
        assert job.poll() is None, "the job ended before the kill"
        os.kill(int((tmp_path / "rank1.pid").read_text()), signal.SIGKILL)
        assert job.wait(timeout=30) != 0
    finally:
        if job.poll() is None:
            job.kill()
        job.communicate()
    r = refmp(2, ["train", *run, "--resume", str(ck), "--save", str(resumed)], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "resuming from" in r.stdout, r.stdout  # from a checkpoint, not from the start
    a, b = load_file(str(whole)), load_file(str(resumed))
    for k in a:
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)
