"""What the Engine asks of a model family: one Engine runs GPT-2 or a Llama-family model.

Shapes: C channels, NH query heads, NKV key/value heads, HS head size, F the MLP's width,
V vocabulary; tp, cp group sizes.

The Engine (refmp.parallel.engine) composes the same pieces whatever the model; what differs
is written once per family, here, and the Engine asks it:

    shapes()                  every parameter's global shape, in the model's order
    experts                   the MoE layers' experts (refmp.nn.experts: GPT-2's MLP;
                              refmp.nn.swiglu_experts: Mixtral's SwiGLU), what dispatch runs
    holds / shard_index       which parameters a rank holds, and the Index of its tp shard
                              (an expert's: its etp shard, with folding)
    place(name, sp)           the placement row (refmp.parallel.placement.Place)
    ring / ulysses            cp's attention core for the family's block
    ops(...)                  the block's Ops for a layout (serial, tp, SP), around cp's core
    stage(...)                the pipeline Stage of this rank's chunks
    gather_tp(local, tp)      whole parameters from the tp ranks' shards
    bind(grid)                the groups the family sums over besides the layout's (collective)
    reduce_copies(grads)      the sums those groups need after backward
    tied_ends                 whether a parameter lives on both pipeline ends (GPT-2's tied wte)
    sp_loss_shares            whether, with SP, each tp rank's loss is its tokens' share

``family_of(mcfg)`` picks the family from the shape: a GPTConfig is GPT-2 (the placement table
of refmp.parallel.placement, refmp.parallel.ops, refmp.parallel.pipeline.stage, unchanged),
a LlamaConfig the Llama family (refmp.parallel.tensor.llama's split, the grouped-query cores
of cp, refmp.parallel.pipeline.llama_stage; with ``n_expert``, Mixtral's SwiGLU experts
under GPT-2's expert rows).
"""

from __future__ import annotations

from refmp.errors import ConfigError
from refmp.nn import experts as GPT2_EXPERTS
from refmp.nn import llama as LM
from refmp.nn import llama_layers as LL
from refmp.nn import swiglu_experts
from refmp.nn.families import is_llama
from refmp.nn.params import param_shapes
from refmp.nn.slices import WHOLE, Index
from refmp.parallel import placement as P
from refmp.parallel.context.gqa_ring import GQARingAttention
from refmp.parallel.context.ring import RingAttention
from refmp.parallel.context.ulysses import UlyssesAttention
from refmp.parallel.expert import expert_index, is_expert
from refmp.parallel.ops import MEGATRON, make_ops
from refmp.parallel.pipeline.llama_stage import LlamaStage
from refmp.parallel.pipeline.stage import Stage
from refmp.parallel.tensor import llama as TPL
from refmp.parallel.tensor import sequence
from refmp.runtime import backend


def family_of(mcfg, folded: bool = False):
    """The family of the model shape ``mcfg``: Llama's for a LlamaConfig, else GPT-2's
    (``folded``: its experts on a grid of their own, --etp; refmp.parallel.folding)."""
    return LlamaFamily(mcfg) if is_llama(mcfg) else GPT2Family(mcfg, folded)


class GPT2Family:
    """GPT-2: refmp.parallel.placement's table, refmp.parallel.ops, the Stage."""

    tied_ends = True  # wte embeds on the first stage and is the head on the last
    experts = GPT2_EXPERTS  # an MoE layer's experts: GPT-2's MLP each
    sp_loss_shares = False  # with SP the vocabulary-parallel head's loss is whole per tp rank

    def __init__(self, cfg, folded: bool = False):
        self.cfg = cfg
        self.folded = folded  # MoE parallel folding: the experts' rows are their grid's

    def shapes(self) -> dict:
        return param_shapes(self.cfg)

    def held_shards(self, source, chunks: dict, first: bool, last: bool, grid,
                    dtype) -> P.ShardReader:
        return P.held_shards(self.cfg, source, chunks, first, last, grid, dtype)

    def shard_index(self, name: str, shape, rank: int, tp: int, etp_rank: int = 0,
                    etp: int = 1) -> Index:
        return P.shard_index(name, shape, rank, tp, etp_rank, etp)

    def place(self, name: str, sp: bool) -> P.Place:
        return P.place(name, sp, self.folded)

    def ring(self, comm, chunks):
        return RingAttention(comm, chunks)

    def ulysses(self, comm, chunks, keep_scores: bool):
        return UlyssesAttention(comm, chunks, keep_scores)

    def ops(self, tp, sp: bool, attn, positions, keep_scores: bool):
        layers = sequence.LAYERS if sp else MEGATRON  # SP: tp's layers split along T
        return make_ops(self.cfg.n_head, self.cfg.vocab_size, tp, layers, attn, positions,
                        keep_scores)

    def stage(self, chunks, n_chunks, ops, sharder, moe, sequence_shards, recompute):
        return Stage(chunks, n_chunks, self.cfg, ops, sharder, moe, sequence_shards, recompute)

    def gather_tp(self, local: dict, tp) -> dict:
        return P.gather_tp(local, tp, self.cfg.vocab_size)

    def bind(self, grid) -> dict:
        """No groups of its own; the coordinates clipping reads (none besides the grid's)."""
        return {}

    def reduce_copies(self, grads: dict) -> None:
        """Nothing: every copy GPT-2 keeps is summed by the layout's own sums."""


class LlamaFamily:
    """The Llama family (refmp.nn.llama): q, k, v, gate and up column-parallel, o and down
    row-parallel, RMSNorms, the embedding and an untied head replicated over tp
    (refmp.parallel.tensor.llama); the key/value heads replicated on tp/NKV ranks when
    tp > NKV, their gradients summed over those copies (the ``tp-kv`` group, coordinate
    ``kv`` for clipping); wte on the first stage, ln_f and lm_head on the last.

    A Mixtral-style model (``n_expert``) keeps GPT-2's expert rows (placement's table):
    whole SwiGLU experts split over ep (each rank its ep rank's, placement.expert_owner),
    replicated over tp, summed over edp (+ tp with SP), a unit ``h.{i}.experts`` per block;
    its router replicated like the RMSNorms."""

    experts = swiglu_experts  # an MoE layer's experts: the Llama MLP each

    def __init__(self, cfg: LM.LlamaConfig):
        self.cfg = cfg
        self.kv = None  # the tp ranks holding this rank's key/value heads (bind)
        self.tied_ends = False  # a tied head is refused where the ends are on two ranks
        self.sp_loss_shares = True  # with SP each tp rank's loss is its T/tp tokens' share

    def shapes(self) -> dict:
        return LM.param_shapes(self.cfg)

    def holds(self, name: str, blocks, first: bool, last: bool, ep_rank: int = 0,
              ep: int = 1) -> bool:
        """Its chunks' blocks (of an MoE block's experts, only those of ``ep_rank``); wte on
        the first stage (and the last when tied); ln_f and lm_head on the last."""
        top = name.split(".")
        if top[0] == "h" and is_expert(name):
            owner = P.expert_owner(expert_index(name), self.cfg.n_expert, ep)
            return int(top[1]) in blocks and owner == ep_rank
        if top[0] == "h":
            return int(top[1]) in blocks
        if top[0] == "wte":
            return first or (last and self.cfg.tied)
        return last

    def held_shards(self, source, chunks: dict, first: bool, last: bool, grid,
                    dtype) -> P.ShardReader:
        blocks = {i for c in chunks.values() for i in c}
        shapes = self.shapes()
        tp, ep = grid.comm["tp"], grid.comm["ep"]
        indices = {k: self.shard_index(k, s, tp.rank, tp.size) for k, s in shapes.items()
                   if self.holds(k, blocks, first, last, ep.rank, ep.size)}
        return P.ShardReader(source, shapes, indices, dtype)

    def shard_index(self, name: str, shape, rank: int, tp: int, etp_rank: int = 0,
                    etp: int = 1) -> Index:
        """refmp.parallel.tensor.llama.shard's piece as an Index (columns or rows); an
        expert whole (replicated over tp, as GPT-2's)."""
        inner = P.local_name(name)
        if tp == 1 or not name.startswith("h.") or is_expert(name):
            return WHOLE
        if inner in TPL.KV:
            hs = self.cfg.head_size
            held = TPL.kv_heads(self.cfg, rank, tp)
            return Index((None, ((held.start * hs, held.stop * hs),)))
        if inner in TPL.COLUMN:
            n = shape[1] // tp
            return Index((None, ((rank * n, (rank + 1) * n),)))
        if inner in TPL.ROW:
            n = shape[0] // tp
            return Index((((rank * n, (rank + 1) * n),),))
        return WHOLE

    def place(self, name: str, sp: bool) -> P.Place:
        """The row: split over tp (copies over dp, cp, and the kv group for a replicated
        key/value head), an expert's GPT-2's (split over ep, summed over edp, + tp with
        SP), or replicated (partial over tp with SP)."""
        inner = P.local_name(name)
        if is_expert(name):
            return P.place(name, sp)  # placement's experts.{e}.* row
        if name.startswith("h.") and inner in TPL.COLUMN + TPL.ROW:
            dim = 1 if inner in TPL.COLUMN else 0
            copies = ("dp", "cp", "kv") if inner in TPL.KV else ("dp", "cp")
            return P.Place((dim, None), None, ("dp", "cp"), copies)
        return P.Place(None, None, ("dp", "cp", *(("tp",) if sp else ())), ("dp", "cp", "tp"))

    def ring(self, comm, chunks):
        return GQARingAttention(comm, chunks)  # K/V blocks travel with NKV heads

    def ulysses(self, comm, chunks, keep_scores: bool):
        return LL.RepeatedCore(UlyssesAttention(comm, chunks, keep_scores))  # on NH heads

    def ops(self, tp, sp: bool, attn, positions, keep_scores: bool):
        core = LL.SerialCore(keep_scores) if attn is None else attn
        if tp.size > 1:
            return (TPL.SequenceOps if sp else TPL.TensorOps)(self.cfg, tp, core, positions)
        return LM.Ops(self.cfg.n_head, self.cfg.n_kv_head, core, positions)

    def stage(self, chunks, n_chunks, ops, sharder, moe, sequence_shards, recompute):
        return LlamaStage(self.cfg, chunks, n_chunks, ops, sharder, recompute, moe)

    def gather_tp(self, local: dict, tp) -> dict:
        """Every parameter whole on every tp rank: the split ones all-gathered and glued
        (refmp.parallel.tensor.llama.unshard: a replicated key/value head taken once)."""
        if tp.size == 1:
            return dict(local)
        xp = backend.xp
        out = {}
        for k, v in local.items():
            split = self.place(k, False).tp_split
            if split is None:
                out[k] = v
                continue
            moved = xp.ascontiguousarray(xp.moveaxis(v, split[0], 0))  # split axis first
            got = tp.allgather(moved).reshape((tp.size,) + moved.shape)  # in rank order
            out[k] = TPL.unshard(k, [xp.moveaxis(a, 0, split[0]) for a in got], self.cfg)
        return out

    def bind(self, grid) -> dict:
        """The key/value copies' group (collective over tp); its coordinate for clipping."""
        self.kv = TPL.kv_group(grid.comm["tp"], self.cfg)
        return {"kv": self.kv.rank}

    def reduce_copies(self, grads: dict) -> None:
        """tp > NKV: each copy of a key/value head saw only its own rank's query heads, so
        the copies' gradients are summed over the ``tp-kv`` group (nothing when tp <= NKV)."""
        TPL.reduce_kv_grads(grads, self.kv)


def check_family(cfg, mcfg) -> None:
    """Refuse, for a Llama-family model, what the engine's Llama pieces do not run (the
    same answer on every rank): ``cfg`` the TrainConfig, ``mcfg`` the model's shape."""
    if not is_llama(mcfg):
        return
    from refmp.parallel.pipeline.catalog import CATALOG

    refused = [
        (mcfg.n_expert and cfg.etp, f"--etp {cfg.etp} (MoE parallel folding) splits GPT-2's "
                                    f"experts (c_fc, c_proj); a Mixtral-style model's SwiGLU "
                                    f"experts run whole on their ep rank"),
        (mcfg.n_expert and cfg.save is not None,
         f"--save {cfg.save}: a Mixtral-style model (n_expert) has no LlamaForCausalLM form; "
         f"keep its weights with --checkpoint-dir"),
        (cfg.fp8 != "none", f"--fp8 {cfg.fp8} replaces GPT-2's linears"),
        (cfg.cp_ulysses > 1, "--cp-ulysses (hierarchical cp) runs GPT-2's attention core"),
    ]
    for on, why in refused:
        if on:
            raise ConfigError(f"--arch llama: {why}")
    if cfg.tp > 1:
        TPL.check_tp(mcfg, cfg.tp)
    if mcfg.tied and cfg.pp > 1 and cfg.schedule in CATALOG:
        placed = CATALOG[cfg.schedule].chunk_placement(cfg.pp, cfg.virtual_stages)
        S = cfg.pp * placed.v
        if not any({0, S - 1} <= set(placed.chunks(r)) for r in range(cfg.pp)):
            raise ConfigError("--arch llama: a tied head (tie_word_embeddings) puts wte on the "
                              "first and the last pipeline stage; under --pp it runs where one "
                              "rank holds both ends (--schedule zb-v or dualpipev), else untie it")
    if cfg.cp > 1 and cfg.cp_algo == "ulysses" and mcfg.n_head % (cfg.tp * cfg.cp):
        raise ConfigError(f"--cp-algo ulysses splits the n_head/tp heads over --cp {cfg.cp}")
