"""The layout-invariant batch order, the addition task, and the token-file loaders."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refmp.errors import ConfigError
from refmp.parallel.data.accumulate import dp_rows
from refmp.training.datasets import ADD_CHARS, AdditionTask, get_batch, load_tokens, window_indices


@given(B=st.integers(1, 8), dp=st.sampled_from([1, 2, 4]), step=st.integers(0, 50),
       T=st.integers(1, 5), n=st.integers(20, 60))
def test_dp_rows_reassemble_the_global_batch(B, dp, step, T, n):
    B *= dp
    tokens = np.arange(n)
    x, y = get_batch(tokens, step, B, T)
    parts = [get_batch(tokens, step, B, T, dp_rows(B, dp, r)) for r in range(dp)]
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), x)
    np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), y)
    np.testing.assert_array_equal(y, x + 1)  # y is x shifted by one token
    nw = (n - 1) // T
    np.testing.assert_array_equal(x[:, 0], ((step * B + np.arange(B)) % nw) * T)


def test_window_formula_and_shuffle():
    assert list(window_indices(2, 3, 5)) == [1, 2, 3]  # (2*3 + j) mod 5
    perm = np.array([4, 3, 2, 1, 0])
    assert list(window_indices(2, 3, 5, perm)) == [3, 2, 1]


def test_dp_rows_refuses_indivisible_batch():
    with pytest.raises(ConfigError, match="divisible"):
        dp_rows(5, 2, 0)


def test_addition_task():
    task = AdditionTask(digits=3, seed=1, n_train=2000, n_test=50)
    text = "".join(ADD_CHARS[i] for i in task.encode(np.array([123_456, 999_999, 5])).ravel())
    assert text == "123+456=0579\n999+999=1998\n000+005=0005\n"
    ds = task.dataset()
    assert ds.vocab_size == 13 and len(ds.tokens) == 2000 * 13
    assert not set(task.test_pairs) & set(task.train_pairs)  # held out: never trained on
    assert task.line_len == 13


def test_load_files(tmp_path):
    np.save(tmp_path / "t.npy", np.array([1, 5, 2, 7]))
    ds = load_tokens(str(tmp_path / "t.npy"))
    assert list(ds.tokens) == [1, 5, 2, 7] and ds.vocab_size == 8
    np.array([3, 60000, 1], dtype=np.uint16).tofile(tmp_path / "t.bin")
    ds = load_tokens(str(tmp_path / "t.bin"))
    assert list(ds.tokens) == [3, 60000, 1] and ds.vocab_size == 60001
    (tmp_path / "t.txt").write_bytes("héllo".encode())
    ds = load_tokens(str(tmp_path / "t.txt"))
    assert list(ds.tokens) == list("héllo".encode()) and ds.vocab_size == 256


@pytest.mark.parametrize("name,content,match", [
    ("missing.npy", None, "no such file"),
    ("bad.npy", b"not an npy file", "cannot read"),
    ("two_d.npy", "2d", "1-D integer"),
    ("odd.bin", b"\x00\x01\x02", "even"),
    ("one.txt", b"a", "at least 2 tokens"),
])
def test_bad_files(tmp_path, name, content, match):
    path = tmp_path / name
    if content == "2d":
        np.save(path, np.zeros((2, 2), dtype=np.int64))
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match=match):
        load_tokens(str(path))
