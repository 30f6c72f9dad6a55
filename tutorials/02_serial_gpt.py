"""Tutorial 2: the serial GPT-2, one training step, and a gradient check you can watch.

    python tutorials/02_serial_gpt.py

Everything later in refmp splits *this* model across ranks, so it is worth seeing whole:
parameters with GPT-2's names, a forward pass that returns a cache, a backward pass that
turns the cache into gradients, and finite differences proving those gradients right.
Exits non-zero if a check fails.
"""

import sys

import numpy as np

from refmp.nn import GPT, GPTConfig
from refmp.training.datasets import ADD_CHARS, AdditionTask, get_batch
from refmp.training.optim import AdamW

# 1. The data: the built-in addition task, one 13-character problem per window.
task = AdditionTask(digits=3, seed=0, n_train=1000, n_test=10)
ds = task.dataset()
T = task.line_len
x, y = get_batch(ds.tokens, step=0, B=4, T=T)  # (4, 13) each; y is x shifted by one token
print("a batch row as text:", repr("".join(ADD_CHARS[i] for i in x[0])))

# 2. The model: GPT-2 exactly, small. float64 so finite differences are meaningful.
cfg = GPTConfig(vocab_size=ds.vocab_size, block_size=T, n_layer=2, n_head=2, n_embd=16)
model = GPT.create(cfg, seed=0, dtype="float64")
print(f"\n{model.num_params():,} parameters, GPT-2 names:")
for name, p in list(model.params.items())[:8]:
    print(f"  {name:<24} {str(p.shape):<10}")
print("  ...")

# 3. Forward returns the loss and a cache; backward consumes the cache.
loss, cache = model.forward(x, y)
model.backward(cache)
print(f"\nloss {float(loss):.4f}  (uniform guessing would give ln(13) = {np.log(13):.4f})")

# 4. Gradient check: nudge single weights by +-eps and compare the slope with backward's.
eps, worst = 1e-6, 0.0
rng = np.random.default_rng(0)
print("\ngradient check (central differences, float64):")
for name in ["wte.weight", "h.0.attn.c_attn.weight", "h.1.mlp.c_fc.bias", "ln_f.weight"]:
    p = model.params[name]
    i = tuple(int(rng.integers(0, s)) for s in p.shape)
    old = p[i]
    p[i] = old + eps
    plus = float(model.forward(x, y)[0])
    p[i] = old - eps
    minus = float(model.forward(x, y)[0])
    p[i] = old
    numeric, analytic = (plus - minus) / (2 * eps), float(model.grads[name][i])
    # finite differences carry ~1e-10 of rounding noise: judge by |diff| against that floor
    diff = abs(numeric - analytic)
    worst = max(worst, diff / (1e-8 + 1e-5 * abs(numeric)))
    print(f"  {name:<24} {str(i):<10} backward {analytic:+.10f}  numeric {numeric:+.10f}  "
          f"|diff| {diff:.1e}")

# 5. One AdamW step lowers the loss on the same batch.
AdamW(model.params, lr=1e-2).step(model.grads)
after = float(model.forward(x, y)[0])
print(f"\none AdamW step: loss {float(loss):.4f} -> {after:.4f}")

ok = worst < 1 and after < float(loss)
print("\nOK: gradients match finite differences and the step lowered the loss" if ok
      else "\nFAILED")
sys.exit(0 if ok else 1)
