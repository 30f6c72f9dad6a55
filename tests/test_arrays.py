"""The cache walker's identity contract (refmp.runtime.arrays.map_leaves), as autocast keeps it.

ZeRO-3's detach finds a cache's weights by ``id`` and the activation ledger leaves parameter
buffers out by ``id``: a leaf the walker's function hands back, and an argument autocast
hands back, must be the caller's own object, inside containers of the same types.
"""

from typing import NamedTuple

import numpy as np

from refmp.runtime.arrays import WeightRef, activation_bytes, attach, detach, leaves, map_leaves
from refmp.runtime.precision import BF16, autocast


class Pair(NamedTuple):
    a: object
    b: object


def test_map_leaves_keeps_identity_and_container_types():
    w, x = np.ones(3), np.zeros(2)
    nest = (w, [x, {"k": Pair(w, 1.5)}], None)
    out = map_leaves(nest, lambda a: a)
    assert out is not nest and out[0] is w and out[1][0] is x
    assert isinstance(out[1][1]["k"], Pair) and out[1][1]["k"].a is w and out[1][1]["k"].b == 1.5
    assert list(leaves(nest)) == [w, x, w, 1.5, None]  # depth first, left to right


def test_detach_attach_by_identity():
    w, x = np.ones(3), np.ones(3)  # equal values, different arrays: only w is a weight
    cache = Pair(x, (w, [w]))
    gone = detach(cache, {"w": w})
    assert gone.a is x and isinstance(gone.b[0], WeightRef) and isinstance(gone.b[1][0], WeightRef)
    back = attach(gone, {"w": w})
    assert back.a is x and back.b[0] is w and back.b[1][0] is w


@autocast
def _layer(x, w):
    return x @ w, Pair(x, w)  # an output, and a cache keeping both arguments


def test_autocast_hands_back_the_callers_arrays():
    for dtype in (np.float64, BF16):
        x, w = np.ones((2, 3), dtype), np.ones((3, 4), dtype)
        y, cache = _layer(x, w)
        assert y.dtype == dtype and isinstance(cache, Pair)
        assert cache.a is x and cache.b is w  # not rounded copies
        assert activation_bytes(cache, [w]) == x.nbytes  # the weight left out by identity
