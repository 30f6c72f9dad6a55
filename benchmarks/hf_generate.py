"""refmp's KV-cached decoding against Hugging Face transformers' ``generate`` (its cache on),
on the same weights, CPU and threads; and against refmp without the cache.

    python benchmarks/hf_generate.py [--rounds 3] [--threads 1]

The shape of the speed goal (docs/inference.md): 4 layers, C 256, 8 heads, vocabulary 256;
8 prompts of 64 tokens, 64 new, greedy. transformers and torch are benchmark-only
dependencies (``pip install torch transformers``). The script checks that both produce the
same tokens in float64 (in float32 a random model's nearly tied logits may round to another
argmax), then times each in float32 in alternating rounds and prints the medians in new
tokens/s (over the whole call: prefill and decoding).
"""

from __future__ import annotations  # noqa: I001  (refmp before NumPy, below)

import argparse
import json
import statistics
import time

import refmp  # noqa: F401  (first: it sets OpenBLAS's thread spin before NumPy loads)

import numpy as np
import torch
import transformers
from mpi4py import MPI

from refmp.distributed.grid import ProcessGrid
from refmp.inference.decoder import Decoder
from refmp.inference.generate import generate
from refmp.inference.sampling import Sampler
from refmp.nn.gpt import GPT, GPTConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from threadpoolctl import threadpool_limits

    threadpool_limits(args.threads)
    cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=8, n_embd=256)
    model = GPT.create(cfg, 0, "float64")
    B, T0, N = 8, 64, 64
    prompts = np.random.default_rng(0).integers(0, 256, (B, T0))
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_positions=128, n_embd=256, n_layer=4, n_head=8, bos_token_id=None,
        eos_token_id=None)).double().eval()
    state = {f"transformer.{k}": torch.from_numpy(v.copy()) for k, v in model.params.items()}
    hf.load_state_dict({**state, "lm_head.weight": state["transformer.wte.weight"]})  # tied
    grid = ProcessGrid(MPI.COMM_SELF)
    params = model.params

    def ours(use_cache: bool = True):
        return generate(Decoder(cfg, params, grid), prompts, N, Sampler(),
                        use_cache=use_cache).tokens

    def theirs():
        with torch.no_grad():
            ids = torch.from_numpy(prompts)  # the mask: else a token 0 counts as padding
            return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N,
                               do_sample=False, use_cache=True, pad_token_id=0).numpy()

    same = bool((ours() == theirs()).all())  # float64
    params = {k: v.astype(np.float32) for k, v in params.items()}
    hf = hf.float()
    times = {"refmp": [], "hf": [], "refmp_no_cache": []}
    for _ in range(args.rounds):
        for name, fn in (("refmp", ours), ("hf", theirs),
                         ("refmp_no_cache", lambda: ours(False))):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    tok_s = {k: B * N / statistics.median(v) for k, v in times.items()}
    print(json.dumps({"same_tokens_float64": same, "new_tokens_per_s": tok_s,
                      "threads": args.threads, "rounds": args.rounds,
                      "vs_hf": tok_s["refmp"] / tok_s["hf"],
                      "vs_no_cache": tok_s["refmp"] / tok_s["refmp_no_cache"]}))


if __name__ == "__main__":
    main()
