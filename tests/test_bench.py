"""`refmp bench` takes train's layout flags, obeys them, and reports the ledger per axis."""

import json
import os

import pytest
from mpi_helpers import refmp

from refmp.cost.flops import active_params
from refmp.nn.params import GPTConfig

pytestmark = pytest.mark.cli

TINY = ["bench", "--preset", "tiny", "--steps", "2", "--warmup", "1"]
TINY_PARAMS = 120_576  # 2 layers, n_embd 64, block 64, vocab 256


def bench_json(n: int, flags: list[str]) -> dict:
    r = refmp(n, [*TINY, *flags, "--json"], timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)  # one object: rank 0 alone prints


def test_tp_is_obeyed_and_its_allreduces_are_ledgered():
    out = bench_json(2, ["--tp", "2"])
    lay = out["layout"]
    assert (lay["tp"], lay["dp"], lay["pp"], lay["cp"], lay["zero"]) == (2, 1, 1, 1, 0)
    tp = out["ledger"]["tp"]
    assert tp["allreduce"]["bytes"] > 0 and tp["allreduce"]["count"] > 0
    assert tp["allreduce"]["count"] % out["steps"] == 0  # every timed step alike
    assert set(out["ledger"].get("dp", {})) <= {"metric"}  # no gradient traffic over dp of 1


def test_zero_1_shards_over_dp():
    out = bench_json(2, ["--dp", "2", "--zero", "1"])
    lay = out["layout"]
    assert (lay["dp"], lay["tp"], lay["zero"]) == (2, 1, 1)
    dp = out["ledger"]["dp"]
    # ZeRO: gradients reduce-scattered, parameters all-gathered, no all-reduce; each moves
    # the full float32 model once per step
    assert "allreduce" not in dp
    for op in ("reduce_scatter", "allgather"):
        assert dp[op]["bytes"] == out["steps"] * 4 * TINY_PARAMS, op
    # every rank's memory: what it holds is the formulas' figure, exactly; its process more
    state = ("params", "grads", "optimizer", "activations")
    assert len(out["memory_per_rank"]) == 2
    # every rank's CPU time a step: its own (a tenth of the step at least), not the wall
    # clock's (at most the machine's cores' worth, its threads all busy)
    assert len(out["cpu_ms_per_step"]) == 2
    for c in out["cpu_ms_per_step"]:
        assert 0.1 * out["ms_per_step_min"] < c < os.cpu_count() * out["ms_per_step_max"], out
    for mem in out["memory_per_rank"]:
        assert [mem["measured"][k] for k in state] == [mem["formula"][k] for k in state], mem
        assert mem["measured"]["optimizer"] == 8 * TINY_PARAMS // 2  # AdamW's 2 moments, 1/dp
        assert mem["peak_rss"] > mem["formula_peak"] > sum(mem["measured"][k] for k in state)


def test_text_report_has_one_line_per_axis():
    r = refmp(2, [*TINY, "--cp", "2", "--cp-algo", "ulysses", "--cp-balance", "contiguous"],
              timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("refmp bench:") == 1
    assert r.stdout.count("    rank ") == 2  # a memory line per rank
    assert "cp=2" in r.stdout and "cp ulysses contiguous" in r.stdout
    assert r.stdout.splitlines()[1].startswith("  cpu ") and " kernels, " in r.stdout  # where
    assert r.stdout.count("CPU time a step, by rank: ") == 1
    ledger = r.stdout.split("communication per step")[1]
    lines = [x.split() for x in ledger.splitlines() if x.startswith("    ")]
    assert [x[0] for x in lines] == ["cp", "world"]  # axis, bytes per step, "B", (calls)
    cp_bytes = int(lines[0][1].replace(",", ""))
    assert cp_bytes > 0 and "alltoall" in r.stdout


def test_bench_refuses_bad_layout_once():
    r = refmp(2, [*TINY, "--tp", "3"], timeout=60)
    assert r.returncode == 2 and r.stderr.count("error:") == 1, r.stderr


def test_moe_flops_count_active_parameters():
    C = 64
    dense = GPTConfig(256, 64, 2, 4, C)
    expert = C * 4 * C + 4 * C + 4 * C * C + C  # one GPT-2 MLP
    assert active_params(dense) == TINY_PARAMS - 64 * C  # wpe is a lookup
    for k in (1, 2):  # block 0's MLP becomes a router (C x 4, in full) and 4 experts, k visited
        moe = GPTConfig(256, 64, 2, 4, C, n_expert=4, top_k=k, moe_every=2)
        assert active_params(moe) == active_params(dense) + C * 4 + (k - 1) * expert, k


def test_composed_layout_and_recompute_flops():
    """pp 2 x cp 2 with full recomputation: obeyed, and the recomputed forward is counted as
    hardware FLOPs beyond the model's (2 N_blocks + 4 L T C per token)."""
    from refmp.cost.flops import recompute_flops_per_step

    out = bench_json(4, ["--pp", "2", "--cp", "2", "--microbatches", "2", "--recompute", "full"])
    lay = out["layout"]
    assert (lay["pp"], lay["cp"], lay["recompute"]) == (2, 2, "full")
    assert out["ledger"]["cp"]["send"]["bytes"] > 0 and out["ledger"]["pp"]["send"]["bytes"] > 0
    m = out["model"]
    tokens = m["batch_size"] * m["block_size"]
    n_blocks = out["active_params"] - m["vocab"] * m["n_embd"] - 2 * m["n_embd"]
    extra = recompute_flops_per_step("full", n_blocks, m["n_layer"], m["block_size"],
                                     m["n_embd"], tokens)
    assert extra > 0
    ratio = out["recompute_gflops"] / out["gflops"]
    model = 6 * out["active_params"] * tokens + 12 * m["n_layer"] * m["block_size"] * m["n_embd"] * tokens
    assert ratio == pytest.approx(extra / model, rel=1e-9)
    assert out["hardware_gflops"] == pytest.approx(out["gflops"] + out["recompute_gflops"])
