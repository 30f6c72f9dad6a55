"""KV-cached decoding, serial: every decoding path (generate with and without the cache, the
paged cache, continuous batching) equal to the model's uncached forward of the tokens it
produced (float64, logits to 1e-12; a greedy token the argmax of the recomputed logits); the
paged cache bitwise the contiguous one, continuous batching bitwise one request at a time,
sampling reproducible; ``refmp generate`` end to end, and its refusals (exit 2).
(Split layouts: tests/test_inference_parallel.py.)"""

import dataclasses
import json

import numpy as np
import pytest
from extras import reason
from mpi4py import MPI
from mpi_helpers import mpiexec, refmp

from refmp.checkpoint.convert import from_gpt2
from refmp.checkpoint.weights import save_model
from refmp.cli.main import main
from refmp.distributed.grid import ProcessGrid
from refmp.inference.decoder import Decoder
from refmp.inference.generate import generate
from refmp.inference.sampling import Sampler
from refmp.inference.scheduler import Request, plan, serve
from refmp.nn.gpt import GPT, GPTConfig
from refmp.training.datasets import ADD_CHARS


def model(n_expert: int = 0, V: int = 19) -> GPT:
    cfg = GPTConfig(vocab_size=V, block_size=16, n_layer=2, n_head=4, n_embd=32,
                    n_expert=n_expert, capacity_factor=0.0)  # decoding drops no token
    return GPT.create(cfg, 5, "float64")


def decoder(m: GPT) -> Decoder:
    return Decoder(m.cfg, m.params, ProcessGrid(MPI.COMM_SELF))


PROMPTS = np.random.default_rng(1).integers(0, 19, (3, 6))
SAMPLED = Sampler(temperature=0.8, top_k=5, top_p=0.9, seed=7)


def assert_uncached(m: GPT, tokens, logits, t0: int, greedy: bool) -> None:
    """Decoded ``tokens`` (B, T0 + N) and the ``logits`` (B, N, V) their new tokens were
    picked from, held to the serial model's uncached forward of the same tokens (every
    position recomputed, no cache): the logits to 1e-12; greedy, each new token their argmax."""
    full, _ = m.forward(tokens[:, :-1])  # (B, T0 + N - 1, V)
    np.testing.assert_allclose(logits, full[:, t0 - 1:], rtol=0, atol=1e-12)
    if greedy:
        np.testing.assert_array_equal(tokens[:, t0:], full[:, t0 - 1:].argmax(axis=-1))


@pytest.mark.parametrize("n_expert", [0, 4])
def test_cached_decoding_equals_the_uncached_forward(n_expert):
    m = model(n_expert)
    got = generate(decoder(m), PROMPTS, 7, Sampler())
    assert_uncached(m, got.tokens, got.logits, 6, greedy=True)
    np.testing.assert_array_equal(got.tokens, m.generate(PROMPTS, 7))
    again = generate(decoder(m), PROMPTS, 7, Sampler(), use_cache=False)
    assert_uncached(m, again.tokens, again.logits, 6, greedy=True)
    np.testing.assert_array_equal(again.tokens, got.tokens)
    sampled = generate(decoder(m), PROMPTS, 7, SAMPLED)
    assert_uncached(m, sampled.tokens, sampled.logits, 6, greedy=False)
    assert got.kv_cache_bytes == 2 * 2 * 3 * (6 + 6) * 32 * 8  # 2 L B (T0 + N - 1) C w


def test_paged_cache_is_bitwise_the_contiguous_one():
    m = model()
    flat = generate(decoder(m), PROMPTS, 7, Sampler())
    for bs in (1, 4, 5):
        paged = generate(decoder(m), PROMPTS, 7, Sampler(), block_size=bs)
        assert_uncached(m, paged.tokens, paged.logits, 6, greedy=True)
        np.testing.assert_array_equal(paged.logits, flat.logits)
        np.testing.assert_array_equal(paged.tokens, flat.tokens)


REQUESTS = [Request([1, 2, 3], 5, 0), Request([4, 5, 6, 7, 8], 2, 0), Request([9], 6, 1),
            Request([3, 3, 2, 1], 4, 2), Request([7, 7], 3, 2), Request([11] * 6, 1, 5)]


@pytest.mark.parametrize("block_size", [None, 2])
def test_continuous_batching_equals_one_request_at_a_time(block_size):
    """Each request's tokens and logits: those of the model's uncached forward (sampled, and
    greedy), and bitwise those of the same request served alone."""
    m = model()
    dec = decoder(m)
    both = serve(dec, REQUESTS, SAMPLED, 3, block_size)
    if block_size:  # a request's blocks: at most one not full
        assert all(dec.cache.waste(s) < block_size for s in range(3))
    assert max(len(st.decode) for st in both.trace) == 3
    greedy = serve(decoder(m), REQUESTS, Sampler(), 3, block_size)
    for i, r in enumerate(REQUESTS):
        for run, is_greedy in ((both, False), (greedy, True)):
            assert_uncached(m, run.tokens[i][None], run.logits[i][None], len(r.prompt),
                            is_greedy)
        alone = serve(decoder(m), [r._replace(arrival=0)], SAMPLED, 3, block_size, ids=[i])
        np.testing.assert_array_equal(both.tokens[i], alone.tokens[0])
        np.testing.assert_array_equal(both.logits[i], alone.logits[0])
        assert len(both.tokens[i]) == len(r.prompt) + r.max_new_tokens


@pytest.mark.parametrize("stages, slots", [(1, 3), (2, 4), (3, 3), (4, 2)])
def test_the_plan_never_schedules_a_group_twice_while_it_is_in_flight(stages, slots):
    """A turn of group g started at tick t is on stage s at t + s, done at t + stages - 1:
    the group's next turn starts at t + stages or later; each request gets its tokens."""
    steps = plan(REQUESTS, slots, stages)
    for g in range(min(stages, slots)):
        ticks = [st.tick for st in steps if st.group == g]
        assert all(b - a >= stages for a, b in zip(ticks[:-1], ticks[1:], strict=True)), (g, ticks)
    for t in range(steps[-1].tick + stages):  # at each tick the stages hold distinct groups
        live = [st.group for st in steps if st.tick <= t < st.tick + stages]
        assert len(live) == len(set(live)), (t, live)
    fed = [0] * len(REQUESTS)
    for st in steps:
        for i, *_ in st.decode + st.admit:
            fed[i] += 1
    assert fed == [r.max_new_tokens for r in REQUESTS]
    assert sorted(s for st in steps for s in st.done) == sorted(
        s for st in steps for _, s in st.admit)  # every slot taken is given back


def test_the_plan_keeps_every_stage_busy_while_the_groups_have_work():
    """One group per stage: 2 stages, 2 groups of 2 slots, 8 equal requests: a turn starts at
    every tick (each stage works on one group while the other group's tokens travel)."""
    steps = plan([Request([1, 2], 5)] * 8, 4, 2)
    assert [st.tick for st in steps] == list(range(len(steps)))
    assert [st.group for st in steps] == [t % 2 for t in range(len(steps))]


def test_training_evaluates_the_copy_it_computes_on():
    """Training's evaluation (refmp.training.evaluate) decodes the weights as the step
    computes on them: with --mixed-precision bf16 the fp32 masters rounded to bf16."""
    from refmp.runtime.precision import BF16
    from refmp.training.evaluate import decoder as evaluation_decoder
    from refmp.training.trainer import TrainConfig, Trainer

    cfg = TrainConfig(n_layer=2, n_head=2, n_embd=16, batch_size=4, steps=1, progress=False,
                      mixed_precision="bf16")
    tr = Trainer(cfg, grid=ProcessGrid(MPI.COMM_SELF))
    tr.step()
    full = tr.runner.full_params()  # the fp32 masters, whole (one rank)
    dec = evaluation_decoder(tr.runner, tr.grid, tr.mcfg, tr.T).dec
    assert list(dec.blocks) == [0, 1]
    for k, v in full.items():
        assert dec.params[k].dtype == BF16, k
        np.testing.assert_array_equal(dec.params[k], v.astype(BF16), err_msg=k)


def test_paged_blocks_waste_at_most_one_block_per_request():
    m = model()
    dec = decoder(m)
    generate(dec, PROMPTS, 4, Sampler(), block_size=4)  # 6 + 3 = 9 tokens: 3 blocks
    assert [len(t) for t in dec.cache.table] == [3, 3, 3]
    assert [dec.cache.waste(s) for s in range(3)] == [3, 3, 3]
    dec.cache.free(1)
    assert len(dec.cache.pool) == 3 and dec.cache.table[1] == []


def test_sampling_is_reproducible_and_greedy_at_its_limits():
    logits = np.random.default_rng(0).standard_normal((4, 19))
    a, b = SAMPLED.pick(logits, [0, 1, 2, 3], 3), SAMPLED.pick(logits, [0, 1, 2, 3], 3)
    np.testing.assert_array_equal(a, b)
    for s in (Sampler(temperature=1.0, top_k=1), Sampler(temperature=1.0, top_p=1e-9)):
        np.testing.assert_array_equal(s.pick(logits, range(4), 0), logits.argmax(axis=-1))
    draws = {int(Sampler(1.0, seed=k).pick(logits[:1], [0], 0)[0]) for k in range(40)}
    assert len(draws) > 3  # it samples


# --- refmp generate ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A model of the addition task's vocabulary, saved as refmp train --save writes it."""
    m = GPT.create(GPTConfig(len(ADD_CHARS), 16, 2, 4, 32), 3, "float64")
    path = tmp_path_factory.mktemp("gen") / "m.safetensors"
    save_model(str(path), m.params, m.cfg, ADD_CHARS)
    return str(path), m


def test_generate_command(weights, tmp_path, capsys):
    path, m = weights
    toks, lg = tmp_path / "t.npy", tmp_path / "l.npy"
    args = ["generate", "--init", path, "--prompt", "123+456=", "--prompt", "999+001=",
            "--max-new-tokens", "5", "--dtype", "float64"]
    assert main([*args, "--save-tokens", str(toks), "--save-logits", str(lg), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    prompts = np.array([[ADD_CHARS.index(c) for c in p] for p in ("123+456=", "999+001=")])
    want = m.generate(prompts, 5)
    np.testing.assert_array_equal(np.load(toks), want)
    assert np.load(lg).shape == (2, 5, len(ADD_CHARS))
    assert out["texts"] == ["".join(ADD_CHARS[i] for i in r[8:]) for r in want]
    assert out["tokens_per_s"] > 0 and out["kv_cache_bytes"] == [2 * 2 * 2 * 12 * 32 * 8]
    assert main([*args, "--no-kv-cache"]) == 0
    assert "'123+456=' -> " in capsys.readouterr().out
    from_gpt2(path, str(tmp_path / "ck"))  # a 1-rank sharded checkpoint of the same weights
    flags = ["--checkpoint", str(tmp_path / "ck"), *args[3:], "--json"]
    assert main(["generate", *flags]) == 0
    assert json.loads(capsys.readouterr().out)["texts"] == out["texts"]


def test_default_new_tokens_fit_the_positions(weights, capsys):
    """Without --max-new-tokens a prompt gets 16 new tokens, or the positions it leaves (the
    model has 16: an 8-token prompt gets 9)."""
    assert main(["generate", "--init", weights[0], "--prompt", "123+456=", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["new_tokens"][0]) == 9


@pytest.mark.parametrize("flags, message", [
    (["--prompt", "12a+3="], "'a' not in the model's vocabulary"),
    (["--prompt", "1" * 17], "longer than the model's 16 positions"),
    (["--prompt", "1+1=", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--prompt", "1+1=", "--max-new-tokens", "14"], "need 17 positions"),
    (["--prompt", "1+1=", "--prompt", "12+1="], "different lengths"),
    (["--prompt", "1+1=", "--moe-top-k", "1"], "is a dense model (no experts): --moe-top-k"),
    (["--prompt", "1+1=", "--kv-block-size", "0"], "--kv-block-size must be at least 1"),
])
def test_bad_input_is_one_message_and_exit_2(weights, flags, message, capsys):
    assert main(["generate", "--init", weights[0], *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("error:") == 1


def test_generate_under_mpi_tp_dp_ep_with_moe_flags_and_a_layout_that_does_not_fit(weights,
                                                                                   tmp_path):
    """tp 2 x dp 2 x ep 2 on an MoE model, --moe-top-k 1 overriding the file's top_k 2: the
    tokens of the serial model with one expert per token and no capacity limit."""
    cfg = GPTConfig(len(ADD_CHARS), 16, 2, 4, 32, n_expert=4)
    m = GPT.create(cfg, 3, "float64")
    path = str(tmp_path / "moe.safetensors")
    save_model(path, m.params, cfg, ADD_CHARS)
    r = refmp(4, ["generate", "--init", path, "--tp", "2", "--dp", "2", "--ep", "2",
                  "--moe-top-k", "1", "--prompt", "123+456=", "--prompt", "999+001=",
                  "--max-new-tokens", "4", "--dtype", "float64", "--json",
                  "--save-logits", str(tmp_path / "l.npy")])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    one = GPT(dataclasses.replace(cfg, top_k=1, capacity_factor=0.0), m.params)
    want = one.generate(np.array([[ADD_CHARS.index(c) for c in p]
                                  for p in ("123+456=", "999+001=")]), 4)
    assert out["new_tokens"] == want[:, 8:].tolist() and len(out["kv_cache_bytes"]) == 4
    full = one.forward(want[:, :-1])[0][:, 7:]  # the uncached forward, one expert a token
    np.testing.assert_allclose(np.load(tmp_path / "l.npy"), full, rtol=0, atol=1e-12)
    two = GPT(dataclasses.replace(cfg, capacity_factor=0.0), m.params).forward(want[:, :-1])[0]
    assert np.abs(two[:, 7:] - full).max() > 1e-3  # the flag was obeyed: top-2 differs
    r = refmp(3, ["generate", "--init", weights[0], "--pp", "3", "--prompt", "1+1="])
    assert r.returncode == 2 and r.stderr.count("error:") == 1, r.stderr
    assert "--pp 3 stages but the model has 2 layers" in r.stderr


def test_matches_hugging_face_generate(tmp_path, capsys):
    """A random transformers GPT2LMHeadModel saved by save_pretrained (float64 safetensors),
    decoded by `refmp generate --init DIR`: the tokens equal transformers' greedy generate with
    its cache, the logits its cached forward's (caught at lm_head) to 1e-12, and the float32
    logits generate returns to their rounding."""
    torch = pytest.importorskip("torch", reason=reason("torch", "hf"))
    transformers = pytest.importorskip("transformers", reason=reason("transformers", "hf"))
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=23, n_positions=24, n_embd=32, n_layer=2,
                                  n_head=4, bos_token_id=None, eos_token_id=None)
    hf = transformers.GPT2LMHeadModel(cfg).double().eval()
    with torch.no_grad():  # every weight random, biases and LayerNorms too
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    prompts = np.random.default_rng(2).integers(0, 23, (2, 8))
    prompts[0, 3] = 0  # a token 0 is a token, not padding
    np.save(tmp_path / "p.npy", prompts)
    seen = []  # the float64 logits of each cached call, as generate computes them
    hf.lm_head.register_forward_hook(lambda mod, inp, out: seen.append(out[:, -1].clone()))
    ids = torch.from_numpy(prompts)
    with torch.no_grad():  # the mask given: else generate takes a token 0 for padding
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                          do_sample=False, use_cache=True, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0)
    assert main(["generate", "--init", str(tmp_path / "hf"), "--prompts", str(tmp_path / "p.npy"),
                 "--max-new-tokens", "6", "--dtype", "float64", "--json",
                 "--save-tokens", str(tmp_path / "t.npy"),
                 "--save-logits", str(tmp_path / "l.npy")]) == 0
    capsys.readouterr()
    np.testing.assert_array_equal(np.load(tmp_path / "t.npy"), out.sequences.numpy())
    logits = np.load(tmp_path / "l.npy")  # (B, N, V)
    np.testing.assert_allclose(logits, torch.stack(seen, 1).numpy(), rtol=0, atol=1e-12)
    hf32 = torch.stack(out.logits, dim=1).numpy()  # generate's copy, cast to float32
    np.testing.assert_allclose(logits.astype(np.float32), hf32, rtol=2.0**-23, atol=0)


@pytest.mark.tutorial
def test_tutorial_12_inference():
    r = mpiexec(4, ["python", "tutorials/12_inference.py"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: the split cache decodes like the serial model" in r.stdout
