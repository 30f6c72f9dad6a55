"""``refmp convert``: a sharded checkpoint as one GPT-2 file, and back; ``--info``: what a
checkpoint holds (refmp.checkpoint.convert).
"""

from __future__ import annotations

import argparse
import os

from refmp.errors import ConfigError


def add_parser(sub) -> None:
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
    c.add_argument("--n-head", type=int, default=None, metavar="N",
                   help="FILE to DIR: the attention heads of a file that does not say them (a "
                        "GPT-2 file from another implementation)")
    c.set_defaults(run=run_convert)


def run_convert(args: argparse.Namespace) -> None:
    """``refmp convert``: one process, no MPI communication."""
    from refmp.checkpoint import convert

    if args.n_head is not None and not os.path.isfile(args.src):
        raise ConfigError("--n-head is for a .safetensors SRC; a checkpoint's manifest says it")
    if args.info:
        if args.out is not None:
            raise ConfigError("--info prints what SRC holds and writes nothing: give no OUT")
        print(convert.info(args.src))
    elif args.out is None:
        raise ConfigError(f"convert {args.src}: give OUT (a .safetensors file or a directory), "
                          f"or --info")
    elif os.path.isfile(args.src):
        print(f"wrote {convert.from_gpt2(args.src, args.out, args.n_head)} (1 rank, step 0) from {args.src}")
    else:
        print(f"wrote {args.out} from {convert.to_gpt2(args.src, args.out)}")
