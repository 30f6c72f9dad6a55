"""Data parallelism: every rank holds the whole model and a slice of the global batch.

Shapes: B global batch (sequences per step), dp data-parallel ranks, T time.

Each dp rank takes rows [r*B/dp, (r+1)*B/dp) of the step's batch (refmp.data.dp_rows) and
computes its loss as a *share of the global mean*: the sum of its tokens' losses divided by
the global token count B*T (not by its own B/dp*T). The gradient of that share is the rank's
share of the global gradient, so a plain sum over dp gives exactly the serial gradient:

    grad = d/dw (1/(B T) sum_{all tokens} l)  =  sum_r  d/dw (1/(B T) sum_{rank r's tokens} l)

(Averaging per-rank means instead is the same only when every rank has the same token count;
summing shares is exact always, and it is what micro-batching will rely on too.)

Gradient accumulation: the rank's rows are split further into M micro-batches, run one after
the other; each micro-batch's loss is still divided by the *global* B*T, so the gradients it
adds up are exactly the serial ones, and only one reduction per step is needed. Activation
memory is then that of B/(dp M) rows.

Communication: one all-reduce of every gradient per step (4 or 8 bytes per parameter),
bucketed and overlapped with backward as in PyTorch DDP (Li et al. 2020, sec. 3.2): gradients
are grouped, in the order backward produces them (head, last block, ..., first block,
embeddings), into buckets of about ``bucket_mb`` megabytes; as soon as a bucket's last gradient
is ready its nonblocking all-reduce starts, and backward goes on computing the earlier layers
while it runs. All buckets are waited for before the optimizer. With micro-batches, only the
last micro-batch's backward communicates. ``bucket_mb = 0``: one all-reduce after backward.

MPICH (like most MPIs) has no progress thread: a started all-reduce advances only while the
rank calls into MPI. So between backward pieces we ``Test`` the open requests; that both drives
them and records (to within one piece) when each finished, for the timeline.
"""

from __future__ import annotations

import time

from refmp.backend import array_module
from refmp.comm import Comm, wait
from refmp.data import dp_rows
from refmp.errors import ConfigError


def flatten(arrays: list):
    """One contiguous 1-D buffer holding ``arrays`` back to back (a copy)."""
    xp = array_module(*arrays)
    return xp.concatenate([a.reshape(-1) for a in arrays])


def unflatten_into(flat, arrays: list) -> None:
    """Copy consecutive pieces of ``flat`` back into ``arrays`` (in place)."""
    o = 0
    for a in arrays:
        a[...] = flat[o : o + a.size].reshape(a.shape)
        o += a.size


def allreduce_grads(grads: dict, comm: Comm) -> None:
    """Sum every gradient over the data-parallel ranks, in place (one all-reduce)."""
    if comm.size == 1:
        return
    arrays = list(grads.values())
    flat = flatten(arrays)  # (P,) all gradients
    comm.allreduce(flat)  # sum of the ranks' shares = the global gradient
    unflatten_into(flat, arrays)


def ready_order(cfg) -> list[str]:
    """Parameter names in the order GPT.backward completes their gradients."""
    from refmp.nn.gpt import block_param_shapes

    names = ["ln_f.weight", "ln_f.bias"]
    for i in reversed(range(cfg.n_layer)):
        names += [f"h.{i}.{k}" for k in block_param_shapes(cfg, i)]  # MoE blocks differ
    return names + ["wte.weight", "wpe.weight"]


def make_buckets(params: dict, order: list[str], bucket_bytes: int) -> list[list[str]]:
    """Consecutive names of ``order`` grouped until a group holds >= bucket_bytes (DDP's rule)."""
    buckets, cur, size = [], [], 0
    for k in order:
        cur.append(k)
        size += int(params[k].nbytes)
        if size >= bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
    return buckets + ([cur] if cur else [])


def activation_bytes(cache, exclude=()) -> int:
    """Bytes of the distinct arrays a forward cache keeps alive, parameters excluded.

    Views count as their base buffer, once; ``exclude`` holds parameter arrays (or views of
    parameter buffers), which caches reference but which are not activations.
    """
    def root(a):
        while getattr(a, "base", None) is not None:
            a = a.base
        return a

    skip = {id(root(a)) for a in exclude}
    seen: dict[int, int] = {}
    stack = [cache]
    while stack:
        c = stack.pop()
        if isinstance(c, (tuple, list)):
            stack.extend(c)
        elif isinstance(c, dict):
            stack.extend(c.values())
        elif hasattr(c, "nbytes") and hasattr(c, "shape"):
            r = root(c)
            if id(r) not in skip:
                seen[id(r)] = int(r.nbytes)
    return sum(seen.values())


def split_microbatches(x, y, M: int) -> list:
    """M consecutive, equal row slices of (x, y) (DESIGN.md: micro-batches split rows in order).

    Copied (token ids, small), so a micro-batch's caches hold only its own rows.
    """
    b = x.shape[0] // M
    return [(x[i * b : (i + 1) * b].copy(), y[i * b : (i + 1) * b].copy()) for i in range(M)]


def check_microbatches(B: int, dp: int, M: int) -> None:
    if M < 1:
        raise ConfigError(f"--microbatches must be at least 1, got {M}")
    if B % (dp * M):
        raise ConfigError(f"--batch-size ({B}) must be divisible by dp * microbatches "
                          f"({dp} * {M}): every micro-batch has the same rows")


class Timeline:
    """(lane, what, start, end) intervals of one step on this rank, in seconds from its start."""

    def __init__(self):
        self.t0, self.events = time.perf_counter(), []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def add(self, lane: str, what: str, start: float, end: float) -> None:
        self.events.append((lane, what, start, end))

    def ascii(self, width: int = 60) -> str:
        """One row per interval: '#' computing (backward), '=' communicating."""
        if not self.events:
            return "(no events)"
        end = max(e[3] for e in self.events) or 1e-9
        rows = []
        for lane, what, a, b in self.events:
            i, j = int(a / end * width), max(int(a / end * width) + 1, int(b / end * width))
            mark = "#" if lane == "compute" else "="
            rows.append(f"{what:>16} |{' ' * i}{mark * (j - i)}{' ' * (width - j)}| "
                        f"{1e3 * a:7.2f}-{1e3 * b:7.2f} ms")
        return "\n".join(rows)


class DataParallel:
    """Plain data parallelism, and the interface every strategy's runner offers the Trainer.

    A runner owns how one step's forward and backward are computed and communicated; the
    Trainer owns the batch, the optimizer and the logging. The interface:

    * ``params`` / ``grads``: the arrays this rank updates, by GPT-2 name (shards welcome);
    * ``batch_rows(B)``: which rows of the global batch this rank reads;
    * ``forward_backward(x, y, denom)``: accumulate this rank's gradients (over its
      micro-batches), return its loss share (its tokens' loss sum / denom, denom = global
      token count);
    * ``reduce_grads()``: communicate so that ``grads`` is the global gradient of ``params``;
    * ``grad_sum_sq(local)``: add partial sums of squares over ranks owning other elements;
    * ``after_step()``: anything after the optimizer step (ZeRO: all-gather the parameters);
    * ``loss_total(share)``: the global mean loss from the shares;
    * ``generate(idx, n)``: greedy decoding (collective where the model is split);
    * ``eval_comm``: the ranks that split evaluation prompts between them;
    * ``full_params()``: the whole model with GPT-2 names (gathered) on rank 0, else None;
    * ``memory()``: bytes held per kind (params, grads, optimizer is the Trainer's, and the
      peak ``activations``: the live forward caches of one micro-batch).
    """

    def __init__(self, model, grid, microbatches: int = 1, bucket_mb: float = 25.0):
        self.model, self.grid = model, grid
        self.dp = grid.comm["dp"]
        self.eval_comm = self.dp
        self.M = microbatches
        self.buckets = make_buckets(model.params, ready_order(model.cfg),
                                    int(bucket_mb * 2**20)) if bucket_mb > 0 else []
        self.peak_activations = 0
        self.timeline = Timeline()

    @property
    def params(self) -> dict:
        return self.model.params

    @property
    def grads(self) -> dict:
        return self.model.grads

    def batch_rows(self, B: int) -> slice:
        check_microbatches(B, self.dp.size, self.M)
        return dp_rows(B, self.dp.size, self.dp.rank)

    def zero_grad(self) -> None:
        self.model.zero_grad()

    def forward_backward(self, x, y, denom: int) -> float:
        self.timeline, share = Timeline(), 0.0
        for m, (xm, ym) in enumerate(split_microbatches(x, y, self.M)):
            last = m == self.M - 1
            t = self.timeline.now()
            # (b/M, T) rows -> a loss share; MoE routing statistics are summed over dp
            loss, cache = self.model.forward(xm, ym, denom, stats_comm=self.dp)
            self.timeline.add("compute", f"forward mb{m}", t, self.timeline.now())
            self.peak_activations = max(self.peak_activations,
                                        activation_bytes(cache, self.model.params.values()))
            hook = self._start_ready_buckets if (last and self.buckets) else None
            self._pending, self._open, self._t = set(), [], self.timeline.now()
            self.model.backward(cache, on_ready=hook)  # grads accumulate over micro-batches
            if hook is None:
                self.timeline.add("compute", f"backward mb{m}", self._t, self.timeline.now())
            share += float(loss)
            self.stats = self.model.moe_stats(cache)  # {} for a dense model
        return share

    def _start_ready_buckets(self, names: list[str]) -> None:
        """Backward finished ``names``: start the all-reduce of every bucket now complete."""
        tl, now = self.timeline, self.timeline.now()
        piece = "head" if names[0].startswith("ln_f") else ".".join(names[0].split(".")[:2])
        piece = "embed" if piece.startswith(("wte", "wpe")) else piece
        tl.add("compute", f"backward {piece}", self._t, now)
        self._pending.update(names)
        for i in range(len(self._open), len(self.buckets)):
            if not self._pending.issuperset(self.buckets[i]):
                break  # buckets start in order, the same on every rank (MPI needs that)
            flat = flatten([self.model.grads[k] for k in self.buckets[i]])
            req = self.dp.allreduce_start(flat)  # sum the ranks' shares of these gradients
            self._open.append([i, flat, req, tl.now(), None])
        self._poll()
        self._t = tl.now()

    def _poll(self) -> None:
        """Test open all-reduces: drives them (no MPI progress thread) and notes completion."""
        for b in self._open:
            if b[4] is None and (b[2] is None or b[2].Test()):
                b[4] = self.timeline.now()

    def reduce_grads(self) -> None:
        if not self.buckets:
            t = self.timeline.now()
            allreduce_grads(self.model.grads, self.dp)  # every rank holds the global gradient
            self.timeline.add("comm", "allreduce all", t, self.timeline.now())
            return
        for i, flat, req, t, done in self._open:  # wait before the optimizer needs them
            if req is not None:
                wait(req)
            done = done if done is not None else self.timeline.now()
            self.timeline.add("comm", f"allreduce b{i}", t, done)
            unflatten_into(flat, [self.model.grads[k] for k in self.buckets[i]])
        self._open = []

    def grad_sum_sq(self, local: float) -> float:
        return local  # gradients are replicated after reduce_grads: count them once

    def after_step(self) -> None:
        pass  # every rank applied the same update to the same full parameters

    def loss_total(self, share: float) -> float:
        return self.dp.allreduce_scalar(share)  # sum of shares = the global mean loss

    def generate(self, idx, n: int):
        return self.model.generate(idx, n)

    def full_params(self) -> dict | None:
        return self.model.params if self.grid.rank == 0 else None

    def memory(self) -> dict[str, int]:
        """Bytes of full parameters and gradients (4 + 4 per parameter in float32)."""
        return {"params": sum(int(p.nbytes) for p in self.model.params.values()),
                "grads": sum(int(p.nbytes) for p in self.model.params.values()),
                "activations": self.peak_activations}
