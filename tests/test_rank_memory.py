"""Ranks with a memory size (refmp cluster --rank-memory, docs/nodes.md) and each rank's
measured peak beside the planner's prediction (docs/memory_at_scale.md).

Pure: sizes, and bad limits refused with one message before any node is made. As root with
a kernel memory controller (skipped elsewhere, with the reason), on clusters of network
namespaces, every rank in a cgroup of LIMIT: a layout that fits trains on 2 nodes and
decodes, each rank's measured peak (ru_maxrss) within TOLERANCE of the prediction plus the
runtime baseline measured here (a rank of Python, NumPy, mpi4py and refmp's modules before
any model); one that does not fit is
refused before any work, naming the prediction, the limit and a layout that fits; a rank made
to exceed its limit (REFMP_FAULT_MODE=memory, past the check) ends the job with a message that
names the rank and the limit; no cgroup is left behind, and a cluster killed outright leaves
its cgroups to the next one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mpi_helpers import REPO, mpiexec

from refmp.checkpoint.weights import save_model
from refmp.cli import cluster, netns
from refmp.cli.main import main
from refmp.config import TrainConfig
from refmp.cost.decode import decode_memory
from refmp.cost.memory import size
from refmp.errors import ConfigError
from refmp.nn import GPT, GPTConfig
from refmp.runtime import cgroup
from refmp.training.rank_memory import predicted_peak

pytestmark = pytest.mark.cli
WHY = netns.unavailable() or cgroup.unavailable()
needs_limits = pytest.mark.skipif(WHY is not None, reason=f"no ranks with a memory size: {WHY}")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
LIMIT = "250MiB"
TOLERANCE = 0.10  # of the prediction, beside the baseline
# 4 blocks of C 512 on bytes: 12.7M parameters, 51 MB in float32; AdamW's state 203 MB
SHAPE = ["--n-layer", "4", "--n-embd", "512", "--n-head", "8", "--block-size", "32"]
MODEL = GPTConfig(256, 32, 4, 8, 512)
# decoding: 12 such blocks (38M parameters, 152 MB), so that a tp 2 rank's share (76 MB) puts
# 10% of the prediction above the variation between launches (about 3 MB; up to 6 MB within a
# whole suite's run)
DECODE = GPTConfig(256, 32, 12, 8, 512)
ONE = {"pp": 1, "dp": 1, "cp": 1, "tp": 1, "ep": 1}  # a layout's sizes
ZERO = dict.fromkeys(ONE, 0)  # a rank's coordinates


def test_sizes():
    assert cgroup.parse_size("4GiB") == 4 << 30 == cgroup.parse_size("4g")
    assert cgroup.parse_size("1.5G") == 3 << 29 and cgroup.parse_size("4GB") == 4 * 10**9
    assert cgroup.parse_size("512MiB") == 512 << 20 and cgroup.parse_size("1000") == 1000
    assert cgroup.gib(4 << 30) == "4 GiB" and cgroup.gib(250 << 20) == "250 MiB"
    for bad, why in (("lots", "not a size"), ("4 GiBs", "not a size"), ("0", "positive"),
                     ("-1G", "positive"), ("", "not a size")):
        with pytest.raises(ValueError, match=why):
            cgroup.parse_size(bad)


def test_one_reader_of_limits_for_a_rank_and_for_the_container(tmp_path, monkeypatch):
    """cgroup.limit reads v1's memory.limit_in_bytes or v2's memory.max ("max": none);
    headroom is the root's limit less its usage (the smaller of v2's and v1's), which caps
    checks.available_memory; rank_limit reads a rank's own cgroup with the same reader."""
    from refmp.training import checks

    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    v2.mkdir()
    v1.mkdir()
    monkeypatch.setattr(cgroup, "V2", str(v2))
    monkeypatch.setattr(cgroup, "V1", str(v1))
    (v2 / "memory.max").write_text("max\n")
    (v2 / "memory.current").write_text("100\n")
    assert cgroup.limit(str(v2), cgroup.Controller(2, str(v2))) is None
    assert cgroup.headroom() is None  # no limit anywhere
    (v2 / "memory.max").write_text("5000\n")
    (v1 / "memory.limit_in_bytes").write_text("3000\n")
    (v1 / "memory.usage_in_bytes").write_text("1000\n")
    assert cgroup.headroom() == 2000  # v1's 3000 - 1000 below v2's 5000 - 100
    assert checks.available_memory() == (2000, "the cgroup's memory limit")
    monkeypatch.setenv(cgroup.ENV, str(v1))  # v1 found first: a rank's cgroup of 3000 B
    assert cgroup.rank_limit() == (3000, str(v1)) and cgroup.peak()["limit"] == 3000


def test_bad_limits_are_refused_before_any_node(monkeypatch, capsys):
    made = []
    monkeypatch.setattr(netns, "unavailable", lambda: None)
    monkeypatch.setattr(netns, "Cluster", lambda *a, **k: made.append(a))

    def refused(limit: str) -> str:
        args = argparse.Namespace(clean=False, program=["--", "true"], nodes=1,
                                  ranks_per_node=2, link_gbit=None, share=[], launcher="netns",
                                  json=None, rank_memory=limit)
        with pytest.raises(ConfigError) as e:
            cluster.run_cluster(args)
        return str(e.value)

    assert "--rank-memory 'four' is not a size" in refused("four")
    assert "must be positive" in refused("0") and "must be positive" in refused("-2GiB")
    assert "more than this machine's memory" in refused(f"{cgroup.machine_bytes() + 1}")
    monkeypatch.setattr(cgroup, "controller", lambda: None)
    assert "--rank-memory 1GiB: no kernel memory controller" in refused("1GiB")
    monkeypatch.setattr(cgroup.os, "geteuid", lambda: 1000)
    assert "--rank-memory 1GiB: a memory cgroup per rank needs root" in refused("1GiB")
    assert made == []
    # the command: one message, status 2 (here or without root: refused before any node)
    assert main(["cluster", "--rank-memory", "0", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "--rank-memory '0': a memory size must be positive" in err


def launch(folder: str, *args: str, env: dict = ENV, json_file: str | None = None):
    """``refmp cluster --rank-memory LIMIT --share folder [...] args`` to its end."""
    extra = ["--json", json_file] if json_file else []
    return subprocess.run([sys.executable, "-m", "refmp", "cluster", "--rank-memory", LIMIT,
                           "--share", folder, *extra, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=180)


# a rank before any model: Python, NumPy, mpi4py and the modules refmp train and generate
# load before they make or read one
BASELINE = """
import resource
import numpy
from mpi4py import MPI
import refmp.cli.main, refmp.cli.train, refmp.cli.generate, refmp.training.trainer
import refmp.inference.decoder, refmp.inference.generate, refmp.inference.sources
import refmp.checkpoint.weights, safetensors.numpy
peaks = MPI.COMM_WORLD.gather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
if peaks:  # rank 0 alone prints (two ranks' lines could interleave)
    print(max(peaks))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The runtime baseline (BASELINE's peak, the largest of 2 ranks), and
    four runs under LIMIT: training that fits (2 nodes), decoding, training that does not fit,
    and training whose rank 1 exceeds its limit before its first step."""
    d = str(tmp_path_factory.mktemp("rank-memory"))
    text = os.path.join(d, "text.txt")
    rng = np.random.default_rng(0)
    with open(text, "wb") as f:
        f.write(bytes(rng.integers(97, 123, 20000).astype(np.uint8)))
    m = GPT.create(MODEL, 0, "float32")
    save_model(os.path.join(d, "m.safetensors"), m.params, m.cfg, "bytes")
    m = GPT.create(DECODE, 0, "float32")
    save_model(os.path.join(d, "d.safetensors"), m.params, m.cfg, "bytes")
    del m
    base = mpiexec(2, [sys.executable, "-c", BASELINE], env={"UCX_TLS": "tcp,self"})
    assert base.returncode == 0, base.stderr
    train = ["--", "refmp", "train", "--data", text, *SHAPE, "--batch-size", "4", "--steps",
             "1", "--no-progress"]
    two = ["--nodes", "2", "--ranks-per-node", "1"]
    one = ["--nodes", "1", "--ranks-per-node", "2"]
    fault = {**ENV, "REFMP_FAULT_RANK": "1", "REFMP_FAULT_STEP": "0",
             "REFMP_FAULT_MODE": "memory"}
    return {"dir": d, "baseline": int(base.stdout),
            "fits": launch(d, *two, *train, "--pp", "2", "--microbatches", "2", "--log-json",
                           os.path.join(d, "fits.jsonl"),
                           json_file=os.path.join(d, "cluster.json")),
            "decodes": launch(d, *two, "--", "refmp", "generate", "--init",
                              os.path.join(d, "d.safetensors"), "--tp", "2", "--prompt",
                              "abcdefgh", "--max-new-tokens", "8", "--json"),
            "refused": launch(d, *one, *train, "--dp", "2"),
            "killed": launch(d, *one, *train, "--pp", "2", "--microbatches", "2", env=fault)}


def within(rows: list[dict], baseline: int) -> list[str]:
    """The ranks whose measured peak is not the prediction plus the baseline, +- TOLERANCE."""
    return [f"rank {r}: measured {m['rss']:,}, predicted {m['predicted']:,} + baseline "
            f"{baseline:,}" for r, m in enumerate(rows)
            if abs(m["rss"] - baseline - m["predicted"]) > TOLERANCE * m["predicted"]]


@needs_limits
def test_a_layout_that_fits_runs_within_its_limit_on_two_nodes(runs):
    r = runs["fits"]
    assert r.returncode == 0, r.stdout + r.stderr
    limit = cgroup.parse_size(LIMIT)
    with open(os.path.join(runs["dir"], "fits.jsonl")) as f:
        summary = json.loads(f.read().splitlines()[-1])
    rows = summary["memory_measured"]
    assert len(rows) == 2 and all(m["limit"] == limit for m in rows)
    assert all(0 < m["cgroup"] <= limit and m["rss"] <= limit for m in rows), rows
    assert within(rows, runs["baseline"]) == [], (runs["baseline"], rows)
    cfg = TrainConfig(pp=2, microbatches=2, batch_size=4, block_size=32, n_layer=4, n_embd=512,
                      n_head=8)
    for pp, m in enumerate(rows):  # the planner's figure for each stage
        assert m["predicted"] == predicted_peak(cfg, MODEL, {**ONE, "pp": 2}, {**ZERO, "pp": pp})
    assert "measured peak memory per rank" in r.stdout
    assert f"predicted {size(rows[0]['predicted'])}" in r.stdout
    with open(os.path.join(runs["dir"], "cluster.json")) as f:
        kept = json.load(f)["rank_memory"]
    assert kept["limit"] == limit and kept["oom_kills"] == [0, 0]
    assert [p >= m["cgroup"] for p, m in zip(kept["peak"], rows, strict=True)] == [True, True]


@needs_limits
def test_decoding_reports_its_measured_peak_beside_the_prediction(runs):
    r = runs["decodes"]
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("{")))
    rows = out["memory_measured"]
    for t, m in enumerate(rows):  # 8 prompt tokens and 7 more run through the model
        want = decode_memory(DECODE, {**ONE, "tp": 2}, {**ZERO, "tp": t}, 1, 15)
        assert m["predicted"] == want["peak"] and m["limit"] == cgroup.parse_size(LIMIT)
    assert within(rows, runs["baseline"]) == [], (runs["baseline"], rows)


@needs_limits
def test_a_layout_that_does_not_fit_is_refused_before_any_work(runs):
    r = runs["refused"]
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr
    assert err.count("error:") == 1, err  # one message, for every rank
    assert "does not fit its memory limit of 250 MiB = 262 MB" in err, err
    cfg = TrainConfig(dp=2, batch_size=4, block_size=32, n_layer=4, n_embd=512, n_head=8)
    need = predicted_peak(cfg, MODEL, {**ONE, "dp": 2}, ZERO)
    assert f"the planner predicts a peak of {size(need)} for this layout" in err, err
    assert "a layout of these 2 ranks that fits: --tp 1 --pp 1 --dp 2 --zero" in err, err
    assert "step" not in r.stdout  # no step ran


@needs_limits
def test_a_rank_past_its_limit_ends_the_job_with_its_name_and_limit(runs):
    r = runs["killed"]
    assert r.returncode != 0, r.stdout + r.stderr
    assert ("refmp cluster: rank 1 was killed by the kernel: it reached its memory limit of "
            "250 MiB (--rank-memory 250MiB)") in r.stderr, r.stdout + r.stderr
    assert "rank 0 was killed" not in r.stderr
    assert "done:" not in r.stdout
    ctl = cgroup.controller()
    assert [d for d in os.listdir(ctl.root) if d.startswith(cgroup.PREFIX)] == []


@needs_limits
def test_a_killed_run_leaves_its_cgroups_to_the_next_cluster(tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "refmp", "cluster", "--rank-memory", "100MiB",
                          "--nodes", "1", "--", "sleep", "60"], cwd=REPO, env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ident = p.stdout.readline().split()[2].rstrip(":")  # "refmp cluster ID: ..."
    rank0 = os.path.join(cgroup.controller().root, f"{cgroup.PREFIX}{ident}", "rank0")
    deadline = time.time() + 30
    while time.time() < deadline and not (os.path.isdir(rank0) and Path(
            rank0, "cgroup.procs").read_text().split()):
        time.sleep(0.05)  # until the rank is in its cgroup
    p.kill()  # SIGKILL: nothing of the cluster's teardown runs
    p.wait(timeout=30)
    assert os.path.dirname(rank0) in netns.leftovers(ident)
    assert ident in netns.clean()  # as every new cluster does first
    assert netns.leftovers(ident) == [] and not os.path.exists(rank0)
    p.stdout.close()
