"""Model FLOPs per step: the work a dense implementation must do (Chowdhery et al. 2022,
appendix B), and what recomputation adds.

6 * N * tokens for the matrix products of N parameters (forward 2, backward 4), where N
leaves out wpe (a lookup, no product) but keeps wte (it is the LM head's matrix; an untied
head keeps lm_head and leaves wte out: refmp.cost.family), plus
12 * L * T * C * tokens for attention's q k^T and att v (refmp computes the full T x T
products, masked, so this is work done, not an upper bound). For a mixture of experts N is
the active parameters: each expert's weights count top_k / n_expert (a token visits top_k
of the n_expert experts), the router counts in full; tokens dropped at capacity are still
counted, so this is the routed model's work, not what a layer with drops did.

Recomputation executes more than the model's FLOPs: the extra forward work is counted apart
(hardware FLOPs, Narayanan et al. 2021, eq. 3); MFU stays model FLOPs over peak.
"""

from __future__ import annotations

import math
from functools import cache

from refmp.cost.family import shapes, tied
from refmp.nn.params import GPTConfig
from refmp.parallel.context.chunks import SequenceChunks


@cache
def active_params(cfg: GPTConfig) -> float:
    """N of the FLOP count: parameters in matrix products per token, wpe left out, each
    expert's counted top_k / n_expert (see the module docstring)."""
    n = 0.0
    for name, shape in shapes(cfg).items():
        if name == "wpe.weight" or (name == "wte.weight" and not tied(cfg)):
            continue  # a lookup, no product (an untied head is lm_head, counted)
        share = cfg.top_k / cfg.n_expert if ".mlp.experts." in name else 1.0
        n += share * math.prod(shape)
    return n


def model_flops_per_step(n_params: float, n_layer: int, T: int, C: int, tokens: int) -> float:
    """6 N tokens + 12 L T C tokens (see the module docstring)."""
    return 6.0 * n_params * tokens + 12.0 * n_layer * T * C * tokens


def recompute_flops_per_step(mode: str, n_block_params: float, n_layer: int, T: int, C: int,
                             tokens: int, rescored: bool = False) -> float:
    """The FLOPs recomputation adds (hardware FLOPs, Narayanan et al. 2021 eq. 3, beyond the
    model's): full runs every block's forward again, 2 N_blocks tokens + 4 L T C tokens;
    selective recomputes the softmax's scores q k^T, 2 L T C tokens, and so does every
    backward of an attention that keeps no scores (``rescored``: refmp.nn.flash's)."""
    again = 2.0 * n_layer * T * C * tokens if rescored or mode == "selective" else 0.0
    if mode == "full":
        return 2.0 * n_block_params * tokens + 4.0 * n_layer * T * C * tokens + again
    return again


def ring_attention_flops(seq: SequenceChunks, r: int, B: int, n_head: int, hs: int) -> int:
    """Attention FLOPs rank r executes in ring attention's forward (a closed form).

    A block of c queries over c keys costs 4 B NH c^2 HS (q k^T and p v, 2 FLOPs per
    multiply-add); diagonal blocks are computed in full, then masked. Contiguous: rank r
    computes r full blocks and its diagonal. Zigzag: its early chunk r sees r earlier chunks,
    its late chunk 2cp-1-r sees 2cp-1-r, plus two diagonals: 2cp+1 blocks on every rank.
    """
    blocks = r + 1 if seq.balance == "contiguous" else 2 * seq.cp + 1
    return blocks * 4 * B * n_head * seq.c ** 2 * hs
