"""The flags of ``refmp train`` (and those ``bench`` and ``generate`` share): the layout's
made from refmp.config.ParallelConfig's fields, the model's, the optimizer's, the files'."""

from __future__ import annotations

import argparse
import os
from dataclasses import fields

from refmp.config import PIPELINE, ParallelConfig, TrainConfig, flag_name
from refmp.cost.model import SEARCHED
from refmp.errors import ConfigError


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


def add_moe_args(p: argparse.ArgumentParser, decoding: bool = False) -> None:
    """MoE flags (train and bench). All but --n-expert default to None, so an explicit flag
    is visible: it wins over an --init file's metadata; None means GPTConfig's default.

    ``decoding`` (generate): the flags that change what a trained model computes, --moe-top-k
    (dest ``moe_top_k``: --top-k is the sampler's there) and --moe-every; the weights give
    the experts, decoding routes every token (no capacity) and has no loss to weigh."""
    g = p.add_argument_group("mixture of experts")
    if decoding:
        g.add_argument("--moe-top-k", type=int, default=None,
                       help="experts per token (default: the weights' metadata, or 2)")
    else:
        g.add_argument("--n-expert", type=int, default=0, help="experts per MoE layer (0: dense)")
        g.add_argument("--top-k", type=int, default=None,
                       help="experts per token (default 2, or the --init file's)")
    g.add_argument("--moe-every", type=int, default=None,
                   help="block i is MoE if i %% N == 0 (default 1, or the --init file's routers)")
    if decoding:
        return
    g.add_argument("--capacity-factor", type=float, default=None,
                   help="slots per expert: ceil(CF*K*T/E) per sequence; 0: no limit "
                        "(default 1.25, or the --init file's)")
    g.add_argument("--aux-loss-coef", type=float, default=None,
                   help="load-balancing loss weight alpha (default 0.01, or the --init file's)")
    g.add_argument("--z-loss-coef", type=float, default=None,
                   help="router z-loss weight (default 0.001, or the --init file's)")


def add_family_args(p: argparse.ArgumentParser) -> None:
    """The model family (refmp.training.families): GPT-2, or a Llama-family model whose
    shape a fresh run must give in full (nothing is guessed) and an --init directory says."""
    g = p.add_argument_group("model family (docs/llama.md)")
    g.add_argument("--arch", choices=["gpt2", "llama"], default=None,
                   help="gpt2, or llama: RMSNorm, rotary positions, SwiGLU, grouped-query "
                        "attention (default: llama for a LlamaForCausalLM --init directory, "
                        "else gpt2)")
    g.add_argument("--n-kv-head", type=int, default=None, help="llama: key/value heads")
    g.add_argument("--ffn", type=int, default=None,
                   help="llama: the SwiGLU MLP's width (intermediate_size)")
    g.add_argument("--rope-theta", type=float, default=None, help="llama: the rotary base")
    g.add_argument("--rms-eps", type=float, default=None, help="llama: RMSNorm's epsilon")
    g.add_argument("--head", choices=["tied", "untied"], default=None,
                   help="llama: the head is wte (tied) or lm_head, a matrix of its own")


def add_train_args(p: argparse.ArgumentParser) -> None:
    """The flags of a run; their defaults are TrainConfig's."""
    D = TrainConfig
    g = p.add_argument_group("model")
    g.add_argument("--n-layer", type=int, default=D.n_layer, help="transformer blocks (default %(default)s)")
    g.add_argument("--n-head", type=int, default=None,
                   help="attention heads (default 4, or the --init file's)")
    g.add_argument("--n-embd", type=int, default=D.n_embd, help="channels C (default %(default)s)")
    g.add_argument("--block-size", type=int, default=None,
                   help="sequence length T (default: one addition problem, 13; 64 for --data)")
    g.add_argument("--dtype", choices=["float32", "float64"], default=D.dtype)
    g.add_argument("--device", choices=["cpu", "gpu"], default=os.environ.get("REFMP_DEVICE", "cpu"),
                   help="cpu (NumPy) or gpu (CuPy, one GPU per rank); default $REFMP_DEVICE or cpu")
    add_moe_args(p)
    add_family_args(p)
    g = p.add_argument_group("data")
    g.add_argument("--data", default=None, metavar="PATH",
                   help="token file: .npy (1-D ints), .bin (uint16, nanoGPT) or any other file "
                        "as bytes (vocab 256), or with --tokenizer as text. Default: the "
                        "built-in addition task")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="tokenize a text --data file with this Hugging Face tokenizer "
                        "(tokenizer.json, or vocab.json and merges.txt; the text extra), "
                        "cached as FILE.tokens.bin beside it")
    g.add_argument("--digits", type=int, default=D.digits,
                   help="addition task: digits per operand (%(default)s)")
    g.add_argument("--shuffle", action="store_true", help="seeded shuffle of the windows")
    g.add_argument("--seed", type=int, default=D.seed, help="weights, data and shuffle seed (%(default)s)")
    g = p.add_argument_group("optimization")
    g.add_argument("--batch-size", type=int, default=D.batch_size,
                   help="global batch, sequences/step (%(default)s)")
    g.add_argument("--steps", type=int, default=D.steps, help="training steps (%(default)s)")
    g.add_argument("--optimizer", choices=["sgd", "adamw"], default=D.optimizer)
    g.add_argument("--lr", type=float, default=D.lr, help="peak learning rate (%(default)g)")
    g.add_argument("--lr-schedule", choices=["cosine", "constant"], default=D.lr_schedule,
                   help="cosine: linear warm-up then decay to --min-lr-ratio * lr")
    g.add_argument("--warmup-steps", type=int, default=None,
                   help=f"linear warm-up steps, at most --steps (default {D.warmup_steps})")
    g.add_argument("--min-lr-ratio", type=float, default=D.min_lr_ratio)
    g.add_argument("--weight-decay", type=float, default=D.weight_decay,
                   help="decoupled (AdamW) or L2 (SGD), on matrices only (%(default)g)")
    g.add_argument("--beta1", type=float, default=D.beta1)
    g.add_argument("--beta2", type=float, default=D.beta2)
    g.add_argument("--momentum", type=float, default=D.momentum, help="SGD momentum (%(default)g)")
    g.add_argument("--grad-clip", type=float, default=D.grad_clip,
                   help="clip the global gradient norm to this (0: off; default %(default)s)")
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
    g.add_argument("--init", default=None, metavar="PATH",
                   help="start from these weights (a .safetensors file or a Hugging Face "
                        "directory); the model shape is read from them")
    g.add_argument("--save", default=None, metavar="PATH",
                   help="write the trained model (full, GPT-2 names) once at the end: a PATH "
                        "ending in .safetensors is one file, any other a Hugging Face "
                        "directory (config.json, model.safetensors, the --tokenizer's files)")
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
