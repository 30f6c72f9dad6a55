"""ZeRO 1/2/3 composed with tensor parallelism (tp 2 x dp 2) and ZeRO 1/2 with pipeline
parallelism (pp 2 x dp 2) equal the serial run (float64), under real MPI on 4 ranks.

Every rank trains the serial model itself (COMM_SELF) next to the composed one. A rank holds
its tp shards (or its stage's parameters), and of those only its dp slice of the gradients
and optimizer state, so it is compared with the same elements of the serial arrays: first cut
to the runner's local arrays (tensor_runner.shard, or the stage's names), then to the dp slice
(``ShardedOptimizer.shard_of``). Memory and dp ledger bytes are held against
refmp.parallel.zero_cost's formulas, exactly; the CLI's --save against a serial CLI run.
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_helpers import Mismatches, collective, refmp

from refmp.checkpoint import read_tensors
from refmp.data import Dataset
from refmp.grid import ProcessGrid
from refmp.nn import GPTConfig, gpt
from refmp.parallel.data import activation_bytes
from refmp.parallel.tensor_runner import TensorParallel, shard
from refmp.parallel.zero3_tensor import ZeRO3Tensor
from refmp.parallel.zero_compose import ShardedOptimizer
from refmp.parallel.zero_cost import (
    sharded_comm_per_step,
    sharded_memory_per_rank,
    stage3_comm_per_step,
    stage3_memory_per_rank,
    tp_local_numel,
    tp_unit_sizes,
)
from refmp.train import TrainConfig, Trainer

TOL = dict(rtol=1e-9, atol=1e-12)
close = np.testing.assert_allclose


def local_of(run: ShardedOptimizer, full: dict, axis: str, tp_comm) -> dict:
    """The serial arrays cut as the inner runner holds them (its tp shards / its stage's)."""
    inner = run.inner
    if axis == "tp":
        return {k: shard(k, v, tp_comm.rank, tp_comm.size, inner.V_pad)
                for k, v in full.items()}  # every parameter has a tp shard
    return {k: full[k] for k in inner.params}


def stage_numel(run: ShardedOptimizer, cfg: GPTConfig, pp_rank: int, pp: int) -> int:
    """Elements pipeline rank pp_rank holds: its blocks, wte/wpe first, ln_f/wte last."""
    shapes, blocks = gpt.param_shapes(cfg), run.inner.blocks
    mine = [i for c in range(pp_rank, len(blocks), pp) for i in blocks[c]]
    names = [k for k in shapes if any(k.startswith(f"h.{i}.") for i in mine)]
    names += ["wte.weight", "wpe.weight"] if pp_rank == 0 else []
    names += ["ln_f.weight", "ln_f.bias", "wte.weight"] if pp_rank == pp - 1 else []
    return sum(int(np.prod(shapes[k])) for k in names)


@pytest.mark.mpi
@pytest.mark.parallel(nprocs=4)
@settings(max_examples=8, phases=[Phase.explicit, Phase.generate], deadline=None)
@given(layout=st.sampled_from([("tp", 1), ("tp", 2), ("tp", 3), ("pp", 1), ("pp", 2)]),
       M=st.sampled_from([1, 2]), sp=st.booleans(),
       schedule=st.sampled_from(["gpipe", "1f1b", "zb-h1", "interleaved"]), hs=st.integers(1, 3),
       V=st.integers(3, 13), T=st.sampled_from([2, 4]), clip=st.sampled_from([0.0, 0.05, 10.0]),
       seed=st.integers(0, 99))
@example(layout=("tp", 1), M=1, sp=False, schedule="1f1b", hs=2, V=11, T=4, clip=0.05, seed=1)
@example(layout=("tp", 2), M=2, sp=True, schedule="1f1b", hs=3, V=7, T=4, clip=0.05, seed=2)
@example(layout=("tp", 3), M=1, sp=False, schedule="1f1b", hs=2, V=11, T=4, clip=0.05, seed=6)
@example(layout=("tp", 3), M=2, sp=True, schedule="1f1b", hs=3, V=7, T=4, clip=0.05, seed=7)
@example(layout=("pp", 1), M=2, sp=False, schedule="1f1b", hs=2, V=11, T=4, clip=0.05, seed=3)
@example(layout=("pp", 2), M=2, sp=False, schedule="zb-h1", hs=3, V=5, T=2, clip=0.05, seed=4)
@example(layout=("pp", 1), M=2, sp=False, schedule="interleaved", hs=1, V=6, T=2, clip=0.05,
         seed=5)
@collective
def test_zero_over_tp_and_pp_equals_serial(layout, M, sp, schedule, hs, V, T, clip, seed):
    axis, zero = layout
    n_head, n_layer, dp, v = 2, 2, 2, 1
    if axis == "pp" and schedule == "interleaved":  # 2 chunks per pipeline rank
        n_layer, v, M = 4, 2, 2
    cfg = TrainConfig(n_layer=n_layer, n_head=n_head, n_embd=n_head * hs, block_size=T,
                      batch_size=dp * M * 2, steps=3, lr=0.01, warmup_steps=1, grad_clip=clip,
                      dtype="float64", seed=seed, progress=False, zero=zero, microbatches=M,
                      tp=2 if axis == "tp" else 1, pp=2 if axis == "pp" else 1,
                      sequence_parallel=sp and axis == "tp", schedule=schedule,
                      virtual_stages=v)
    ds = Dataset(np.random.default_rng(seed).integers(0, V, 120), V, "random")
    serial = Trainer(dataclasses.replace(cfg, zero=0, microbatches=1, tp=1, pp=1,
                                         sequence_parallel=False, schedule="1f1b",
                                         virtual_stages=1),
                     grid=ProcessGrid(MPI.COMM_SELF), dataset=ds)
    par = Trainer(cfg, grid=ProcessGrid(MPI.COMM_WORLD, tp=cfg.tp, pp=cfg.pp), dataset=ds)
    try:
        check(cfg, axis, serial, par)
    finally:  # MPI has a few thousand communicators: free each example's
        for grid in (serial.grid, par.grid):
            for comm in grid.comm.values():
                comm.mpi.Free()


def check(cfg, axis, serial, par):
    run, grid, bad = par.runner, par.grid, Mismatches()
    assert isinstance(run, ZeRO3Tensor if cfg.zero == 3 else ShardedOptimizer)
    for s in range(cfg.steps):
        a, b = serial.step(), par.step()
        bad.check(close, b["loss"], a["loss"], **TOL, err_msg=f"loss at step {s}")
        bad.check(close, b["grad_norm"], a["grad_norm"], **TOL, err_msg=f"norm at step {s}")
        # this rank's dp slice of its tp shards / stage, after reduction and clipping
        want_g = run.shard_of(local_of(run, serial.model.grads, axis, grid.comm["tp"]))
        want_p = run.shard_of(local_of(run, serial.model.params, axis, grid.comm["tp"]))
        bad.check(np.testing.assert_equal, sorted(run.grads), sorted(want_g), err_msg="pieces")
        for k in want_g:
            bad.check(close, run.grads[k], want_g[k], **TOL, err_msg=f"grad {k} at step {s}")
            bad.check(close, run.params[k], want_p[k], **TOL, err_msg=f"weight {k} after {s}")
        # and the runner computes on the full local arrays, all-gathered over dp
        want_local = local_of(run, serial.model.params, axis, grid.comm["tp"])
        for k, v in run.inner.params.items():  # (stage 3: none, they are freed)
            bad.check(close, v, want_local[k], **TOL, err_msg=f"local weight {k} after {s}")
    led = grid.ledger
    sent = {op: led.bytes(op, "dp") for op in ("allreduce", "reduce_scatter", "allgather")}
    full = run.full_params()  # collective over tp / pp; world rank 0 gets it
    if full is not None:
        for k, v in serial.model.params.items():
            bad.check(close, full[k], v, **TOL, err_msg=f"gathered weight {k}")
    # memory: ZeRO's division by dp of what the tp / pp rank holds, exactly (float64: 8 B)
    mcfg = serial.model.cfg
    n_local = (tp_local_numel(mcfg, 2) if axis == "tp"
               else stage_numel(run, mcfg, grid.coords["pp"], 2))
    mem, want = par.memory(), sharded_memory_per_rank(n_local, 2, cfg.zero, itemsize=8)
    if cfg.zero == 3:  # each unit of the tp shards padded to a multiple of dp, then / dp
        want = stage3_memory_per_rank(tp_unit_sizes(mcfg, 2), 2, itemsize=8)
    for kind in ("params", "grads", "optimizer"):
        bad.check(np.testing.assert_equal, mem[kind], want[kind], err_msg=f"{kind} bytes")
    if axis == "tp":  # activations: as plain tp's on one micro-batch (the flat buffer is no
        # activation, though the caches hold views of it)
        plain = TensorParallel(serial.model, grid, cfg.sequence_parallel, cfg.microbatches)
        x = np.zeros((cfg.batch_size // (2 * cfg.microbatches), mcfg.block_size), np.int64)
        _, cache = plain.forward(x, x.copy(), 1)  # collective over tp
        bad.check(np.testing.assert_equal, mem["activations"],
                  activation_bytes(cache, plain.params.values()), err_msg="activation bytes")
    # dp communication: reduce-scatter + all-gather replace the all-reduce, each step
    want = sharded_comm_per_step(n_local, 2, itemsize=8)
    if cfg.zero == 3:  # per micro-batch: reduce-scatter every unit, gather embed/blocks twice
        want = stage3_comm_per_step(tp_unit_sizes(mcfg, 2), 2, cfg.microbatches, itemsize=8)
    for op, got in sent.items():
        bad.check(np.testing.assert_equal, got, cfg.steps * want.get(op, 0),
                  err_msg=f"{op}@dp bytes")
    bad.assert_none()


def test_tp_local_numel_counts_the_shards():
    """The analytic count equals the sizes of tensor_runner.shard's pieces (V padded)."""
    cfg = GPTConfig(vocab_size=11, block_size=4, n_layer=2, n_head=4, n_embd=8)
    full = gpt.GPT.create(cfg, 0, "float64").params
    for tp in (1, 2, 4):
        got = sum(shard(k, v, 0, tp, -(-11 // tp) * tp).size for k, v in full.items())
        assert tp_local_numel(cfg, tp) == got


COMMON = ["train", "--n-embd", "8", "--n-layer", "2", "--n-head", "2", "--steps", "3",
          "--batch-size", "8", "--dtype", "float64", "--no-progress", "--digits", "2"]


@pytest.mark.cli
@pytest.mark.parametrize("layout", [["--zero", "1", "--tp", "2", "--dp", "2"],
                                    ["--zero", "3", "--tp", "2", "--dp", "2",
                                     "--sequence-parallel", "--microbatches", "2"],
                                    ["--zero", "2", "--pp", "2", "--dp", "2",
                                     "--microbatches", "2"]])
def test_cli_trains_and_saves_the_full_model(layout, tmp_path):
    r = refmp(1, [*COMMON, "--save", str(tmp_path / "serial.safetensors")], timeout=120)
    assert r.returncode == 0, r.stderr
    r = refmp(4, [*COMMON, *layout, "--save", str(tmp_path / "zero.safetensors")], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "reduce_scatter@dp" in r.stdout and "allreduce@dp" not in r.stdout
    want, _ = read_tensors(str(tmp_path / "serial.safetensors"))
    got, _ = read_tensors(str(tmp_path / "zero.safetensors"))
    assert sorted(got) == sorted(want)
    for k in want:
        close(got[k], want[k], **TOL, err_msg=k)


@pytest.mark.cli
@pytest.mark.parametrize("args, message", [
    (["--zero", "3", "--pp", "2", "--n-layer", "2"], "--zero 3 with --pp: not implemented"),
])
def test_zero3_over_pp_is_refused(args, message):
    r = refmp(4, ["train", "--n-embd", "8", "--steps", "1", "--no-progress", *args], timeout=60)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr
