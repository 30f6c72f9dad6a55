"""The Llama family's configuration, parameter names and shapes, and its initialization
(refmp.nn.llama re-exports them).

Shapes: C channels (n_embd), V vocabulary, L layers, NH query heads, NKV key/value heads,
HS head size (C/NH), F the MLP's width (n_inner), E experts.

Initialization is refmp.nn.params.init_slice's (seed, name, element) draw, which for these
names is Hugging Face's: N(0, 0.02) for every matrix, 1 for the RMSNorm weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from refmp.errors import ConfigError
from refmp.nn import moe as M
from refmp.nn import swiglu_experts
from refmp.nn.experts import LocalExperts
from refmp.nn.params import init_slice
from refmp.runtime import backend


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    block_size: int = 64  # max_position_embeddings
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2  # num_key_value_heads; n_head for plain multi-head attention
    n_embd: int = 64
    n_inner: int = 172  # intermediate_size
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    tied: bool = False  # tie_word_embeddings: logits = h wte^T
    n_expert: int = 0  # num_local_experts: a Mixtral-style MoE MLP in every block; 0: dense
    top_k: int = 2  # num_experts_per_tok

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    def check(self) -> None:
        """Refuse shapes that cannot make the model (a ConfigError with the reason)."""
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd",
                     "n_inner"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd ({self.n_embd}) must be divisible by n_head "
                              f"({self.n_head})")
        if self.head_size % 2:
            raise ConfigError(f"the head size ({self.head_size}) must be even: rotary "
                              f"embeddings rotate its two halves")
        if self.n_head % self.n_kv_head:
            raise ConfigError(f"n_kv_head ({self.n_kv_head}) must divide n_head "
                              f"({self.n_head})")
        if self.rope_theta <= 0 or self.rms_eps <= 0:
            raise ConfigError("rope_theta and rms_eps must be positive")
        if self.n_expert and not 1 <= self.top_k <= self.n_expert:
            raise ConfigError(f"top_k ({self.top_k}) must be between 1 and n_expert "
                              f"({self.n_expert})")

    @property
    def capacity_factor(self) -> float:
        """Mixtral routes every token to its top-k experts: no capacity limit (0, as
        GPTConfig.capacity_factor says it)."""
        return 0.0

    def is_moe(self, i: int) -> bool:
        """Is block i's MLP a mixture of experts? Every block's, with ``n_expert``."""
        return self.n_expert > 0

    def moe_context(self, denom=None, dispatch=None, seq=None) -> M.MoEContext | None:
        """Mixtral's MoE layer for one forward (None: dense): refmp.nn.moe's router, top-k
        and renormalized gates on SwiGLU experts, no capacity limit, no auxiliary losses
        (Mixtral's forward without output_router_logits). ``dispatch``: where the experts
        run (default all here; expert parallelism's all-to-all); ``seq``: the ranks a
        sequence is split over (refmp.parallel.expert.SequenceSplit), or None."""
        if not self.n_expert:
            return None
        return M.MoEContext(self.n_expert, self.top_k, 0.0, 0.0, 0.0, denom, seq=seq,
                            dispatch=LocalExperts(swiglu_experts) if dispatch is None else dispatch)


def block_param_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one block's parameters, by their name inside the block."""
    C, F, kv = cfg.n_embd, cfg.n_inner, cfg.n_kv_head * cfg.head_size
    mlp = {"mlp.gate_proj.weight": (C, F), "mlp.up_proj.weight": (C, F),
           "mlp.down_proj.weight": (F, C)}
    if cfg.n_expert:
        mlp = {"mlp.router.weight": (C, cfg.n_expert)}
        for e in range(cfg.n_expert):
            mlp.update({f"mlp.experts.{e}.gate_proj.weight": (C, F),
                        f"mlp.experts.{e}.up_proj.weight": (C, F),
                        f"mlp.experts.{e}.down_proj.weight": (F, C)})
    return {
        "ln_1.weight": (C,),
        "attn.q_proj.weight": (C, C),
        "attn.k_proj.weight": (C, kv),
        "attn.v_proj.weight": (C, kv),
        "attn.o_proj.weight": (C, C),
        "ln_2.weight": (C,),
        **mlp,
    }


def param_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's global shape, in the model's order."""
    shapes = {"wte.weight": (cfg.vocab_size, cfg.n_embd)}
    for i in range(cfg.n_layer):
        for name, shape in block_param_shapes(cfg).items():
            shapes[f"h.{i}.{name}"] = shape
    shapes["ln_f.weight"] = (cfg.n_embd,)
    if not cfg.tied:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.n_embd)
    return shapes


def init_params(cfg: LlamaConfig, seed: int, dtype="float32") -> dict:
    """All parameters at full size (init_slice's draw: N(0, 0.02) matrices, unit norms)."""
    return {name: backend.from_host(init_slice(name, shape, cfg, seed, dtype=dtype))
            for name, shape in param_shapes(cfg).items()}
