"""KV-cached decoding on split models under real MPI: every layout's tokens equal the serial
decoder's, its logits (generate's, paged or not, and continuous batching's) the serial model's
uncached forward's of the same tokens (float64, to 1e-12); the cache's bytes per rank and one
decode step's messages equal their formulas. A Decoder that reads its share from a Source (a
GPT-2 file, a Hugging Face directory in several files, a sharded checkpoint) holds exactly the
serial model's slices, with a traced peak of its share plus one read chunk.

One launch per rank count: the 8 ranks are split into worlds of 1, 2 and 4 ranks (and one of
8), each running its layout; every world rank checks what its own layout held.
"""

import json
import os
import shutil
import tempfile

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import Mismatches, collective
from safetensors.numpy import save_file
from test_init_slices import traced_peak
from test_slice_io import sharded_checkpoint

from refmp.checkpoint.hf import hf_config
from refmp.checkpoint.source import open_source
from refmp.checkpoint.weights import save_model
from refmp.cost.expert import alltoallv_bytes
from refmp.distributed.grid import ProcessGrid
from refmp.inference.cache import cache_bytes
from refmp.inference.decoder import Decoder, decode_step_bytes
from refmp.inference.generate import generate
from refmp.inference.sampling import Sampler
from refmp.inference.scheduler import Request, serve
from refmp.nn.gpt import GPT, GPTConfig
from refmp.nn.moe import MoECache
from refmp.nn.slices import BLOCK_BYTES

pytestmark = pytest.mark.mpi

T0, N, B = 8, 5, 4


def model(n_expert: int = 0) -> GPT:
    cfg = GPTConfig(vocab_size=19, block_size=16, n_layer=2, n_head=4, n_embd=32,
                    n_expert=n_expert, capacity_factor=0.0)  # decoding drops no token
    return GPT.create(cfg, 5, "float64")


PROMPTS = np.random.default_rng(1).integers(0, 19, (B, T0))
SAMPLED = Sampler(temperature=0.9, top_k=6, top_p=0.9, seed=4)


def same(a, b, what: str) -> None:
    assert a == b, f"{what}: {a} != {b}"


def at_most(a, b, what: str) -> None:
    assert a <= b, f"{what}: {a} > {b}"


def serial(m: GPT, sampler: Sampler):
    dec = Decoder(m.cfg, m.params, ProcessGrid(MPI.COMM_SELF))
    return generate(dec, PROMPTS, N, sampler).tokens


def run_layout(world, kw: dict, bad: Mismatches, balance: str = "zigzag", n_expert: int = 0,
               block_size=None) -> None:
    """One layout on ``world``: tokens and logits against serial, bytes against formulas."""
    m = model(n_expert)
    grid = ProcessGrid(world, **kw)
    s, c = grid.sizes, grid.coords
    ids = np.array_split(np.arange(B), s["dp"])[c["dp"]]
    for sampler in (Sampler(), SAMPLED):
        dec = Decoder(m.cfg, m.params, grid, balance)
        res = generate(dec, PROMPTS[ids], N, sampler, ids, block_size=block_size)
        want_bytes = cache_bytes(len(dec.blocks), len(ids),
                                 T0 // s["cp"] + len(range(c["cp"], N - 1, s["cp"])),
                                 m.cfg.n_embd, s["tp"], 8)
        if block_size is None:
            bad.check(same, res.kv_cache_bytes, want_bytes, f"{kw} cache bytes")
        if not dec.last:
            continue
        want = serial(m, sampler)[ids]
        full, _ = m.forward(res.tokens[:, :-1])  # the uncached forward of the same tokens
        bad.check(np.testing.assert_array_equal, res.tokens, want, err_msg=f"{kw} tokens")
        bad.check(np.testing.assert_allclose, res.logits, full[:, T0 - 1:], rtol=0, atol=1e-12,
                  err_msg=f"{kw} logits")


def step_ledger(world, kw: dict, bad: Mismatches, n_expert: int = 0) -> None:
    """One decode step's messages: the ledger of N + 1 tokens minus that of N. With experts,
    the all-to-alls the serial model's routing of the step's tokens implies: per MoE layer,
    E int64 counts and (M + R) C itemsize bytes of rows (alltoallv_bytes' forward half)."""
    m = model(n_expert)
    grid = ProcessGrid(world, **kw)
    s = grid.sizes
    split = np.array_split(np.arange(B), s["dp"])
    ids = split[grid.coords["dp"]]
    got = []
    for n in (N, N + 1):
        grid.ledger.reset()
        dec = Decoder(m.cfg, m.params, grid)
        generate(dec, PROMPTS[ids], n, Sampler(), ids)
        got.append(dict(grid.ledger.entries))
    step = {f"{o}@{a}": got[1][(o, a)][0] - got[0].get((o, a), [0])[0] for (o, a) in got[1]}
    step = {k: v for k, v in step.items() if v}
    want = decode_step_bytes(len(ids), m.cfg.n_embd, m.cfg.vocab_size, m.cfg.n_head,
                             len(dec.blocks), dec.first, dec.last, s["tp"], s["cp"], s["pp"], 8)
    if n_expert and s["ep"] > 1:  # the step's input: every request's token at T0 + N - 1
        x = generate(Decoder(m.cfg, m.params, ProcessGrid(MPI.COMM_SELF)), PROMPTS, N + 1,
                     Sampler()).tokens[:, : T0 + N]
        _, cache = m.forward(x, np.zeros_like(x))
        owner = np.repeat([d for d, rows in enumerate(split) for _ in rows], x.shape[1])
        f = grid.coords["dp"] * s["cp"] + grid.coords["cp"]  # my index in dp x cp
        moe = [c.mlp for i, c in enumerate(cache[1])
               if i in dec.blocks and isinstance(c.mlp, MoECache)]
        rows = 0
        for c in moe:
            tok = c.order // m.cfg.top_k
            last = tok % x.shape[1] == x.shape[1] - 1  # the step's token of each request
            expert = c.top.reshape(-1)[c.order]
            rows += alltoallv_bytes(owner[tok][last], expert[last], f, s["ep"], n_expert,
                                    m.cfg.n_embd, 8) // 2
        want.update({"alltoall@ep": len(moe) * n_expert * 8, "alltoallv@ep": rows})
    bad.check(same, step, want, f"{kw} ledger of a decode step")


REQUESTS = [Request([1, 2, 3], 5, 0), Request([4, 5, 6, 7, 8], 2, 0), Request([9], 6, 1),
            Request([3, 3, 2, 1], 4, 2), Request([7, 7], 3, 2), Request([11] * 6, 1, 5)]


def serve_layout(world, kw: dict, bad: Mismatches, slots: int = 4, block_size=None) -> None:
    """Continuous batching with one group in flight per stage: each request's logits those
    of the serial model's uncached forward of its tokens (to 1e-12); its tokens and logits
    bitwise those of the same request served alone on this layout, and (to 1e-12; bitwise
    without tp) those of the serial model serving it alone."""
    m = model()
    grid = ProcessGrid(world, **kw)
    dec = Decoder(m.cfg, m.params, grid)
    both = serve(dec, REQUESTS, SAMPLED, slots, block_size)
    one = Decoder(m.cfg, m.params, ProcessGrid(MPI.COMM_SELF))
    for i, r in enumerate(REQUESTS):
        alone = serve(dec, [r._replace(arrival=0)], SAMPLED, slots, block_size, ids=[i])
        if not dec.last:
            continue
        full, _ = m.forward(both.tokens[i][None, :-1])  # uncached: every position again
        bad.check(np.testing.assert_allclose, both.logits[i], full[0, len(r.prompt) - 1:],
                  rtol=0, atol=1e-12, err_msg=f"{kw} request {i} logits against the forward")
        ref = serve(one, [r._replace(arrival=0)], SAMPLED, slots, ids=[i])
        bad.check(np.testing.assert_array_equal, both.tokens[i], alone.tokens[0],
                  err_msg=f"{kw} request {i} tokens")
        bad.check(np.testing.assert_array_equal, both.logits[i], alone.logits[0],
                  err_msg=f"{kw} request {i} logits")
        bad.check(np.testing.assert_array_equal, both.tokens[i], ref.tokens[0],
                  err_msg=f"{kw} request {i} tokens against serial")
        bad.check(np.testing.assert_allclose, both.logits[i], ref.logits[0], rtol=0,
                  atol=0 if grid.sizes["tp"] == 1 else 1e-12, err_msg=f"{kw} request {i}")


# layouts on worlds of 4 ranks (run twice over: the 8 ranks in two halves), then 2 and 1
FOUR = [dict(tp=2, pp=2), dict(pp=2, cp=2), dict(cp=4), dict(dp=2, cp=2), dict(tp=4),
        dict(dp=4), dict(pp=2, dp=2), dict(dp=2, tp=2)]


@pytest.mark.parallel(nprocs=8)
@collective
def test_every_layout_decodes_like_the_serial_model():
    w = MPI.COMM_WORLD
    bad = Mismatches()
    quarter = w.Split(w.rank // 4, w.rank)
    for kw in FOUR[w.rank // 4 :: 2]:
        run_layout(quarter, kw, bad)
    run_layout(quarter, dict(cp=2, tp=2) if w.rank < 4 else dict(cp=2, dp=2), bad,
               balance="contiguous")
    run_layout(quarter, dict(ep=2), bad, n_expert=4)  # dp 4 x ep 2: experts by all-to-all
    run_layout(quarter, dict(pp=2, dp=2, ep=2) if w.rank < 4 else dict(cp=2, ep=2), bad,
               n_expert=4)
    run_layout(quarter, dict(tp=2, pp=2), bad, block_size=3)  # paged
    serve_layout(quarter, dict(pp=2, tp=2) if w.rank < 4 else dict(pp=2, dp=2), bad)
    step_ledger(quarter, dict(ep=2) if w.rank < 4 else dict(pp=2, dp=2, ep=2), bad, n_expert=4)
    pair = w.Split(w.rank // 2, w.rank)
    run_layout(pair, [dict(tp=2), dict(pp=2), dict(cp=2), dict(dp=2)][w.rank // 2], bad)
    serve_layout(pair, dict(pp=2), bad, slots=3, block_size=2)  # paged
    run_layout(MPI.COMM_WORLD, dict(pp=2, cp=2, tp=2), bad)
    run_layout(MPI.COMM_WORLD, dict(pp=2, dp=2, cp=2, ep=4), bad, n_expert=4)
    for kw in (dict(pp=2, cp=2, tp=2), dict(dp=2, pp=2, tp=2)):
        step_ledger(MPI.COMM_WORLD, kw, bad)
    bad.assert_none()


READ = GPTConfig(vocab_size=63, block_size=16, n_layer=4, n_head=4, n_embd=64)  # 1.6 MB


def write_sources(world) -> tuple[str, GPT]:
    """(a folder, the model) holding READ's model as a GPT-2 file, a Hugging Face directory
    in two files behind model.safetensors.index.json, and a sharded checkpoint whose pieces
    line up with no layout; written by world rank 0, the folder bcast."""
    m = GPT.create(READ, 2, "float32")
    d = tempfile.mkdtemp(prefix="refmp-read-") if world.rank == 0 else None
    d = world.bcast(d, root=0)
    if world.rank == 0:
        save_model(os.path.join(d, "m.safetensors"), m.params, READ)
        os.makedirs(os.path.join(d, "hf"))
        names = sorted(m.params)
        halves = {"model-00001-of-00002.safetensors": names[::2],
                  "model-00002-of-00002.safetensors": names[1::2]}
        for fname, ks in halves.items():
            save_file({"transformer." + k: m.params[k] for k in ks},
                      os.path.join(d, "hf", fname), metadata={"format": "pt"})
        with open(os.path.join(d, "hf", "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": {"transformer." + k: fname for fname, ks
                                                      in halves.items() for k in ks}}, f)
        with open(os.path.join(d, "hf", "config.json"), "w") as f:
            json.dump(hf_config(READ, "float32"), f)
        sharded_checkpoint(os.path.join(d, "ck"), m.params, READ)
    world.barrier()
    return d, m


def read_layout(world, kw: dict, folder: str, m: GPT, bad: Mismatches) -> None:
    """On each source: the Decoder's shards equal those it cuts from the whole model (the
    serial slices, placement.shards_held), bitwise; its traced peak while reading is its
    share plus one chunk and some bookkeeping: from a file at most the largest tensor (each
    is under BLOCK_BYTES here, so read in one chunk), from a checkpoint two BLOCK_BYTES (the
    file's hash, read in chunks, and one span of its values)."""
    grid = ProcessGrid(world, **kw)
    want = Decoder(READ, m.params, grid).params
    largest = max(v.nbytes for v in m.params.values())
    whole = sum(v.nbytes for v in m.params.values())
    for kind in ("m.safetensors", "hf", "ck"):
        src = open_source(os.path.join(folder, kind))
        dec, peak = traced_peak(lambda src=src: Decoder(READ, src, grid, dtype="float32"))
        bad.check(same, list(dec.params), list(want), f"{kw} {kind}: the names held")
        for k, v in want.items():
            bad.check(np.testing.assert_array_equal, dec.params[k], v, err_msg=f"{kw} {kind} {k}")
        share = sum(v.nbytes for v in dec.params.values())
        chunk = 2 * BLOCK_BYTES if kind == "ck" else largest  # ck: a hash chunk, a span
        bad.check(at_most, peak, share + chunk + 65536, f"{kw} {kind}: the read's peak "
                  f"past its share {share} + one chunk {chunk}")
    if kw == dict(tp=2, pp=2):  # the bound says something: well under the whole model
        bad.check(at_most, share + largest + 65536, whole // 2, "the bound is not below half "
                  "the model")


@pytest.mark.parallel(nprocs=8)
@collective
def test_generate_reads_only_its_share_from_a_file_a_directory_and_a_checkpoint():
    w = MPI.COMM_WORLD
    bad = Mismatches()
    folder, m = write_sources(w)
    quarter = w.Split(w.rank // 4, w.rank)
    read_layout(quarter, dict(tp=2, pp=2) if w.rank < 4 else dict(pp=2, cp=2), folder, m, bad)
    pair = w.Split(w.rank // 2, w.rank)
    read_layout(pair, [dict(tp=2), dict(pp=2), dict(cp=2), dict(dp=2)][w.rank // 2],
                folder, m, bad)
    w.barrier()
    if w.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    bad.assert_none()
