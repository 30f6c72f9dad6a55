"""Tutorial 1: memory. Activation recomputation and mixed precision, measured against the formulas.

Run:  mpiexec -n 2 python tutorials/01_memory.py            (any number of ranks works)
      mpiexec -n 2 python tutorials/01_memory.py --plot docs/img/memory_vs_seq.png

It prints
  1. ZeRO's bytes per parameter with mixed precision (bf16 weights and gradients, fp32 masters
     and AdamW moments: 2 + 2 + 12, Rajbhandari et al. 2020 sec. 3.1) for each stage on this
     many ranks: the formula (refmp.cost.zero.memory_per_rank) beside what every
     rank measured in a real step;
  2. one model on one rank: params, grads, optimizer state and peak activations for
     --recompute none / selective / full (Korthikanti et al. 2022) x fp32 / bf16, with the
     exact relations the tests hold: selective keeps what none keeps (refmp's attention,
     refmp.nn.flash, already keeps no (T, T) softmax: only each row's log-sum-exp, recomputing
     the softmax in blocks in the backward), bf16 halves every float the caches keep (the int64
     token ids stay);
  3. peak activations against the sequence length T for the three modes, in fp32 and bf16:
     all three grow linearly with T (no T^2 term); with --plot, the figure.
It exits non-zero if a measured figure disagrees with its formula.
"""

import sys

import numpy as np
from mpi4py import MPI

from refmp.cost.zero import memory_per_rank, padded, unit_sizes
from refmp.distributed.grid import ProcessGrid
from refmp.training.datasets import Dataset
from refmp.training.trainer import TrainConfig, Trainer

world = MPI.COMM_WORLD
rank0 = world.rank == 0
failures = []
V = 32
ds = Dataset(np.random.default_rng(0).integers(0, V, 20_000), V, "random tokens")


def say(*a):
    if rank0:
        print(*a, flush=True)


def config(**kw) -> TrainConfig:
    base = dict(n_layer=2, n_head=4, n_embd=32, block_size=32, batch_size=4, steps=1,
                lr=0.01, warmup_steps=1, dtype="float32", progress=False)
    return TrainConfig(**{**base, **kw})


def check(ok: bool, what: str) -> None:
    if not ok:
        failures.append(what)
        print(f"   MISMATCH on rank {world.rank}: {what}", flush=True)


# --- 1. ZeRO's bytes per parameter with bf16, on this many ranks ------------------------------
n = world.size
say(f"1. ZeRO with bf16 on dp = {n}: bytes per parameter (params + grads + optimizer)")
for stage in range(4):
    cfg = config(dp=n, zero=stage, batch_size=4 * n, mixed_precision="bf16")
    tr = Trainer(cfg, dataset=ds)
    tr.step()
    sizes = unit_sizes(tr.mcfg)  # wte, wpe, each block, ln_f
    held = sum(padded(s, n) for s in sizes.values()) if stage else sum(sizes.values())
    want = memory_per_rank(sizes, n, stage, itemsize=4, compute=2)  # the formula
    mem = tr.memory()  # what this rank holds
    for k in ("params", "grads", "optimizer"):
        check(mem[k] == want[k], f"stage {stage} {k}: measured {mem[k]}, formula {want[k]}")
    per = {0: "16", 1: f"4 + 12/{n}", 2: f"2 + 14/{n}", 3: f"16/{n}"}[stage]
    total = sum(mem[k] for k in ("params", "grads", "optimizer"))
    say(f"   stage {stage}: {total / held:6.2f} B/param measured  ({per} = "
        f"{sum(want.values()) / held:.2f} formula; params {mem['params']:,}, grads "
        f"{mem['grads']:,}, optimizer {mem['optimizer']:,} bytes on each rank)")

# --- 2. one model, one rank: recomputation x precision ----------------------------------------
self_grid = ProcessGrid(MPI.COMM_SELF)


def measure(**kw) -> dict:
    tr = Trainer(config(**kw), grid=self_grid, dataset=ds)
    tr.step()
    return {**tr.memory(), "N": tr.num_params}


if rank0:
    cfg = config()
    B, T, L = cfg.batch_size, cfg.block_size, cfg.n_layer
    ids = 8 * (2 * B * T + T)  # int64 token ids, targets and positions in the caches
    say(f"\n2. one rank, {L} layers, n_embd {cfg.n_embd}, T {T}, batch {B}: bytes held")
    say(f"   {'precision':<9} {'recompute':<10} {'params':>9} {'grads':>9} {'optimizer':>10} "
        f"{'activations':>12}")
    got = {}
    for mp in ("none", "bf16"):
        for rc in ("none", "selective", "full"):
            m = got[mp, rc] = measure(mixed_precision=mp, recompute=rc)
            say(f"   {'fp32' if mp == 'none' else mp:<9} {rc:<10} {m['params']:>9,} "
                f"{m['grads']:>9,} {m['optimizer']:>10,} {m['activations']:>12,}")
            w = (4, 4, 8) if mp == "none" else (2, 2, 12)  # bytes per parameter
            check((m["params"], m["grads"], m["optimizer"]) == tuple(x * m["N"] for x in w),
                  f"{mp} {rc}: {w} bytes per parameter")
        saved = got[mp, "none"]["activations"] - got[mp, "selective"]["activations"]
        check(saved == 0, f"{mp}: selective keeps what none keeps (no softmax to drop)")
    for rc in ("none", "selective", "full"):
        a32, a16 = got["none", rc]["activations"], got["bf16", rc]["activations"]
        check(2 * (a16 - ids) == a32 - ids, f"{rc}: bf16 halves every float activation")
    say("   selective saves nothing: the attention keeps no softmax (only its log-sum-exp,")
    say("   L B NH T w bytes); bf16 halves every float kept;")
    say("   the weights and optimizer state stay 16 bytes per parameter either way")

# --- 3. activations against the sequence length -----------------------------------------------
if rank0:
    Ts = [8, 16, 32, 64, 128]
    say("\n3. peak activations (KiB) against T, batch 4")
    say("   " + f"{'T':>5}" + "".join(f"{mp + ' ' + rc:>16}" for mp in ("fp32", "bf16")
                                       for rc in ("none", "selective", "full")))
    curves = {}
    for T in Ts:
        row = []
        for mp in ("none", "bf16"):
            for rc in ("none", "selective", "full"):
                a = measure(block_size=T, mixed_precision=mp, recompute=rc)["activations"]
                curves.setdefault((mp, rc), []).append(a)
                row.append(f"{a / 1024:16.1f}")
        say(f"   {T:>5}" + "".join(row))
    if "--plot" in sys.argv:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = sys.argv[sys.argv.index("--plot") + 1]
        fig, ax = plt.subplots(figsize=(6, 4))
        for (mp, rc), ys in curves.items():
            ax.plot(Ts, [y / 2**20 for y in ys], marker="o",
                    linestyle="-" if mp == "none" else "--",
                    color={"none": "C0", "selective": "C1", "full": "C2"}[rc],
                    label=f"{'fp32' if mp == 'none' else mp}, recompute {rc}")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("peak activations per rank (MiB)")
        ax.set_title("2 layers, n_embd 32, 4 heads, batch 4 (refmp, measured)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        say(f"   plot written to {path}")

bad = world.allgather(len(failures))
if sum(bad):
    say(f"\nFAILED: {sum(bad)} figure(s) disagree with their formulas")
    sys.exit(1)
say("\nOK: memory per rank equals the formulas (recompute none/selective/full, fp32/bf16, "
    "ZeRO 0-3)")
