"""``refmp train``: its flags (the layout's, which ``refmp bench`` takes too, made from
refmp.config.ParallelConfig's fields: help, group, type, choices and default are the field's),
the TrainConfig they make (with ``--layout auto``, the planner's layout), and the run as a
command: progress, the JSON log, checkpoints, --save, --trace and the summary.

The step itself lives in refmp.training.trainer (Trainer, which checks the run first:
refmp.training.checks), the held-out evaluation in refmp.training.evaluate; this module only
drives them and reports.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, fields

import numpy as np

from refmp.cli.flags import add_train_args, check_flags, given_flags
from refmp.distributed.faults import inject_fault
from refmp.distributed.preemption import Preempted, Preemption
from refmp.distributed.topology import crossing_notes
from refmp.distributed.watchdog import Watchdog
from refmp.errors import ConfigError, TrainingError
from refmp.nn.families import is_llama
from refmp.parallel.data.hpz import block_notes
from refmp.parallel.data.hsdp import shard_notes
from refmp.training.checks import moe_flags
from refmp.training.evaluate import evaluate
from refmp.training.families import arch_of, cost_shape, save_model
from refmp.training.rank_memory import measured, print_measured
from refmp.training.trainer import TrainConfig, Trainer


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a GPT or a Llama model on any layout",
                       description="Train a GPT-2 style model, or with --arch llama (or --init "
                                   "a LlamaForCausalLM directory) a Llama-family one. Launch "
                                   "with mpiexec for several ranks, e.g. `mpiexec -n 2 refmp "
                                   "train --dp 2`.")
    add_train_args(p)
    p.set_defaults(run=run_train)


def run_train(args: argparse.Namespace, argv: list[str]) -> dict:
    """The TrainConfig of the flags, or with --layout auto the planner's (the layout flags
    given, ``argv`` after ``train``, kept fixed), then the run."""
    check_flags(args)
    names = {f.name for f in fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items()
             if k in names and not (k == "warmup_steps" and v is None)}
    cfg = TrainConfig(**given)
    if "auto" in (args.layout, cfg.stage_layers) and arch_of(cfg) == "llama":
        raise ConfigError("--layout auto and --stage-layers auto measure GPT-2's blocks; for "
                          "--arch llama give the layout and --stage-layers N,N,... yourself")
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
    from refmp.checkpoint.format import complete_steps
    from refmp.distributed.faults import agreed

    stop = Preemption(cfg.exit_signal)  # a bad signal name is bad input, before any work
    tr = Trainer(cfg)  # with --resume: the weights, optimizer state and step of a checkpoint
    stop.install(tr.grid)  # from here a signal waits for the next step boundary
    rank0 = tr.grid.rank == 0
    start = tr.step_num
    if start > cfg.steps:
        raise ConfigError(f"--resume {tr.resumed['dir']} is at step {start}, beyond --steps "
                          f"{cfg.steps} (--steps is the total, counting the steps before)")
    log = open(cfg.log_json, "w") if (rank0 and cfg.log_json) else None
    if rank0 and cfg.init and not is_llama(tr.mcfg):  # a flag overriding the file, said once
        from refmp.checkpoint.weights import read_config

        for note in read_config(cfg.init, cfg.n_head, moe_flags(cfg))[1]:
            print(f"refmp train: warning: {note}", file=sys.stderr, flush=True)
    if rank0:
        m = tr.mcfg
        heads = f"{m.n_head} heads" + (f" ({m.n_kv_head} key/value)" if is_llama(m) else "")
        print(f"refmp train: {tr.ds.name}, {len(tr.ds.tokens):,} tokens, vocab {m.vocab_size}; "
              f"{'Llama' if is_llama(m) else 'GPT'} {m.n_layer} layers, {heads}, "
              f"n_embd {m.n_embd}, block {tr.T}, "
              f"{tr.num_params:,} parameters ({cfg.dtype}); {tr.grid.describe()}"
              f"{_on_nodes(tr.grid.nodes)}", flush=True)
        notes = crossing_notes(tr.grid.sizes, tr.grid.nodes)  # tp or cp across nodes
        notes += block_notes(tr.grid.sizes, tr.grid.nodes, cfg.hpz_size)  # hpZ's blocks
        notes += shard_notes(tr.grid.sizes, tr.grid.nodes, cfg.dp_shard)  # HSDP's shard groups
        for note in notes:  # before the first step
            print(f"refmp train: warning: {note}", file=sys.stderr, flush=True)
    if rank0 and tr.resumed:
        _print_resume(tr.resumed, cfg)
    watchdog = (Watchdog(tr.grid.mpi, tr.grid.recorder, cfg.collective_timeout, cfg.trace_dir)
                .start() if cfg.collective_timeout > 0 and tr.grid.world.size > 1 else None)
    bar = _progress(cfg.steps - start, rank0 and cfg.progress)
    t_start, rec = time.perf_counter(), {}
    while tr.step_num < cfg.steps:  # --steps is the total: a resumed run does the rest
        step = tr.step_num
        tr.grid.recorder.step = step  # the flight recorder labels each call with its step
        inject_fault(tr.grid.rank, step, tr.grid.comm["pp"])  # a testing hook, off by default
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
        if (signame := stop.agreed()) is not None:  # the step boundary every rank agrees on
            _preempted(tr, cfg, signame, log, bar)
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
    score = evaluate(tr.runner, tr.grid, tr.mcfg, tr.T, tr.ds.task)
    memory = tr.grid.world.allgather_obj(tr.memory())
    if cfg.save:  # tensor by tensor: each gathered whole onto rank 0 alone, written, let go
        agreed(tr.grid.world, lambda: save_model(
            cfg, tr.mcfg, tr.runner.weight_dtype, tr.runner.param_gatherer(),
            tr.ds.vocab, tr.ds.tokenizer, write=rank0))
    # each rank's measured peak (after the run, the evaluation and --save) and the prediction
    peaks = tr.grid.world.allgather_obj(measured(cfg, cost_shape(tr.mcfg), tr.grid.sizes,
                                                 tr.grid.coords))
    summary = {
        "summary": True, "steps": cfg.steps, "start_step": start, "final_loss": rec.get("loss"),
        "tokens_per_s": (cfg.steps - start) * cfg.batch_size * tr.T / max(seconds, 1e-9),
        "seconds": seconds,
        "accuracy": None if score is None else score[0] / max(1, score[1]),
        "comm": tr.grid.ledger.as_dict(), "memory_per_rank": memory, "memory_measured": peaks,
        "layout": tr.grid.sizes, "device": tr.device_info, "config": asdict(cfg),
    }
    if "moe" in rec:
        summary["moe"] = rec["moe"]  # the last step's routing statistics
    if log:
        log.write(json.dumps(summary) + "\n")
        log.close()
    if rank0:
        _print_summary(summary, score)
    if watchdog is not None:
        watchdog.stop()
    return summary


def _on_nodes(nodes: tuple[int, ...]) -> str:
    """" on 2 nodes (ranks 0-1, 2-3)" when the ranks are on several nodes, else ""."""
    if len(set(nodes)) == 1:
        return ""
    ranks = [[r for r, n in enumerate(nodes) if n == k] for k in sorted(set(nodes))]
    return (f" on {len(ranks)} nodes (ranks "
            + ", ".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else f"{g[0]}" for g in ranks) + ")")


def _preempted(tr: Trainer, cfg: TrainConfig, signame: str, log, bar) -> None:
    """Stop at this step boundary (every rank): the checkpoint, one message, Preempted."""
    from refmp.checkpoint.format import complete_steps

    step = tr.step_num
    if bar is not None:
        bar.close()
    if cfg.checkpoint_dir is None:
        saved = "no --checkpoint-dir: nothing saved"
    else:
        if step not in complete_steps(cfg.checkpoint_dir):  # else --save-every just wrote it
            tr.save_checkpoint(cfg.checkpoint_dir, cfg.keep)
        saved = f"checkpoint of step {step} in {cfg.checkpoint_dir} (continue with --resume)"
    message = f"stopped by {signame} after step {step} of {cfg.steps}; {saved}"
    if log:
        log.write(json.dumps({"preempted": signame, "step": step}) + "\n")
        log.close()
    raise Preempted(message)


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
        self.total = total
        self.n = 0
        self.every = max(1, total // 10)
        self.post = {}

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
        print(f"  {key:<32} {v['bytes']:>14,} B  {v['count']:>6} calls")
    print_memory(s["memory_per_rank"])
    print_measured(s["memory_measured"])


def print_memory(rows: list[dict]) -> None:
    """The memory table of a run's summary: one line a rank."""
    # the columns every run has, then the buffers only some layouts keep (when nonzero):
    # 2BW's second weight version and stashed gradients, the codecs' error buffers
    extra = {"versions": "weight version W(t-1)", "grad_stash": "next batch's gradients",
             "error_feedback": "codec error buffers"}
    shown = [k for k in extra if any(m.get(k) for m in rows)]
    print("memory per rank (bytes): params, grads, optimizer state, peak activations"
          + "".join(f", {extra[k]}" for k in shown))
    for r, m in enumerate(rows):
        print(f"  rank {r}: {m['params']:>12,} {m['grads']:>12,} {m['optimizer']:>12,} "
              f"{m.get('activations', 0):>12,}" + "".join(f" {m[k]:>12,}" for k in shown))
