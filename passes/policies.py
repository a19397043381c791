"""Schedule policies as data: where each stage's parameters, gradients and optimizer states
live, the window, and when updates run; lowered to step programs by the shared passes of
:mod:`shfx.passes.lowering`.

STRONGHOLD and the systems it was compared with, on the same runtime and the same simulator;
they train exactly like eager PyTorch and differ in memory and time only:

| policy | on the device | optimizer | program |
| --- | --- | --- | --- |
| :class:`Resident` (Megatron-like) | every stage, persistent | on the device (``DU``) | F..., B DU... |
| :class:`L2L` | one stage at a time | states on the device; params back to the host (``OP``) | PF F R ..., B DU OP R PF ... |
| :class:`ZeroOffload` | every stage, persistent (params and grads) | on the host after the backward; params refreshed | F..., B OG..., U..., PF (refresh)... |
| :class:`ZeroInfinity` | fetched on demand, ``lookahead`` stages ahead | on the host after the backward | PF PF F R PF ..., PF PF B OG R PF ..., U... |
| :class:`Stronghold` | a window of W stages; the first k persistent | host (window stages, during the backward), device (first k) | the window schedule |

A policy is a frozen object: ``shfx.compile(model, policy=shfx.Stronghold(window=2,
resident_first=1))``; the names (``"stronghold"``, ...) are shorthands for the defaults
(:data:`POLICIES`, :func:`make_policy`). Its :meth:`Policy.placement` says, for given stage
specs, which stages stay resident, which stream through how many slots, which groups are
updated on the device and when updates run; :func:`lower_policy` turns that into a program
with the passes of :mod:`shfx.passes.lowering`. A new policy is a subclass with a
``placement`` (see ``docs/design.md``, "Adding a policy").

>>> from shfx.passes.stages import chain
>>> " ".join(Stronghold(window=2).program(chain(3)).actions())
'PF0 PF1 F0 R0 PF2 F1 F2 B2 OG2 U2 R2 PF0 B1 OG1 U1 R1 B0 OG0 U0 R0'
>>> make_policy("zero-offload", delayed_update=True)
ZeroOffload(delayed_update=True, deferred_update=False)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from .lowering import (
    add_param_transfers,
    image_window_needed,
    add_buffer_offloads,
    add_grad_norms,
    add_grad_offloads,
    add_param_copyback,
    add_prefetch_release,
    add_refresh,
    add_ssd_transfers,
    add_updates_after_backward,
    add_updates_in_backward,
    check_host_window,
    check_window,
    checked_stages,
    compute_order,
)
from .actions import OG, SR, Action, U
from .features import clip_program, delayed_update
from .meta import get_meta
from .program import Program, ScheduleError, lower_actions
from .stages import StageSpec

__all__ = [
    "Placement",
    "Policy",
    "FunctionPolicy",
    "add_ssd_tier",
    "add_param_tier",
    "param_tier_groups",
    "least_image_window",
    "Stronghold",
    "Resident",
    "L2L",
    "ZeroOffload",
    "ZeroInfinity",
    "POLICIES",
    "policy_names",
    "get_policy",
    "make_policy",
    "resolve_policy",
    "policy_program",
    "lower_policy",
    "policy_actions",
    "window_actions",
    "schedule_window",
    "schedule_stronghold",
    "schedule_resident",
    "schedule_l2l",
    "schedule_zero_offload",
    "schedule_zero_infinity",
]

Updates = Literal["backward", "after-backward", "next-step", "next-forward"]


@dataclass(frozen=True)
class Placement:
    """What a policy decides for one model's stages.

    Attributes:
        persistent: stages resident across steps, in slots ``0..len-1`` (loaded once).
        streamed: stages fetched into the window's slots when used.
        slots: the window: slots for the streamed stages (after the persistent ones).
        keep: streamed stages whose forward residency lasts into their backward (the last
            ``keep`` of the forward); 0: every stage is fetched again for its backward.
        device_groups: trainable groups updated on the device (their gradients and optimizer
            states stay there); the others are updated on the host.
        updates: when the host updates run: ``"backward"`` (each as soon as its gradients are
            on the host), ``"after-backward"`` (all after the backward), ``"next-step"`` (the
            runtime runs them between steps: ZeRO-Offload's delayed update), ``"next-forward"``
            (exact gradient clipping: a ``GN`` per group where its gradients land, then every
            ``U`` in forward order at the end; ``step()`` starts them and the next forward's
            prefetch of a stage waits for the updates of the groups it reads).
        refresh: after the host updates, refresh the persistent stages' slots with the new
            weights (a PREFETCH of each; with ``"next-forward"``, at the start of the program).
        ssd_groups: the NVMe tier: host-updated groups whose optimizer states (AdamW m, v) live
            on the SSD, read into a host-window buffer before their update and written back
            after it (empty: every state in host RAM).
        host_window: how many of those groups' states are on the host at once (its buffers).
        ssd_masters: the SSD holds those groups' fp32 master weights too (mixed precision: the
            masters are a buffer of their own, read only by the update).
    """

    persistent: tuple[int, ...]
    streamed: tuple[int, ...]
    slots: int
    keep: int
    device_groups: frozenset[int]
    updates: Updates
    refresh: bool = False
    ssd_groups: frozenset[int] = frozenset()
    host_window: int = 0
    ssd_masters: bool = False

    @property
    def num_slots(self) -> int:
        return len(self.persistent) + self.slots


class Policy:
    """A schedule policy: frozen data, lowered by :func:`lower_policy`.

    Subclasses are frozen dataclasses with a class attribute ``name`` and a :meth:`placement`;
    ``windowed`` ones have a ``window`` field (an int, or ``"auto"`` for the tuner)."""

    name: ClassVar[str]
    windowed: ClassVar[bool] = False

    def placement(self, stages: Sequence[StageSpec]) -> Placement:
        raise NotImplementedError

    def program_name(self, placement: Placement) -> str:
        return self.name

    def program(self, stages: Sequence[StageSpec]) -> Program:
        """The step program for ``stages`` (:func:`lower_policy`)."""
        return lower_policy(self, stages)

    @property
    def auto(self) -> tuple[str, ...]:
        """The fields left to the tuner (``"auto"``); a field that does not apply (the host
        window without the NVMe tier) is not."""
        off = self._inactive()
        return tuple(f.name for f in dataclasses.fields(self) if getattr(self, f.name) == "auto" and f.name not in off)  # type: ignore[arg-type]

    def _inactive(self) -> set[str]:
        return set()

    def replace(self, **changes: Any) -> Policy:
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    def options(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]


def _positive_or_auto(cls: str, field: str, v: object, minimum: int) -> None:
    if v == "auto":
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{field} must be an int >= {minimum} or 'auto' (in {cls}(...)), got {v!r}")


def _check_flag(cls: str, field: str, v: object) -> None:
    if not isinstance(v, bool):
        raise TypeError(f"{cls}({field}=...) must be True or False, got {v!r}")


def _update_groups(stages: Sequence[StageSpec], which: Sequence[int] | None = None) -> frozenset[int]:
    idx = range(len(stages)) if which is None else which
    return frozenset(stages[i].update_group for i in idx if stages[i].update_group is not None)


def _concrete(policy: Policy) -> None:
    if policy.auto:
        raise ScheduleError(
            f"{policy!r} leaves {', '.join(policy.auto)} to the tuner: choose with cost_model.tune.tune_window "
            "(shfx.compile does it at the first call) or give a number"
        )


class _NVMe:
    """The NVMe tier as fields of a policy that updates on the host (:class:`Stronghold`,
    :class:`ZeroInfinity`): ``nvme`` puts the optimizer states (AdamW m, v) of every
    host-updated group on the SSD, ``nvme_masters`` their fp32 master weights too (mixed
    precision only: in fp32 the master is the image a PREFETCH sends), and ``host_window``
    bounds how many groups' states are on the host at once (``"auto"``: the tuner's choice)."""

    def _check_nvme(self, cls: str) -> None:
        _check_flag(cls, "nvme", self.nvme)
        _check_flag(cls, "nvme_masters", self.nvme_masters)
        _positive_or_auto(cls, "host_window", self.host_window, 1)
        if self.nvme_masters and not self.nvme:
            raise ValueError(f"{cls}(nvme_masters=True) puts the master weights on the SSD, which needs nvme=True")

    def _inactive(self) -> set[str]:
        return set() if self.nvme else {"host_window"}

    def _ssd(self, stages: Sequence[StageSpec], host_groups: frozenset[int]) -> dict[str, Any]:
        """The Placement fields of the NVMe tier for these host-updated groups."""
        if not self.nvme or not host_groups:
            return {}
        return {
            "ssd_groups": host_groups,
            "host_window": check_host_window(self.host_window, len(host_groups)),
            "ssd_masters": self.nvme_masters,
        }

    def _nvme_name(self, placement: Placement) -> str:
        if not placement.ssd_groups:
            return ""
        return f", nvme H={placement.host_window}" + (" with masters" if placement.ssd_masters else "")

    def __repr__(self) -> str:
        # NOTE: the NVMe fields are shown only when the tier is on, so a policy without it
        # reads (and prints in reports) as before the tier existed
        nv = ("nvme", "nvme_masters", "host_window")
        shown = [f for f in dataclasses.fields(self) if self.nvme or f.name not in nv]  # type: ignore[arg-type]
        return f"{type(self).__name__}({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in shown)})"


@dataclass(frozen=True, repr=False)
class Stronghold(_NVMe, Policy):
    """STRONGHOLD: a sliding window of ``window`` stages on the device, transfers overlapped
    with compute, each group updated on the host as soon as its gradients land; the first
    ``resident_first`` stages stay on the device with their optimizer, so the next forward
    starts without waiting for their host updates. With ``nvme=True`` the optimizer states of
    the host-updated groups live on the SSD, ``host_window`` groups' at a time on the host
    (:class:`_NVMe`).

    >>> from shfx.passes.stages import chain
    >>> " ".join(Stronghold(window=2, resident_first=1).program(chain(4)).actions())
    'PF1 PF2 F0 F1 R1 PF3 F2 F3 B3 OG3 U3 R3 PF1 B2 OG2 U2 R2 B1 OG1 U1 R1 B0 DU0'
    >>> " ".join(Stronghold(window=2, nvme=True, host_window=1).program(chain(3)).actions())
    'PF0 PF1 F0 R0 PF2 F1 F2 B2 SR2 OG2 U2 SW2 SR1 R2 PF0 B1 OG1 U1 SW1 SR0 R1 B0 OG0 U0 SW0 R0'
    """

    name: ClassVar[str] = "stronghold"
    windowed: ClassVar[bool] = True
    window: int | Literal["auto"] = 2
    resident_first: int | Literal["auto"] = 0
    deferred_update: bool = False
    nvme: bool = False
    host_window: int | Literal["auto"] = "auto"
    nvme_masters: bool = False

    def __post_init__(self) -> None:
        _positive_or_auto("Stronghold", "window", self.window, 1)
        _positive_or_auto("Stronghold", "resident_first", self.resident_first, 0)
        _check_flag("Stronghold", "deferred_update", self.deferred_update)
        self._check_nvme("Stronghold")

    def placement(self, stages: Sequence[StageSpec]) -> Placement:
        _concrete(self)
        n = len(stages)
        k = min(int(self.resident_first), n)
        rest = n - k
        w = check_window(self.window, rest) if rest else 0
        when: Updates = "next-forward" if self.deferred_update else "backward"
        dev = _update_groups(stages, range(k))
        ssd = self._ssd(stages, _update_groups(stages) - dev)
        return Placement(tuple(range(k)), tuple(range(k, n)), w, w, dev, when, **ssd)

    def program_name(self, placement: Placement) -> str:
        k = len(placement.persistent)
        name = f"stronghold(W={placement.slots}" + ("" if k == 0 else f", k={k}")
        name += ", deferred update" if self.deferred_update else ""
        return name + self._nvme_name(placement) + ")"


@dataclass(frozen=True)
class Resident(Policy):
    """Everything on the device, the optimizer too (Megatron-like): every stage persistent, each
    group updated on the device right after the last backward that sends it gradients. With
    ``deferred_update`` (exact clipping: ``max_grad_norm`` turns it on) each group's norm is
    computed on the device after its last backward, its gradient waits in the stage's gradient
    buffer, and the updates run after the step's gate, in forward order.

    >>> from shfx.passes.stages import chain
    >>> " ".join(Resident().program(chain(3)).actions())
    'F0 F1 F2 B2 DU2 B1 DU1 B0 DU0'
    >>> " ".join(Resident(deferred_update=True).program(chain(3)).actions())
    'F0 F1 F2 B2 GN2 B1 GN1 B0 GN0 CK0 DU0 DU1 DU2'
    """

    name: ClassVar[str] = "resident"
    deferred_update: bool = False

    def __post_init__(self) -> None:
        _check_flag("Resident", "deferred_update", self.deferred_update)

    def placement(self, stages: Sequence[StageSpec]) -> Placement:
        n = len(stages)
        when: Updates = "next-forward" if self.deferred_update else "backward"
        return Placement(tuple(range(n)), (), 0, 0, _update_groups(stages), when)

    def program_name(self, placement: Placement) -> str:
        return "resident(deferred update)" if self.deferred_update else "resident"


@dataclass(frozen=True)
class L2L(Policy):
    """L2L: one stage on the device at a time; the optimizer states of every group live on the
    device, a stage is updated there right after its backward and its parameters are copied
    back to the host (``OP``) before it leaves.

    >>> from shfx.passes.stages import chain
    >>> " ".join(L2L().program(chain(2)).actions())
    'PF0 F0 R0 PF1 F1 B1 DU1 OP1 R1 PF0 B0 DU0 OP0 R0'
    """

    name: ClassVar[str] = "l2l"

    def placement(self, stages: Sequence[StageSpec]) -> Placement:
        return Placement((), tuple(range(len(stages))), 1, 1, _update_groups(stages), "backward")


@dataclass(frozen=True, repr=False)
class ZeroOffload(_NVMe, Policy):
    """ZeRO-Offload: parameters and gradients on the device (every stage persistent); each
    stage's gradients go to the host after its backward; the host updates every group after the
    backward and the updated parameters are copied back into the resident slots. With
    ``nvme=True`` the optimizer states live on the SSD, ``host_window`` groups' at a time on the
    host (:class:`_NVMe`), the delayed update included.

    With ``delayed_update`` (ZeRO-Offload's DPU) the program ends with the gradient copies: the
    runtime starts the host update of step i in ``step()`` and lets it run during step i+1's
    forward and backward (which train on the weights before it), then refreshes the slots in the
    next ``step()``. Each gradient copy of step i+1 waits for the update of step i that reads
    the same host buffer. Not eager-equivalent by design (one step stale).

    >>> from shfx.passes.stages import chain
    >>> " ".join(ZeroOffload().program(chain(2)).actions())
    'F0 F1 B1 OG1 B0 OG0 U0 U1 PF0 PF1'
    >>> " ".join(ZeroOffload(delayed_update=True).program(chain(2)).actions())
    'F0 F1 B1 OG1 B0 OG0 PF0 PF1 U0 U1'
    >>> " ".join(ZeroOffload(nvme=True, host_window=1).program(chain(2)).actions())
    'F0 F1 B1 SR0 OG1 B0 OG0 U0 SW0 SR1 U1 SW1 PF0 PF1'
    """

    name: ClassVar[str] = "zero-offload"
    delayed_update: bool = False
    deferred_update: bool = False
    nvme: bool = False
    host_window: int | Literal["auto"] = "auto"
    nvme_masters: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.delayed_update, bool):
            raise TypeError(f"ZeroOffload(delayed_update=...) must be True or False, got {self.delayed_update!r}")
        _check_flag("ZeroOffload", "deferred_update", self.deferred_update)
        self._check_nvme("ZeroOffload")
        if self.delayed_update and self.deferred_update:
            raise ValueError(
                "ZeroOffload(delayed_update=True, deferred_update=True): the delayed update trains on one-step-stale "
                "weights, the deferred one (exact clipping) finishes each update before the next forward reads the "
                "weights; choose one"
            )

    def placement(self, stages: Sequence[StageSpec]) -> Placement:
        _concrete(self)
        n = len(stages)
        when: Updates = "next-step" if self.delayed_update else "next-forward" if self.deferred_update else "after-backward"
        ssd = self._ssd(stages, _update_groups(stages))
        return Placement(tuple(range(n)), (), 0, 0, frozenset(), when, refresh=not self.delayed_update, **ssd)

    def program_name(self, placement: Placement) -> str:
        if self.deferred_update:
            name = "zero-offload(deferred update)"
        else:
            name = "zero-offload(delayed update)" if self.delayed_update else "zero-offload"
        nv = self._nvme_name(placement)
        return name + f"({nv[2:]})" if nv else name


@dataclass(frozen=True, repr=False)
class ZeroInfinity(_NVMe, Policy):
    """ZeRO-Infinity: parameters, gradients and optimizer states on the host; each stage fetched
    on demand ``lookahead`` stages ahead of its use and released right after it; the host
    updates every group after the backward. With ``nvme=True`` (ZeRO-Infinity's NVMe tier) the
    optimizer states live on the SSD, ``host_window`` groups' at a time on the host
    (:class:`_NVMe`).

    >>> from shfx.passes.stages import chain
    >>> " ".join(ZeroInfinity().program(chain(3)).actions())
    'PF0 PF1 F0 R0 PF2 F1 R1 F2 R2 PF2 PF1 B2 OG2 R2 PF0 B1 OG1 R1 B0 OG0 R0 U0 U1 U2'
    >>> " ".join(ZeroInfinity(nvme=True, host_window=2).program(chain(3)).actions()[-10:])
    'B0 OG0 R0 U0 SW0 SR2 U1 SW1 U2 SW2'
    """

    name: ClassVar[str] = "zero-infinity"
    lookahead: int = 1
    deferred_update: bool = False
    nvme: bool = False
    host_window: int | Literal["auto"] = "auto"
    nvme_masters: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.lookahead, bool) or not isinstance(self.lookahead, int) or self.lookahead < 1:
            raise ValueError(f"ZeroInfinity(lookahead=...) must be an int >= 1, got {self.lookahead!r}")
        _check_flag("ZeroInfinity", "deferred_update", self.deferred_update)
        self._check_nvme("ZeroInfinity")

    def placement(self, stages: Sequence[StageSpec]) -> Placement:
        _concrete(self)
        n = len(stages)
        when: Updates = "next-forward" if self.deferred_update else "after-backward"
        ssd = self._ssd(stages, _update_groups(stages))
        return Placement((), tuple(range(n)), min(self.lookahead + 1, n), 0, frozenset(), when, **ssd)

    def program_name(self, placement: Placement) -> str:
        name = "zero-infinity" if self.lookahead == 1 else f"zero-infinity(lookahead={self.lookahead})"
        name = name + "(deferred update)" if self.deferred_update else name
        nv = self._nvme_name(placement)
        return name + f"({nv[2:]})" if nv else name


@dataclass(frozen=True, repr=False)
class FunctionPolicy(_NVMe, Policy):
    """A policy written as a function ``fn(stage_specs, window) -> Program`` (an action order
    lowered with :func:`shfx.passes.program.lower_actions`, say); ``shfx.compile(policy=fn)``
    wraps it in one. Its window may be ``"auto"`` like any other. With ``nvme=True`` (an NVMe
    ``Offload`` spec sets it) the optimizer states of the groups its program updates on the host
    (``U``) live on the SSD: :func:`add_ssd_tier` places their reads and write-backs.

    >>> from shfx.passes.stages import chain
    >>> FunctionPolicy(schedule_window, window=3).program(chain(3)).name
    'stronghold(W=3)'
    >>> FunctionPolicy(schedule_window, window=3, nvme=True, host_window=1).program(chain(3)).name
    'stronghold(W=3)(nvme H=1)'
    """

    name: ClassVar[str] = "custom"
    windowed: ClassVar[bool] = True
    fn: Callable[..., Program] = None  # type: ignore[assignment]
    window: int | Literal["auto"] = 2
    nvme: bool = False
    host_window: int | Literal["auto"] = "auto"
    nvme_masters: bool = False

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"FunctionPolicy needs a function (stage_specs, window) -> Program, got {self.fn!r}")
        _positive_or_auto("FunctionPolicy", "window", self.window, 1)
        self._check_nvme("FunctionPolicy")

    def program(self, stages: Sequence[StageSpec]) -> Program:
        _concrete(self)
        stages = checked_stages(stages)
        prog = self.fn(stages, check_window(self.window, len(stages)))
        if not isinstance(prog, Program):
            raise TypeError(f"policy {self.fn!r} returned {type(prog).__name__}, not a shfx.passes.Program")
        if self.nvme:
            prog = add_ssd_tier(prog, self.host_window, self.nvme_masters)
        return prog


def add_ssd_tier(program: Program, host_window: int, ssd_masters: bool = False) -> Program:
    """The NVMe tier as a pass over any program that updates on the host: every group with a
    host update (``U g``) keeps its optimizer states on the SSD, read into one of
    ``host_window`` host buffers before the update and written back after it
    (:func:`shfx.passes.lowering.add_ssd_transfers`), the program lowered again with them. A
    program without host updates, or with the tier already, is returned as it is.

    >>> from shfx.passes.stages import chain
    >>> " ".join(add_ssd_tier(schedule_zero_offload(chain(2)), 1).actions())
    'F0 F1 B1 SR0 OG1 B0 OG0 U0 SW0 SR1 U1 SW1 PF0 PF1'
    """
    if program.ssd_groups:
        return program
    acts = [get_meta(n).action for n in program.nodes]
    host = frozenset(a.stage for a in acts if a.kind == U)
    if not host:
        return program
    hw = check_host_window(host_window, len(host))
    tier = {**program.tier, "ssd_groups": host, "host_window": hw, "ssd_masters": ssd_masters}
    name = f"{program.name}(nvme H={hw}" + (" with masters" if ssd_masters else "") + ")"
    return lower_actions(add_ssd_transfers(acts, host, hw), program.stages, program.num_slots, name=name,
                         persistent=program.persistent, **tier)  # fmt: skip


def param_tier_groups(program: Program) -> frozenset[int]:
    """The groups of ``program``'s NVMe tier whose image can live on the SSD too: read by the
    prefetch of the stage owning them only (no other stage borrows them) and with no buffer a
    forward writes back (``OB``); the others stay in host RAM."""
    shared = {g for st in program.stages for g in st.grad_groups if g != st.update_group}
    return frozenset(
        st.update_group for st in program.stages
        if st.update_group in program.ssd_groups and st.update_group not in shared
        and not st.buffer_out_bytes and not st.recompute_buffer_bytes
    )  # fmt: skip


def least_image_window(program: Program) -> int:
    """The fewest image buffers the parameter tier needs over ``program`` (a program with the
    NVMe tier, before :func:`add_param_tier`): the most images its order holds at once when
    each is read right before its first use; 0 when no group's image can live on the SSD.

    >>> from shfx.passes.stages import chain
    >>> least_image_window(Stronghold(window=1, nvme=True, host_window=1).program(chain(3)))
    1
    """
    groups = param_tier_groups(program)
    if not groups:
        return 0
    return image_window_needed([get_meta(n).action for n in program.nodes], program.stages, groups)


def add_param_tier(program: Program, image_window: int | None = None, masters: bool = False) -> Program:
    """The parameter tier (``Offload(params="nvme")``) as a pass over a program with the NVMe
    tier: the groups of :func:`param_tier_groups` keep their image on the SSD, read into one of
    ``image_window`` host buffers before the prefetches and the update that need it and freed
    or written back after them (:func:`shfx.passes.lowering.add_param_transfers`); their
    gradient lands in the group's host-window buffer, and with ``masters`` (mixed precision)
    their fp32 master is read and written with the states. ``image_window`` None: the fewest
    buffers the order needs, plus one read ahead.

    >>> from shfx.passes.stages import chain
    >>> p = add_param_tier(Stronghold(window=1, nvme=True, host_window=1).program(chain(2)), 2)
    >>> " ".join(p.actions())
    'PR0 PR1 PF0 PD0 F0 R0 PF1 PD1 F1 B1 PR1 PR0 SR1 OG1 U1 PW1 SW1 SR0 R1 PF0 B0 OG0 U0 PW0 SW0 R0'
    """
    if not program.ssd_groups:
        raise ScheduleError(
            "the parameter tier keeps a group's image, master, gradient and states on the SSD: the program needs the NVMe "
            "tier for its states first (nvme=True / Offload(optimizer='nvme'))"
        )
    if program.ssd_images:
        return program
    groups = param_tier_groups(program)
    if not groups:
        return program
    acts = [get_meta(n).action for n in program.nodes]
    pos = {a: i for i, a in enumerate(acts)}
    late = sorted(g for g in groups if any(pos.get(Action(SR, g), -1) > pos.get(Action(OG, st.index), 1 << 30)
                                           for st in program.stages if g in st.grad_groups))
    if late:
        raise ScheduleError(
            f"the parameter tier lands a group's gradient in its host-window buffer, read (SR) before the gradient arrives "
            f"(OG), but {program.name!r} reads groups {late} after their gradients: its updates run after the backward, "
            "so every gradient would wait in host RAM. Use a policy updating during the backward (policy='stronghold')"
        )
    need = image_window_needed(acts, program.stages, groups)
    iw = need + 1 if image_window is None else image_window
    tier = {**program.tier, "ssd_images": groups, "image_window": iw, "ssd_masters": masters}
    return lower_actions(add_param_transfers(acts, program.stages, groups, iw), program.stages, program.num_slots,
                         name=f"{program.name}(params I={iw})", persistent=program.persistent, **tier)  # fmt: skip


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Resident, L2L, ZeroOffload, ZeroInfinity, Stronghold)}
"""The registry: policy name -> class, in the order tables list them. ``compile``, the CLI,
``plan``, ``compare``, the tuner and the paper examples take their names from here."""


def policy_names() -> tuple[str, ...]:
    """The registered policy names, in table order."""
    return tuple(POLICIES)


def get_policy(name: str) -> type[Policy]:
    """The policy class registered as ``name``."""
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown policy {name!r}; available: {', '.join(POLICIES)}, a shfx.passes.policies.Policy "
            "object, or a function (stage_specs, window) -> Program"
        ) from None


def make_policy(policy: str | Policy, **options: Any) -> Policy:
    """A policy object from a name and its options (``make_policy("stronghold", window=3)``), or
    a policy object with ``options`` replaced. An option the policy does not have is an error
    that lists the ones it has."""
    cls = type(policy) if isinstance(policy, Policy) else get_policy(policy)
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    bad = sorted(set(options) - fields)
    if bad:
        has = ", ".join(sorted(fields)) or "none"
        raise ValueError(f"policy {cls.name!r} has no option {', '.join(bad)} (its options: {has})")
    return policy.replace(**options) if isinstance(policy, Policy) else cls(**options)


def resolve_policy(policy: str | Policy | Callable[..., Program], window: int | str | None = None) -> Policy:
    """What ``shfx.compile(policy=..., window=...)`` runs: a name becomes its policy with the
    window (for a policy that has one); a policy object is taken as it is (a window given
    besides must agree with it); a function ``(stage_specs, window) -> Program`` becomes a
    :class:`FunctionPolicy` (its window defaults to 2)."""
    if callable(policy) and not isinstance(policy, (Policy, str)):
        return FunctionPolicy(policy, 2 if window is None else window)
    if not isinstance(policy, (str, Policy)):
        raise TypeError(
            f"policy must be a name ({', '.join(POLICIES)}), a shfx.passes.policies.Policy object, or a function "
            f"(stage_specs, window) -> Program; got {type(policy).__name__}"
        )
    cls = get_policy(policy) if isinstance(policy, str) else type(policy)
    if window is not None and not cls.windowed:
        raise ValueError(
            f"policy {cls.name!r} has no window (window={window!r} was given): "
            + ("every stage stays on the device" if cls in (Resident, ZeroOffload) else "its slots are fixed")
            + "; drop window=, or use policy='stronghold'"
        )
    if isinstance(policy, str):
        return cls(window=window) if window is not None else cls()  # type: ignore[call-arg]
    if window is not None and getattr(policy, "window", window) != window:
        raise ValueError(f"window={window!r} disagrees with {policy!r}; give the window in one place")
    return policy


def policy_program(
    policy: str | Policy, stages: Sequence[StageSpec], window: int | None = None, resident_first: int | None = None, **options: Any
) -> Program:
    """The program of a policy (a name or an object) for what-if tools that compare every policy
    at one window: ``window`` applies to the policies that have one (clamped to the stages that
    stream) and the others ignore it; ``resident_first`` is STRONGHOLD's refinement."""
    pol = make_policy(policy, **options)
    if window is not None and pol.windowed:
        pol = pol.replace(window=window)
    if resident_first:
        if "resident_first" not in pol.options():
            raise ValueError(f"resident_first is a refinement of the 'stronghold' policy; {pol.name!r} does not take it")
        pol = pol.replace(resident_first=resident_first)
    return pol.program(stages)


def policy_actions(policy: Policy, stages: Sequence[StageSpec]) -> list[Action]:
    """Given a policy and the stages, its action order: the compute order, then the passes of
    :mod:`shfx.passes.lowering` the policy's :class:`Placement` asks for."""
    stages = checked_stages(stages)
    pl = policy.placement(stages)
    if pl.updates == "next-forward":
        # exact clipping is a feature pass (shfx.passes.features.clip_program) over the program
        # that updates during the backward: GN where each U was, the gate CK0, the U's deferred
        if pl.device_groups:  # (raises for a streamed stage updated on the device: its gradient leaves with the slot)
            add_grad_norms(compute_order(stages), stages, pl.device_groups, pl.persistent)
        return [get_meta(n).action for n in _clipped(policy, stages, pl).nodes]
    return _placement_actions(policy, stages, pl)


def _placement_actions(policy: Policy, stages: list[StageSpec], pl: Placement) -> list[Action]:
    acts = compute_order(stages)
    acts = add_buffer_offloads(acts, stages)
    acts = add_grad_offloads(acts, stages, pl.device_groups)
    if pl.updates == "backward":
        acts = add_updates_in_backward(acts, stages, pl.device_groups)
        acts = add_param_copyback(acts, stages, pl.device_groups, pl.persistent, policy.name)
    acts = add_prefetch_release(acts, stages, streamed=pl.streamed, slots=pl.slots, keep=pl.keep)
    if pl.updates == "after-backward":
        acts = add_updates_after_backward(acts, stages, pl.device_groups)
    if pl.refresh:
        acts = add_refresh(acts, pl.persistent)
    return _with_ssd(acts, pl)


def _with_ssd(acts: list[Action], pl: Placement) -> list[Action]:
    return add_ssd_transfers(acts, pl.ssd_groups, pl.host_window) if pl.ssd_groups else acts


def _clipped(policy: Policy, stages: list[StageSpec], pl: Placement) -> Program:
    """The program of a placement whose updates run in the next forward: the same placement
    updating during the backward, lowered, then the exact-clipping pass."""
    base = dataclasses.replace(pl, updates="backward")
    acts = _placement_actions(policy, stages, base)
    prog = lower_actions(
        acts, stages, base.num_slots, name=policy.program_name(base), persistent=base.persistent,
        ssd_groups=base.ssd_groups, host_window=base.host_window, ssd_masters=base.ssd_masters,
    )  # fmt: skip
    return clip_program(prog, name=policy.program_name(pl))


def lower_policy(policy: Policy, stages: Sequence[StageSpec]) -> Program:
    """Given a policy and the stages, the step program: :func:`policy_actions`, then
    :func:`shfx.passes.program.lower_actions` (dependency edges and slots); a placement whose
    updates run in the next forward (exact clipping) is the exact-clipping feature pass over
    the placement updating during the backward (:func:`shfx.passes.features.clip_program`)."""
    stages = checked_stages(stages)
    pl = policy.placement(stages)
    if pl.updates == "next-forward":
        if pl.device_groups:  # (its refusal of streamed device stages)
            add_grad_norms(compute_order(stages), stages, pl.device_groups, pl.persistent)
        return _clipped(policy, stages, pl)
    if pl.updates == "next-step":  # the delayed update: the placement updating after the backward, then the pass
        base = dataclasses.replace(pl, updates="after-backward", refresh=True)
        acts = _placement_actions(policy, stages, base)
    else:
        acts = policy_actions(policy, stages)
    prog = lower_actions(
        acts, stages, pl.num_slots, name=policy.program_name(pl), persistent=pl.persistent,
        ssd_groups=pl.ssd_groups, host_window=pl.host_window, ssd_masters=pl.ssd_masters,
    )  # fmt: skip
    if pl.updates == "next-step":
        return delayed_update(prog)
    return prog


# ---- shorthands: the policies as functions (stage_specs, window) -> Program -------------------------


def schedule_window(stages: Sequence[StageSpec], window: int) -> Program:
    """The "stronghold" policy: a sliding window of ``window`` resident stages.

    >>> from shfx.passes.stages import chain
    >>> " ".join(schedule_window(chain(3), 2).actions())
    'PF0 PF1 F0 R0 PF2 F1 F2 B2 OG2 U2 R2 PF0 B1 OG1 U1 R1 B0 OG0 U0 R0'
    """
    return Stronghold(window=window).program(stages)


def window_actions(stages: Sequence[StageSpec], window: int) -> list[Action]:
    """The stronghold window order (before lowering): at most ``window`` stages resident."""
    return policy_actions(Stronghold(window=window), stages)


def schedule_stronghold(stages: Sequence[StageSpec], window: int, resident_first: int = 0) -> Program:
    """:class:`Stronghold` with ``window`` and ``resident_first``."""
    return Stronghold(window=window, resident_first=resident_first).program(stages)


def schedule_resident(stages: Sequence[StageSpec], window: int | None = None) -> Program:
    """:class:`Resident` (``window`` is ignored)."""
    return Resident().program(stages)


def schedule_l2l(stages: Sequence[StageSpec], window: int | None = None) -> Program:
    """:class:`L2L` (``window`` is ignored)."""
    return L2L().program(stages)


def schedule_zero_offload(stages: Sequence[StageSpec], window: int | None = None, *, delayed_update: bool = False) -> Program:
    """:class:`ZeroOffload` (``window`` is ignored)."""
    return ZeroOffload(delayed_update=delayed_update).program(stages)


def schedule_zero_infinity(stages: Sequence[StageSpec], window: int | None = None) -> Program:
    """:class:`ZeroInfinity` (``window`` is ignored)."""
    return ZeroInfinity().program(stages)
