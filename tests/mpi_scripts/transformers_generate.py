"""transformers' side of tests/test_llama_parallel.py's decoding test, in a process of its
own (importing torch takes longer than the watchdog lets a rank go without a call, so the
ranks wait on this process by polling collectively):

    python transformers_generate.py FOLDER PROMPTS.npy N OUT.npy

writes a toy LlamaForCausalLM made by transformers in float64 (its RMSNorm and rotary tables
too: tests/test_llama_hf.py's in_float64; one key/value head) to FOLDER, and its generate's
greedy tokens (B, T0 + N) of the prompts to OUT.npy.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from test_llama_hf import hf_model, in_float64, torch  # noqa: E402  (tests/ on the path first)


def main(folder: str, prompts: str, n: int, out: str) -> None:
    with pytest.MonkeyPatch.context() as mp:
        in_float64(mp)
        hf = hf_model(n_kv_head=1, seed=7)
        hf.save_pretrained(folder)
        ids = torch.tensor(np.load(prompts))
        want = hf.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
    np.save(out, want.numpy())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
