"""Hardware descriptions for the cost model: links, clusters and the presets with their sources.

A cluster is two-level: `gpus_per_node` devices share a fast intra-node link (NVLink, Infinity
Fabric, PCIe, or the loopback of one host), and nodes are joined by a slower inter-node link
(InfiniBand, RoCE, Ethernet). Every number is in SI base units: seconds, bytes, bytes per second,
FLOP per second. Bandwidths are per device and per direction.

Every preset parameter carries a source: "spec" means the vendor's data sheet, "assumption" means a
value we chose (usually a commonly measured figure) and which the reader may override from the
command line. `treeattn simulate --preset NAME --show-preset` prints them.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path


def _check_positive(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value}")


def _check_nonnegative(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")


def _check_fraction(name: str, value: float) -> None:
    _check_nonnegative(name, value)
    if value > 1:
        raise ValueError(f"{name} must lie in [0, 1], got {value}")


@dataclass(frozen=True)
class Link:
    """A point-to-point link as seen by one device: time(n bytes) = latency + n / bandwidth.

    Attributes:
        latency: seconds per message (software + wire), > 0.
        bandwidth: bytes per second per direction that one device can push through it, > 0.
            This is the effective (achieved) figure; see the preset's notes for how it relates to
            the data-sheet number.
    """

    latency: float
    bandwidth: float

    def __post_init__(self) -> None:
        _check_positive("latency", self.latency)
        _check_positive("bandwidth", self.bandwidth)

    def transfer_seconds(self, nbytes: float) -> float:
        """Seconds to move one message of `nbytes` bytes over this link (0 bytes costs nothing)."""
        if nbytes <= 0:
            return 0.0
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Cluster:
    """A two-level cluster of identical devices.

    Attributes:
        name: preset name.
        gpus_per_node: devices sharing the intra-node link.
        memory_bandwidth: device memory bandwidth, bytes/s (data-sheet peak).
        memory_efficiency: fraction of memory_bandwidth an attention-decode kernel achieves, (0, 1].
        peak_flops: dense matrix FLOP/s of the device in the simulated dtype (prefill roofline).
        flops_efficiency: fraction of peak_flops a prefill attention kernel achieves, (0, 1].
        kernel_overhead: fixed seconds per attention kernel call (launch + tail).
        merge_seconds: seconds for one merge_states of two decode states (a few small kernels).
        collective_overhead: fixed seconds per collective or send/recv call on top of link latency.
        intra: the intra-node link.
        inter: the inter-node link.
        p2p_overlap: fraction of a ring step's transfer that hides behind that step's compute,
            in [0, 1]. 1 on GPUs (copy engines / NVLink DMA work beside the SMs); on a CPU host
            the transfer is a memcpy done by the same cores, so it is calibrated.
        host_cores: None for devices that each have their own compute and memory. For ranks that
            are processes on one host (the cpu-local preset), the number of cores they share:
            ranks beyond it time-slice, and memory bandwidth is shared by the running ranks.
        host_memory_bandwidth: with host_cores, the bandwidth all running ranks share, bytes/s.
        step_overhead: fixed software seconds per decode step, paid once by every method
            (framework dispatch, host synchronisation). 0 in every preset: the presets describe
            the hardware; set it to study a slow software stack.
        host_read_seconds: what one read of a device value on the host costs inside a decode
            step (tree_decode "onepass" reads its reduced fallback flag once per call): the stream
            drains and the device idles while the host launches the next kernels. 0 for ranks whose
            tensors live in host memory (cpu-local), where the read is a load.
        busy_round_p2p: for ranks that share `host_cores` cores, ((p, seconds), ...): the
            extra seconds the first p2p round after an attention costs when p ranks compute
            between rounds, on top of collective_overhead + latency: a receiving rank that went to sleep
            must be woken and scheduled again, and with p > host_cores it also waits for a core
            that another rank holds (oversubscription). Measured per world size by
            `treeattn bench calibrate`; empty (no term) in the GPU presets, where every rank has
            its own device and the idle latency already describes a round.
        busy_round_collective: the same for one small collective call (allreduce,
            allgather, broadcast), on top of the collective's own alpha-beta cost.
        busy_next_round_p2p: ((p, seconds), ...): the extra seconds of each further p2p round
            that follows another round back to back (no attention in between) among p ranks
            sharing the host, on top of collective_overhead + latency. Measured per world size by
            `treeattn bench calibrate` as (attention + two ring steps) - (attention + one).
        busy_next_round_collective: the same for a further small collective call issued right
            after another round (measured with two 4-byte allreduces back to back).
        memory_capacity: bytes of memory per device, None if unknown. With host_cores (ranks
            that are processes on one host) the memory all ranks share.
        sources: parameter name -> where its value comes from.
    """

    name: str
    gpus_per_node: int
    memory_bandwidth: float
    memory_efficiency: float
    peak_flops: float
    flops_efficiency: float
    kernel_overhead: float
    merge_seconds: float
    collective_overhead: float
    intra: Link
    inter: Link
    p2p_overlap: float = 1.0
    host_cores: int | None = None
    host_memory_bandwidth: float | None = None
    step_overhead: float = 0.0
    host_read_seconds: float = 0.0
    busy_round_p2p: tuple[tuple[int, float], ...] = ()
    busy_round_collective: tuple[tuple[int, float], ...] = ()
    busy_next_round_p2p: tuple[tuple[int, float], ...] = ()
    busy_next_round_collective: tuple[tuple[int, float], ...] = ()
    memory_capacity: float | None = None
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be an integer >= 1, got {self.gpus_per_node!r}")
        _check_positive("memory_bandwidth", self.memory_bandwidth)
        _check_positive("memory_efficiency", self.memory_efficiency)
        _check_fraction("memory_efficiency", self.memory_efficiency)
        _check_positive("peak_flops", self.peak_flops)
        _check_positive("flops_efficiency", self.flops_efficiency)
        _check_fraction("flops_efficiency", self.flops_efficiency)
        _check_nonnegative("kernel_overhead", self.kernel_overhead)
        _check_nonnegative("merge_seconds", self.merge_seconds)
        _check_nonnegative("collective_overhead", self.collective_overhead)
        _check_fraction("p2p_overlap", self.p2p_overlap)
        if self.host_cores is not None:
            if not isinstance(self.host_cores, int) or self.host_cores < 1:
                raise ValueError(f"host_cores must be None or an integer >= 1, got {self.host_cores!r}")
            if self.host_memory_bandwidth is None:
                raise ValueError("host_memory_bandwidth is required when host_cores is set")
        _check_nonnegative("step_overhead", self.step_overhead)
        _check_nonnegative("host_read_seconds", self.host_read_seconds)
        if self.host_memory_bandwidth is not None:
            _check_positive("host_memory_bandwidth", self.host_memory_bandwidth)
        if self.memory_capacity is not None:
            _check_positive("memory_capacity", self.memory_capacity)
        for name in BUSY_ROUND_TABLES:
            table = getattr(self, name)
            if table and self.host_cores is None:
                raise ValueError(f"{name} needs host_cores: it describes ranks sharing one host's cores")
            for entry in table:
                if len(entry) != 2 or not isinstance(entry[0], int) or entry[0] < 1:
                    raise ValueError(f"{name} must be ((world_size >= 1, seconds), ...), got {table!r}")
                _check_nonnegative(f"{name}[p={entry[0]}]", entry[1])

    def busy_round_seconds(self, ranks: int) -> tuple[float, float]:
        """(extra seconds per p2p step, extra seconds per collective call) for `ranks` busy ranks.

        Zero unless the ranks are processes sharing a host (host_cores set) and there are >= 2.
        A world size that was not measured takes the figure of the nearest measured one (the
        larger on a tie).
        """
        if self.host_cores is None or ranks < 2:
            return 0.0, 0.0
        return _nearest(self.busy_round_p2p, ranks), _nearest(self.busy_round_collective, ranks)

    def busy_next_round_seconds(self, ranks: int) -> tuple[float, float]:
        """(extra seconds per further p2p round, extra seconds per further collective call) for a
        round that follows another round back to back among `ranks` busy ranks; same rules as
        busy_round_seconds."""
        if self.host_cores is None or ranks < 2:
            return 0.0, 0.0
        return _nearest(self.busy_next_round_p2p, ranks), _nearest(self.busy_next_round_collective, ranks)

    @property
    def attention_bandwidth(self) -> float:
        """Bytes/s one device streams K and V at in a decode kernel."""
        return self.memory_bandwidth * self.memory_efficiency

    def nodes(self, gpus: int) -> int:
        """Number of nodes `gpus` devices occupy; raises if they do not fill whole nodes."""
        if not isinstance(gpus, int) or gpus < 1:
            raise ValueError(f"gpus must be an integer >= 1, got {gpus!r}")
        if gpus <= self.gpus_per_node:
            return 1
        if gpus % self.gpus_per_node != 0:
            raise ValueError(
                f"gpus ({gpus}) must be a multiple of gpus_per_node ({self.gpus_per_node}) "
                f"when it spans more than one node"
            )
        return gpus // self.gpus_per_node

    def with_overrides(self, **overrides: object) -> Cluster:
        """A copy with some parameters replaced, each marked 'override' in sources.

        Link parameters are given as intra_latency, intra_bandwidth, inter_latency, inter_bandwidth.
        None values are ignored. Every value is validated.
        """
        changes: dict[str, object] = {}
        sources = dict(self.sources)
        link_changes: dict[str, dict[str, float]] = {"intra": {}, "inter": {}}
        names = {f.name for f in fields(self)}
        for key, value in overrides.items():
            if value is None:
                continue
            prefix, _, attr = key.partition("_")
            if prefix in link_changes and attr in ("latency", "bandwidth"):
                link_changes[prefix][attr] = value  # type: ignore[assignment]
            elif key in names and key not in ("name", "sources", "intra", "inter"):
                changes[key] = value
            else:
                raise ValueError(f"unknown cluster parameter {key!r}")
            sources[key] = "override (command line or caller)"
        for which, link_change in link_changes.items():
            if link_change:
                try:
                    changes[which] = replace(getattr(self, which), **link_change)
                except (ValueError, TypeError) as err:
                    raise type(err)(f"{which}_{err}") from None
        return replace(self, sources=sources, **changes)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Cluster:
        data = dict(data)
        for name in BUSY_ROUND_TABLES:
            if name in data:  # JSON turns the pairs into lists
                data[name] = tuple((int(p), float(s)) for p, s in data[name])  # type: ignore[union-attr]
        data["intra"] = Link(**data["intra"])  # type: ignore[arg-type]
        data["inter"] = Link(**data["inter"])  # type: ignore[arg-type]
        return cls(**data)  # type: ignore[arg-type]


BUSY_ROUND_TABLES = ("busy_round_p2p", "busy_round_collective", "busy_next_round_p2p", "busy_next_round_collective")


def _nearest(table: tuple[tuple[int, float], ...], ranks: int) -> float:
    """The seconds of the entry whose world size is nearest `ranks` (the larger on a tie); 0 if empty."""
    if not table:
        return 0.0
    return min(table, key=lambda entry: (abs(entry[0] - ranks), -entry[0]))[1]


GB = 1e9
GIB = 2**30
US = 1e-6
TFLOPS = 1e12


@dataclass(frozen=True)
class ClusterFlag:
    """A Cluster parameter the command line overrides (`treeattn simulate --mem-bw-gbs 2000`).

    Attributes:
        key: the parameter as Cluster.with_overrides names it (intra_latency for intra.latency).
        name: the flag's parameter name (--mem-bw-gbs for mem_bw_gbs); its value is in the flag's unit.
        scale: SI units per flag unit (GB for GB/s, US for us); 1 for a count or a fraction.
        help: the flag's help.
        kind: the flag's type, int or float.
    """

    key: str
    name: str
    scale: float
    help: str
    kind: type = float


CLUSTER_FLAGS = (
    ClusterFlag("gpus_per_node", "gpus_per_node", 1, "Override the preset's devices per node.", int),
    ClusterFlag("memory_bandwidth", "mem_bw_gbs", GB, "Device memory bandwidth, GB/s."),
    ClusterFlag("memory_efficiency", "mem_efficiency", 1, "Fraction of memory bandwidth a decode kernel reaches."),
    ClusterFlag("peak_flops", "peak_tflops", TFLOPS, "Dense peak, TFLOP/s."),
    ClusterFlag("flops_efficiency", "flops_efficiency", 1, "Fraction of peak reached in prefill."),
    ClusterFlag("kernel_overhead", "kernel_overhead_us", US, "Fixed cost per attention kernel, us."),
    ClusterFlag("merge_seconds", "merge_us", US, "Cost of one merge of two states, us."),
    ClusterFlag("collective_overhead", "collective_overhead_us", US, "Fixed cost per collective or send/recv call, us."),
    ClusterFlag("intra_latency", "intra_latency_us", US, "Intra-node link latency, us."),
    ClusterFlag("intra_bandwidth", "intra_bw_gbs", GB, "Intra-node bandwidth per device per direction, GB/s."),
    ClusterFlag("inter_latency", "inter_latency_us", US, "Inter-node link latency, us."),
    ClusterFlag("inter_bandwidth", "inter_bw_gbs", GB, "Inter-node bandwidth per device per direction, GB/s."),
    ClusterFlag("p2p_overlap", "p2p_overlap", 1, "Fraction of a ring transfer hidden behind compute, [0, 1]."),
    ClusterFlag("step_overhead", "step_overhead_us", US, "Fixed software cost per decode step (every method), us."),
    ClusterFlag("memory_capacity", "memory_gib", GIB, "Memory per device, GiB (cpu-local: the host's, shared by the ranks)."),
)
"""The command line's Cluster overrides, in the Cluster's field order: one entry per flag."""


def cluster_overrides(values: dict[str, float | int | None]) -> dict[str, float | int | None]:
    """Cluster.with_overrides keywords, in SI units, from flag values (CLUSTER_FLAGS name -> value in
    the flag's unit; a missing or None value stays None: the preset's).

        >>> cluster_overrides({"mem_bw_gbs": 2000, "merge_us": 5})["memory_bandwidth"]
        2000000000000.0
        >>> cluster = PRESETS["dgx-h100"].with_overrides(**cluster_overrides({"gpus_per_node": 4, "intra_bw_gbs": 100}))
        >>> cluster.nodes(8), cluster.intra.bandwidth
        (2, 100000000000.0)
    """
    unknown = set(values) - {f.name for f in CLUSTER_FLAGS}
    if unknown:
        raise ValueError(f"cluster_overrides takes CLUSTER_FLAGS names, got {sorted(unknown)}")
    return {f.key: None if values.get(f.name) is None else values[f.name] * f.scale for f in CLUSTER_FLAGS}

# --------------------------------------------------------------------------------------- presets
# Sources (data sheets, read 2024):
#   H100 SXM5: HBM3 3.35 TB/s; 989 TFLOP/s dense BF16; NVLink 4 900 GB/s total (bidirectional) per
#     GPU through NVSwitch, i.e. 450 GB/s per direction (NVIDIA H100 Tensor Core GPU data sheet).
#   DGX H100: 8 GPUs per node, 8x ConnectX-7 400 Gb/s NDR InfiniBand, one per GPU (DGX H100 user
#     guide; also the paper, section 6: "8 InfiniBand NDR interconnects per node (1 per GPU)").
#   MI300X: HBM3 5.3 TB/s; 1307 TFLOP/s dense BF16; 7 Infinity Fabric links per GPU, 128 GB/s
#     bidirectional each (896 GB/s aggregate), so one peer is reached at 64 GB/s per direction
#     (AMD Instinct MI300X data sheet / platform brief).
#   RTX 4090: GDDR6X 1008 GB/s; 165 TFLOP/s dense BF16 with FP32 accumulate; PCIe 4.0 x16,
#     31.5 GB/s per direction; peer-to-peer is disabled on GeForce cards, so transfers are staged
#     through host memory (NVIDIA Ada GPU architecture white paper).
# Assumptions (commonly measured values, not data-sheet figures) are marked as such.

_DGX_H100 = Cluster(
    name="dgx-h100",
    gpus_per_node=8,
    memory_bandwidth=3.35e12,
    memory_efficiency=0.8,
    peak_flops=989e12,
    flops_efficiency=0.6,
    kernel_overhead=5 * US,
    merge_seconds=5 * US,
    collective_overhead=5 * US,
    memory_capacity=80 * GIB,
    host_read_seconds=10 * US,
    intra=Link(latency=3 * US, bandwidth=0.8 * 450 * GB),
    inter=Link(latency=8 * US, bandwidth=0.9 * 50 * GB),
    p2p_overlap=1.0,
    sources={
        "memory_capacity": "spec: H100 SXM5 80 GB HBM3 per device",
        "gpus_per_node": "spec: DGX H100, 8 GPUs per node",
        "memory_bandwidth": "spec: H100 SXM5 HBM3 3.35 TB/s",
        "memory_efficiency": "assumption: flash-decoding kernels reach ~80% of HBM bandwidth",
        "peak_flops": "spec: H100 SXM5 989 TFLOP/s dense BF16",
        "flops_efficiency": "assumption: FlashAttention-2 forward reaches ~60% of peak",
        "kernel_overhead": "assumption: ~5 us launch + tail per CUDA kernel",
        "merge_seconds": "assumption: one small fused kernel, ~5 us",
        "collective_overhead": "assumption: ~5 us NCCL kernel launch per collective or send/recv",
        "host_read_seconds": "assumption: ~10 us: a device-to-host copy of one value after the allreduce (~5 us), "
                             "then the device idles through the next kernel's launch (~5 us)",
        "intra.latency": "assumption: ~3 us NCCL send/recv over NVLink for small messages",
        "intra.bandwidth": "spec 450 GB/s per direction (NVLink 4, 900 GB/s bidirectional) x 0.8 achieved (assumption)",
        "inter.latency": "assumption: ~8 us NCCL send/recv across InfiniBand NDR for small messages",
        "inter.bandwidth": "spec 400 Gb/s = 50 GB/s per GPU (ConnectX-7 NDR) x 0.9 achieved (assumption)",
        "p2p_overlap": "assumption: copy engines overlap transfers with compute completely",
    },
)

_MI300X = Cluster(
    name="mi300x",
    gpus_per_node=8,
    memory_bandwidth=5.3e12,
    memory_efficiency=0.7,
    peak_flops=1307e12,
    flops_efficiency=0.5,
    kernel_overhead=8 * US,
    merge_seconds=8 * US,
    collective_overhead=10 * US,
    memory_capacity=192 * GIB,
    host_read_seconds=10 * US,
    intra=Link(latency=5 * US, bandwidth=0.8 * 64 * GB),
    inter=Link(latency=10 * US, bandwidth=0.85 * 50 * GB),
    p2p_overlap=1.0,
    sources={
        "memory_capacity": "spec: MI300X 192 GB HBM3 per device",
        "gpus_per_node": "spec: 8x MI300X platform (the paper used 4 of them in Table 1)",
        "memory_bandwidth": "spec: MI300X HBM3 5.3 TB/s",
        "memory_efficiency": "assumption: decode kernels reach ~70% of HBM bandwidth",
        "peak_flops": "spec: MI300X 1307 TFLOP/s dense BF16",
        "flops_efficiency": "assumption: ~50% of peak in attention prefill",
        "kernel_overhead": "assumption: ~8 us launch + tail per HIP kernel",
        "merge_seconds": "assumption: one small kernel, ~8 us",
        "collective_overhead": "assumption: ~10 us RCCL launch per collective or send/recv",
        "host_read_seconds": "assumption: ~10 us: a device-to-host copy of one value, then the next kernel's launch",
        "intra.latency": "assumption: ~5 us RCCL send/recv over Infinity Fabric",
        "intra.bandwidth": "spec 64 GB/s per direction to one peer (128 GB/s bidirectional link) x 0.8 achieved (assumption)",
        "inter.latency": "assumption: ~10 us over RoCE",
        "inter.bandwidth": "assumption: one 400 Gb/s RoCE NIC per GPU (50 GB/s) x 0.85 achieved",
        "p2p_overlap": "assumption: DMA engines overlap transfers with compute completely",
    },
)

_RTX4090_PCIE = Cluster(
    name="rtx4090-pcie",
    gpus_per_node=2,
    memory_bandwidth=1.008e12,
    memory_efficiency=0.8,
    peak_flops=165e12,
    flops_efficiency=0.6,
    kernel_overhead=5 * US,
    merge_seconds=5 * US,
    collective_overhead=10 * US,
    memory_capacity=24 * GIB,
    host_read_seconds=10 * US,
    intra=Link(latency=15 * US, bandwidth=0.7 * 31.5 * GB),
    inter=Link(latency=30 * US, bandwidth=0.9 * 1.25 * GB),
    p2p_overlap=1.0,
    sources={
        "memory_capacity": "spec: RTX 4090 24 GB GDDR6X per device",
        "gpus_per_node": "spec: the paper's 2x RTX 4090 box (Table 2)",
        "memory_bandwidth": "spec: RTX 4090 GDDR6X 1008 GB/s",
        "memory_efficiency": "assumption: ~80% of memory bandwidth",
        "peak_flops": "spec: RTX 4090 165 TFLOP/s dense BF16 with FP32 accumulate",
        "flops_efficiency": "assumption: ~60% of peak in attention prefill",
        "kernel_overhead": "assumption: ~5 us launch + tail per CUDA kernel",
        "merge_seconds": "assumption: one small kernel, ~5 us",
        "collective_overhead": "assumption: ~10 us NCCL launch (no P2P, staged through host)",
        "host_read_seconds": "assumption: ~10 us: a device-to-host copy of one value, then the next kernel's launch",
        "intra.latency": "assumption: ~15 us through host memory (GeForce P2P disabled)",
        "intra.bandwidth": "spec PCIe 4.0 x16 31.5 GB/s per direction x 0.7 achieved through host staging (assumption)",
        "inter.latency": "assumption: 10 GbE between boxes, ~30 us",
        "inter.bandwidth": "assumption: 10 GbE (1.25 GB/s) x 0.9",
        "p2p_overlap": "assumption: copy engines overlap transfers with compute completely",
    },
)

# GB200 NVL72 (the Helix paper's system, arXiv 2507.07120): 72 Blackwell GPUs in one NVLink domain.
#   B200 in GB200: HBM3e 8 TB/s and 186 GB per GPU (GB200 NVL72 data sheet: 576 TB/s and 13.4 TB for 72
#   GPUs); NVLink 5: 1.8 TB/s bidirectional per GPU = 900 GB/s per direction; FP8 dense 5 PFLOP/s per GPU
#   (the data sheet's 720 PFLOP/s FP8 for 72 GPUs is with sparsity: half of it dense). The Helix paper's own
#   roofline (its Figure 1) uses MemBW = 8000 GB/s.
_GB200_NVL72 = Cluster(
    name="gb200-nvl72",
    gpus_per_node=72,
    memory_bandwidth=8e12,
    memory_efficiency=0.8,
    peak_flops=5e15,
    flops_efficiency=0.6,
    kernel_overhead=2 * US,
    merge_seconds=2 * US,
    collective_overhead=3 * US,
    memory_capacity=186 * GB,
    host_read_seconds=10 * US,
    intra=Link(latency=2 * US, bandwidth=0.8 * 900 * GB),
    inter=Link(latency=8 * US, bandwidth=0.9 * 100 * GB),
    p2p_overlap=1.0,
    sources={
        "memory_capacity": "spec: GB200 NVL72, 13.4 TB HBM3e for 72 GPUs = 186 GB per GPU",
        "gpus_per_node": "spec: GB200 NVL72, 72 GPUs in one NVLink domain",
        "memory_bandwidth": "spec: GB200 NVL72, 576 TB/s for 72 GPUs = 8 TB/s per GPU (the Helix paper's MemBW too)",
        "memory_efficiency": "assumption: decode kernels and GEMVs reach ~80% of HBM bandwidth",
        "peak_flops": "spec: GB200 NVL72 FP8 720 PFLOP/s with sparsity for 72 GPUs = 5 PFLOP/s dense per GPU",
        "flops_efficiency": "assumption: ~60% of peak in attention and GEMMs",
        "kernel_overhead": "assumption: ~2 us per kernel inside a CUDA graph (no launch from the host)",
        "merge_seconds": "assumption: one small fused kernel, ~2 us",
        "collective_overhead": "assumption: ~3 us per NCCL collective or send/recv inside a CUDA graph",
        "host_read_seconds": "assumption: ~10 us: a device-to-host copy of one value, then the next kernel's launch",
        "intra.latency": "assumption: ~2 us per NVLink 5 message through the NVLink switch",
        "intra.bandwidth": "spec 900 GB/s per direction (NVLink 5, 1.8 TB/s bidirectional) x 0.8 achieved (assumption)",
        "inter.latency": "assumption: ~8 us per message across racks (not used inside one NVL72)",
        "inter.bandwidth": "assumption: one 800 Gb/s NIC per GPU (100 GB/s) x 0.9 achieved",
        "p2p_overlap": "assumption: copy engines overlap transfers with compute completely",
    },
)

PRESETS: dict[str, Cluster] = {c.name: c for c in (_DGX_H100, _MI300X, _RTX4090_PCIE, _GB200_NVL72)}
CALIBRATED_PRESET = "cpu-local"
PRESET_NAMES: tuple[str, ...] = (*PRESETS, CALIBRATED_PRESET)
DEFAULT_CALIBRATION_PATH = Path("calibration.json")


def load_cluster(preset: str, calibration: str | Path | None = None) -> Cluster:
    """Return the named preset; "cpu-local" is read from a calibration file.

    Args:
        preset: one of PRESET_NAMES.
        calibration: path of the JSON written by `treeattn bench calibrate` (only for cpu-local;
            default ./calibration.json).
    """
    if preset in PRESETS:
        return PRESETS[preset]
    if preset != CALIBRATED_PRESET:
        raise ValueError(f"preset must be one of {', '.join(PRESET_NAMES)}, got {preset!r}")
    path = Path(calibration) if calibration is not None else DEFAULT_CALIBRATION_PATH
    if not path.is_file():
        raise ValueError(
            f"preset 'cpu-local' needs a calibration file; {str(path)!r} does not exist. "
            f"Run `treeattn bench calibrate --output {path}` first."
        )
    data = json.loads(path.read_text())
    if "cluster" not in data:
        raise ValueError(f"{str(path)!r} is not a calibration file (no 'cluster' key)")
    cluster = Cluster.from_dict(data["cluster"])
    if "memory_capacity" not in data["cluster"] and (ram := host_memory_bytes()) is not None:  # written before the field
        cluster = replace(cluster, memory_capacity=float(ram),
                          sources={**cluster.sources, "memory_capacity": "this machine's RAM (os.sysconf), shared by the ranks"})
    return cluster


def host_memory_bytes() -> int | None:
    """Physical memory of this machine, or None if unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
