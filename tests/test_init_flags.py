"""--init with MoE flags: a flag given wins over the file's metadata, and a file with no
metadata (written by another implementation) takes the flags, not silent defaults."""

import numpy as np
import pytest
from mpi_helpers import refmp
from safetensors.numpy import load_file, save_file

from refmp.checkpoint.weights import read_config, save_model
from refmp.errors import ConfigError
from refmp.nn import GPT, GPTConfig
from refmp.training.datasets import Dataset
from refmp.training.trainer import TrainConfig, build_model

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
    return build_model(TrainConfig(init=path, **flags), ds).cfg


def test_flags_apply_to_a_file_without_metadata(tmp_path):
    path = moe_file(tmp_path, metadata=False)
    cfg = loaded(path, top_k=1, capacity_factor=0)
    assert (cfg.top_k, cfg.capacity_factor) == (1, 0)
    assert (cfg.n_expert, cfg.moe_every) == (4, 2)  # from the routers
    assert (cfg.aux_loss_coef, cfg.z_loss_coef) == (GPTConfig.aux_loss_coef, GPTConfig.z_loss_coef)
    _, notes = read_config(path, moe={"top_k": 1, "capacity_factor": 0})
    assert len(notes) == 1 and "does not record aux_loss_coef, z_loss_coef" in notes[0], notes
    cfg = loaded(path, aux_loss_coef=0.5, z_loss_coef=0.25)
    assert (cfg.aux_loss_coef, cfg.z_loss_coef, cfg.top_k) == (0.5, 0.25, GPTConfig.top_k)


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
    assert loaded(path, moe_every=2).moe_every == 2
    for every, blocks in ((1, "[0, 1, 2, 3]"), (3, "[0, 3]")):
        with pytest.raises(ConfigError, match=rf"--moe-every {every} puts experts in blocks "
                                              rf"\{blocks}, but .* routers in blocks \[0, 2\]"):
            loaded(path, moe_every=every)


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
