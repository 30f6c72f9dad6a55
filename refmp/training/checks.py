"""Every check before anything big is made (docs/faults.md, "Bad input, before any work"):
:func:`validate` runs them in order, each one refusing on every rank with the same message
(refmp.distributed.faults.agreed where only some ranks can see the fault):

1. the flags, pure (every rank gives the same answer without talking): refmp.config's
   check_config, and the checkpoint flags;
2. the output paths, which rank 0 writes (so rank 0 checks them);
3. the data and the model's shape (:func:`model_config`: from the flags or the ``--init``
   file's header, no weight read);
4. the layout's rules (refmp.parallel.rules.check_layout, pure);
5. the memory: the estimate of what a rank will hold (refmp.cost.memory) against what its
   node, or its GPU, has free now (docs/faults.md says how close the estimate is).
"""

from __future__ import annotations

from mpi4py import MPI

from refmp.config import TrainConfig, check_config, saves_directory
from refmp.cost.memory import estimate_memory, need_bytes, size
from refmp.distributed.faults import agreed, check_writable_dir, check_writable_file
from refmp.distributed.grid import ProcessGrid
from refmp.errors import ConfigError
from refmp.nn import GPTConfig
from refmp.parallel.family import check_family
from refmp.parallel.rules import check_layout
from refmp.runtime import cgroup
from refmp.training.datasets import AdditionTask, Dataset, load_tokens
from refmp.training.families import (
    arch_of,
    check_family_flags,
    check_save,
    cost_shape,
    llama_model,
)
from refmp.training.rank_memory import check_rank_limit


def validate(cfg: TrainConfig, grid: ProcessGrid,
             dataset: Dataset | None = None) -> tuple[Dataset, GPTConfig]:
    """The checks of the module docstring, in order, on every rank of ``grid`` (collective);
    returns the data (``dataset``, else the flags') and the model's shape."""
    world = grid.world
    check_config(cfg)
    check_checkpoint_flags(cfg)
    agreed(world, lambda: check_outputs(cfg) if world.rank == 0 else None)

    def shape():
        check_family_flags(cfg)
        ds = dataset if dataset is not None else build_dataset(cfg)
        return ds, model_config(cfg, ds)

    ds, mcfg = agreed(world, shape)
    check_layout(cfg, mcfg, world.size, grid.sizes)
    check_family(cfg, mcfg)  # what the engine's pieces of the model's family run
    check_save(cfg, mcfg)
    agreed(world, lambda: check_memory(cfg, mcfg, grid))
    return ds, mcfg


def check_checkpoint_flags(cfg: TrainConfig) -> None:
    """--checkpoint-dir, --save-every, --keep, --resume: values that make sense together."""
    for k in ("save_every", "keep"):
        if getattr(cfg, k) < 0:
            raise ConfigError(f"--{k.replace('_', '-')} must be 0 or more, got {getattr(cfg, k)}")
    if (cfg.save_every or cfg.keep) and not cfg.checkpoint_dir:
        raise ConfigError("--save-every and --keep need --checkpoint-dir DIR")
    if cfg.resume and cfg.init:
        raise ConfigError(f"--init {cfg.init} and --resume {cfg.resume} both give the starting "
                          "weights; a checkpoint carries its own: give one of them")


def check_outputs(cfg: TrainConfig) -> None:
    """What rank 0 writes (--save, a file or a Hugging Face directory; --log-json, --trace
    files; the --checkpoint-dir and --trace-dir folders, which every rank writes into):
    writable, before any step; and --trace-dir only where the watchdog that writes it runs."""
    if cfg.save is not None:
        check = check_writable_dir if saves_directory(cfg.save) else check_writable_file
        check(cfg.save, "--save")
    for flag, path in (("--log-json", cfg.log_json), ("--trace", cfg.trace)):
        if path is not None:
            check_writable_file(path, flag)
    for flag, path in (("--checkpoint-dir", cfg.checkpoint_dir), ("--trace-dir", cfg.trace_dir)):
        if path is not None:
            check_writable_dir(path, flag)
    if cfg.trace_dir is not None and not cfg.collective_timeout:
        raise ConfigError("--trace-dir holds the watchdog's report, and --collective-timeout 0 "
                          "turns the watchdog off")


# --- the data and the model's shape ----------------------------------------------------------


def build_dataset(cfg: TrainConfig) -> Dataset:
    if cfg.data is None:
        return AdditionTask(cfg.digits, cfg.seed).dataset()
    return load_tokens(cfg.data, cfg.tokenizer)


def moe_flags(cfg: TrainConfig) -> dict:
    """The MoE settings a TrainConfig was given (those not None), by GPTConfig field name."""
    from refmp.checkpoint.weights import MOE_META

    return {k: getattr(cfg, k) for k in MOE_META if getattr(cfg, k) is not None}


def model_config(cfg: TrainConfig, ds: Dataset) -> GPTConfig:
    """The model's shape, from the flags or the --init file's header (no weight is made or
    read), checked against the data: what the memory check needs before anything is big.

    MoE settings left None take GPTConfig's defaults, or with --init the file's metadata;
    those given win over the file (refmp.checkpoint.weights.read_config says where they differ).
    """
    from refmp.checkpoint.weights import read_config

    moe = moe_flags(cfg)  # the MoE settings given, by GPTConfig field name
    if arch_of(cfg) == "llama":  # refmp.training.families: the flags or the directory's
        mcfg = llama_model(cfg, ds)
    elif cfg.init is not None:
        mcfg, _ = read_config(cfg.init, cfg.n_head, moe)
        if cfg.block_size is not None and cfg.block_size > mcfg.block_size:
            raise ConfigError(f"--block-size {cfg.block_size} exceeds the block size "
                              f"{mcfg.block_size} of {cfg.init}")
    else:
        # the addition task: one problem per window, so every position keeps one role
        T = cfg.block_size or (ds.task.line_len if ds.task else 64)
        mcfg = GPTConfig(ds.vocab_size, T, cfg.n_layer, cfg.n_head or 4, cfg.n_embd,
                         cfg.n_expert, **moe)
        mcfg.check()
    if ds.vocab_size > mcfg.vocab_size:
        raise ConfigError(f"the data has {ds.vocab_size} token ids but the model's vocabulary "
                          f"is {mcfg.vocab_size}")
    T = cfg.block_size or mcfg.block_size
    if ds.n_windows(T) < 1:
        raise ConfigError(f"the data ({len(ds.tokens)} tokens) is shorter than one window of "
                          f"{T + 1} tokens; use a smaller --block-size")
    return mcfg


# --- the memory ------------------------------------------------------------------------------


def available_memory(device: str = "cpu") -> tuple[int, str]:
    """(bytes free, where that figure comes from): the GPU's free memory for --device gpu;
    else /proc/meminfo's MemAvailable (or physical memory), capped by a cgroup limit."""
    if device == "gpu":
        import cupy

        return int(cupy.cuda.runtime.memGetInfo()[0]), "free on this GPU"
    free, source = cgroup.machine_bytes(), "physical memory"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free, source = int(line.split()[1]) * 1024, "MemAvailable"
    except OSError:
        pass
    room = cgroup.headroom()  # a container's memory limit, less what it uses
    if room is not None and room < free:
        free, source = room, "the cgroup's memory limit"
    return free, source


def check_memory(cfg, mcfg, grid) -> None:
    """Refuse a layout whose estimated memory exceeds what this node (or GPU) has free.

    Collective over grid.world (a split by node and GPU, one all-reduce): the ranks that
    share the memory add up their needs. Raises on the ranks of a node that does not fit;
    :func:`validate` calls it through refmp.distributed.faults.agreed so that every rank stops.
    """
    mcfg = cost_shape(mcfg)  # a Llama model as refmp.cost describes it
    mem = estimate_memory(cfg, mcfg, grid.sizes, grid.coords)
    need = need_bytes(mem)
    device = 0
    if cfg.device == "gpu":  # refmp.runtime.device.use_gpu chose this rank's GPU
        import cupy

        device = cupy.cuda.Device().id
    node = grid.world.mpi.Split_type(MPI.COMM_TYPE_SHARED)
    share = node.Split(device, node.Get_rank())
    try:
        total, n = share.allreduce(need), share.Get_size()
    finally:
        share.Free()
        node.Free()
    # a rank with a memory size (refmp cluster --rank-memory): its own limit first
    check_rank_limit(cfg, mcfg, grid.sizes, grid.coords, grid.rank)
    free, source = available_memory(cfg.device)
    if total > free:
        kept = ("params", "grads", "optimizer") + (("error_feedback",) if mem["error_feedback"] else ())
        parts = ", ".join(f"{k.replace('_', ' ')} {size(mem[k])}" for k in kept)
        where = "GPU" if cfg.device == "gpu" else "node"
        raise ConfigError(
            f"not enough memory: rank {grid.rank} needs about {size(need)} ({parts}, peak "
            f"activations {size(mem['activations'] + mem['workspace'])}, one read at set-up "
            f"{size(mem['setup'])}); the {n} rank(s) on this {where} need {size(total)}, "
            f"but {size(free)} is available ({source}). Use a smaller --block-size or "
            f"--batch-size, more --microbatches, or more ranks (an estimate: docs/faults.md)")
