"""``refmp convert``: a sharded checkpoint as one GPT-2 file or a Hugging Face directory, and
back; ``--hf``: weights as a Hugging Face directory; ``--info``: what a checkpoint holds
(refmp.checkpoint.convert). Every conversion streams tensor by tensor: its peak is the
largest tensor plus one read chunk.
"""

from __future__ import annotations

import argparse
import os

from refmp.config import saves_directory
from refmp.errors import ConfigError


def add_parser(sub) -> None:
    c = sub.add_parser("convert", help="a sharded checkpoint to one GPT-2 file or a Hugging "
                                       "Face directory, and back",
                       description="`refmp convert DIR OUT.safetensors`: the checkpoint in DIR "
                                   "(its latest, or DIR/step-N) as one GPT-2-named file, the "
                                   "--save format; `refmp convert DIR OUT` (OUT not ending in "
                                   ".safetensors): as a Hugging Face directory (config.json "
                                   "and model.safetensors, which transformers' "
                                   "GPT2LMHeadModel.from_pretrained loads); `refmp convert "
                                   "WEIGHTS DIR` (a .safetensors file or a Hugging Face "
                                   "directory): a 1-rank checkpoint of those weights (step 0, "
                                   "no optimizer state) that --resume reads into any layout; "
                                   "`refmp convert --hf WEIGHTS OUT`: those weights as a "
                                   "Hugging Face directory, with their tokenizer; `refmp "
                                   "convert --info DIR`: what a checkpoint holds, and who "
                                   "holds which slice.")
    c.add_argument("src", metavar="SRC", help="a checkpoint directory, a .safetensors file or "
                                              "a Hugging Face directory")
    c.add_argument("out", metavar="OUT", nargs="?", help="the file or directory to write")
    c.add_argument("--info", action="store_true", help="print what SRC holds; write nothing")
    c.add_argument("--hf", action="store_true",
                   help="write OUT as a Hugging Face directory (what a checkpoint SRC becomes "
                        "anyway when OUT does not end in .safetensors)")
    c.add_argument("--n-head", type=int, default=None, metavar="N",
                   help="weights SRC: the attention heads of a file that does not say them (a "
                        "GPT-2 file from another implementation)")
    c.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="weights SRC to a checkpoint: an MoE model's experts per token, for a "
                        "file that does not say them")
    c.set_defaults(run=run_convert)


def is_weights(path: str) -> bool:
    """A GPT-2 file or a Hugging Face directory (model.safetensors, or several files behind
    model.safetensors.index.json), not a checkpoint."""
    return os.path.isfile(path) or any(os.path.isfile(os.path.join(path, f)) for f in
                                       ("model.safetensors", "model.safetensors.index.json"))


def run_convert(args: argparse.Namespace) -> None:
    """``refmp convert``: one process, no MPI communication."""
    from refmp.checkpoint import convert

    weights = is_weights(args.src)
    if args.n_head is not None and not weights:
        raise ConfigError("--n-head is for a .safetensors file or Hugging Face directory SRC; "
                          "a checkpoint's manifest says it")
    if args.top_k is not None and (not weights or args.hf):
        raise ConfigError("--top-k is for an MoE .safetensors file SRC written as a checkpoint "
                          "(a checkpoint's manifest says it; a Hugging Face directory has no "
                          "experts)")
    if args.info:
        if args.out is not None or args.hf:
            raise ConfigError("--info prints what SRC holds and writes nothing: give no OUT "
                              "and no --hf")
        print(convert.info(args.src))
    elif args.out is None:
        raise ConfigError(f"convert {args.src}: give OUT (a .safetensors file or a directory), "
                          f"or --info")
    elif args.hf and not saves_directory(args.out):
        raise ConfigError(f"--hf writes a directory; OUT {args.out} ends in .safetensors")
    elif args.hf and weights:
        convert.weights_to_hf(args.src, args.out, args.n_head)
        print(f"wrote {args.out} (a Hugging Face directory) from {args.src}")
    elif weights:
        done = convert.from_gpt2(args.src, args.out, args.n_head, args.top_k)
        print(f"wrote {done} (1 rank, step 0) from {args.src}")
    else:
        form = "a Hugging Face directory" if saves_directory(args.out) else "one GPT-2 file"
        print(f"wrote {args.out} ({form}) from {convert.to_gpt2(args.src, args.out)}")
