"""Reading and writing a share: every Source (a GPT-2 file, a Hugging Face directory in one
file or several, a sharded checkpoint whose pieces do not line up with the slice) reads any
slice equal to that slice of the whole tensor, bitwise, holding only the slice plus a bounded
chunk (tracemalloc); StreamWriter writes tensor by tensor exactly the bytes safetensors'
save_file writes, and refuses a tensor out of order, of the wrong shape or dtype, or missing."""

import json
import math
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import save_file
from test_init_slices import random_index, traced_peak

from refmp.checkpoint import format as F
from refmp.checkpoint.convert import from_gpt2, to_gpt2
from refmp.checkpoint.hf import save_hf
from refmp.checkpoint.pieces import CheckpointSource
from refmp.checkpoint.source import FileSource, InitSource, open_source
from refmp.checkpoint.stream import StreamWriter, stream
from refmp.checkpoint.weights import model_metadata, save_model
from refmp.cli.convert import is_weights
from refmp.errors import ConfigError
from refmp.nn import slices as S
from refmp.nn.params import GPTConfig, init_params, param_shapes

CFG = GPTConfig(vocab_size=301, block_size=16, n_layer=2, n_head=4, n_embd=32)


def model(cfg=CFG, dtype="float32"):
    return {k: np.asarray(v) for k, v in init_params(cfg, 1, dtype).items()}


def sharded_checkpoint(root, params, cfg, ranks=3, seed=0):
    """A checkpoint whose files hold random, interleaved runs of every tensor (as no layout
    would cut it: the reader must not rely on the pieces lining up), with AdamW-like
    moments m = 2 param, v = 3 param."""
    rng = np.random.default_rng(seed)
    owner = {}
    for k, v in params.items():  # runs of random lengths, each given to a random rank
        cuts = np.sort(rng.choice(np.arange(1, v.size), min(v.size - 1, 7), replace=False))
        bounds = np.concatenate([[0], cuts, [v.size]])
        owner[k] = [(int(a), int(b), int(rng.integers(ranks)))
                    for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    ckpt = os.path.join(root, F.step_name(5))
    os.makedirs(ckpt)
    files = {}
    for r in range(ranks):
        pieces = {}
        for k, v in params.items():
            idx = np.concatenate([np.arange(a, b) for a, b, o in owner[k] if o == r] or
                                 [np.zeros(0, np.int64)])
            if idx.size:
                flat = v.reshape(-1)[idx]
                pieces[k] = (F.runs_of(idx), None, {"param": flat, "m": 2 * flat, "v": 3 * flat})
        entry = F.write_rank_file(os.path.join(ckpt, F.rank_file(r)), pieces)
        files[F.rank_file(r)] = {"rank": r, "coords": {}, **entry}
    F.write_json(os.path.join(ckpt, F.MANIFEST), {
        "format": F.FORMAT, "version": 1, "step": 5, "dtype": "float32", "layout": {},
        "optimizer": {"kind": "adamw", "t": 5, "moments": ["m", "v"]},
        "model": {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}, "config": None,
        "vocab": None, "tensors": {k: list(s) for k, s in param_shapes(cfg).items()},
        "files": files})
    return ckpt


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The same model as a GPT-2 file, a Hugging Face directory, one split over two files
    behind model.safetensors.index.json, and a sharded checkpoint."""
    d = tmp_path_factory.mktemp("sources")
    params = model()
    save_model(str(d / "m.safetensors"), params, CFG)
    save_hf(str(d / "hf"), params, CFG)
    (d / "hf2").mkdir()
    names = sorted(params)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for fname, ks in halves.items():
        save_file({"transformer." + k: params[k] for k in ks}, str(d / "hf2" / fname),
                  metadata={"format": "pt"})
    with open(d / "hf2" / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": {"transformer." + k: fname
                                                  for fname, ks in halves.items() for k in ks}}, f)
    (d / "hf2" / "config.json").write_text((d / "hf" / "config.json").read_text())
    sharded_checkpoint(str(d / "ck"), params, CFG)
    return params, {"file": str(d / "m.safetensors"), "hf": str(d / "hf"),
                    "hf-index": str(d / "hf2"), "checkpoint": str(d / "ck")}


@pytest.mark.parametrize("kind", ["file", "hf", "hf-index", "checkpoint"])
def test_every_source_reads_any_slice_of_the_whole_tensor(sources, kind):
    params, paths = sources
    src = open_source(paths[kind])
    assert src.shapes() == param_shapes(CFG)
    rng = np.random.default_rng(1)
    for k, v in params.items():
        for _ in range(6):
            index = random_index(rng, v.shape)
            got = src.read(k, index)
            want = S.take(v, index)
            assert got.dtype == v.dtype and np.array_equal(got, want), (kind, k, index)
        assert np.array_equal(src.read(k, dtype="float64"), v.astype("float64"))
    if kind == "checkpoint":  # the moments too, and a rank's piece by its flat indices
        index = np.array([-1, 5, 6, 7, 0, 1, -1, 100], np.int64)
        got = src.read_elements("wte.weight", index, kind="v")
        want = np.where(index >= 0, 3 * params["wte.weight"].reshape(-1)[index], 0)
        assert np.array_equal(got, want.astype(np.float32))


def test_a_checkpoint_missing_a_slice_is_refused(sources, tmp_path):
    params, _ = sources
    ckpt = sharded_checkpoint(str(tmp_path), params, CFG, seed=2)
    path = os.path.join(ckpt, F.MANIFEST)
    with open(path) as f:
        man = json.load(f)
    del man["files"]["rank-00001.safetensors"]
    F.write_json(path, man)
    src = CheckpointSource(ckpt)
    with pytest.raises(ConfigError, match="no file holds"):
        src.read("h.0.mlp.c_fc.weight")


def test_a_missing_or_untied_file_is_refused(sources, tmp_path):
    _, paths = sources
    shutil.copytree(paths["hf-index"], tmp_path / "hf2")
    os.remove(tmp_path / "hf2" / "model-00002-of-00002.safetensors")
    with pytest.raises(ConfigError, match="model-00002-of-00002.safetensors: no such file"):
        FileSource(str(tmp_path / "hf2"))
    params = model()
    save_file({**params, "lm_head.weight": params["wte.weight"]}, str(tmp_path / "tied"))
    FileSource(str(tmp_path / "tied")).check_head()
    head = params["wte.weight"].copy()
    head[-1, -1] += 1
    save_file({**params, "lm_head.weight": head}, str(tmp_path / "untied"))
    with pytest.raises(ConfigError, match="untied"):
        FileSource(str(tmp_path / "untied")).check_head()


BIG = GPTConfig(vocab_size=8192, block_size=16, n_layer=1, n_head=4, n_embd=256)


@pytest.mark.parametrize("kind", ["file", "checkpoint", "init"])
def test_peak_while_reading_is_the_slice_plus_a_chunk(tmp_path, kind):
    """wte (8192, 256) float32 is 8 MiB: a tp rank's rows, a ZeRO range, q|k|v columns."""
    params = model(BIG)
    if kind == "file":
        save_model(str(tmp_path / "m.safetensors"), params, BIG)
        src = FileSource(str(tmp_path / "m.safetensors"))
    elif kind == "checkpoint":
        src = CheckpointSource(sharded_checkpoint(str(tmp_path), params, BIG))
        for f in src.man["files"]:
            src.verify(f)  # (the checksums stream through a chunk; checked once)
    else:
        src = InitSource(BIG, 1)
    for name, index in [("wte.weight", S.tp_index((8192, 256), 0, "vocab", 1, 8)),
                        ("wte.weight", S.Index(flat=(1_000_001, 1_300_000))),
                        ("h.0.attn.c_attn.weight", S.tp_index((256, 768), 1, "heads", 0, 4))]:
        out, peak = traced_peak(lambda n=name, i=index: src.read(n, i, "float32"))
        assert np.array_equal(out, S.take(params[name], index)), (name, index)
        assert peak <= out.nbytes + 2 * S.BLOCK_BYTES + 131072, (name, peak, out.nbytes)
        assert out.nbytes < 2 * S.BLOCK_BYTES  # small slices: the bound says something


def test_stream_writer_writes_save_files_bytes(tmp_path):
    """One metadata key: byte for byte. Several: save_file orders them as a hash map does
    (differently each run), so the same bytes up to that order."""
    params = {**model(), "runs": np.array([[0, 7]], np.int64), "half": np.ones(3, np.float16),
              "empty": np.zeros((0, 4), np.float64)}
    for meta in [None, {"format": "pt"}, model_metadata(CFG, "0123\n\"x")]:
        a, b = str(tmp_path / "a"), str(tmp_path / "b")
        save_file(params, a, metadata=meta)
        stream(b, {k: v.shape for k, v in params.items()}, {k: v.dtype for k, v in params.items()},
               params.__getitem__, meta)
        x, y = open(a, "rb").read(), open(b, "rb").read()
        n = int.from_bytes(x[:8], "little")
        assert len(x) == len(y) and x[:8] == y[:8] and x[8 + n:] == y[8 + n:]
        hx, hy = json.loads(x[8:8 + n]), json.loads(y[8:8 + n])
        assert list(hx) == list(hy) and hx == hy
        if meta is None or len(meta) == 1:
            assert x == y
    assert os.listdir(tmp_path) == ["a", "b"] or sorted(os.listdir(tmp_path)) == ["a", "b"]


def test_convert_streams_what_save_model_and_save_hf_write(sources, tmp_path):
    params, paths = sources
    one = str(tmp_path / "one.safetensors")
    to_gpt2(paths["checkpoint"], one)
    save_file(params, str(tmp_path / "ref"), metadata=model_metadata(CFG))
    x, y = open(tmp_path / "ref", "rb").read(), open(one, "rb").read()
    n = int.from_bytes(x[:8], "little")
    assert x[8 + n:] == y[8 + n:] and json.loads(x[8:8 + n]) == json.loads(y[8:8 + n])
    to_gpt2(paths["checkpoint"], str(tmp_path / "hf"))  # one metadata key: the same bytes
    assert open(tmp_path / "hf" / "model.safetensors", "rb").read() == \
        open(os.path.join(paths["hf"], "model.safetensors"), "rb").read()
    assert is_weights(paths["hf-index"]) and not is_weights(paths["checkpoint"])
    back = from_gpt2(paths["hf-index"], str(tmp_path / "ck"))  # several files in, streamed
    src = CheckpointSource(back)
    entry = src.man["files"]["rank-00000.safetensors"]
    old = F.write_rank_file(str(tmp_path / "old"), {  # what a training run's writer makes
        k: (F.runs_of(np.arange(v.size)), None, {"param": v.reshape(-1)}) for k, v in params.items()})
    assert (entry["bytes"], entry["sha256"]) == (old["bytes"], old["sha256"])
    assert entry["pieces"] == old["pieces"]


def test_peak_of_convert_is_the_largest_tensor_plus_a_chunk(tmp_path):
    cfg = GPTConfig(vocab_size=2048, block_size=16, n_layer=6, n_head=4, n_embd=128)
    params = model(cfg)
    ckpt = sharded_checkpoint(str(tmp_path), params, cfg)
    total = sum(v.nbytes for v in params.values())
    largest = max(v.nbytes for v in params.values())  # wte, 1 MiB of 6.6
    _, peak = traced_peak(lambda: to_gpt2(ckpt, str(tmp_path / "out.safetensors")))
    assert peak <= largest + 2 * S.BLOCK_BYTES + 262144 < total, (peak, largest, total)


def test_stream_writer_refuses_and_leaves_nothing(tmp_path):
    path = str(tmp_path / "x.safetensors")
    shapes = {"a": (2, 3), "b": (4,)}
    arrays = {"a": np.zeros((2, 3), np.float32), "b": np.ones(4, np.float32)}
    cases = [  # (what is handed in, the words of the refusal)
        ([("b", arrays["b"])], "where the header has a next"),
        ([("a", np.zeros((3, 2), np.float32))], "header says"),
        ([("a", np.zeros((2, 3), np.float64))], "header says"),
        ([("a", arrays["a"])], "never written"),
        ([("a", arrays["a"]), ("b", arrays["b"]), ("b", arrays["b"])], "after every tensor"),
    ]
    for writes, words in cases:
        with pytest.raises(ValueError, match=words):
            with StreamWriter(path, shapes, np.float32) as w:
                for k, v in writes:
                    w.write(k, v)
        assert os.listdir(tmp_path) == [], words
    with StreamWriter(path, shapes, np.float32, {"format": "refmp"}) as w:
        for k in w.order:
            w.write(k, arrays[k][::1] if k == "b" else np.asfortranarray(arrays[k]))
    assert os.listdir(tmp_path) == ["x.safetensors"]
    assert w.bytes == os.path.getsize(path) and len(w.sha256) == 64
    calls = []  # a rank that does not write still gathers, in the file's order
    assert stream(path, shapes, np.float32, calls.append, write=False) is None
    assert calls == ["a", "b"] and math.prod(shapes["a"]) == 6
