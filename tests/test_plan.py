"""`refmp plan`: its memory per rank is the measured ledger's, exactly; its search keeps the
fixed choices, explains what it leaves out, and prints one table or the --json shape."""

import itertools
import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_helpers import REPO, Mismatches, collective, mpiexec

from refmp.cli import calibrate as calib_cli
from refmp.cli import plan as plan_cli
from refmp.cost import model, nodes, terms
from refmp.cost import search as plan_search
from refmp.cost.machines import MACHINES
from refmp.cost.memory import memory, stage_memory, total
from refmp.cost.model import Layout, train_config
from refmp.distributed.grid import ProcessGrid
from refmp.nn.params import GPTConfig
from refmp.runtime import cpu
from refmp.training.trainer import Trainer

pytestmark = pytest.mark.cli

SMALL = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=13)
STATE = ("params", "grads", "optimizer", "activations")


def trained(lay: Layout, batch: int, grid=None, dtype: str = "float32", **kw) -> Trainer:
    """One step of this layout, on the addition task (the plan's TrainConfig, as it runs)."""
    mcfg = replace(SMALL, **kw)
    cfg = replace(train_config(lay, mcfg, batch, dtype, stage_layers=False), steps=2,
                  progress=False)
    tr = Trainer(cfg, grid=grid)
    tr.step()
    return tr


@settings(max_examples=8)
@given(recompute=st.sampled_from(["none", "selective", "full"]),
       mp=st.sampled_from(["none", "bf16", "fp16"]), b=st.sampled_from([1, 2, 4]),
       dtype=st.sampled_from(["float32", "float64"]))
def test_memory_is_the_measured_ledger_on_one_rank(recompute, mp, b, dtype):
    """params, grads, optimizer and activations: the plan's figure is Trainer.memory()."""
    lay = Layout(recompute=recompute, mixed_precision=mp, microbatch_size=b)
    tr = trained(lay, 4, ProcessGrid(MPI.COMM_SELF), dtype)
    got, want = tr.memory(), memory(lay, tr.mcfg, 4, dtype)
    assert {k: want[k] for k in STATE} == {k: got[k] for k in STATE}


def four_rank_example(grid, zero, recompute, mp, sp, b, interleaved, algo) -> tuple:
    """(Layout, global batch, the model's shape over SMALL) of one example of the four-rank
    test below: SP only with tp, interleaving two chunks only with pp, Ulysses only where
    the heads divide, and a batch that interleaving's micro-batches can fill."""
    tp, pp, dp, cp = grid
    v = 2 if interleaved and pp > 1 else 1
    lay = Layout(tp=tp, pp=pp, dp=dp, cp=cp, zero=zero, sequence_parallel=sp and tp > 1,
                 recompute=recompute, mixed_precision=mp, microbatch_size=b,
                 schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v,
                 cp_algo=algo if cp > 1 and max(2, tp) // tp % cp == 0 else "ring")
    batch = dp * b * (pp if v > 1 else 1)  # interleaving needs the micro-batches in pp's
    shape = {"n_layer": pp * v if pp * v > 2 else 2, "block_size": 16,
             "n_head": max(2, tp)}  # whole heads on each tp rank
    return lay, batch, shape


GRIDS = [(tp, pp, dp, cp) for tp in (1, 2, 4) for pp in (1, 2, 4) for dp in (1, 2, 4)
         for cp in (1, 2) if tp * pp * dp * cp == 4]


@pytest.mark.parallel(nprocs=4)
@settings(max_examples=4, phases=[Phase.explicit, Phase.generate])  # no shrinking under MPI
@given(grid=st.sampled_from(GRIDS), zero=st.sampled_from([0, 1, 2, 3]),
       recompute=st.sampled_from(["none", "selective", "full"]),
       mp=st.sampled_from(["none", "bf16"]), sp=st.booleans(), b=st.sampled_from([1, 2]),
       interleaved=st.booleans(), algo=st.sampled_from(["ring", "ulysses"]))
@example(grid=(2, 2, 1, 1), zero=1, recompute="full", mp="none", sp=False, b=1,
         interleaved=False, algo="ring")  # tp x pp
@example(grid=(1, 2, 2, 1), zero=3, recompute="none", mp="bf16", sp=False, b=1,
         interleaved=True, algo="ring")  # ZeRO-3 inside an interleaved pipeline, in bf16
@example(grid=(1, 2, 1, 2), zero=0, recompute="none", mp="none", sp=False, b=1,
         interleaved=True, algo="ring")  # interleaved with cp: one positions array per rank
@example(grid=(2, 1, 1, 2), zero=0, recompute="selective", mp="none", sp=True, b=1,
         interleaved=False, algo="ring")  # ring with tp, one head per rank: y is the output
@example(grid=(1, 4, 1, 1), zero=0, recompute="none", mp="bf16", sp=False, b=2,
         interleaved=True, algo="ring")  # middle stages: boundaries only, no tied swap
@collective
def test_memory_is_the_measured_ledger_on_four_ranks(grid, zero, recompute, mp, sp, b,
                                                    interleaved, algo):
    """Every rank's ledger is its stage's prediction, and the plan's figure is the largest.

    Two corners the estimate counts exactly: with cp the embedding's positions are one array
    every micro-batch shares (interleaving keeps two in flight), and with one head per rank
    ring attention's output is a view of its running output y."""
    tp, pp, dp, cp = grid
    lay, batch, shape = four_rank_example(grid, zero, recompute, mp, sp, b, interleaved, algo)
    v = lay.virtual_stages
    tr = trained(lay, batch, **shape)
    mcfg, sizes, r = tr.mcfg, tr.grid.sizes, tr.grid.coords["pp"]
    got = tr.memory()
    predicted = stage_memory(train_config(lay, mcfg, batch), mcfg, sizes, r)
    bad = Mismatches()
    bad.check(np.testing.assert_equal, [predicted[k] for k in STATE], [got[k] for k in STATE],
              err_msg=f"{lay} rank {tr.grid.rank}")
    # the cp traffic the plan times is the ledger's (ring sends, or Ulysses' all-to-alls)
    Ls = sum(len(ch) for ch in tr.runner.stage.chunks.values())
    op, nbytes, calls = model.cp_ledger(lay, batch // dp, 16 // cp, mcfg.n_embd, Ls,
                                        batch // (dp * b), 2 if mp != "none" else 4)
    led = tr.grid.ledger.entries.get((op, "cp"), [0, 0])
    bad.check(np.testing.assert_equal, list(led), [nbytes, calls],
              err_msg=f"{lay} rank {tr.grid.rank}: cp ledger")
    if pp > 1:  # the tied wte's swap between the two ends: one send beside the boundaries'
        c, M = (2 if mp != "none" else 4), batch // (dp * b)
        msg = b * (16 // cp // (tp if lay.sequence_parallel else 1)) * mcfg.n_embd * c
        sent, count = tr.grid.ledger.entries[("send", "pp")]
        pp_bytes = model.predict(lay, mcfg, batch, MACHINE)["bytes"][r]["pp"]["send"]
        plan_tied = pp_bytes - 2 * v * M * b * (16 // cp) * mcfg.n_embd * c
        swaps = r in (0, pp - 1)  # a middle stage sends its boundaries only
        bad.check(np.testing.assert_equal, sent - (count - swaps) * msg, plan_tied,
                  err_msg=f"{lay} rank {tr.grid.rank}: the tied wte's swap")
    most = max(MPI.COMM_WORLD.allgather(sum(got[k] for k in STATE)))
    bad.check(np.testing.assert_equal, total(memory(lay, mcfg, batch)), most,
              err_msg=f"{lay}: the plan's max over ranks")
    # and each term's seconds are those bytes over its link, on every stage
    bad.check(np.testing.assert_equal, [w for G in (1, 2, 4) for w in mispriced(lay, mcfg,
                                                                                 batch, G)],
              [], err_msg=f"{lay}: terms whose seconds are not their bytes")
    bad.assert_none()


MACHINE = MACHINES["dgx-a100"]
GPT2 = GPTConfig(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, block_size=1024)

# the part of its ledger bytes a collective of n ranks puts on a rank's link (the ledger
# counts a collective's buffer once): a ring all-reduce 2 (n-1)/n, a reduce-scatter,
# all-gather or all-to-all (n-1)/n, a send all of it
SHARE = {"allreduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
         "allgather": lambda n: (n - 1) / n, "alltoall": lambda n: (n - 1) / n,
         "send": lambda n: 1.0}


def mispriced(lay: Layout, mcfg: GPTConfig, batch: int, G: int) -> list[str]:
    """Every pipeline stage's communication terms held to its own bytes (predict's
    ``bytes``) on its own link, on MACHINE with G ranks a node, no latency and nothing
    overlapped: a term's seconds are each collective's share of its bytes (SHARE) over the
    bandwidth of its group's link, inside a node while the group fits one (ranks tp fastest,
    then cp, dp, pp). A pipeline's sends: the boundaries between neighbouring stages
    (2 v M b Tl C c a step; the two stages span 2 tp cp dp ranks) and, on the two end
    stages, the rest, the tied wte's swap across the whole pipeline. The terms that
    differ, as text."""
    mach = replace(MACHINE, gpus_per_node=G, intra_latency_us=0.0, inter_latency_us=0.0,
                   overlaps_p2p=False)
    pred = model.predict(lay, mcfg, batch, mach, model.Impl(dp_overlap=False))
    tp, pp, dp, cp, ep = lay.tp, lay.pp, lay.dp, lay.cp, lay.ep
    b, c = lay.microbatch_size, 2 if lay.mixed_precision != "none" else 4
    M = batch // (dp * b)

    def bw(ranks: int) -> float:  # bytes/s of the link of a group spanning ``ranks`` ranks
        return 1e9 * (mach.intra_node_gbs if ranks <= G else mach.inter_node_gbs)

    groups = {"tp": (tp, tp), "cp": (cp, tp * cp), "ep": (ep, tp * ep),
              "dp": (dp * cp, tp * cp * dp)}  # axis: (ranks in a group, ranks it spans)
    boundary = 2 * lay.virtual_stages * M * b * (mcfg.block_size // cp) * mcfg.n_embd * c
    boundary *= pp > 1
    wrong = []
    for r, (moved, secs) in enumerate(zip(pred["bytes"], pred["stages"], strict=True)):
        want = {axis: sum(SHARE[op](n) * x for op, x in moved[axis].items()) / bw(span)
                for axis, (n, span) in groups.items()}
        tied = moved["pp"]["send"] - boundary
        if tied < 0 or (tied > 0) != (pp > 1 and r in (0, pp - 1)):
            wrong.append(f"G {G} stage {r}: pp's {moved['pp']['send']} bytes are not "
                         f"{boundary} of boundaries and a tied swap on the end stages")
        want["pp"] = boundary / bw(2 * tp * cp * dp) + tied / bw(pp * tp * cp * dp)
        wrong += [f"G {G} stage {r}: {k} {secs[k]!r} s, its bytes {moved[k]} take {w!r} s"
                  for k, w in want.items() if secs[k] != pytest.approx(w, rel=1e-12, abs=0)]
    return wrong


@pytest.mark.parametrize("G", [1, 2, 4])
def test_each_stage_s_terms_are_its_bytes_over_its_link(G):
    """Every stage of the four-rank test's layouts (all its grids, ZeRO stages, cp
    algorithms and interleaving, the other options in turn), of an MoE model over ep and
    of the compressed dp sums: each communication term's seconds are its own bytes over its
    own link (mispriced), so a term cannot drift from the bytes the ledger holds it to."""
    cases = []
    other = itertools.cycle(itertools.product(["none", "selective", "full"], ["none", "bf16"],
                                              [False, True], [1, 2]))
    for grid, zero, interleaved, algo in itertools.product(GRIDS, [0, 1, 2, 3], [False, True],
                                                           ["ring", "ulysses"]):
        recompute, mp, sp, b = next(other)
        lay, batch, shape = four_rank_example(grid, zero, recompute, mp, sp, b, interleaved,
                                              algo)
        cases.append((lay, replace(SMALL, **shape), batch))
    moe = replace(SMALL, n_layer=4, block_size=16, n_expert=4, top_k=2, moe_every=2)
    cases += [(Layout(tp=tp, pp=pp, dp=dp, ep=ep), moe, 2 * dp)
              for tp, pp, dp, ep in [(1, 1, 4, 4), (1, 2, 2, 2), (2, 2, 1, 1), (2, 1, 2, 2)]]
    cases += [(Layout(pp=2, dp=2, grad_compress=codec), replace(SMALL, block_size=16), 4)
              for codec in ("bf16", "powersgd", "topk")]
    for lay, mcfg, batch in cases:
        wrong = mispriced(lay, mcfg, batch, G)
        assert not wrong, "\n".join([str(lay), *wrong])


def test_search_keeps_fixed_choices_and_ranks_by_step_time():
    fits, _ = plan_search.search(GPT2, 512, 64, MACHINE, {"tp": 2, "recompute": "full"}, top=5)
    assert len(fits) == 5
    assert all(r["tp"] == 2 and r["recompute"] == "full" for r in fits)
    assert all(r["tp"] * r["pp"] * r["dp"] * r["cp"] == 64 for r in fits)
    times = [r["step_seconds"] for r in fits]
    assert times == sorted(times)
    for r in fits:  # the figures agree with each other
        assert r["tokens_per_s"] == pytest.approx(512 * 1024 / r["step_seconds"])
        assert 0 < r["mfu"] < 1 and r["tflops_per_gpu"] > r["mfu"] * MACHINE.peak_tflops
        assert sum(r["memory_bytes"].values()) <= MACHINE.gpu_memory_gb * 1e9


def test_selective_is_priced_as_none_where_it_runs_the_same_code():
    """refmp's attention (refmp.nn.flash, the ring) keeps no (T, T) square and makes its
    probabilities again in every backward: --recompute selective runs what none runs, so
    every term, the hardware FLOPs and the memory are none's, and the search does not offer
    it as a choice of its own (it does when fixed). An attention that keeps the softmax
    (Megatron 2021's) pays selective's q k^T and softmax again, and is offered both."""
    base = Layout(tp=2, dp=4, mixed_precision="bf16", microbatch_size=2)
    lays = {rc: replace(base, recompute=rc) for rc in ("none", "selective", "full")}
    refmp = {rc: model.predict(lay, GPT2, 64, MACHINE) for rc, lay in lays.items()}
    assert refmp["selective"]["seconds"] == refmp["none"]["seconds"]
    assert refmp["selective"]["tflops_per_gpu"] == refmp["none"]["tflops_per_gpu"]
    assert memory(lays["selective"], GPT2, 64) == memory(lays["none"], GPT2, 64)
    meg = {rc: model.predict(lay, GPT2, 64, MACHINE, model.MEGATRON_2021)
           for rc, lay in lays.items()}
    # none's compute is the model's three passes; rescoring adds one q k^T product a block:
    # M = 64 / (dp b) = 8 micro-batches of 12 blocks, b NH / tp = 12 heads' (T, HS) @ (HS, T)
    qk = 8 * 12 * terms.gemm(1024, 64, 1024, MACHINE, 2, 12)
    assert meg["selective"]["seconds"]["compute"] == pytest.approx(
        meg["none"]["seconds"]["compute"] + qk)
    assert refmp["none"]["seconds"]["compute"] == pytest.approx(
        meg["selective"]["seconds"]["compute"])
    assert refmp["full"]["seconds"]["compute"] == pytest.approx(
        meg["full"]["seconds"]["compute"] + qk)  # full's forward again, then the backward's
    few = {"tp": 1, "pp": 1, "zero": 0}  # dp 8: the recomputations by micro-batch size
    fits, _ = plan_search.search(GPT2, 64, 8, MACHINE, few, top=20)
    assert {r["recompute"] for r in fits} == {"none", "full"}
    fits, _ = plan_search.search(GPT2, 64, 8, MACHINE, few, top=20, impl=model.MEGATRON_2021)
    assert {r["recompute"] for r in fits} == {"none", "selective", "full"}
    fits, _ = plan_search.search(GPT2, 64, 8, MACHINE, {**few, "recompute": "selective"}, top=3)
    assert fits and all(r["recompute"] == "selective" for r in fits)


def test_infeasible_layouts_say_what_does_not_fit():
    """GPT-3 on one node without ZeRO: 16 bytes per parameter cannot fit 8 x 80 GB."""
    big = GPTConfig(n_layer=96, n_embd=12288, n_head=96, vocab_size=50257, block_size=2048)
    fits, bad = plan_search.search(big, 8, 8, MACHINE, {"zero": 0, "pp": 8, "tp": 1}, top=3)
    assert fits == [] and bad
    timed = [r for r in bad if "step_seconds" in r]  # valid layouts, timed, not fitting
    assert timed and all("needs" in r["reason"] and "optimizer" in r["reason"] for r in timed)
    assert all(r["reason"] for r in bad)
    _, bad = plan_search.search(GPT2, 512, 64, MACHINE, {"tp": 8}, top=3)  # 8 does not divide 12 heads
    assert bad and all("--tp 8 must divide" in r["reason"] for r in bad)


def test_ulysses_is_timed_by_its_all_to_alls_and_the_ring_hides_behind_attention():
    """cp's term: Ulysses' four all-to-alls per block (the ledger's bytes, cp_ledger, which
    the four-rank test holds to the measured ledger) on one ring of cp ranks; the ring's
    sends minus the attention core they travel behind, so a long sequence hides them; on a
    CPU (overlaps_p2p False, MPICH copies inside the wait) none of them is hidden."""
    mcfg = GPTConfig(n_layer=4, n_embd=1024, n_head=16, vocab_size=50257, block_size=8192)
    uly = Layout(cp=4, dp=2, cp_algo="ulysses", recompute="selective")
    got = model.predict(uly, mcfg, 16, MACHINE)["seconds"]["cp"]
    bd, Tl, M = 8, 2048, 8
    nbytes = 4 * 2 * mcfg.n_layer * bd * Tl * mcfg.n_embd * 2  # qkv 3 C + y C, both ways
    assert model.cp_ledger(uly, bd, Tl, mcfg.n_embd, 4, M, 2) == ("alltoall", nbytes, 4 * 4 * M)
    want = 3 / 4 * nbytes / 300e9 + 4 * 4 * M * 3 * 5e-6  # (n-1)/n X / bw + (n-1) lat a call
    assert got == pytest.approx(want)
    ring = model.predict(replace(uly, cp_algo="ring"), mcfg, 16, MACHINE)["seconds"]["cp"]
    assert ring == 0.0 < got  # 8k tokens: the core's (2048 x 8192) products cover the sends
    cpu = model.predict(replace(uly, cp_algo="ring"), mcfg, 16,
                        replace(MACHINE, overlaps_p2p=False))["seconds"]["cp"]
    op, sent, calls = model.cp_ledger(replace(uly, cp_algo="ring"), bd, Tl, mcfg.n_embd, 4, M, 2)
    assert cpu == pytest.approx(sent / 300e9 + calls * 5e-6)  # a CPU's copies: all exposed
    full = model.cp_ledger(replace(uly, recompute="full"), bd, Tl, mcfg.n_embd, 4, M, 2)
    assert full[1:] == (nbytes * 3 // 2, 6 * 4 * M)  # the recomputed forward's two again


def test_more_gpus_per_tp_group_cost_inter_node_bandwidth():
    """tp across nodes (16 > 8 GPUs per node) is slower than inside one: the tp term grows."""
    wide = GPTConfig(n_layer=4, n_embd=2048, n_head=16, vocab_size=50257, block_size=1024)
    inside = model.predict(Layout(tp=8, dp=4), wide, 64, MACHINE)
    across = model.predict(Layout(tp=16, dp=2), wide, 64, MACHINE)
    assert across["seconds"]["tp"] > 5 * inside["seconds"]["tp"]


def test_allreduce_across_nodes_by_hand():
    """4 ranks on 2 nodes of 2: recursive doubling crosses the whole X once (one step inside
    the node, one across); the hierarchy crosses X / 2 in a two-node ring (half of it, twice),
    after and before its reduce-scatter and all-gather inside the node."""
    mach = replace(MACHINE, gpus_per_node=2, intra_node_gbs=10, inter_node_gbs=1,
                   intra_latency_us=2, inter_latency_us=50)
    X = 8e6
    flat = (X / 10e9 + 2e-6) + (X / 1e9 + 50e-6)
    hier = (2 * 0.5 * X / 10e9 + 2 * 2e-6) + (2 * 0.5 * (X / 2) / 1e9 + 2 * 50e-6)
    assert nodes.allreduce_across(X, 4, 2, mach, False) == pytest.approx(flat, rel=1e-12)
    assert nodes.allreduce_across(X, 4, 2, mach, True) == pytest.approx(hier, rel=1e-12)


def test_a_shared_link_prices_what_crosses_it_and_picks_the_reduce():
    """--link-gbit: the search times each layout on the nodes' shared link (refmp.cost.nodes)
    and gives it the faster dp all-reduce: hierarchical where dp crosses a slow link, flat
    where a node holds one rank of each dp group or there is no dp."""
    mcfg = GPTConfig(n_layer=2, n_embd=384, n_head=4, vocab_size=256, block_size=32)
    slow = nodes.cluster(replace(MACHINE, gpus_per_node=2), 2, 0.1, 50.0)
    assert slow.shared_link and slow.inter_node_gbs == pytest.approx(0.1 / 8 * 1448 / 1514 / 2)
    fits, _ = plan_search.search(mcfg, 4, 4, slow, {"zero": 0, "mixed_precision": "none"},
                                 top=50)
    by = {(r["dp"], r["tp"], r["pp"]): r for r in fits if r["microbatch_size"] * r["dp"] == 4}
    dp4, dp2 = by[4, 1, 1], by[2, 2, 1]
    assert dp4["dp_reduce"] == "hierarchical"
    # one rank of each dp group on a node: nothing to reduce inside it, one latency fewer flat
    assert dp2["dp_reduce"] == "flat"
    assert by[1, 2, 2]["dp_reduce"] == "flat"  # no dp: nothing to choose
    for r in (dp4, dp2):  # the time is refmp.cost.nodes' for that reduce, not the ring's
        lay = Layout(**{f: r[f] for f in Layout.__dataclass_fields__})
        own = nodes.predict_on_nodes(lay, mcfg, 4, slow, r["dp_reduce"])
        assert r["step_seconds"] == own["step_seconds"]
        flat = nodes.predict_on_nodes(lay, mcfg, 4, slow)["step_seconds"]
        assert r["step_seconds"] < flat if r is dp4 else r["step_seconds"] == flat
    plain = plan_search.search(mcfg, 4, 4, replace(MACHINE, gpus_per_node=2), {"zero": 0})[0]
    assert all("dp_reduce" not in r for r in plain)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "refmp", "plan", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_the_cost_model_is_pure():
    """Importing the search and the step-time model loads neither MPI nor the trainer."""
    code = ("import sys, refmp.cost.search, refmp.cost.model; assert 'mpi4py' not in "
            "sys.modules and not any(m.startswith('refmp.training') for m in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr


def test_time_shared_cores_make_the_bubble_free_and_ranks_share_the_peak():
    """More ranks than cores: a waiting rank's core runs another rank, so a pipeline's bubble
    costs nothing and the step is the mean stage's; and each rank gets its share of the
    measured peak."""
    mcfg = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=8, n_embd=256)
    lay = Layout(pp=4)
    own = model.predict(lay, mcfg, 8, MACHINE)
    shared = model.predict(lay, mcfg, 8, replace(MACHINE, time_shared=True))
    assert own["seconds"]["bubble"] > 0 and shared["seconds"]["bubble"] == 0
    # and a stage's idle share runs the others: the mean stage, below the slowest (the head's)
    busy = own["step_seconds"] - own["seconds"]["bubble"]
    assert 0.5 * busy < shared["step_seconds"] < busy
    cores = cpu.cores()
    assert calib_cli.cpu_machine(cores).time_shared is False
    assert calib_cli.cpu_machine(2 * cores).time_shared is True


def test_cli_prints_one_table():
    """(Speed lives in refmp bench, not in timed tests: the search is instant in practice.)"""
    r = cli("--preset", "gpt2", "--machine", "dgx-a100", "--gpus", "64", "--global-batch", "512")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert sum(line.lstrip().startswith("#") for line in lines) == 1  # one table header
    assert "faster than the runner-up, mostly in" in r.stdout


def test_cli_json_shape():
    r = cli("--preset", "gpt2-medium", "--gpus", "16", "--global-batch", "64", "--top", "3",
            "--json", "--pp", "2")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["layouts"]
    assert len(rows) == 3 and all(x["pp"] == 2 for x in rows)
    keys = {"tp", "pp", "dp", "cp", "ep", "zero", "sequence_parallel", "recompute",
            "mixed_precision", "microbatch_size", "schedule", "virtual_stages", "memory_bytes",
            "step_seconds", "tokens_per_s", "tflops_per_gpu", "mfu"}
    assert all(keys <= set(x) for x in rows)
    assert set(rows[0]["memory_bytes"]) == {"params", "grads", "optimizer", "error_feedback",
                                            "activations"}
    assert [x["step_seconds"] for x in rows] == sorted(x["step_seconds"] for x in rows)


def test_cli_nothing_fits_exits_2():
    r = cli("--preset", "gpt3-175b", "--gpus", "8", "--zero", "0", "--pp", "8", "--tp", "1",
            "--global-batch", "8")
    assert r.returncode == 2 and "no layout fits" in r.stderr
    assert "needs" in r.stdout


def test_tutorial_13_checks_itself():
    """tutorials/13_plan.py as a reader runs it: the search, the terms, and every rank's
    measured memory against the plan (data parallel and a 2-stage pipeline in bf16)."""
    r = mpiexec(2, ["python", "tutorials/13_plan.py"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: every rank's memory is the plan's" in r.stdout
    assert r.stdout.count("faster than the runner-up") == 1  # rank 0 alone narrates


TRAIN = ["--n-layer", "2", "--n-head", "2", "--n-embd", "8", "--batch-size", "8",
         "--dtype", "float64", "--no-progress"]


def test_train_layout_auto_trains_the_planned_layout_like_the_serial_run(tmp_path):
    """4 ranks, --layout auto: rank 0 prints the planner's layout once, the run uses it (the
    log's layout), and its weights after 3 steps are the serial run's."""
    from mpi_helpers import refmp
    from safetensors.numpy import load_file

    from refmp.training.trainer import TrainConfig

    out, log = tmp_path / "auto.safetensors", tmp_path / "log.jsonl"
    r = refmp(4, ["train", "--layout", "auto", *TRAIN, "--steps", "3", "--save", str(out),
                  "--log-json", str(log)], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("--layout auto on 4 ranks") == 1, r.stdout
    line = next(x for x in r.stdout.splitlines() if "--layout auto on 4 ranks" in x)
    chosen = line.split(" chose ")[1].split(":")[0].split()
    flags = dict(zip(chosen[::2], chosen[1::2], strict=False))
    summary = json.loads(log.read_text().splitlines()[-1])
    for axis in ("tp", "pp", "dp", "cp"):
        assert summary["layout"][axis] == int(flags[f"--{axis}"]), (axis, line)
    assert summary["config"]["recompute"] == flags["--recompute"]
    assert summary["config"]["microbatches"] == int(flags["--microbatches"])
    serial = Trainer(TrainConfig(n_layer=2, n_head=2, n_embd=8, batch_size=8, steps=3,
                                 dtype="float64", progress=False), grid=ProcessGrid(MPI.COMM_SELF))
    for _ in range(3):
        serial.step()
    saved = load_file(str(out))
    for k, v in serial.runner.full_params().items():
        np.testing.assert_allclose(saved[k], v, rtol=1e-9, atol=1e-12, err_msg=k)


def test_train_layout_auto_refuses_what_cannot_fit_on_every_rank():
    """A fixed flag no layout can honour (tp 2 on 2 heads is fine, tp 4 is not): one message,
    exit 2 on every rank, no traceback."""
    from mpi_helpers import refmp

    r = refmp(2, ["train", "--layout", "auto", "--tp", "4", *TRAIN, "--steps", "1"], timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("--layout auto: no layout fits 2 rank(s) (tp=4 fixed)") == 1, r.stderr
    assert "Traceback" not in r.stderr


def test_train_flags_given_are_the_searchs_fixed_choices():
    """given_flags tells a flag given (even at its default, or abbreviated) from a default;
    --microbatches fixes M, so b = B / (dp M); --stage-layers is refused."""
    from refmp.cli.flags import add_train_args, given_flags
    from refmp.errors import ConfigError
    from refmp.training.trainer import TrainConfig

    given = given_flags(add_train_args, ["--tp", "1", "--seq", "--steps", "3", "--layout", "auto"])
    assert given == {"tp", "sequence_parallel", "steps", "layout"}
    fits, _ = plan_search.search(SMALL, 8, 4, MACHINES["dgx-a100"], {"microbatches": 2, "tp": 1}, top=4)
    assert fits and all(8 // (r["dp"] * r["microbatch_size"]) == 2 and r["tp"] == 1
                        for r in fits)
    with pytest.raises(ConfigError, match="--stage-layers"):
        plan_cli.plan_train(TrainConfig(stage_layers="1,1"), {"stage_layers"}, MPI.COMM_SELF)
    cfg, best = plan_cli.plan_train(TrainConfig(n_layer=2, n_head=2, n_embd=8, batch_size=8,
                                                recompute="full"), {"recompute"},
                                    MPI.COMM_SELF)
    assert (cfg.recompute, best["recompute"], cfg.dp, cfg.tp) == ("full", "full", 1, 1)


def test_plan_vs_bench_runs_end_to_end_and_ranks_by_hand():
    """benchmarks/plan_vs_bench.py on two layouts of the tiny preset, 2 steps, 1 round (the
    full measurement is for a quiet machine); its Spearman's rho against hand-worked cases."""
    sys.path.insert(0, f"{REPO}/benchmarks")
    import plan_vs_bench as pvb

    assert pvb.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert pvb.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ties share their mean rank: (1, 2, 3) against (1.5, 1.5, 3), cov 1.5 / sqrt(2 * 1.5)
    assert pvb.spearman([1, 2, 3], [5, 5, 9]) == pytest.approx(0.8660254, abs=1e-6)
    r = subprocess.run([sys.executable, "benchmarks/plan_vs_bench.py", "--preset", "tiny",
                        "--steps", "2", "--warmup", "0", "--rounds", "1", "--layouts",
                        "dp4,tp2xdp2", "--json"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [x["layout"] for x in out["layouts"]] == ["dp4", "tp2xdp2"]
    assert all(x["plan_ms"] > 0 and x["bench_ms"] > 0 for x in out["layouts"])
    assert abs(out["spearman"]) == pytest.approx(1.0)  # two layouts: in order, or not


def test_elementwise_bytes_by_hand():
    """b 1, Tl = T = 4, C 8, NH 2, bf16: n = a = 32, h = 128, S = 32 (docstring's counts)."""
    eb = terms.elementwise_bytes
    fwd, bwd = 2 * (10 * 32 + 2 * 128 + 2 * 32 + 2 * 32), 2 * (14 * 32 + 3 * 128 + 2 * 32 + 3 * 32)
    assert eb(1, 4, 4, 8, 2, 1, False, "none", False, 2) == fwd + bwd
    assert eb(1, 4, 4, 8, 2, 1, False, "full", False, 2) == 2 * fwd + bwd
    assert eb(1, 4, 4, 8, 2, 1, False, "selective", False, 2) == fwd + bwd + 2 * 2 * 32
    # refmp's attention makes the softmax again in every backward (rescored): none and
    # selective alike, and full on top of its forward again
    for rc, more in (("none", 0), ("selective", 0), ("full", fwd)):
        assert eb(1, 4, 4, 8, 2, 1, False, rc, False, 2, rescored=True) == (
            fwd + bwd + 2 * 2 * 32 + more)
    drop = 2 * 2 * 32 + 32 + 2 * 32  # the probabilities' data and mask, two hidden masks
    assert eb(1, 4, 4, 8, 2, 1, False, "none", True, 2) == fwd + bwd + 2 * drop


class Counted(np.ndarray):
    """An array that counts the NumPy operations on it (test_numpy_calls_count_a_real_block):
    ufuncs (operators, reductions), array functions, reshapes, transposes and indexing."""
    calls = 0

    def __array_ufunc__(self, ufunc, method, *ins, **kw):
        Counted.calls += 1
        plain = [i.view(np.ndarray) if isinstance(i, Counted) else i for i in ins]
        if "out" in kw:
            kw["out"] = tuple(o.view(np.ndarray) if isinstance(o, Counted) else o
                              for o in kw["out"])
        r = getattr(ufunc, method)(*plain, **kw)
        return r.view(Counted) if isinstance(r, np.ndarray) else r

    def __array_function__(self, func, types, args, kwargs):
        Counted.calls += 1
        return super().__array_function__(func, types, args, kwargs)

    def _counted(name):
        def op(self, *a, **k):
            Counted.calls += 1
            return getattr(np.ndarray, name)(self, *a, **k)
        return op

    reshape, transpose = _counted("reshape"), _counted("transpose")
    __getitem__, __setitem__ = _counted("__getitem__"), _counted("__setitem__")
    T = property(_counted("transpose"))


def test_numpy_calls_count_a_real_block():
    """numpy_calls of a serial block is the count of a real block_forward and block_backward
    on counting arrays, plus one accumulation per gradient; the layouts' additions as its
    docstring gives them (tp 4 collectives of 6 calls, the ring 26 a cp step, ...)."""
    from refmp.nn import gpt
    from refmp.nn.params import init_params

    cfg = GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=32, block_size=8)
    p = {k[4:]: v.view(Counted) for k, v in init_params(cfg, 0).items() if k.startswith("h.0.")}
    x = np.random.default_rng(0).standard_normal((2, 8, 16)).astype(np.float32).view(Counted)
    counts = []
    for ops in (gpt.Ops(2), gpt.Ops(2, keep_scores=False)):  # none, then selective
        Counted.calls = 0
        y, cache = gpt.block_forward(p, x, ops)
        fwd = Counted.calls
        _, g = gpt.block_backward(y, cache, ops)
        counts.append(Counted.calls + len(g))
    calls = terms.numpy_calls
    serial = counts[0]
    assert counts[1] == serial  # selective's block runs none's calls (refmp.nn.flash)
    assert calls(Layout()) == serial
    assert calls(Layout(tp=2)) == serial + 4 * 6
    assert calls(Layout(cp=2)) == serial + 2 * (10 + 16)
    assert calls(Layout(cp=4, cp_algo="ulysses")) == serial + 2 * 32
    assert calls(Layout(recompute="full")) == serial + fwd
    assert calls(Layout(recompute="selective")) == serial
    assert calls(Layout(), moe=True, top_k=2) == serial + 2 * (40 + 2 * 20)


def test_cpu_machine_terms_scale_the_step_as_their_formulas_say():
    """call_us: M L numpy_calls calls of call_us each; gemm_short: a product's time times
    1 + hm/m + hk/k + hn/n; and cpu_machine takes a calibration's rates as they are."""
    mcfg = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=8, n_embd=256)
    lay = Layout(mixed_precision="none", microbatch_size=2)  # M = 8 / 2 = 4
    cpu_m = replace(MACHINE, sms=0, call_us=2.0, hbm_gbs=1e9)  # products compute-bound
    got = model.predict(lay, mcfg, 8, cpu_m)["seconds"]["calls"]
    assert got == pytest.approx(4 * 4 * terms.numpy_calls(lay) * 2e-6)
    base = terms.gemm(128, 256, 1024, cpu_m, 4)
    short = replace(cpu_m, gemm_short=(16.0, 32.0, 64.0))
    assert terms.gemm(128, 256, 1024, short, 4) == pytest.approx(
        base * (1 + 16 / 128 + 32 / 256 + 64 / 1024))
    calib = {"gflops": 50.0, "gbs": 6.0, "call_us": 0.5, "short": [20.0, 30.0, 2.0],
             "stream_gbs": 7.0}
    mach = calib_cli.cpu_machine(2, (4.0, 3.0), calib)
    assert (mach.peak_tflops, mach.hbm_gbs, mach.call_us, mach.gemm_short, mach.stream_gbs) == (
        0.05, 6.0, 0.5, (20.0, 30.0, 2.0), 7.0)
    opt = model.predict(lay, mcfg, 8, replace(cpu_m, stream_gbs=2.0))["seconds"]["optimizer"]
    assert opt == pytest.approx(32 * 3_257_856 / 2e9, rel=0.05)  # AdamW's 32 bytes a weight
    assert (mach.intra_node_gbs, mach.intra_latency_us) == (4.0, 3.0)


def test_calibrate_measures_positive_rates():
    """A short calibration: every rate positive and finite, the slowdowns not negative."""
    c = calib_cli.calibrate(0.005)
    assert c["gflops"] > 0 and c["gbs"] > 0 and c["stream_gbs"] > 0 and 0 < c["call_us"] < 1e4
    assert len(c["short"]) == 3 and all(h >= 0 for h in c["short"])
    assert np.isfinite([c["gflops"], c["gbs"], c["call_us"], *c["short"]]).all()


def test_cpu_machine_gives_each_rank_its_share_of_this_process_s_rates(monkeypatch):
    """Calibrated in this process (refmp plan --machine cpu): 4 ranks on 2 cores (1 thread
    each) get half of each rate, and an operation, one thread's Python, takes twice as long;
    1 rank on 2 cores keeps an operation's time. A process of 2 threads measured the block's
    rows and AdamW's in both: a rank of the 4 gets a quarter of those (its BLAS on one thread
    in the calibration too: half the peak)."""
    calib = {"gflops": 50.0, "short": [1.0, 2.0, 3.0], "gbs": 6.0, "stream_gbs": 8.0,
             "call_us": 3.0}
    monkeypatch.setattr(calib_cli, "calibrate", lambda: dict(calib))
    monkeypatch.setattr(cpu, "cores", lambda: 2)
    monkeypatch.setattr(cpu, "threads", lambda: 1)
    four = calib_cli.cpu_machine(4)
    assert (four.peak_tflops, four.hbm_gbs, four.stream_gbs, four.call_us) == (0.025, 3.0, 4.0, 6.0)
    assert calib_cli.cpu_machine(1).call_us == 3.0
    monkeypatch.setattr(cpu, "threads", lambda: 2)
    four = calib_cli.cpu_machine(4)
    assert (four.peak_tflops, four.hbm_gbs, four.stream_gbs, four.call_us) == (0.025, 1.5, 2.0, 6.0)


def test_a_synced_measurement_starts_on_every_rank_at_once():
    """_mean_seconds with ``sync``: one warm-up call, then the communicator's barrier, then
    the timed calls (at least 3), so that ranks calibrating beside each other time each
    function while the others run the same one."""
    order = []

    class Sync:
        def Barrier(self):
            order.append("barrier")

    calib_cli._mean_seconds(lambda: order.append("call"), 0.0, Sync())
    assert order[:2] == ["call", "barrier"] and order[2:] == ["call"] * (len(order) - 2)
    assert len(order) >= 5


def test_slowest_takes_each_rate_of_the_slowest_rank_and_the_median_short_sides():
    """Ranks calibrated beside each other: the least of each rate, the most time an operation,
    and each short side's median (not the slowest-peak rank's own, biased low)."""
    calibs = [{"gflops": 40.0, "short": [0.0, 10.0, 4.0], "gbs": 5.0, "stream_gbs": 6.0,
               "call_us": 4.0},
              {"gflops": 50.0, "short": [20.0, 30.0, 0.0], "gbs": 3.0, "stream_gbs": 7.0,
               "call_us": 6.0},
              {"gflops": 45.0, "short": [12.0, 20.0, 2.0], "gbs": 4.0, "stream_gbs": 5.0,
               "call_us": 5.0}]
    assert calib_cli.slowest(calibs) == {"gflops": 40.0, "short": [12.0, 20.0, 2.0], "gbs": 3.0,
                                        "stream_gbs": 5.0, "call_us": 6.0}


def test_calibration_prices_refmp_s_own_optimizer_step_and_operations(monkeypatch):
    """On a clock that gives every timed function S seconds, the calibrated machine's
    optimizer term is S per 2^20 weights (refmp's AdamW step, timed on 2^20 of them) and a
    block's calls term is S per block of the tiny one (its operations, numpy_calls' count
    less the accumulations the block leaves to its caller, then those at the same cost)."""
    S = 2e-3
    timed = []

    def clock(fn, seconds, sync):
        timed.append(fn)
        return S

    monkeypatch.setattr(calib_cli, "_mean_seconds", clock)
    calib = calib_cli.calibrate()
    assert len(timed) == 7  # 4 products, the small block, the tiny block, the AdamW step
    mcfg = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=8, n_embd=256)
    lay = Layout(mixed_precision="none", microbatch_size=2)  # M = 8 / 2 = 4
    t = model.predict(lay, mcfg, 8, calib_cli.cpu_machine(2, (4.0, 3.0), calib))["seconds"]
    assert t["optimizer"] == pytest.approx(3_257_856 / 2**20 * S)
    per_block = terms.numpy_calls(lay) / (terms.numpy_calls(lay) - 12)  # 12 parameters
    assert t["calls"] == pytest.approx(4 * 4 * S * per_block)


def test_megatron_2021_table_within_ten_percent(capsys):
    """docs/plan.md's published comparison, as benchmarks/plan_megatron.py prints it: every
    row of Narayanan et al. 2021's Table 1 within 10% with Megatron-LM 2021's implementation,
    and the 1T row (pp 64, 512 micro-batches a pipeline) through `refmp plan` too: the
    executor's tags set it no bound (its simulations are cached by then: terms.bubble)."""
    from refmp.cli.main import main

    sys.path.insert(0, f"{REPO}/benchmarks")
    import plan_megatron

    for row in plan_megatron.ROWS:
        got = plan_megatron.best(row, model.MEGATRON_2021)[0]["tflops_per_gpu"]
        assert abs(got / row[8] - 1) < 0.10, (row[0], got, row[8])
    _, nh, C, L, tp, pp, n, B, paper, _ = plan_megatron.ROWS[-1]
    flags = {"--n-layer": L, "--n-embd": C, "--n-head": nh, "--tp": tp, "--pp": pp, "--gpus": n,
             "--global-batch": B, "--microbatch-size": 1, "--vocab": 51200,
             "--block-size": 2048, "--recompute": "full", "--mixed-precision": "bf16",
             "--sequence-parallel": "off", "--impl": "megatron-2021", "--top": 1}
    assert main(["plan", *(str(x) for kv in flags.items() for x in kv), "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["layouts"][0]
    assert (best["pp"], best["dp"]) == (64, 6)
    assert abs(best["tflops_per_gpu"] / paper - 1) < 0.10, best["tflops_per_gpu"]


def test_zero3_prefetch_by_hand():
    """zero.prefetched: the next gather goes out when a use starts computing; reductions
    queue behind; compute beside the communication stream runs ``slowdown`` times slower."""
    from refmp.cost.zero import prefetched

    assert prefetched([(2, 1, 0), (2, 1, 0)], 1.0) == 5  # gather 0-1; computes 1-3, 3-5
    assert prefetched([(1, 3, 0), (1, 3, 0)], 1.0) == 7  # gathers 0-3, 3-6; computes 3-4, 6-7
    assert prefetched([(1, 1, 1)], 1.0) == 3  # gather, compute, then the reduce-scatter
    # gather 1 runs 1-5 beside compute 0, which takes 4 s at half speed, then compute 1 5-7
    assert prefetched([(2, 1, 0), (2, 4, 0)], 2.0) == 7


def published(*flags: str) -> float:
    r = cli(*flags, "--vocab", "51200", "--block-size", "2048", "--recompute", "full",
            "--mixed-precision", "bf16", "--sequence-parallel", "off", "--top", "1", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["layouts"][0]["tflops_per_gpu"]


def test_cli_impl_prints_the_published_rows_within_ten_percent():
    """The issue's command lines: Table 1's first and fifth rows with --impl megatron-2021
    (the search keeps zero 0 and picks the faster schedule), a ZeRO-3 row of Table 2 with
    --impl deepspeed-zero3; refmp's own implementation is faster than the paper's."""
    row1 = ("--n-layer", "24", "--n-embd", "2304", "--n-head", "24", "--tp", "1", "--pp", "1",
            "--gpus", "32", "--global-batch", "512", "--microbatch-size", "1")
    assert abs(published(*row1, "--impl", "megatron-2021") / 137 - 1) < 0.10
    assert published(*row1) / 137 - 1 > 0.10
    row5 = ("--n-layer", "48", "--n-embd", "8192", "--n-head", "64", "--tp", "8", "--pp", "2",
            "--gpus", "512", "--global-batch", "1536", "--microbatch-size", "1")
    assert abs(published(*row5, "--impl", "megatron-2021") / 138 - 1) < 0.10
    zero3 = ("--n-layer", "96", "--n-embd", "12288", "--n-head", "96", "--tp", "1", "--gpus",
             "384", "--global-batch", "1536", "--microbatch-size", "4")
    assert abs(published(*zero3, "--impl", "deepspeed-zero3") / 144 - 1) < 0.10
    r = cli("--preset", "gpt2", "--impl", "megatron-2021", "--zero", "2")
    assert r.returncode == 2 and "--impl megatron-2021 runs --zero 0 only" in r.stderr


def test_deepspeed_zero3_table_within_ten_percent():
    """Narayanan et al. 2021's Table 2, ZeRO-3 rows, with DeepSpeed's prefetch overlap
    (zero.prefetched): every row within 10%."""
    sys.path.insert(0, f"{REPO}/benchmarks")
    import plan_megatron

    for row in plan_megatron.ZERO3:
        got = plan_megatron.table2_row(row, model.DEEPSPEED_ZERO3)[0]["tflops_per_gpu"]
        assert abs(got / row[-1] - 1) < 0.10, (row[0], row[6], got, row[-1])


@settings(max_examples=30, deadline=None)
@given(n_layer=st.integers(2, 9), chunks=st.integers(1, 4), block=st.integers(1, 50),
       head=st.integers(0, 400), embed=st.integers(0, 400))
def test_stage_layers_auto_minimizes_the_slowest_stage(n_layer, chunks, block, head, embed):
    """balanced_split on measured costs (the embeddings with the first stage, the head and
    its loss with the last) reaches the smallest possible slowest stage: every split tried."""
    from itertools import combinations

    from refmp.parallel.pipeline.partition import balanced_split, chunk_cost

    chunks = min(chunks, n_layer)
    costs = {"block": (block, 10), "head": (head, 2), "embed": (embed, 5)}

    def slowest(counts):
        return max(chunk_cost(n, c == 0, c == len(counts) - 1, costs)[0]
                   for c, n in enumerate(counts))

    every = [[b - a for a, b in zip((0, *cut), (*cut, n_layer), strict=True)]
             for cut in combinations(range(1, n_layer), chunks - 1)]
    got = balanced_split(n_layer, chunks, costs)
    assert sum(got) == n_layer and min(got) >= 1 and len(got) == chunks
    assert slowest(got) == min(slowest(s) for s in every)


def test_stage_layers_auto_measures_the_pieces_here():
    """measured_costs times a block, the head with its loss and the embeddings (positive
    nanoseconds, piece_costs' parameters); auto_stage_layers splits on rank 0's timings."""
    from refmp.errors import ConfigError
    from refmp.parallel.pipeline import partition as P

    mcfg = GPTConfig(n_layer=4, n_head=2, n_embd=16, block_size=8, vocab_size=512)
    costs = P.measured_costs(mcfg, 2, reps=1)
    params = P.piece_costs(16, 8, 512)
    assert {k: v[1] for k, v in costs.items()} == {k: v[1] for k, v in params.items()}
    assert all(v[0] > 0 for v in costs.values())
    split = P.auto_stage_layers(mcfg, 2, 2, "float32", MPI.COMM_SELF)
    assert sum(map(int, split.split(","))) == 4
    with pytest.raises(ConfigError, match="auto"):
        P.parse_stage_layers("auto")


def test_setup_reads_an_owned_slice_of_each_unit_over_its_own_group():
    """ZeRO-3's build reads at most a rank's slice of each unit: a dense unit over its dp x cp
    group (n), an expert unit over edp (with folding dp cp tp / (etp ep), which may be smaller
    than ep: tp 4 x dp 2 with ep 4 over etp 1 gives edp 2), plus two read chunks."""
    from refmp.config import TrainConfig
    from refmp.cost.memory import setup_bytes
    from refmp.nn.slices import BLOCK_BYTES

    cfg = TrainConfig(zero=3)
    shapes = {"h.0": {"attn": (4, 40)}, "h.0.experts": {"fc": (8, 64), "b": (64,)}}
    # dense: 160 elements over n 4 -> 40; experts: 576 over edp 2 -> 288 (under its 512)
    assert setup_bytes(cfg, shapes, 4, 2, 4) == 4 * 288 + 2 * BLOCK_BYTES
    assert setup_bytes(cfg, shapes, 4, 8, 4) == 4 * 72 + 2 * BLOCK_BYTES
    folded = Layout(tp=4, dp=2, ep=4, etp=1, zero=3, mixed_precision="none")
    assert memory(folded, GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4,
                                    n_embd=32, n_expert=4), 8)["setup"] > 0
