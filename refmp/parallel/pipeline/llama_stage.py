"""The chunks of a Llama model (refmp.nn.llama) one pipeline rank holds, for the flush
executor (refmp.parallel.pipeline.executor.Executor): every flush schedule of the catalog
(naive, GPipe, 1F1B, interleaved, ZB-H1, ZB-V, DualPipeV) runs it unchanged.

Shapes: b rows of one micro-batch, T tokens of a sequence this rank holds (T/cp under
context parallelism), C channels, L layers, S = pp v chunks.

A chunk is L/S consecutive blocks; chunk 0 also embeds the tokens (``wte``), the last chunk
also applies ``ln_f``, the head and the loss. With an untied head (Llama's usual
``tie_word_embeddings: false``) the last stage owns ``lm_head.weight`` and the first owns
``wte.weight``: no parameter lives on two stages and no embedding gradient crosses the
pipeline (GPT-2's tied head needs the first and last stages to sum wte's gradient). A tied
head is run when one rank holds both ends (pp = 1, or a V placement, where chunk 0 and the
last chunk are both on rank 0), and refused otherwise.

The executor's interface: ``n_chunks``, ``act_shape``, ``forward``, ``backward``, ``weight``.
A zero-bubble schedule's W action finds nothing to do: this stage computes each block's
weight gradients in its B (the numbers are the same; only the timeline differs).
"""

from __future__ import annotations

from refmp.errors import ConfigError
from refmp.nn import layers as L
from refmp.nn import llama as LM
from refmp.nn import llama_layers as LL
from refmp.nn.params import block_params
from refmp.runtime import backend


def chunk_blocks(cfg: LM.LlamaConfig, n_chunks: int, chunks: list[int]) -> dict[int, range]:
    """Chunk id -> its blocks, for this rank's ``chunks`` (L/S consecutive blocks each)."""
    if cfg.n_layer % n_chunks:
        raise ConfigError(f"{n_chunks} pipeline chunks must divide the {cfg.n_layer} layers")
    per = cfg.n_layer // n_chunks
    return {c: range(c * per, (c + 1) * per) for c in chunks}


def held_names(cfg: LM.LlamaConfig, blocks: dict[int, range], n_chunks: int) -> list[str]:
    """The parameters a rank running chunks ``blocks`` holds, in the model's order."""
    first, last = 0 in blocks, n_chunks - 1 in blocks
    if cfg.tied and first != last:
        raise ConfigError("a tied head under pp puts wte on the first and the last stage; the "
                          "Llama stage runs an untied head (tie_word_embeddings false), or a "
                          "tied one with both ends on one rank (pp 1, or a V schedule)")
    mine = {i for r in blocks.values() for i in r}
    out = []
    for name in LM.param_shapes(cfg):
        top = name.split(".")
        if top[0] == "h":
            held = int(top[1]) in mine
        elif top[0] == "wte":
            held = first or (last and cfg.tied)
        else:  # ln_f, lm_head
            held = last
        if held:
            out.append(name)
    return out


class LlamaStage:
    """This rank's chunks (chunk id -> blocks), the layout's Ops (refmp.nn.llama.Ops: serial,
    tp's, around cp's attention core), its parameters (held_names, its tp shards) and their
    gradients, accumulated over the step's micro-batches."""

    def __init__(self, cfg: LM.LlamaConfig, chunks: dict[int, range], n_chunks: int,
                 ops: LM.Ops, params: dict):
        self.cfg = cfg
        self.chunks = chunks
        self.n_chunks = n_chunks
        self.ops = ops
        self.params = params
        self.grads = {k: None for k in params}

    def zero_grad(self) -> None:
        self.grads = {k: None for k in self.params}

    def act_shape(self, b: int, T: int) -> tuple[int, int, int]:
        return (b, T, self.cfg.n_embd)  # what crosses a stage boundary

    def tables(self, T: int):
        """The rotary tables (T, HS) of this rank's tokens (their global positions)."""
        xp = backend.array_module(next(iter(self.params.values())))
        positions = xp.arange(T) if self.ops.positions is None else self.ops.positions
        dtype = next(iter(self.params.values())).dtype
        return LL.rope_tables(positions, self.cfg.head_size, self.cfg.rope_theta, dtype)

    def forward(self, c: int, inp, targets=None, denom=None):
        """Chunk c on one micro-batch: ``inp`` is token ids (chunk 0) or the previous chunk's
        output. Returns the output, or on the last chunk the loss share, and the cache."""
        cos, sin = self.tables(inp.shape[1])
        x, emb, head, blocks = inp, None, None, []
        if c == 0:
            x, emb = L.embedding_forward(inp, self.params["wte.weight"])  # (b, T, C)
        for i in self.chunks[c]:
            x, bc = LM.block_forward(block_params(self.params, i), x, self.cfg, cos, sin, self.ops)
            blocks.append(bc)
        if c == self.n_chunks - 1:
            x, head = LM.head_forward(self.params, x, self.cfg, targets, denom)
        return x, (emb, blocks, head)

    def backward(self, c: int, dout, cache, split: bool, final: bool):
        """Chunk c's backward; returns (the input's gradient, or None on chunk 0; nothing
        left for a W action)."""
        emb, blocks, head = cache
        dx = dout
        if head is not None:
            dx, g = LM.head_backward(1.0, head, self.cfg)
            self.accumulate(g)
        for i, bc in zip(reversed(self.chunks[c]), reversed(blocks), strict=True):
            dx, g = LM.block_backward(dx, bc, self.ops)
            self.accumulate(g, prefix=f"h.{i}.")
        if emb is None:
            return dx, []
        self.accumulate({"wte.weight": L.embedding_backward(dx, emb)})
        return None, []

    def weight(self, todo, final: bool) -> None:
        """A zero-bubble W: every weight gradient was taken in B."""

    def accumulate(self, g: dict, prefix: str = "") -> None:
        for k, v in g.items():
            name = prefix + k
            self.grads[name] = v if self.grads[name] is None else self.grads[name] + v
