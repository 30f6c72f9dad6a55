"""ZeRO stages 1 and 2 over another runner: tensor parallelism x dp, pipeline parallelism x dp.

Rajbhandari et al. 2020, sec. 5 (P_os, P_os+g) applied to *whatever a rank holds*. Under
tensor parallelism a rank holds its tp shards (refmp.parallel.tensor_runner), under pipeline
parallelism its stage's parameters (refmp.parallel.pipeline.runner); the dp ranks of one tp
(or pp) coordinate hold the same arrays, replicated, and that replication is what ZeRO removes.
So this layer never looks inside the model: it takes the runner's ``params`` dict as one unit
(refmp.parallel.zero.Unit) and shards it over grid.comm["dp"].

Shapes: N elements of the runner's local parameters (already tp-sharded or stage-local),
Np = N padded up to a multiple of dp, S = Np/dp the slice this dp rank owns.

One step:
  forward_backward   the runner's own (its tp / pp communication, its micro-batches); it
                     accumulates its full local gradients (N), as always
  reduce_grads       the runner's own reductions except the dp all-reduce (SP's tp
                     all-reduce, the pipeline's tied-wte swap), then
                     reduce-scatter over dp: the ranks' shares, flattened (Np) -> my S, summed
  optimizer          AdamW on the S elements this rank owns (split by parameter, so weight
                     decay goes to matrices only: refmp.parallel.zero.decay_names)
  after_step         all-gather over dp: every rank's S updated elements -> the full Np, which
                     the runner's parameters are views of

Stage 1 keeps the flat gradient (Np) after the reduce-scatter; stage 2 keeps only its slice
(S). Unlike refmp.parallel.zero (plain dp), the reduce-scatter happens once per step, after the
runner's backward: the runner accumulates whole local gradients over its micro-batches (the
pipeline must: a stage's gradient is complete only after the schedule's last backward), so
stage 2 shrinks what a rank keeps between steps, not the peak during backward. DeepSpeed makes
the same choice: its pipeline engine supports ZeRO stage 1 only.

Clipping: each element is owned once per dp group, so the squares of the owned pieces are
summed by the runner's own rule (tp shards summed over tp, replicated ones counted once; one
copy of the tied wte per pipeline) and then over dp.
"""

from __future__ import annotations

from refmp.backend import array_module
from refmp.errors import ConfigError
from refmp.parallel.zero import Unit, decay_names


def check_zero_composes(stage: int, axis: str) -> None:
    """Refuse ZeRO stage 3 over pp (same answer on every rank, before any communication);
    over tp it is refmp.parallel.zero3_tensor."""
    if stage == 3:
        raise ConfigError(f"--zero 3 with {axis}: not implemented (stage 3 would all-gather "
                          f"each layer's weights over dp inside the pipeline's forward and "
                          f"backward actions); use --zero 1 or 2 with {axis}")


class ShardedOptimizer:
    """The runner interface (refmp.parallel.data) for ``inner`` with ZeRO stage 1 or 2 over dp.

    ``inner`` is a runner whose ``params``/``grads`` are this rank's arrays by name, whose
    ``reduce_grads`` skips its dp all-reduce when ``reduce_dp`` is False, and whose
    ``grad_sum_sq(local, grads)`` applies its own counting rule to ``grads``.
    """

    def __init__(self, inner, grid, stage: int):
        self.inner, self.grid, self.stage = inner, grid, stage
        self.dp = dp = grid.comm["dp"]
        self.eval_comm = inner.eval_comm
        inner.reduce_dp = False  # the reduce-scatter below replaces its all-reduce
        local = inner.params  # (already sharded over tp, or one stage's) by name
        shapes = {k: tuple(v.shape) for k, v in local.items()}
        self.unit = U = Unit("local", shapes, dp.size, dp.rank)
        p0 = next(iter(local.values()))
        self.xp, self.dtype = array_module(p0), p0.dtype
        self.pbuf = U.flatten(local, self.xp, self.dtype)  # (Np,) every rank: all of them
        local.update(U.views(self.pbuf))  # the runner now computes on views of pbuf
        self.gbuf = self.xp.zeros(U.padded if stage == 1 else U.shard, self.dtype)
        gshard = self.gbuf[U.lo : U.hi] if stage == 1 else self.gbuf  # (S,)
        self._params = U.pieces(self.pbuf[U.lo : U.hi])  # my S elements, by parameter
        self._grads = U.pieces(gshard)
        self.decay = decay_names(self._params, shapes)

    @property
    def params(self) -> dict:
        return self._params  # this rank's pieces of the runner's parameters, flat

    @property
    def grads(self) -> dict:
        return self._grads  # the same pieces of the gradient, summed over dp

    def shard_of(self, local: dict) -> dict:
        """This rank's pieces of ``local`` (arrays shaped like the runner's params, by name)."""
        return self.unit.shard_of(local, self.xp, self.dtype)

    def batch_rows(self, B: int) -> slice:
        return self.inner.batch_rows(B)

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def forward_backward(self, x, y, denom: int) -> float:
        return self.inner.forward_backward(x, y, denom)

    def reduce_grads(self) -> None:
        self.inner.reduce_grads()  # its tp / pp reductions; not the dp all-reduce
        U = self.unit
        flat = U.flatten(self.inner.grads, self.xp, self.dtype)  # (Np,) this rank's share
        # reduce-scatter over dp: sum the ranks' shares and keep my S elements of the sum
        mine = self.dp.reduce_scatter(flat)  # (S,)
        if self.stage == 1:  # stage 1 keeps the whole flat gradient buffer (Np)
            self.gbuf[...] = flat
            self.gbuf[U.lo : U.hi] = mine
        else:  # stage 2: only the slice
            self.gbuf[...] = mine

    def grad_sum_sq(self, local: float) -> float:
        # the runner's rule over tp / pp, then over dp: each element is owned by one dp rank
        return self.dp.allreduce_scalar(self.inner.grad_sum_sq(local, self._grads))

    def after_step(self) -> None:
        U = self.unit  # all-gather over dp: each rank's updated S elements -> the full Np
        self.pbuf[...] = self.dp.allgather(self.pbuf[U.lo : U.hi])

    def loss_total(self, share: float) -> float:
        return self.inner.loss_total(share)

    def generate(self, idx, n: int):
        return self.inner.generate(idx, n)

    def full_params(self) -> dict | None:
        return self.inner.full_params()  # its params are views of the gathered pbuf

    def timeline(self):
        return self.inner.timeline()  # pipeline only (--trace)

    def memory(self) -> dict[str, int]:
        """Bytes of the flat parameter and gradient buffers kept, and the runner's activations."""
        mem = self.inner.memory() if hasattr(self.inner, "memory") else {}
        return {**mem, "params": int(self.pbuf.nbytes), "grads": int(self.gbuf.nbytes)}
