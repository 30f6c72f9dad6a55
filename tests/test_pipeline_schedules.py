"""Pipeline schedules without MPI: completion, bubble formulas, memory, partition, B/W split."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refmp.cli import main
from refmp.errors import ConfigError
from refmp.nn import gpt
from refmp.parallel.pipeline.partition import balanced_split, check_pipeline, piece_costs
from refmp.parallel.pipeline.schedules import SCHEDULES, Action, schedule
from refmp.parallel.pipeline.simulate import (
    Deadlock,
    bubble_formula,
    simulate,
    simulate_schedule,
)


@settings(max_examples=60)
@given(name=st.sampled_from(SCHEDULES), pp=st.integers(1, 6), k=st.integers(1, 4),
       v=st.integers(1, 3))
def test_every_schedule_completes_with_the_formula_bubble(name, pp, k, v):
    v = v if name == "interleaved" else 1
    m = k * pp  # interleaved needs pp | m; ZB-H1's formula holds for m >= pp
    tl = simulate_schedule(name, pp, m, v)  # raises Deadlock if it cannot complete
    assert tl.bubble() == pytest.approx(bubble_formula(name, pp, m, v), abs=1e-12)
    busy = {"naive": 3, "gpipe": 3, "1f1b": 3, "interleaved": 3, "zb-h1": 3}[name] * m * v
    assert all(tl.busy(r) == busy for r in range(pp))


@given(name=st.sampled_from(["naive", "gpipe", "1f1b", "zb-h1"]), pp=st.integers(1, 6),
       m=st.integers(1, 12))
def test_small_and_uneven_micro_batch_counts_complete(name, pp, m):
    tl = simulate_schedule(name, pp, m)
    if name in ("gpipe", "1f1b"):  # exact for every m
        assert tl.bubble() == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)


@given(pp=st.integers(1, 6), m=st.integers(1, 12))
def test_memory_gpipe_holds_m_and_1f1b_at_most_pp_minus_stage(pp, m):
    assert simulate_schedule("gpipe", pp, m).peak_held == [m] * pp
    peaks = simulate_schedule("1f1b", pp, m).peak_held
    assert all(peaks[s] == min(pp - s, m) for s in range(pp)), peaks
    assert max(simulate_schedule("zb-h1", pp, m).peak_held) <= min(pp, m)
    assert simulate_schedule("naive", pp, m).peak_held == [1] * pp


def test_1f1b_phases_for_4_stages():
    """Rank 0 of 4: three warm-up forwards, then F/B pairs, then the owed backwards."""
    acts = [str(a) for a in schedule("1f1b", 4, 6, 0)]
    assert acts == ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2", "B3", "B4", "B5"]


def test_a_schedule_that_waits_on_itself_is_reported_as_deadlock():
    # rank 0 wants B0 before it ran F1; rank 1 runs F1 first: rank 0 waits for B1 from rank 1,
    # which waits for F1 from rank 0.
    lists = [[Action("F", 0, 0), Action("B", 1, 0), Action("F", 1, 0), Action("B", 0, 0)],
             [Action("F", 1, 1), Action("B", 1, 1), Action("F", 0, 1), Action("B", 0, 1)]]
    with pytest.raises(Deadlock, match="rank 0 at B1"):
        simulate(lists, 2, 2)
    with pytest.raises(ValueError, match="exactly once"):
        simulate([[Action("F", 0, 0)], [Action("F", 0, 1), Action("B", 0, 1)]], 2, 1)


def test_partition_puts_the_head_cost_on_the_last_stage():
    costs = piece_costs(n_embd=16, block_size=8, vocab_size=50000)  # a huge head
    assert balanced_split(4, 2, costs) == [3, 1]
    costs = piece_costs(n_embd=64, block_size=8, vocab_size=2)  # a negligible head
    assert balanced_split(4, 2, costs) == [2, 2]
    assert balanced_split(5, 5, costs) == [1] * 5


@pytest.mark.parametrize("args, msg", [
    ((1, 2, 2, "1f1b", 1, None, 4), "only 1 layers"),
    ((4, 2, 3, "interleaved", 2, None, 8), "multiple of --pp"),
    ((2, 2, 2, "1f1b", 1, [2, 1], 4), "adds up to 3"),
    ((3, 2, 2, "1f1b", 1, [1, 1, 1], 4), "expected 2"),
    ((2, 2, 4, "1f1b", 1, None, 2), "cannot make 4 micro-batches"),
    ((4, 2, 2, "1f1b", 2, None, 4), "needs --schedule interleaved"),
    ((4, 2, 2, "pipedream", 1, None, 4), "--schedule must be"),
])
def test_bad_pipeline_layouts_are_refused(args, msg):
    with pytest.raises(ConfigError, match=msg):
        check_pipeline(*args)


def test_split_backward_equals_block_backward():
    """B (input gradient) then W (weight gradients) give exactly what block_backward gives."""
    cfg = gpt.GPTConfig(vocab_size=11, block_size=5, n_layer=1, n_head=2, n_embd=8)
    p = gpt.block_params(gpt.init_params(cfg, seed=3, dtype="float64"), 0)
    rng = np.random.default_rng(0)
    x, dout = rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 5, 8))
    _, cache = gpt.block_forward(p, x, cfg.n_head)
    dx, g = gpt.block_backward(dout, cache)
    dx2, g2, todo = gpt.block_backward_input(dout, cache)
    g2.update(gpt.block_backward_weight(todo))
    np.testing.assert_array_equal(dx2, dx)
    assert sorted(g2) == sorted(g)
    for k in g:
        np.testing.assert_allclose(g2[k], g[k], rtol=1e-13, atol=1e-15, err_msg=k)


def test_schedule_command_prints_timeline_and_writes_files(tmp_path, capsys):
    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    assert main(["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b",
                 "--png", str(png), "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "rank 3 | .. .. .. F0 B0 B0 F1" in out
    assert "bubble 0.2727 simulated, 0.2727 formula" in out
    assert "peak micro-batches held per rank: 4, 3, 2, 1" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e.get("cat") == "F" for e in events) == 4 * 8


def test_schedule_command_refuses_bad_input(capsys):
    assert main(["schedule", "--pp", "3", "--microbatches", "4", "--schedule", "interleaved",
                 "--virtual-stages", "2"]) == 2
    assert "multiple of --pp" in capsys.readouterr().err


def test_docs_timelines_are_what_refmp_prints(capsys):
    """docs/pipeline.md shows `refmp schedule` output; it must match what refmp prints now."""
    import pathlib
    import re

    page = (pathlib.Path(__file__).parent.parent / "docs" / "pipeline.md").read_text()
    blocks = re.findall(r"<!-- schedule: (.*?) -->\n```text\n(.*?)```\n", page, re.S)
    assert len(blocks) == 4
    for args, shown in blocks:
        assert main(["schedule", *args.split()]) == 0
        assert capsys.readouterr().out == shown, f"docs/pipeline.md drifted for {args}"


def test_stage_chunks_in_sequence_equal_the_serial_model():
    """Layer level, no MPI: one Stage holding chunks 0..2 of a 3-block GPT, run chunk after
    chunk (split backward on one micro-batch, whole on the other), gives the GPT's loss and
    gradients."""
    from refmp.parallel.pipeline.stage import Stage

    cfg = gpt.GPTConfig(vocab_size=7, block_size=4, n_layer=3, n_head=2, n_embd=4)
    model = gpt.GPT.create(cfg, seed=1, dtype="float64")
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 7, (3, 4)), rng.integers(0, 7, (3, 4))
    loss, cache = model.forward(x, y, denom=12)
    model.backward(cache)
    stage = Stage(model.params, {0: range(0, 1), 1: range(1, 3), 2: range(3, 3)}, 3, 2)
    total = 0.0
    for rows, split in ((slice(0, 2), True), (slice(2, 3), False)):  # two micro-batches
        h, caches = x[rows], []
        for c in range(3):
            h, cc = stage.forward(c, h, y[rows], 12)
            caches.append(cc)
        total += float(h)
        dx, todos = None, []
        for c in reversed(range(3)):
            dx, todo = stage.backward(c, dx, caches[c], split)
            todos.append(todo)
        for todo in todos if split else []:  # the deferred W passes
            stage.weight(todo)
    np.testing.assert_allclose(total, float(loss), rtol=1e-12)
    for k, g in model.grads.items():
        np.testing.assert_allclose(stage.grads[k], g, rtol=1e-10, atol=1e-14, err_msg=k)
