"""The speed anchor for `refmp bench`: the same GPT-2 in PyTorch eager, timed beside refmp.

    python benchmarks/torch_anchor.py [--preset small] [--steps 20] [--rounds 3] [--device gpu]
    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/torch_anchor.py   (data parallel)

PyTorch is not a refmp dependency; install it to run this (`pip install torch`). The script
builds refmp's model, copies its initial weights into an eager PyTorch GPT-2 (nanoGPT style:
`F.scaled_dot_product_attention`, `torch.optim.AdamW`, `clip_grad_norm_`), checks that both
compute the same first loss, then times training steps of each in alternating rounds on the
same data and the same number of threads, and prints medians and the ratio, and each
round's ratio with their median (a round's two halves run back to back, so a slow spell on
a shared machine weighs on both: the steadier figure there). With
``--device gpu`` refmp runs on CuPy and PyTorch on CUDA (timed with device synchronization).

Under ``mpiexec -n N`` it times data parallelism instead: refmp's own training step
(``refmp.training.trainer.Trainer`` with ``--dp N``, what ``refmp train`` and ``refmp bench`` run:
bucketed all-reduce, clipping, AdamW) against PyTorch's DistributedDataParallel over gloo,
each rank with OMP_NUM_THREADS threads, both on the same global batch of the preset; a step's
time is the slowest rank's (every rank starts it together).
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
import torch.nn.functional as F

from refmp.runtime import backend
from refmp.cli.bench import PRESETS
from refmp.nn import GPT, GPTConfig
from refmp.training.optim import AdamW, clip_grad_norm


class TorchGPT(torch.nn.Module):
    """GPT-2 with refmp's parameter layout ((in, out) weights), as plain tensors."""

    def __init__(self, params: dict, n_head: int, n_layer: int):
        super().__init__()
        self.n_head, self.n_layer = n_head, n_layer
        self.p = torch.nn.ParameterDict(
            {k.replace(".", "_"): torch.nn.Parameter(torch.tensor(v)) for k, v in params.items()})

    def forward(self, idx, targets):
        p = self.p
        B, T = idx.shape
        x = p["wte_weight"][idx] + p["wpe_weight"][:T]
        C = x.shape[-1]
        for i in range(self.n_layer):
            def w(name, i=i):
                return p[f"h_{i}_{name}".replace(".", "_")]
            h = F.layer_norm(x, (C,), w("ln_1.weight"), w("ln_1.bias"), 1e-5)
            q, k, v = (h @ w("attn.c_attn.weight") + w("attn.c_attn.bias")).split(C, dim=2)
            q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            a = a.transpose(1, 2).reshape(B, T, C)
            x = x + a @ w("attn.c_proj.weight") + w("attn.c_proj.bias")
            h = F.layer_norm(x, (C,), w("ln_2.weight"), w("ln_2.bias"), 1e-5)
            h = F.gelu(h @ w("mlp.c_fc.weight") + w("mlp.c_fc.bias"), approximate="tanh")
            x = x + h @ w("mlp.c_proj.weight") + w("mlp.c_proj.bias")
        x = F.layer_norm(x, (C,), p["ln_f_weight"], p["ln_f_bias"], 1e-5)
        logits = x @ p["wte_weight"].T
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def dp_main(s: dict, steps: int, rounds: int) -> None:
    """Data parallel over this MPI job's ranks (see the module docstring)."""
    import socket

    import torch.distributed as dist
    from mpi4py import MPI

    from refmp.training.datasets import Dataset, get_batch
    from refmp.training.trainer import TrainConfig, Trainer

    world = MPI.COMM_WORLD
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if world.rank == 0:
        with socket.socket() as sock:  # a free port for gloo's rendezvous
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    port = world.bcast(port if world.rank == 0 else None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world.rank,
                            world_size=world.size)
    n_steps = 1 + rounds * steps
    cfg = TrainConfig(n_layer=s["n_layer"], n_head=s["n_head"], n_embd=s["n_embd"],
                      block_size=s["block_size"], batch_size=s["batch_size"], steps=n_steps,
                      dtype="float32", lr_schedule="constant", lr=1e-4, progress=False,
                      dp=world.size)
    rng = np.random.default_rng(1)
    n_tok = (s["batch_size"] * n_steps + 1) * s["block_size"] + 1
    tr = Trainer(cfg, dataset=Dataset(rng.integers(0, s["vocab"], n_tok), s["vocab"], "random"))
    host = world.bcast(tr.runner.full_params())  # before any step: the initial weights
    tmodel = torch.nn.parallel.DistributedDataParallel(TorchGPT(host, s["n_head"], s["n_layer"]))
    p = tmodel.module.p
    topt = torch.optim.AdamW(
        [{"params": [v for v in p.values() if v.ndim >= 2], "weight_decay": cfg.weight_decay},
         {"params": [v for v in p.values() if v.ndim < 2], "weight_decay": 0.0}],
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    x, y = get_batch(tr.ds.tokens, 0, cfg.batch_size, tr.T, tr.rows, tr.perm)  # step 0's rows
    tx, ty = torch.tensor(x), torch.tensor(y)

    def torch_step():
        topt.zero_grad(set_to_none=True)
        loss = tmodel(tx, ty)  # this rank's mean; DDP averages the gradients over ranks
        loss.backward()
        torch.nn.utils.clip_grad_norm_(tmodel.parameters(), cfg.grad_clip)
        topt.step()
        return float(loss.detach())

    l_refmp = tr.step()["loss"]  # the global mean of step 0's batch (also the warm-up)
    l_torch = world.allreduce(torch_step()) / world.size
    assert abs(l_refmp - l_torch) < 1e-4 * abs(l_torch), (l_refmp, l_torch)
    times = {"refmp": [], "torch": []}
    for _ in range(rounds):
        for name, fn in (("refmp", tr.step), ("torch", torch_step)):
            for _ in range(steps):
                world.Barrier()
                t0 = time.perf_counter()
                fn()
                times[name].append(world.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    if world.rank == 0:
        print(json.dumps({"preset": s, "dp": world.size, "threads_per_rank": torch.get_num_threads(),
                          "first_loss": {"refmp": l_refmp, "torch": l_torch},
                          "ms_per_step": med, "refmp_over_torch_time": med["refmp"] / med["torch"],
                          "per_round_ratio": (r := round_ratios(times, steps)),
                          "median_round_ratio": round(statistics.median(r), 3)},
                         indent=1))
    dist.destroy_process_group()


def round_ratios(times: dict, steps: int) -> list[float]:
    """refmp's median step over torch's within each round (the two ran back to back, so a
    slow spell on the shared machine weighs on both): steadier than the ratio of medians."""
    per = {k: [statistics.median(v[i:i + steps]) for i in range(0, len(v), steps)]
           for k, v in times.items()}
    return [round(r / t, 3) for r, t in zip(per["refmp"], per["torch"], strict=True)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per round (20)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (3)")
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    for name in ("n_layer", "n_embd", "n_head", "block_size", "batch_size", "vocab"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    args = ap.parse_args()
    s = dict(PRESETS[args.preset])
    s.update({k: getattr(args, k) for k in s if getattr(args, k, None) is not None})
    if int(os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1) > 1:
        return dp_main(s, args.steps, args.rounds)  # under mpiexec -n N
    gpu = args.device == "gpu"
    if gpu:
        backend.use("cupy")
    dev = "cuda" if gpu else "cpu"

    def sync():
        if gpu:
            backend.sync()
            torch.cuda.synchronize()

    cfg = GPTConfig(s["vocab"], s["block_size"], s["n_layer"], s["n_head"], s["n_embd"])
    model = GPT.create(cfg, seed=0, dtype="float32")
    host = {k: backend.to_host(v).copy() for k, v in model.params.items()}
    tmodel = TorchGPT(host, cfg.n_head, cfg.n_layer).to(dev)
    decay = [p for k, p in tmodel.p.items() if p.ndim >= 2]
    other = [p for k, p in tmodel.p.items() if p.ndim < 2]
    topt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": other, "weight_decay": 0.0}], lr=1e-4)
    opt = AdamW(model.params, lr=1e-4, weight_decay=0.1)
    rng = np.random.default_rng(1)
    x = rng.integers(0, s["vocab"], (s["batch_size"], s["block_size"]))
    y = rng.integers(0, s["vocab"], (s["batch_size"], s["block_size"]))
    tx, ty = torch.tensor(x, device=dev), torch.tensor(y, device=dev)
    x, y = backend.from_host(x), backend.from_host(y)

    def refmp_step():
        model.zero_grad()
        loss, cache = model.forward(x, y)
        model.backward(cache)
        clip_grad_norm(model.grads, 1.0)
        opt.step(model.grads)
        return float(loss)

    def torch_step():
        topt.zero_grad(set_to_none=True)
        loss = tmodel(tx, ty)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(tmodel.parameters(), 1.0)
        topt.step()
        return float(loss.detach())

    l_refmp, l_torch = refmp_step(), torch_step()  # also the warm-up
    assert abs(l_refmp - l_torch) < 1e-4 * abs(l_torch), (l_refmp, l_torch)
    times = {"refmp": [], "torch": []}
    for _ in range(args.rounds):
        for name, fn in (("refmp", refmp_step), ("torch", torch_step)):
            for _ in range(args.steps):
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                times[name].append(time.perf_counter() - t0)
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    ratios = round_ratios(times, args.steps)
    tokens = s["batch_size"] * s["block_size"]
    out = {"preset": args.preset, "model": s, "device": args.device,
           "torch_threads": torch.get_num_threads(),
           "first_loss": {"refmp": l_refmp, "torch": l_torch},
           "ms_per_step": med, "tokens_per_s": {k: tokens / (v / 1e3) for k, v in med.items()},
           "refmp_over_torch_time": med["refmp"] / med["torch"],
           "per_round_ratio": ratios, "median_round_ratio": round(statistics.median(ratios), 3)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
