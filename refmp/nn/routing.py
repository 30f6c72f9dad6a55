"""What a step reports of its MoE layers' routing: tokens per expert, the fraction dropped at
capacity, and the auxiliary and z losses (refmp.nn.moe computes them; this only adds them up).

Shapes: E experts. Each MoE layer's forward leaves in its cache ``stats["raw"]``, the array
[assigned (E), kept (E), aux, z] of the tokens it saw; a rank adds these up over a step's
forwards (:class:`MoEFigures`), the engine sums them over the ranks that saw other tokens,
and :func:`moe_summary` turns the sums into the logged figures.
"""

from __future__ import annotations


def routing_summary(raw, E: int) -> dict:
    """Logged figures from [assigned (E), kept (E), aux, z] (one rank's, or summed)."""
    return {"tokens_per_expert": [int(v) for v in raw[E:2 * E]],
            "dropped": float(1.0 - raw[E:2 * E].sum() / max(1.0, raw[:E].sum())),
            "aux_loss": float(raw[-2]), "z_loss": float(raw[-1]), "raw": raw}


def moe_summary(raws: list, E: int | None = None) -> dict:
    """{"moe": per-layer tokens per expert and dropped fraction, summed aux and z losses}
    from each MoE layer's [assigned (E), kept (E), aux, z]."""
    if not raws:
        return {}
    E = (len(raws[0]) - 2) // 2 if E is None else E
    layers = [routing_summary(r, E) for r in raws]
    return {"moe": {"tokens_per_expert": [s["tokens_per_expert"] for s in layers],
                    "dropped": [s["dropped"] for s in layers],
                    "aux_loss": sum(s["aux_loss"] for s in layers),
                    "z_loss": sum(s["z_loss"] for s in layers)}}


def forward_summary(cache) -> dict:
    """The MoE layers' figures of one refmp.nn.gpt.GPT forward (empty for a dense model)."""
    return moe_summary([c.mlp.stats["raw"] for c in cache[1] if hasattr(c.mlp, "stats")])  # MoECaches


class MoEFigures:
    """The MoE layers' losses and routing figures of a step's forwards on one rank: ``aux``
    this rank's share of the auxiliary losses, ``raw`` block -> summed [assigned, kept, aux,
    z] (:func:`moe_summary`'s input)."""

    def __init__(self):
        self.aux = 0.0
        self.raw: dict[int, object] = {}

    def add(self, i: int, loss: float, raw) -> None:
        self.aux += loss
        self.raw[i] = raw if i not in self.raw else self.raw[i] + raw

    def merge(self, other: MoEFigures) -> None:
        """Add another step's figures (forwards that ran ahead, in an earlier step)."""
        self.aux += other.aux
        for i, raw in other.raw.items():
            self.raw[i] = raw if i not in self.raw else self.raw[i] + raw
