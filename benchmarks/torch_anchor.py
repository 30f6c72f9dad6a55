"""The speed anchor for `refmp bench`: the same GPT-2 in PyTorch eager, timed beside refmp.

    python benchmarks/torch_anchor.py [--preset small|tiny|gpt2] [--steps 20] [--rounds 3] [--device gpu]
    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/torch_anchor.py   (data parallel)

PyTorch is not a refmp dependency; install it to run this (`pip install torch`). The script
builds refmp's model, copies its initial weights into an eager PyTorch GPT-2 (nanoGPT style:
`nn.Linear` and `nn.LayerNorm` blocks, `F.scaled_dot_product_attention`, `torch.optim.AdamW`,
`clip_grad_norm_`; benchmarks/torch_peers.py splits the same model), checks that both
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


class Block(torch.nn.Module):
    """One pre-LN transformer block over nn.Linear and nn.LayerNorm (what DTensor's tensor
    parallel styles and FSDP2 wrap); c_attn's output rows come as ``tp`` consecutive groups
    of (q, k, v) for the heads one tensor-parallel rank holds (the plain order when tp = 1)."""

    def __init__(self, params: dict, i: int, n_head: int, tp: int = 1):
        super().__init__()
        def linear(name, perm=None):
            w, b = (torch.tensor(params[f"h.{i}.{name}.{k}"]) for k in ("weight", "bias"))
            lin = torch.nn.Linear(*w.shape)  # refmp's (in, out) is torch's (out, in) transposed
            w, b = (w.T, b) if perm is None else (w.T[perm], b[perm])
            lin.weight.data, lin.bias.data = w.contiguous(), b.clone()
            return lin

        def norm(name):
            ln = torch.nn.LayerNorm(params[f"h.{i}.{name}.weight"].shape[0], eps=1e-5)
            ln.weight.data, ln.bias.data = (torch.tensor(params[f"h.{i}.{name}.{k}"])
                                            for k in ("weight", "bias"))
            return ln

        C = params[f"h.{i}.ln_1.weight"].shape[0]
        self.hs = C // n_head
        # rank r's columns of c_attn: its heads' q, then k, then v (Megatron's layout)
        perm = torch.arange(3 * C).view(3, tp, C // tp).transpose(0, 1).reshape(-1)
        self.ln_1, self.c_attn, self.c_proj = norm("ln_1"), linear("attn.c_attn", perm), linear("attn.c_proj")
        self.ln_2, self.c_fc, self.mlp_proj = norm("ln_2"), linear("mlp.c_fc"), linear("mlp.c_proj")

    def forward(self, x):
        qkv = self.c_attn(self.ln_1(x))  # (B, T, 3C/tp): the sequence gathered under SP
        B, T, _ = qkv.shape
        q, k, v = (t.view(B, T, -1, self.hs).transpose(1, 2) for t in qkv.chunk(3, dim=2))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(a.transpose(1, 2).reshape(B, T, -1))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class TorchGPT(torch.nn.Module):
    """GPT-2 in eager PyTorch (nanoGPT style) from refmp's parameters, or the part of it one
    pipeline stage holds: the embeddings when ``first``, ``layers``, and with ``last`` the
    final LayerNorm and the head (tied to wte; a last stage without the embeddings keeps its
    own copy, whose gradient the caller sums with the first stage's). ``forward(idx or h,
    targets=None)``: the mean loss with targets on a last stage, else its output."""

    def __init__(self, params: dict, n_head: int, n_layer: int, layers=None, first=True,
                 last=True, tp: int = 1):
        super().__init__()
        self.first, self.last = first, last
        t = {k: torch.tensor(v) for k, v in params.items() if not k.startswith("h.")}
        if first:
            self.wte = torch.nn.Embedding.from_pretrained(t["wte.weight"], freeze=False)
            self.wpe = torch.nn.Parameter(t["wpe.weight"])
        self.h = torch.nn.ModuleList(Block(params, i, n_head, tp) for i in (layers or range(n_layer)))
        if last:
            self.ln_f = torch.nn.LayerNorm(t["ln_f.weight"].shape[0], eps=1e-5)
            self.ln_f.weight.data, self.ln_f.bias.data = t["ln_f.weight"], t["ln_f.bias"]
            if not first:
                self.lm_head = torch.nn.Parameter(t["wte.weight"].clone())

    def forward(self, x, targets=None, pos=None):
        if self.first:  # pos: the positions of x's tokens (default 0..T-1)
            pos = torch.arange(x.shape[1]) if pos is None else pos
            x = self.wte(x) + self.wpe[pos]
        for block in self.h:
            x = block(x)
        if not self.last:
            return x
        logits = self.ln_f(x) @ (self.wte.weight if self.first else self.lm_head).T
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def torch_adamw(model, lr: float, weight_decay: float, betas: tuple[float, float]):
    """torch's AdamW with refmp's rule: decay the matrices, not the biases and gains."""
    ps = list(model.parameters())
    return torch.optim.AdamW([{"params": [p for p in ps if p.ndim >= 2], "weight_decay": weight_decay},
                              {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}],
                             lr=lr, betas=betas)


def init_gloo(world):
    """torch.distributed over gloo on this MPI job's ranks (rank 0 picks a free port)."""
    import socket

    import torch.distributed as dist

    if world.rank == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    port = world.bcast(port if world.rank == 0 else None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world.rank,
                            world_size=world.size)


def dp_main(s: dict, steps: int, rounds: int) -> None:
    """Data parallel over this MPI job's ranks (see the module docstring)."""
    import torch.distributed as dist
    from mpi4py import MPI

    from refmp.training.datasets import Dataset, get_batch
    from refmp.training.trainer import TrainConfig, Trainer

    world = MPI.COMM_WORLD
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    init_gloo(world)
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
    topt = torch_adamw(tmodel, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2))
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
    topt = torch_adamw(tmodel, 1e-4, 0.1, (0.9, 0.999))  # refmp's AdamW defaults
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
