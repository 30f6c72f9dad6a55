"""`refmp train` and `refmp bench` end to end under mpiexec, as a user runs them."""

import json

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import refmp, refused
from safetensors.numpy import load_file

from refmp.distributed.grid import ProcessGrid
from refmp.training.trainer import TrainConfig, Trainer

pytestmark = pytest.mark.cli

SMALL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "8", "--batch-size", "4",
         "--dtype", "float64", "--no-progress"]


def serial_weights(steps: int, **kw) -> dict:
    """The same run, serial, in this process: what the files must hold."""
    cfg = TrainConfig(n_layer=1, n_head=2, n_embd=8, batch_size=4, steps=steps, dtype="float64",
                      progress=False, **kw)
    tr = Trainer(cfg, grid=ProcessGrid(MPI.COMM_SELF))
    for _ in range(steps):
        tr.step()
    return tr.runner.full_params()


def test_train_save_log_and_init_round_trip(tmp_path):
    a, b, log = tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "log.jsonl"
    r = refmp(2, ["train", "--dp", "2", *SMALL, "--steps", "3", "--save", str(a),
                  "--log-json", str(log)])
    assert r.returncode == 0, r.stderr
    assert "held-out exact match" in r.stdout and "allreduce@dp" in r.stdout
    assert r.stdout.count("refmp train:") == 1  # rank 0 alone prints
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["step"] for x in lines[:-1]] == [0, 1, 2]
    assert lines[-1]["summary"] and lines[-1]["layout"]["dp"] == 2
    assert all(x["tokens"] == 4 * 13 and x["seconds"] > 0 for x in lines[:-1])
    saved = load_file(str(a))
    ref = serial_weights(3)
    assert set(saved) == set(ref)  # GPT-2 names, full model
    for k in ref:
        np.testing.assert_allclose(saved[k], ref[k], rtol=1e-9, atol=1e-12, err_msg=k)

    # --init: the shape comes from the file (n_head from its metadata), training resumes
    r = refmp(2, ["train", "--dp", "2", "--init", str(a), "--steps", "2", "--batch-size", "4",
                  "--dtype", "float64", "--no-progress", "--save", str(b)])
    assert r.returncode == 0, r.stderr
    assert "1 layers, 2 heads, n_embd 8" in r.stdout
    cfg = TrainConfig(init=str(a), batch_size=4, steps=2, dtype="float64", progress=False)
    tr = Trainer(cfg, grid=ProcessGrid(MPI.COMM_SELF))
    for _ in range(2):
        tr.step()
    resumed = load_file(str(b))
    for k, v in tr.runner.full_params().items():
        np.testing.assert_allclose(resumed[k], v, rtol=1e-9, atol=1e-12, err_msg=k)


def test_text_file_data(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello refmp, " * 50)
    r = refmp(2, ["train", "--data", str(text), "--block-size", "8", "--steps", "2", *SMALL])
    assert r.returncode == 0, r.stderr
    assert "vocab 256" in r.stdout and "held-out" not in r.stdout


BAD = [
    (["--dp", "3"], "does not match the 2 MPI processes"),
    (["--data", "/nonexistent/file.txt"], "no such file"),
    (["--n-head", "3", "--n-embd", "16"], "divisible by n_head"),
    (["--batch-size", "5"], "must be divisible by dp"),
    (["--init", "/nonexistent.safetensors"], "no such file"),
    (["--optimizer", "adam"], "invalid choice"),
    (["--steps", "0"], "at least 1"),
    # hierarchical cp (--cp-ulysses) and HSDP (--dp-shard): docs/frontier.md
    (["--cp", "2", "--cp-ulysses", "2", "--n-head", "3", "--n-embd", "6", "--block-size", "8"],
     "n_head/tp = 3 heads of a tp rank, which must be divisible by 2"),
    (["--cp", "2", "--cp-ulysses", "2", "--block-size", "6"], "block size 6 is not divisible by 4"),
    (["--cp", "2", "--cp-ulysses", "4", "--block-size", "8"], "must be at least 1 and divide --cp 2"),
    (["--cp", "2", "--cp-ulysses", "2", "--cp-algo", "ulysses", "--block-size", "8"],
     "leave --cp-algo ring"),
    (["--dp-shard", "3", "--zero", "1"], "--dp-shard 3 must divide --dp 2"),
    (["--dp-shard", "1"], "--zero 0 shards nothing"),
    (["--dp-shard", "1", "--zero", "3", "--hpz-size", "2"], "--dp-shard 1 with --hpz-size"),
]


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory):
    """BAD's command lines and an --init file that is not safetensors, each refused on 2
    ranks, all in one launch (mpi_helpers.refused)."""
    bad = tmp_path_factory.mktemp("bad") / "bad.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    cases = {str(args): ["train", "--no-progress", *args] for args, _ in BAD}
    cases["bad safetensors"] = ["train", "--init", str(bad), "--no-progress"]
    gen = ["generate", "--init", "/nonexistent.safetensors", "--device", "gpu"]
    cases["generate gpu"] = [*gen, "--prompt", "1+1="]
    cases["generate gpu requests"] = [*gen, "--requests", "/nonexistent.jsonl"]
    return refused(2, cases)


@pytest.mark.parametrize("args,message", BAD)
def test_bad_input_fails_cleanly_on_every_rank(bad_runs, args, message):
    r = bad_runs[str(args)]
    assert r.returncode != 0
    assert message in r.stderr, r.stderr
    assert r.stderr.count(message) == 1  # said once, not once per rank
    assert "Traceback" not in r.stderr


def test_bad_safetensors_file(bad_runs):
    r = bad_runs["bad safetensors"]
    assert r.returncode == 2 and "not a readable safetensors file" in r.stderr, r.stderr


def test_generate_on_a_gpu_without_cupy_is_refused_before_the_weights(bad_runs):
    import importlib.util

    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed: tests/gpu runs the GPU")
    r = bad_runs["generate gpu"]
    assert r.returncode == 2 and r.stderr.count("--device gpu needs CuPy") == 1, r.stderr
    assert "Traceback" not in r.stderr


def test_generate_on_a_gpu_refuses_continuous_batching(bad_runs):
    r = bad_runs["generate gpu requests"]
    message = "--requests (continuous batching) runs on the CPU"
    assert r.returncode == 2 and r.stderr.count(message) == 1, r.stderr


def test_bench_json():
    r = refmp(1, ["bench", "--preset", "tiny", "--steps", "2", "--warmup", "1", "--json"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("ms_per_step", "tokens_per_s", "gflops", "mfu"):
        assert out[key] > 0, key
    assert out["tokens_per_s"] == pytest.approx(8 * 64 / (out["ms_per_step"] / 1e3))
    assert 0 < out["mfu"] < 1


def test_help():
    r = refmp(1, ["train", "--help"])
    assert r.returncode == 0 and "--batch-size" in r.stdout and "--dp" in r.stdout


def test_memory_table_shows_the_buffers_a_layout_keeps(capsys):
    """2BW's second weight version gets its own column (as many bytes as the weights); a
    plain run prints none."""
    from refmp.cli.train import print_memory

    rows = {}
    for schedule in ("1f1b", "2bw"):
        cfg = TrainConfig(n_layer=1, n_head=2, n_embd=8, block_size=4, batch_size=2, steps=1,
                          schedule=schedule, progress=False)
        tr = Trainer(cfg, grid=ProcessGrid(MPI.COMM_SELF))
        tr.step()
        print_memory([tr.memory()])
        rows[schedule] = capsys.readouterr().out.splitlines()
    assert "W(t-1)" not in rows["1f1b"][0] and "W(t-1)" in rows["2bw"][0]
    params, *_, version = (int(v.replace(",", "")) for v in rows["2bw"][1].split()[2:])
    assert version == params > 0
