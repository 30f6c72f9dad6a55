"""What a resumed run changes of the saved one (the checkpoint flags themselves are checked
with the run's other flags: refmp.training.checks)."""

from __future__ import annotations

from dataclasses import asdict

from refmp.config import TrainConfig

MATH_FIELDS = ("batch_size", "optimizer", "lr", "lr_schedule", "warmup_steps", "min_lr_ratio",
               "weight_decay", "beta1", "beta2", "momentum", "grad_clip", "dtype", "seed", "data",
               "tokenizer", "shuffle", "digits", "steps")  # the settings that change a step's numbers


def config_notes(man: dict, cfg: TrainConfig) -> list[str]:
    """Where this run's training settings differ from the saved run's (said once, rank 0)."""
    saved = man.get("config") or {}
    given = asdict(cfg)
    notes = [f"--{k.replace('_', '-')} {given[k]} differs from the checkpoint's {saved[k]}"
             for k in MATH_FIELDS if k in saved and saved[k] != given[k]]
    if cfg.grad_compress in ("powersgd", "topk") and not man.get("codec_restored"):
        notes.append(f"--grad-compress {cfg.grad_compress}: the checkpoint holds no codec state "
                     f"for this layout and codec (a rank's error buffers and Q's are its own), "
                     f"so error feedback and PowerSGD's Q start afresh")
    if cfg.fp8 == "delayed" and not man.get("fp8_restored"):
        notes.append("--fp8 delayed: the checkpoint holds no amax history (its run scaled "
                     f"by {saved.get('fp8', 'none')}), so the history starts afresh: the first "
                     "step scales by its current amaxes")
    return notes
