"""Named hardware profiles for the analytic model (hardware you do not have).

Figures are typical *achieved* values, not datasheet peaks, from REFERENCE.md and public
measurements; treat them as defaults to replace with your own (``Hardware(...)``, or
``replace(PROFILES["A100-80GB-PCIe4"], h2d_bps=20e9)``).
"""

from __future__ import annotations

from dataclasses import dataclass

from shfx.passes.units import format_bandwidth, format_bytes

__all__ = ["Hardware", "PROFILES", "get_profile"]

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
        return (
            f"{self.name}: {format_bytes(self.device_memory_bytes)} device, {fl}; h2d {format_bandwidth(self.h2d_bps)}, "
            f"d2h {format_bandwidth(self.d2h_bps)}, duplex {self.duplex}; host {self.host_cores} cores, "
            f"{format_bandwidth(self.host_mem_bps)} memory, {format_bytes(self.host_memory_bytes)} RAM"
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


def get_profile(name: str | Hardware) -> Hardware:
    if isinstance(name, Hardware):
        return name
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown hardware profile {name!r}; known: {', '.join(PROFILES)} (or pass a Hardware)") from None
