"""Optimizers (SGD, AdamW) and clipping by the global gradient norm.

Both act on dicts ``{name: array}`` of parameters and gradients, in place. They never ask
whether an array is a whole parameter or a shard of one: every update is elementwise, so a
rank that holds a shard updates its shard exactly as the serial run updates those elements.
What a later step depends on, each optimizer saves and restores itself (a checkpoint's
part, refmp.checkpoint.sharded): ``state()`` gives {"kind", "t", "moments": {moment: {name:
array}}}, ``load_state`` sets it from host arrays.

Only two things need the parameter's identity, and both are passed in:

* weight decay applies to parameters whose *global* ndim >= 2 (matrices and embeddings, not
  biases or LayerNorm gains); a shard of a matrix may be flattened, so callers that flatten
  pass ``decay`` names explicitly;
* the global gradient norm must count every element once across ranks: each rank sums the
  squares of the elements it owns, and ``sum_sq`` adds those partial sums over the ranks that
  own different elements (refmp.runtime.arrays.global_grad_norm, which the engine uses too).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable

from refmp.runtime.arrays import global_grad_norm
from refmp.runtime.backend import array_module, from_host
from refmp.runtime.cpu import rows


def decay_names(params: dict) -> set[str]:
    """Names of the parameters that get weight decay: ndim >= 2 (as GPT-2 training does)."""
    return {k for k, p in params.items() if p.ndim >= 2}


class SGD:
    """p -= lr * (g + wd * p), with optional momentum (torch.optim.SGD semantics).

    Weight decay is applied to the ``decay`` names only (default: ndim >= 2).
    """

    def __init__(self, params: dict, lr: float = 0.1, momentum: float = 0.0,
                 weight_decay: float = 0.0, decay: Iterable[str] | None = None):
        self.params = params
        self.lr = lr
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.decay = set(decay_names(params) if decay is None else decay)
        self.t = 0  # steps taken
        self.buffers: dict[str, object] = {}  # b of each parameter, from its first step on

    def step(self, grads: dict) -> None:
        self.t += 1
        for k, p in self.params.items():
            g = grads[k]
            if self.weight_decay and k in self.decay:
                g = g + self.weight_decay * p
            if self.momentum:
                buf = self.buffers.get(k)
                buf = g.copy() if buf is None else buf * self.momentum + g
                self.buffers[k] = buf
                g = buf
            p -= self.lr * g

    def state(self) -> dict:
        """{"kind": "sgd", "t", "moments": {"momentum": buffers}}, no moment before the first
        step with momentum; the live arrays."""
        return {"kind": "sgd", "t": self.t,
                "moments": {"momentum": self.buffers} if self.buffers else {}}

    def load_state(self, state: dict) -> None:
        """Set what state() gives from {"t", "moments"} of host arrays (no "momentum": none yet)."""
        self.t = state["t"]
        self.buffers = {k: from_host(a).astype(self.params[k].dtype)
                        for k, a in state["moments"].get("momentum", {}).items()}

    def state_bytes(self) -> int:
        return sum(int(v.nbytes) for v in self.buffers.values())


class AdamW:
    """AdamW (Loshchilov & Hutter 2019) with torch.optim.AdamW's exact update:

        p <- p * (1 - lr * wd)                      (decoupled decay, ``decay`` names only)
        m <- b1 m + (1 - b1) g;   v <- b2 v + (1 - b2) g^2
        p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    """

    def __init__(self, params: dict, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, decay: Iterable[str] | None = None):
        self.params = params
        self.lr = lr
        self.betas = betas
        self.eps = eps
        self.weight_decay = weight_decay
        self.decay = set(decay_names(params) if decay is None else decay)
        self.t = 0
        self.m = {k: array_module(p).zeros_like(p) for k, p in params.items()}  # 1st moment
        self.v = {k: array_module(p).zeros_like(p) for k, p in params.items()}  # 2nd moment

    def step(self, grads: dict) -> None:
        self.t += 1
        b1, b2 = self.betas
        bc1 = 1.0 - b1**self.t
        bc2_sqrt = math.sqrt(1.0 - b2**self.t)
        for k, p in self.params.items():
            decay = 1.0 - self.lr * self.weight_decay if self.weight_decay and k in self.decay \
                else None
            update = functools.partial(_adamw, b1=b1, b2=b2, bc1=bc1, bc2_sqrt=bc2_sqrt,
                                       lr=self.lr, eps=self.eps, decay=decay)
            rows(update, p, grads[k], self.m[k], self.v[k])  # in threads (refmp.runtime.cpu)

    def state(self) -> dict:
        """{"kind": "adamw", "t", "moments": {"m": m, "v": v}}; the live arrays."""
        return {"kind": "adamw", "t": self.t, "moments": {"m": self.m, "v": self.v}}

    def load_state(self, state: dict) -> None:
        """Set what state() gives from {"t", "moments"} of host arrays (one not given: zeros)."""
        self.t = state["t"]
        for name, moment in (("m", self.m), ("v", self.v)):
            for k, a in moment.items():
                a[...] = from_host(state["moments"][name][k]) if name in state["moments"] else 0

    def state_bytes(self) -> int:
        return sum(int(a.nbytes) for a in self.m.values()) + sum(int(a.nbytes) for a in self.v.values())


def _adamw(p, g, m, v, *, b1, b2, bc1, bc2_sqrt, lr, eps, decay):
    """AdamW's update of p, m and v in place, elementwise (any block of rows of them).

    The class docstring's formulas, in that order, through one scratch buffer ``t`` (no
    fresh temporaries: the operations, and so the bits, are those of the plain expressions).
    """
    xp = array_module(p)
    t = xp.empty_like(m)
    if decay is not None:
        p *= decay
    m *= b1
    m += xp.multiply(g, 1.0 - b1, out=t)  # m = b1 m + (1 - b1) g
    v *= b2
    xp.multiply(g, g, out=t)
    t *= 1.0 - b2
    v += t  # v = b2 v + (1 - b2) g^2
    xp.sqrt(v, out=t)
    t /= bc2_sqrt
    t += eps  # sqrt(v) / sqrt(1 - b2^t) + eps
    xp.divide(m, t, out=t)
    t *= lr / bc1
    p -= t  # p = p - lr / (1 - b1^t) * m / (...)


def clip_grad_norm(grads: dict, max_norm: float,
                   sum_sq: Callable[[float], float] | None = None) -> float:
    """Scale gradients in place so their global norm is at most ``max_norm``.

    torch.nn.utils.clip_grad_norm_ semantics: coef = max_norm / (norm + 1e-6), applied only
    when it is below 1. Returns the norm before clipping.
    """
    norm = global_grad_norm(grads, sum_sq)
    clip_grads(grads, max_norm, norm)
    return norm


def clip_grads(grads: dict, max_norm: float, norm: float) -> None:
    """Scale gradients in place by max_norm / (norm + 1e-6) when that is below 1 (torch's rule),
    given the global norm (computed by whoever knows which elements each rank owns)."""
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in grads.values():
            g *= coef


class LossScaler:
    """fp16's dynamic loss scaling (Micikevicius et al. 2018, sec. 3.2; as torch's GradScaler
    and Megatron's DynamicGradScaler): backward starts from ``scale`` instead of 1, so that
    small gradients survive fp16's range (its smallest normal is 6e-5); the gradients are
    divided by it again, in fp32, before the optimizer. A step whose gradient holds an inf or
    a NaN (the global norm is then not finite: the same answer on every rank, from one
    all-reduce) is skipped and the scale halved; after ``window`` good steps in a row it
    doubles. ``scale`` and ``good`` are training state (a checkpoint saves ``state()``).
    """

    def __init__(self, scale: float = 65536.0, window: int = 1000, min_scale: float = 1.0):
        self.scale = float(scale)
        self.window = window
        self.min_scale = min_scale
        self.good = 0

    def update(self, finite: bool) -> bool:
        """After a step's gradient norm: True when the step may be taken."""
        if not finite:
            self.scale = max(self.min_scale, self.scale / 2)
            self.good = 0
            return False
        self.good += 1
        if self.good >= self.window:
            self.scale = self.scale * 2
            self.good = 0
        return True

    def state(self) -> dict:
        return {"scale": self.scale, "good": self.good}

    def load_state(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good = int(state["good"])
