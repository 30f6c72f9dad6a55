"""``refmp trace PATH...``: the watchdog's analysis again, from the flight recorders it wrote.

With ``--trace-dir DIR``, a run the watchdog ended leaves ``DIR/rank{r}.json``, one per rank
(refmp.distributed.watchdog): each rank's last calls, its counts per group and its stack.
This reads them (files, or directories holding them) and prints the same table and findings
(refmp.distributed.diagnose), and with ``--last N`` each rank's last N calls. No MPI.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

from refmp.distributed.diagnose import last_calls, report
from refmp.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("trace", help="who was stuck: read the watchdog's flight recorders",
                       description="Read the rank{r}.json files a run ended by the watchdog "
                                   "wrote to --trace-dir, and print which rank had not entered "
                                   "which call, and mismatched calls (docs/faults.md).")
    p.add_argument("paths", nargs="+", metavar="PATH", help="rank{r}.json files or directories")
    p.add_argument("--last", type=int, default=0, metavar="N",
                   help="also print each rank's last N calls (0: none)")
    p.set_defaults(run=run_trace)


def read_states(paths: list[str]) -> dict[int, dict]:
    """Rank -> state, from files and directories of rank*.json."""
    files = []
    for path in paths:
        found = sorted(glob.glob(os.path.join(path, "rank*.json"))) if os.path.isdir(path) else [path]
        if not found:
            raise ConfigError(f"trace {path}: no rank*.json in it")
        files += found
    states = {}
    for path in files:
        try:
            with open(path) as f:
                state = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"trace {path}: not a flight recorder ({e})") from None
        states[int(state["rank"])] = state
    return states


def run_trace(args: argparse.Namespace) -> None:
    states = read_states(args.paths)
    world = max(s["world_size"] for s in states.values())
    print(report(states, world))
    for _, st in sorted(states.items()) if args.last > 0 else ():
        print("\n".join(last_calls(st, args.last)))
