"""Named hardware profiles for the analytic model (hardware you do not have).

Figures are typical *achieved* values, not datasheet peaks, from REFERENCE.md and public
measurements; treat them as defaults to replace with your own (``Hardware(...)``, or
``replace(PROFILES["A100-80GB-PCIe4"], h2d_bps=20e9)``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shfx.passes.units import format_bandwidth, format_bytes

__all__ = ["Hardware", "PROFILES", "get_profile", "Network", "NETWORKS", "get_network", "with_data_parallel"]

GB = 1e9
GiB = 2**30


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its host.

    Attributes:
        name: profile name.
        device_memory_bytes: accelerator memory.
        flops: achieved dense matmul FLOP/s per dtype, e.g. ``{"float32": 14e12, "bfloat16": 100e12}``.
        device_mem_bps: device memory bandwidth (bounds elementwise work).
        h2d_bps, d2h_bps: pinned host<->device bandwidth one way at a time.
        duplex: fraction of its one-way bandwidth each direction keeps while both copy.
        link_latency_s: fixed cost per copy.
        host_cores: cores available to the host optimizer.
        host_mem_bps: host memory bandwidth (AdamW moves ~28 bytes per parameter).
        host_memory_bytes: host RAM.
        ssd_read_bps, ssd_write_bps: NVMe bandwidth (0: none).
        ssd_duplex: fraction of its bandwidth each of reads and writes keeps while the other
            runs (an NVMe drive shares flash and controller; :class:`~shfx.cost_model.costs.Links`).
        ssd_latency_s: fixed cost per SSD request.
        ssd_queue_depth: requests the NVMe tier keeps in flight per transfer (the bandwidth
            figures are those reached at that depth).
        ssd_bytes: NVMe capacity usable for offloaded optimizer states (0: none; the
            planner's ``zero-infinity`` spills there when host RAM overflows).
        net_bps: data parallel: the node's network bandwidth, bytes/s per direction (0: none,
            a single node); ``net_latency_s``: its latency per collective step (one hop of a ring).
        peer_bps: bandwidth between two accelerators of one node, bytes/s per direction (0: the
            host link's ``h2d_bps``: PCIe without NVLink); ``peer_latency_s``: per step (0: the
            host link's ``link_latency_s``).
        ranks_per_node: data-parallel ranks (accelerators) per node; ``nodes``: nodes. The
            ranks are ``ranks_per_node x nodes``; ``host_memory_bytes`` is per node, shared by
            its ranks (:func:`with_data_parallel` sets these four from a :class:`Network`).
    """

    name: str
    device_memory_bytes: int
    flops: dict
    device_mem_bps: float
    h2d_bps: float
    d2h_bps: float
    duplex: float
    link_latency_s: float
    host_cores: int
    host_mem_bps: float
    host_memory_bytes: int
    ssd_read_bps: float = 0.0
    ssd_write_bps: float = 0.0
    ssd_bytes: int = 0
    ssd_duplex: float = 0.5
    ssd_latency_s: float = 100e-6
    ssd_queue_depth: int = 32
    net_bps: float = 0.0
    net_latency_s: float = 0.0
    peer_bps: float = 0.0
    peer_latency_s: float = 0.0
    ranks_per_node: int = 1
    nodes: int = 1

    @property
    def ranks(self) -> int:
        """Data-parallel ranks: ``ranks_per_node x nodes``."""
        return self.ranks_per_node * self.nodes

    def collective_link(self) -> tuple[float | None, float]:
        """``(bytes/s per direction, latency per step)`` of the slowest link of the ring the
        collectives run on: between the accelerators of a node (``peer_bps``) with one node,
        the network (``net_bps``; the slower of both when a node has several ranks) with
        several; ``(None, 0.0)`` with one rank (no collective).

        >>> v = with_data_parallel("V100-32GB-PCIe3", 8, nodes=8, network="25gbe")
        >>> v.collective_link() == (NETWORKS["25gbe"].bps, NETWORKS["25gbe"].latency_s)
        True
        """
        if self.ranks == 1:
            return None, 0.0
        peer = (self.peer_bps or self.h2d_bps, self.peer_latency_s or self.link_latency_s)
        if self.nodes == 1:
            return peer
        if not self.net_bps > 0:
            raise ValueError(
                f"{self.name} has {self.nodes} nodes but no network bandwidth (net_bps=0): give one, e.g. "
                "with_data_parallel(hw, ranks, nodes=..., network='25gbe')"
            )
        net = (self.net_bps, self.net_latency_s)
        if self.ranks_per_node == 1:
            return net
        return min(net[0], peer[0]), max(net[1], peer[1])

    def matmul_flops(self, dtype: str = "float32") -> float:
        """Achieved matmul FLOP/s in ``dtype`` (a key of :attr:`flops`; the short names
        ``fp32``/``bf16``/``fp16`` are accepted for those three)."""
        dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(dtype, dtype)
        try:
            return self.flops[dtype]
        except KeyError:
            raise KeyError(f"{self.name} has no FLOP/s figure for {dtype}; known: {', '.join(self.flops)}") from None

    def describe(self) -> str:
        fl = ", ".join(f"{k} {v / 1e12:.0f} TFLOP/s" for k, v in self.flops.items())
        dp = ""
        if self.ranks > 1:
            bps, lat = self.collective_link()
            dp = (
                f"; data parallel: {self.ranks} ranks ({self.nodes} node{'s' if self.nodes > 1 else ''} of {self.ranks_per_node}), "
                f"ring bottleneck {format_bandwidth(bps or 0)}, {lat * 1e6:.0f} us per step"
            )
        return (
            f"{self.name}: {format_bytes(self.device_memory_bytes)} device, {fl}; h2d {format_bandwidth(self.h2d_bps)}, "
            f"d2h {format_bandwidth(self.d2h_bps)}, duplex {self.duplex}; host {self.host_cores} cores, "
            f"{format_bandwidth(self.host_mem_bps)} memory, {format_bytes(self.host_memory_bytes)} RAM" + dp
        )


PROFILES: dict[str, Hardware] = {
    # STRONGHOLD's artifact machine: 32 GB V100 on PCIe 3, 90 GB host RAM, 12 cores.
    "V100-32GB-PCIe3": Hardware(
        name="V100-32GB-PCIe3",
        device_memory_bytes=32 * GiB,
        # NOTE: Volta has no bf16 tensor cores; bf16 matmuls run on the CUDA cores at about the
        # fp32 rate. fp16 (with loss scaling) is this card's 16-bit format.
        flops={"float32": 12.5e12, "float16": 90e12, "bfloat16": 12.5e12},
        device_mem_bps=800 * GB,
        h2d_bps=12 * GB,
        d2h_bps=12 * GB,
        duplex=0.85,
        link_latency_s=10e-6,
        host_cores=12,
        host_mem_bps=60 * GB,
        host_memory_bytes=90 * GiB,
        ssd_read_bps=3 * GB,
        ssd_write_bps=2 * GB,
        # V100s without NVLink exchange data over PCIe 3 x16 (~12 GB/s achieved, REFERENCE.md)
        peer_bps=12 * GB,
        peer_latency_s=10e-6,
    ),
    "A100-80GB-PCIe4": Hardware(
        name="A100-80GB-PCIe4",
        device_memory_bytes=80 * GiB,
        flops={"float32": 17e12, "tf32": 120e12, "bfloat16": 230e12, "float16": 230e12},
        device_mem_bps=1800 * GB,
        h2d_bps=25 * GB,
        d2h_bps=25 * GB,
        duplex=0.45,  # PCIe4 H2D falls to ~11 GB/s while D2H runs
        link_latency_s=8e-6,
        host_cores=32,
        host_mem_bps=150 * GB,
        host_memory_bytes=512 * GiB,
        ssd_read_bps=10 * GB,
        ssd_write_bps=5 * GB,
    ),
    "H100-80GB-PCIe5": Hardware(
        name="H100-80GB-PCIe5",
        device_memory_bytes=80 * GiB,
        flops={"float32": 48e12, "tf32": 350e12, "bfloat16": 650e12, "float16": 650e12},
        device_mem_bps=2800 * GB,
        h2d_bps=55 * GB,
        d2h_bps=55 * GB,
        duplex=52 / 55,
        link_latency_s=6e-6,
        host_cores=48,
        host_mem_bps=250 * GB,
        host_memory_bytes=1024 * GiB,
        ssd_read_bps=12 * GB,
        ssd_write_bps=6 * GB,
    ),
    "GH200": Hardware(
        name="GH200",
        device_memory_bytes=96 * GiB,
        flops={"float32": 60e12, "tf32": 450e12, "bfloat16": 800e12, "float16": 800e12},
        device_mem_bps=3500 * GB,
        h2d_bps=300 * GB,
        d2h_bps=300 * GB,
        duplex=160 / 300,
        link_latency_s=4e-6,
        host_cores=72,
        host_mem_bps=450 * GB,
        host_memory_bytes=480 * GiB,
        ssd_read_bps=12 * GB,
        ssd_write_bps=6 * GB,
    ),
}

# ---- beyond host RAM (issue 26): a consumer card with one SSD, an H100 with four --------------
# NOTE: cited figures; where a figure is an estimate (not on a spec sheet, not measured by the
# source) the comment says so. The SSD capacity stays 0 as in every profile: give it (--ssd).

# RTX 4090 (AD102), the card LoHan (arXiv 2403.06504) fine-tunes a 175B model on:
# - 24 GB GDDR6X, 1008 GB/s, PCIe 4.0 x16; dense BF16/FP16 tensor throughput with FP32 accumulate
#   165.2 TFLOP/s, TF32 82.6, FP32 (non-tensor) 82.6 (NVIDIA Ada Lovelace architecture
#   whitepaper, RTX 4090 column). 165.5 TF/s BF16/FP32-accumulate was measured at stock clocks
#   (github.com/JustAResearcher/gpu-unlock-ada, rtx4090-register-report.md, "Baseline" column).
#   Achieved matmul rates below are estimates, ~90% of those (as this file's other profiles).
# - host link: PCIe 4.0 x16, ~25 GB/s pinned one way, H2D falling to ~11 while D2H runs (REFERENCE.md).
# - SSD: one consumer PCIe 4.0 x4 NVMe drive, e.g. Samsung 990 PRO: up to 7,450 MB/s sequential
#   read and 6,900 MB/s write (Samsung's spec sheet); 7 / 6 GB/s achieved (an estimate: sustained
#   writes past the drive's SLC cache are lower, measure yours).
# - host: 256 GiB of RAM (LoHan's "256 GB main memory", arXiv 2403.06504v2 abstract); 32 cores
#   and ~100 GB/s of host memory bandwidth are estimates for a workstation (not from LoHan).
PROFILES["RTX4090-24GB"] = Hardware(
    name="RTX4090-24GB",
    device_memory_bytes=24 * GiB,
    flops={"float32": 60e12, "tf32": 75e12, "bfloat16": 150e12, "float16": 150e12},
    device_mem_bps=900 * GB,
    h2d_bps=25 * GB,
    d2h_bps=25 * GB,
    duplex=0.45,
    link_latency_s=8e-6,
    host_cores=32,
    host_mem_bps=100 * GB,
    host_memory_bytes=256 * GiB,
    ssd_read_bps=7 * GB,
    ssd_write_bps=6 * GB,
)

# RTX 4090 with LoHan's SSDs: the profile above with the twelve Intel (Solidigm) D7-P5510 3.84 TB
# drives of LoHan's testbed striped (RAID-0) instead of one consumer drive. The testbed: "Dual Intel
# Xeon Gold 5320 CPU", "768 GB 3200 MHz DDR4 (16 channels in total)", one RTX 4090, "12x D7-P5510
# 3.84 TB SSD" (github.com/RC4ML/LoHan, the paper's ICDE 2025 artifact, evaluation_data.md; its
# make_raid.sh makes /dev/nvme0n1..nvme11n1 one mdadm level-0 array). Per drive 6,500 MB/s sequential
# read and 3,400 MB/s write (Solidigm's D7-P5510 figures for the 3.84 TB model as a KX kdb+ file-system
# benchmark's test-setup table quotes them; not read from Solidigm's page here).
# NOTE: 12 x those (78 / 40.8 GB/s) is an estimate and an upper bound: spec-sheet rates summed, as if
# the array striped perfectly; the artifact does not publish the array's measured rate. Host RAM,
# cores and memory bandwidth stay the RTX4090-24GB profile's (256 GiB; the testbed had 768 GB:
# --host 768GB).
PROFILES["RTX4090-24GB-12xNVMe"] = replace(
    PROFILES["RTX4090-24GB"], name="RTX4090-24GB-12xNVMe", ssd_read_bps=12 * 6.5 * GB, ssd_write_bps=12 * 3.4 * GB
)

# H100 (PCIe 5) with four NVMe drives striped (RAID-0), as DeepNVMe reads and writes them: the
# device, link and host of "H100-80GB-PCIe5" above, the SSD figures DeepNVMe measured with four
# NVMe SSDs in RAID-0 and CPU buffers: "10GB/sec reads and 5GB/sec writes" (DeepSpeed blog
# "DeepNVMe: Improving DL Applications through I/O Optimizations", 2024,
# github.com/microsoft/DeepSpeed blogs/deepspeed-gds/README.md, Figure 1; four drives of 3.25 GB/s
# read each, Azure NC96ads_A100_v4). REFERENCE.md quotes ~27 / 11 GB/s for four PCIe 5 drives
# (not checked here): replace(PROFILES["H100-80GB-4xNVMe"], ssd_read_bps=27e9, ssd_write_bps=11e9).
PROFILES["H100-80GB-4xNVMe"] = replace(
    PROFILES["H100-80GB-PCIe5"], name="H100-80GB-4xNVMe", ssd_read_bps=10 * GB, ssd_write_bps=5 * GB
)


@dataclass(frozen=True)
class Network:
    """A node's network for data parallel: achieved bandwidth per direction (bytes/s) and
    latency per collective step (one ring hop: a message through the NIC, the switch and the
    other NIC, plus gloo/NCCL's per-message software cost)."""

    name: str
    bps: float
    latency_s: float


NETWORKS: dict[str, Network] = {
    # NOTE: typical achieved figures, not datasheet peaks and not measured here: 25 Gb/s is
    # 3.125 GB/s on the wire, TCP (gloo) reaches ~90% of it; 100 Gb/s is 12.5 GB/s, ~11 GB/s
    # with RDMA (NCCL over RoCE/InfiniBand), less over TCP. Latencies: a TCP hop ~25 us, RDMA ~5-10 us.
    "25gbe": Network("25GbE", 2.8e9, 25e-6),
    "100gbe": Network("100GbE", 11e9, 10e-6),
}


def get_network(name: str | Network) -> Network:
    """A :class:`Network` by name (:data:`NETWORKS`: ``25gbe``, ``100gbe``) or as it is."""
    if isinstance(name, Network):
        return name
    try:
        return NETWORKS[name.lower()]
    except (KeyError, AttributeError):
        raise KeyError(f"unknown network {name!r}; known: {', '.join(NETWORKS)} (or pass a Network)") from None


def with_data_parallel(hw: str | Hardware, ranks: int, *, nodes: int = 1, network: str | Network | None = None) -> Hardware:
    """``hw`` as one of ``ranks`` data-parallel ranks spread evenly over ``nodes`` nodes joined by
    ``network`` (needed when ``nodes > 1``). Each node is the profile's machine (its host RAM
    shared by ``ranks / nodes`` ranks); the accelerators of a node talk over ``peer_bps`` (the
    host link, PCIe, unless the profile says otherwise).

    >>> hw = with_data_parallel("V100-32GB-PCIe3", 8, nodes=2, network="100gbe")
    >>> hw.ranks, hw.ranks_per_node, hw.collective_link()
    (8, 4, (11000000000.0, 1e-05))
    """
    from dataclasses import replace

    hw = get_profile(hw)
    for name, v in (("ranks", ranks), ("nodes", nodes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if ranks % nodes:
        raise ValueError(f"{ranks} ranks do not spread evenly over {nodes} nodes; give a multiple of the node count")
    if nodes > 1 and network is None:
        raise ValueError(f"{nodes} nodes need a network between them: network='25gbe' or '100gbe' (or a Network)")
    net = get_network(network) if network is not None else None
    return replace(
        hw, ranks_per_node=ranks // nodes, nodes=nodes,
        net_bps=net.bps if net else hw.net_bps, net_latency_s=net.latency_s if net else hw.net_latency_s,
    )  # fmt: skip


def get_profile(name: str | Hardware) -> Hardware:
    if isinstance(name, Hardware):
        return name
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown hardware profile {name!r}; known: {', '.join(PROFILES)} (or pass a Hardware)") from None
