"""Hugging Face directories and tokenizers, both ways (refmp.checkpoint.hf, .tokenizer).

* refmp's directory (``refmp convert --hf``, ``--save DIR``) loads in transformers'
  GPT2LMHeadModel.from_pretrained with refmp's logits, and reads back bitwise;
* a config.json in the directory or beside a file gives the head count, checked against
  the tensors; a setting refmp's GPT-2 does not compute is refused, never run as another model;
* text in, text out: a byte-level BPE trained here by the tokenizers library (no download)
  encodes --prompt TEXT and decodes the continuation, and tokenizes a --data text file
  (cached beside it); without the library, one message naming the extra.

The transformers and tokenizers tests skip without those libraries (the hf and text extras),
saying which is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import pytest
from extras import reason
from safetensors.numpy import load_file, save_file

from refmp.checkpoint.hf import save_hf
from refmp.checkpoint.weights import read_config, read_model, save_model
from refmp.cli.main import main
from refmp.config import TrainConfig, check_config
from refmp.errors import ConfigError
from refmp.nn import GPT, GPTConfig
from refmp.training.datasets import load_tokens

TEXT = ("the quick brown fox jumps over the lazy dog. " * 3 + "hello world, hello refmp! "
        "a tokenizer made here, with no download: byte-level BPE. ") * 4


def random_model(cfg: GPTConfig, seed: int = 0) -> GPT:
    """Every parameter random (biases and LayerNorms too): a wrong name or slice shows."""
    rng = np.random.default_rng(seed)
    params = {k: rng.normal(0.0, 0.3, v.shape) for k, v in GPT.create(cfg, 0, "float64").params.items()}
    return GPT(cfg, params)


def bare_file(path: str, model: GPT) -> str:
    """The model's tensors with no metadata, as another implementation writes them."""
    save_file({k: np.ascontiguousarray(v) for k, v in model.params.items()}, path)
    return path


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE trained on TEXT by the tokenizers library: the directory holding its
    tokenizer.json, and one holding GPT-2's form of it (vocab.json + merges.txt)."""
    tokenizers = pytest.importorskip("tokenizers", reason=reason("tokenizers", "text"))
    tok = tokenizers.ByteLevelBPETokenizer()
    tok.train_from_iterator([TEXT], vocab_size=300, min_frequency=2, show_progress=False)
    one = tmp_path_factory.mktemp("tokenizer_json")
    tok.save(str(one / "tokenizer.json"))
    two = tmp_path_factory.mktemp("vocab_merges")
    tok.save_model(str(two))
    return str(one), str(two), tok


# --- part 1: what the tensors do not say ----------------------------------------------------


def test_config_json_beside_a_file_or_in_a_directory_gives_the_heads(tmp_path):
    cfg = GPTConfig(23, 16, 2, 4, 32)
    m = random_model(cfg)
    d = tmp_path / "hf"
    save_hf(str(d), m.params, cfg)
    assert read_config(str(d))[0] == cfg  # the directory: its config.json says 4 heads
    f = bare_file(str(tmp_path / "bare.safetensors"), m)
    with pytest.raises(ConfigError, match="does not say how many attention heads.*--n-head N"):
        read_config(f)
    shutil.copy(d / "config.json", tmp_path / "config.json")  # now beside the bare file
    assert read_config(f)[0].n_head == 4
    with pytest.raises(ConfigError, match="--n-head 2, but .*config.json says n_head 4"):
        read_config(f, n_head=2)
    assert read_config(f, n_head=4)[0].n_head == 4


@pytest.mark.parametrize("key, value, message", [
    ("n_embd", 64, "says n_embd 64 \\(the tensors: 32\\): it describes another model"),
    ("n_positions", 8, "says n_positions 8"),
    ("activation_function", "relu", "activation_function 'relu'"),
    ("layer_norm_epsilon", 1e-6, "layer_norm_epsilon 1e-06; refmp's GPT-2 computes"),
    ("scale_attn_by_inverse_layer_idx", True, "scale_attn_by_inverse_layer_idx True"),
    ("tie_word_embeddings", False, "tie_word_embeddings False"),
    ("model_type", "llama", "a 'llama' model"),
    ("n_head", None, "has no n_head"),
])
def test_a_config_json_refmp_does_not_compute_is_refused(tmp_path, key, value, message):
    cfg = GPTConfig(23, 16, 2, 4, 32)
    d = tmp_path / "hf"
    save_hf(str(d), random_model(cfg).params, cfg)
    conf = json.loads((d / "config.json").read_text())
    conf[key] = value
    (d / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ConfigError, match=message):
        read_config(str(d))


def test_an_untied_head_is_refused_and_a_tied_one_read(tmp_path):
    cfg = GPTConfig(23, 16, 1, 2, 8)
    m = random_model(cfg)
    tensors = {f"transformer.{k}": v for k, v in m.params.items()}
    path = str(tmp_path / "w.safetensors")
    save_file({**tensors, "lm_head.weight": m.params["wte.weight"].copy()}, path)
    assert read_model(path, n_head=2)[0] == cfg
    save_file({**tensors, "lm_head.weight": m.params["wte.weight"] + 1}, path)
    with pytest.raises(ConfigError, match="lm_head.weight is not wte.weight"):
        read_model(path, n_head=2)


# --- part 2: refmp's directory in transformers -----------------------------------------------


def test_refmps_directory_loads_in_transformers_with_refmps_logits(tmp_path, capsys):
    """`refmp convert --hf FILE DIR`: GPT2LMHeadModel.from_pretrained(DIR) computes refmp's
    logits (float64, to rounding); the directory reads back bitwise, and holds no lm_head
    (tied); refmp's vocabulary survives in its metadata."""
    torch = pytest.importorskip("torch", reason=reason("torch", "hf"))
    transformers = pytest.importorskip("transformers", reason=reason("transformers", "hf"))
    cfg = GPTConfig(23, 16, 2, 4, 32)
    m = random_model(cfg)
    path = str(tmp_path / "m.safetensors")
    save_model(path, m.params, cfg, vocab="0123456789+=\n" + "x" * 10)
    out = str(tmp_path / "hf")
    assert main(["convert", "--hf", path, out]) == 0
    assert "a Hugging Face directory" in capsys.readouterr().out
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert hf.dtype == torch.float64 and hf.config.n_head == 4
    x = np.random.default_rng(1).integers(0, 23, (2, 16))
    with torch.no_grad():
        theirs = hf(torch.from_numpy(x)).logits.numpy()
    np.testing.assert_allclose(theirs, m.forward(x)[0], rtol=0, atol=1e-12)
    stored = load_file(os.path.join(out, "model.safetensors"))
    assert "lm_head.weight" not in stored and "transformer.wte.weight" in stored
    got_cfg, got = read_model(out)
    assert got_cfg == cfg
    for k, v in m.params.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
    assert read_config(out)[0] == cfg
    with pytest.raises(ConfigError, match="mixture-of-experts model has no Hugging Face"):
        moe = GPTConfig(23, 16, 1, 2, 8, n_expert=2)
        save_hf(str(tmp_path / "moe"), GPT.create(moe, 0, "float64").params, moe)


# --- part 3: text in, text out ---------------------------------------------------------------


def test_generate_encodes_the_prompt_and_decodes_the_continuation(bpe, tmp_path, capsys):
    """The directory's tokenizer.json, or --tokenizer DIR of vocab.json + merges.txt: the
    prompt's ids are the tokenizer's, the continuation the serial model's greedy tokens,
    printed decoded; --json and --save-tokens still give the ids."""
    one, two, tok = bpe
    V = tok.get_vocab_size()
    cfg = GPTConfig(V, 32, 2, 4, 32)
    m = random_model(cfg)
    d = str(tmp_path / "hf")
    save_hf(d, m.params, cfg, tokenizer=one)
    assert sorted(os.listdir(d)) == ["config.json", "model.safetensors", "tokenizer.json"]
    prompt = "hello world, the lazy"
    ids = tok.encode(prompt).ids
    want = m.generate(np.array([ids]), 5)[0, len(ids):]
    t = str(tmp_path / "t.npy")
    assert main(["generate", "--init", d, "--prompt", prompt, "--max-new-tokens", "5",
                 "--dtype", "float64", "--json", "--save-tokens", t]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["new_tokens"] == [want.tolist()] and out["texts"] == [tok.decode(want.tolist())]
    assert np.load(t).tolist() == [ids + want.tolist()]
    f = bare_file(str(tmp_path / "bare.safetensors"), m)  # no tokenizer beside it
    assert main(["generate", "--init", f, "--n-head", "4", "--tokenizer", two, "--prompt",
                 prompt, "--max-new-tokens", "5", "--dtype", "float64"]) == 0
    assert f"[0] {prompt!r} -> {tok.decode(want.tolist())!r}" in capsys.readouterr().out
    assert main(["generate", "--init", f, "--n-head", "4", "--prompt", prompt]) == 2
    err = capsys.readouterr().err
    assert "--prompt TEXT needs a tokenizer" in err and "--tokenizer DIR" in err


def test_without_the_library_text_is_refused_naming_the_extra_and_ids_still_work(
        bpe, tmp_path, capsys, monkeypatch):
    one, _, tok = bpe
    cfg = GPTConfig(tok.get_vocab_size(), 16, 1, 2, 8)
    d = str(tmp_path / "hf")
    save_hf(d, random_model(cfg).params, cfg, tokenizer=one)
    np.save(tmp_path / "p.npy", np.array([[1, 2, 3]]))
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers: ImportError
    assert main(["generate", "--init", d, "--prompt", "hello"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and 'pip install "refmp[text]"' in err, err
    assert main(["generate", "--init", d, "--prompts", str(tmp_path / "p.npy"),
                 "--max-new-tokens", "2"]) == 0
    assert "[0] 1 2 3 -> " in capsys.readouterr().out  # ids in, ids out
    with pytest.raises(ConfigError, match=r'tokenizers library: pip install "refmp\[text\]"'):
        load_tokens(str(tmp_path / "p.npy"), one)


def test_a_text_file_is_tokenized_once_and_cached_until_text_or_tokenizer_change(bpe, tmp_path):
    one, two, tok = bpe
    text = tmp_path / "corpus.txt"
    text.write_text(TEXT)
    ds = load_tokens(str(text), one)
    assert ds.tokens.tolist() == tok.encode(TEXT).ids and ds.vocab_size == tok.get_vocab_size()
    cache = tmp_path / "corpus.txt.tokens.bin"
    record = tmp_path / "corpus.txt.tokens.json"
    assert np.fromfile(cache, np.uint16).tolist() == ds.tokens.tolist()
    cache.write_bytes(np.full(len(ds.tokens), 7, np.uint16).tobytes())  # a planted cache
    assert set(load_tokens(str(text), one).tokens.tolist()) == {7}  # read, not remade
    text.write_text(TEXT + " one more line")  # the text changed: remade
    assert load_tokens(str(text), one).tokens.tolist() == tok.encode(TEXT + " one more line").ids
    assert json.loads(record.read_text())["tokens"] == len(tok.encode(TEXT + " one more line").ids)
    other = tokenizer_of_other_merges(tmp_path)
    assert load_tokens(str(text), other).tokens.tolist() != tok.encode(TEXT + " one more line").ids
    for bad in (TrainConfig(tokenizer=one), TrainConfig(data="x.npy", tokenizer=one)):
        with pytest.raises(ConfigError, match="--tokenizer .* tokenizes a text --data file"):
            check_config(bad)


def tokenizer_of_other_merges(tmp_path) -> str:
    """Another byte-level BPE (fewer merges): the same text gives other ids."""
    import tokenizers

    tok = tokenizers.ByteLevelBPETokenizer()
    tok.train_from_iterator([TEXT], vocab_size=260, min_frequency=2, show_progress=False)
    d = tmp_path / "other"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    return str(d)


def test_train_on_text_through_the_tokenizer_saves_a_directory_that_generates_text(
        bpe, tmp_path, capsys):
    """refmp train --data FILE.txt --tokenizer DIR --save OUT (a directory): OUT holds the
    model, its config.json and the tokenizer, and `refmp generate --init OUT --prompt` speaks
    text; the weights are the serial Trainer's."""
    one, _, tok = bpe
    text = tmp_path / "corpus.txt"
    text.write_text(TEXT)
    out = str(tmp_path / "out")
    flags = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
             "--batch-size", "2", "--steps", "2", "--dtype", "float64", "--no-progress"]
    assert main(["train", "--data", str(text), "--tokenizer", one, *flags, "--save", out]) == 0
    printed = capsys.readouterr().out
    assert f"vocab {tok.get_vocab_size()}" in printed and "(tokenizer_json" in printed
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]
    cfg, params = read_model(out)
    assert (cfg.vocab_size, cfg.n_head, cfg.block_size) == (tok.get_vocab_size(), 2, 16)
    assert main(["generate", "--init", out, "--prompt", "the quick", "--max-new-tokens",
                 "3", "--dtype", "float64", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    ids = tok.encode("the quick").ids
    want = GPT(cfg, params).generate(np.array([ids]), 3)[0, len(ids):].tolist()
    assert got["new_tokens"] == [want] and got["texts"] == [tok.decode(want)]
