"""check_layout: every rule a layout must meet, with its reason, before anything is built.

A pure function of the training configuration, the model's shape and the world size, so every
rank refuses a bad layout with the same message before any communication. Every axis
composes with every other; what is left are the arithmetic rules of each split.
"""

from __future__ import annotations

from refmp.config import check_sizes
from refmp.errors import ConfigError
from refmp.parallel.context.chunks import ALGOS, SequenceChunks
from refmp.parallel.fp8 import check_fp8
from refmp.parallel.pipeline.catalog import CATALOG
from refmp.parallel.pipeline.partition import check_pipeline, parse_stage_layers


def check_layout(cfg, mcfg, world_size: int, sizes: dict | None = None) -> dict[str, int]:
    """Refuse what this layout cannot split; return the axis sizes (dp filled in).

    ``cfg``: a refmp.training.trainer.TrainConfig; ``mcfg``: the model's GPTConfig; ``sizes``: the
    grid's, when one was made already (else read from cfg and checked against world_size).
    """
    s = sizes or check_sizes(world_size, cfg.pp, cfg.dp, cfg.cp, cfg.tp, cfg.ep, cfg.etp)
    pp, dp, cp, tp, ep = s["pp"], s["dp"], s["cp"], s["tp"], s["ep"]
    T, B, M = cfg.block_size or mcfg.block_size, cfg.batch_size, cfg.microbatches
    if cfg.zero not in (0, 1, 2, 3):
        raise ConfigError(f"--zero must be 0, 1, 2 or 3, got {cfg.zero}")
    if cfg.bucket_mb < 0:
        raise ConfigError(f"--bucket-mb must be >= 0, got {cfg.bucket_mb}")
    if cfg.dp_reduce == "hierarchical" and cfg.zero > 0:
        raise ConfigError(f"--dp-reduce hierarchical is ZeRO 0's all-reduce; --zero {cfg.zero} "
                          f"reduce-scatters and all-gathers over the flat group (use --zero 0)")
    check_dp_shard(cfg, dp)
    check_hpz(cfg, dp * cp)
    if cfg.recompute not in ("none", "selective", "full"):
        raise ConfigError(f"--recompute must be none, selective or full, got {cfg.recompute!r}")
    if M < 1:
        raise ConfigError(f"--microbatches must be at least 1, got {M}")
    if B % (dp * M):
        raise ConfigError(f"--batch-size ({B}) must be divisible by dp * microbatches "
                          f"({dp} * {M}): every micro-batch has the same rows")
    # tensor (and sequence) parallelism: whole heads per rank; T/tp tokens per rank with SP
    if mcfg.n_head % tp:
        raise ConfigError(f"--tp {tp} must divide the number of heads n_head "
                          f"({mcfg.n_head}): each tensor-parallel rank computes whole heads")
    if cfg.sequence_parallel and tp == 1:
        raise ConfigError("--sequence-parallel shards activations over the tensor-parallel "
                          "ranks: it needs --tp > 1")
    # context parallelism: equal chunks; Ulysses splits each tp rank's heads again over cp
    if cfg.cp_algo not in ALGOS:
        raise ConfigError(f"--cp-algo must be one of {', '.join(ALGOS)}, got {cfg.cp_algo!r}")
    if cp > 1:
        if T % cp:
            raise ConfigError(f"--cp {cp} must divide the block size T ({T}); the addition "
                              f"task's default T is 13: pass --block-size or --digits")
        SequenceChunks(T, cp, cfg.cp_balance)  # refuses a T the chunks cannot split
        if cfg.cp_algo == "ulysses" and (mcfg.n_head // tp) % cp:
            raise ConfigError(f"--cp-algo ulysses gives each of the {cp} cp ranks a share of "
                              f"the n_head/tp = {mcfg.n_head // tp} heads of a tp rank, which "
                              f"must be divisible by --cp {cp}")
    check_cp_ulysses(cfg, mcfg.n_head // tp, cp)
    if cfg.sequence_parallel and (T // cp) % tp:
        raise ConfigError(f"--sequence-parallel: --tp {tp} must divide the tokens each rank "
                          f"holds, T/cp = {T}/{cp}: each tp rank keeps a 1/tp of them")
    # experts: whole experts per ep rank, carved from dp x cp (check_sizes)
    if ep > 1 and mcfg.n_expert == 0:
        raise ConfigError(f"--ep {ep} needs a mixture-of-experts model (--n-expert > 0)")
    if mcfg.n_expert % ep:
        raise ConfigError(f"--n-expert ({mcfg.n_expert}) must be divisible by --ep ({ep}): "
                          f"every expert-parallel rank holds E/ep experts")
    check_etp(cfg, mcfg)
    sched = CATALOG.get(cfg.schedule)  # an unknown name: check_pipeline's message below
    if sched is not None and not sched.flushes and cfg.resume:
        raise ConfigError(f"--schedule {cfg.schedule} {sched.carries} across each step, which a "
                          "checkpoint does not hold: --resume would lose them")
    if sched is not None and not sched.moe and mcfg.n_expert:
        raise ConfigError(f"--schedule {cfg.schedule} {sched.carries} across each step, and "
                          "their MoE losses would be counted in the wrong step: use a dense "
                          "model (--n-expert 0)")
    # the pipeline (pp = 1 is a one-stage schedule: gradient accumulation)
    check_pipeline(mcfg.n_layer, pp, M, cfg.schedule, cfg.virtual_stages,
                   parse_stage_layers(cfg.stage_layers), B // dp)
    check_compression(cfg)
    check_fp8(cfg, mcfg.n_embd, tp)
    return s


def check_etp(cfg, mcfg) -> None:
    """--etp: MoE parallel folding (refmp.parallel.folding), each expert's hidden width 4C
    split over etp ranks (ep x etp dividing a stage's ranks: check_sizes; 0: off)."""
    etp = cfg.etp
    if etp == 0:
        return
    if mcfg.n_expert == 0:
        raise ConfigError(f"--etp {etp} folds the experts' grid: it needs a mixture-of-experts "
                          f"model (--n-expert > 0)")
    if (4 * mcfg.n_embd) % etp:
        raise ConfigError(f"--etp {etp} must divide the experts' hidden size 4C = {4 * mcfg.n_embd}: "
                          f"each etp rank holds 4C/etp of c_fc's columns and c_proj's rows")


def check_compression(cfg) -> None:
    """Refuse a codec (refmp.parallel.data.compress) where it does not compose, with why."""
    codec, wide = cfg.grad_compress, cfg.mixed_precision == "none" or cfg.grad_dtype == "fp32"
    if not (cfg.compress_rank >= 1 and 0 < cfg.compress_ratio <= 1 and cfg.compress_start >= 0
            and cfg.quant_block >= 1):
        raise ConfigError("--compress-rank and --quant-block must be at least 1, --compress-ratio "
                          "in (0, 1], --compress-start >= 0")
    if codec in ("powersgd", "topk") and cfg.zero >= 2:
        raise ConfigError(f"--grad-compress {codec} sums each unit's whole gradient, but ZeRO-"
                          f"{cfg.zero} reduce-scatters it every micro-batch and keeps a shard: "
                          f"use --zero 0 or 1 (or --grad-compress bf16)")
    if codec != "none" and not wide:
        raise ConfigError(f"--grad-compress {codec} with 16-bit gradients: bf16 would change nothing, "
                          f"and PowerSGD's basis and top-k's errors need more bits: add --grad-dtype fp32")
    if codec in ("bf16", "topk") and cfg.device == "gpu":
        raise ConfigError(f"--grad-compress {codec} runs on the CPU (bf16 through ml_dtypes; top-k's "
                          f"scatter-add in rank order): on the GPU use powersgd")
    if cfg.weight_gather != "none" and cfg.zero != 3:
        raise ConfigError(f"--weight-gather {cfg.weight_gather} quantizes ZeRO-3's all-gathers of the "
                          "weights for each use; other stages keep whole weights (their all-gather after the "
                          "step is the update itself): add --zero 3")


def check_cp_ulysses(cfg, heads: int, cp: int) -> None:
    """--cp-ulysses U: hierarchical cp (refmp.parallel.context.hybrid), U dividing cp and
    the ``heads`` of a tp rank, the ring across the groups (1: off)."""
    U = cfg.cp_ulysses
    if U == 1:
        return
    if U < 1 or cp % U:
        raise ConfigError(f"--cp-ulysses {U} must be at least 1 and divide --cp {cp}: groups of "
                          f"U consecutive cp ranks, the ring across cp/U of them")
    if cfg.cp_algo != "ring":
        raise ConfigError(f"--cp-ulysses {U} runs Ulysses inside groups and the ring across them; "
                          f"--cp-algo {cfg.cp_algo} is one level: leave --cp-algo ring")
    if heads % U:
        raise ConfigError(f"--cp-ulysses {U} gives each rank of a Ulysses group a share of the "
                          f"n_head/tp = {heads} heads of a tp rank, which must be divisible by {U}")


def check_dp_shard(cfg, dp: int) -> None:
    """--dp-shard N: HSDP (refmp.parallel.data.hsdp), N dividing dp, with a ZeRO stage to shard
    and none of the options that replace the group's plain reductions (0 or dp: off)."""
    N = cfg.dp_shard
    if N in (0, dp):
        return
    if N < 0 or dp % N:
        raise ConfigError(f"--dp-shard {N} must divide --dp {dp}: ZeRO shards over groups of N "
                          f"dp ranks and the dp/N groups hold replicas (0: all of dp)")
    if cfg.zero == 0:
        raise ConfigError(f"--dp-shard {N} shards ZeRO's state over groups of {N} dp ranks; --zero 0 "
                          f"shards nothing: add --zero 1, 2 or 3")
    for name, on in (("--hpz-size", cfg.hpz_size != 1), ("--grad-compress", cfg.grad_compress != "none"),
                     ("--weight-gather", cfg.weight_gather != "none"),
                     ("--dp-reduce hierarchical", cfg.dp_reduce == "hierarchical")):
        if on:
            raise ConfigError(f"--dp-shard {N} with {name}: HSDP's shard groups and replicas take "
                              f"plain reductions; use one of the two")


def check_hpz(cfg, n: int) -> None:
    """--hpz-size G: ZeRO-3's, G dividing the n = dp x cp ranks of a ZeRO group, below n
    (1: off)."""
    G = cfg.hpz_size
    if G == 1:
        return
    if G < 1:
        raise ConfigError(f"--hpz-size must be at least 1 (1: off), got {G}")
    if cfg.zero != 3:
        raise ConfigError(f"--hpz-size partitions ZeRO-3's weights a second time; --zero {cfg.zero} "
                          f"gathers none for each use: add --zero 3, or leave --hpz-size 1")
    if cfg.weight_gather != "none":
        raise ConfigError(f"--hpz-size with --weight-gather {cfg.weight_gather}: the {cfg.weight_gather} "
                          "gathers run over the whole group; use one of the two")
    if n % G or G >= n:
        raise ConfigError(f"--hpz-size {G} must divide the dp x cp ranks of a ZeRO group ({n}) and "
                          f"be below it (a node's ranks of the group)")
