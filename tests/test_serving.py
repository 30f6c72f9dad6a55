"""Serving on one rank (docs/serving.md): prefix caching, chunked prefill and speculative
decoding each change no token. Held against the plain decoder: continuous batching's
refmp.inference.scheduler.serve and generate's greedy and sampled tokens, the logits against
the serial model's uncached forward (float64, 1e-12). Speculative sampling keeps the target's
distribution (frequencies over many seeds, a stated bound). Split layouts and
disaggregation: tests/test_serving_parallel.py."""

import json

import numpy as np
import pytest
from mpi4py import MPI

from refmp.checkpoint.weights import save_model
from refmp.cli.main import main
from refmp.cost.serving import prefill_flops, prefix_saving, speculative_speedup, tokens_per_pass
from refmp.distributed.grid import ProcessGrid
from refmp.inference.decoder import Decoder
from refmp.inference.generate import generate
from refmp.inference.prefix import PrefixCache, predicted_saving
from refmp.inference.sampling import Sampler
from refmp.inference.scheduler import Request, serve
from refmp.inference.serving import serve_chunked
from refmp.inference.speculative import DraftModel, PromptLookup, speculate, verify
from refmp.nn.gpt import GPT, GPTConfig

V = 19


def model(seed: int = 5, n_layer: int = 2, C: int = 32, n_head: int = 4) -> GPT:
    return GPT.create(GPTConfig(vocab_size=V, block_size=32, n_layer=n_layer, n_head=n_head,
                                n_embd=C), seed, "float64")


def decoder(m: GPT) -> Decoder:
    return Decoder(m.cfg, m.params, ProcessGrid(MPI.COMM_SELF))


HEAD = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # a shared "system prompt"
# arrivals one turn apart: each prompt is prefilled (and its blocks keyed) before the next
SHARED = [Request(HEAD + [1, 2], 5, 0), Request(HEAD + [3], 4, 1), Request(HEAD[:5] + [0, 0], 6, 2),
          Request(HEAD + [1, 2, 3, 4], 3, 3), Request([5, 5], 4, 4), Request(HEAD[:8], 2, 5),
          Request(HEAD[4:8] + [1, 1], 3, 6)]  # HEAD's block 1 as its block 0: no match
SAMPLED = Sampler(temperature=0.8, top_k=8, seed=3)


def same_as_plain(m: GPT, got, ref, what: str) -> None:
    for i, (a, b) in enumerate(zip(got.tokens, ref.tokens, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"{what}: request {i} tokens")
        full, _ = m.forward(a[None, :-1])  # uncached: every position again
        n = len(SHARED[i].prompt) if len(SHARED) == len(ref.tokens) else 0
        np.testing.assert_allclose(got.logits[i], full[0, n - 1:], rtol=0, atol=1e-12,
                                   err_msg=f"{what}: request {i} logits")


def test_chunked_prefill_and_prefix_caching_change_no_token():
    """Chunks of 1, 4 and 16 tokens (and whole prompts), with and without prefix caching:
    every request's tokens those of continuous batching without either, its logits the
    uncached forward's; the prefill work saved what the shared prefixes predict."""
    m = model()
    dec = decoder(m)
    for sampler, runs in ((SAMPLED, [(1, False), (4, False), (16, False), (None, True),
                                     (4, True)]), (Sampler(), [(None, True), (4, False)])):
        ref = serve(dec, SHARED, sampler, 2)
        for chunk, prefix in runs:
            got = serve_chunked(dec, SHARED, sampler, 2, 4 if prefix else None, chunk, prefix)
            same_as_plain(m, got, ref, f"chunk {chunk} prefix {prefix}")
            prompts = [r.prompt for r in SHARED]
            assert got.prefilled + got.saved == sum(len(p) for p in prompts)
            if prefix and chunk is None:  # each prompt prefilled before the next arrives
                assert got.saved == predicted_saving(prompts, 4) == 8 + 4 + 8 + 4


def test_prefix_blocks_are_counted_shared_and_evicted_oldest_first():
    """Reference counts: a matched block has one user per slot; a block is never written by
    a second request; a finished request's keyed blocks wait, least recently used evicted
    first, and only once the never-keyed blocks are gone."""
    c = PrefixCache([0], 3, 1, 4, 2, 1, np.float64)  # 4 blocks of 2 tokens
    one = np.ones((1, 4, 1))
    c.append(0, 0, one, one)
    c.advance(0, 4)
    c.register(0, [1, 2, 3, 4])  # two keyed blocks
    assert c.match(1, [1, 2, 3, 4, 5]) == 4 and c.table[1] == c.table[0]
    assert c.users[c.table[0]].tolist() == [2, 2]
    assert c.match(2, [1, 2, 3, 4]) == 2  # the last token is always prefilled
    c.append(0, 2, 2 * one[:, :2], 2 * one[:, :2])  # its own block for tokens 2, 3
    assert c.table[2][1] not in c.table[0]
    shared = list(c.table[0])
    c.free(0)
    c.free(1)
    assert list(c.unused) == [shared[1]] and c.users[shared[0]] == 1  # slot 2 uses block 0
    c.free(2)
    assert list(c.unused) == [shared[1], shared[0]]  # the deepest block first
    taken = [c._take() for _ in range(3)]  # the free pool, then the oldest unused
    assert taken[-1] == shared[1] and len(c.block_of) == 1
    assert c.match(1, [1, 2, 3, 4, 5]) == 2  # the first block is still cached


def test_speculative_greedy_is_plain_greedy_batched_and_paged():
    """Both drafts, contiguous and paged caches, prompts of several lengths in one batch:
    tokens those of plain greedy generate, logits the uncached forward's. With the target as
    its own draft every draft is accepted: g + 1 tokens per target pass."""
    m = model()
    prompts = np.random.default_rng(1).integers(0, V, (3, 6))
    want = generate(decoder(m), prompts, 8, Sampler()).tokens
    small = model(9, n_layer=1, C=16, n_head=2)
    drafts = {"lookup": PromptLookup(V), "small": DraftModel(decoder(small)),
              "itself": DraftModel(decoder(m), block_size=3)}
    for name, draft in drafts.items():
        for bs in (None, 3):
            got = speculate(decoder(m), [list(p) for p in prompts], 8, Sampler(), draft, 3, bs)
            np.testing.assert_array_equal(np.stack(got.tokens), want, err_msg=f"{name} {bs}")
            full, _ = m.forward(want[:, :-1])
            np.testing.assert_allclose(np.stack(got.logits), full[:, 5:], rtol=0, atol=1e-12)
            if name == "itself":
                assert got.tokens_per_pass == got.predicted_per_pass == 4.0
    ragged = [[3, 4], [5, 6, 7, 8, 9], [1]]
    got = speculate(decoder(m), ragged, 4, SAMPLED, drafts["small"], 2)
    for p, t in zip(ragged, got.tokens, strict=True):
        alone = speculate(decoder(m), [p], 4, SAMPLED, drafts["small"], 2,
                          requests=[ragged.index(p)])
        np.testing.assert_array_equal(t, alone.tokens[0])


def test_verification_stops_at_the_first_rejection():
    """p puts nothing on draft 1: it is rejected whatever u, the round ends with a token of
    the residual, and draft 2 (which p would accept) is not taken."""
    p = np.zeros((3, 4))
    p[0, 2] = p[1, 1] = p[2, 0] = 1.0
    q = np.full((2, 4), 0.25)
    assert verify([1, 1], q, p, [0.0, 0.0], [0.5] * 3) == [2]
    p[0] = [0, 1, 0, 0]  # now draft 1 is p's choice: accepted; draft 2 too; then p[2]
    assert verify([1, 1], q, p, [0.99, 0.99], [0.5] * 3) == [1, 1, 0]


def marginals(m: GPT, prompt, sampler: Sampler):
    """The target's distribution of new token 0, and of new token 1 summed over token 0."""
    first = sampler.probs(m.forward(np.array([prompt]))[0][0, -1])  # (V,)
    both = np.array([list(prompt) + [x] for x in range(V)])
    nxt = np.stack([sampler.probs(z) for z in m.forward(both)[0][:, -1]])  # (V, V)
    return first, first @ nxt


def test_speculative_sampling_keeps_the_target_distribution():
    """n = 800 requests (one seed each) of the same prompt, gamma 2, temperature 0.3, with two
    drafts: the frequencies of new tokens 0 and 1 within 5 sd + 1/n of the target's
    probabilities, sd = sqrt(p (1 - p) / n), for each of the 2 V tokens (a correct rule fails
    this with probability under 2 V x 6e-7 per draft, by the normal approximation and a union
    bound). Each draft is chosen so that the bound has power: the draft model's own
    distribution q fails it (accepting every draft would be caught), and prompt lookup's
    draft d has p(d) (1 - p(d)) beyond it (resampling a rejection from p instead of
    max(0, p - q) puts that much more on d)."""
    m, small = model(), model(9, n_layer=1, C=16, n_head=2)
    small.params["wte.weight"] = small.params["wte.weight"] * 4  # a confident, other draft
    prompt, n = [3, 1, 4, 1, 5, 9], 800
    sampler = Sampler(temperature=0.3, seed=11)
    want = marginals(m, prompt, sampler)
    bound = [5 * np.sqrt(p * (1 - p) / n) + 1 / n for p in want]
    q = sampler.probs(small.forward(np.array([prompt]))[0][0, -1])
    assert np.any(np.abs(q - want[0]) > bound[0]), "the draft model is too close to p"
    d = PromptLookup(V)._lookup(prompt, 2)[0]
    assert want[0][d] * (1 - want[0][d]) > bound[0][d], "lookup's draft is too unlikely"
    for draft in (DraftModel(decoder(small)), PromptLookup(V)):
        got = speculate(decoder(m), [prompt] * n, 3, sampler, draft, 2)
        tokens = np.stack(got.tokens)[:, len(prompt):]
        for k, p in enumerate(want):
            freq = np.bincount(tokens[:, k], minlength=V) / n
            assert np.all(np.abs(freq - p) <= bound[k]), (type(draft).__name__, k, freq, p)
    a = got.accepted / got.proposed
    assert 0 < a < 1 and abs(got.tokens_per_pass - got.predicted_per_pass) < 0.5, got


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The test's model and a smaller draft of its vocabulary as files, requests sharing a
    prefix as a jsonl."""
    d = tmp_path_factory.mktemp("serving")
    m, small = model(), model(9, n_layer=1, C=16, n_head=2)
    save_model(str(d / "m.safetensors"), m.params, m.cfg)
    save_model(str(d / "d.safetensors"), small.params, small.cfg)
    with open(d / "r.jsonl", "w") as f:
        for r in SHARED:
            f.write(json.dumps({"prompt": r.prompt, "max_new_tokens": r.max_new_tokens,
                                "arrival": r.arrival}) + "\n")
    return d


def test_generate_command_serving_flags(files, capsys):
    """``refmp generate`` with --draft (a model, prompt lookup) and with --prefix-cache and
    --prefill-chunk: the new tokens of the same command without them."""
    def run(*flags):
        assert main(["generate", "--init", str(files / "m.safetensors"), "--dtype", "float64",
                     "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)

    np.save(files / "p.npy", np.random.default_rng(1).integers(0, V, (3, 6)))
    plain = run("--prompts", str(files / "p.npy"), "--max-new-tokens", "6")
    for draft in (str(files / "d.safetensors"), "lookup"):
        got = run("--prompts", str(files / "p.npy"), "--max-new-tokens", "6", "--draft", draft,
                  "--gamma", "2")
        assert got["new_tokens"] == plain["new_tokens"] and got["target_passes"] > 0
    plain = run("--requests", str(files / "r.jsonl"), "--max-batch", "2")
    got = run("--requests", str(files / "r.jsonl"), "--max-batch", "2", "--prefix-cache",
              "--kv-block-size", "4", "--prefill-chunk", "3")
    assert got["new_tokens"] == plain["new_tokens"] and got["prefix_saved_tokens"] > 0


@pytest.mark.parametrize("flags, message", [
    (["--requests", "R", "--prefix-cache"], "give --kv-block-size"),
    (["--prompts", "P", "--prefix-cache", "--kv-block-size", "2"], "serve --requests"),
    (["--requests", "R", "--prefill-chunk", "0"], "--prefill-chunk must be at least 1"),
    (["--prompts", "P", "--draft", "lookup", "--gamma", "0"], "--gamma must be at least 1"),
    (["--requests", "R", "--draft", "lookup"], "not --requests"),
    (["--prompts", "P", "--draft", "lookup", "--no-kv-cache"], "drop --no-kv-cache"),
    (["--prompts", "P", "--draft", "lookup", "--prefill-tp", "1"], "are separate modes"),
    (["--prompts", "P", "--prefill-tp", "2"], "the world has 1"),
    (["--prompts", "P", "--draft", "M"], "the draft has 16 positions"),
])
def test_serving_refusals_are_one_message_and_exit_2(files, flags, message, capsys):
    short = GPT.create(GPTConfig(vocab_size=V, block_size=16, n_layer=1, n_head=2, n_embd=16),
                       1, "float64")
    save_model(str(files / "short.safetensors"), short.params, short.cfg)
    np.save(files / "p.npy", np.zeros((2, 4), dtype=np.int64))
    names = {"R": str(files / "r.jsonl"), "P": str(files / "p.npy"),
             "M": str(files / "short.safetensors")}
    flags = [names.get(f, f) for f in flags]
    assert main(["generate", "--init", str(files / "m.safetensors"), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("error:") == 1, err


def test_the_cost_terms_compose():
    """A prompt prefilled in two chunks costs what it costs whole (the second chunk attends
    over the first), so a prefix hit of s tokens saves exactly the prefill of those s; the
    tokens per pass are 1 at a = 0 and g + 1 at a = 1."""
    L, C, T0 = 2, 32, 13
    for s in (0, 4, 12):
        assert prefill_flops(L, C, s) + prefill_flops(L, C, T0 - s, s) == prefill_flops(L, C, T0)
        assert prefix_saving(L, C, T0, s) == prefill_flops(L, C, s)
    assert tokens_per_pass(0.0, 4) == 1 and tokens_per_pass(1.0, 4) == 5
    assert tokens_per_pass(0.5, 2) == 1.75 and speculative_speedup(0.5, 2, 0.0) == 1.75
