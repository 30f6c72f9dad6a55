"""refmp's layouts against PyTorch's own distributed equivalents, timed side by side.

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/torch_peers.py [--preset small]
        [--steps 5] [--rounds 3] [--layouts zero3,pp_1f1b,pp_zb,tp_sp,cp_ring] [--json]
        [--n-layer --n-embd --n-head --block-size --batch-size --vocab: override the preset]

PyTorch is not a refmp dependency; install it to run this. Each layout runs refmp's own
training step (``refmp.training.trainer.Trainer``, what ``refmp train`` and ``refmp bench``
run) and the PyTorch program a user would write instead, over gloo on the same ranks:

=========  =====================================  ==============================================
layout     refmp                                  PyTorch
=========  =====================================  ==============================================
zero3      ``--zero 3`` (dp 2)                    FSDP2: ``fully_shard`` per block, then the model
pp_1f1b    ``--pp 2 --microbatches 8 --schedule   ``torch.distributed.pipelining``:
           1f1b``                                 ``Schedule1F1B``
pp_zb      ``--schedule zb-h1``                   ``ScheduleInterleavedZeroBubble``, one stage
                                                  per rank (its zero-bubble split of backward)
tp_sp      ``--tp 2 --sequence-parallel``         DTensor ``parallelize_module``: Colwise /
                                                  RowwiseParallel, SequenceParallel LayerNorms
cp_ring    ``--cp 2 --cp-algo ring`` (zigzag)     ``context_parallel`` (ring attention, its
                                                  head-tail balance) inside DDP
=========  =====================================  ==============================================

Both start from refmp's initial weights (benchmarks/torch_anchor.py copies them into its
TorchGPT) and train on the same global batch with the same AdamW and clipping; the first
losses must agree to 1e-5 (relative) and the first step's gradient norms to 1e-4 (a check
that the PyTorch program reduces its gradients as refmp does). Steps
run in alternating rounds (refmp's ``--steps``, then torch's); a step's time is the slowest
rank's, and the figures are medians, with each step's CPU time (the process's threads, the
busiest rank's: steadier than the wall clock on a shared machine). Torch runs one thread per
rank (``torch.set_num_threads``), NumPy OMP_NUM_THREADS.

torch's ``context_parallel`` replaces only the CUDA attention kernels (flash, efficient,
cuDNN) with ring attention; on the CPU, scaled_dot_product_attention dispatches to
``_scaled_dot_product_flash_attention_for_cpu``, which it does not handle, so ``cp_ring``
reports that error instead of figures.
"""

from __future__ import annotations  # noqa: I001  (refmp before NumPy, below)

import argparse
import json
import os
import statistics
import time

import refmp  # noqa: F401  (first: it sets OpenBLAS's thread spin before NumPy loads)

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from mpi4py import MPI

from refmp.cli.bench import PRESETS
from refmp.nn import GPTConfig
from refmp.parallel.pipeline.partition import rank_chunks
from refmp.parallel.pipeline.schedules import ChunkPlacement
from refmp.training.datasets import Dataset, get_batch
from refmp.training.trainer import TrainConfig, Trainer
from torch_anchor import TorchGPT, init_gloo, round_ratios, torch_adamw

LAYOUTS = {"zero3": dict(zero=3), "pp_1f1b": dict(pp=2, microbatches=8, schedule="1f1b"),
           "pp_zb": dict(pp=2, microbatches=8, schedule="zb-h1"),
           "tp_sp": dict(tp=2, sequence_parallel=True), "cp_ring": dict(cp=2, cp_algo="ring")}


def clip_(params, max_norm: float, summed: bool = False, uncounted=None) -> float:
    """Scale the gradients to a global L2 norm of at most ``max_norm``: a sharded DTensor's
    square from its local shard summed over ranks, a replicated one's counted once; plain
    gradients counted once, or with ``summed`` summed over ranks (a pipeline stage's own);
    ``uncounted``: a parameter scaled but left out of the norm (a tied copy). A partial
    sum (a sequence-parallel LayerNorm's gradient) is all-reduced first, as the optimizer
    would. Returns the norm before clipping."""
    from torch.distributed.tensor import DTensor, Replicate

    over, here = torch.zeros(()), torch.zeros(())
    for p in params:
        g = p.grad
        if g is None or p is uncounted:
            continue
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                p.grad = g = g.redistribute(placements=[Replicate()] * len(g.placements))
            sq = g.to_local().pow(2).sum()
            if any(pl.is_shard() for pl in g.placements):
                over += sq
            else:
                here += sq
        elif summed:
            over += g.pow(2).sum()
        else:
            here += g.pow(2).sum()
    dist.all_reduce(over)
    norm = float((over + here).sqrt())
    if norm > max_norm:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(max_norm / (norm + 1e-6))
    return norm


def torch_zero3(host, s, cfg, x, y, rows):
    """FSDP2: every block its own unit (its weights gathered just before use), then the rest."""
    from torch.distributed.fsdp import fully_shard

    m = TorchGPT(host, s["n_head"], s["n_layer"])
    for block in m.h:
        fully_shard(block)
    fully_shard(m)
    opt = torch_adamw(m, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2))
    tx, ty = torch.tensor(x[rows]), torch.tensor(y[rows])

    def step():
        opt.zero_grad(set_to_none=True)
        loss = m(tx, ty)  # this rank's rows' mean; FSDP2 averages the gradients over ranks
        loss.backward()
        norm = clip_(list(m.parameters()), cfg.grad_clip)
        opt.step()
        return MPI.COMM_WORLD.allreduce(float(loss.detach())) / MPI.COMM_WORLD.size, norm
    return step


def torch_pipe(host, s, cfg, x, y, rows, zero_bubble: bool):
    """torch.distributed.pipelining: this rank's stage (refmp's own split of the blocks),
    the tied embedding's two copies summed after the schedule, clipping over both stages."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleavedZeroBubble

    world = MPI.COMM_WORLD
    n = world.size
    mcfg = GPTConfig(s["vocab"], s["block_size"], s["n_layer"], s["n_head"], s["n_embd"])
    (c, layers), = rank_chunks(mcfg, s["block_size"], world.rank, ChunkPlacement(n)).items()
    first, last = c == 0, c == n - 1
    m = TorchGPT(host, s["n_head"], s["n_layer"], list(layers), first, last)
    stage = PipelineStage(m, c, n, torch.device("cpu"))
    V = s["vocab"]

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
    sched = (ScheduleInterleavedZeroBubble([stage], cfg.microbatches, loss_fn) if zero_bubble
             else Schedule1F1B(stage, cfg.microbatches, loss_fn))
    opt = torch_adamw(m, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2))
    tied = m.wte.weight if first else m.lm_head
    tx, ty = torch.tensor(x), torch.tensor(y)

    def step():
        opt.zero_grad(set_to_none=True)
        losses = []
        if first:
            sched.step(tx)
        else:
            sched.step(target=ty, losses=losses)
        dist.all_reduce(tied.grad)  # the tied wte: embedding's and head's gradients summed
        norm = clip_(list(m.parameters()), cfg.grad_clip, summed=True,
                     uncounted=tied if last else None)  # the tied weight counted on stage 0
        opt.step()
        loss = float(torch.stack(losses).detach().mean()) if last else None
        return world.bcast(loss, root=n - 1), norm
    return step


def torch_tp_sp(host, s, cfg, x, y, rows):
    """DTensor tensor parallelism with sequence parallelism (Korthikanti et al. 2022), each
    block's plan as torchtitan writes it: LayerNorms on sequence shards, c_attn and c_fc
    column-parallel after the sequence all-gather, c_proj and mlp_proj row-parallel with a
    reduce-scatter back to sequence shards. The embeddings, ln_f and the head stay
    replicated: the first block slices its sequence shard, and ln_f's output is gathered so
    every rank computes the whole head (vocab 256: a few per cent of the step)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp = MPI.COMM_WORLD.size
    mesh = init_device_mesh("cpu", (tp,))
    m = TorchGPT(host, s["n_head"], s["n_layer"], tp=tp)
    block_plan = {"ln_1": SequenceParallel(), "c_attn": ColwiseParallel(input_layouts=Shard(1)),
                  "c_proj": RowwiseParallel(output_layouts=Shard(1)),
                  "ln_2": SequenceParallel(), "c_fc": ColwiseParallel(input_layouts=Shard(1)),
                  "mlp_proj": RowwiseParallel(output_layouts=Shard(1))}
    for block in m.h:
        parallelize_module(block, mesh, block_plan)
    parallelize_module(m, mesh, {
        "h.0": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1),
                                  use_local_output=True),
        "ln_f": SequenceParallel()})
    # ln_f's output gathered along the sequence for the replicated head
    parallelize_module(m.ln_f, mesh, PrepareModuleOutput(output_layouts=Shard(1),
                                                         desired_output_layouts=Replicate(),
                                                         use_local_output=True))
    opt = torch_adamw(m, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2))
    tx, ty = torch.tensor(x), torch.tensor(y)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = m(tx, ty)  # the global batch's mean, the same on every rank
        loss.backward()
        norm = clip_(list(m.parameters()), cfg.grad_clip)
        opt.step()
        return float(loss.detach()), norm
    return step


def torch_cp_ring(host, s, cfg, x, y, rows):
    """torch's context parallelism: inside ``context_parallel`` the batch, targets and
    positions are split along the sequence (head-tail balanced for causal attention) and
    scaled_dot_product_attention runs as ring attention; DDP averages the gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (MPI.COMM_WORLD.size,))
    m = torch.nn.parallel.DistributedDataParallel(TorchGPT(host, s["n_head"], s["n_layer"]))
    opt = torch_adamw(m, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2))
    tx, ty, pos = torch.tensor(x), torch.tensor(y), torch.arange(x.shape[1])

    def step():
        opt.zero_grad(set_to_none=True)
        with context_parallel(mesh, buffers=[tx, ty, pos], buffer_seq_dims=[1, 1, 0]):
            loss = m(tx, ty, pos)  # my tokens' mean (equal shares)
            loss.backward()
        norm = clip_(list(m.parameters()), cfg.grad_clip)
        opt.step()
        return MPI.COMM_WORLD.allreduce(float(loss.detach())) / MPI.COMM_WORLD.size, norm
    return step


TORCH = {"zero3": torch_zero3,
         "pp_1f1b": lambda *a: torch_pipe(*a, zero_bubble=False),
         "pp_zb": lambda *a: torch_pipe(*a, zero_bubble=True),
         "tp_sp": torch_tp_sp, "cp_ring": torch_cp_ring}


def run_layout(name: str, s: dict, steps: int, rounds: int) -> dict:
    """One layout: both programs built from the same weights, checked, then timed."""
    world = MPI.COMM_WORLD
    n_steps = 2 + rounds * steps
    cfg = TrainConfig(n_layer=s["n_layer"], n_head=s["n_head"], n_embd=s["n_embd"],
                      block_size=s["block_size"], batch_size=s["batch_size"], steps=n_steps,
                      dtype="float32", lr_schedule="constant", lr=1e-4, progress=False,
                      **LAYOUTS[name])
    rng = np.random.default_rng(1)
    n_tok = (s["batch_size"] * n_steps + 1) * s["block_size"] + 1
    tr = Trainer(cfg, dataset=Dataset(rng.integers(0, s["vocab"], n_tok), s["vocab"], "random"))
    host = world.bcast(tr.runner.full_params())  # before any step: the initial weights
    B = cfg.batch_size
    x, y = get_batch(tr.ds.tokens, 0, B, tr.T, slice(0, B), tr.perm)  # step 0's whole batch
    torch_step = TORCH[name](host, s, cfg, x, y, tr.rows)
    # step 0 (also the warm-up): the losses must agree, and the gradients' norms show that
    # torch's program reduces its gradients as refmp does
    rec = tr.step()
    (l_r, g_r), (l_t, g_t) = (rec["loss"], rec["grad_norm"]), torch_step()
    assert abs(l_r - l_t) <= 1e-5 * abs(l_t), (name, l_r, l_t)
    assert abs(g_r - g_t) <= 1e-4 * g_t, (name, "gradient norms", g_r, g_t)
    times, cpu = {"refmp": [], "torch": []}, {"refmp": [], "torch": []}
    for _ in range(rounds):
        for who, fn in (("refmp", tr.step), ("torch", torch_step)):
            for _ in range(steps):
                world.Barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                wall, busy = time.perf_counter() - t0, time.process_time() - c0
                times[who].append(world.allreduce(wall, op=MPI.MAX))
                cpu[who].append(world.allreduce(busy, op=MPI.MAX))
    med, cpu_med = ({k: 1e3 * statistics.median(v) for k, v in d.items()} for d in (times, cpu))
    r = round_ratios(times, steps)
    return {"refmp_ms": round(med["refmp"], 2), "torch_ms": round(med["torch"], 2),
            "refmp_over_torch": round(med["refmp"] / med["torch"], 3), "per_round_ratio": r,
            # CPU time (all the process's threads), the busiest rank's: what a step costs
            # apart from waiting, steadier than the wall clock on a shared machine
            "cpu_ms": {k: round(v, 2) for k, v in cpu_med.items()},
            "first_loss": {"refmp": l_r, "torch": l_t},
            "first_grad_norm": {"refmp": round(g_r, 6), "torch": round(g_t, 6)}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round (5)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (3)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of: " + ", ".join(LAYOUTS))
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    for name in ("n_layer", "n_embd", "n_head", "block_size", "batch_size", "vocab"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                        help="override the preset (as torch_anchor.py)")
    args = ap.parse_args()
    names = args.layouts.split(",")
    world = MPI.COMM_WORLD
    bad = [n for n in names if n not in LAYOUTS]
    if bad or world.size != 2:
        if world.rank == 0:
            print(f"torch_peers: unknown layouts {bad}" if bad else
                  "torch_peers: run under `mpiexec -n 2`")
        raise SystemExit(2)
    torch.set_num_threads(1)
    init_gloo(world)
    s = dict(PRESETS[args.preset])
    s.update({k: getattr(args, k) for k in s if getattr(args, k, None) is not None})
    out = {"preset": args.preset, "model": s, "ranks": world.size, "torch_threads": 1,
           "numpy_threads": os.environ.get("OMP_NUM_THREADS"), "layouts": {}}
    for name in names:
        try:
            out["layouts"][name] = run_layout(name, s, args.steps, args.rounds)
        except NotImplementedError as e:  # a peer that does not run on the CPU: said so
            out["layouts"][name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        if world.rank == 0 and not args.json:
            print(name, json.dumps(out["layouts"][name]), flush=True)
    if world.rank == 0 and args.json:
        print(json.dumps(out, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
