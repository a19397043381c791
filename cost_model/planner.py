"""The capacity planner: how large a model each policy can train on given hardware, and why.

A **memory model** (:func:`memory_model`) gives, for one policy and one GPT size, the bytes each
tier holds at the step's peak, term by term: on the device the slot pool, gradient buffers,
optimizer states, boundary activations and their gradients, the working set of the stage being
computed, the CUDA workspace and allocator slack; on the host the fp32 master weights, gradients,
AdamW moments, staging buffers; on an SSD what ZeRO-Infinity spills there. The **planner**
(:func:`largest_trainable`, :func:`plan`) searches the largest layer count that fits and names
the term that stops it.

On the emulated device (``shfx.EmulatedDevice``) the model is exact: it counts what the runtime
reserves, byte for byte (slots sized to the largest stage each holds, 64-byte aligned tensors,
per-slot gradient buffers, device AdamW states, boundary activations, their gradients and the
model's inputs), and the emulated device counts nothing else (no temporaries inside a stage, no
workspace, no fragmentation). ``tests/test_planner.py`` trains the largest size it predicts and
checks that one layer more raises ``OutOfDeviceMemory``. On a real GPU it adds the terms the
emulated device cannot see (see ``docs/planner.md``).

>>> fam = GPTShape(hidden=2048, heads=16, seq=1024, batch=4, vocab=50304)       # STRONGHOLD's setup
>>> row = largest_trainable("stronghold", fam, "V100-32GB-PCIe3")
>>> row.layers, row.binding
(116, 'host: optimizer states (m, v)')
>>> print(plan(fam, "V100-32GB-PCIe3"))                             # doctest: +SKIP
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from shfx.passes.units import format_bytes

from shfx.passes.ledger import (
    DEVICE_TERMS, DP_COLLECTIVE, DP_IMAGE, HOST_TERMS, HOST_WINDOW, IMAGE_WINDOW, SSD_TERMS, pool_sizes, replay, shard_chunk, shard_numel,
)  # fmt: skip
from shfx.passes.policies import POLICIES, Policy, ZeroInfinity, get_policy, make_policy, policy_names

from .hardware import Hardware, get_profile
from .shapes import GPTShape, normalize_precision, short_precision

__all__ = [
    "DEFAULT_WORKSPACE_BYTES",
    "DEFAULT_HOST_WINDOW",
    "Target",
    "as_target",
    "MemoryBreakdown",
    "memory_model",
    "PlanRow",
    "Plan",
    "largest_trainable",
    "plan",
    "memory_for_model",
    "plan_for_model",
    "updates_on_device",
    "BEYOND_RAM_TIERS",
    "ACTIVATIONS_OFFLOADED",
]



BEYOND_RAM_TIERS: dict[str, dict] = {
    "nvme-all": {"nvme_all": True},
    "nvme-all+act-host": {"nvme_all": True, "activations": "host"},
    "nvme-all+act-nvme": {"nvme_all": True, "activations": "nvme"},
}
"""The tiers beyond host RAM (issue 26) as :func:`memory_model` options, by the suffix of their
plan row (``stronghold+nvme-all``, ...; ``plan(..., tiers=...)``, ``shfx plan --tiers``):
parameters, gradients and optimizer states on the SSD with bounded host windows
(``shfx.Offload(params="nvme", gradients="nvme", optimizer="nvme")``), and the checkpointed
boundary activations offloaded to host RAM or the SSD (``Offload(activations="host"|"nvme")``)."""

ACTIVATIONS_OFFLOADED = "offloaded activations"
"""The host and SSD term of offloaded boundary activations (``memory_model(activations=...)``;
the ledger's name for their host buffers)."""

_BEYOND_RAM_SSD_TERMS = ("working copy (16-bit)", "rollback copies", ACTIVATIONS_OFFLOADED)

DEFAULT_HOST_WINDOW = 2
"""The NVMe tier's host window the planner counts when none is given (``shfx plan --host-window``):
two groups' states on the host, one being updated while the next is read. Its buffers are a few
blocks' states, so the largest model hardly depends on it; the step time does, and the tuner
chooses it (:func:`shfx.cost_model.tune.tune_window`)."""

DEFAULT_WORKSPACE_BYTES = 512 * 2**20
"""Device memory a real GPU loses before any tensor: the CUDA context (~300-400 MiB on a V100
with PyTorch's kernels loaded) plus cuBLAS/cuDNN workspaces (a few MiB per stream). The same
figure :func:`shfx.cost_model.formulas.device_memory_terms` uses for ``cuda_context``. 0 on the
emulated device."""

ALIGN = 64  # shfx.passes.layout.ALIGN: every tensor in a host group and a slot starts on 64 bytes
_GROUP_STATE_BYTES = 8  # AdamW m and v, fp32, per parameter
_STAGING_BUFFERS = 2  # shfx.runtime.host_store.HostStore(staging_buffers=2)
_STEP_BYTES = 4  # shfx.passes.ledger.STEP_BYTES: AdamW's step counter, copied with a group's states



def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _positive_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


def _format_params(n: int) -> str:
    """2522320896 -> '2.52 B'; 294816 -> '0.29 M'."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M" if n else "0"


def _unpack(policy: str | Policy, window: int | None = None, resident_first: int | str | None = None) -> tuple[str, int, int | str]:
    """``(name, window, k)`` of a policy given by name (with stronghold's ``window`` and
    ``resident_first``, defaults 2 and 0) or as an object (``window`` and ``resident_first``,
    if given, must agree with it). The closed form knows the registered policies."""
    if isinstance(policy, Policy):
        name = policy.name
        if type(policy) is not POLICIES.get(name) or (isinstance(policy, ZeroInfinity) and policy.lookahead != 1):
            raise ValueError(
                f"the planner's closed form knows the registered policies ({', '.join(POLICIES)}, ZeroInfinity with "
                f"lookahead=1); for {policy!r} use memory_for_model, which replays its program through the ledger"
            )
        own = {"window": getattr(policy, "window", None), "resident_first": getattr(policy, "resident_first", None)}
        for key, given in (("window", window), ("resident_first", resident_first)):
            if given is not None and own[key] is not None and given != own[key]:
                raise ValueError(f"{key}={given!r} disagrees with {policy!r}; give it in one place")
        w = own["window"] if own["window"] is not None else (2 if window is None else window)
        k = own["resident_first"] if own["resident_first"] is not None else (0 if resident_first is None else resident_first)
        return name, w, k
    get_policy(policy)  # a clear error for an unknown name
    return policy, 2 if window is None else window, 0 if resident_first is None else resident_first


def _policy_of(name: str, window: int, resident_first: int) -> Policy:
    """The policy object of a (name, window, k) triple, for the program replay."""
    pol = make_policy(name)
    if pol.windowed:
        pol = pol.replace(window=window)
    if resident_first:
        pol = pol.replace(resident_first=resident_first)
    return pol


# ---- the model family ------------------------------------------------------------------------


def _block_numels(shape: GPTShape) -> list[int]:
    h = shape.hidden
    # ln_1 (w, b), c_attn (w, b), attn.c_proj (w, b), ln_2 (w, b), c_fc (w, b), mlp.c_proj (w, b)
    return [h, h, 3 * h * h, 3 * h, h * h, h, h, h, 4 * h * h, 4 * h, 4 * h * h, h]


def _stage_bytes(shape: GPTShape, elt: int) -> dict[str, int]:
    """Slot bytes of the head, a block and the tail of ``shape`` laid out as shfx lays them out
    (:mod:`shfx.passes.layout`: each tensor 64-byte aligned; the tail's slot holds a copy of the
    tied embedding it borrows), and ``tail_own``: the tail's own group (the final LayerNorm)."""
    h, V, s = shape.hidden, shape.vocab, shape.seq
    tail_own = 2 * _align(h * elt)
    return {
        "head": _align(V * h * elt) + _align(s * h * elt),
        "block": sum(_align(n * elt) for n in _block_numels(shape)),
        "tail": tail_own + _align(V * h * elt),
        "tail_own": tail_own,
    }


# ---- what the plan is checked against --------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """Capacities a memory model is checked against.

    Attributes:
        name: what it is (a profile name, the emulated device's description).
        device_bytes: accelerator memory.
        host_bytes: host RAM (None: not limited, e.g. the emulated device).
        ssd_bytes: NVMe capacity for spilled optimizer states (0: none).
        emulated: the emulated device: it counts only what shfx reserves (no working set,
            workspace or fragmentation), so the planner's defaults for those are 0.
        ranks: data-parallel ranks the model trains on (1: none); every tier's capacity is then
            one rank's: its device, and ``host_bytes`` its share of the node's RAM (the node's
            RAM over ``ranks_per_node``; the host terms are per rank, so the node holds them
            ``ranks_per_node`` times).
        ranks_per_node: ranks sharing one node's host RAM.
    """

    name: str
    device_bytes: int
    host_bytes: int | None = None
    ssd_bytes: int = 0
    emulated: bool = False
    ranks: int = 1
    ranks_per_node: int = 1

    def describe(self) -> str:
        host = "host not limited" if self.host_bytes is None else f"{format_bytes(self.host_bytes)} host"
        if self.ranks > 1 and self.host_bytes is not None:
            host += f" per rank ({format_bytes(self.host_bytes * self.ranks_per_node)} per node of {self.ranks_per_node})"
        ssd = f"{format_bytes(self.ssd_bytes)} SSD" if self.ssd_bytes else "no SSD"
        dp = f"; data parallel over {self.ranks} ranks" if self.ranks > 1 else ""
        return f"{self.name}: {format_bytes(self.device_bytes)} device, {host}, {ssd}{dp}"


def as_target(hardware: Any) -> Target:
    """A :class:`Target` from a :class:`~shfx.cost_model.hardware.Hardware`, a profile name
    (:data:`shfx.cost_model.hardware.PROFILES`), an emulated device (``shfx.EmulatedDevice``: anything
    with ``memory_bytes`` and ``h2d_bps``), or a Target. A Hardware with data parallel
    (:func:`~shfx.cost_model.hardware.with_data_parallel`) gives one rank's target: its
    ``ranks``, and ``host_bytes`` the node's RAM over its ranks per node."""
    if isinstance(hardware, Target):
        return hardware
    if isinstance(hardware, str):
        hardware = get_profile(hardware)
    if isinstance(hardware, Hardware):
        k = hardware.ranks_per_node
        return Target(
            hardware.name, int(hardware.device_memory_bytes), int(hardware.host_memory_bytes) // k, int(hardware.ssd_bytes),
            ranks=hardware.ranks, ranks_per_node=k,
        )  # fmt: skip
    if hasattr(hardware, "memory_bytes") and hasattr(hardware, "h2d_bps"):  # shfx.EmulatedDevice (cost_model never imports shfx)
        return Target(str(hardware), int(hardware.memory_bytes), None, 0, emulated=True)
    raise TypeError(
        f"hardware must be a shfx.cost_model.hardware.Hardware, a profile name, a shfx.EmulatedDevice or a "
        f"planner.Target, got {hardware!r}"
    )


# ---- one policy at one size ------------------------------------------------------------------


@dataclass
class MemoryBreakdown:
    """Bytes per tier and term at the step's peak for one policy and one model size.

    Attributes:
        policy: the policy.
        family: the GPT family (with its layer count), or None for :func:`memory_for_model`.
        device, host, ssd: term -> bytes (see ``docs/planner.md`` for each term).
        target: the capacities it was computed for (the allocator slack depends on them).
        slot_sizes: bytes of each device slot; ``grad_buffer_sizes``: of each slot's gradient buffer.
        settings: window, resident_first, workspace, slack, whether the working set is counted.
        name: what was modelled (for :func:`memory_for_model`, the model's class).
    """

    policy: str
    family: GPTShape | None
    device: dict[str, int]
    host: dict[str, int]
    ssd: dict[str, int]
    target: Target | None = None
    slot_sizes: tuple[int, ...] = ()
    grad_buffer_sizes: tuple[int, ...] = ()
    settings: dict = field(default_factory=dict)
    name: str = ""

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def ssd_total(self) -> int:
        return sum(self.ssd.values())

    def _tiers(self, hw: Any) -> list[tuple[str, dict[str, int], int | None]]:
        t = as_target(hw) if hw is not None else self.target
        if t is None:
            raise ValueError("fits()/binding() need the hardware to check against")
        return [("device", self.device, t.device_bytes), ("host", self.host, t.host_bytes), ("ssd", self.ssd, t.ssd_bytes)]

    def fits(self, hw: Any = None) -> bool:
        """Every tier within its capacity (a host of unknown size always fits)."""
        return all(cap is None or sum(terms.values()) <= cap for _, terms, cap in self._tiers(hw))

    def utilization(self, hw: Any = None) -> dict[str, float]:
        """Tier -> used / capacity (tiers without a limit left out; an SSD tier with terms and no
        SSD is ``inf``)."""
        out = {}
        for tier, terms, cap in self._tiers(hw):
            total = sum(terms.values())
            if cap is None or (cap == 0 and total == 0):
                continue
            out[tier] = math.inf if cap == 0 else total / cap
        return out

    def binding(self, hw: Any = None) -> str:
        """``"tier: term"``: the tier most over (or, if all fit, closest to) its capacity, and its
        largest term (terms within 1% of the largest are named together: ``"a + b"``)."""
        util = self.utilization(hw)
        tier = max(util, key=lambda k: util[k])
        terms = {"device": self.device, "host": self.host, "ssd": self.ssd}[tier]
        top = max(terms.values())
        return f"{tier}: " + " + ".join(k for k, v in terms.items() if v >= 0.99 * top)

    def table(self) -> str:
        what = self.family.describe() + f", {self.family.layers} layers" if self.family else self.name
        st = self.settings
        tier = "+nvme-all" if st.get("nvme_all") else ""
        tier += f"+act-{st['activations']}" if st.get("activations") else ""
        rows = [f"{self.policy}{tier}: {what}"]
        for tier, terms in (("device", self.device), ("host", self.host), ("ssd", self.ssd)):
            if not terms:
                continue
            rows.append(f"  {tier:<7} {format_bytes(sum(terms.values())):>11}")
            rows += [f"    {k:<28} {format_bytes(v):>11}" for k, v in terms.items() if v]
        if self.target is not None:
            rows.append(f"  {'fits' if self.fits() else 'does not fit'} {self.target.describe()} (limited by {self.binding()})")
        return "\n".join(rows)

    __str__ = table

    def to_dict(self) -> dict:
        return {
            "policy": self.policy,
            "family": asdict(self.family) if self.family else None,
            "name": self.name,
            "device": dict(self.device),
            "host": dict(self.host),
            "ssd": dict(self.ssd),
            "device_total": self.device_total,
            "host_total": self.host_total,
            "ssd_total": self.ssd_total,
            "slot_sizes": list(self.slot_sizes),
            "grad_buffer_sizes": list(self.grad_buffer_sizes),
            "settings": dict(self.settings),
        }


@dataclass(frozen=True)
class _Layout:
    """Which stage kinds each slot holds (runs of ``(kinds, count)`` slots), whether those slots
    get a gradient buffer, which stage kinds' groups are updated on the device, and which stages
    are persistent (kind -> count)."""

    runs: tuple[tuple[frozenset[str], int, bool], ...]
    device_groups: dict[str, int]
    persistent: dict[str, int]


def _kind(i: int, n: int) -> str:
    return "head" if i == 0 else "tail" if i == n - 1 else "block"


def _layout(policy: str, layers: int, window: int, resident_first: int) -> _Layout:
    """The slot assignment shfx's policies make for a GPT (head, ``layers`` blocks, tail), in
    closed form; equal to what :func:`shfx.passes.program.lower_actions` assigns (free slots are taken
    lowest first), over the train, eval and cold-backward programs
    (``tests/test_planner.py`` checks it against the programs on a grid).

    - ``resident``, ``zero-offload``: stage i persistent in slot i.
    - ``l2l``: one slot for every stage.
    - ``zero-infinity``: two slots; stage i in slot ``i % 2`` in forward and ``(n-1-i) % 2`` in
      backward (the backward prefetches the last two stages first).
    - ``stronghold``: the first ``k`` stages persistent in slots ``0..k-1``; stage ``i >= k``
      in slot ``k + (i - k) % w`` (a released slot goes to the stage ``w`` ahead, in both phases).
    """
    n = layers + 2
    everything = {"head": 1, "block": layers, "tail": 1}
    none = {"head": 0, "block": 0, "tail": 0}
    if policy in ("resident", "zero-offload"):
        runs = ((frozenset({"head"}), 1, True), (frozenset({"block"}), layers, True), (frozenset({"tail"}), 1, True))
        return _Layout(runs, everything if policy == "resident" else none, everything)
    # the other assignments are periodic in the stage index: the head, the tail and the first few
    # blocks reach every slot a block can reach
    probe = sorted({0, n - 1} | set(range(1, min(layers, resident_first + 2 * max(window, 2) + 2) + 1)))

    def assign(where, grad_slots=lambda k: False) -> tuple[tuple[frozenset[str], int, bool], ...]:
        kinds: dict[int, set[str]] = {}
        for i in probe:
            for k in where(i):
                kinds.setdefault(k, set()).add(_kind(i, n))
        return tuple((frozenset(kinds[k]), 1, grad_slots(k)) for k in range(len(kinds)))

    if policy == "l2l":
        return _Layout(assign(lambda i: (0,), lambda k: True), everything, none)
    if policy == "zero-infinity":
        return _Layout(assign(lambda i: {i % 2, (n - 1 - i) % 2}), none, none)
    k = max(0, min(resident_first, n))
    w = min(window, n - k)
    pers = {"head": 0, "block": 0, "tail": 0}
    for i in range(k):
        pers[_kind(i, n)] += 1
    runs = assign(lambda i: (i,) if i < k else (k + (i - k) % w,), lambda j: j < k)
    return _Layout(runs, pers, pers)


def _staging_buffers(grad_accum_steps: int, borrowed_to_host: bool, host_trainable: int, mixed: bool = False) -> int:
    """Host staging buffers the runtime allocates (``HostStore.acquire_staging``, each as large as
    the largest group): a gradient copy that is added rather than copied in needs one - the tied
    embedding's gradient from the tail, or every copy after the first under gradient
    accumulation, when up to two are in flight; in mixed precision with a tied embedding on the
    host, the owner's copy too (its 16-bit sum is cast on the host; every other group's gradient
    is cast on the device and copied straight in: ``shfx.passes.layout.device_cast_groups``)."""
    if not host_trainable:
        return 0
    return _STAGING_BUFFERS if grad_accum_steps > 1 or (mixed and borrowed_to_host) else int(borrowed_to_host)


def _resolve(target: Target, workspace_bytes: int | None, allocator_slack: float, working_set: bool | None):
    if workspace_bytes is None:
        workspace_bytes = 0 if target.emulated else DEFAULT_WORKSPACE_BYTES
    if isinstance(workspace_bytes, bool) or not isinstance(workspace_bytes, int) or workspace_bytes < 0:
        raise ValueError(f"workspace_bytes must be an int >= 0 (bytes), got {workspace_bytes!r}")
    if isinstance(allocator_slack, bool) or not isinstance(allocator_slack, (int, float)) or not 0 <= allocator_slack < 1:
        raise ValueError(f"allocator_slack must be a fraction of device memory in [0, 1), got {allocator_slack!r}")
    if working_set is None:
        working_set = not target.emulated
    return workspace_bytes, float(allocator_slack), bool(working_set)


def _check_common(policy: str, window: int, resident_first: int) -> None:
    get_policy(policy)
    _positive_int("window", window)
    if isinstance(resident_first, bool) or not isinstance(resident_first, int) or resident_first < 0:
        raise ValueError(f"resident_first must be an int >= 0, got {resident_first!r}")
    if resident_first and policy != "stronghold":
        raise ValueError(f"resident_first is a refinement of the 'stronghold' policy; policy {policy!r} does not take it")


def memory_model(
    policy: str | Policy,
    family: GPTShape,
    hardware: Any,
    *,
    window: int | None = None,
    resident_first: int | None = None,
    workspace_bytes: int | None = None,
    allocator_slack: float = 0.0,
    working_set: bool | None = None,
    attention_scores: bool = True,
    nvme: bool | None = None,
    grad_accum_steps: int = 1,
    rollback: bool | None = None,
    host_window: int | None = None,
    nvme_masters: bool | None = None,
    ranks: int | None = None,
    nvme_all: bool = False,
    activations: str | None = None,
    image_window: int | None = None,
) -> MemoryBreakdown:
    """Peak bytes per tier and term when ``policy`` trains ``family`` (at ``family.layers``) on
    ``hardware``.

    Args:
        policy: a registered policy: its name (:func:`shfx.passes.policies.policy_names`) or object.
        family: the model.
        hardware: a :class:`~shfx.cost_model.hardware.Hardware`, a profile name, ``shfx.EmulatedDevice``
            or a :class:`Target`.
        window: stages streamed through the device at once (``stronghold``; the other policies
            have a fixed number of slots).
        resident_first: ``stronghold`` only: the first k stages persistent with their optimizer on
            the device.
        workspace_bytes: CUDA context and library workspaces; default
            :data:`DEFAULT_WORKSPACE_BYTES` on real hardware, 0 on the emulated device.
        allocator_slack: fraction of device memory lost to the caching allocator's fragmentation
            (default 0: slots, gradient buffers and states are allocated once; see docs/planner.md).
        working_set: count the temporaries of the stage being computed (a block's recompute, the
            tail's logits); default on for real hardware, off for the emulated device (it does
            not see them).
        attention_scores: the working set includes the ``5 a s / h`` attention-score term
            (materialised scores, as Megatron does; fused attention kernels never hold them).
        nvme: the NVMe tier (``stronghold`` and ``zero-infinity``; a policy object with
            ``nvme=True`` says so itself): the AdamW states of the host-updated groups on the SSD
            and ``host_window`` groups' states in host buffers (the ledger's ``SSD host window``),
            the fp32 masters too with ``nvme_masters`` (mixed precision only), as the programs'
            SSD reads and writes place them. None: ``zero-infinity`` spills its fp32 master and
            states to the SSD only when host RAM overflows and the target has an SSD (ZeRO-
            Infinity's own choice, no host window counted; the planner's model before the tier).
        host_window: the NVMe tier's host window (default: the policy object's when a number,
            else :data:`DEFAULT_HOST_WINDOW`).
        nvme_masters: the NVMe tier holds the fp32 masters too (default: the policy object's, else
            False); needs mixed precision (in fp32 the master is what a PREFETCH sends).
        grad_accum_steps: with more than one, gradients are added on the host through up to two
            staging buffers (one otherwise, for the tied embedding's gradient from the tail); in
            mixed precision (or under data parallel) each group updated on the device sums its
            micro-steps in an fp32 accumulator on the device (4 B/param, device term ``gradients``).
        rollback: count the step journal's copies (``shfx.compile(rollback=...)``, the host term
            ``rollback copies``: per group its fp32 master, step counter and AdamW m and v, and
            for a group updated on the device its weights in the slot too). Default: what
            ``shfx.compile`` does at ``family.precision``: on for ``float16`` (the loss scaler
            undoes the updates an overflowing step already ran), off otherwise.
        nvme_all: the tier beyond host RAM (``stronghold`` with ``resident_first=0``, one rank;
            ``shfx.Offload(params="nvme", gradients="nvme", optimizer="nvme")``): the images,
            masters (mixed precision) and AdamW m and v on the SSD, the host holding
            ``host_window`` buffers of a group's states, master and gradient, ``image_window``
            image buffers and the tied head's image and gradient (:func:`_nvme_all_terms`, the
            ledger's parameter tier in closed form).
        image_window: with ``nvme_all``, the image buffers (default: what the program needs plus
            one, as ``shfx.passes.policies.add_param_tier`` chooses).
        activations: ``"host"`` or ``"nvme"`` (``stronghold``, with checkpointing;
            ``Offload(activations=...)``): as the ledger's activation offload
            (:mod:`shfx.passes.activations`), every stage but the last block and the tail sends
            the inputs its backward needs (the head's token ids, the blocks' checkpoints) off the
            device after its forward and gets them back before its backward, ``8 b s + (l - 1) A``
            bytes in host RAM (or on the SSD, through the activation window's two host buffers of
            one activation, :data:`shfx.passes.activations.ACTIVATION_WINDOW`), term
            :data:`ACTIVATIONS_OFFLOADED`; the device's peak
            then holds ``2 A`` + the output of checkpoints and ``max(out + A, 2 A)`` of gradients.
        ranks: data parallel over this many ranks (default: the target's, 1 without data
            parallel). The terms are then one rank's: the device's unchanged, the host's as the
            ledger counts them (:func:`shfx.passes.ledger.host_terms` with ``ranks``): the fp32
            master, gradient and AdamW m and v of each group sharded to rank 0's ``min(T, chunk)``, ``chunk = ceil(T / N)`` rounded up to 16
            elements, the image whole, the staging buffers and the collectives' buffers at the
            largest group's padded length. Policies that update groups on the device
            (``resident``, ``l2l``, stronghold's first k) replicate those groups (their device
            terms whole on every rank; in 16 bits the fp32 master shard on the host).

    >>> m = memory_model("resident", GPTShape(hidden=2048, heads=16, seq=1024, batch=4, vocab=50304, layers=30), "V100-32GB-PCIe3")
    >>> round(m.device["optimizer states"] / m.family.num_params(), 2)   # AdamW m and v, fp32
    8.0
    """
    nvme, host_window, nvme_masters = _nvme_options(policy, nvme, host_window, nvme_masters)
    policy, window, resident_first = _unpack(policy, window, resident_first)
    _check_common(policy, window, resident_first)
    _positive_int("grad_accum_steps", grad_accum_steps)
    if not isinstance(family, GPTShape):
        raise TypeError(f"family must be a GPTShape, got {type(family).__name__}")
    if nvme is not None and not isinstance(nvme, bool):
        raise ValueError(f"nvme must be True, False or None, got {nvme!r}")
    if rollback is not None and not isinstance(rollback, bool):
        raise ValueError(f"rollback must be True, False or None (the precision's default), got {rollback!r}")
    tgt = as_target(hardware)
    ranks = _ranks(tgt, ranks)
    workspace_bytes, allocator_slack, working_set = _resolve(tgt, workspace_bytes, allocator_slack, working_set)
    fam = family
    _check_beyond_ram(policy, resident_first, ranks, fam, nvme_all, activations)
    rollback = fam.rollback_default if rollback is None else rollback
    L, h, a, s, b, V = fam.layers, fam.hidden, fam.heads, fam.seq, fam.batch, fam.vocab
    elt = fam.param_bytes
    # NOTE: l2l updates each stage on the device and copies its 16-bit working copy back (OP);
    # in mixed precision its fp32 masters stay on the device with m and v (per_group below), as
    # every policy updating on the device keeps them (shfx.runtime.device_optim): its slot and
    # gradient buffer are 16-bit like the others'
    size = _stage_bytes(fam, elt)
    own32 = _stage_bytes(fam, 4)
    group32 = {"head": own32["head"], "block": own32["block"], "tail": own32["tail_own"]}
    own16 = _stage_bytes(fam, elt)
    group16 = {"head": own16["head"], "block": own16["block"], "tail": own16["tail_own"]}  # the working copy
    lay = _layout(policy, L, window, resident_first)
    # ---- device
    slot_sizes: tuple[int, ...] = ()
    grad_sizes: tuple[int, ...] = ()
    for kinds, count, grad in lay.runs:
        sz = max(size[k] for k in kinds)
        slot_sizes += (sz,) * count
        grad_sizes += (sz if grad else 0,) * count
    # device AdamW: m and v (fp32) per group; in mixed precision its fp32 master too
    per_group = 3 if fam.mixed else 2
    states = sum(per_group * group32[k] * c for k, c in lay.device_groups.items())
    # mixed precision under accumulation: an fp32 gradient accumulator per device group (the
    # micro-steps' 16-bit gradients widened and summed there, shfx.runtime.gradients)
    # (data parallel, fp32 too: the sum of the all-reduced micro-step gradients, apart from the next local one)
    accumulators = sum(group32[k] * c for k, c in lay.device_groups.items()) if (fam.mixed or ranks > 1) and grad_accum_steps > 1 else 0
    A = b * s * h * elt  # one boundary activation [b, s, h]
    inputs = 8 * b * s * (2 if fam.loss_in_model else 1)  # int64 token ids (and targets)
    out = 4 if fam.loss_in_model else b * s * V * elt  # the loss (a scalar, in fp32 as the GPT computes it) or the logits
    korthikanti = s * b * h * (34 + (5 * a * s / h if attention_scores else 0)) * elt / 2  # bytes per layer
    if fam.checkpointing and activations is not None:
        # (the ledger's activation offload, shfx.passes.activations: every stage but the last block
        # and the tail sends the inputs its backward needs to the host after its forward; the peak,
        # in a block's backward, holds the last block's and the tail's inputs, the output and two
        # boundary gradients)
        acts = 2 * A + out
    elif fam.checkpointing:
        acts = inputs + (L + 1) * A + out  # the head's and every block's output, kept for the backward
    else:
        acts = inputs + A + int(L * korthikanti) + out  # every layer's activations
    act_grads = out + A  # the output's gradient and one boundary gradient (the peak is the tail's backward)
    if fam.checkpointing and activations is not None:
        act_grads = max(act_grads, 2 * A)
    ws = 0
    if working_set:
        # logits, then (loss in the model) their fp32 copy and its log-softmax (fp32)
        tail_ws = (elt + 8 if fam.loss_in_model else elt) * b * s * V
        ws = max(int(korthikanti), tail_ws) if fam.checkpointing else tail_ws
    # the tail's gradient of the tied embedding waits on the device for the head's backward when
    # the head is updated there (resident, l2l, stronghold's first k): allocated at the end of the
    # tail's backward, on top of the peak
    pending_dev = V * h * elt if lay.device_groups["head"] else 0
    device = {
        "parameters (slots)": sum(slot_sizes),
        "gradients": sum(grad_sizes) + accumulators,
        "optimizer states": states,
        "activations (checkpoints)": int(acts),
        "activation gradients": int(act_grads),
        "pending tied gradient": int(pending_dev),
        "working set (one block)": int(ws),
        "workspace": workspace_bytes,
        "allocator slack": int(round(allocator_slack * tgt.device_bytes)),
    }

    # ---- host (fp32; shfx's host store keeps every group's master weights)
    host_groups = {k: (1 if k != "block" else L) - lay.device_groups[k] for k in ("head", "block", "tail")}
    if policy in ("resident", "l2l"):
        host_groups = {"head": 0, "block": 0, "tail": 0}
    all_groups = {"head": 1, "block": L, "tail": 1}
    master = sum(group32[k] * c for k, c in all_groups.items())
    host_trainable = sum(group32[k] * c for k, c in host_groups.items())
    # NOTE: in mixed precision the host store keeps every group's image (what a PREFETCH sends:
    # the parameters in the working dtype) beside its fp32 master, persistent stages' included
    # (loaded once, refreshed from the master after their host update; a device update's OP or
    # sync writes it from the slot).
    working = sum(group16[k] * c for k, c in all_groups.items()) if fam.mixed else 0
    largest_group = max(group32.values())
    rollback_bytes = 0
    if rollback:  # shfx.passes.ledger.host_terms(rollback=True): master, step, m, v; + slot weights on the device
        slot_group = {"head": size["head"], "block": size["block"], "tail": size["tail_own"]}
        rollback_bytes = sum((3 * group32[k] + _STEP_BYTES) * c for k, c in all_groups.items())
        rollback_bytes += sum(slot_group[k] * c for k, c in lay.device_groups.items())
    host = {
        "master parameters (fp32)": master,
        "gradients (fp32)": host_trainable,
        "optimizer states (m, v)": _GROUP_STATE_BYTES // 4 * host_trainable,
        "working copy (16-bit)": working,
        "gradient staging (pinned)": _staging_buffers(grad_accum_steps, bool(host_groups["head"]), host_trainable, fam.mixed)
        * largest_group,
        # the tail's gradient of the tied embedding, in the device's dtype (summed with the
        # head's in 16-bit, then cast, as autograd does on a 16-bit model)
        "pending tied gradient": elt * V * h if host_groups["head"] else 0,
        "rollback copies": rollback_bytes,
        HOST_WINDOW: 0,
        DP_IMAGE: 0,
        DP_COLLECTIVE: 0,
    }
    if ranks > 1:
        host = _dp_host(fam, L, ranks, group32, group16 if working else None, rollback, host, host_groups)
    ssd: dict[str, int] = {}
    host_updating = ("stronghold", "zero-offload", "zero-infinity")  # (resident and l2l update on the device)
    tier = bool(nvme) and policy in host_updating and host_trainable > 0 and not nvme_all
    if nvme and policy not in host_updating:
        raise ValueError(
            f"the NVMe tier is a field of the policies updating on the host ('stronghold', 'zero-offload', 'zero-infinity'), "
            f"not of {policy!r}"
        )
    if tier:
        # the NVMe tier as the programs place it (shfx.passes.ledger.host_terms): the host-updated
        # groups' AdamW m and v (and fp32 masters) on the SSD, H buffers of the largest on the host
        if nvme_masters and not fam.mixed:
            raise ValueError(
                "nvme_masters=True needs mixed precision (precision='bfloat16' or 'float16'): in fp32 the master is the "
                "image every PREFETCH copies, so it stays in host RAM"
            )
        # (data parallel: each rank's SSD file holds its shards, a window buffer the largest shard)
        per_rank = (lambda k: 4 * shard_numel(group32[k] // 4, ranks)) if ranks > 1 else (lambda k: group32[k])  # noqa: E731
        largest_host = max(per_rank(k) for k, c in host_groups.items() if c)
        ssd = {
            "master parameters (fp32)": host_trainable if nvme_masters else 0,
            "optimizer states (m, v)": host.pop("optimizer states (m, v)"),
        }
        host = {**host, "optimizer states (m, v)": 0}
        host["master parameters (fp32)"] -= ssd["master parameters (fp32)"]
        host_window = min(host_window, sum(host_groups.values()))  # (as check_host_window clamps it)
        host[HOST_WINDOW] = host_window * (_GROUP_STATE_BYTES // 4 + (1 if nvme_masters else 0)) * largest_host
        host[HOST_WINDOW] += _STEP_BYTES * sum(host_groups.values())  # (the step counters stay in RAM)
        if rollback:  # the states' undo is their previous version on the SSD: the copies are masters and steps
            states = sum(_GROUP_STATE_BYTES // 4 * per_rank(k) * c for k, c in host_groups.items())
            host["rollback copies"] -= states
            ssd["optimizer states (m, v)"] += states
        host = {k: host.get(k, 0) for k in HOST_TERMS}
    elif policy == "zero-infinity":
        over = tgt.host_bytes is not None and sum(host.values()) > tgt.host_bytes
        if nvme is None and over and tgt.ssd_bytes > 0:
            ssd = {
                "master parameters (fp32)": host.pop("master parameters (fp32)"),
                "optimizer states (m, v)": host.pop("optimizer states (m, v)"),
            }
            host = {"master parameters (fp32)": 0, "optimizer states (m, v)": 0, **host}
    if nvme_all:
        host, ssd, host_window, image_window = _nvme_all_terms(fam, L, group32, group16, window, host_window, image_window, rollback, host)
    if activations is not None:
        offloaded = 8 * b * s + (L - 1) * A  # the head's token ids, the first l - 1 blocks' inputs
        if activations == "host":
            host[ACTIVATIONS_OFFLOADED] = offloaded
        else:  # on the SSD, through the activation window's host buffers, each one block's input
            from shfx.passes.activations import ACTIVATION_WINDOW

            host[ACTIVATIONS_OFFLOADED] = ACTIVATION_WINDOW * max(A, 8 * b * s)
            ssd = {**ssd, ACTIVATIONS_OFFLOADED: offloaded}
    settings = {
        "window": window,
        "resident_first": resident_first,
        "workspace_bytes": workspace_bytes,
        "allocator_slack": allocator_slack,
        "working_set": working_set,
        "attention_scores": attention_scores,
        "grad_accum_steps": grad_accum_steps,
        "rollback": rollback,
    }
    if ranks > 1:
        settings["ranks"] = ranks
    if tier:
        settings.update(nvme=True, host_window=host_window, nvme_masters=bool(nvme_masters))
    if nvme_all:
        settings.update(nvme_all=True, host_window=host_window, image_window=image_window)
    if activations is not None:
        settings["activations"] = activations
    # (every term the ledger names, as memory_for_model has them)
    host = {**dict.fromkeys(HOST_TERMS, 0), **host}
    ssd = {**dict.fromkeys(SSD_TERMS, 0), **ssd} if ssd else ssd
    return MemoryBreakdown(policy, fam, device, host, ssd, tgt, slot_sizes, grad_sizes, settings)


def _check_beyond_ram(policy: str, resident_first: int, ranks: int, fam: GPTShape, nvme_all: Any, activations: Any) -> None:
    """The preconditions of :func:`memory_model`'s ``nvme_all`` and ``activations``."""
    if not isinstance(nvme_all, bool):
        raise ValueError(f"nvme_all must be True or False, got {nvme_all!r}")
    if activations not in (None, "host", "nvme"):
        raise ValueError(f"activations must be None, 'host' or 'nvme' (where offloaded boundary activations go), got {activations!r}")
    if not (nvme_all or activations):
        return
    what = "nvme_all" if nvme_all else f"activations={activations!r}"
    if policy != "stronghold" or resident_first:
        raise ValueError(
            f"{what} is modelled for the 'stronghold' policy with resident_first=0 (every group streamed and updated "
            f"on the host), not {policy!r} with resident_first={resident_first}"
        )
    if ranks > 1:
        raise ValueError(f"{what} is not modelled with data parallel ({ranks} ranks); drop one")
    if activations and not fam.checkpointing:
        raise ValueError(f"activations={activations!r} offloads checkpointed boundary activations: it needs checkpointing=True")


def _nvme_all_terms(
    fam: GPTShape, L: int, group32: dict, group16: dict, window: int, host_window: int, image_window: int | None,
    rollback: bool, host: dict[str, int],
) -> tuple[dict[str, int], dict[str, int], int, int]:  # fmt: skip
    """Host and SSD terms of the tier beyond host RAM (``memory_model(nvme_all=True)``), its host
    window and image window: the closed form of the ledger's parameter tier
    (:func:`shfx.passes.ledger.host_terms` with ``ssd_images``; ``Offload(params="nvme",
    gradients="nvme", optimizer="nvme")``, the fp32 masters on the SSD in mixed precision).

    The groups whose image can live on the SSD (:func:`shfx.passes.policies.param_tier_groups`)
    are the blocks' and the tail's; the head's is borrowed by the tail (the tied embedding), so
    its image (in fp32: its master) and its fp32 gradient stay in host RAM. SSD: the paged
    images (in fp32 the image is the master), every group's fp32 master in mixed precision,
    AdamW m and v of every group; with rollback (not run yet with the tier) a second version of
    master, m and v. Host: ``H`` host-window buffers, each the largest group's SSD read (m, v and,
    in mixed precision, the master) plus the largest paged gradient (a gradient lands in its
    group's buffer and is used by the update in the same step), the step counters, ``I`` image
    buffers of the largest paged image (``I`` = what the program needs plus one read ahead:
    ``max(1, min(W, l + 2 - W)) + 1``), the gradient staging and the pending tied gradient as
    without the tier."""
    counts = {"head": 1, "block": L, "tail": 1}
    paged = {"head": 0, "block": L, "tail": 1}
    groups = sum(counts.values())
    H = min(host_window, groups)
    I = max(1, min(window, L + 2 - window)) + 1 if image_window is None else image_window  # noqa: E741
    image_of = group16 if fam.mixed else group32
    master = sum(group32[k] * c for k, c in counts.items())
    paged_images = sum(image_of[k] * c for k, c in paged.items())
    read = max(_GROUP_STATE_BYTES // 4 * group32[k] + (group32[k] if fam.mixed else 0) for k in counts)
    out = dict.fromkeys(HOST_TERMS, 0)
    out["master parameters (fp32)"] = 0 if fam.mixed else group32["head"]
    out["working copy (16-bit)"] = group16["head"] if fam.mixed else 0
    out["gradients (fp32)"] = group32["head"]
    out[HOST_WINDOW] = H * (read + max(group32[k] for k, c in paged.items() if c)) + _STEP_BYTES * groups
    out[IMAGE_WINDOW] = I * max(image_of[k] for k, c in paged.items() if c)
    out["gradient staging (pinned)"] = host["gradient staging (pinned)"]
    out["pending tied gradient"] = host["pending tied gradient"]
    ssd = {
        "master parameters (fp32)": master if fam.mixed else paged_images,
        "optimizer states (m, v)": _GROUP_STATE_BYTES // 4 * master,
        "working copy (16-bit)": paged_images if fam.mixed else 0,
        "rollback copies": 3 * master if rollback else 0,
    }
    return out, ssd, H, I


def _ranks(tgt: Target, ranks: int | None) -> int:
    """Data-parallel ranks: ``ranks`` when given (it must agree with a target that has its
    own), else the target's."""
    if ranks is None:
        return tgt.ranks
    _positive_int("ranks", ranks)
    if tgt.ranks > 1 and ranks != tgt.ranks:
        raise ValueError(f"ranks={ranks} disagrees with the target's {tgt.ranks} ranks; give it in one place")
    return ranks


def _dp_host(
    fam: GPTShape, L: int, ranks: int, group32: dict, group16: dict | None, rollback: bool, host: dict,
    host_groups: dict | None = None,
) -> dict[str, int]:  # fmt: skip
    """One rank's host terms with data parallel: the closed form of
    :func:`shfx.passes.ledger.host_terms` with ``ranks``. ``host_groups``: the groups of each
    kind updated on the host (default all); the others are updated on the device, replicated:
    on the host their image and master shard (the store lays one out for every group), and on a
    GPU the all-reduce's host scratch of the largest one's gradient (``collective buffers``)."""
    counts = {"head": 1, "block": L, "tail": 1}
    hosted = counts if host_groups is None else host_groups
    dev = {k: counts[k] - hosted[k] for k in counts}
    chunk = {k: shard_chunk(group32[k] // 4, ranks) for k in counts}
    own = {k: shard_numel(group32[k] // 4, ranks) for k in counts}  # rank 0's: the most
    masters = sum(4 * own[k] * c for k, c in counts.items())
    shard = sum(4 * own[k] * c for k, c in hosted.items())
    elt = fam.param_bytes if group16 is not None else 4
    padded = max((ranks * chunk[k] for k, c in hosted.items() if c), default=0)
    largest_dev = max((group32[k] for k, c in dev.items() if c), default=0)
    return {
        **dict.fromkeys(HOST_TERMS, 0),
        "master parameters (fp32)": masters,
        DP_IMAGE: 0 if group16 is not None else host["master parameters (fp32)"],
        "gradients (fp32)": shard,
        "optimizer states (m, v)": _GROUP_STATE_BYTES // 4 * shard,
        "working copy (16-bit)": host["working copy (16-bit)"],
        # (+ the store's staging buffer a borrowed, tied, gradient is copied through)
        "gradient staging (pinned)": _STAGING_BUFFERS * padded * elt
        + (max(group32[k] for k in counts) if host["pending tied gradient"] else 0),
        DP_COLLECTIVE: (padded * elt + 2 * max((chunk[k] for k, c in hosted.items() if c), default=0) * elt if padded else 0)
        + largest_dev // 4 * elt,
        "pending tied gradient": host["pending tied gradient"],
        # (a device group's journal copies its master, m, v, step and slot weights: in 16 bits the
        # whole device master and the 16-bit slot; in fp32 this rank's host master shard and the fp32 slot)
        "rollback copies": sum((4 * own[k] * 3 + _STEP_BYTES) * c for k, c in hosted.items())
        + (sum((3 * group32[k] + _STEP_BYTES + group16[k]) * c for k, c in dev.items()) if group16 is not None
           else sum((4 * own[k] + 3 * group32[k] + _STEP_BYTES) * c for k, c in dev.items()))
        if rollback else 0,
    }


def _nvme_options(policy: Any, nvme: bool | None, host_window: int | None, masters: bool | None) -> tuple[bool | None, int, bool]:
    """The NVMe tier's options of :func:`memory_model`: from the arguments, or from a policy
    object with ``nvme=True`` (an argument that disagrees with it is an error)."""
    own = isinstance(policy, Policy) and bool(getattr(policy, "nvme", False))
    if own:
        if nvme is False:
            raise ValueError(f"nvme=False disagrees with {policy!r}; give it in one place")
        nvme = True
        ph = policy.host_window  # type: ignore[attr-defined]
        if host_window is not None and ph != "auto" and host_window != ph:
            raise ValueError(f"host_window={host_window!r} disagrees with {policy!r}; give it in one place")
        host_window = host_window if host_window is not None else (ph if ph != "auto" else None)
        masters = policy.nvme_masters if masters is None else masters  # type: ignore[attr-defined]
    if host_window is None:
        host_window = DEFAULT_HOST_WINDOW
    if isinstance(host_window, bool) or not isinstance(host_window, int) or host_window < 1:
        raise ValueError(f"host_window must be an int >= 1 (groups whose optimizer states are on the host at once), got {host_window!r}")
    if masters is not None and not isinstance(masters, bool):
        raise ValueError(f"nvme_masters must be True or False, got {masters!r}")
    return nvme, host_window, bool(masters)


# ---- the planner ---------------------------------------------------------------------------------


@dataclass
class PlanRow:
    """The largest size one policy trains: ``layers`` (0: not even one), its parameter count,
    its memory, and what stops one layer more (``"tier: term"``)."""

    policy: str
    layers: int
    params: int
    breakdown: MemoryBreakdown
    binding: str

    def to_dict(self) -> dict:
        return {
            "policy": self.policy,
            "layers": self.layers,
            "params": self.params,
            "binding": self.binding,
            **{k: v for k, v in self.breakdown.to_dict().items() if k not in ("policy", "family")},
        }


_AUTO_K_MAX = 256  # resident_first="auto" tries k = 0, 1, ... until two in a row gain nothing


def largest_trainable(policy: str | Policy, family: GPTShape, hardware: Any, *, max_layers: int = 100_000, **memory_kw) -> PlanRow:
    """The largest layer count of ``family`` that ``policy`` fits on ``hardware`` (at most
    ``max_layers``), and the term that stops one layer more.

    ``memory_kw`` are :func:`memory_model`'s options. With 0 layers (even one does not fit), the
    row's breakdown is that of one layer, and its binding says what overflows.

    Memory is not monotone in the layer count: whether the tail shares a slot with the head or
    with a block depends on ``(layers + 1) mod window``, so a model can fit when one layer
    smaller does not. It is monotone along each residue class ``mod lcm(window, 2)`` once the
    window is full, so the search tries every size up to a few windows, then gallops and
    bisects along each residue class.
    """
    _positive_int("max_layers", max_layers)
    memory_kw.update(_nvme_kw(policy, memory_kw))
    policy, w, k = _unpack(policy, memory_kw.pop("window", None), memory_kw.pop("resident_first", None))
    memory_kw = dict(memory_kw, window=w, resident_first=k)
    if memory_kw.get("resident_first") == "auto":
        # STRONGHOLD's k, chosen under the budget: the k that trains the most layers (the first
        # k stages need 4 instead of 16 host bytes per parameter, but their optimizer on the
        # device), the smallest such k
        if policy != "stronghold":
            raise ValueError(f"resident_first='auto' is for the 'stronghold' policy, not {policy!r}")
        if _ranks(as_target(hardware), memory_kw.get("ranks")) > 1:  # data parallel: every group on the host
            return largest_trainable(policy, family, hardware, max_layers=max_layers, **dict(memory_kw, resident_first=0))
        best, worse = None, 0
        for k in range(_AUTO_K_MAX + 1):  # more k helps while the host binds, then costs the device
            row = largest_trainable(policy, family, hardware, max_layers=max_layers, **dict(memory_kw, resident_first=k))
            if best is None or row.layers > best.layers:
                best, worse = row, 0
            else:
                worse += 1
                if worse >= 2 or row.layers < k:
                    break
        assert best is not None
        return best
    tgt = as_target(hardware)
    window = memory_kw.get("window", 2)
    resident_first = memory_kw.get("resident_first", 0)
    _check_common(policy, window, resident_first)

    def at(n_layers: int) -> MemoryBreakdown:
        return memory_model(policy, family.with_layers(n_layers), tgt, **memory_kw)

    def fits(n_layers: int) -> bool:
        return at(n_layers).fits(tgt)

    period = window * 2 // math.gcd(window, 2)
    small = min(max_layers, resident_first + 2 * period + 4)
    best = max((n_layers for n_layers in range(1, small + 1) if fits(n_layers)), default=0)
    for r in range(period):
        start = small + 1 + r
        if start > max_layers or not fits(start):
            continue
        steps_max = (max_layers - start) // period
        lo, hi = 0, 1  # fits(start + lo*period); find the first hi that does not (or the end)
        while hi <= steps_max and fits(start + hi * period):
            lo, hi = hi, hi * 2
        hi = min(hi, steps_max + 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(start + mid * period):
                lo = mid
            else:
                hi = mid
        best = max(best, start + lo * period)
    label = policy + ("+nvme-all" if memory_kw.get("nvme_all") else "+nvme" if memory_kw.get("nvme") else "")
    label += f"+act-{memory_kw['activations']}" if memory_kw.get("activations") else ""
    if best == 0:
        bd = at(1)
        return PlanRow(label, 0, 0, bd, bd.binding(tgt))
    bd = at(best)
    binding = at(best + 1).binding(tgt) if best < max_layers else f"max_layers ({max_layers}) reached"
    return PlanRow(label, best, family.with_layers(best).num_params(), bd, binding)


def _nvme_kw(policy: Any, memory_kw: dict) -> dict:
    """A policy object's NVMe tier as :func:`memory_model` options (popped from ``memory_kw``
    and checked against them); empty for a name or a policy without the tier."""
    if not (isinstance(policy, Policy) and getattr(policy, "nvme", False)):
        return {}
    nvme, host_window, masters = _nvme_options(
        policy, memory_kw.pop("nvme", None), memory_kw.pop("host_window", None), memory_kw.pop("nvme_masters", None)
    )
    return {"nvme": nvme, "host_window": host_window, "nvme_masters": masters}


@dataclass
class Plan:
    """The largest trainable size of each policy on one target (:func:`plan`)."""

    family: GPTShape | None
    hardware: Target
    rows: list[PlanRow]
    settings: dict

    def row(self, policy: str) -> PlanRow:
        for r in self.rows:
            if r.policy == policy:
                return r
        raise KeyError(f"no row for policy {policy!r} in this plan; it has: {', '.join(r.policy for r in self.rows)}")

    def table(self) -> str:
        st = self.settings
        what = self.family.describe() if self.family is not None else st.get("model", "model")
        ws = format_bytes(st["workspace_bytes"]) if st.get("workspace_bytes") is not None else "auto"
        head = [
            what,
            f"on {self.hardware.describe()}",
            f"window {st.get('window')}, resident_first {st.get('resident_first')}, workspace {ws}, "
            f"allocator slack {100 * st.get('allocator_slack', 0):.0f}%"
            + ("" if self.hardware.emulated else f", working set {'on' if st.get('working_set', True) else 'off'}"),
            "",
        ]
        if st.get("not data parallel"):
            head[-2] += (
                f"; left out (they update on the device, data parallel shards the host optimizer): "
                f"{', '.join(st['not data parallel'])}"
            )
        hws = sorted({r.breakdown.settings["host_window"] for r in self.rows if r.breakdown.settings.get("nvme")})
        if hws:
            head[-2] += f", NVMe tier: host window {', '.join(map(str, hws))}"
        beyond = sorted({r.breakdown.settings["host_window"] for r in self.rows if r.breakdown.settings.get("nvme_all")})
        if beyond:
            head[-2] += f", beyond RAM (nvme-all): host window {', '.join(map(str, beyond))}"
        width = max([16] + [len(r.policy) + 5 for r in self.rows])
        head.append(f"{'policy':<{width}} {'layers':>7} {'params':>9} {'device':>11} {'host':>11} {'SSD':>11}  limited by")
        for r in self.rows:
            bd = r.breakdown
            if r.layers == 0:
                dev = host = ssd = "-"
            else:
                dev, host = format_bytes(bd.device_total), format_bytes(bd.host_total)
                ssd = format_bytes(bd.ssd_total) if bd.ssd else "-"
            k = r.breakdown.settings.get("resident_first", 0)
            label = f"{r.policy} k={k}" if k and self.settings.get("resident_first") == "auto" else r.policy
            head.append(f"{label:<{width}} {r.layers:>7} {_format_params(r.params):>9} {dev:>11} {host:>11} {ssd:>11}  {r.binding}")
        return "\n".join(head)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict:
        return {
            "family": asdict(self.family) if self.family is not None else None,
            "hardware": asdict(self.hardware),
            "settings": dict(self.settings),
            "rows": [r.to_dict() for r in self.rows],
        }

    def to_json(self, path: str | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    def to_csv(self, path: str) -> str:
        """One row per policy: layers, params, totals, binding, then every term as
        ``tier:term`` columns (bytes)."""
        cols = [f"device:{t}" for t in DEVICE_TERMS] + [f"host:{t}" for t in HOST_TERMS] + [f"ssd:{t}" for t in SSD_TERMS]
        # (the tiers beyond host RAM add their own terms: columns only when a row has them)
        extra = [f"host:{ACTIVATIONS_OFFLOADED}"] + [f"ssd:{t}" for t in _BEYOND_RAM_SSD_TERMS]
        cols += [c for c in extra if c not in cols and any(c.split(":", 1)[1] in getattr(r.breakdown, c.split(":", 1)[0]) for r in self.rows)]
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["policy", "layers", "params", "device_bytes", "host_bytes", "ssd_bytes", "binding", *cols])
            for r in self.rows:
                bd = r.breakdown
                terms = {f"device:{k}": v for k, v in bd.device.items()}
                terms.update({f"host:{k}": v for k, v in bd.host.items()})
                terms.update({f"ssd:{k}": v for k, v in bd.ssd.items()})
                w.writerow(
                    [r.policy, r.layers, r.params, bd.device_total, bd.host_total, bd.ssd_total, r.binding]
                    + [terms.get(c, 0) for c in cols]
                )
        return path


def plan(
    family: GPTShape,
    hardware: Any,
    *,
    policies: Sequence[str | Policy] | None = None,
    max_layers: int = 100_000,
    window: int = 2,
    resident_first: int | str = 0,
    tiers: Sequence[str] = (),
    tier_options: dict | None = None,
    **memory_kw,
) -> Plan:
    """:func:`largest_trainable` for each policy. ``resident_first`` applies to ``stronghold``
    only (the other policies do not take it; ``"auto"``: the smallest k that trains the most
    layers, trying k = 0, 1, ... until two in a row gain nothing); ``memory_kw`` go to :func:`memory_model`.
    ``tiers``: names of :data:`BEYOND_RAM_TIERS` (``"nvme-all"``, ``"nvme-all+act-host"``,
    ``"nvme-all+act-nvme"``), each a ``stronghold`` row (``window``, ``resident_first=0``) after
    the policies' rows, named ``stronghold+<tier>``; ``tier_options``: more :func:`memory_model`
    options for those rows only (``host_window``, ``image_window``).

    >>> p = plan(GPTShape(hidden=2048, heads=16, seq=1024, batch=4, vocab=50304), "V100-32GB-PCIe3")
    >>> [(r.policy, r.layers) for r in p.rows]
    [('resident', 33), ('l2l', 66), ('zero-offload', 67), ('zero-infinity', 116), ('stronghold', 116)]
    """
    policies = policy_names() if policies is None else (policies,) if isinstance(policies, (str, Policy)) else policies
    skipped: list[str] = []
    if _ranks(as_target(hardware), memory_kw.get("ranks")) > 1:
        # data parallel shards the host optimizer: the policies updating on the device are left out
        keep = [p for p in policies if not updates_on_device(p)]
        skipped = [str(p if isinstance(p, str) else p.name) for p in policies if updates_on_device(p)]
        policies = keep
    unpacked = [
        (*_unpack(p, *((window, resident_first if p == "stronghold" else 0) if isinstance(p, str) else ())), _nvme_kw(p, dict(memory_kw)))
        for p in policies
    ]  # fmt: skip
    tgt = as_target(hardware)
    rows = []
    for name, w, k, nv in unpacked:
        kw = {key: v for key, v in memory_kw.items() if not (nv and key in nv)}
        rows.append(largest_trainable(name, family, tgt, max_layers=max_layers, **dict(kw, window=w, resident_first=k, **nv)))
    for t in tiers:
        if t not in BEYOND_RAM_TIERS:
            raise ValueError(f"unknown tier {t!r}; known: {', '.join(BEYOND_RAM_TIERS)}")
        kw = {key: v for key, v in memory_kw.items() if key not in ("nvme", "nvme_masters")}
        kw.update(tier_options or {}, window=window, resident_first=0, **BEYOND_RAM_TIERS[t])
        rows.append(largest_trainable("stronghold", family, tgt, max_layers=max_layers, **kw))
    ws, slack, wset = _resolve(tgt, memory_kw.get("workspace_bytes"), memory_kw.get("allocator_slack", 0.0), memory_kw.get("working_set"))
    settings = dict(
        window=window,
        resident_first=resident_first,
        workspace_bytes=ws,
        allocator_slack=slack,
        working_set=wset,
        max_layers=max_layers,
        **{k: v for k, v in memory_kw.items() if k not in ("workspace_bytes", "allocator_slack", "working_set")},
    )
    if skipped:
        settings["not data parallel"] = skipped
    return Plan(family, tgt, rows, settings)


def updates_on_device(policy: str | Policy) -> bool:
    """Whether a policy updates some group on the device (refused with data parallel)."""
    name = policy if isinstance(policy, str) else policy.name
    k = getattr(policy, "resident_first", 0) if isinstance(policy, Policy) else 0
    return name in ("resident", "l2l") or bool(isinstance(k, int) and k > 0)


# ---- any model, from its capture ----------------------------------------------------------------


def _any_policy(policy: str | Policy, window: int | None, resident_first: int | None) -> Policy:
    """A policy object for the program replay: any Policy (registered or not), or a name with
    stronghold's window and k."""
    if isinstance(policy, Policy):
        for key, given in (("window", window), ("resident_first", resident_first)):
            own = getattr(policy, key, None)
            if given is not None and given != own:
                raise ValueError(f"{key}={given!r} disagrees with {policy!r}; give it in one place")
        if "host_window" in policy.auto:  # the NVMe tier's host window: the planner's default
            return policy.replace(host_window=DEFAULT_HOST_WINDOW)
        return policy
    name, w, k = _unpack(policy, window, resident_first)
    _check_common(name, w, k)
    return _policy_of(name, w, k)


def memory_for_model(
    policy: str | Policy,
    model: Any,
    example_inputs: tuple,
    hardware: Any,
    *,
    window: int | None = None,
    resident_first: int | None = None,
    blocks: Any = None,
    workspace_bytes: int | None = None,
    allocator_slack: float = 0.0,
    grad_accum_steps: int = 1,
    graph: Any = None,
    precision: str = "float32",
    rollback: bool | None = None,
    ranks: int | None = None,
) -> MemoryBreakdown:
    """The memory model of any model shfx can capture, from its real stages and step program.

    Captures ``model(*example_inputs)`` (meta tensors are fine) and partitions it as
    ``shfx.compile`` does (:func:`shfx.passes.pipeline.compile_variant`), builds ``policy``'s
    programs (train, eval, cold backward; any policy, by name or as an object), and counts
    what the engine reserves: the slot pool and gradient buffers as :class:`shfx.passes.pipeline.Variant`
    sizes them, the device AdamW states of the groups updated there, and the boundary values,
    their gradients and pre-forward buffer copies replayed in program order. Exact on the
    emulated device for every model; on a real GPU the working set of a stage is not known here
    (pass it in ``workspace_bytes``). ``graph``: a :class:`shfx.passes.partition.StageGraph` already
    partitioned (skips the capture; it is taken in the precision it was partitioned for).
    ``precision``: what ``shfx.compile(precision=...)`` trains in (``fp32``, ``bf16``, ``fp16``
    or the long names); ``rollback``: count the step journal's copies (default: as
    ``shfx.compile`` does, on for fp16). ``ranks``: data parallel (default: the target's), the
    programs with their collectives and the host terms one rank's.
    """
    from shfx.passes.pipeline import PipelineOptions, build_programs, compile_variant

    pol = _any_policy(policy, window, resident_first)
    tgt = as_target(hardware)
    ranks = _ranks(tgt, ranks)
    workspace_bytes, allocator_slack, _ = _resolve(tgt, workspace_bytes, allocator_slack, False)
    precision = normalize_precision(precision)
    rollback = precision == "float16" if rollback is None else bool(rollback)
    if graph is None:
        opts = PipelineOptions(
            policy=pol, blocks=blocks, verify=False, precision=short_precision(precision), plan_only=True, ranks=ranks
        )
        variant = compile_variant(model, tuple(example_inputs), {}, opts)
        graph, progs = variant.graph, variant.programs
    else:
        progs = build_programs(graph.specs, pol, verify=False, ranks=ranks)
    led = replay(
        progs[0], programs=progs, group_bytes=[g.host_master_bytes for g in graph.groups],
        working_bytes=[g.working_bytes for g in graph.groups], grad_accum_steps=grad_accum_steps, rollback=rollback,
    )  # fmt: skip
    device = dict.fromkeys(DEVICE_TERMS, 0)
    device.update({k: v for k, v in led.terms_at_peak("device").items() if v})
    device["workspace"] = workspace_bytes
    device["allocator slack"] = int(round(allocator_slack * tgt.device_bytes))
    host = dict.fromkeys(HOST_TERMS, 0)
    host.update(led.static("host"))
    on_ssd = led.static("ssd")
    ssd = {**dict.fromkeys(SSD_TERMS, 0), **on_ssd} if on_ssd else {}
    slot_sizes, grad_sizes = pool_sizes(progs)
    name = type(model).__name__ if model is not None else "model"
    settings = {"window": getattr(pol, "window", None), "resident_first": getattr(pol, "resident_first", 0),
                "workspace_bytes": workspace_bytes, "allocator_slack": allocator_slack, "working_set": False,
                "stages": len(graph.stages), "precision": precision, "rollback": rollback}
    if ranks > 1:
        settings["ranks"] = ranks
    if progs[0].ssd_groups:
        settings.update(nvme=True, host_window=progs[0].host_window, nvme_masters=progs[0].ssd_masters)
    return MemoryBreakdown(pol.name, None, device, host, ssd, tgt, slot_sizes, grad_sizes, settings, name=name)


def plan_for_model(
    model: Any,
    example_inputs: tuple,
    hardware: Any,
    *,
    policies: Sequence[str | Policy] | None = None,
    window: int = 2,
    resident_first: int = 0,
    blocks: Any = None,
    workspace_bytes: int | None = None,
    allocator_slack: float = 0.0,
    precision: str = "float32",
    rollback: bool | None = None,
) -> Plan:
    """Does ``model`` (at its own size) fit with each policy? One capture, then
    :func:`memory_for_model` per policy; each row's ``layers`` is the number of stages if it
    fits, else 0, and its binding the tightest tier and term. ``precision``, ``rollback``: as
    :func:`memory_for_model`."""
    from shfx.passes.pipeline import PipelineOptions, compile_variant

    policies = policy_names() if policies is None else (policies,) if isinstance(policies, (str, Policy)) else policies
    pols = [_any_policy(p, window, resident_first if p == "stronghold" else 0) if isinstance(p, str) else p for p in policies]
    tgt = as_target(hardware)
    precision = normalize_precision(precision)
    opts = PipelineOptions(policy=pols[0], blocks=blocks, verify=False, precision=short_precision(precision), plan_only=True)
    graph = compile_variant(model, tuple(example_inputs), {}, opts).graph
    n_params = sum(
        info.numel for k, info in graph.tensors.items() if info.kind == "param" and info.trainable
    )
    rows = []
    for p in pols:
        bd = memory_for_model(
            p, model, example_inputs, tgt, workspace_bytes=workspace_bytes, allocator_slack=allocator_slack, graph=graph,
            precision=precision, rollback=rollback,
        )  # fmt: skip
        ok = bd.fits(tgt)
        rows.append(PlanRow(p.name, len(graph.stages) if ok else 0, n_params if ok else 0, bd, bd.binding(tgt)))
    ws, slack, _ = _resolve(tgt, workspace_bytes, allocator_slack, False)
    settings = dict(window=window, resident_first=resident_first, workspace_bytes=ws, allocator_slack=slack,
                    working_set=False, model=f"{type(model).__name__} ({len(graph.stages)} stages, {n_params / 1e6:.1f} M params)")
    return Plan(None, tgt, rows, settings)
