"""The ``refmp`` command: ``refmp train``, ``bench``, ``schedule``, ``convert``, ``plan``
and ``trace`` (also ``python -m refmp``).

Run it under MPI for more than one rank: ``mpiexec -n 2 refmp train --dp 2``.
How a run ends when something goes wrong (refmp.distributed.faults, docs/faults.md): bad input prints
one message (from rank 0) and every rank exits with status 2; a non-finite loss or gradient
norm, one message and status 3; any other exception on any rank prints that rank's traceback
(``[rank r]`` before each line) and aborts the whole job (MPI_Abort); a rank without
progress for --collective-timeout seconds, the watchdog's report and status 5; a SIGTERM
(--exit-signal), a stop at the next step boundary (a checkpoint with --checkpoint-dir), one
message and status 4.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields

from refmp.distributed.preemption import EXIT_PREEMPTED, Preempted
from refmp.errors import ConfigError, TrainingError

EXIT_BAD_INPUT = 2
EXIT_TRAINING = 3  # a run stopped on every rank (refmp.errors.TrainingError)


def launcher_rank() -> int:
    """This process's rank as the launcher tells it, without initializing MPI (for --help)."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


class Parser(argparse.ArgumentParser):
    """argparse, printing usage errors from rank 0 only (every rank still exits 2)."""

    def error(self, message):
        if launcher_rank() == 0:
            self.print_usage(sys.stderr)
            sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(EXIT_BAD_INPUT)


def add_model_args(p: argparse.ArgumentParser) -> None:
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
    add_model_args(p)
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
                        "Layout flags given with it (--tp --pp --dp --cp --ep --zero "
                        "--sequence-parallel --recompute --mixed-precision --microbatches "
                        "--schedule --virtual-stages --cp-algo) are fixed choices of the "
                        "search; --stage-layers is refused. Nothing fits: exit 2")
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
    g = p.add_argument_group("hangs and preemption (docs/faults.md)")
    g.add_argument("--collective-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="a rank without progress this long (waiting in a call, or computing) "
                        "makes every rank report where it is, names the stuck rank and ends "
                        "the job, status 5 (0: off; default 300)")
    g.add_argument("--trace-dir", default=None, metavar="DIR",
                   help="on such a timeout, write every rank's flight recorder (its last "
                        "2,000 calls) to DIR/rank{r}.json; read them with `refmp trace DIR`")
    g.add_argument("--exit-signal", default="SIGTERM,SIGUSR1", metavar="SIGNALS",
                   help="signals that stop the run at the next step boundary, with a "
                        "checkpoint when --checkpoint-dir is given, status 4 (comma-separated; "
                        "none: off; default SIGTERM,SIGUSR1)")


def add_layout_args(p: argparse.ArgumentParser) -> None:
    """How the ranks split the work (train and bench): the axes, ZeRO, pipeline, cp options."""
    g = p.add_argument_group("layout")
    g.add_argument("--dp", type=int, default=None,
                   help="data-parallel ranks (default: world size / (pp*cp*tp))")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (1)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: shard LayerNorms and residuals along the sequence")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages (1)")
    g.add_argument("--cp", type=int, default=1, help="context-parallel ranks (1)")
    g.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks, carved from the dp x cp ranks (1)")
    g.add_argument("--microbatches", type=int, default=1,
                   help="micro-batches per step: pipeline micro-batches, or gradient "
                        "accumulation without --pp (1)")
    g.add_argument("--bucket-mb", type=float, default=25.0,
                   help="data parallel: gradient all-reduce bucket size in MB, overlapped "
                        "with backward (0: one all-reduce after backward; default 25)")
    g.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                   help="ZeRO stage: 1 shards optimizer state, 2 also gradients, "
                        "3 also parameters (0: plain data parallel)")
    g.add_argument("--recompute", choices=["none", "selective", "full"], default="none",
                   help="activation recomputation (Korthikanti et al. 2022): full keeps each "
                        "block's input and recomputes its forward in backward; selective "
                        "recomputes attention's softmax; same results, bitwise (none)")
    add_precision_args(p)
    from refmp.cli.schedule import add_pipeline_args

    add_pipeline_args(p)
    g = p.add_argument_group("context parallelism (--cp)")
    g.add_argument("--cp-algo", choices=["ring", "ulysses"], default="ring",
                   help="ring: K/V blocks around the ring; ulysses: all-to-all to heads (ring)")
    g.add_argument("--cp-balance", choices=["zigzag", "contiguous"], default="zigzag",
                   help="zigzag: rank r holds chunks r and 2cp-1-r of 2cp, equal causal work "
                        "(default); contiguous: chunk r of cp")


def add_precision_args(p: argparse.ArgumentParser) -> None:
    """Mixed precision (train and bench): the compute dtype, the gradients', fp16's loss scale."""
    g = p.add_argument_group("mixed precision (Micikevicius et al. 2018)")
    g.add_argument("--mixed-precision", choices=["none", "bf16", "fp16"], default="none",
                   help="compute copy of the weights, activations and gradients in bf16 or "
                        "fp16, fp32 master weights and optimizer state (--dtype); on the CPU "
                        "products run in fp32 on the rounded operands (none)")
    g.add_argument("--grad-dtype", choices=["compute", "fp32"], default="compute",
                   help="with --mixed-precision: accumulate and reduce gradients in the "
                        "compute dtype or in fp32 (compute)")
    g.add_argument("--loss-scale-init", type=float, default=65536.0,
                   help="fp16: initial dynamic loss scale (65536)")
    g.add_argument("--loss-scale-window", type=int, default=1000,
                   help="fp16: double the loss scale after this many steps without "
                        "overflow; an overflow skips the step and halves it (1000)")


def make_parser() -> argparse.ArgumentParser:
    p = Parser(prog="refmp", description="refmp: GPT-2 in NumPy, split across MPI ranks.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    t = sub.add_parser("train", help="train a GPT (data parallel over the MPI ranks)",
                       description="Train a GPT-2 style model. Launch with mpiexec for several "
                                   "ranks, e.g. `mpiexec -n 2 refmp train --dp 2`.")
    add_train_args(t)
    b = sub.add_parser("bench", help="time training steps: ms/step, tokens/s, FLOP/s, MFU",
                       description="Time training steps of a model and report ms/step, "
                                   "tokens/s, model FLOP/s and MFU against a measured peak.")
    from refmp.cli.bench import add_bench_args

    add_bench_args(b)  # the model preset and the timing; the rest is train's own flags
    add_moe_args(b)
    add_layout_args(b)
    from refmp.cli.schedule import add_schedule_parser
    from refmp.cli.trace import add_trace_parser

    add_schedule_parser(sub)
    add_trace_parser(sub)
    pl = sub.add_parser("plan", help="predict memory and step time of layouts; search the best",
                        description="Predict memory per rank and step time of every layout of "
                                    "a model on a machine, and print the fastest that fit "
                                    "(a pure computation, no MPI: docs/plan.md).")
    from refmp.cost.search import add_plan_args

    add_plan_args(pl)
    c = sub.add_parser("convert", help="a sharded checkpoint to one GPT-2 file, and back",
                       description="`refmp convert DIR OUT.safetensors`: the checkpoint in DIR "
                                   "(its latest, or DIR/step-N) as one GPT-2-named file, the "
                                   "--save format; `refmp convert FILE.safetensors DIR`: a "
                                   "1-rank checkpoint of those weights (step 0, no optimizer "
                                   "state) that --resume reads into any layout; `refmp convert "
                                   "--info DIR`: what a checkpoint holds, and who holds which "
                                   "slice.")
    c.add_argument("src", metavar="SRC", help="a checkpoint directory or a .safetensors file")
    c.add_argument("out", metavar="OUT", nargs="?", help="the file or directory to write")
    c.add_argument("--info", action="store_true", help="print what SRC holds; write nothing")
    return p


def run_convert(args) -> None:
    """``refmp convert``: one process, no MPI communication."""
    from refmp.checkpoint import convert

    if args.info:
        if args.out is not None:
            raise ConfigError("--info prints what SRC holds and writes nothing: give no OUT")
        print(convert.info(args.src))
    elif args.out is None:
        raise ConfigError(f"convert {args.src}: give OUT (a .safetensors file or a directory), "
                          f"or --info")
    elif os.path.isfile(args.src):
        print(f"wrote {convert.from_gpt2(args.src, args.out)} (1 rank, step 0) from {args.src}")
    else:
        print(f"wrote {args.out} from {convert.to_gpt2(args.src, args.out)}")


def limit_threads() -> None:
    """One BLAS/OpenMP thread pool per rank must not oversubscribe the cores.

    Before NumPy loads: if the launcher says several ranks share this node and the user set
    no thread count, give each rank cores // local ranks threads (at least 1). Idle BLAS
    threads spin, so 2 ranks x 2 threads on 2 cores runs many times slower than 2 x 1.
    """
    from refmp.runtime.cpu import cores, local_ranks  # no NumPy there

    if local_ranks() <= 1:
        return
    threads = str(max(1, cores() // local_ranks()))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, threads)


def check_flags(args: argparse.Namespace) -> None:
    """Rules between flags as given (TrainConfig cannot tell a default from a choice)."""
    if getattr(args, "warmup_steps", None) is not None and args.warmup_steps > args.steps \
            and args.lr_schedule == "cosine":  # the constant schedule has no warm-up
        raise ConfigError(f"--warmup-steps {args.warmup_steps} is more than --steps "
                          f"{args.steps}: the learning rate would never reach --lr")


def given_flags(add_args, argv: list[str]) -> set[str]:
    """The destinations of the flags on this command line (not their defaults): ``argv``
    parsed again by a parser of the same flags whose defaults are all left unset."""
    p = Parser(add_help=False)
    add_args(p)
    for a in p._actions:  # argparse's own list of the flags just added
        a.default = argparse.SUPPRESS
    return set(vars(p.parse_known_args(argv)[0]))


def main(argv: list[str] | None = None) -> int:
    limit_threads()
    args = make_parser().parse_args(argv)
    from refmp.distributed.faults import abort_job, write_pid

    write_pid(launcher_rank())  # a testing hook (REFMP_TEST_PID_DIR), off by default
    try:
        if args.command == "train":
            from refmp.cli.train import run
            from refmp.training.trainer import TrainConfig

            check_flags(args)
            names = {f.name for f in fields(TrainConfig)}
            given = {k: v for k, v in vars(args).items()
                     if k in names and not (k == "warmup_steps" and v is None)}
            cfg = TrainConfig(**given)
            if args.layout == "auto":  # the planner's layout, the flags given kept fixed
                from mpi4py import MPI

                from refmp.cost.search import describe_train, plan_train

                argv = sys.argv[1:] if argv is None else argv
                cfg, best = plan_train(cfg, given_flags(add_train_args, argv[1:]),
                                       MPI.COMM_WORLD)
                if MPI.COMM_WORLD.Get_rank() == 0:
                    print(describe_train(best, MPI.COMM_WORLD.Get_size()), flush=True)
            run(cfg)
        elif args.command == "bench":
            from refmp.cli.bench import run_bench

            run_bench(args)
        elif args.command == "convert":
            run_convert(args)
        elif args.command == "plan":
            from refmp.cost.search import run_plan

            run_plan(args)
        elif args.command == "schedule":
            from refmp.cli.schedule import run_schedule

            run_schedule(args)
        elif args.command == "trace":
            from refmp.cli.trace import run_trace

            run_trace(args)
    except (ConfigError, TrainingError) as e:  # raised on every rank: said once, rank 0
        if launcher_rank() == 0:
            sys.stderr.write(f"refmp {args.command}: error: {e}\n")
        return EXIT_BAD_INPUT if isinstance(e, ConfigError) else EXIT_TRAINING
    except Preempted as e:  # every rank, at the same step boundary
        if launcher_rank() == 0:
            sys.stderr.write(f"refmp {args.command}: {e}\n")
        return EXIT_PREEMPTED
    except (Exception, KeyboardInterrupt):  # noqa: BLE001  one rank: it must not wait alone
        abort_job()  # this rank's traceback, then MPI_Abort ends every rank
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
