"""Communication compression: codecs between a gradient (or a weight) and its collective.

The Sharder (refmp.parallel.data.sharder) hands a unit's flat gradient (Pp,) to the codec,
which sums it over the unit's group (dp x cp, or edp for experts) in fewer bytes. Shapes: a
parameter's gradient g_i on rank i of n, seen as a matrix of n_r x m (its first axis by the
rest), R the PowerSGD rank, F the fraction top-k keeps, w bytes per gradient element.

    bf16      sum_i bf16(g_i), in bf16 on the wire                     2 nm bytes
    powersgd  Vogels et al. 2019: M_i = g_i + e_i, P = sum_i M_i Q,      w R (n_r + m)
              P^ = orth(P), Q = sum_i M_i^T P^, g = P^ Q^T,              per compressed matrix,
              e_i = M_i - g / n; Q is kept for the next step (warm start)  w nm otherwise
    topk      Lin et al. 2018 (DGC, without momentum correction): M_i = g_i + e_i, the
              k = ceil(F nm) largest |M_i| are sent, values and int32 indices, all-gathered
              and summed, e_i = M_i - sent_i                            n k (w + 4), gathered

A matrix is compressed by PowerSGD only where R (n_r + m) < n_r m (``compresses``); the
vectors, and the matrices it would not shrink, are summed whole.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019): what a codec did not send this
step is added to the next step's gradient, so no gradient is lost, only delayed; that is what
lets a biased compressor converge like the uncompressed run.

PowerSGD is exact across ranks: P and Q are linear in the M_i, so their sums over the ranks
are the serial run's products of sum_i M_i with the same Q, orthogonalized after the sum; and
with each rank keeping its share e_i = M_i - g/n of the error, the shares sum to the serial
run's error, so every step starts where the serial one does. Top-k is not: a sum of sparse
vectors is not sparse, and the top k of each rank's M_i are not the top k of their sum.
"""

from __future__ import annotations

import math
import zlib

import numpy as np

from refmp.parallel.data.fp8_gather import FP8Gather
from refmp.runtime.backend import array_module, from_host
from refmp.runtime.precision import BF16


def summed(group, buf):
    """``buf`` summed over the group, in place (alone: ``buf``, nothing sent)."""
    return group.allreduce(buf) if group.size > 1 else buf


def gathered(group, buf):
    """Every rank's ``buf`` in rank order (alone: ``buf``, nothing sent)."""
    return group.allgather(buf) if group.size > 1 else buf


def compresses(shape: tuple, rank: int) -> bool:
    """PowerSGD compresses a matrix that R (n_r + m) elements shrink (torch's
    min_compression_rate); vectors, and the other matrices, are summed whole."""
    return len(shape) >= 2 and rank * (shape[0] + math.prod(shape[1:])) < math.prod(shape)


class Codec:
    """A plain sum whose buffer travels in ``wire`` (None: the gradient's dtype), from step
    ``start`` on; a subclass that ``replaces`` the sum does it in ``reduce``."""

    replaces = False

    def __init__(self, start: int = 0, wire=None, error_feedback: bool = True):
        self.start = start
        self.wire = wire
        self.feedback = error_feedback
        self.error: dict[tuple[str, str], object] = {}  # (unit, name) -> e_i, not yet sent

    def produced(self, u: str, k: str, g):
        """M_i = g_i + e_i, a new array (the gradient buffer is overwritten by the sum)."""
        e = self.error.get((u, k))
        return g + e if e is not None else g.copy()

    def memory(self) -> int:
        """Bytes of the error buffers kept between steps."""
        return sum(int(e.nbytes) for e in self.error.values())

    def state(self) -> dict:
        """What the next steps depend on (refmp.checkpoint.sharded): ``error/{unit}/{name}``."""
        return {f"error/{u}/{k}": e for (u, k), e in self.error.items()}

    def load_state(self, state: dict) -> None:
        """Set the buffers back from ``state`` (host arrays, as ``state`` names them)."""
        self.error = {tuple(k.split("/")[1:]): from_host(v) for k, v in state.items()
                      if k.startswith("error/")}


class PowerSGD(Codec):
    replaces = True

    def __init__(self, rank: int, seed: int, start: int = 0, error_feedback: bool = True):
        super().__init__(start, None, error_feedback)
        self.rank = rank
        self.seed = seed
        self.q: dict[str, object] = {}  # name -> Q (m, R), warm-started from the last step

    def memory(self) -> int:
        """Bytes of the error buffers and the warm-start Q's kept between steps."""
        return super().memory() + sum(int(q.nbytes) for q in self.q.values())

    def state(self) -> dict:
        """The error buffers, and ``q/{name}``: the Q the next step starts from."""
        return {**super().state(), **{f"q/{k}": q for k, q in self.q.items()}}

    def load_state(self, state: dict) -> None:
        super().load_state(state)
        self.q = {k[2:]: from_host(v) for k, v in state.items() if k.startswith("q/")}

    def reduce(self, unit, flat, group) -> None:
        """Unit ``unit``'s gradient ``flat`` (Pp,) becomes the PowerSGD sum over ``group``."""
        xp, R = array_module(flat), self.rank
        views = unit.views(flat)
        mats = {k: g.reshape(g.shape[0], -1) for k, g in views.items() if compresses(g.shape, R)}
        whole = [g for k, g in views.items() if k not in mats]
        M = {k: self.produced(unit.name, k, g) for k, g in mats.items()}  # (n_r, m)
        for k, m in M.items():
            if k not in self.q:  # the same Q on every rank and layout: seeded by the name
                rng = np.random.default_rng([self.seed, zlib.crc32(k.encode())])
                self.q[k] = xp.asarray(rng.standard_normal((m.shape[1], R)), dtype=flat.dtype)
        first = summed(group, xp.concatenate([g.ravel() for g in whole]
                                             + [(m @ self.q[k]).ravel() for k, m in M.items()]))
        o, P = 0, {}
        for g in whole:
            g[...] = first[o : o + g.size].reshape(g.shape)
            o += g.size
        for k, m in M.items():  # orthogonalized after the sum: orth is not linear
            P[k] = xp.linalg.qr(first[o : o + m.shape[0] * R].reshape(m.shape[0], R))[0]
            o += m.shape[0] * R
        if not M:
            return
        second = summed(group, xp.concatenate([(m.T @ P[k]).ravel() for k, m in M.items()]))
        o = 0
        for k, m in M.items():
            self.q[k] = q = second[o : o + m.shape[1] * R].reshape(m.shape[1], R)  # (m, R)
            o += m.shape[1] * R
            mats[k][...] = approx = P[k] @ q.T  # (n_r, m)
            if self.feedback:
                self.error[(unit.name, k)] = m - approx / group.size  # this rank's share


class TopK(Codec):
    replaces = True

    def __init__(self, ratio: float, start: int = 0, error_feedback: bool = True):
        super().__init__(start, None, error_feedback)
        self.ratio = ratio

    def reduce(self, unit, flat, group) -> None:
        """Unit ``unit``'s gradient ``flat`` (Pp,) becomes the sum of every rank's top k."""
        xp = array_module(flat)
        values, index = [], []
        for k, g in unit.views(flat).items():
            m = self.produced(unit.name, k, g).ravel()  # (nm,) M_i
            n_keep = math.ceil(self.ratio * m.size)
            top = xp.sort(xp.argpartition(xp.abs(m), m.size - n_keep)[m.size - n_keep :])
            values.append(m[top])
            index.append(top + unit.offsets[k])
            if self.feedback:
                m[top] = 0  # what was not sent: M_i - sent_i
                self.error[(unit.name, k)] = m.reshape(g.shape)
        vals = gathered(group, xp.concatenate(values))  # (n k,)
        idx = gathered(group, xp.concatenate(index).astype(np.int32))  # (n k,)
        flat[...] = 0
        np.add.at(flat, idx, vals)  # in rank order: the same sum on every rank


class Int8Gather:
    """ZeRO++'s quantized weight all-gather (qwZ; Wang et al. 2023): each rank's shard in
    blocks of ``block`` elements, int8 with one fp32 scale max|x|/127 per block. Bytes of a
    gather of S-element shards: n (Sb + 4 Sb/block), Sb = S rounded up to a block."""

    def __init__(self, block: int):
        self.block = block

    def allgather(self, group, shard):
        """The full (n S,) weights from every rank's (S,) ``shard``, each block dequantized."""
        xp, S, B = array_module(shard), shard.size, self.block
        nb = -(-S // B)
        x = xp.zeros(nb * B, dtype=np.float32)
        x[:S] = shard
        x = x.reshape(nb, B)
        scale = xp.abs(x).max(axis=1) / 127  # (nb,)
        q = xp.rint(x / xp.where(scale > 0, scale, 1)[:, None]).astype(np.int8)  # (nb, B)
        qs = gathered(group, q.ravel()).reshape(group.size, nb, B).astype(np.float32)
        scales = gathered(group, scale).reshape(group.size, nb, 1)
        return (qs * scales).reshape(group.size, nb * B)[:, :S].reshape(-1).astype(shard.dtype)


def make_codecs(cfg, seed: int = 0) -> tuple:
    """The gradient codec and the weight gather of a layout (None: plain; int8, or FP8's
    refmp.parallel.data.fp8_gather); ``seed``: the
    run's, from which PowerSGD's first Q is drawn on every rank alike."""
    ef, start = not cfg.no_error_feedback, cfg.compress_start
    grad = {"none": None, "bf16": lambda: Codec(start, BF16),
            "powersgd": lambda: PowerSGD(cfg.compress_rank, seed, start, ef),
            "topk": lambda: TopK(cfg.compress_ratio, start, ef)}[cfg.grad_compress]
    gather = {"none": None, "int8": lambda: Int8Gather(cfg.quant_block), "fp8": FP8Gather}[cfg.weight_gather]
    return grad() if grad else None, gather() if gather else None
