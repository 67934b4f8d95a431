"""Hardware profiles: what the performance model needs to know about one GPU and its host, or
(with a [node] table) a node of several GPUs, their links and the network to other nodes.

Units: bandwidths in GB/s (10^9 bytes/s), compute in TFLOPS (10^12 flop/s, what a large
matmul realistically reaches, not the datasheet peak), throughputs in parameters per second,
memory sizes as byte sizes ("24GiB"). All numbers are typical, not guarantees; measure and
write your own profile (any TOML path is accepted wherever a name is).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .schema import validate_fields

_SIZE = {"size": True}


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """The accelerator (on `simulated = true` profiles: CPU memory standing in for it)."""

    memory: int = field(metadata=_SIZE)
    """Device memory usable by the run."""
    bf16_tflops: float
    """Achievable dense bf16 matmul throughput."""
    fp32_tflops: float
    """Achievable dense fp32 matmul throughput (full fp32, no TF32: torch's default)."""
    memory_bandwidth_gbps: float
    """Device memory bandwidth (the GPU optimizer update is bound by it)."""
    simulated: bool = False
    """True for the CPU-only simulated device (every tier is host memory)."""

    def __post_init__(self) -> None:
        validate_fields(self)


@dataclass(frozen=True, kw_only=True)
class PcieSpec:
    """The host <-> device link, as measured with large copies."""

    gen: int = field(metadata={"min": 0})
    """PCIe generation (informative; 0 for the simulated device)."""
    h2d_pinned_gbps: float
    """Host-to-device from pinned memory."""
    d2h_pinned_gbps: float
    """Device-to-host into pinned memory."""
    h2d_pageable_gbps: float
    """Host-to-device from pageable memory."""
    d2h_pageable_gbps: float
    """Device-to-host into pageable memory."""

    def __post_init__(self) -> None:
        validate_fields(self)


@dataclass(frozen=True, kw_only=True)
class HostSpec:
    """CPU and DRAM."""

    memory: int | None = field(default=None, metadata=_SIZE)
    """Installed DRAM (a default for the host budget; None = not stated)."""
    dram_bandwidth_gbps: float
    """Achievable DRAM bandwidth (STREAM-like), shared by the CPU update and all DMA."""
    cpu_cores: int
    """Physical cores available to the run (the optimizer and the NVMe I/O threads share them)."""
    cpu_fp32_tflops: float
    """Achievable fp32 matmul throughput on all cores (low-rank projections on CPU)."""
    adamw_params_per_s: float
    """fp32 AdamW update throughput on all cores (fused / DeepSpeedCPUAdam-class kernel)."""
    adamw8bit_params_per_s: float | None = None
    """8-bit blockwise AdamW update throughput on all cores (None: AdamW's: our C kernel runs at
    1.0-1.07x fused AdamW on its AVX2 path, 1.2-1.4x on AVX-512; the H200 host's 16 cores 7.5e9
    vs 4.9e9 parameters/s)."""
    op_overhead_us: float | None = None
    """Host cost of one op or module hook the performance model counts, in microseconds (None: not
    measured, priced as free). The simulated device adds it to compute; on a GPU the launching
    thread is a resource of each phase ("host launch"), measured by `finetune profile` through
    the engine (a tiny streamed Llama: launch thread only)."""
    step_calibration: float | None = None
    """Measured / modelled step time of a proxy model (`finetune profile`; None: 1, uncalibrated).
    It absorbs what the model does not price op by op: softmax, norms, elementwise work,
    allocator traffic. The simulated device: fitted to proxies run by the engine, scaling its
    compute phases but their per-op dispatch (dispatch_calibration); CUDA: plain PyTorch's
    forward + backward of a bf16 proxy against its matmul flops at the GEMM rate, scaling
    "gpu compute"."""
    step_calibration_bf16: float | None = None
    """The simulated device only: step_calibration of the wider proxy run in bf16 (None: the fp32
    one's). A CPU's bf16 GEMM probe runs 2-4x its fp32 one while a small model's whole bf16 step
    gains far less (casts, norms in fp32): one factor for both priced bf16 runs 1.9x too fast."""
    dispatch_calibration: float | None = None
    """The simulated device only: the factor on its per-op dispatch cost (ops x `op_overhead_us`),
    fitted with step_calibration, which then scales the rest of its compute (None: step_calibration
    scales both). `finetune profile` fits the two from a narrow proxy (mostly dispatch) and a
    wider one (mostly matmuls)."""
    dispatch_calibration_bf16: float | None = None
    """The simulated device only: dispatch_calibration fitted with the proxies run in bf16 (None:
    the fp32 one's); a CPU's bf16 ops cost more per call than its fp32 ones."""

    def __post_init__(self) -> None:
        if self.adamw8bit_params_per_s is None:
            object.__setattr__(self, "adamw8bit_params_per_s", self.adamw_params_per_s)
        validate_fields(self)


@dataclass(frozen=True, kw_only=True)
class CxlSpec:
    """A CXL memory expander (a CPU-less NUMA node)."""

    memory: int = field(metadata=_SIZE)
    """Capacity of the expander."""
    bandwidth_gbps: float
    """Achievable bandwidth to the expander."""
    latency_ns: float
    """Load latency (informative; chunk streaming is bandwidth-bound)."""

    def __post_init__(self) -> None:
        validate_fields(self)


def unmeasured_cxl(memory: int) -> CxlSpec:
    """CXL memory no profile describes (a node detected here, or one the engine emulates in host
    memory): priced at the cpu-sim profile's host DRAM rate until `finetune profile` measures it."""
    return CxlSpec(memory=memory, bandwidth_gbps=20.0, latency_ns=300.0)


@dataclass(frozen=True, kw_only=True)
class NvmeSpec:
    """The swap drive(s), as seen through O_DIRECT with aligned pinned buffers."""

    read_gbps: float
    """Sequential large-block read bandwidth."""
    write_gbps: float
    """Sequential large-block write bandwidth."""
    capacity: int | None = field(default=None, metadata=_SIZE)
    """Free space for swap files (None = not stated)."""

    def __post_init__(self) -> None:
        validate_fields(self)


#: How the GPUs of a node reach each other: "nvlink" (their own links, no PCIe or host traffic),
#: "pcie" (peer to peer over the PCIe switch: each GPU's PCIe link carries it), "host" (staged
#: through host memory, as NCCL's SHM transport does where peer access is off, e.g. GeForce
#: RTX 40-series, or gloo between processes: the PCIe links and host DRAM carry it).
GPU_LINKS = ("nvlink", "pcie", "host")


@dataclass(frozen=True, kw_only=True)
class NodeSpec:
    """Several GPUs in one node, and the network to other nodes. The [host], [cxl] and [nvme]
    tables then describe the whole node (its local ranks share them); [gpu] and [pcie] one GPU."""

    gpus: int
    """GPUs in the node (the most `--nproc-per-node` can use)."""
    gpu_link: str = field(metadata={"choices": GPU_LINKS})
    """How the GPUs reach each other (see GPU_LINKS)."""
    gpu_link_gbps: float
    """Achievable bandwidth of one collective between the node's GPUs (NCCL bus bandwidth of a
    broadcast / reduce), GB/s."""
    network_gbps: float | None = None
    """Achievable bandwidth from this node to the others (all its NICs together), GB/s; None:
    a single node (`--nnodes` above 1 is refused)."""

    def __post_init__(self) -> None:
        validate_fields(self)


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """One GPU (or a node of several: [node]), its host and optional CXL memory and NVMe drive."""

    name: str
    """Canonical name, e.g. "rtx4090"."""
    aliases: tuple[str, ...] = ()
    """Other names it answers to (case-insensitive)."""
    description: str = ""
    """One line for listings."""
    extends: str | None = None
    """Name of a profile whose tables this one starts from (its own keys override)."""
    gpu: GpuSpec
    pcie: PcieSpec
    host: HostSpec
    cxl: CxlSpec | None = None
    nvme: NvmeSpec | None = None
    node: NodeSpec | None = None
    """Several GPUs per node (None: one GPU, no network)."""

    @property
    def gpus_per_node(self) -> int:
        return self.node.gpus if self.node is not None else 1

    @property
    def simulated(self) -> bool:
        return self.gpu.simulated

    def gpu_tflops(self, precision: str) -> float:
        """Achievable matmul TFLOPS in the compute precision ("bf16" or "fp32")."""
        return self.gpu.bf16_tflops if precision == "bf16" else self.gpu.fp32_tflops
