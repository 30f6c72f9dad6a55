"""Context parallelism x tensor parallelism (cp=2 x tp=2 on 4 ranks, x dp=2 on 8) equals the
serial model, with and without sequence parallelism.

One block of refmp.nn.gpt run through ParallelOps (tp linears, SP regions, the CP attention
core) against the serial block; whole AdamW runs with clipping against the serial run
(tests/parity.assert_same_run: losses, norms, whole gradients and weights every step) and
their ledger against the formulas (tests/test_context_parallel.want_per_step); the command
line: --save, evaluation, bad input.
"""

import numpy as np
import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_helpers import Mismatches, collective, refmp, refused_each
from parity import assert_same_run
from safetensors.numpy import load_file
from test_context_parallel import assert_ledger

from refmp.distributed.grid import ProcessGrid
from refmp.nn import gpt
from refmp.parallel.context.chunks import SequenceChunks
from refmp.parallel.context.ring import RingAttention
from refmp.parallel.context.ulysses import UlyssesAttention
from refmp.parallel.ops import MEGATRON, ParallelOps
from refmp.parallel.placement import place, tp_shard
from refmp.parallel.tensor import sequence
from refmp.training.datasets import Dataset
from refmp.training.trainer import TrainConfig, Trainer

TOL = dict(rtol=1e-9, atol=1e-12)
close = np.testing.assert_allclose
NO_SHRINK = (Phase.explicit, Phase.generate)
LAYOUTS = [("ring", "zigzag"), ("ring", "contiguous"), ("ulysses", "zigzag")]


def free(grid: ProcessGrid) -> None:
    for c in grid.comm.values():
        c.mpi.Free()


@pytest.mark.mpi
@pytest.mark.parallel(nprocs=4)
@settings(max_examples=4, phases=NO_SHRINK)
@given(layout=st.sampled_from(LAYOUTS), sp=st.booleans(), hs=st.integers(1, 2),
       B=st.integers(1, 2), c=st.integers(1, 2), seed=st.integers(0, 999))
@example(layout=("ulysses", "zigzag"), sp=True, hs=1, B=2, c=1, seed=1)  # all-to-all + SP
@collective
def test_tp_block_with_cp_attention_equals_serial_block(layout, sp, hs, B, c, seed):
    """Rank (cp r, tp j) holds the tokens SequenceChunks gives r (with SP: their j-th 1/tp) and
    the j-th 1/tp of the heads; the gradients, summed where placement says, are the shards
    of the serial block's."""
    algo, balance = layout
    grid = ProcessGrid(MPI.COMM_WORLD, cp=2, tp=2)
    tp, cp = grid.comm["tp"], grid.comm["cp"]
    NH, T = 4, (4 if balance == "zigzag" else 2) * 2 * c  # 2cp or cp chunks of 2c: SP splits Tl
    C, cpl = NH * hs, SequenceChunks(T, 2, balance)
    rng = np.random.default_rng(seed)
    p = {k: rng.standard_normal(s) * 0.3 for k, s in gpt.block_param_shapes(
        gpt.GPTConfig(n_head=NH, n_embd=C)).items()}
    x, dout = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, C))
    y_ref, cache = gpt.block_forward(p, x, gpt.Ops(NH))
    dx_ref, g_ref = gpt.block_backward(dout, cache, gpt.Ops(NH))

    mine = cpl.positions(cp.rank)  # (Tl,) my tokens' global positions
    if sp:  # SP: my tp rank's contiguous 1/tp of them
        n = len(mine) // tp.size
        mine = mine[tp.rank * n : (tp.rank + 1) * n]  # (Tl/tp,)
    attn = (RingAttention if algo == "ring" else UlyssesAttention)(cp, cpl)
    ops = ParallelOps(NH, 7, tp, sequence.LAYERS if sp else MEGATRON, attn)
    p_tp = {k: tp_shard(f"h.0.{k}", v, tp.rank, tp.size) for k, v in p.items()}
    y, cache = gpt.block_forward(p_tp, x[:, mine], ops)  # (B, Tl, C), or Tl/tp with SP
    dx, g = gpt.block_backward(dout[:, mine], cache, ops)
    for k in sorted(g):  # summed over cp (other tokens), and over tp where SP left it partial
        g[k] = cp.allreduce(np.ascontiguousarray(g[k]))
        if "tp" in place(f"h.0.{k}", sp).reduce:
            g[k] = tp.allreduce(g[k])

    bad = Mismatches()
    bad.check(close, y, y_ref[:, mine], **TOL, err_msg="block output")
    bad.check(close, dx, dx_ref[:, mine], **TOL, err_msg="block dx")
    for k, v in g_ref.items():
        bad.check(close, g[k], tp_shard(f"h.0.{k}", v, tp.rank, tp.size), **TOL, err_msg=k)
    free(grid)
    bad.assert_none()


def small_cfg(**kw) -> TrainConfig:
    base = dict(n_layer=2, n_head=4, n_embd=8, block_size=8, batch_size=2, steps=3, lr=0.02,
                warmup_steps=1, grad_clip=0.05, dtype="float64", seed=3, progress=False, cp=2,
                tp=2)
    return TrainConfig(**{**base, **kw})


DATA = Dataset(np.random.default_rng(0).integers(0, 7, 200), 7, "random")  # vocab 7: pad 8


@pytest.mark.mpi
@pytest.mark.parallel(nprocs=4)
@settings(max_examples=4, phases=NO_SHRINK)
@given(layout=st.sampled_from(LAYOUTS), M=st.integers(1, 2), sp=st.booleans(),
       zero=st.sampled_from([0, 1, 2, 3]))
@example(layout=("ulysses", "zigzag"), M=2, sp=True, zero=2)  # all-to-all + SP
@collective
def test_cp_tp_training_equals_serial(layout, M, sp, zero):
    """cp=2 x tp=2: 3 AdamW steps with clipping that bites (grad_clip 0.05); with SP each
    rank's T/cp tokens are split again over tp."""
    algo, balance = layout
    cfg = small_cfg(cp_algo=algo, cp_balance=balance, microbatches=M, batch_size=2 * M,
                    sequence_parallel=sp, zero=zero)
    par = assert_same_run(cfg, DATA)
    assert_ledger(par)


@pytest.mark.mpi
@pytest.mark.parallel(nprocs=8)
@collective
def test_cp_tp_dp_training_equals_serial():
    """cp=2 x tp=2 x dp=2 (8 ranks, oversubscribed): the same, gradients summed over dp x cp."""
    par = assert_same_run(small_cfg(cp_algo="ring", batch_size=4, steps=2), DATA)
    assert par.grid.sizes["dp"] == 2
    assert_ledger(par)


# --- the command line ------------------------------------------------------------------------

SMALL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "8", "--batch-size", "4", "--steps", "3",
         "--no-progress", "--dtype", "float64", "--grad-clip", "0.1"]


@pytest.mark.cli
def test_cp_tp_train_save_and_evaluate(tmp_path):
    """4 ranks, cp=2 x tp=2, --digits 2 (block 8: one problem per window), evaluation."""
    out = tmp_path / "m.safetensors"
    r = refmp(4, ["train", "--cp", "2", "--tp", "2", "--block-size", "8", "--digits", "2",
                  *SMALL, "--save", str(out)], timeout=150)
    assert r.returncode == 0, r.stderr
    assert "held-out exact match" in r.stdout and "cp=2 x tp=2" in r.stdout
    assert "send@cp" in r.stdout and "allreduce@tp" in r.stdout
    cfg = TrainConfig(n_layer=1, n_head=2, n_embd=8, batch_size=4, steps=3, dtype="float64",
                      grad_clip=0.1, block_size=8, digits=2, progress=False)
    tr = Trainer(cfg, grid=ProcessGrid(MPI.COMM_SELF))
    for _ in range(3):
        tr.step()
    saved, want = load_file(str(out)), tr.runner.full_params()
    assert set(saved) == set(want)
    for k, v in want.items():  # full, unpadded (vocab 13 on tp 2), GPT-2 names
        assert saved[k].shape == v.shape, k
        close(saved[k], v, **TOL, err_msg=k)


BAD_CP_TP = [
    (["--cp-algo", "ulysses"], "n_head/tp = 1 heads of a tp rank, which must be divisible"),
    (["--sequence-parallel", "--block-size", "6", "--cp-balance", "contiguous"],
     "--tp 2 must divide the tokens each rank holds, T/cp = 6/2"),
    (["--block-size", "6"], "block size 6 is not divisible by 4"),
    (["--n-head", "3", "--n-embd", "6"], "--tp 2 must divide the number of heads"),
]


@pytest.fixture(scope="module")
def bad_cp_tp_runs():
    """BAD_CP_TP's command lines, each refused on 4 ranks, all in one launch
    (mpi_helpers.refused)."""
    train = ["train", "--cp", "2", "--tp", "2", "--block-size", "8", *SMALL]
    return refused_each(4, train, BAD_CP_TP)


@pytest.mark.cli
@pytest.mark.parametrize("args,message", BAD_CP_TP)
def test_cp_tp_bad_input_fails_cleanly(bad_cp_tp_runs, args, message):
    r = bad_cp_tp_runs[str(args)]
    assert r.returncode == 2, r.stderr
    assert r.stderr.count(message) == 1, r.stderr  # every rank refused; rank 0 says it once
    assert "Traceback" not in r.stderr
