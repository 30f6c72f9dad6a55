"""The V-shaped schedules (ZB-V, DualPipeV) in the simulator: they complete for every (pp, m),
their bubble is the formula's, their memory the papers', and the chunks sit in a V; each
weight gradient sits where zero bubble puts it, and the action lists are PyTorch's."""

import importlib.util

import pytest
from extras import reason
from hypothesis import given
from hypothesis import strategies as st

from refmp.parallel.pipeline.catalog import CATALOG, schedule
from refmp.parallel.pipeline.schedules import ChunkPlacement
from refmp.parallel.pipeline.simulate import bubble_formula, simulate_schedule


@given(name=st.sampled_from(["zb-v", "dualpipev"]), pp=st.integers(1, 6), m=st.integers(1, 14))
def test_v_schedules_complete_for_every_pp_and_micro_batch_count(name, pp, m):
    tl = simulate_schedule(name, pp, m)  # raises Deadlock if it cannot complete
    assert all(tl.busy(r) == 6 * m for r in range(pp))  # 2 chunks x (F + B + W) per micro-batch
    if m >= 2 * pp:  # DualPipeV's own bound; ZB-V's formula holds from m = 2 pp - 1
        assert tl.bubble() == pytest.approx(bubble_formula(name, pp, m), abs=1e-12)
        assert all(tl.makespan - tl.busy(r) == pp - 1 for r in range(pp))  # only the V's fill


@pytest.mark.parametrize("pp", [2, 3, 4, 5])
def test_zb_v_bubble_from_2pp_minus_1_and_its_memory_is_1f1b_s(pp):
    m = 2 * pp - 1
    tl = simulate_schedule("zb-v", pp, m)
    assert tl.bubble() == pytest.approx(bubble_formula("zb-v", pp, m), abs=1e-12)
    # 2 pp half-stage caches on every rank: 1F1B's pp stage caches on stage 0
    assert tl.peak_held == [2 * pp] * pp
    assert simulate_schedule("dualpipev", pp, 2 * pp).peak_held == [2 * pp + 1] * pp  # PP + 1


def test_at_pp_4_and_8_micro_batches_the_v_halves_zb_h1_s_idle_time():
    """Idle time per rank, in a whole stage's F: 1F1B 3 (p-1), ZB-H1 p-1, ZB-V and DualPipeV
    (p-1)/2 (p-1 steps of a chunk that is half a stage)."""
    idle = {}
    for n in ("1f1b", "zb-h1", "zb-v", "dualpipev"):
        tl = simulate_schedule(n, 4, 8)
        idle[n] = (tl.makespan - tl.busy(0)) / tl.v
    assert idle == {"1f1b": 9, "zb-h1": 3, "zb-v": 1.5, "dualpipev": 1.5}


@pytest.mark.parametrize("pp", [2, 3, 4, 5, 6])
def test_dualpipev_paired_bubble_is_deepseeks_formula(pp):
    """DeepSeek's DualPipe bubble (PP/2 - 1)(F&B + B - 3W), PP = 2 pp chunks, at F = W = 1
    and a whole backward B = 2: with each F and the whole B after it run as one overlapped
    pair of cost F&B, the most idle rank idles exactly that, for F&B from F + B = 3 (no
    overlap: every rank idles it) down to one backward, 2."""
    from refmp.parallel.pipeline.simulate import simulate

    for m in (2 * pp, 2 * pp + 1, 3 * pp):
        lists = [schedule("dualpipev", pp, m, r) for r in range(pp)]
        for fb in (3, 2.5, 2):
            tl = simulate(lists, pp, m, 2, "dualpipev", placed=ChunkPlacement(pp, 2, "v"), pair=fb)
            idle = [tl.makespan - tl.busy(r) for r in range(pp)]
            assert max(idle) == pytest.approx((pp - 1) * (fb + 2 - 3 * 1), abs=1e-9), (m, fb, idle)
            assert fb != 3 or idle == [2 * (pp - 1)] * pp


def test_the_chunks_sit_in_a_v_and_dualpipev_splits_only_some_backwards():
    placed = CATALOG["dualpipev"].chunk_placement(4)
    assert [placed.chunks(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    acts = schedule("dualpipev", 4, 8, 0)
    whole = {(a.mb, a.chunk) for a in acts if a.kind == "B"} - {(a.mb, a.chunk) for a in acts
                                                              if a.kind == "W"}
    assert 0 < len(whole) < 16  # the steady state's backwards are whole, the edges' split
    assert all(a.kind != "W" or (a.mb, a.chunk) not in whole for a in acts)
    # the bottom of the V: rank 1 of 2 runs chunk 1, turns, runs chunk 2 on the same rank
    assert [str(a) for a in schedule("zb-v", 2, 3, 1)][:6] == ["F0.1", "F0.2", "F1.1", "F1.2",
                                                               "B0.2", "W0.2"]


def test_schedule_json_and_the_weight_versions_of_2bw(capsys):
    import json

    from refmp.cli.main import main

    assert main(["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "zb-v", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["bubble"] == pytest.approx(got["formula"]) == pytest.approx(3 / 51)
    assert got["peak_held"] == [8] * 4 and got["weight_versions"] == [1] * 4
    # 2bw: three steps, no flush; batch t computes on W(t-1): batch 1 (micro-batches 3-5) on
    # W(0), batch 2 on W(1); batch t+1's first forward on rank 1 ends step t
    assert main(["schedule", "--pp", "2", "--microbatches", "3", "--schedule", "2bw"]) == 0
    out = capsys.readouterr().out
    assert "rank 1 | .... F0@0 B0@0 B0@0 F1@0" in out and "F3@0 .... | B3@0 B3@0 F4@0" in out
    assert "F6@1 .... | B6@1" in out
    assert "bubble 0.1000 simulated (a steady step, 10 steps), 0.1000 formula" in out
    assert main(["schedule", "--pp", "2", "--microbatches", "3", "--schedule", "2bw",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["weight_versions"] == [2, 2]
    # pipedream: 2 pp - 1 steps; stage s runs batch t on W(max(t - (pp - 1 - s), 0)): on
    # rank 0 of 3 batch 3 (micro-batches 6, 7) runs in step 1 on W(1), its backward in step 3
    assert main(["schedule", "--pp", "3", "--microbatches", "2", "--schedule", "pipedream"]) == 0
    out = capsys.readouterr().out
    assert "| F6@1 F7@1 ...." in out and "B6@1 B6@1 .... B7@1 B7@1 |" in out
    assert main(["schedule", "--pp", "3", "--microbatches", "2", "--schedule", "pipedream",
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["weight_versions"] == [3, 2, 1] and got["bubble"] == pytest.approx(0.4)


def misplaced_weight_gradients(name: str, pp: int, m: int, rank: int) -> list[str]:
    """What is wrong with where rank's W's sit: every F and B once for each micro-batch of
    its two chunks; each W after its own B, and, before the rank's last forward, right after
    it (so before its chunk's next backward: the steady state's B W pairs); the W's left for
    the flush (their B after the last forward, where ZB-V defers them to fill the drain)
    come after it too; each chunk's W's in micro-batch order; ZB-V splits every backward."""
    acts = schedule(name, pp, m, rank)
    chunks = CATALOG[name].chunk_placement(pp).chunks(rank)
    where = {tuple(a): i for i, a in enumerate(acts)}
    wrong = [f"{k}: {sorted((a.mb, a.chunk) for a in acts if a.kind == k)}" for k in "FB"
             if sorted((a.mb, a.chunk) for a in acts if a.kind == k)
             != sorted((i, c) for i in range(m) for c in chunks)]
    last_f = max(i for i, a in enumerate(acts) if a.kind == "F")
    for i, a in enumerate(acts):
        if a.kind == "W":
            b = where.get(("B", a.mb, a.chunk), len(acts))
            if b > i or (b < last_f and i != b + 1):
                wrong.append(f"{a} at {i}, its backward at {b}, the last forward at {last_f}")
    for c in chunks:
        ws = [a.mb for a in acts if a.kind == "W" and a.chunk == c]
        if ws != sorted(ws) or len(set(ws)) < len(ws):
            wrong.append(f"chunk {c}'s W's in the order {ws}")
    if name == "zb-v" and sum(a.kind == "W" for a in acts) != 2 * m:
        wrong.append(f"{sum(a.kind == 'W' for a in acts)} W's for {2 * m} backwards")
    return wrong


@pytest.mark.parametrize("name", ["zb-v", "dualpipev"])
def test_each_weight_gradient_follows_its_backward_or_fills_the_flush(name):
    wrong = {(pp, m, r): w for pp in range(1, 7) for m in range(1, 17) for r in range(pp)
             if (w := misplaced_weight_gradients(name, pp, m, r))}
    assert not wrong, wrong


def torch_orders(cls, pp: int, m: int) -> list[list[tuple]]:
    """Every rank's (kind, micro-batch, chunk) list of a torch.distributed.pipelining V
    schedule, read from the pipeline_order it computes for all ranks when built. Its stages
    stand in with the fields the order is computed from (no process group: nothing runs);
    its I (the backward for the input) is refmp's split B, a B its whole one, an overlapped
    forward-backward pair its two actions in order."""
    from types import SimpleNamespace

    import torch

    stages = [SimpleNamespace(submod=torch.nn.Identity(), num_stages=2 * pp, group_size=pp,
                              group_rank=0, stage_index=c) for c in (0, 2 * pp - 1)]
    order = cls(stages, m).pipeline_order
    kinds = {"F": "F", "I": "B", "B": "B", "W": "W"}
    return [[(kinds[x.computation_type.value], x.microbatch_index, x.stage_index)
             for a in order[r] if a is not None for x in (a.sub_actions or (a,))]
            for r in range(pp)]


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason=reason("torch", "hf"))
def test_the_v_schedules_are_pytorchs():
    """zb-v is ScheduleZBVZeroBubble's order, every (pp, m), and dualpipev ScheduleDualPipeV's
    from m = 2 pp (its least): the same actions on every rank in the same order, the same
    backwards split (a W on the list)."""
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleZBVZeroBubble

    for pp in range(1, 6):
        for name, cls, ms in (("zb-v", ScheduleZBVZeroBubble, range(1, 13)),
                              ("dualpipev", ScheduleDualPipeV, range(2 * pp, 2 * pp + 5))):
            for m in ms:
                mine = [[tuple(a) for a in schedule(name, pp, m, r)] for r in range(pp)]
                assert mine == torch_orders(cls, pp, m), (name, pp, m)
