"""GPT-2 small at its real shape (12 layers, C 768, 12 heads, vocabulary 50257: 124M
parameters), float64, one sequence of T 8: one training step of refmp, serial and on tp 2
(which pads the vocabulary to 50258 rows), equals transformers' GPT2LMHeadModel with
torch.optim.AdamW and torch's gradient clipping, loaded by ``from_pretrained`` from the
Hugging Face directory refmp wrote.

Memory: a float64 copy of the model is 1 GB, and a step holds four (weights, gradients,
AdamW's two moments). The three runs take turns, each freed before the next: the two tp
ranks under mpiexec while this process holds no model, then the torch reference (its
updated weights kept, 1 GB), then refmp serial in this process. Skipped without the hf
extra (torch, transformers), saying so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json

import numpy as np
import pytest
from extras import reason
from mpi4py import MPI
from mpi_helpers import refmp
from safetensors.numpy import load_file

from refmp.checkpoint.hf import save_hf
from refmp.config import flag_name
from refmp.distributed.grid import ProcessGrid
from refmp.nn import GPTConfig
from refmp.nn.params import param_shapes
from refmp.training.trainer import TrainConfig, Trainer

pytestmark = pytest.mark.cli

GPT2_SMALL = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
T = 8
LR = 1e-3
TOL = {"rtol": 1e-9, "atol": 1e-12}  # float64 rounding, summed in other orders


def torch_step(torch, transformers, model_dir: str, tokens: np.ndarray):
    """(loss, updated weights by GPT-2 name): GPT2LMHeadModel.from_pretrained(model_dir),
    the mean cross-entropy of predicting tokens[1:] from tokens[:-1], gradients clipped to
    norm 1, then torch.optim.AdamW with weight decay on the matrices (refmp's rule)."""
    hf = transformers.GPT2LMHeadModel.from_pretrained(model_dir).train(False)  # no dropout
    assert hf.dtype == torch.float64
    x = torch.from_numpy(tokens[None, :-1])  # (1, T)
    y = torch.from_numpy(tokens[1:])  # (T,)
    logits = hf(x).logits  # (1, T, V)
    loss = torch.nn.functional.cross_entropy(logits.view(-1, GPT2_SMALL.vocab_size), y)
    loss.backward()
    params = list(hf.parameters())  # the tied wte once: its gradient holds both uses
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.99), eps=1e-8, fused=True)  # fused: 2x faster
    opt.step()
    del opt  # AdamW's moments: 2 GB
    hf.zero_grad(set_to_none=True)
    return loss.item(), {k: p.detach().numpy() for k, p in hf.transformer.named_parameters()}


def release() -> None:
    """Hand the memory of freed arrays back to the system before the next run starts: glibc
    keeps freed blocks of tens of MB in the heap (about 1 GB after the weights are written),
    which the ranks launched next would otherwise sit beside."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc is not None and hasattr(ctypes.CDLL(libc), "malloc_trim"):  # glibc only
        ctypes.CDLL(libc).malloc_trim(0)


def weights(cfg: GPTConfig) -> dict:
    """Every parameter random: N(0, 0.02), around 1 for the LayerNorms' weights (biases
    too, so that a wrong slice of any of them shows)."""
    rng = np.random.default_rng(0)
    out = {}
    for k, shape in param_shapes(cfg).items():
        layernorm = k.startswith("ln_f.") or ".ln_" in k
        out[k] = rng.standard_normal(shape) * 0.02 + (1.0 if layernorm and k.endswith(".weight") else 0.0)
    return out


def test_gpt2_small_step_equals_transformers_and_adamw_serial_and_tp2(tmp_path):
    torch = pytest.importorskip("torch", reason=reason("torch", "hf"))
    transformers = pytest.importorskip("transformers", reason=reason("transformers", "hf"))
    model_dir = str(tmp_path / "gpt2")
    save_hf(model_dir, weights(GPT2_SMALL), GPT2_SMALL)  # refmp's directory
    release()
    tokens = np.random.default_rng(0).integers(0, GPT2_SMALL.vocab_size, T + 1)  # (T+1,)
    tokens[3] = GPT2_SMALL.vocab_size - 1  # the last real row of the padded vocabulary
    data = str(tmp_path / "tokens.npy")
    np.save(data, tokens)
    flags = {"block_size": T, "batch_size": 1, "steps": 1, "dtype": "float64", "lr": LR,
             "lr_schedule": "constant", "grad_clip": 1.0, "weight_decay": 0.1, "beta1": 0.9,
             "beta2": 0.99}
    out = str(tmp_path / "tp2.safetensors")
    log = str(tmp_path / "log.jsonl")
    r = refmp(2, ["train", "--tp", "2", "--init", model_dir, "--data", data, "--no-progress",
                  "--save", out, "--log-json", log,
                  *(a for k, v in flags.items() for a in (flag_name(k), str(v)))], timeout=240)
    assert r.returncode == 0, r.stderr
    assert "124,439,808 parameters" in r.stdout, r.stdout  # GPT-2 small, tied head

    want_loss, want = torch_step(torch, transformers, model_dir, tokens)
    release()
    with open(log) as f:
        np.testing.assert_allclose(json.loads(f.readline())["loss"], want_loss, **TOL)
    for k, v in load_file(out).items():
        np.testing.assert_allclose(v, want[k], **TOL, err_msg=f"tp 2 {k}")
    release()

    tr = Trainer(TrainConfig(init=model_dir, data=data, progress=False, **flags),
                 grid=ProcessGrid(MPI.COMM_SELF))
    np.testing.assert_allclose(tr.step()["loss"], want_loss, **TOL)
    for k, v in tr.runner.full_params().items():
        np.testing.assert_allclose(v, want[k], **TOL, err_msg=f"serial {k}")
