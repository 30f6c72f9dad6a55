"""Pipeline schedules without MPI: completion, bubble formulas, memory, partition, B/W split."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refmp.cli.main import main
from refmp.errors import ConfigError
from refmp.nn import gpt
from refmp.parallel.pipeline.catalog import CATALOG, schedule
from refmp.parallel.pipeline.partition import balanced_split, check_pipeline, piece_costs
from refmp.parallel.pipeline.schedules import Action, ChunkPlacement
from refmp.parallel.pipeline.simulate import (
    Deadlock,
    bubble_formula,
    simulate,
    simulate_schedule,
)
from refmp.parallel.pipeline.timeline import Timeline

FLUSHED = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1")  # the V schedules: test_pipeline_v.py


@settings(max_examples=60)
@given(name=st.sampled_from(FLUSHED), pp=st.integers(1, 6), k=st.integers(1, 4),
       v=st.integers(1, 3))
def test_every_schedule_completes_with_the_formula_bubble(name, pp, k, v):
    v = v if name == "interleaved" else 1
    m = k * pp  # interleaved needs pp | m; ZB-H1's formula holds for m >= pp
    tl = simulate_schedule(name, pp, m, v)  # raises Deadlock if it cannot complete
    assert tl.bubble() == pytest.approx(bubble_formula(name, pp, m, v), abs=1e-12)
    busy = {"naive": 3, "gpipe": 3, "1f1b": 3, "interleaved": 3, "zb-h1": 3}[name] * m * v
    assert all(tl.busy(r) == busy for r in range(pp))


@given(name=st.sampled_from(FLUSHED), pp=st.integers(2, 4), k=st.integers(1, 3),
       scale=st.floats(0.01, 100))
def test_measured_costs_replace_the_unit_costs(name, pp, k, scale):
    """simulate(costs=...): the unit costs given explicitly reproduce the formula, and the
    bubble is a fraction, unchanged when every cost is scaled; a slower last stage (the LM
    head) makes the other ranks wait, so the bubble grows (naive runs one action at a time:
    its bubble is 1 - 1/pp whatever the costs)."""
    m, v = k * pp, 2 if name == "interleaved" else 1
    split = name == "zb-h1"
    unit = {(r, kind): {"F": 1, "B": 1 if split else 2, "W": 1}[kind]
            for r in range(pp) for kind in "FBW"}
    tl = simulate_schedule(name, pp, m, v, costs={key: scale * c for key, c in unit.items()})
    assert tl.bubble() == pytest.approx(bubble_formula(name, pp, m, v), abs=1e-9)
    slow_head = {**unit, (pp - 1, "F"): 2.0}
    slower = simulate_schedule(name, pp, m, v, costs=slow_head).bubble()
    assert slower == pytest.approx(tl.bubble()) if name == "naive" else slower > tl.bubble() + 1e-9


def test_measured_timeline_costs_and_where_the_idle_time_goes():
    from refmp.parallel.pipeline.timeline import Event, Timeline

    ev = [Event(0, "F", 0, 0, 0.0, 1.0), Event(0, "send", 0, 1, 1.0, 1.5),
          Event(0, "F", 1, 0, 1.5, 2.5), Event(0, "F", 2, 0, 3.0, 6.0),
          Event(1, "recv", 0, 1, 0.0, 1.5), Event(1, "F", 0, 1, 1.5, 3.5)]
    tl = Timeline("x", 2, 3, events=ev, unit="s")
    assert tl.costs() == {(0, "F"): 1.0, (1, "F"): 2.0}  # medians per rank and kind
    idle = tl.idle()  # of 2 ranks x 6 s: compute 5 + 2, recv 1.5, send 0.5
    assert idle["recv"] == pytest.approx(1.5 / 12) and idle["send"] == pytest.approx(0.5 / 12)
    assert sum(idle.values()) == pytest.approx(tl.bubble()) == pytest.approx(1 - 7 / 12)
    assert tl.hops() == {0: (0.5, 0.0), 1: (0.0, 1.5)}  # median send, shortest receive


@given(name=st.sampled_from(FLUSHED), pp=st.integers(2, 4), k=st.integers(1, 3),
       send=st.floats(0.0, 0.5), recv=st.floats(0.0, 0.5))
def test_messages_cost_their_ranks_outside_compute(name, pp, k, send, recv):
    """simulate(hops=...): zero hops are the free messages' timeline; costly ones leave each
    rank's compute as it was and lengthen the step. One micro-batch on 2 ranks by hand: F,
    a hop, F, B (2), a hop, B: 6 + 2 (send + recv)."""
    m, v = k * pp, 2 if name == "interleaved" else 1
    free = simulate_schedule(name, pp, m, v)
    assert simulate_schedule(name, pp, m, v, hops={r: (0.0, 0.0) for r in range(pp)}).events \
        == free.events
    tl = simulate_schedule(name, pp, m, v, hops={r: (send, recv) for r in range(pp)})
    assert all(tl.busy(r) == pytest.approx(free.busy(r)) for r in range(pp))
    assert tl.makespan >= free.makespan + (pp - 1) * (send + recv) - 1e-9
    one = simulate_schedule("1f1b", 2, 1, hops={0: (send, recv), 1: (send, recv)})
    assert one.makespan == pytest.approx(6 + 2 * (send + recv))
    with pytest.raises(ValueError, match="pairs"):
        simulate([schedule("1f1b", 2, 2, r) for r in range(2)], 2, 2, pair=1.0,
                 hops={0: (0, 0), 1: (0, 0)})


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


def megatron_interleaved(pp: int, m: int, v: int, rank: int) -> tuple[int, list, list]:
    """Megatron-core's interleaved 1F1B for one rank (schedules.py,
    forward_backward_pipelining_with_interleaving; its micro-batch group per virtual stage
    is pp): the warm-up forwards, and the (micro-batch, chunk) of each forward and backward."""
    total = m * v  # forwards on this rank: every micro-batch on each of its v chunks
    warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)

    def model_chunk_id(k: int, forward: bool) -> int:
        in_group = k % (pp * v)
        chunk = in_group // pp
        return chunk if forward else v - 1 - chunk

    def microbatch_id(k: int) -> int:
        return (k // (pp * v)) * pp + k % pp

    fwd = [(microbatch_id(k), model_chunk_id(k, True) * pp + rank) for k in range(total)]
    bwd = [(microbatch_id(k), model_chunk_id(k, False) * pp + rank) for k in range(total)]
    return warmup, fwd, bwd


@settings(max_examples=12)
@given(pp=st.integers(2, 5), k=st.integers(1, 3), v=st.integers(2, 3))
def test_interleaved_warms_up_and_holds_what_megatron_does(pp, k, v):
    """Rank r: Megatron's warm-up forwards, then forward-backward pairs, then the backwards
    owed; its peak of micro-batch chunks in flight (forwards whose backward has not run, as
    the simulator holds them) one more than its warm-up, or every forward when there is no
    steady state; each forward and backward on Megatron's micro-batch and chunk."""
    m = k * pp
    peaks = simulate_schedule("interleaved", pp, m, v).peak_held
    for r in range(pp):
        warmup, fwd, bwd = megatron_interleaved(pp, m, v, r)
        acts = schedule("interleaved", pp, m, r, v)
        kinds = "".join(a.kind for a in acts)
        assert kinds == "F" * warmup + "FB" * (m * v - warmup) + "B" * warmup, (r, kinds)
        assert peaks[r] == min(warmup + 1, m * v), (r, peaks)
        assert [(a.mb, a.chunk) for a in acts if a.kind == "F"] == fwd
        assert [(a.mb, a.chunk) for a in acts if a.kind == "B"] == bwd


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
    ((4, 2, 2, "chimera", 1, None, 4), "--schedule must be"),
])
def test_bad_pipeline_layouts_are_refused(args, msg):
    with pytest.raises(ConfigError, match=msg):
        check_pipeline(*args)


def split_vs_whole(p: dict, x, dout, ops, moe=None) -> None:
    """B (block_backward with a todo list) then W (block_backward_weight) against the
    unsplit block_backward: the same products in the same order, so bitwise equal."""
    _, cache = gpt.block_forward(p, x, ops, moe)
    dx, g = gpt.block_backward(dout, cache, ops)
    todo = []
    dx2, g2 = gpt.block_backward(dout, cache, ops, todo=todo)
    # B did not compute the deferred linears' weight gradients: W does, from todo alone
    linears = ["mlp.c_proj", "mlp.c_fc", "attn.c_proj", "attn.c_attn"][2 if moe else 0:]
    assert [name for name, _ in todo] == linears  # in backward order
    assert not any(f"{n}.{s}" in g2 for n in linears for s in ("weight", "bias"))
    g2.update(gpt.block_backward_weight(todo, ops))
    np.testing.assert_array_equal(dx2, dx)
    assert sorted(g2) == sorted(g)
    for k in g:
        np.testing.assert_array_equal(g2[k], g[k], err_msg=k)


def test_split_backward_equals_block_backward_bitwise():
    """The zero-bubble split is a mode of gpt.block_backward (serial Ops): B + W == whole."""
    cfg = gpt.GPTConfig(vocab_size=11, block_size=5, n_layer=1, n_head=2, n_embd=8)
    p = gpt.block_params(gpt.init_params(cfg, seed=3, dtype="float64"), 0)
    rng = np.random.default_rng(0)
    x, dout = rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 5, 8))
    split_vs_whole(p, x, dout, gpt.Ops(cfg.n_head))


@pytest.mark.parametrize("cf", [0.0, 0.5])
def test_split_backward_of_an_moe_block_equals_block_backward_bitwise(cf):
    """An MoE block: its MLP (router, experts, both losses) runs whole in B; only the
    attention linears wait for W. With dropping (cf 0.5) and without (0)."""
    cfg = gpt.GPTConfig(vocab_size=11, block_size=6, n_layer=1, n_head=2, n_embd=8,
                        n_expert=4, top_k=2, capacity_factor=cf, aux_loss_coef=0.1,
                        z_loss_coef=0.01)
    p = gpt.block_params(gpt.init_params(cfg, seed=4, dtype="float64"), 0)
    rng = np.random.default_rng(1)
    x, dout = rng.standard_normal((3, 6, 8)), rng.standard_normal((3, 6, 8))
    split_vs_whole(p, x, dout, gpt.Ops(cfg.n_head), cfg.moe_context(denom=3 * 6 + 5))


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
    back = Timeline.from_chrome_trace(json.loads(trace.read_text()))  # what docs/_hooks reads
    tl = simulate_schedule("1f1b", 4, 8)
    assert (back.unit, back.makespan, back.bubble()) == (tl.unit, tl.makespan, tl.bubble())
    assert sorted(back.events) == sorted(tl.events)


def test_schedule_command_refuses_bad_input(capsys):
    assert main(["schedule", "--pp", "3", "--microbatches", "4", "--schedule", "interleaved",
                 "--virtual-stages", "2"]) == 2
    assert "multiple of --pp" in capsys.readouterr().err


def test_docs_timelines_are_what_refmp_prints(capsys):
    """docs/pipeline*.md show `refmp schedule` output; it must match what refmp prints now."""
    import pathlib
    import re

    pages = sorted((pathlib.Path(__file__).parent.parent / "docs").glob("pipeline*.md"))
    blocks = [(page.name, args, shown) for page in pages for args, shown in
              re.findall(r"<!-- schedule: (.*?) -->\n```text\n(.*?)```\n", page.read_text(), re.S)]
    assert len(blocks) == 8
    for name, args, shown in blocks:
        assert main(["schedule", *args.split()]) == 0
        assert capsys.readouterr().out == shown, f"docs/{name} drifted for {args}"


@pytest.mark.parametrize("zero, n_expert", [(0, 0), (3, 0), (2, 2)])
def test_stage_chunks_in_sequence_equal_the_serial_model(zero, n_expert):
    """Layer level, no MPI: one Stage holding chunks 0..2 of a 3-block GPT (serial Ops, a
    Sharder over one rank), run chunk after chunk (split backward on one micro-batch, whole
    on the other), gives the GPT's loss and gradients. ZeRO-3 detaches the weights from the
    caches and attaches them again for the backward; an MoE model adds its aux losses."""
    from mpi4py import MPI

    from refmp.distributed.comm import Comm
    from refmp.distributed.ledger import Ledger
    from refmp.parallel.data.sharder import Sharder
    from refmp.parallel.pipeline.stage import Stage
    from refmp.parallel.placement import units_of

    cfg = gpt.GPTConfig(vocab_size=7, block_size=4, n_layer=3, n_head=2, n_embd=4,
                        n_expert=n_expert, top_k=1, capacity_factor=1.0, aux_loss_coef=0.1)
    model = gpt.GPT.create(cfg, seed=1, dtype="float64")
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 7, (3, 4)), rng.integers(0, 7, (3, 4))
    loss, cache = model.forward(x, y, denom=12)
    model.backward(cache)
    units = units_of(model.params)
    one = Comm(MPI.COMM_SELF, "dp", Ledger())
    sharder = Sharder(model.params, units, {u: one for u in units}, zero, bucket_mb=0)
    moe = (lambda denom: cfg.moe_context(denom)) if n_expert else None
    stage = Stage({0: range(0, 1), 1: range(1, 3), 2: range(3, 3)}, 3, cfg,
                  gpt.Ops(cfg.n_head), sharder, moe)
    assert stage.act_shape(2, 4) == (2, 4, 4)
    sharder.zero_grad()
    total = 0.0
    for rows, split in ((slice(0, 2), True), (slice(2, 3), False)):  # two micro-batches
        final = rows.stop == 3
        h, caches = x[rows], []
        for c in range(3):
            h, cc = stage.forward(c, h, y[rows], 12)
            caches.append(cc)
        total += float(h)
        dx, todos = None, []
        for c in reversed(range(3)):
            dx, todo = stage.backward(c, dx, caches[c], split, final)
            assert (dx is None) == (c == 0)
            assert bool(todo) == (split and c < 2)  # chunk 2: the head only, no W
            todos.append(todo)
        for todo in todos if split else []:  # the deferred W passes
            stage.weight(todo, final)
    sharder.finish()
    np.testing.assert_allclose(total + stage.aux, float(loss), rtol=1e-12)
    assert (stage.aux > 0) == bool(n_expert)
    grads = sharder.full_local(grads=True)
    assert sorted(grads) == sorted(model.grads)
    for k, g in model.grads.items():
        np.testing.assert_allclose(grads[k], g, rtol=1e-10, atol=1e-14, err_msg=k)


@settings(max_examples=40)
@given(pp=st.integers(1, 6), m=st.integers(1, 12), steps=st.integers(1, 4))
def test_2bw_runs_complete_and_each_step_is_a_consistent_cut(pp, m, steps):
    """simulate_steps: steps of pipedream.two_bw with their boundaries complete (no deadlock);
    step t runs only batches t and t+1 (no forward of t+2, whose weights its update makes;
    a send that crosses a boundary is received in the next step) and every backward of
    batch t; the peaks are 1F1B's; a one-step run is 1F1B."""
    from bisect import bisect_right

    from refmp.parallel.pipeline.pipedream import two_bw
    from refmp.parallel.pipeline.simulate import simulate_steps

    tl = simulate_steps("2bw", pp, m, steps)
    assert len(tl.barriers) == steps - 1
    for e in tl.events:
        s = bisect_right(tl.barriers, e.start)  # the step the action runs in
        assert s <= e.mb // m <= s + 1, e
    for t in range(steps - 1):
        assert max(e.end for e in tl.events if e.kind == "B" and e.mb // m == t) <= tl.barriers[t]
    assert all(min(pp - s, m) <= tl.peak_held[s] <= min(pp - s, m + 1) for s in range(pp))
    for r in range(pp):
        assert two_bw(pp, m, r, fill=True, ahead=False) == schedule("1f1b", pp, m, r)


@pytest.mark.parametrize("pp", [2, 3, 4, 6])
def test_2bw_steady_step_leaves_one_idle_step_whatever_pp(pp):
    """Where no step boundary is capped (m large enough), a steady 2bw step leaves every rank
    one idle unit (rank 1's backward that does not fit before the boundary), where 1F1B
    leaves 3(pp - 1): bubble 1/(3m+1), the formula; the later stages run backwards of the
    next batch before the boundary (pp >= 3); pp 1 has no bubble."""
    from refmp.parallel.pipeline.pipedream import lead, two_bw

    checked = 0
    for m in range(1, 13):
        if any(lead(pp, m, r) < 2 * r // 3 * 2 + (2 * r % 3 >= 1) for r in range(pp)):
            continue  # capped: no forward of batch t+2 may enter step t
        checked += 1
        tl = simulate_schedule("2bw", pp, m)
        assert tl.bubble() == pytest.approx(bubble_formula("2bw", pp, m), abs=1e-12)
        assert all(tl.makespan - tl.busy(r) == 1 for r in range(pp))
        ahead_b = [a for a in two_bw(pp, m, pp - 1) if a.kind == "B" and a.mb >= m]
        assert bool(ahead_b) == (pp >= 3)
    assert checked >= 12 - 2 * pp
    assert simulate_schedule("2bw", 1, 4).bubble() == 0 == bubble_formula("2bw", 1, 4)


@settings(max_examples=30)
@given(pp=st.integers(1, 5), m=st.integers(1, 8), steps=st.integers(1, 9))
def test_pipedream_runs_complete_and_follow_the_version_rule(pp, m, steps):
    """simulate_steps("pipedream"): no deadlock; in step t stage s runs the backwards of batch
    t only and the forwards of batch t + pp - 1 - s (step 0 also those before it), so its
    forward of batch t runs in step max(t - (pp - 1 - s), 0), on the current weights, the
    version the rule names and the labels show; a steady step's bubble is the formula's."""
    from bisect import bisect_right

    from refmp.parallel.pipeline.pipedream import pipedream_version
    from refmp.parallel.pipeline.simulate import simulate_steps

    tl = simulate_steps("pipedream", pp, m, steps)
    for e in tl.events:
        step, batch, d = bisect_right(tl.barriers, e.start), e.mb // m, pp - 1 - e.rank
        assert batch == step if e.kind == "B" else batch == step + d or step == 0 and batch < d
        assert tl.versions[e.rank, e.mb] == pipedream_version(pp, e.rank, batch)
        assert e.kind == "B" or tl.versions[e.rank, e.mb] == step  # a forward: the current W
    assert all(tl.peak_held[s] <= m * (pp - s) for s in range(pp))
    steady = simulate_schedule("pipedream", pp, m)
    assert steady.bubble() == pytest.approx(bubble_formula("pipedream", pp, m), abs=1e-12)


def test_async_schedules_refuse_resume_and_say_why():
    """2bw and pipedream carry state across each step that a checkpoint does not hold;
    pipedream refuses MoE too (later batches' MoE losses would land in the wrong step)."""
    from refmp.parallel.rules import check_layout
    from refmp.training.trainer import TrainConfig

    mcfg = gpt.GPTConfig(vocab_size=7, block_size=4, n_layer=2, n_head=2, n_embd=4)
    for name, why in [("2bw", "carries the next batch's activations"),
                      ("pipedream", "carries the forwards of up to pp - 1 later batches")]:
        cfg = TrainConfig(pp=2, microbatches=2, batch_size=4, schedule=name, resume="ckpt")
        with pytest.raises(ConfigError, match=why):
            check_layout(cfg, mcfg, 2)
    moe = gpt.GPTConfig(vocab_size=7, block_size=4, n_layer=2, n_head=2, n_embd=4, n_expert=2)
    cfg = TrainConfig(pp=2, microbatches=2, batch_size=4, schedule="pipedream")
    with pytest.raises(ConfigError, match="MoE losses"):
        check_layout(cfg, moe, 2)
    # no bound from the tags, whatever the micro-batches and batches in flight
    for name in ("1f1b", "pipedream"):
        check_pipeline(64, 64, 4096, name, 1, None, 4096)


def message_streams(lists: list[list[Action]], placed: ChunkPlacement) -> tuple[dict, dict]:
    """The executor's messages for these action lists, per (sender, receiver, tag): each
    message's (direction, micro-batch, receiving chunk), once in the order the sender sends
    them, once in the order the receiver posts its receives (one at a time, in list order)."""
    from refmp.parallel.pipeline.executor import tag

    chunks = placed.pp * placed.v
    sends: dict = {}
    recvs: dict = {}
    for r, acts in enumerate(lists):
        for a in acts:
            grad = a.kind == "B"
            if a.kind == "U" or a.kind == "W":
                continue
            to = a.chunk - 1 if grad else a.chunk + 1  # the chunk this action sends to
            frm = a.chunk + 1 if grad else a.chunk - 1  # and the one it receives from
            if 0 <= to < chunks:  # send_forward / send_backward
                key = (r, placed.rank(to), tag(to, grad))
                sends.setdefault(key, []).append((a.kind, a.mb, to))
            if 0 <= frm < chunks:  # recv_forward / recv_backward
                key = (placed.rank(frm), r, tag(a.chunk, grad))
                recvs.setdefault(key, []).append((a.kind, a.mb, a.chunk))
    return sends, recvs


def test_each_message_stream_is_received_in_the_order_it_is_sent():
    """The executor's tags (receiving chunk, direction) are safe for every schedule: MPI
    matches the k-th receive of a (sender, receiver, tag) with its k-th send, and that is the
    message the receiver wants; across the steps of the asynchronous schedules too."""
    from refmp.parallel.pipeline.catalog import run_of_steps

    for name, sched in CATALOG.items():
        for pp in (1, 2, 3, 4):
            for m in (1, 2, 3, 4, 5, 8, 12):
                for v in ((1, 2, 3) if name == "interleaved" else (1,)):
                    if name == "interleaved" and m % pp:
                        continue
                    if not sched.flushes:
                        lists = [run_of_steps(name, pp, m, r, 2 * pp + 1) for r in range(pp)]
                    else:
                        lists = [schedule(name, pp, m, r, v) for r in range(pp)]
                    sends, recvs = message_streams(lists, sched.chunk_placement(pp, v))
                    assert sends == recvs, (name, pp, m, v)


def test_the_catalog_is_the_one_list_of_schedules():
    """Every schedule is named once, in refmp.parallel.pipeline.catalog: --schedule's choices
    (refmp.config's, so refmp train's and bench's) and refmp schedule's are its names, the
    planner searches flush schedules of it, the asynchronous executors are its schedules
    without a flush; and its answers are each schedule's own (chunks and their placement,
    the batches a step runs ahead, the weight versions)."""
    import argparse
    from dataclasses import fields

    from refmp.cli.schedule import add_parser
    from refmp.config import ParallelConfig
    from refmp.parallel.pipeline.asynchronous import ASYNC_EXECUTORS
    from refmp.parallel.pipeline.catalog import NAMES

    meta = next(f for f in fields(ParallelConfig) if f.name == "schedule").metadata
    assert meta["choices"] == NAMES
    assert set(meta["plan"]["choices"]) <= {n for n in NAMES if CATALOG[n].flushes}
    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    cli = next(a for a in sub.choices["schedule"]._actions if a.dest == "schedule")
    assert tuple(cli.choices) == NAMES
    assert set(ASYNC_EXECUTORS) == {n for n in NAMES if not CATALOG[n].flushes}
    pp = 4
    assert {n: CATALOG[n].ahead(pp) for n in NAMES if CATALOG[n].ahead(pp)} == {"2bw": 1, "pipedream": 3}
    assert {n: CATALOG[n].chunks_per_rank(3) for n in NAMES if CATALOG[n].chunks_per_rank(3) > 1} \
        == {"interleaved": 3, "zb-v": 2, "dualpipev": 2}
    assert [CATALOG["zb-v"].chunk_placement(pp).rank(c) for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [CATALOG["interleaved"].chunk_placement(pp, 2).rank(c) for c in range(8)] == [0, 1, 2, 3] * 2
    assert [CATALOG["pipedream"].versions(pp, r) for r in range(pp)] == [4, 3, 2, 1]
    assert {CATALOG[n].versions(pp, 0) for n in NAMES if CATALOG[n].flushes} == {1}
