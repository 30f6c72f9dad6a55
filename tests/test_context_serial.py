"""Serial pieces of context parallelism: block attention with its log-sum-exp, the online-
softmax merge, the chunk layouts and the balance of causal work (no MPI needed)."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refmp.cost.flops import ring_attention_flops
from refmp.errors import ConfigError
from refmp.nn import blockwise as BW
from refmp.nn import layers as L
from refmp.parallel.context.chunks import SequenceChunks

pytestmark = pytest.mark.nn

TOL = dict(rtol=1e-10, atol=1e-12)


def heads(qkv, n_head):
    B, T, C3 = qkv.shape
    return qkv.reshape(B, T, 3, n_head, C3 // 3 // n_head).transpose(2, 0, 3, 1, 4)


@given(B=st.integers(1, 2), NH=st.integers(1, 3), HS=st.integers(1, 4),
       n_blocks=st.integers(1, 4), c=st.integers(1, 3), seed=st.integers(0, 99))
def test_blocks_merged_equal_causal_attention(B, NH, HS, n_blocks, c, seed):
    """Query block a over key blocks 0..a (the last causal), merged: attention_forward's
    output; the blocks' gradients summed: attention_backward's, at every block border."""
    rng = np.random.default_rng(seed)
    T = n_blocks * c
    qkv, dout = rng.standard_normal((B, T, 3 * NH * HS)), rng.standard_normal((B, T, NH * HS))
    y_ref, cache = L.attention_forward(qkv, NH)
    dqkv_ref = heads(L.attention_backward(dout, cache), NH)  # (3, B, NH, T, HS)
    q, k, v = heads(qkv, NH)
    dy = dout.reshape(B, T, NH, HS).transpose(0, 2, 1, 3)
    scale = 1.0 / math.sqrt(HS)
    blk = [slice(i * c, (i + 1) * c) for i in range(n_blocks)]
    y = np.zeros_like(q)
    lse = np.full(q.shape[:-1], -np.inf)
    for a in range(n_blocks):
        for b in reversed(range(a + 1)):  # any order merges to the same result
            yb, lb = BW.attention_block_forward(q[:, :, blk[a]], k[:, :, blk[b]], v[:, :, blk[b]],
                                               scale, causal=a == b)
            y[:, :, blk[a]], lse[:, :, blk[a]] = BW.attention_merge(
                y[:, :, blk[a]], lse[:, :, blk[a]], yb, lb)
    np.testing.assert_allclose(y.transpose(0, 2, 1, 3).reshape(B, T, -1), y_ref, **TOL)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for a in range(n_blocks):
        for b in range(a + 1):
            g = BW.attention_block_backward(dy[:, :, blk[a]], q[:, :, blk[a]], k[:, :, blk[b]],
                                           v[:, :, blk[b]], y[:, :, blk[a]], lse[:, :, blk[a]],
                                           scale, causal=a == b)
            dq[:, :, blk[a]] += g[0]
            dk[:, :, blk[b]] += g[1]
            dv[:, :, blk[b]] += g[2]
    for name, got, want in zip("qkv", (dq, dk, dv), dqkv_ref, strict=True):
        np.testing.assert_allclose(got, want, **TOL, err_msg=f"d{name}")


def test_lse_is_the_row_log_sum_exp():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 1, 2, 3, 4))
    s = q @ k.transpose(0, 1, 3, 2) / 2.0
    _, lse = BW.attention_block_forward(q, k, v, 0.5)
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(-1)), **TOL)


@given(T_per=st.integers(1, 3), cp=st.integers(1, 5),
       balance=st.sampled_from(["zigzag", "contiguous"]))
def test_layout_partitions_the_sequence(T_per, cp, balance):
    n = 2 * cp if balance == "zigzag" else cp
    lay = SequenceChunks(n * T_per, cp, balance)
    pos = np.concatenate([lay.positions(r) for r in range(cp)])
    assert sorted(pos) == list(range(n * T_per))
    assert all(len(lay.positions(r)) == n * T_per // cp for r in range(cp))


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_layout_gives_each_rank_its_documented_chunks(cp):
    """zigzag: 2cp chunks of c tokens, rank r holds chunk r then chunk 2cp-1-r; contiguous:
    cp chunks, rank r holds chunk r. Written out from the rule, not from SequenceChunks."""
    c = 3
    for r in range(cp):
        early, late = range(r * c, (r + 1) * c), range((2 * cp - 1 - r) * c, (2 * cp - r) * c)
        zig = SequenceChunks(2 * cp * c, cp, "zigzag")
        assert zig.chunks(r) == [r, 2 * cp - 1 - r]
        assert zig.positions(r).tolist() == [*early, *late]
        con = SequenceChunks(cp * c, cp, "contiguous")
        assert con.chunks(r) == [r]
        assert con.positions(r).tolist() == list(range(r * c, (r + 1) * c))
    assert SequenceChunks(16, 4, "zigzag").positions(1).tolist() == [2, 3, 12, 13]


def test_layout_refuses_a_sequence_it_cannot_split():
    with pytest.raises(ConfigError, match="not divisible by 8"):
        SequenceChunks(12, 4, "zigzag")
    SequenceChunks(12, 4, "contiguous")  # 4 chunks of 3: fine


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_equalizes_causal_work(cp):
    T, B, NH, HS = 16 * cp, 1, 1, 1
    zig = [ring_attention_flops(SequenceChunks(T, cp, "zigzag"), r, B, NH, HS) for r in range(cp)]
    con = [ring_attention_flops(SequenceChunks(T, cp, "contiguous"), r, B, NH, HS)
           for r in range(cp)]
    assert len(set(zig)) == 1  # every rank the same
    assert con == sorted(con) and con[-1] == cp * con[0]  # the last rank: cp times the first
    assert max(zig) < max(con)  # the slowest rank sets the step time
