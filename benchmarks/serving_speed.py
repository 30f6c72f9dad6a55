"""``refmp generate`` against transformers' ``generate`` at GPT-2 small's real shape, on the same
directory and threads (docs/serving.md): batch 1 and 8, a 128-token prompt, 512 new tokens,
greedy, float32, the KV cache on in both.

    python benchmarks/serving_speed.py --model gpt2/ --threads 8 [--rounds 3]
    python benchmarks/serving_speed.py --tiny      # a random small model: the script runs

``--model``: a Hugging Face GPT-2 directory (config.json, model.safetensors; e.g.
``huggingface-cli download gpt2 --local-dir gpt2``). refmp runs as the command, ``refmp generate
--init DIR --prompts P --json``, one process, its threads limited to ``--threads`` through the
environment (OMP, OpenBLAS, MKL); its tokens/s is the command's own (prefill and decoding,
without start-up and reading). transformers runs in this process with
``torch.set_num_threads``, timed around ``generate``. Rounds alternate the two; the medians
are printed as one JSON object, with whether the tokens agree (float32: a nearly tied argmax
may round apart late in a long continuation, so the first position that differs is printed
too). transformers and torch are benchmark-only dependencies; without them only refmp runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np


def refmp_run(init: str, prompts: str, n_new: int, threads: int, out: str) -> float:
    """One ``refmp generate`` run: its new tokens/s (the command's own measure)."""
    env = {**os.environ, **{v: str(threads) for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                                       "MKL_NUM_THREADS")}}
    r = subprocess.run([sys.executable, "-m", "refmp", "generate", "--init", init, "--prompts",
                        prompts, "--max-new-tokens", str(n_new), "--json", "--save-tokens", out],
                       capture_output=True, text=True, env=env, check=False)
    if r.returncode != 0:
        raise SystemExit(r.stderr)
    return json.loads(r.stdout.splitlines()[-1])["tokens_per_s"]


def hf_model(init: str, threads: int):
    """transformers' GPT2LMHeadModel of the directory, float32, or None without transformers."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    torch.set_num_threads(threads)
    return transformers.GPT2LMHeadModel.from_pretrained(init, torch_dtype=torch.float32).eval()


def hf_run(hf, prompts: np.ndarray, n_new: int) -> tuple[float, np.ndarray]:
    import torch

    ids = torch.from_numpy(prompts)
    with torch.no_grad():  # the mask given: else a token 0 counts as padding
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                          min_new_tokens=n_new, do_sample=False, use_cache=True, pad_token_id=0)
        seconds = time.perf_counter() - t0
    return prompts.shape[0] * n_new / seconds, out.numpy()


def tiny_model(folder: str) -> str:
    """A random GPT-2-named file of a small shape (no download): the script's own check."""
    from refmp.checkpoint.weights import save_model
    from refmp.nn.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=64)
    path = os.path.join(folder, "tiny.safetensors")
    save_model(path, GPT.create(cfg, 0, "float32").params, cfg)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a Hugging Face GPT-2 directory")
    ap.add_argument("--tiny", action="store_true", help="a random small model, 16 + 16 tokens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,8")
    args = ap.parse_args()
    if (args.model is None) == (not args.tiny):
        raise SystemExit("give --model DIR or --tiny")
    folder = tempfile.mkdtemp(prefix="refmp-serving-speed-")
    init = tiny_model(folder) if args.tiny else args.model
    T0, n_new = (16, 16) if args.tiny else (128, 512)
    hf = None if args.tiny else hf_model(init, args.threads)
    V = 512 if args.tiny else json.load(open(os.path.join(init, "config.json")))["vocab_size"]
    rows = []
    for B in (int(b) for b in args.batches.split(",")):
        prompts = np.random.default_rng(B).integers(0, V, (B, T0))
        path = os.path.join(folder, f"p{B}.npy")
        np.save(path, prompts)
        ours, theirs = [], []
        toks = os.path.join(folder, f"t{B}.npy")
        hf_tokens = None
        for _ in range(args.rounds):
            ours.append(refmp_run(init, path, n_new, args.threads, toks))
            if hf is not None:
                speed, hf_tokens = hf_run(hf, prompts, n_new)
                theirs.append(speed)
        row = {"batch": B, "prompt": T0, "new": n_new,
               "refmp_tokens_per_s": statistics.median(ours)}
        if hf is not None:
            mine = np.load(toks, allow_pickle=True)
            differ = np.nonzero((mine != hf_tokens).any(axis=0))[0]
            row.update({"transformers_tokens_per_s": statistics.median(theirs),
                        "refmp_over_transformers": statistics.median(ours)
                        / statistics.median(theirs),
                        "first_differing_position": int(differ[0]) if len(differ) else None})
        rows.append(row)
    shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps({"threads": args.threads, "rounds": args.rounds,
                      "model": "tiny" if args.tiny else init, "rows": rows}))


if __name__ == "__main__":
    main()
