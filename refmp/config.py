"""What a run is asked to do (TrainConfig, the fields behind ``refmp train``'s flags), the
learning-rate schedule, and the check that every value makes sense before anything is built
(the same answer on every rank: a pure function of the configuration).

refmp.training.trainer runs the step; refmp.parallel.layout checks the layout;
refmp.distributed.faults the output paths; refmp.cost.memory the memory the layout will need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from refmp.errors import ConfigError


@dataclass
class TrainConfig:
    n_layer: int = 2
    n_head: int | None = None  # None: 4, or what an --init file's metadata says
    n_embd: int = 64
    n_expert: int = 0  # mixture of experts (refmp.nn.moe); 0: dense
    # the MoE settings below: None means not given, so GPTConfig's default or what an --init
    # file says; a value given wins over the file's metadata (refmp.checkpoint.weights.read_config)
    top_k: int | None = None
    moe_every: int | None = None
    capacity_factor: float | None = None
    aux_loss_coef: float | None = None
    z_loss_coef: float | None = None
    block_size: int | None = None  # None: one addition problem (13), else 64
    batch_size: int = 128
    steps: int = 1500
    optimizer: str = "adamw"
    lr: float = 3e-3
    lr_schedule: str = "cosine"
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    momentum: float = 0.0
    grad_clip: float = 1.0
    dtype: str = "float32"
    seed: int = 0
    data: str | None = None
    shuffle: bool = False
    digits: int = 3
    dp: int | None = None
    tp: int = 1
    pp: int = 1
    cp: int = 1
    cp_algo: str = "ring"  # context parallelism: ring or ulysses
    cp_balance: str = "zigzag"  # which chunks a cp rank holds: zigzag or contiguous
    ep: int = 1
    microbatches: int = 1  # pipeline micro-batches, or gradient accumulation without pp
    device: str = "cpu"  # cpu (NumPy) or gpu (CuPy)
    bucket_mb: float = 25.0  # data parallel: all-reduce bucket size (0: one, after backward)
    zero: int = 0  # ZeRO stage: 0 (plain data parallel), 1, 2 or 3
    schedule: str = "1f1b"  # pipeline schedule (refmp.parallel.pipeline.schedules)
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedule)
    stage_layers: str | None = None  # "2,1,1": blocks per pipeline stage (default: balanced)
    trace: str | None = None  # write the last step's pipeline timeline (Chrome trace JSON)
    sequence_parallel: bool = False  # with --tp: shard LayerNorm/residual regions along T
    recompute: str = "none"  # activation recomputation: none, selective or full
    mixed_precision: str = "none"  # none, bf16 or fp16: compute copy, activations, gradients
    grad_dtype: str = "compute"  # with mixed precision: gradients in the compute dtype or fp32
    loss_scale_init: float = 65536.0  # fp16: the initial dynamic loss scale (2^16)
    loss_scale_window: int = 1000  # fp16: double the scale after this many good steps
    init: str | None = None
    save: str | None = None
    log_json: str | None = None
    progress: bool = True
    checkpoint_dir: str | None = None  # sharded checkpoints (refmp.checkpoint.sharded): DIR/step-{N:08d}/
    save_every: int = 0  # a checkpoint every N steps (0: only at the end)
    keep: int = 0  # keep the last K checkpoints (0: all)
    resume: str | None = None  # continue from the latest complete checkpoint in this directory
    collective_timeout: float = 300.0  # the watchdog: seconds without progress (0: off)
    trace_dir: str | None = None  # the watchdog's report: every rank's flight recorder as JSON
    exit_signal: str = "SIGTERM,SIGUSR1"  # preemption: stop at a step boundary ("none": off)


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr (or constant)."""
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def _in(x: float, lo: float, hi: float, hi_open: bool = True) -> bool:
    """lo <= x < hi (or <= hi); False for nan."""
    return lo <= x and (x < hi if hi_open else x <= hi)


def check_config(cfg: TrainConfig) -> None:
    """Refuse bad values before anything is built (same answer on every rank).

    Comparisons are written so that nan fails them (nan < 0 is False: ``not x >= 0``).
    """
    if cfg.optimizer not in ("sgd", "adamw"):
        raise ConfigError(f"--optimizer must be sgd or adamw, got {cfg.optimizer!r}")
    if cfg.dtype not in ("float32", "float64"):
        raise ConfigError(f"--dtype must be float32 or float64, got {cfg.dtype!r}")
    if cfg.device not in ("cpu", "gpu"):
        raise ConfigError(f"--device must be cpu or gpu, got {cfg.device!r}")
    if cfg.lr_schedule not in ("cosine", "constant"):
        raise ConfigError(f"--lr-schedule must be cosine or constant, got {cfg.lr_schedule!r}")
    for name in ("batch_size", "steps"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):
        raise ConfigError(f"--lr must be positive and finite, got {cfg.lr}")
    if cfg.warmup_steps < 0:
        raise ConfigError(f"--warmup-steps must be >= 0, got {cfg.warmup_steps}")
    if not _in(cfg.min_lr_ratio, 0, 1, hi_open=False):
        raise ConfigError(f"--min-lr-ratio must be between 0 and 1, got {cfg.min_lr_ratio}")
    for name in ("beta1", "beta2", "momentum"):  # 1 would never forget (and AdamW divides by 0)
        if not _in(getattr(cfg, name), 0, 1):
            raise ConfigError(f"--{name} must be in [0, 1), got {getattr(cfg, name)}")
    for name in ("weight_decay", "grad_clip", "bucket_mb", "capacity_factor", "aux_loss_coef",
                 "z_loss_coef"):
        x = getattr(cfg, name)
        if x is not None and not _in(x, 0, math.inf):
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0 and finite, got {x}")
    if cfg.block_size is not None and cfg.block_size < 1:
        raise ConfigError(f"--block-size must be at least 1, got {cfg.block_size}")
    if cfg.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {cfg.seed}")
    if cfg.cp_algo not in ("ring", "ulysses"):
        raise ConfigError(f"--cp-algo must be ring or ulysses, got {cfg.cp_algo!r}")
    if cfg.cp_balance not in ("zigzag", "contiguous"):
        raise ConfigError(f"--cp-balance must be zigzag or contiguous, got {cfg.cp_balance!r}")
    if cfg.mixed_precision not in ("none", "bf16", "fp16"):
        raise ConfigError(f"--mixed-precision must be none, bf16 or fp16, got "
                          f"{cfg.mixed_precision!r}")
    if cfg.grad_dtype not in ("compute", "fp32"):
        raise ConfigError(f"--grad-dtype must be compute or fp32, got {cfg.grad_dtype!r}")
    if cfg.grad_dtype != "compute" and cfg.mixed_precision == "none":
        raise ConfigError("--grad-dtype fp32 needs --mixed-precision bf16 or fp16")
    if cfg.mixed_precision == "bf16" and cfg.device == "gpu":
        raise ConfigError("--mixed-precision bf16 runs on the CPU (ml_dtypes); on the GPU use fp16")
    if cfg.loss_scale_init <= 0 or cfg.loss_scale_window < 1:
        raise ConfigError("--loss-scale-init must be positive and --loss-scale-window at least 1")
    if not _in(cfg.collective_timeout, 0, math.inf):
        raise ConfigError(f"--collective-timeout must be >= 0 and finite, got "
                          f"{cfg.collective_timeout}")
    if not 1 <= cfg.digits <= 6:
        raise ConfigError(f"--digits must be between 1 and 6, got {cfg.digits}")
