"""Schedule policies: the systems STRONGHOLD was compared with, as rewrite passes over the same IR.

Each policy turns stage specs into a step program; they run on the same runtime and the same
simulator and train exactly like eager PyTorch (they differ in memory and time only):

| policy | on the device | optimizer | program |
| --- | --- | --- | --- |
| ``resident`` (Megatron-like) | every stage, persistent | on the device (``DU``) | F..., B DU... |
| ``l2l`` | one stage at a time | states on the device; params back to the host (``OP``) | PF F R ..., B DU OP R PF ... |
| ``zero-offload`` | every stage, persistent (params and grads) | on the host after the backward; params refreshed | F..., B OG..., U..., PF (refresh)... |
| ``zero-infinity`` | fetched on demand, one-stage lookahead | on the host after the backward | PF PF F R PF ..., PF PF B OG R PF ..., U... |
| ``stronghold`` | a window of W stages; the first k persistent | host (window stages, during the backward), device (first k) | the window schedule |

Add a policy by writing a function ``(stage_specs, window) -> Program`` that emits an action
order and lowers it with :func:`shfx.passes.program.lower_actions`; register it in :data:`POLICIES`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .program import B, DU, F, OB, OG, OP, PF, R, U, Action, Program, ScheduleError, lower_actions
from .schedule import _checked, _update_order, check_window, schedule_window
from .stages import StageSpec

__all__ = [
    "schedule_resident",
    "schedule_l2l",
    "schedule_zero_offload",
    "schedule_zero_infinity",
    "schedule_stronghold",
    "stronghold_actions",
    "POLICIES",
    "get_policy",
]


def _sends_to_host(st: StageSpec, device: set[int]) -> bool:
    return st.has_grads and bool(set(st.grad_groups) - device)


def _device_updates_after(stages: Sequence[StageSpec], order: Sequence[int], device: set[int]) -> dict[int, list[int]]:
    """Stage -> the device-updated groups whose last contributor (in ``order``) it is."""
    return {s: [g for g in gs if g in device] for s, gs in _update_order(stages, order).items()}


def _host_updates_after(stages: Sequence[StageSpec], order: Sequence[int], device: set[int]) -> dict[int, list[int]]:
    return {s: [g for g in gs if g not in device] for s, gs in _update_order(stages, order).items()}


def schedule_resident(stages: Sequence[StageSpec], window: int | None = None) -> Program:
    """Everything on the device, the optimizer too (Megatron-like): every stage persistent, each
    group updated on the device right after the last backward that sends it gradients.

    >>> from shfx.passes.stages import chain
    >>> " ".join(schedule_resident(chain(3)).actions())
    'F0 F1 F2 B2 DU2 B1 DU1 B0 DU0'
    """
    stages = _checked(stages)
    n = len(stages)
    device = {s.update_group for s in stages if s.update_group is not None}
    acts: list[Action] = []
    for i in range(n):
        acts.append(Action(F, i))
        if stages[i].mutates_buffers:
            acts.append(Action(OB, i))
    order = list(range(n - 1, -1, -1))
    ups = _device_updates_after(stages, order, device)
    for i in order:
        acts.append(Action(B, i))
        acts.extend(Action(DU, g) for g in ups.get(i, []))
    return lower_actions(acts, stages, n, name="resident", persistent=list(range(n)))


def schedule_l2l(stages: Sequence[StageSpec], window: int | None = None) -> Program:
    """L2L: one stage on the device at a time; the optimizer states of every group live on the
    device, a stage is updated there right after its backward and its parameters are copied
    back to the host (``OP``) before it leaves.

    >>> from shfx.passes.stages import chain
    >>> " ".join(schedule_l2l(chain(2)).actions())
    'PF0 F0 R0 PF1 F1 B1 DU1 OP1 R1 PF0 B0 DU0 OP0 R0'
    """
    stages = _checked(stages)
    n = len(stages)
    device = {s.update_group for s in stages if s.update_group is not None}
    acts: list[Action] = []
    for i in range(n):
        acts += [Action(PF, i), Action(F, i)]
        if stages[i].mutates_buffers:
            acts.append(Action(OB, i))
        if i < n - 1:
            acts.append(Action(R, i))
    order = list(range(n - 1, -1, -1))
    ups = _device_updates_after(stages, order, device)
    for i in order:
        if i < n - 1:
            acts.append(Action(PF, i))
        acts.append(Action(B, i))
        for g in ups.get(i, []):
            acts.append(Action(DU, g))
        if stages[i].update_group is not None:
            if stages[i].update_group in ups.get(i, []):
                acts.append(Action(OP, i))
            else:
                raise ScheduleError(
                    f"l2l: stage {i}'s group {stages[i].update_group} also gets gradients from an earlier stage, so it "
                    "cannot be updated while the stage is resident; l2l needs each group's owner to be its last contributor"
                )
        acts.append(Action(R, i))
    return lower_actions(acts, stages, 1, name="l2l")


def schedule_zero_offload(stages: Sequence[StageSpec], window: int | None = None, *, delayed_update: bool = False) -> Program:
    """ZeRO-Offload: parameters and gradients on the device (every stage persistent); each
    stage's gradients go to the host after its backward; the host updates every group after the
    backward and the updated parameters are copied back into the resident slots.

    With ``delayed_update`` (ZeRO-Offload's DPU) the program ends with the gradient copies: the
    runtime starts the host update of step i in ``step()`` and lets it run during step i+1's
    forward and backward (which train on the weights before it), then refreshes the slots in the
    next ``step()``. Each gradient copy of step i+1 waits for the update of step i that reads
    the same host buffer.

    >>> from shfx.passes.stages import chain
    >>> " ".join(schedule_zero_offload(chain(2)).actions())
    'F0 F1 B1 OG1 B0 OG0 U0 U1 PF0 PF1'
    >>> " ".join(schedule_zero_offload(chain(2), delayed_update=True).actions())
    'F0 F1 B1 OG1 B0 OG0'
    """
    stages = _checked(stages)
    n = len(stages)
    acts: list[Action] = []
    for i in range(n):
        acts.append(Action(F, i))
        if stages[i].mutates_buffers:
            acts.append(Action(OB, i))
    for i in range(n - 1, -1, -1):
        acts.append(Action(B, i))
        if stages[i].has_grads:
            acts.append(Action(OG, i))
    if delayed_update:
        p = lower_actions(acts, stages, n, name="zero-offload(delayed update)", persistent=list(range(n)))
        p.updates_outside = True
        return p
    groups = sorted({s.update_group for s in stages if s.update_group is not None})
    acts += [Action(U, g) for g in groups]
    acts += [Action(PF, i) for i in range(n)]  # refresh every resident stage with the new weights
    return lower_actions(acts, stages, n, name="zero-offload", persistent=list(range(n)))


def schedule_zero_infinity(stages: Sequence[StageSpec], window: int | None = None) -> Program:
    """ZeRO-Infinity: parameters, gradients and optimizer states on the host; each stage fetched
    on demand just before use with one stage of lookahead (two slots), released right after; the
    host updates every group after the backward.

    >>> from shfx.passes.stages import chain
    >>> " ".join(schedule_zero_infinity(chain(3)).actions())
    'PF0 PF1 F0 R0 PF2 F1 R1 F2 R2 PF2 PF1 B2 OG2 R2 PF0 B1 OG1 R1 B0 OG0 R0 U0 U1 U2'
    """
    stages = _checked(stages)
    n = len(stages)
    acts: list[Action] = [Action(PF, i) for i in range(min(2, n))]
    for i in range(n):
        acts.append(Action(F, i))
        if stages[i].mutates_buffers:
            acts.append(Action(OB, i))
        acts.append(Action(R, i))
        if i + 2 < n:
            acts.append(Action(PF, i + 2))
    order = list(range(n - 1, -1, -1))
    acts += [Action(PF, i) for i in order[:2]]
    for k, i in enumerate(order):
        acts.append(Action(B, i))
        if stages[i].has_grads:
            acts.append(Action(OG, i))
        acts.append(Action(R, i))
        if k + 2 < n:
            acts.append(Action(PF, order[k + 2]))
    groups = sorted({s.update_group for s in stages if s.update_group is not None})
    acts += [Action(U, g) for g in groups]
    return lower_actions(acts, stages, min(2, n), name="zero-infinity", keep_graph=False)


def stronghold_actions(stages: Sequence[StageSpec], window: int, resident_first: int = 0) -> list[Action]:
    """The stronghold order: the first ``resident_first`` stages persistent with their optimizer
    on the device; the rest streamed through a window of ``window`` slots, updated on the host
    as soon as their gradients land."""
    n = len(stages)
    k = max(0, min(resident_first, n))
    rest = n - k
    w = check_window(window, max(rest, 1)) if rest else 0
    device = {stages[i].update_group for i in range(k) if stages[i].update_group is not None}
    acts: list[Action] = [Action(PF, k + i) for i in range(w)]
    for i in range(n):
        acts.append(Action(F, i))
        if stages[i].mutates_buffers:
            acts.append(Action(OB, i))
        if i >= k and i < n - w:
            acts.append(Action(R, i))
            acts.append(Action(PF, i + w))
    order = list(range(n - 1, -1, -1))
    host_ups = _host_updates_after(stages, order, device)
    dev_ups = _device_updates_after(stages, order, device)
    for i in order:
        acts.append(Action(B, i))
        if _sends_to_host(stages[i], device):
            acts.append(Action(OG, i))
        acts.extend(Action(U, g) for g in host_ups.get(i, []))
        acts.extend(Action(DU, g) for g in dev_ups.get(i, []))
        if i >= k:
            acts.append(Action(R, i))
            if i - w >= k:
                acts.append(Action(PF, i - w))
    return acts


def schedule_stronghold(stages: Sequence[StageSpec], window: int, resident_first: int = 0) -> Program:
    """The stronghold policy: the window schedule, plus its refinement, the first
    ``resident_first`` stages kept resident with their optimizer on the device so the next
    forward starts without waiting for the host updates of the first stages.

    >>> from shfx.passes.stages import chain
    >>> " ".join(schedule_stronghold(chain(4), 2, resident_first=1).actions())
    'PF1 PF2 F0 F1 R1 PF3 F2 F3 B3 OG3 U3 R3 PF1 B2 OG2 U2 R2 B1 OG1 U1 R1 B0 DU0'
    """
    stages = _checked(stages)
    if resident_first == 0:
        return schedule_window(stages, window)
    n = len(stages)
    k = max(0, min(resident_first, n))
    rest = n - k
    w = check_window(window, rest) if rest else 0
    acts = stronghold_actions(stages, window, k)
    return lower_actions(acts, stages, k + w, name=f"stronghold(W={w}, k={k})", persistent=list(range(k)))


POLICIES: dict[str, Callable[..., Program]] = {
    "stronghold": schedule_window,
    "resident": schedule_resident,
    "l2l": schedule_l2l,
    "zero-offload": schedule_zero_offload,
    "zero-infinity": schedule_zero_infinity,
}


def get_policy(name: str) -> Callable[..., Program]:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; available: {', '.join(sorted(POLICIES))}, or a function (stage_specs, window) -> Program"
        ) from None
