"""What serving's additions save or cost (docs/serving.md), per request.

Shapes: L layers, C channels, T0 prompt tokens, s prompt tokens a prefix cache matched, g
draft tokens a round, a the acceptance rate, c a draft forward's cost over the target's, w
bytes per element.
"""

from __future__ import annotations


def prefill_flops(L: int, C: int, t: int, n: int = 0) -> int:
    """Forward FLOPs of prefilling t tokens after n cached ones: the linears, 24 C^2 a token
    and layer (qkv 6, projection 2, MLP 16), and attention, each token over the n + i keys
    before it and itself, 4 C a key (q k^T and the sum over v). The head is left out (one
    token's logits either way)."""
    keys = t * n + t * (t + 1) // 2  # sum over the t tokens of the keys each sees
    return L * (24 * C * C * t + 4 * C * keys)


def prefix_saving(L: int, C: int, T0: int, s: int) -> int:
    """FLOPs a prefix-cache hit of s tokens saves on a prompt of T0: the whole prefill minus
    the prefill of the T0 - s tokens after the match."""
    return prefill_flops(L, C, T0) - prefill_flops(L, C, T0 - s, s)


def tokens_per_pass(a: float, g: int) -> float:
    """Expected tokens a speculative round yields per target forward, (1 - a^(g+1)) / (1 - a)
    (Leviathan et al. 2023, eq. 1; g + 1 when every draft is accepted)."""
    return g + 1.0 if a >= 1 else (1 - a ** (g + 1)) / (1 - a)


def speculative_speedup(a: float, g: int, c: float) -> float:
    """Expected speed-up in time per token over plain decoding, when a target forward of g + 1
    tokens costs what one of 1 does (decoding is memory bound) and a draft forward costs c of
    it: tokens_per_pass / (g c + 1) (Leviathan et al. 2023, theorem 3.8)."""
    return tokens_per_pass(a, g) / (g * c + 1)


def kv_transfer_bytes(L: int, T0: int, C: int, w: int) -> int:
    """Bytes of one request's KV cache sent from the prefill group to the decode group: k and
    v of every layer and prompt token, 2 L T0 C w, whatever the two groups' tp and pp."""
    return 2 * L * T0 * C * w
