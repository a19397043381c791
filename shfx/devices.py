"""Device specifications a user passes to ``shfx.compile(device=...)``."""

from __future__ import annotations

import os
from dataclasses import dataclass

from shfx.passes.units import format_bandwidth, format_bytes, parse_bandwidth, parse_bytes

__all__ = ["EmulatedDevice", "CudaDevice"]


@dataclass(frozen=True)
class EmulatedDevice:
    """An accelerator emulated on the CPU: compute runs on the host's cores, copies between
    "host" and "device" take ``max(real memcpy, bytes / bandwidth)``, and allocating past
    ``memory`` raises :class:`shfx.OutOfDeviceMemory`.

    Args:
        memory: device capacity, e.g. ``"512MiB"`` (int: bytes).
        h2d, d2h: link bandwidth per direction, e.g. ``"12GB/s"``; ``None``/``"inf"`` = unthrottled.
        duplex: fraction of its one-way bandwidth each direction keeps while the other direction
            is also copying (1.0: full duplex; 0.5: the link is shared equally).
        cuda_like: run with CUDA's execution model (``shfx.runtime.emulated``): the issuing
            thread only launches, each copy stream is a queue that moves the bytes later, events
            are recorded and waited on per stream, and the host waits only where the program says
            so; a host wait in the issuing path then shows as lost overlap, as on a GPU. Default:
            the environment variable ``SHFX_CUDA_LIKE=1``, else off (copy tasks run whole on
            their stream's thread).

    What it covers: the slot pool, stage-boundary activations and their gradients, user
    inputs, and the buffers the runtime allocates. It does not see temporaries inside one
    stage's computation (autograd intermediates).

    >>> EmulatedDevice(memory="512MiB", h2d="12GB/s").memory_bytes
    536870912
    """

    memory: int | str = "16GiB"
    h2d: float | str | None = "25GB/s"
    d2h: float | str | None = "25GB/s"
    duplex: float = 1.0
    cuda_like: bool | None = None

    def __post_init__(self) -> None:
        if self.cuda_like is None:
            object.__setattr__(self, "cuda_like", os.environ.get("SHFX_CUDA_LIKE", "") not in ("", "0"))
        parse_bytes(self.memory, what="EmulatedDevice memory", positive=True)
        parse_bandwidth(self.h2d, what="EmulatedDevice h2d bandwidth")
        parse_bandwidth(self.d2h, what="EmulatedDevice d2h bandwidth")
        ok = isinstance(self.duplex, (int, float)) and not isinstance(self.duplex, bool) and 0 < self.duplex <= 1.0
        if not ok:
            raise ValueError(
                f"EmulatedDevice duplex must be in (0, 1]: a number, the fraction of its bandwidth each direction "
                f"keeps while the other copies too (1.0: full duplex), got {self.duplex!r}"
            )

    @property
    def memory_bytes(self) -> int:
        return parse_bytes(self.memory, what="EmulatedDevice memory", positive=True)

    @property
    def h2d_bps(self) -> float | None:
        return parse_bandwidth(self.h2d)

    @property
    def d2h_bps(self) -> float | None:
        return parse_bandwidth(self.d2h)

    def __str__(self) -> str:
        return (
            f"emulated device ({format_bytes(self.memory_bytes)}, h2d {format_bandwidth(self.h2d_bps)}, "
            f"d2h {format_bandwidth(self.d2h_bps)}" + (f", duplex {self.duplex}" if self.duplex != 1.0 else "")
            + (", CUDA-like" if self.cuda_like else "") + ")"
        )


@dataclass(frozen=True)
class CudaDevice:
    """A CUDA device, optionally with a memory budget below its capacity (``memory``)."""

    index: int = 0
    memory: int | str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            raise ValueError(f"CudaDevice index must be an int >= 0 (cuda:N), got {self.index!r}")
        if self.memory is not None:
            parse_bytes(self.memory, what="CudaDevice memory", positive=True)

    @property
    def memory_bytes(self) -> int | None:
        return None if self.memory is None else parse_bytes(self.memory, what="CudaDevice memory", positive=True)

    def __str__(self) -> str:
        return f"cuda:{self.index}" + (f" (budget {format_bytes(self.memory_bytes)})" if self.memory is not None else "")
