"""refmp's Llama against transformers' LlamaForCausalLM (refmp.nn.llama, refmp.checkpoint.hf_llama).

* a directory written by transformers' save_pretrained loads into refmp with its logits, and
  refmp's directory loads into from_pretrained with refmp's;
* training: refmp's steps (its AdamW) equal LlamaForCausalLM's with torch.optim.AdamW in
  float64, loss, every gradient and every weight after each step, to rounding; grouped-query
  attention and multi-head, tied head and untied;
* a config.json setting refmp does not compute is refused with its name.

transformers computes RMSNorm's statistics and the rotary tables in float32 whatever the
model's dtype (and its eager attention its softmax; these tests run its sdpa attention, which
keeps the model's dtype). The logits test compares the unchanged model at float32's
precision; the others compute those two in the model's dtype (``float64_hf``), so that the
comparison is at float64's rounding.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from extras import reason

from refmp.checkpoint.hf_llama import hf_name, llama_config, load_llama, save_llama
from refmp.errors import ConfigError
from refmp.nn.llama import Llama, param_shapes
from refmp.training.optim import AdamW

torch = pytest.importorskip("torch", reason=reason("torch", "hf"))
transformers = pytest.importorskip("transformers", reason=reason("transformers", "hf"))
ML = pytest.importorskip("transformers.models.llama.modeling_llama")

TOL = dict(rtol=1e-9, atol=1e-12)


def hf_model(n_kv_head: int = 2, tied: bool = False, seed: int = 0):
    """A toy LlamaForCausalLM in float64, every weight random (norms too)."""
    conf = transformers.LlamaConfig(
        vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=n_kv_head, max_position_embeddings=16,
        rope_theta=500.0, rms_norm_eps=1e-5, tie_word_embeddings=tied, bos_token_id=None,
        eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(conf).to(torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3 if p.ndim == 1 else 0.2)
            if p.ndim == 1:
                p.add_(1.0)
    model.config._attn_implementation = "sdpa"
    return model


@pytest.fixture
def float64_hf(monkeypatch):
    """transformers' RMSNorm and rotary tables in the model's dtype (float64), not float32."""
    in_float64(monkeypatch)


def in_float64(monkeypatch) -> None:
    """float64_hf's patches (tests/test_llama_parallel.py applies them on one rank)."""

    def rmsnorm(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))

    def rotary(self, x, position_ids):
        hs = self.inv_freq.shape[0] * 2
        theta = self.config.rope_parameters["rope_theta"]
        inv = 1.0 / theta ** (torch.arange(0, hs, 2, dtype=torch.float64) / hs)
        ang = position_ids[..., None].to(torch.float64) * inv
        ang = torch.cat((ang, ang), dim=-1)
        return ang.cos().to(x.dtype), ang.sin().to(x.dtype)

    monkeypatch.setattr(ML.LlamaRMSNorm, "forward", rmsnorm)
    monkeypatch.setattr(ML.LlamaRotaryEmbedding, "forward", rotary)


def refmp_of(model, tmp_path) -> Llama:
    model.save_pretrained(tmp_path / "hf")
    cfg, params = load_llama(str(tmp_path / "hf"))
    return Llama(cfg, params)


def torch_adamw(hf):
    """torch.optim.AdamW over ``hf``'s parameters, weight decay 0.1 on the matrices alone (as
    refmp's AdamW decays them), lr 1e-2."""
    decay = [p for p in hf.parameters() if p.ndim >= 2]
    rest = [p for p in hf.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": rest, "weight_decay": 0.0}], lr=1e-2, eps=1e-8)


def torch_loss_backward(hf, opt, idx, tgt) -> float:
    """transformers' loss of one batch (vocabulary 37), its gradients left in ``hf``."""
    logits = hf(torch.tensor(idx)).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 37), torch.tensor(tgt).reshape(-1))
    opt.zero_grad()
    loss.backward()
    return loss.item()


def tokens(seed: int = 1, B: int = 3, T: int = 9):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 37, (B, T)), rng.integers(0, 37, (B, T))


@pytest.mark.parametrize("tied", [False, True])
def test_logits_of_a_transformers_directory(tmp_path, tied):
    hf = hf_model(tied=tied)
    ours = refmp_of(hf, tmp_path)
    assert ours.cfg.n_kv_head == 2 and ours.cfg.tied == tied
    idx, _ = tokens()
    want = hf(torch.tensor(idx)).logits.detach().numpy()
    np.testing.assert_allclose(ours.forward(idx)[0], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n_kv_head,tied", [(2, False), (4, True), (1, False)])
def test_training_equals_transformers_adamw(tmp_path, float64_hf, n_kv_head, tied):
    hf = hf_model(n_kv_head, tied)
    ours = refmp_of(hf, tmp_path)
    opt = torch_adamw(hf)
    ropt = AdamW(ours.params, lr=1e-2, weight_decay=0.1, eps=1e-8)
    hp = dict(hf.named_parameters())
    for step in range(3):
        idx, tgt = tokens(10 + step)
        loss = torch_loss_backward(hf, opt, idx, tgt)
        rloss, cache = ours.forward(idx, tgt)
        ours.zero_grad()
        ours.backward(cache)
        np.testing.assert_allclose(rloss, loss, **TOL, err_msg=f"loss at step {step}")
        for name in param_shapes(ours.cfg):
            key, transposed = hf_name(name)
            g = hp[key].grad.numpy()
            np.testing.assert_allclose(ours.grads[name], g.T if transposed else g, **TOL,
                                       err_msg=f"gradient {name} at step {step}")
        opt.step()
        ropt.step(ours.grads)
        for name in param_shapes(ours.cfg):
            key, transposed = hf_name(name)
            w = hp[key].detach().numpy()
            np.testing.assert_allclose(ours.params[name], w.T if transposed else w, **TOL,
                                       err_msg=f"weight {name} after step {step}")


@pytest.mark.parametrize("tied", [False, True])
def test_refmp_directory_loads_in_transformers(tmp_path, float64_hf, tied):
    hf = hf_model(tied=tied)
    ours = refmp_of(hf, tmp_path)
    save_llama(str(tmp_path / "out"), ours.cfg, ours.params)
    back = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "out"),
                                                         dtype=torch.float64)
    back.config._attn_implementation = "sdpa"
    idx, _ = tokens()
    np.testing.assert_allclose(back(torch.tensor(idx)).logits.detach().numpy(),
                               ours.forward(idx)[0], **TOL)
    cfg, params = load_llama(str(tmp_path / "out"))
    assert cfg == ours.cfg
    for k, v in ours.params.items():
        np.testing.assert_array_equal(params[k], v, err_msg=k)


def test_refmp_train_on_a_directory_equals_transformers_adamw(tmp_path, float64_hf, capsys):
    """``refmp train --init DIR --save OUT``, the engine on one rank: two AdamW steps on the
    data's windows equal transformers' with torch.optim.AdamW from the same directory, and
    OUT (a LlamaForCausalLM directory) loads in from_pretrained with those weights."""
    from refmp.cli.main import main

    hf = hf_model(1)
    hf.save_pretrained(tmp_path / "hf")
    toks = np.random.default_rng(3).integers(0, 37, 200)
    np.save(tmp_path / "data.npy", toks)
    B, T = 3, 9
    argv = ["train", "--init", str(tmp_path / "hf"), "--data", str(tmp_path / "data.npy"),
            "--steps", "2", "--batch-size", str(B), "--block-size", str(T), "--lr", "1e-2",
            "--lr-schedule", "constant", "--weight-decay", "0.1", "--beta2", "0.999",
            "--grad-clip", "0", "--dtype", "float64", "--save", str(tmp_path / "out"),
            "--no-progress"]
    assert main(argv) == 0, capsys.readouterr().err
    opt, n = torch_adamw(hf), (len(toks) - 1) // T
    for s in range(2):  # the windows (s B + j) mod n of refmp's data order
        w = [(s * B + j) % n for j in range(B)]
        idx = np.stack([toks[i * T : i * T + T] for i in w])
        torch_loss_backward(hf, opt, idx, np.stack([toks[i * T + 1 : i * T + T + 1] for i in w]))
        opt.step()
    back = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "out"),
                                                         dtype=torch.float64)
    want = dict(hf.named_parameters())
    for k, v in back.named_parameters():
        np.testing.assert_allclose(v.detach().numpy(), want[k].detach().numpy(), **TOL,
                                   err_msg=k)


@pytest.mark.parametrize("key,value", [
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
    ("sliding_window", 4),
    ("attention_bias", True),
    ("mlp_bias", True),
    ("hidden_act", "gelu"),
    ("head_dim", 8),
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 1e4}),
    ("model_type", "mistral"),
])
def test_what_refmp_does_not_compute_is_refused_by_name(key, value):
    conf = json.loads(hf_model().config.to_json_string())
    conf[key] = value
    name = "rope_type" if key == "rope_parameters" else key
    with pytest.raises(ConfigError, match=name):
        llama_config(conf)


@pytest.mark.parametrize("n_kv_head", [2, 1])
def test_decoding_with_the_gqa_cache_equals_transformers_generate(tmp_path, float64_hf, n_kv_head):
    """refmp's Decoder on one rank (the Llama family's pieces): greedy tokens equal
    transformers' generate (its own cache); each cached step's logits equal the uncached
    forward's; the cache holds 2 L B T NKV HS w bytes (L 2, B 2, T 9 cached, HS 4, float64)."""
    from mpi4py import MPI

    from refmp.distributed.grid import ProcessGrid
    from refmp.inference.decoder import Decoder
    from refmp.inference.generate import generate
    from refmp.inference.sampling import Sampler

    hf = hf_model(n_kv_head)
    ours = refmp_of(hf, tmp_path)
    idx, _ = tokens(5, B=2, T=4)
    want = hf.generate(torch.tensor(idx), max_new_tokens=6, do_sample=False, min_new_tokens=6)
    dec = Decoder(ours.cfg, ours.params, ProcessGrid(MPI.COMM_SELF))
    got = generate(dec, idx, 6, Sampler())
    np.testing.assert_array_equal(got.tokens, want.numpy())
    plain = generate(dec, idx, 6, Sampler(), use_cache=False)
    for s in range(6):
        np.testing.assert_allclose(got.logits[:, s], plain.logits[:, s], **TOL,
                                   err_msg=f"logits of step {s}")
    assert got.kv_cache_bytes == 2 * 2 * 2 * 9 * n_kv_head * 4 * 8


WORDS = [f"w{i}" for i in range(36)] + ["[unk]"]  # a 37-word vocabulary: the toy model's V


def word_tokenizer(folder) -> None:
    """A word-level tokenizer.json for the toy model, made by the tokenizers library."""
    tokenizers = pytest.importorskip("tokenizers", reason=reason("tokenizers", "text"))
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    tok = tokenizers.Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[unk]"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))


def test_refmp_generate_reads_a_llama_directory_and_its_tokenizer(tmp_path, float64_hf, capsys):
    from refmp.cli.main import main

    hf = hf_model(1)
    hf.save_pretrained(tmp_path / "llama")
    word_tokenizer(tmp_path / "llama")
    prompt = "w3 w1 w4 w1 w5"
    ids = [int(w[1:]) for w in prompt.split()]
    want = hf.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False, min_new_tokens=4)
    capsys.readouterr()
    assert main(["generate", "--init", str(tmp_path / "llama"), "--prompt", prompt,
                 "--max-new-tokens", "4", "--dtype", "float64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["new_tokens"] == [want[0, 5:].tolist()]
    assert out["texts"] == [" ".join(WORDS[i] for i in out["new_tokens"][0])]
    assert out["kv_cache_bytes"] == [2 * 2 * 1 * 8 * 1 * 4 * 8]  # 2 L B T NKV HS w
    # GPT-2's figures, from the same code (refmp.cli.decoding)
    assert out["tokens_per_s"] == 4 / (out["prefill_s"] + out["decode_s"]) > 0
    for flags, says in ((["--tp", "2"], "pp*cp*tp = 1*1*2"), (["--ep", "2"], "--ep 2")):
        assert main(["generate", "--init", str(tmp_path / "llama"), "--prompt", prompt,
                     *flags]) == 2
        assert says in capsys.readouterr().err


def from_mixtral(arrays: dict, cfg) -> dict:
    """A MixtralForCausalLM's arrays (values or gradients) under refmp's names and layouts:
    the fused experts (E, 2F, C) and (E, C, F) split and transposed, the router (E, C)
    transposed."""
    out = {}
    F = cfg.n_inner
    for name in param_shapes(cfg):
        if ".mlp." not in name:
            key, transposed = hf_name(name)
            out[name] = arrays[key].T if transposed else arrays[key]
            continue
        _, i, rest = name.split(".", 2)
        pre = f"model.layers.{i}.mlp."
        if rest == "mlp.router.weight":
            out[name] = arrays[pre + "gate.weight"].T
            continue
        e, kind = int(rest.split(".")[2]), rest.split(".")[3]
        if kind == "down_proj":
            out[name] = arrays[pre + "experts.down_proj"][e].T  # (F, C)
        else:
            half = slice(0, F) if kind == "gate_proj" else slice(F, 2 * F)
            out[name] = arrays[pre + "experts.gate_up_proj"][e][half].T  # (C, F)
    return out


def test_mixtral_moe_training_equals_transformers(float64_hf, monkeypatch):
    """Mixtral's sparse MoE block (router softmax, top-2, gates renormalized, SwiGLU experts)
    in refmp's Llama (refmp.nn.swiglu_experts through refmp.nn.moe) trains as
    MixtralForCausalLM with torch.optim.AdamW, float64 (its router's softmax too)."""
    from refmp.nn.llama import LlamaConfig

    MM = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")

    def router(self, h):
        h = h.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(h, self.weight)
        top, idx = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        return logits, top / top.sum(dim=-1, keepdim=True), idx

    monkeypatch.setattr(MM.MixtralTopKRouter, "forward", router)
    monkeypatch.setattr(MM.MixtralRMSNorm, "forward", ML.LlamaRMSNorm.forward)
    monkeypatch.setattr(MM.MixtralRotaryEmbedding, "forward", ML.LlamaRotaryEmbedding.forward)
    conf = transformers.MixtralConfig(
        vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        num_local_experts=4, num_experts_per_tok=2, rope_theta=500.0, rms_norm_eps=1e-5,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(conf).to(torch.float64)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3 if p.ndim == 1 else 0.2)
            if p.ndim == 1:
                p.add_(1.0)
    hf.config._attn_implementation = "sdpa"
    hf.config._experts_implementation = "eager"  # its grouped GEMM takes no float64
    cfg = LlamaConfig(vocab_size=37, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=16,
                      n_inner=24, rope_theta=500.0, rms_eps=1e-5, n_expert=4, top_k=2)
    hp = dict(hf.named_parameters())
    ours = Llama(cfg, {k: np.ascontiguousarray(v) for k, v in
                       from_mixtral({k: p.detach().numpy().copy() for k, p in hp.items()}, cfg).items()})
    opt = torch_adamw(hf)
    decay = {k for k, v in ours.params.items() if v.ndim >= 2}
    ropt = AdamW(ours.params, lr=1e-2, weight_decay=0.1, decay=decay)
    for step in range(2):
        idx, tgt = tokens(20 + step)
        loss = torch_loss_backward(hf, opt, idx, tgt)
        rloss, cache = ours.forward(idx, tgt)
        ours.zero_grad()
        ours.backward(cache)
        np.testing.assert_allclose(rloss, loss, **TOL, err_msg=f"loss at step {step}")
        grads = from_mixtral({k: p.grad.numpy() for k, p in hp.items()}, cfg)
        for k, g in grads.items():
            np.testing.assert_allclose(ours.grads[k], g, **TOL, err_msg=f"gradient {k} at {step}")
        opt.step()
        ropt.step(ours.grads)
    for k, w in from_mixtral({k: p.detach().numpy() for k, p in hp.items()}, cfg).items():
        np.testing.assert_allclose(ours.params[k], w, **TOL, err_msg=f"weight {k}")
