"""Serving on split models under real MPI (docs/serving.md): chunked prefill, prefix caching
and speculative decoding on tp 2 and pp 2 give the tokens of the serial plain
decoder (logits to 1e-12 of the serial model's uncached forward); prefill/decode
disaggregation between groups of other tp and pp sizes gives generate's tokens, and sends
exactly 2 L T0 C w bytes of KV cache per request (the ledger's send@kv).

One launch of 3 ranks: two of them decode on tp 2 and pp 2, then the three disaggregate
(tp 2 prefilling for one rank, one rank for tp 2, pp 2 for one rank) and run the command.
"""

import json
import os
import shutil
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from io import StringIO

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import Mismatches, collective

from refmp.checkpoint.weights import save_model
from refmp.cli.main import main
from refmp.cost.serving import kv_transfer_bytes
from refmp.distributed.grid import ProcessGrid
from refmp.inference.decoder import Decoder
from refmp.inference.disaggregate import disaggregated
from refmp.inference.generate import generate
from refmp.inference.sampling import Sampler
from refmp.inference.scheduler import Request, serve
from refmp.inference.serving import serve_chunked
from refmp.inference.speculative import DraftModel, PromptLookup, speculate
from refmp.nn.gpt import GPT, GPTConfig

pytestmark = pytest.mark.mpi

V = 19
HEAD = [1, 2, 3, 4, 5, 6, 7, 8, 9]
SHARED = [Request(HEAD + [1, 2], 4, 0), Request(HEAD + [3], 3, 1), Request([5, 5], 3, 2),
          Request(HEAD[:8], 2, 3)]
SAMPLED = Sampler(temperature=0.8, top_k=8, seed=3)
PROMPTS = np.random.default_rng(1).integers(0, V, (3, 6))


def same(a, b, what: str) -> None:
    assert a == b, f"{what}: {a} != {b}"


def model(seed: int = 5, n_layer: int = 2, C: int = 32, n_head: int = 4) -> GPT:
    return GPT.create(GPTConfig(vocab_size=V, block_size=32, n_layer=n_layer, n_head=n_head,
                                n_embd=C), seed, "float64")


def serving_layout(world, kw: dict, bad: Mismatches) -> None:
    """Chunks of 1, 4, 16 with and without prefix caching, and speculative decoding (greedy
    with prompt lookup, sampled with a draft model) against the serial plain decoder."""
    m = model()
    one = ProcessGrid(MPI.COMM_SELF)
    dec = Decoder(m.cfg, m.params, ProcessGrid(world, **kw))
    ref = serve(Decoder(m.cfg, m.params, one), SHARED, SAMPLED, 2)
    for chunk, prefix in ((1, False), (4, True), (16, True)):
        got = serve_chunked(dec, SHARED, SAMPLED, 2, 4 if prefix else None, chunk, prefix)
        for i, r in enumerate(SHARED):
            bad.check(np.testing.assert_array_equal, got.tokens[i], ref.tokens[i],
                      err_msg=f"{kw} chunk {chunk} prefix {prefix} request {i} tokens")
            if dec.last:
                full, _ = m.forward(got.tokens[i][None, :-1])
                bad.check(np.testing.assert_allclose, got.logits[i],
                          full[0, len(r.prompt) - 1:], rtol=0, atol=1e-12,
                          err_msg=f"{kw} chunk {chunk} request {i} logits")
    greedy = generate(Decoder(m.cfg, m.params, one), PROMPTS, 7, Sampler()).tokens
    small = model(9, n_layer=1, C=16, n_head=2)
    prompts = [list(p) for p in PROMPTS]
    got = speculate(dec, prompts, 7, Sampler(), PromptLookup(V), 3, 3)  # paged
    bad.check(np.testing.assert_array_equal, np.stack(got.tokens), greedy,
              err_msg=f"{kw} speculative greedy, prompt lookup")
    draft = DraftModel(Decoder(small.cfg, small.params, one))
    sampled = speculate(dec, prompts, 7, SAMPLED, draft, 3)
    serial = speculate(Decoder(m.cfg, m.params, one), prompts, 7, SAMPLED, draft, 3)
    bad.check(np.testing.assert_array_equal, np.stack(sampled.tokens), np.stack(serial.tokens),
              err_msg=f"{kw} speculative sampled, a draft model")
    if dec.last:
        full, _ = m.forward(np.stack(sampled.tokens)[:, :-1])
        bad.check(np.testing.assert_allclose, np.stack(sampled.logits), full[:, 5:], rtol=0,
                  atol=1e-12, err_msg=f"{kw} speculative logits")


def disaggregation(world, prefill: dict, decode: dict, bad: Mismatches) -> None:
    """Tokens of generate on one rank; the KV bytes sent, summed over the world."""
    m = model()
    want = generate(Decoder(m.cfg, m.params, ProcessGrid(MPI.COMM_SELF)), PROMPTS, 6,
                    SAMPLED).tokens
    got = disaggregated(world, prefill, decode, m.cfg, m.params, PROMPTS, 6, SAMPLED, block=4)
    sent = world.allreduce(got.kv_bytes_sent)
    B, T0 = PROMPTS.shape
    bad.check(same, sent, B * kv_transfer_bytes(m.cfg.n_layer, T0, m.cfg.n_embd, 8),
              f"disaggregated {prefill} -> {decode}: KV bytes sent")
    if got.tokens is not None:
        bad.check(np.testing.assert_array_equal, got.tokens, want,
                  err_msg=f"disaggregated {prefill} -> {decode} tokens")


def command(world, bad: Mismatches) -> None:
    """``refmp generate --prefill-tp 2`` on the 3 ranks (one decodes): rank 0 prints
    generate's tokens; a world of the wrong size is refused on every rank with exit 2."""
    m = model()
    d = world.bcast(tempfile.mkdtemp(prefix="refmp-serving-") if world.rank == 0 else None)
    if world.rank == 0:
        save_model(os.path.join(d, "m.safetensors"), m.params, m.cfg)
        np.save(os.path.join(d, "p.npy"), PROMPTS)
    world.barrier()
    base = ["generate", "--init", os.path.join(d, "m.safetensors"), "--prompts",
            os.path.join(d, "p.npy"), "--max-new-tokens", "5", "--dtype", "float64", "--json"]
    out, err = StringIO(), StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([*base, "--prefill-tp", "2"])
        refused = main([*base, "--prefill-tp", "2", "--pp", "2"])
    bad.check(same, (code, refused), (0, 2), f"exit statuses, rank {world.rank}: {err.getvalue()}")
    if world.rank == 0:
        want = generate(Decoder(m.cfg, m.params, ProcessGrid(MPI.COMM_SELF)), PROMPTS, 5,
                        Sampler()).tokens[:, 6:]
        lines = out.getvalue().splitlines()
        bad.check(same, json.loads(lines[0])["new_tokens"], want.tolist(), "the command's tokens")
        bad.check(same, err.getvalue().count("error:"), 1, "one message")
    world.barrier()
    if world.rank == 0:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parallel(nprocs=3)
@collective
def test_serving_on_split_models_changes_no_token():
    w = MPI.COMM_WORLD
    bad = Mismatches()
    pair = w.Split(0 if w.rank < 2 else MPI.UNDEFINED, w.rank)
    if w.rank < 2:  # rank 2 goes on to the disaggregation, and waits there
        for kw in (dict(tp=2), dict(pp=2)):
            serving_layout(pair, kw, bad)
    disaggregation(w, dict(tp=2), {}, bad)  # tp 2 -> 1: both halves of the heads
    disaggregation(w, {}, dict(tp=2), bad)  # tp 1 -> 2: a slice to each
    disaggregation(w, dict(pp=2), {}, bad)  # two stages' layers to one rank
    command(w, bad)
    bad.assert_none()
