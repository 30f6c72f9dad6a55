"""The serial references of the pipelines without a flush, for any model family
(tests/test_async_pipeline.py runs GPT-2 on them, tests/test_llama_parallel.py a Llama model).

PipeDream-2BW (Narayanan et al. 2021, sec. 3.1): update t applies batch t's gradient taken at
W(t-1), W(-1) = W(0), the whole optimizer step working on that gradient and on W(t). With
pp = 1 ``--schedule 2bw`` is that rule run serially: :func:`assert_same_delayed_run` holds a
layout to it.

PipeDream's weight stashing (Narayanan et al. 2019, sec. 3.3, one update per batch): stage s
computes batch t's forward and backward on W(max(t - (pp - 1 - s), 0)); update t applies the
sum of those gradients to W(t). :func:`pipedream_reference` states it serially, a family's
``gradient`` taking each piece of the model from its stage's version; :func:`run_against`
holds a layout to it.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import parity
from mpi4py import MPI
from mpi_helpers import Mismatches

from refmp.config import lr_at
from refmp.distributed.grid import ProcessGrid
from refmp.nn import gpt
from refmp.parallel.pipeline.partition import rank_chunks
from refmp.parallel.pipeline.schedules import ChunkPlacement
from refmp.training.datasets import get_batch
from refmp.training.optim import clip_grads
from refmp.training.trainer import TrainConfig, Trainer, build_optimizer


def assert_same_delayed_run(cfg: TrainConfig, ds, tol: dict, check=None) -> Trainer:
    """parity.assert_same_run against 2bw at pp 1 (the delayed rule), not the plain serial
    run; returns the layout's Trainer."""
    plain = parity.serial_config
    parity.serial_config = lambda c: replace(plain(c), schedule="2bw")  # the delayed reference
    try:
        return parity.assert_same_run(cfg, ds, tol=tol, check=check)
    finally:
        parity.serial_config = plain


def gpt2_gradient(mcfg, version, stage_of: dict, x, y, denom: int) -> tuple[float, dict]:
    """GPT-2 under PipeDream's rule: the embedding (stage 0's), each block (its stage's) and
    ln_f and the tied head (stage pp - 1's) forward and backward on ``version(stage)``;
    wte's two shares added. Returns (loss, gradient)."""
    ops, pp = gpt.Ops(mcfg.n_head), max(stage_of.values()) + 1
    h, emb = gpt.embed_forward(version(0), x)
    blocks = []
    for i in range(mcfg.n_layer):
        h, c = gpt.block_forward(gpt.block_params(version(stage_of[i]), i), h, ops)
        blocks.append(c)
    loss, head = gpt.head_forward(version(pp - 1), h, y, denom)
    dx, g = gpt.head_backward(1.0, head)
    for i in reversed(range(mcfg.n_layer)):
        dx, gb = gpt.block_backward(dx, blocks[i], ops)
        g.update({f"h.{i}.{k}": v for k, v in gb.items()})
    ge = gpt.embed_backward(dx, emb)
    g["wte.weight"] = g["wte.weight"] + ge["wte.weight"]
    g["wpe.weight"] = ge["wpe.weight"]
    return float(loss), g


def pipedream_reference(cfg: TrainConfig, ds, gradient=gpt2_gradient) -> list[tuple[float, float, dict]]:
    """PipeDream's rule, serially: batch t's gradient by ``gradient(mcfg, version, stage_of,
    x, y, denom)``, where ``version(s)`` is stage s's weights W(max(t - (pp - 1 - s), 0)) and
    ``stage_of`` each block's stage (the pp-stage partition's), clipped by its global norm;
    AdamW steps W(t). Returns (loss, norm, W(t + 1)) of each step."""
    base = Trainer(parity.serial_config(cfg), grid=ProcessGrid(MPI.COMM_SELF), dataset=ds)
    mcfg, pp, T = base.mcfg, cfg.pp, cfg.block_size
    stage_of = {i: s for s in range(pp)
                for c in rank_chunks(mcfg, T, s, ChunkPlacement(pp)).values() for i in c}
    W = [{k: np.asarray(v) for k, v in base.runner.full_params().items()}]  # W(0)
    params = {k: v.copy() for k, v in W[0].items()}
    opt, out = build_optimizer(cfg, params), []
    for t in range(cfg.steps):
        def version(s, t=t):
            return W[max(t - (pp - 1 - s), 0)]
        x, y = get_batch(base.ds.tokens, t, cfg.batch_size, T, perm=base.perm)
        loss, g = gradient(mcfg, version, stage_of, x, y, cfg.batch_size * T)
        norm = math.sqrt(sum(float((v * v).sum()) for v in g.values()))
        clip_grads(g, cfg.grad_clip, norm)
        opt.lr = lr_at(cfg, t)
        opt.step(g)
        W.append({k: v.copy() for k, v in params.items()})
        out.append((loss, norm, W[-1]))
    return out


def run_against(cfg: TrainConfig, ds, gradient, tol: dict) -> tuple[Trainer, Mismatches]:
    """Train ``cfg`` (a pipedream run) on the world; rank 0 compares each step's loss, norm
    and whole weights with :func:`pipedream_reference`'s. Returns the Trainer and the
    mismatches, not yet agreed on (``assert_none`` over the world)."""
    ref = pipedream_reference(cfg, ds, gradient) if MPI.COMM_WORLD.rank == 0 else None
    par, bad = Trainer(cfg, dataset=ds), Mismatches()
    for t in range(cfg.steps):
        rec, now = par.step(), par.runner.full_params()
        if ref is not None:
            loss, norm, w = ref[t]
            bad.check(np.testing.assert_allclose, rec["loss"], loss, **tol, err_msg=f"loss {t}")
            bad.check(np.testing.assert_allclose, rec["grad_norm"], norm, **tol, err_msg=f"norm {t}")
            for k, v in w.items():
                bad.check(np.testing.assert_allclose, now[k], v, **tol, err_msg=f"{k} after {t}")
    return par, bad
