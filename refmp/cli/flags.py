"""The flags ``refmp train`` and ``refmp bench`` share: the layout, one flag per field of
refmp.config.ParallelConfig (its help, group, type, choices and default are the field's), and
the mixture of experts.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from refmp.config import PIPELINE, ParallelConfig


def flag_name(name: str) -> str:
    """A field's flag: ``cp_algo`` -> ``--cp-algo``."""
    return "--" + name.replace("_", "-")


def add_layout_args(p: argparse.ArgumentParser) -> None:
    """How the ranks split the work: the ParallelConfig fields, each in its help group, and
    --trace with the pipeline's."""
    groups = {}
    for f in fields(ParallelConfig):
        m = f.metadata
        g = groups.get(m["group"])
        if g is None:
            g = groups[m["group"]] = p.add_argument_group(m["group"])
        if m["kind"] is bool:
            g.add_argument(flag_name(f.name), action="store_true", help=m["help"])
        else:
            g.add_argument(flag_name(f.name), type=m["kind"], default=f.default,
                           choices=m["choices"], metavar=m["metavar"], help=m["help"])
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
