"""A rank builds its share: init_slice makes every kind of slice a layout cuts (rows, tp's
columns and q|k|v heads, the padded vocabulary, ZeRO's flat partition of a shard) equal,
bitwise, to that slice of the serial model's tensor, and allocates only the slice plus about
one random block while doing it (measured with tracemalloc, which NumPy reports to)."""

import math
import tracemalloc

import numpy as np
import pytest

from refmp.nn import slices as S
from refmp.nn.params import (
    GPTConfig,
    init_block_rows,
    init_param,
    init_params,
    init_slice,
    param_shapes,
)
from refmp.parallel.data.sharder import owned
from refmp.parallel.data.zero import Unit
from refmp.parallel.placement import TP_SPLITS, local_name, tp_shard

pytestmark = pytest.mark.nn

CFG = GPTConfig(vocab_size=1001, block_size=16, n_layer=2, n_head=4, n_embd=32)


def random_index(rng, shape):
    """A random Index of ``shape``: row ranges (some past the end: padding), column ranges
    in any order, and sometimes a flat range of the cut."""
    dims = []
    for d, n in enumerate(shape):
        k = int(rng.integers(1, 4))
        top = n + (3 if d == 0 else 0)
        rs = []
        for _ in range(k):
            a = int(rng.integers(0, top + 1))
            rs.append((a, int(rng.integers(a, top + 1))))
        dims.append(tuple(rs))
    index = S.Index(tuple(dims))
    size = math.prod(S.cut_shape(shape, index))
    if rng.random() < 0.5:
        lo = int(rng.integers(0, size + 1))
        index = index._replace(flat=(lo, int(rng.integers(lo, size + 1))))
    return index


@pytest.mark.parametrize("name,shape", [
    ("wte.weight", (5000, 64)),  # R = 2048 rows: three blocks
    ("h.0.mlp.c_fc.weight", (64, 2304)),  # R = 56 rows: two blocks
    ("h.1.mlp.c_proj.weight", (300, 7)),
    ("h.0.attn.c_attn.bias", (96,)),
    ("ln_f.weight", (32,)),
])
def test_random_slices_equal_the_whole_tensors_slices(name, shape):
    full = init_param(name, shape, CFG, seed=7)
    rng = np.random.default_rng(0)
    for _ in range(40):
        index = random_index(rng, shape)
        got = init_slice(name, shape, CFG, 7, index)
        want = S.take(full, index)
        assert got.shape == want.shape and np.array_equal(got, want), (name, index)


def test_every_layouts_shards_equal_the_serial_models():
    """tp 1-4 (q|k|v heads, columns, rows, the vocabulary padded to Vp), then ZeRO's flat
    partition of each tp shard over 3 ranks: each equals placement's tp_shard of the whole
    tensor and that shard's ZeRO piece, bitwise, in float32 as the engine holds them."""
    shapes = param_shapes(CFG)
    whole = init_params(CFG, 3, "float32")
    for tp in (1, 2, 4):
        for r in range(tp):
            local = {}
            for k, shape in shapes.items():
                split = TP_SPLITS.get(local_name(k))
                index = S.tp_index(shape, *split, r, tp) if split else S.WHOLE
                got = init_slice(k, shape, CFG, 3, index, "float32")
                assert np.array_equal(got, tp_shard(k, whole[k], r, tp)), (k, tp, r)
                local[k] = (index, got)
            for z in range(3):  # ZeRO over a unit holding every tp shard
                unit = Unit("all", {k: v.shape for k, (_, v) in local.items()}, 3, z)
                flat = unit.flatten({k: v for k, (_, v) in local.items()}, np, np.float32)
                for k, piece in unit.pieces(flat[unit.lo:unit.hi]).items():
                    if k.endswith(".padding"):
                        continue
                    index = local[k][0]._replace(flat=owned(unit, k))
                    got = init_slice(k, shapes[k], CFG, 3, index, "float32")
                    assert np.array_equal(got, piece), (k, tp, r, z)


def test_values_are_gpt2s_and_depend_on_seed_and_name_only():
    w = init_param("h.1.mlp.c_fc.weight", (32, 128), CFG, 5)
    assert abs(w.std() - 0.02) < 0.002
    proj = init_param("h.0.mlp.c_proj.weight", (128, 32), CFG, 5)
    assert abs(proj.std() - 0.02 / 2) < 0.001  # 0.02 / sqrt(2 L), L = 2
    assert not np.array_equal(w, init_param("h.0.mlp.c_fc.weight", (32, 128), CFG, 5))
    assert not np.array_equal(w, init_param("h.1.mlp.c_fc.weight", (32, 128), CFG, 6))
    # the first block's rows do not depend on how many rows the tensor has
    big = init_param("wte.weight", (5000, 64), CFG, 5)
    assert np.array_equal(big[:100], init_param("wte.weight", (100, 64), CFG, 5))
    assert init_block_rows((5000, 64)) == 2048  # 1 MiB of float64 rows
    assert init_params(CFG, 5, "float32")["wte.weight"].dtype == np.float32


def traced_peak(make):
    """(result, peak bytes allocated while ``make()`` ran), by tracemalloc."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        out = make()
        return out, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("shape,index", [
    ((8192, 256), S.rows(3000, 3500)),  # a vocabulary split's rows (of 16 MiB; R = 512)
    ((1024, 768), S.tp_index((1024, 768), 1, "heads", 1, 8)),  # q|k|v columns (of 6 MiB)
    ((8192, 256), S.Index(flat=(1_000_000, 1_200_000))),  # ZeRO's flat partition
])
def test_peak_while_building_is_the_slice_plus_a_block(shape, index):
    out, peak = traced_peak(lambda: init_slice("wte.weight", shape, CFG, 1, index))
    assert peak <= out.nbytes + 2 * S.BLOCK_BYTES + 65536, (peak, out.nbytes)
    assert out.nbytes < 2 * S.BLOCK_BYTES  # the slices are small: the bound says something
