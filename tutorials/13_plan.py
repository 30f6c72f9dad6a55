"""Tutorial 13: planning a layout. Predict memory and step time at any scale, then check the
memory prediction against a real run on this machine.

Run:  mpiexec -n 2 python tutorials/13_plan.py            (any number of ranks works)
      mpiexec -n 2 python tutorials/13_plan.py --plot docs/img/plan_step_time.png

It prints
  1. the planner's five fastest layouts of GPT-2 small on 64 A100s (refmp.cost.search.search:
     every layout check_layout accepts, timed by refmp.cost.model.predict, sized by
     refmp.cost.memory.memory), and why the best beats the runner-up;
  2. GPT-2 large on 64 A100s, bf16, full recomputation: the step time of each (tp, pp) split,
     term by term (GEMMs, elementwise kernels, the tp all-reduces, the pipeline's bubble and
     boundaries, the exposed dp reduction): where each layout loses its time; with --plot,
     the figure;
  3. a small model trained for one step on this many ranks, as data parallel and (on an
     even number of ranks) as a 2-stage pipeline: each rank's measured memory ledger
     (Trainer.memory()) beside the plan's prediction for its stage.
It exits non-zero if a measured figure differs from its prediction.
"""

import sys
from dataclasses import replace

from mpi4py import MPI

from refmp.cost.machines import MACHINES
from refmp.cost.memory import memory, stage_memory, total
from refmp.cost.model import Layout, predict, train_config
from refmp.cost.search import search, table
from refmp.nn.params import GPTConfig
from refmp.training.trainer import Trainer

world = MPI.COMM_WORLD
rank, n = world.Get_rank(), world.Get_size()
say = print if rank == 0 else (lambda *a, **k: None)
A100 = MACHINES["dgx-a100"]

# --- 1. the search --------------------------------------------------------------------------
gpt2 = GPTConfig(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, block_size=1024)
fits, bad = search(gpt2, 512, 64, A100, top=5)
say("1. GPT-2 small, batch 512, on 64 x dgx-a100:")
say(table(fits, bad))

# --- 2. step time against the layout --------------------------------------------------------
large = GPTConfig(n_layer=36, n_embd=1280, n_head=20, vocab_size=50257, block_size=1024)
say("\n2. GPT-2 large, batch 512, 64 x dgx-a100, bf16, full recomputation: ms per step by term")
terms = ("compute", "elementwise", "tp", "bubble", "pp", "dp", "optimizer")
say(f"{'tp x pp':>8} " + " ".join(f"{t:>9}" for t in terms) + f" {'step':>9} {'GB/rank':>8}")
rows = []
for tp, pp in [(1, 1), (1, 2), (1, 4), (1, 8), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2)]:
    lay = Layout(tp=tp, pp=pp, dp=64 // (tp * pp), recompute="full", microbatch_size=1)
    p = predict(lay, large, 512, A100)
    gb = total(memory(lay, large, 512)) / 1e9
    rows.append((f"{tp}x{pp}", p))
    say(f"{tp:>3} x {pp:<2} " + " ".join(f"{1e3 * p['seconds'][t]:>9.1f}" for t in terms)
        + f" {1e3 * p['step_seconds']:>9.1f} {gb:>8.1f}")

if "--plot" in sys.argv and rank == 0:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    bottom = [0.0] * len(rows)
    for t in terms:
        h = [1e3 * p["seconds"][t] for _, p in rows]
        ax.bar([r for r, _ in rows], h, bottom=bottom, label=t)
        bottom = [b + x for b, x in zip(bottom, h, strict=True)]
    ax.set_ylabel("ms per step (predicted)")
    ax.set_xlabel("tp x pp (dp = the rest)")
    ax.set_title("GPT-2 large on 64 A100s: where the step time goes (predicted)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(sys.argv[sys.argv.index("--plot") + 1], dpi=120)

# --- 3. the prediction against the measured ledger ------------------------------------------
small = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=13)
layouts = [Layout(dp=n, mixed_precision="none", zero=1 if n > 1 else 0)]
if n % 2 == 0:
    layouts.append(Layout(pp=2, dp=n // 2, mixed_precision="bf16", recompute="selective"))
say(f"\n3. measured on {n} rank(s) against the plan (bytes of the rank at pp coordinate r)")
wrong = 0
for lay in layouts:
    cfg = replace(train_config(lay, small, 4 * n, stage_layers=False), steps=1, progress=False)
    tr = Trainer(cfg)
    tr.step()
    mcfg, r = tr.mcfg, tr.grid.coords["pp"]
    got = tr.memory()
    want = stage_memory(train_config(lay, mcfg, 4 * n), mcfg, tr.grid.sizes, r)
    keys = ("params", "grads", "optimizer", "activations")
    same = all(got[k] == want[k] for k in keys)
    wrong += not same
    line = f"  rank {rank} pp {r}: " + ", ".join(f"{k} {got[k]} (plan {want[k]})" for k in keys)
    for text in world.gather(line, root=0) or []:
        say(f"{lay.pp} stage(s), dp {lay.dp}, {lay.mixed_precision}: {text}")
wrong = world.allreduce(wrong)
say("OK: every rank's memory is the plan's" if wrong == 0 else f"{wrong} rank(s) differ")
sys.exit(1 if wrong else 0)
