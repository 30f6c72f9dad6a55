"""What a run is asked to do: its layout (ParallelConfig: how the ranks split the work) and
the rest (TrainConfig, the fields behind ``refmp train``'s flags), the learning-rate schedule,
and the checks that every value makes sense before anything is built (the same answer on
every rank: pure functions of the configuration).

Each layout field carries its flag in ``dataclasses.field(metadata=...)``: help (an argparse
format: ``%(default)s`` is the field's default), group, type, choices and, for the fields
``refmp plan`` searches, ``plan``. refmp.cli makes the layout flags of ``refmp train``,
``bench`` and ``plan`` from them; refmp.cost.model the planner's Layout.

refmp.training.trainer runs the step; refmp.parallel.rules checks the layout;
refmp.distributed.faults the output paths; refmp.training.checks the memory it will need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from refmp.errors import ConfigError

# the help groups of the layout flags
LAYOUT = "layout"
PRECISION = "mixed precision (Micikevicius et al. 2018)"
PIPELINE = "pipeline (with --pp > 1; see docs/pipeline.md)"
CONTEXT = "context parallelism (--cp)"
COMPRESS = "communication compression (see docs/compression.md)"


def flag_name(name: str) -> str:
    """A field's flag: ``cp_algo`` -> ``--cp-algo``."""
    return "--" + name.replace("_", "-")


def saves_directory(path: str) -> bool:
    """Where refmp writes a whole model (``--save``, ``refmp convert``): a path ending in
    ``.safetensors`` is one GPT-2 file, any other a Hugging Face directory (config.json and
    model.safetensors; refmp.checkpoint.hf)."""
    return not path.endswith(".safetensors")


def flag(default, help: str, group: str = LAYOUT, kind: type | None = None,
         choices: tuple | None = None, metavar: str | None = None, plan: dict | None = None):
    """A layout field with its flag: ``kind`` the flag's type (default: the default's; a bool
    is a switch); ``plan`` None where ``refmp plan`` does not search the field, else that
    command's ``choices`` and ``help`` where they differ from the field's."""
    return field(default=default, metadata={"help": help, "group": group, "kind": kind or type(default),
                                            "choices": choices, "metavar": metavar, "plan": plan})


@dataclass
class ParallelConfig:
    """How the ranks split the work: the axes, ZeRO, recomputation, mixed precision, the
    pipeline and the context-parallel options; the fields ``refmp plan`` searches first."""
    tp: int = flag(1, "tensor-parallel ranks (%(default)s)", plan={})
    pp: int = flag(1, "pipeline stages (%(default)s)", plan={})
    dp: int | None = flag(None, "data-parallel ranks (default: world size / (pp*cp*tp))", kind=int, plan={})
    cp: int = flag(1, "context-parallel ranks (%(default)s)", plan={})
    ep: int = flag(1, "expert-parallel ranks, carved from the dp x cp ranks (%(default)s)", plan={})
    zero: int = flag(0, "ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters (0: "
                        "plain data parallel)", choices=(0, 1, 2, 3), plan={})
    sequence_parallel: bool = flag(False, "with --tp: shard LayerNorms and residuals along the sequence",
                                   plan={})
    recompute: str = flag("none", "activation recomputation (Korthikanti et al. 2022): full keeps each "
                                  "block's input and recomputes its forward in backward; selective "
                                  "recomputes attention's softmax; same results, bitwise (%(default)s)",
                          choices=("none", "selective", "full"), plan={})
    mixed_precision: str = flag("none", "compute copy of the weights, activations and gradients in bf16 or "
                                        "fp16, fp32 master weights and optimizer state (--dtype); on the "
                                        "CPU products run in fp32 on the rounded operands (%(default)s)",
                                PRECISION, choices=("none", "bf16", "fp16"), plan={})
    microbatches: int = flag(1, "micro-batches per step: pipeline micro-batches, or gradient accumulation "
                                "without --pp (%(default)s)", plan={})
    schedule: str = flag("1f1b", "pipeline schedule (default %(default)s)", PIPELINE,
                         choices=("naive", "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev",
                                  "2bw", "pipedream"),
                         plan={"choices": ("1f1b", "gpipe", "interleaved", "zb-h1")})
    virtual_stages: int = flag(1, "model chunks per rank, for --schedule interleaved (%(default)s)",
                               PIPELINE, plan={})
    stage_layers: str | None = flag(None, "blocks per stage, e.g. 2,1,1, or auto: balanced by the "
                                          "blocks', embeddings' and head's times measured here "
                                          "(default: balanced by a FLOP model)", PIPELINE, kind=str,
                                    metavar="N,N,...")
    cp_algo: str = flag("ring", "ring: K/V blocks around the ring; ulysses: all-to-all to heads "
                                "(%(default)s)", CONTEXT, choices=("ring", "ulysses"),
                        plan={"help": "with --cp > 1 (default: both searched)"})
    cp_ulysses: int = flag(1, "hierarchical cp: Ulysses' all-to-all inside groups of this many consecutive "
                              "cp ranks, the ring (--cp-algo ring) across the cp/U groups; 1: one "
                              "level, --cp-algo's (%(default)s)", CONTEXT, plan={})
    cp_balance: str = flag("zigzag", "zigzag: rank r holds chunks r and 2cp-1-r of 2cp, equal causal "
                                     "work (default); contiguous: chunk r of cp", CONTEXT,
                           choices=("zigzag", "contiguous"))
    bucket_mb: float = flag(25.0, "data parallel: gradient all-reduce bucket size in MB, overlapped with "
                                  "backward (0: one all-reduce after backward; default %(default)g)")
    dp_reduce: str = flag("flat", "the data-parallel gradient all-reduce: flat over the whole group, or "
                                  "hierarchical across nodes (reduce-scatter inside a node, all-reduce "
                                  "of 1/G across nodes, all-gather inside; ZeRO 0; docs/nodes.md) "
                                  "(%(default)s)", choices=("flat", "hierarchical"))
    dp_shard: int = flag(0, "HSDP (hybrid sharding): --zero's stages over groups of this many dp ranks "
                            "(x cp), replicated across the dp/N groups: reduce-scatter inside, "
                            "all-reduce of the slice across, all-gather inside; 0: all of dp "
                            "(%(default)s)", plan={})
    hpz_size: int = flag(1, "ZeRO-3: ZeRO++'s hierarchical partition (hpZ): a second copy of the weights "
                            "partitioned over blocks of this many consecutive dp x cp ranks (give "
                            "those on a node: the ranks per node over tp), so the weight all-gathers "
                            "of every use stay inside a block; 1: off (%(default)s)")
    grad_dtype: str = flag("compute", "with --mixed-precision: accumulate and reduce gradients in the "
                                      "compute dtype or in fp32 (%(default)s)", PRECISION,
                           choices=("compute", "fp32"))
    loss_scale_init: float = flag(65536.0, "fp16: initial dynamic loss scale (%(default)g)", PRECISION)
    loss_scale_window: int = flag(1000, "fp16: double the loss scale after this many steps without "
                                        "overflow; an overflow skips the step and halves it (%(default)s)",
                                  PRECISION)
    grad_compress: str = flag("none", "the data-parallel gradient sums compressed: bf16 on the wire, "
                                      "powersgd (rank --compress-rank factors of each matrix) or topk "
                                      "(the --compress-ratio largest entries) (%(default)s)", COMPRESS,
                              choices=("none", "bf16", "powersgd", "topk"),
                              plan={"help": "price the gradient sums compressed (default none)"})
    compress_rank: int = flag(4, "PowerSGD's rank R: an n x m matrix travels as R (n + m) elements "
                                 "where that is fewer (%(default)s)", COMPRESS, plan={})
    compress_ratio: float = flag(0.01, "top-k: the fraction of each tensor sent (%(default)g)", COMPRESS,
                                 plan={})
    compress_start: int = flag(0, "plain sums for the first N steps, then the codec (%(default)s)",
                               COMPRESS)
    no_error_feedback: bool = flag(False, "PowerSGD / top-k: drop what was not sent instead of adding it "
                                          "to the next step's gradient", COMPRESS)
    weight_gather: str = flag("none", "ZeRO-3's weight all-gathers in block-wise int8, one scale per "
                                      "--quant-block elements (ZeRO++ qwZ), or in MXFP8 (E4M3, one "
                                      "power-of-two scale per 32) (%(default)s)", COMPRESS,
                              choices=("none", "int8", "fp8"), plan={})
    quant_block: int = flag(256, "--weight-gather int8: elements per scale (%(default)s)", COMPRESS,
                            plan={})
    fp8: str = flag("none", "FP8 linears, emulated: E4M3 inputs and weights, E5M2 gradients, "
                            "products in the run's dtype; scales per tensor now (tensor), from an "
                            "amax history (delayed), or per 32 elements (mxfp8) (%(default)s)",
                    PRECISION, choices=("none", "tensor", "delayed", "mxfp8"), plan={})
    etp: int = flag(0, "MoE parallel folding: experts split over --etp ranks like the MLP, --ep x --etp "
                       "folded over a stage's tp x cp x dp ranks (tp included); 0: experts whole, copied "
                       "over tp, --ep carved from dp x cp (%(default)s)", plan={})

    def as_dict(self, sizes: dict[str, int] | None = None) -> dict:
        """The layout's fields, the axis sizes as a grid resolved them (``sizes``: dp filled
        in), as one dict (the JSON of refmp bench and of a checkpoint's manifest)."""
        return {**{f.name: getattr(self, f.name) for f in fields(ParallelConfig)}, **(sizes or {})}


def check_sizes(world_size: int, pp: int = 1, dp: int | None = None, cp: int = 1, tp: int = 1,
                ep: int = 1, etp: int = 0) -> dict[str, int]:
    """Validate the layout's axis sizes and return them (dp filled in; etp with folding)."""
    if etp < 0:
        raise ConfigError(f"--etp must be 0 (experts copied over tp) or at least 1, got {etp}")
    for name, v in (("pp", pp), ("cp", cp), ("tp", tp), ("ep", ep)):
        if v < 1:
            raise ConfigError(f"--{name} must be at least 1, got {v}")
    if dp is None:
        other = pp * cp * tp
        if world_size % other:
            raise ConfigError(
                f"pp*cp*tp = {pp}*{cp}*{tp} = {other} does not divide the world size {world_size}"
            )
        dp = world_size // other
    if dp < 1:
        raise ConfigError(f"--dp must be at least 1, got {dp}")
    if pp * dp * cp * tp != world_size:
        raise ConfigError(
            f"layout pp*dp*cp*tp = {pp}*{dp}*{cp}*{tp} = {pp * dp * cp * tp} does not match the "
            f"{world_size} MPI processes; launch with `mpiexec -n {pp * dp * cp * tp}` "
            f"or change the sizes"
        )
    if etp and (dp * cp * tp) % (ep * etp):
        raise ConfigError(f"--ep x --etp ({ep} x {etp}) must divide a stage's ranks, "
                          f"tp * cp * dp ({tp} * {cp} * {dp}): the experts' grid folds over them")
    if not etp and (dp * cp) % ep:
        raise ConfigError(f"--ep ({ep}) must divide dp * cp ({dp} * {cp}): experts are carved "
                          f"from the data- and context-parallel ranks")
    return {"pp": pp, "dp": dp, "cp": cp, "tp": tp, "ep": ep, **({"etp": etp} if etp else {})}


@dataclass
class TrainConfig(ParallelConfig):
    """A run: its layout (the ParallelConfig fields), the model, the data, the optimization,
    the device and the files."""
    n_layer: int = 2
    n_head: int | None = None  # None: 4, or what an --init file's metadata says
    n_embd: int = 64
    n_expert: int = 0  # mixture of experts (refmp.nn.moe); 0: dense
    # the MoE settings below: None means not given, so GPTConfig's default or what an --init
    # file says; a value given wins over the file's metadata (refmp.checkpoint.weights.read_config)
    top_k: int | None = None
    moe_every: int | None = None
    capacity_factor: float | None = None
    aux_loss_coef: float | None = None
    z_loss_coef: float | None = None
    # the model family (refmp.training.families): gpt2, or llama with its shape below (None:
    # not given; a fresh Llama needs each, a Llama --init directory says them)
    arch: str | None = None  # None: llama for a Llama --init directory, else gpt2
    n_kv_head: int | None = None
    ffn: int | None = None  # the SwiGLU MLP's width (intermediate_size)
    rope_theta: float | None = None
    rms_eps: float | None = None
    head: str | None = None  # tied (the head is wte) or untied (lm_head)
    block_size: int | None = None  # None: one addition problem (13), else 64
    batch_size: int = 128
    steps: int = 1500
    optimizer: str = "adamw"
    lr: float = 6e-3
    lr_schedule: str = "cosine"
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    momentum: float = 0.0
    grad_clip: float = 1.0
    dtype: str = "float32"
    seed: int = 0
    data: str | None = None
    tokenizer: str | None = None  # a Hugging Face tokenizer's directory for a text --data file
    shuffle: bool = False
    digits: int = 3
    device: str = "cpu"  # cpu (NumPy) or gpu (CuPy)
    trace: str | None = None  # write the last step's pipeline timeline (Chrome trace JSON)
    init: str | None = None
    save: str | None = None
    log_json: str | None = None
    progress: bool = True
    checkpoint_dir: str | None = None  # sharded checkpoints (refmp.checkpoint.sharded): DIR/step-{N:08d}/
    save_every: int = 0  # a checkpoint every N steps (0: only at the end)
    keep: int = 0  # keep the last K checkpoints (0: all)
    resume: str | None = None  # continue from the latest complete checkpoint in this directory
    collective_timeout: float = 300.0  # the watchdog: seconds without progress (0: off)
    trace_dir: str | None = None  # the watchdog's report: every rank's flight recorder as JSON
    exit_signal: str = "SIGTERM,SIGUSR1"  # preemption: stop at a step boundary ("none": off)

    @property
    def parallel(self) -> ParallelConfig:
        """This run's layout."""
        return ParallelConfig(**self.as_dict())



def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr (or constant)."""
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def _in(x: float, lo: float, hi: float, hi_open: bool = True) -> bool:
    """lo <= x < hi (or <= hi); False for nan."""
    return lo <= x and (x < hi if hi_open else x <= hi)


def check_config(cfg: TrainConfig) -> None:
    """Refuse bad values before anything is built (same answer on every rank).

    Comparisons are written so that nan fails them (nan < 0 is False: ``not x >= 0``).
    """
    if cfg.optimizer not in ("sgd", "adamw"):
        raise ConfigError(f"--optimizer must be sgd or adamw, got {cfg.optimizer!r}")
    if cfg.dtype not in ("float32", "float64"):
        raise ConfigError(f"--dtype must be float32 or float64, got {cfg.dtype!r}")
    if cfg.device not in ("cpu", "gpu"):
        raise ConfigError(f"--device must be cpu or gpu, got {cfg.device!r}")
    if cfg.lr_schedule not in ("cosine", "constant"):
        raise ConfigError(f"--lr-schedule must be cosine or constant, got {cfg.lr_schedule!r}")
    for name in ("batch_size", "steps"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{flag_name(name)} must be at least 1")
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):
        raise ConfigError(f"--lr must be positive and finite, got {cfg.lr}")
    if cfg.warmup_steps < 0:
        raise ConfigError(f"--warmup-steps must be >= 0, got {cfg.warmup_steps}")
    if not _in(cfg.min_lr_ratio, 0, 1, hi_open=False):
        raise ConfigError(f"--min-lr-ratio must be between 0 and 1, got {cfg.min_lr_ratio}")
    for name in ("beta1", "beta2", "momentum"):  # 1 would never forget (and AdamW divides by 0)
        if not _in(getattr(cfg, name), 0, 1):
            raise ConfigError(f"--{name} must be in [0, 1), got {getattr(cfg, name)}")
    for name in ("weight_decay", "grad_clip", "bucket_mb", "capacity_factor", "aux_loss_coef",
                 "z_loss_coef"):
        x = getattr(cfg, name)
        if x is not None and not _in(x, 0, math.inf):
            raise ConfigError(f"{flag_name(name)} must be >= 0 and finite, got {x}")
    if cfg.block_size is not None and cfg.block_size < 1:
        raise ConfigError(f"--block-size must be at least 1, got {cfg.block_size}")
    if cfg.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {cfg.seed}")
    for f in fields(ParallelConfig):  # the layout's choices (the flags' choices, without a parser)
        if (choices := f.metadata["choices"]) and getattr(cfg, f.name) not in choices:
            raise ConfigError(f"{flag_name(f.name)} must be {', '.join(map(str, choices[:-1]))} or "
                              f"{choices[-1]}, got {getattr(cfg, f.name)!r}")
    if cfg.grad_dtype != "compute" and cfg.mixed_precision == "none":
        raise ConfigError("--grad-dtype fp32 needs --mixed-precision bf16 or fp16")
    if cfg.mixed_precision == "bf16" and cfg.device == "gpu":
        raise ConfigError("--mixed-precision bf16 runs on the CPU (ml_dtypes); on the GPU use fp16")
    if cfg.loss_scale_init <= 0 or cfg.loss_scale_window < 1:
        raise ConfigError("--loss-scale-init must be positive and --loss-scale-window at least 1")
    if not _in(cfg.collective_timeout, 0, math.inf):
        raise ConfigError(f"--collective-timeout must be >= 0 and finite, got "
                          f"{cfg.collective_timeout}")
    if not 1 <= cfg.digits <= 6:
        raise ConfigError(f"--digits must be between 1 and 6, got {cfg.digits}")
    if cfg.tokenizer is not None and (cfg.data is None or cfg.data.endswith((".npy", ".bin"))):
        raise ConfigError(f"--tokenizer {cfg.tokenizer} tokenizes a text --data file; "
                          f"{'no --data was given' if cfg.data is None else cfg.data + ' is tokens already'}")
