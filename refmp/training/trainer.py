"""The training loop behind ``refmp train`` (and the parity tests' whole-step runs).

One step, on every rank, whatever the layout (the runner is refmp.parallel.engine.Engine):
  1. take this rank's rows of the global batch (layout-invariant order, refmp.training.datasets);
  2. forward and backward, the loss being this rank's share of the global mean;
  3. reduce: every gradient piece this rank owns becomes the global gradient's;
  4. stop if the global loss or gradient norm is not finite (every rank sees the same
     values, so every rank stops: refmp.distributed.faults), else clip by the global norm, then the
     optimizer step on the owned pieces.
With --mixed-precision (refmp.runtime.precision) the pieces the optimizer sees are fp32 masters and
fp32 gradients; with fp16, backward starts from the loss scale, and a step whose gradient
norm is not finite (an overflow, on any rank) is skipped and the scale halved
(refmp.training.optim.LossScaler) instead of stopping the run.

Before anything big is made, every check runs in order (refmp.training.checks.validate);
the Trainer saves and restores itself as a checkpoint's parts (refmp.checkpoint.sharded);
evaluation decodes the model as trained so far (refmp.training.evaluate).
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Protocol

import numpy as np

from refmp.checkpoint.sharded import Checkpointed, Pieces, Stateful, load, save
from refmp.checkpoint.source import InitSource, Source, ZeroSource
from refmp.config import TrainConfig, lr_at
from refmp.distributed.faults import agreed, check_finite
from refmp.distributed.gpu import start_gpu
from refmp.distributed.grid import ProcessGrid
from refmp.nn.families import is_llama, param_shapes
from refmp.nn.params import GPTConfig
from refmp.runtime import backend
from refmp.training.checks import moe_flags, validate
from refmp.training.datasets import Dataset, get_batch, shuffle_perm
from refmp.training.families import llama_source
from refmp.training.optim import SGD, AdamW, LossScaler, clip_grads

if TYPE_CHECKING:
    from refmp.parallel.data.sharder import Sharder
    from refmp.parallel.pipeline.schedules import ChunkPlacement


def model_source(cfg: TrainConfig, mcfg: GPTConfig) -> Source:
    """Where the initial weights of the model ``mcfg`` (validate's) come from, nothing read
    yet: a fresh GPT-2 init (InitSource), or the --init file or Hugging Face directory (its
    names and shapes checked, read slice by slice); with --resume zeros (ZeroSource: the
    checkpoint sets every piece, so nothing is drawn or read twice)."""
    from refmp.checkpoint.weights import open_model

    if is_llama(mcfg):  # refmp.training.families: its directory, checkpoint or draw
        return llama_source(cfg, mcfg)
    if cfg.resume:
        return ZeroSource(mcfg, cfg.seed)
    if cfg.init is not None:
        return open_model(cfg.init, n_head=cfg.n_head, moe=moe_flags(cfg))[1]
    return InitSource(mcfg, cfg.seed)


class Runner(Pieces, Stateful, Protocol):
    """What the Trainer drives: refmp.parallel.engine.Engine, for every layout.

    As the checkpoint's Pieces: ``params`` the arrays this rank updates, by name (flat pieces
    of shards are welcome: the optimizer is elementwise), ``counts_in_norm`` which of them
    this rank counts once (in the gradient norm, and in a checkpoint), ``piece_index()``
    where their elements sit in the full model, ``after_step()``. As a Stateful:
    ``state()``/``load_state()`` what later steps depend on of its own (the data-parallel
    sums' codec), which a checkpoint saves rank by rank. Besides: ``grads`` their gradients,
    ``decay`` the names that get weight decay; ``stats`` the last step's extra figures for the
    log (MoE routing); ``weight_dtype`` the weights' (--dtype), ``compute_dtype`` what the
    model computes on (with --mixed-precision the rounded copy). For evaluation's Decoder
    (refmp.training.evaluate), which decodes what each rank holds: ``sharder`` its weights
    unit by unit, ``placed`` and ``stage_layers`` where its model chunks run.
    """

    grads: dict
    decay: set[str]
    stats: dict
    weight_dtype: np.dtype
    compute_dtype: np.dtype
    sharder: Sharder
    placed: ChunkPlacement
    stage_layers: str | None

    def batch_rows(self, B: int) -> slice: ...  # the rows of the global batch this rank reads

    def ahead(self) -> int: ...  # how many later batches' forwards run in each step

    def zero_grad(self) -> None: ...

    def forward_backward(self, x, y, denom: int, dloss: float = 1.0, ahead=()) -> None: ...
    # grads += this rank's share; dloss: the gradient backward starts from (fp16's loss
    # scale); ahead: the next ahead() batches [(x, y), ...], fewer at the end of the run

    def reduce_grads(self) -> None: ...  # grads become the global gradient's owned pieces

    def grad_norm(self) -> float: ...  # the global L2 norm, each element counted once

    def loss_total(self) -> float: ...  # the step's global loss

    def full_params(self) -> dict | None: ...  # the whole model on rank 0 (collective)
    def param_gatherer(self): ...  # gather(name): one whole parameter on rank 0 (collective)

    def timeline(self): ...  # the last step's pipeline timeline (collective over pp)

    def memory(self) -> dict[str, int]: ...  # bytes held: params, grads, activations


def build_runner(cfg: TrainConfig, grid: ProcessGrid, mcfg: GPTConfig, source: Source) -> Runner:
    """The one engine, for a layout whose rules were checked (refmp.parallel.rules): each
    rank reads its share of ``source``."""
    from refmp.parallel.engine import Engine

    return Engine(mcfg, source, grid, cfg.parallel, cfg.block_size or mcfg.block_size,
                  cfg.seed, cfg.dtype)


def build_optimizer(cfg: TrainConfig, params: dict, decay=None):
    """``decay``: names to weight-decay when params are flattened shards (default ndim >= 2)."""
    if cfg.optimizer == "sgd":
        return SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                   decay=decay)
    return AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay,
                 decay=decay)


class Trainer:
    """Holds the grid, data, runner and optimizer of one run, on any layout."""

    def __init__(self, cfg: TrainConfig, grid: ProcessGrid | None = None,
                 dataset: Dataset | None = None):
        self.cfg = cfg
        self.grid = grid if grid is not None else ProcessGrid(
            dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, ep=cfg.ep, etp=cfg.etp)  # refuses bad sizes

        self.device_info = {"device": "cpu"}
        if cfg.device == "gpu":  # before any array is made: parameters go straight to the GPU
            self.device_info = start_gpu(self.grid)

        world = self.grid.world
        # before anything big, on every rank, in order: the flags, the files rank 0 will
        # write, the data and the model's shape, the layout's rules, the memory it needs
        ds, mcfg = validate(cfg, self.grid, dataset)
        self.ds = ds
        self.mcfg = mcfg  # the model's shape, validate's: nothing is read or built yet
        self.T = cfg.block_size or mcfg.block_size  # the block size the run trains on
        source = agreed(world, lambda: model_source(cfg, mcfg))
        self.runner = build_runner(cfg, self.grid, self.mcfg, source)  # reads its share
        self.rows = self.runner.batch_rows(cfg.batch_size)
        self.perm = shuffle_perm(self.ds.n_windows(self.T), cfg.seed) if cfg.shuffle else None
        self.opt = build_optimizer(cfg, self.runner.params, self.runner.decay)
        # fp16: dynamic loss scaling (its state is training state, which a checkpoint
        # saves); bf16 has fp32's range and needs none
        self.scaler = (LossScaler(cfg.loss_scale_init, cfg.loss_scale_window)
                       if cfg.mixed_precision == "fp16" else None)
        self.step_num = 0
        self.resumed = self.resume(cfg.resume) if cfg.resume else None  # its manifest

    @property
    def num_params(self) -> int:
        """The whole model's parameters (from the shapes: no rank holds them all)."""
        return sum(math.prod(s) for s in param_shapes(self.mcfg).values())

    def step(self) -> dict:
        """One training step; returns {step, loss, grad_norm, lr, tokens, seconds} (and with
        fp16 the loss scale the step used and whether it was skipped for an overflow)."""
        cfg, run = self.cfg, self.runner
        t0 = time.perf_counter()
        x, y = get_batch(self.ds.tokens, self.step_num, cfg.batch_size, self.T, self.rows, self.perm)
        x, y = backend.from_host(x), backend.from_host(y)
        run.zero_grad()
        denom = cfg.batch_size * self.T  # the global token count: each rank's loss is a share
        scale = self.scaler.scale if self.scaler else 1.0
        # fp16: an overflow is expected now and then (that is what the scaler is for)
        quiet = np.errstate(over="ignore", invalid="ignore") if self.scaler else nullcontext()
        # the later batches whose forwards run in this step (asynchronous schedules: the
        # runner says how many); the last steps of the run drain
        ahead = [tuple(backend.from_host(a) for a in get_batch(
            self.ds.tokens, k, cfg.batch_size, self.T, self.rows, self.perm))
            for k in range(self.step_num + 1, min(self.step_num + 1 + run.ahead(), cfg.steps))]
        with quiet:
            run.forward_backward(x, y, denom, scale, ahead)  # backward starts from the loss scale
            run.reduce_grads()  # now grads is the global gradient of this rank's pieces
            norm = run.grad_norm()  # global: also without clipping, for the checks below
        loss = run.loss_total()  # global (the forward's): the same on every rank
        take = self.scaler.update(math.isfinite(norm)) if self.scaler else True
        # every rank stops here, before the update (an fp16 overflow is skipped instead)
        check_finite(self.step_num, loss, norm if take else 0.0)
        if cfg.grad_clip > 0 and take:
            clip_grads(run.grads, cfg.grad_clip, norm)
        self.opt.lr = lr_at(cfg, self.step_num)
        if take:  # an fp16 overflow skips the whole update (moments and step count too)
            self.opt.step(run.grads)
            run.after_step()  # the compute copy from the masters; ZeRO 1/2: all-gather
        backend.sync()
        rec = {"step": self.step_num, "loss": loss, "grad_norm": norm, "lr": self.opt.lr,
               "tokens": cfg.batch_size * self.T, "seconds": time.perf_counter() - t0}
        if self.scaler:
            rec.update(loss_scale=scale, skipped=not take)
        rec.update(run.stats)  # e.g. MoE routing statistics
        self.step_num += 1
        return rec

    # --- the state later steps depend on: each part saves itself (refmp.checkpoint.sharded) ---

    def state(self) -> dict:
        """The run's progress: the steps done, where the batch order stands (a function of
        (step, B, seed, shuffle)), and the next learning rate, lr_at(cfg, step)."""
        cfg, B, T, step = self.cfg, self.cfg.batch_size, self.T, self.step_num
        n_windows = self.ds.n_windows(T)
        return {"step": step,
                "data": {"name": self.ds.name, "tokens": len(self.ds.tokens), "batch_size": B,
                         "block_size": T, "windows": n_windows, "next_window": step * B % n_windows,
                         "epoch": step * B // n_windows, "shuffle": cfg.shuffle, "seed": cfg.seed},
                "lr": {"schedule": cfg.lr_schedule, "steps": cfg.steps, "next": lr_at(cfg, step)}}

    def load_state(self, state: dict) -> None:
        """Continue after ``state["step"]`` steps (the batch order and lr follow from it)."""
        self.step_num = int(state["step"])

    def checkpointed(self) -> Checkpointed:
        """What a checkpoint saves and restores of this run: the runner's pieces, the
        optimizer, fp16's loss scaler, this Trainer's progress, and FP8's amax history."""
        return Checkpointed(self.grid, self.cfg, self.mcfg, self.runner, self.opt,
                            self.scaler, progress=self, vocab=self.ds.vocab,
                            codec=self.runner, fp8=getattr(self.runner, "fp8", None))

    def save_checkpoint(self, root: str, keep: int = 0) -> str:
        """Write this step's state as ``root/step-{N:08d}`` (collective)."""
        return save(self.checkpointed(), root, keep)

    def resume(self, path: str) -> dict:
        """Continue from the checkpoint at, or latest in, ``path``, saved by any layout
        (collective). Returns its manifest."""
        return load(self.checkpointed(), path)

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients, optimizer state (and activations)."""
        run = self.runner
        mem = {
            "params": sum(int(p.nbytes) for p in run.params.values()),
            "grads": sum(int(g.nbytes) for g in run.grads.values() if g is not None),
            "optimizer": self.opt.state_bytes(),
        }
        mem.update(run.memory())  # the runner's own buffers and peak activations
        mem["optimizer"] += mem.pop("masters", 0)  # mixed precision: fp32 masters (ZeRO's 12)
        return mem
