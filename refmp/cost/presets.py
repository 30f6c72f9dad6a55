"""``refmp plan --preset``'s Llama-family and published-run shapes (refmp.cost.family), beside
GPT-2's and GPT-3's (refmp.cost.machines.MODELS).

Each: (n_layer, n_embd, n_head, n_kv_head, ffn, vocab, block_size, swiglu, tied).
Llama 3 (Dubey et al. 2024, Table 3: layers, model dimension, FFN dimension, heads,
key/value heads; vocabulary 128,256; untied): 8B, 70B, 405B, at their 8,192-token context.
Korthikanti et al. 2022 (Table 3): GPT-3-style models, vocabulary 51,200, sequence 2,048.
The Ultra-Scale Playbook's 1.34B, 3.57B and 8.86B: the playbook gives their parameter counts
alone; the shapes below are the Llama 3.2 1B / 3B and Llama 3.1 8B shapes with multi-head
attention and a 131,072 vocabulary, which give exactly those counts (tied, tied, untied),
at the playbook's sequence of 4,096.
"""

from __future__ import annotations

from refmp.cost.family import Family

FAMILY = {
    "llama3-8b": (32, 4096, 32, 8, 14336, 128256, 8192, True, False),
    "llama3-70b": (80, 8192, 64, 8, 28672, 128256, 8192, True, False),
    "llama3-405b": (126, 16384, 128, 8, 53248, 128256, 8192, True, False),
    "gpt-22b": (48, 6144, 64, 64, 4 * 6144, 51200, 2048, False, True),
    "gpt-175b": (96, 12288, 96, 96, 4 * 12288, 51200, 2048, False, True),
    "gpt-530b": (105, 20480, 128, 128, 4 * 20480, 51200, 2048, False, True),
    "gpt-1t": (128, 25600, 160, 160, 4 * 25600, 51200, 2048, False, True),
    "playbook-1.34b": (16, 2048, 32, 32, 8192, 131072, 4096, True, True),
    "playbook-3.57b": (28, 3072, 24, 24, 8192, 131072, 4096, True, True),
    "playbook-8.86b": (32, 4096, 32, 32, 14336, 131072, 4096, True, False),
}


def family(name: str, **over) -> Family:
    """The preset ``name`` as a Family, with ``over`` (its fields) replaced."""
    L, C, NH, KV, F, V, T, swiglu, tied = FAMILY[name]
    shape = dict(n_layer=L, n_embd=C, n_head=NH, n_kv_head=KV, ffn=F, vocab_size=V,
                 block_size=T, swiglu=swiglu, tied=tied)
    return Family(**{**shape, **over})
