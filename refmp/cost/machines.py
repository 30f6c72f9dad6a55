"""What ``refmp plan`` plans for: published model shapes, and machines (one accelerator's
peak and memory, and the links between accelerators).

``refmp plan --machine cpu`` measures this host instead (refmp.cli.calibrate.cpu_machine).
"""

from __future__ import annotations

from dataclasses import dataclass

MODELS = {  # (n_layer, n_embd, n_head, vocab, block_size): GPT-2 (Radford 2019), GPT-3 (Brown 2020)
    "gpt2": (12, 768, 12, 50257, 1024), "gpt2-medium": (24, 1024, 16, 50257, 1024),
    "gpt2-large": (36, 1280, 20, 50257, 1024), "gpt2-xl": (48, 1600, 25, 50257, 1024),
    "gpt3-6.7b": (32, 4096, 32, 50257, 2048), "gpt3-175b": (96, 12288, 96, 50257, 2048),
}


@dataclass(frozen=True)
class Machine:
    """One accelerator's peak and memory, and the links (GB/s per GPU, one direction)."""
    name: str
    gpus_per_node: int
    gpu_memory_gb: float
    peak_tflops: float  # dense bf16 (fp32 for cpu)
    hbm_gbs: float  # memory bandwidth, for the roofline and elementwise work
    gemm_efficiency: float  # e: a large GEMM's share of peak (cuBLAS, measured by vendors)
    intra_node_gbs: float
    inter_node_gbs: float
    intra_latency_us: float = 5.0
    inter_latency_us: float = 10.0
    sms: int = 0  # streaming multiprocessors: a GEMM's output tiles run sms at a time
    tile: int = 128  # cuBLAS's output tile (tile x tile) for large bf16 products
    comm_sms: int = 0  # SMs a collective's kernels hold (NCCL: one thread block a channel)
    # more ranks than cores (a CPU): a rank that waits sleeps and its core runs another rank,
    # so a pipeline's bubble costs no time (refmp.distributed.comm's waits; the step is the busy time)
    time_shared: bool = False
    # a CPU's NumPy: each operation's fixed cost (refmp.cost.terms.numpy_calls), and a short
    # product's slowdown, 1 + hm / m + hk / k + hn / n for (m, k) @ (k, n) (refmp.cost.terms.gemm)
    call_us: float = 0.0
    stream_gbs: float = 0.0  # the optimizer's rate as 32 bytes a weight (a CPU's: refmp's AdamW); 0: hbm_gbs
    gemm_short: tuple[float, float, float] = (0.0, 0.0, 0.0)
    # a point-to-point message moves while its ranks compute (NCCL's copy engines); False on
    # a CPU, where MPICH makes the copy inside the receiver's wait (docs/plan.md)
    overlaps_p2p: bool = True
    # each node has one link that its ranks share (refmp cluster's, --link-gbit): the
    # all-reduces that cross nodes are priced by MPI's algorithms on it (refmp.cost.nodes)
    shared_link: bool = False


MACHINES = {  # NVIDIA's data sheets: A100 SXM 312 TFLOP/s bf16, 2.0 TB/s, NVLink 600 GB/s
    # both ways, one 200 Gb/s HDR NIC per GPU; H100 SXM 989 TFLOP/s, 3.35 TB/s, NVLink 900
    # GB/s, 400 Gb/s NDR. e = 0.7: cuBLAS's large bf16 GEMMs reach about 70% of peak.
    # comm_sms 24: assumed, within NCCL's 16-32 channels on these machines.
    "dgx-a100": Machine("dgx-a100", 8, 80, 312, 2039, 0.7, 300, 25, sms=108, comm_sms=24),
    "dgx-h100": Machine("dgx-h100", 8, 80, 989, 3350, 0.7, 450, 50, sms=132, comm_sms=24),
    # the same H100 SXM by its own name (docs/published_runs.md), and the H800, its export
    # version: the same chip, NVLink cut to 400 GB/s both ways (200 one way), nodes of 8
    # with a 400 Gb/s NIC per GPU (DeepSeek-V3's report, sec. 3.1)
    "h100": Machine("h100", 8, 80, 989, 3350, 0.7, 450, 50, sms=132, comm_sms=24),
    "h800": Machine("h800", 8, 80, 989, 3350, 0.7, 200, 50, sms=132, comm_sms=24),
}
