"""Functions over many arrays at once: nested caches walked leaf by leaf, the bytes they hold
(the activation memory the ledgers count), and the global gradient norm of a dict of
gradient pieces.

A cache (what a forward keeps for its backward; a layer's arguments and results) is a nest
of tuples (NamedTuples too), lists and dicts whose *leaves* are arrays, scalars and other
objects. Mixed precision's casts (refmp.runtime.precision), the weight references that
stand in a cache for weights ZeRO-3 freed (``detach``, ``attach``) and the memory ledger's
byte counts all walk them through here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np


def leaves(obj) -> Iterator:
    """Every leaf of ``obj``, depth first, left to right (one pass over an explicit stack:
    autocast calls it on every layer's arguments)."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, (tuple, list)):
            stack.extend(reversed(o))
        elif isinstance(o, dict):
            stack.extend(reversed(list(o.values())))
        else:
            yield o


def map_leaves(obj, fn: Callable):
    """``obj`` rebuilt with every leaf replaced by fn(leaf): tuples, NamedTuples (of their
    own type), lists and dicts are new containers; the leaves are what ``fn`` returns.

    Identity: a leaf for which ``fn`` returns its argument is the caller's own object in the
    result, not a copy. ZeRO-3 finds a cache's weights by ``id`` (``detach``), and the
    activation ledger leaves parameter buffers out by ``id``, so autocast's down-cast
    (refmp.runtime.precision.autocast) hands back such an array as the caller gave it.
    """
    if isinstance(obj, tuple):
        items = [map_leaves(x, fn) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [map_leaves(x, fn) for x in obj]
    if isinstance(obj, dict):
        return {k: map_leaves(v, fn) for k, v in obj.items()}
    return fn(obj)


class WeightRef:
    """Stands in a cache for a weight that ZeRO-3 freed (refmp.parallel.data.sharder);
    ``attach`` puts the weight back."""

    def __init__(self, name: str):
        self.name = name


def detach(cache, p: dict):
    """The cache with every array of ``p`` replaced by a WeightRef (so the weights can go);
    the arrays are found by identity (map_leaves keeps the caller's own objects)."""
    names = {id(v): k for k, v in p.items()}
    return map_leaves(cache, lambda a: WeightRef(names[id(a)]) if id(a) in names else a)


def attach(cache, p: dict):
    """Inverse of detach, with the freshly gathered weights ``p``."""
    return map_leaves(cache, lambda a: p[a.name] if isinstance(a, WeightRef) else a)


def global_grad_norm(grads: dict, sum_sq: Callable[[float], float] | None = None) -> float:
    """sqrt(sum over every element of every gradient of g^2), each element counted once.

    ``grads`` holds the pieces this rank counts; ``sum_sq`` adds the partial sums of squares
    over the ranks that count other elements (e.g. ``grid.world.allreduce_scalar``).
    """
    # each piece's sum of squares in its own dtype (NumPy's pairwise sum), widened to float64
    # and the pieces added on the device in Python's order; one read of the total
    local = float(sum(((g * g).sum().astype(np.float64) for g in grads.values()), 0.0))
    return math.sqrt(sum_sq(local) if sum_sq is not None else local)


def activation_bytes(cache, exclude=()) -> int:
    """Bytes of the distinct arrays a forward cache keeps alive, parameters excluded.

    Views count as their base buffer, once; ``exclude`` holds parameter arrays (or views of
    parameter buffers), which caches reference but which are not activations.
    """
    def root(a):
        while getattr(a, "base", None) is not None:
            a = a.base
        return a

    skip = {id(root(a)) for a in exclude}
    seen: dict[int, int] = {}
    for leaf in leaves(cache):
        if hasattr(leaf, "nbytes") and hasattr(leaf, "shape"):
            r = root(leaf)
            if id(r) not in skip:
                seen[id(r)] = int(r.nbytes)
    return sum(seen.values())


def nbytes_of(obj) -> int:
    """Bytes of every array in a (nested) cache: the activation memory it holds (views and
    repeats counted each time, unlike activation_bytes)."""
    return sum(int(getattr(o, "nbytes", 0)) for o in leaves(obj))
