"""--init with MoE flags: a flag given wins over the file's metadata, and a file with no
metadata (written by another implementation) takes the flags, not silent defaults; its head
count, which its tensors do not fix, is refused until --n-head gives it."""

import numpy as np
import pytest
from mpi_helpers import refmp
from safetensors.numpy import load_file, save_file

from refmp.checkpoint.convert import from_gpt2
from refmp.checkpoint.weights import read_config, save_model
from refmp.errors import ConfigError
from refmp.nn import GPT, GPTConfig
from refmp.training.checks import model_config
from refmp.training.datasets import Dataset
from refmp.training.trainer import TrainConfig

# 4 blocks, experts in blocks 0 and 2; every MoE setting away from GPTConfig's defaults
SAVED = GPTConfig(256, 13, 4, 2, 8, n_expert=4, top_k=2, moe_every=2, capacity_factor=1.5,
                  aux_loss_coef=0.02, z_loss_coef=0.002)


def moe_file(tmp_path, metadata: bool = True) -> str:
    path = str(tmp_path / "moe.safetensors")
    save_model(path, GPT.create(SAVED, 0, "float64").params, SAVED)
    if not metadata:  # as another implementation writes it: tensors only
        save_file(load_file(path), path)
    return path


def loaded(path: str, **flags) -> GPTConfig:
    """The config `refmp train --init path` builds with these TrainConfig fields."""
    ds = Dataset(np.arange(200) % 256, 256, "tokens")
    return model_config(TrainConfig(init=path, **flags), ds)


def test_flags_apply_to_a_file_without_metadata(tmp_path):
    path = moe_file(tmp_path, metadata=False)
    cfg = loaded(path, n_head=2, top_k=1, capacity_factor=0)
    assert (cfg.top_k, cfg.capacity_factor) == (1, 0)
    assert (cfg.n_expert, cfg.moe_every) == (4, 2)  # from the routers
    assert (cfg.aux_loss_coef, cfg.z_loss_coef) == (GPTConfig.aux_loss_coef, GPTConfig.z_loss_coef)
    _, notes = read_config(path, 2, moe={"top_k": 1, "capacity_factor": 0})
    assert len(notes) == 1 and "does not record aux_loss_coef, z_loss_coef" in notes[0], notes
    cfg = loaded(path, n_head=2, top_k=2, aux_loss_coef=0.5, z_loss_coef=0.25)
    assert (cfg.aux_loss_coef, cfg.z_loss_coef, cfg.top_k) == (0.5, 0.25, 2)
    with pytest.raises(ConfigError, match="does not say how many experts each token goes to.*"
                                          "--top-k K"):  # what the forward computes
        loaded(path, n_head=2)


def test_given_flag_wins_over_metadata_and_is_noted(tmp_path):
    path = moe_file(tmp_path)
    cfg = loaded(path)  # nothing given: the file's settings
    assert (cfg.top_k, cfg.capacity_factor, cfg.aux_loss_coef, cfg.z_loss_coef) == (2, 1.5, 0.02, 0.002)
    cfg = loaded(path, top_k=1, capacity_factor=1.5)
    assert (cfg.top_k, cfg.capacity_factor, cfg.aux_loss_coef) == (1, 1.5, 0.02)
    _, notes = read_config(path, moe={"top_k": 1, "capacity_factor": 1.5})
    assert notes == [f"--top-k 1 overrides top_k 2 in {path}"]  # the equal flag is no conflict


def test_moe_every_must_match_the_routers(tmp_path):
    path = moe_file(tmp_path, metadata=False)
    assert loaded(path, n_head=2, top_k=2, moe_every=2).moe_every == 2
    for every, blocks in ((1, "[0, 1, 2, 3]"), (3, "[0, 3]")):
        with pytest.raises(ConfigError, match=rf"--moe-every {every} puts experts in blocks "
                                              rf"\{blocks}, but .* routers in blocks \[0, 2\]"):
            loaded(path, n_head=2, top_k=2, moe_every=every)


def test_moe_flags_on_a_dense_file_are_noted(tmp_path):
    dense = GPTConfig(256, 13, 1, 2, 8)
    path = str(tmp_path / "dense.safetensors")
    save_model(path, GPT.create(dense, 0, "float64").params, dense)
    cfg, notes = read_config(path, moe={"top_k": 1})
    assert cfg.n_expert == 0 and notes == [f"--init {path} is a dense model (no routers): "
                                           f"--top-k ignored"]


@pytest.mark.cli
def test_cli_warns_once_and_refuses_a_wrong_moe_every(tmp_path):
    path = moe_file(tmp_path)
    args = ["train", "--init", path, "--steps", "1", "--batch-size", "4", "--no-progress"]
    r = refmp(2, [*args, "--top-k", "1"], timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("warning:") == 1 and "--top-k 1 overrides top_k 2" in r.stderr, r.stderr
    r = refmp(2, [*args, "--moe-every", "1"], timeout=60)
    assert r.returncode == 2 and r.stderr.count("error:") == 1, r.stderr
    assert "routers in blocks [0, 2]" in r.stderr


def test_a_file_that_does_not_say_its_heads_is_refused_until_they_are_given(tmp_path):
    """A GPT-2 file from another implementation (tensors, no metadata): the head count is
    not in its shapes, so refmp asks for it rather than assume one."""
    path = moe_file(tmp_path, metadata=False)
    with pytest.raises(ConfigError, match="does not say how many attention heads.*--n-head N"):
        read_config(path)
    with pytest.raises(ConfigError, match="--n-head N"):
        loaded(path, top_k=2)
    assert read_config(path, 2, moe={"top_k": 2})[0].n_head == 2
    assert read_config(moe_file(tmp_path))[0].n_head == SAVED.n_head  # refmp's file says it
    path = moe_file(tmp_path, metadata=False)
    with pytest.raises(ConfigError, match="--n-head N"):
        from_gpt2(path, str(tmp_path / "ck"))
    assert from_gpt2(path, str(tmp_path / "ck"), n_head=2, top_k=2).endswith("step-00000000")


@pytest.mark.cli
def test_generate_refuses_a_file_without_heads_and_decodes_with_n_head(tmp_path):
    """refmp generate: one message and status 2 without --n-head; with it, the tokens of the
    serial model with that many heads."""
    dense = GPTConfig(13, 13, 1, 2, 8)
    model = GPT.create(dense, 0, "float64")
    path = str(tmp_path / "bare.safetensors")
    save_model(path, model.params, dense)
    save_file(load_file(path), path)  # tensors only, as another implementation writes them
    prompt = np.array([[1, 2, 10, 3, 4, 11]])  # token ids: the file carries no tokenizer
    np.save(tmp_path / "p.npy", prompt)
    args = ["generate", "--init", path, "--prompts", str(tmp_path / "p.npy"),
            "--max-new-tokens", "3", "--dtype", "float64", "--save-tokens", str(tmp_path / "t.npy")]
    r = refmp(2, [*args, "--tp", "2"], timeout=60)
    assert r.returncode == 2 and r.stderr.count("error:") == 1, r.stderr
    assert "does not say how many attention heads" in r.stderr and "--n-head N" in r.stderr
    r = refmp(2, [*args, "--tp", "2", "--n-head", "2"], timeout=60)
    assert r.returncode == 0, r.stderr
    want = model.generate(prompt, 3)
    np.testing.assert_array_equal(np.load(tmp_path / "t.npy"), want)
