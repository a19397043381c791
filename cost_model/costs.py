"""Costs of a step program's actions: the cost-model protocol and a concrete table.

A cost model answers two questions for the simulator and the tuner: how long a stage computes
and updates (:meth:`CostModel.stage_cost`), and how fast the links are (:attr:`CostModel.links`).
Passes and the simulator receive a cost model as an argument and never build one themselves;
concrete ones come from the profiler (measured on a backend, :mod:`shfx.profiler`) or from the
analytic model (FLOPs and bytes over a :class:`shfx.cost_model.hardware.Hardware` profile).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from shfx.passes.stages import StageSpec

__all__ = [
    "StageCost", "Links", "CostModel", "CostTable", "ProfileStats", "ROLLBACK_COPY_RATIO",
    "host_update_bytes", "host_accumulate_bytes", "ring_collective_s",
]

ROLLBACK_COPY_RATIO = 1.46
"""Host time of the step journal's copy of a group before its update (fp32 master, AdamW m and
v: 12 bytes per parameter read and 12 written, in three separate copies) over the time of that
group's fp32 AdamW update: 3.02 ms of copies against 2.07 ms of updates over the groups of a GPT
4 x 256 on the 2-core VM (``benchmarks/rollback.py``, ``benchmarks/results/rollback.json``).
What :func:`shfx.cost_model.simulate.simulate` charges per CPU_STEP with ``rollback=True`` where
a stage has no :attr:`StageCost.rollback_s` of its own."""


def host_update_bytes(precision: str = "float32") -> int:
    """Host memory bytes one parameter's optimizer update moves: AdamW reads the fp32 weight,
    gradient, m and v and writes the weight, m and v (28); in mixed precision also the 16-bit
    working copy, written in the same pass while the fresh master is in the cache (2). The
    16-bit gradient arrives cast to fp32 (on the device, ``Backend.d2h_copy_cast``): no host
    pass of its own.

    >>> host_update_bytes(), host_update_bytes("bfloat16")
    (28, 30)
    """
    return 28 if precision in ("float32", "fp32") else 30


def host_accumulate_bytes(precision: str = "float32") -> int:
    """Host memory bytes of adding one parameter's staged gradient copy into the fp32 gradient:
    read the copy (4, or 2 in 16-bit) and the gradient (4), write the gradient (4)."""
    return 12 if precision in ("float32", "fp32") else 10


@dataclass(frozen=True)
class StageCost:
    """Seconds one stage takes.

    Attributes:
        forward_s: FORWARD (no autograd graph kept).
        backward_s: BACKWARD with recompute (forward again under autograd, then backward).
        backward_kept_s: BACKWARD when the FORWARD kept its graph (no recompute); default
            ``backward_s - forward_s``.
        update_s: the host optimizer update of the group this stage owns (``CPU_STEP``).
        device_update_s: the same update on the device (``DEVICE_STEP``, policies that keep the
            optimizer there).
        accumulate_s: host time to add a staged gradient copy into the fp32 gradient buffer
            (only paid when gradients accumulate across backward calls).
        forward_cold_s, backward_cold_s, backward_kept_cold_s: the same actions when they start
            after the processor sat idle for :attr:`CostTable.cold_idle_s` (on the emulated
            device compute runs ~1.5x slower then; None: no difference).
        rollback_s: host time of the step journal's copy of the group this stage owns (its
            master weights, step and AdamW states) before its update, paid by the CPU_STEP when
            the simulation keeps rollback copies (``simulate(..., rollback=True)``, what
            ``shfx.compile`` does in fp16); None: :data:`ROLLBACK_COPY_RATIO` x ``update_s``.
    """

    forward_s: float
    backward_s: float
    backward_kept_s: float | None = None
    update_s: float = 0.0
    accumulate_s: float = 0.0
    forward_cold_s: float | None = None
    backward_cold_s: float | None = None
    backward_kept_cold_s: float | None = None
    device_update_s: float = 0.0
    rollback_s: float | None = None

    @property
    def backward_no_recompute_s(self) -> float:
        if self.backward_kept_s is not None:
            return self.backward_kept_s
        return max(0.0, self.backward_s - self.forward_s)

    def scaled(self, compute: float = 1.0, host: float = 1.0) -> StageCost:
        def sc(v: float | None) -> float | None:
            return None if v is None else v * compute

        return replace(
            self,
            forward_s=self.forward_s * compute,
            backward_s=self.backward_s * compute,
            backward_kept_s=sc(self.backward_kept_s),
            update_s=self.update_s * host,
            accumulate_s=self.accumulate_s * host,
            forward_cold_s=sc(self.forward_cold_s),
            backward_cold_s=sc(self.backward_cold_s),
            backward_kept_cold_s=sc(self.backward_kept_cold_s),
            device_update_s=self.device_update_s * compute,
            rollback_s=None if self.rollback_s is None else self.rollback_s * host,
        )

    def rollback_copy_s(self, ratio: float = ROLLBACK_COPY_RATIO) -> float:
        """Host seconds of the rollback copy before this stage's update: :attr:`rollback_s`, or
        ``ratio`` x :attr:`update_s` when it has none."""
        return self.rollback_s if self.rollback_s is not None else ratio * self.update_s


def ring_collective_s(nbytes: float, ranks: int, bps: float, latency_s: float) -> float:
    """Seconds of a ring reduce-scatter or all-gather of a buffer of ``nbytes`` (per rank) over
    ``ranks`` ranks, the slowest link of the ring moving ``bps`` bytes/s per direction with
    ``latency_s`` per step:

        t = (N - 1) / N * B / bw + (N - 1) * latency

    (the ring algorithm's ``N - 1`` steps each send one ``B / N`` chunk to the next rank, all
    ranks at once: Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication
    Operations in MPICH", IJHPCA 2005, and NCCL's ``busBw = algBw x (N - 1) / N`` for both
    collectives). An all-reduce is the two back to back. 0 with one rank.

    >>> ring_collective_s(8e9, 8, 1e9, 0.0), ring_collective_s(8e9, 8, 1e9, 1e-3)
    (7.0, 7.007)
    """
    if ranks <= 1 or nbytes == 0:
        return 0.0
    return (ranks - 1) / ranks * nbytes / bps + (ranks - 1) * latency_s


@dataclass(frozen=True)
class Links:
    """Host<->device link: bytes per second each way (None: instantaneous), the fraction each
    direction keeps while the other also copies (1.0 full duplex), and a fixed per-copy latency.

    The NVMe tier's drive, for programs with SSD reads and writes (``SR``/``SW``): its read and
    write bandwidth (None: no SSD; simulating a program that uses one is then an error), the
    fraction of its bandwidth each keeps while the other also runs (``ssd_duplex``; an NVMe
    drive shares its flash and controller between them), a fixed per-request latency, and
    ``ssd_queue_depth``: the requests one SSD action keeps in flight (the runtime splits a
    group's state into that many aligned chunks); the simulator charges bytes at the drive's
    bandwidth, which is what it reaches at that depth, so the depth is recorded, not modelled.

    Data parallel's collectives (``RS``/``AG``): ``net_bps``, the bytes/s per direction of the
    slowest link of the ring (None: no network; simulating a data-parallel program is then an
    error), ``net_latency_s`` per ring step, and ``net_duplex``, the fraction of it each of the
    two collective queues keeps while the other also moves bytes (0.5: they share the link
    equally). A collective's time alone is :func:`ring_collective_s`.

    >>> Links(12e9, 12e9, ssd_read_bps=3e9, ssd_write_bps=2e9).ssd_time_s("ssd_read", 3 * 10**9)
    1.0
    """

    h2d_bps: float | None
    d2h_bps: float | None
    duplex: float = 1.0
    latency_s: float = 0.0
    ssd_read_bps: float | None = None
    ssd_write_bps: float | None = None
    ssd_duplex: float = 1.0
    ssd_latency_s: float = 0.0
    ssd_queue_depth: int = 1
    net_bps: float | None = None
    net_latency_s: float = 0.0
    net_duplex: float = 0.5

    def collective_time_s(self, nbytes: int, ranks: int, both: bool = False) -> float:
        """Seconds one ring reduce-scatter or all-gather of ``nbytes`` per rank over ``ranks``
        ranks takes alone (``both``: while the other collective queue also moves bytes).

        >>> Links(None, None, net_bps=1e9, net_latency_s=1e-3).collective_time_s(4 * 10**9, 4)
        3.003
        """
        if ranks <= 1 or nbytes == 0:
            return 0.0
        if self.net_bps is None:
            raise ValueError("these links have no network bandwidth (Links(net_bps=..., net_latency_s=...))")
        return ring_collective_s(nbytes, ranks, self.net_bps * (self.net_duplex if both else 1.0), self.net_latency_s)

    def ssd_time_s(self, direction: str, nbytes: int, both: bool = False) -> float:
        """Seconds one SSD read (``"ssd_read"``) or write (``"ssd_write"``) of ``nbytes`` takes
        alone (``both``: while the other direction also runs)."""
        bps = self.ssd_read_bps if direction == "ssd_read" else self.ssd_write_bps
        if bps is None:
            raise ValueError(f"these links have no SSD {direction.split('_')[1]} bandwidth (Links(ssd_read_bps=..., ssd_write_bps=...))")
        if nbytes == 0:
            return 0.0
        return self.ssd_latency_s + nbytes / (bps * (self.ssd_duplex if both else 1.0))

    def time_s(self, direction: str, nbytes: int, both: bool = False) -> float:
        bps = self.h2d_bps if direction == "h2d" else self.d2h_bps
        if bps is None or nbytes == 0:
            return 0.0
        return self.latency_s + nbytes / (bps * (self.duplex if both else 1.0))


@dataclass(frozen=True)
class ProfileStats:
    """How steady a profile was (``CostTable.extra["profile"]`` of a profiled table).

    The profiler times every action once per round over several rounds and keeps, per action,
    the median of the fastest half of its rounds (:func:`shfx.profiler.low_median`).

    Attributes:
        rounds: rounds timed (after one warm-up round).
        seconds: wall time of the whole profile.
        spread: per family of actions (``"compute"``, ``"links"``, ``"host"``) that makes up
            at least 5% of a round, how much slower the slower half of the rounds was than the
            faster half (medians of the family's round totals; 0.03 = 3%).
        steady: whether, for every family, the faster half of the rounds agreed with the
            fastest within ``tolerance`` of a round (False: the profiler ran out of rounds or
            time first, and the costs may include other load).
        tolerance: the agreement asked for (a fraction of a round).

    >>> ProfileStats(5, 0.8, {"compute": 0.031, "links": 0.004}, True, 0.1).summary()
    '5 rounds in 0.80 s; spread between rounds: compute 3%, links 0% (steady)'
    """

    rounds: int
    seconds: float
    spread: dict[str, float]
    steady: bool
    tolerance: float = 0.1

    def summary(self) -> str:
        parts = ", ".join(f"{k} {100 * v:.0f}%" for k, v in self.spread.items())
        state = "steady" if self.steady else f"noisy: the faster rounds disagree by more than {100 * self.tolerance:.0f}% of a round"
        spread = f"; spread between rounds: {parts}" if parts else ""
        return f"{self.rounds} rounds in {self.seconds:.2f} s{spread} ({state})"


class CostModel(Protocol):
    """What the simulator needs: per-stage costs, the links, host optimizer parallelism
    (optional attributes ``cold_idle_s``, ``dispatch_s``, ``phase_gap_s`` as on :class:`CostTable`)."""

    links: Links
    optimizer_workers: int

    def stage_cost(self, stage: StageSpec) -> StageCost: ...


@dataclass
class CostTable:
    """A cost model as a table: one :class:`StageCost` per stage index.

    ``source`` says where the numbers come from ("profiled on ...", "analytic: V100 ...").

    >>> t = CostTable([StageCost(0.01, 0.03)] * 4, Links(12e9, 12e9))
    >>> t.stage_cost(StageSpec(index=2)).backward_s
    0.03
    """

    costs: Sequence[StageCost]
    links: Links
    optimizer_workers: int = 1
    source: str = ""
    extra: dict = field(default_factory=dict)
    cold_idle_s: float | None = None  # compute that starts after this long with nothing running costs *_cold_s
    dispatch_s: float = 0.0  # hand-off of one compute or optimizer action between threads
    phase_gap_s: float = 0.0  # between the end of the forward phase and the start of the backward
    cpu_contention: float = 0.0  # compute slows by this x the overlapping host CPU work (emulated device)
    memcpy_bps: float | None = None  # host memcpy speed of one copy thread (the CPU part of a copy)

    def stage_cost(self, stage: StageSpec) -> StageCost:
        try:
            return self.costs[stage.index]
        except IndexError:
            raise IndexError(
                f"the cost table has {len(self.costs)} stages but the program asks for stage {stage.index}"
            ) from None

    def with_links(self, links: Links) -> CostTable:
        return replace(self, links=links)

    @property
    def num_stages(self) -> int:
        return len(self.costs)
