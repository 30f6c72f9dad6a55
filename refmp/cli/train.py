"""``refmp train``: its flags (the layout's, which ``refmp bench`` takes too, made from
refmp.config.ParallelConfig's fields: help, group, type, choices and default are the field's),
the TrainConfig they make (with ``--layout auto``, the planner's layout), and the run as a
command: progress, the JSON log, checkpoints, --save, --trace and the summary.

The step itself lives in refmp.training.trainer (Trainer); this module only drives it and reports.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, fields

import numpy as np

from refmp.config import PIPELINE, ParallelConfig, flag_name
from refmp.cost.model import SEARCHED
from refmp.distributed.faults import inject_fault
from refmp.errors import ConfigError, TrainingError
from refmp.training.trainer import TrainConfig, Trainer


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a GPT on any layout",
                       description="Train a GPT-2 style model. Launch with mpiexec for several "
                                   "ranks, e.g. `mpiexec -n 2 refmp train --dp 2`.")
    add_train_args(p)
    p.set_defaults(run=run_train)


def add_layout_args(p: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """How the ranks split the work: the ParallelConfig fields (or those named in ``only``),
    each in its help group, and with them all --trace with the pipeline's."""
    groups = {}
    for f in fields(ParallelConfig):
        if only is not None and f.name not in only:
            continue
        m = f.metadata
        g = groups.get(m["group"])
        if g is None:
            g = groups[m["group"]] = p.add_argument_group(m["group"])
        if m["kind"] is bool:
            g.add_argument(flag_name(f.name), action="store_true", help=m["help"])
        else:
            g.add_argument(flag_name(f.name), type=m["kind"], default=f.default,
                           choices=m["choices"], metavar=m["metavar"], help=m["help"])
    if only is not None:
        return
    groups[PIPELINE].add_argument("--trace", default=None, metavar="PATH.json",
                                  help="write the last step's measured timeline as Chrome "
                                       "trace JSON")


def add_moe_args(p: argparse.ArgumentParser) -> None:
    """MoE flags (train and bench). All but --n-expert default to None, so an explicit flag
    is visible: it wins over an --init file's metadata; None means GPTConfig's default."""
    g = p.add_argument_group("mixture of experts")
    g.add_argument("--n-expert", type=int, default=0, help="experts per MoE layer (0: dense)")
    g.add_argument("--top-k", type=int, default=None,
                   help="experts per token (default 2, or the --init file's)")
    g.add_argument("--moe-every", type=int, default=None,
                   help="block i is MoE if i %% N == 0 (default 1, or the --init file's routers)")
    g.add_argument("--capacity-factor", type=float, default=None,
                   help="slots per expert: ceil(CF*K*T/E) per sequence; 0: no limit "
                        "(default 1.25, or the --init file's)")
    g.add_argument("--aux-loss-coef", type=float, default=None,
                   help="load-balancing loss weight alpha (default 0.01, or the --init file's)")
    g.add_argument("--z-loss-coef", type=float, default=None,
                   help="router z-loss weight (default 0.001, or the --init file's)")


def add_train_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--n-layer", type=int, default=2, help="transformer blocks (default 2)")
    g.add_argument("--n-head", type=int, default=None,
                   help="attention heads (default 4, or the --init file's)")
    g.add_argument("--n-embd", type=int, default=64, help="channels C (default 64)")
    g.add_argument("--block-size", type=int, default=None,
                   help="sequence length T (default: one addition problem, 13; 64 for --data)")
    g.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    g.add_argument("--device", choices=["cpu", "gpu"], default=os.environ.get("REFMP_DEVICE", "cpu"),
                   help="cpu (NumPy) or gpu (CuPy, one GPU per rank); default $REFMP_DEVICE or cpu")
    add_moe_args(p)
    g = p.add_argument_group("data")
    g.add_argument("--data", default=None, metavar="PATH",
                   help="token file: .npy (1-D ints), .bin (uint16, nanoGPT) or any other file "
                        "as bytes (vocab 256). Default: the built-in addition task")
    g.add_argument("--digits", type=int, default=3, help="addition task: digits per operand (3)")
    g.add_argument("--shuffle", action="store_true", help="seeded shuffle of the windows")
    g.add_argument("--seed", type=int, default=0, help="weights, data and shuffle seed (0)")
    g = p.add_argument_group("optimization")
    g.add_argument("--batch-size", type=int, default=128, help="global batch, sequences/step (128)")
    g.add_argument("--steps", type=int, default=1500, help="training steps (1500)")
    g.add_argument("--optimizer", choices=["sgd", "adamw"], default="adamw")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (3e-3)")
    g.add_argument("--lr-schedule", choices=["cosine", "constant"], default="cosine",
                   help="cosine: linear warm-up then decay to --min-lr-ratio * lr")
    g.add_argument("--warmup-steps", type=int, default=None,
                   help="linear warm-up steps, at most --steps (default 100)")
    g.add_argument("--min-lr-ratio", type=float, default=0.1)
    g.add_argument("--weight-decay", type=float, default=0.1,
                   help="decoupled (AdamW) or L2 (SGD), on matrices only (0.1)")
    g.add_argument("--beta1", type=float, default=0.9)
    g.add_argument("--beta2", type=float, default=0.99)
    g.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (0)")
    g.add_argument("--grad-clip", type=float, default=1.0,
                   help="clip the global gradient norm to this (0: off; default 1.0)")
    add_layout_args(p)
    g = p.add_argument_group("automatic layout (docs/plan.md)")
    g.add_argument("--layout", choices=["auto"], default=None,
                   help="auto: ask refmp plan (--machine cpu: this host's GEMM peak, free "
                        "memory and MPI links, measured) for the fastest layout of this model "
                        "that fits the MPI world size, print it (rank 0) and train with it. "
                        f"Layout flags given with it ({' '.join(map(flag_name, SEARCHED))}) "
                        "are fixed choices of the search; --stage-layers is refused. Nothing "
                        "fits: exit 2")
    g = p.add_argument_group("files")
    g.add_argument("--init", default=None, metavar="PATH.safetensors",
                   help="start from these weights; the model shape is read from them")
    g.add_argument("--save", default=None, metavar="PATH.safetensors",
                   help="write the trained model (full, GPT-2 names) once at the end")
    g.add_argument("--log-json", default=None, metavar="PATH",
                   help="one JSON object per step, then a summary object")
    g = p.add_argument_group("checkpoints (docs/checkpoints.md)")
    g.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="write sharded checkpoints DIR/step-NNNNNNNN/ (one file per rank and a "
                        "manifest) at the end, and every --save-every steps")
    g.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="a checkpoint every N steps (0: only at the end)")
    g.add_argument("--keep", type=int, default=0, metavar="K",
                   help="keep only the last K checkpoints in --checkpoint-dir (0: all)")
    g.add_argument("--resume", default=None, metavar="DIR",
                   help="continue from the latest complete checkpoint in DIR, saved by any "
                        "layout; --steps is the total, counting the steps before")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")


def check_flags(args: argparse.Namespace) -> None:
    """Rules between flags as given (TrainConfig cannot tell a default from a choice)."""
    if getattr(args, "warmup_steps", None) is not None and args.warmup_steps > args.steps \
            and args.lr_schedule == "cosine":  # the constant schedule has no warm-up
        raise ConfigError(f"--warmup-steps {args.warmup_steps} is more than --steps "
                          f"{args.steps}: the learning rate would never reach --lr")


def given_flags(add_args, argv: list[str]) -> set[str]:
    """The destinations of the flags on this command line (not their defaults): ``argv``
    parsed again by a parser of the same flags whose defaults are all left unset."""
    p = argparse.ArgumentParser(add_help=False)
    add_args(p)
    for a in p._actions:  # argparse's own list of the flags just added
        a.default = argparse.SUPPRESS
    return set(vars(p.parse_known_args(argv)[0]))


def run_train(args: argparse.Namespace, argv: list[str]) -> dict:
    """The TrainConfig of the flags, or with --layout auto the planner's (the layout flags
    given, ``argv`` after ``train``, kept fixed), then the run."""
    check_flags(args)
    names = {f.name for f in fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items()
             if k in names and not (k == "warmup_steps" and v is None)}
    cfg = TrainConfig(**given)
    if args.layout == "auto":  # the planner's layout, the flags given kept fixed
        from mpi4py import MPI

        from refmp.cli.plan import describe_train, plan_train

        cfg, best = plan_train(cfg, given_flags(add_train_args, argv), MPI.COMM_WORLD)
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(describe_train(best, MPI.COMM_WORLD.Get_size()), flush=True)
    if cfg.stage_layers == "auto":  # measured here, the same split on every rank
        from mpi4py import MPI

        from refmp.cli.plan import stage_layers_auto

        cfg = stage_layers_auto(cfg, MPI.COMM_WORLD)
    return run(cfg)


def run(cfg: TrainConfig) -> dict:
    """Train for cfg.steps steps; print progress and a summary on rank 0; return the summary."""
    from refmp.checkpoint.flags import check_flags
    from refmp.checkpoint.format import complete_steps
    from refmp.checkpoint.weights import save_model

    check_flags(cfg)
    tr = Trainer(cfg)  # with --resume: the weights, optimizer state and step of a checkpoint
    rank0 = tr.grid.rank == 0
    start = tr.step_num
    if start > cfg.steps:
        raise ConfigError(f"--resume {tr.resumed['dir']} is at step {start}, beyond --steps "
                          f"{cfg.steps} (--steps is the total, counting the steps before)")
    log = open(cfg.log_json, "w") if (rank0 and cfg.log_json) else None
    if rank0 and cfg.init:  # where a flag overrides the file, said once (the file was read)
        from refmp.checkpoint.weights import moe_flags, read_config

        for note in read_config(cfg.init, cfg.n_head, moe_flags(cfg))[1]:
            print(f"refmp train: warning: {note}", file=sys.stderr, flush=True)
    if rank0:
        m = tr.model.cfg
        print(f"refmp train: {tr.ds.name}, {len(tr.ds.tokens):,} tokens, vocab {m.vocab_size}; "
              f"GPT {m.n_layer} layers, {m.n_head} heads, n_embd {m.n_embd}, block {tr.T}, "
              f"{tr.model.num_params():,} parameters ({cfg.dtype}); {tr.grid.describe()}", flush=True)
    if rank0 and tr.resumed:
        _print_resume(tr.resumed, cfg)
    bar = _progress(cfg.steps - start, rank0 and cfg.progress)
    t_start, rec = time.perf_counter(), {}
    while tr.step_num < cfg.steps:  # --steps is the total: a resumed run does the rest
        step = tr.step_num
        inject_fault(tr.grid.rank, step)  # a testing hook (REFMP_FAULT_RANK), off by default
        try:
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                rec = tr.step()  # a non-finite result is reported once, by the step's check
        except TrainingError as e:  # every rank stops (refmp.cli.main says why, once)
            if log:
                log.write(json.dumps({"error": str(e), "step": step}) + "\n")
                log.close()
            raise
        if cfg.checkpoint_dir and cfg.save_every and tr.step_num % cfg.save_every == 0 \
                and tr.step_num < cfg.steps:  # the last one is written below
            tr.save_checkpoint(cfg.checkpoint_dir, cfg.keep)
        if log:
            log.write(json.dumps(rec) + "\n")
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens'] / rec['seconds']:.0f}")
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - t_start
    if cfg.checkpoint_dir and (tr.step_num > start
                               or tr.step_num not in complete_steps(cfg.checkpoint_dir)):
        written = tr.save_checkpoint(cfg.checkpoint_dir, cfg.keep)  # always at the end
        if rank0:
            print(f"checkpoint of step {tr.step_num} written to {written}", flush=True)
    if cfg.trace:  # the last step's measured pipeline timeline (collective over pp)
        timeline = tr.runner.timeline()
        if rank0:
            timeline.write_trace(cfg.trace)
            print(f"pipeline timeline of the last step written to {cfg.trace}; measured "
                  f"bubble {100 * timeline.bubble():.1f}%", flush=True)
    score = tr.evaluate()
    memory = tr.grid.world.allgather_obj(tr.memory())
    if cfg.save:
        full = tr.runner.full_params()  # collective where the model is split; rank 0 gets it
        if rank0:
            save_model(cfg.save, full, tr.model.cfg, tr.ds.vocab)
        tr.grid.world.barrier()
    summary = {
        "summary": True, "steps": cfg.steps, "start_step": start, "final_loss": rec.get("loss"),
        "tokens_per_s": (cfg.steps - start) * cfg.batch_size * tr.T / max(seconds, 1e-9),
        "seconds": seconds,
        "accuracy": None if score is None else score[0] / max(1, score[1]),
        "comm": tr.grid.ledger.as_dict(), "memory_per_rank": memory,
        "layout": tr.grid.sizes, "device": tr.device_info, "config": asdict(cfg),
    }
    if "moe" in rec:
        summary["moe"] = rec["moe"]  # the last step's routing statistics
    if log:
        log.write(json.dumps(summary) + "\n")
        log.close()
    if rank0:
        _print_summary(summary, score)
    return summary


def _print_resume(man: dict, cfg: TrainConfig) -> None:
    """Where the run continues from (the checkpoint's manifest), and the settings that differ
    from the saved run's."""
    from refmp.checkpoint.flags import config_notes

    lay = man["layout"]
    saved = " x ".join(f"{a}={lay[a]}" for a in ("pp", "dp", "cp", "tp", "ep"))
    print(f"refmp train: resuming from {man['dir']} at step {man['step']} of {cfg.steps} "
          f"(saved on {saved}, ZeRO {lay['zero']})", flush=True)
    for note in config_notes(man, cfg):
        print(f"refmp train: warning: {note}", file=sys.stderr, flush=True)


def _progress(total: int, enabled: bool):
    """tqdm on a terminal; in a log (not a TTY), a plain line about every 10% of the run."""
    if not enabled:
        return None
    from tqdm import tqdm

    if sys.stderr.isatty():
        return tqdm(total=total, desc="train", unit="step", mininterval=0.5)
    return _LogProgress(total)


class _LogProgress:
    """tqdm's update/set_postfix/close, printing one line per tenth of the run."""

    def __init__(self, total: int):
        self.total, self.n, self.every, self.post = total, 0, max(1, total // 10), {}

    def update(self, k: int) -> None:
        self.n += k

    def set_postfix(self, **post) -> None:
        if self.n % self.every == 0 or self.n == self.total:
            print(f"step {self.n}/{self.total} " + " ".join(f"{k} {v}" for k, v in post.items()),
                  flush=True)

    def close(self) -> None:
        pass


def _print_summary(s: dict, score) -> None:
    dev = s["device"]
    if "cuda_aware" in dev:
        print(f"device: {dev['device']} per rank; CUDA-aware MPI: {dev['cuda_aware']} "
              f"(from {dev['cuda_aware_source']}; {'direct' if dev['cuda_aware'] else 'staged'})")
    if s["final_loss"] is None:  # resumed at the last step: nothing left to train
        print(f"done: the checkpoint was already at step {s['steps']}; nothing to train")
    else:
        print(f"done: {s['steps'] - s['start_step']} steps in {s['seconds']:.1f} s, final loss "
              f"{s['final_loss']:.4f}, {s['tokens_per_s']:,.0f} tokens/s")
    if score is not None:
        print(f"held-out exact match: {score[0]}/{score[1]} = {100 * s['accuracy']:.1f}%")
    if "moe" in s:
        moe = s["moe"]
        print(f"experts (last step): aux loss {moe['aux_loss']:.4g}, z-loss {moe['z_loss']:.4g}")
        for i, (n, d) in enumerate(zip(moe["tokens_per_expert"], moe["dropped"], strict=True)):
            print(f"  MoE layer {i}: tokens per expert {n}, dropped {100 * d:.1f}%")
    print("communication (bytes, calls):")
    for key, v in s["comm"].items():
        print(f"  {key:<24} {v['bytes']:>14,} B  {v['count']:>6} calls")
    print("memory per rank (bytes): params, grads, optimizer state, peak activations")
    for r, m in enumerate(s["memory_per_rank"]):
        print(f"  rank {r}: {m['params']:>12,} {m['grads']:>12,} {m['optimizer']:>12,} "
              f"{m.get('activations', 0):>12,}")
