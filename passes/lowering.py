"""Lowering passes: small list-to-list functions that turn a compute order into a policy's
action order, one kind of action each (in the style of ``torch.distributed.pipelining``).

A policy (:mod:`shfx.passes.policies`) is lowered by running, in this order:

1. :func:`compute_order` - ``F0 .. F(n-1)``, then ``B(n-1) .. B0`` (only the stages whose
   backward has work: :func:`shfx.passes.stages.backward_stages`; a frozen bottom gets none);
2. :func:`add_buffer_offloads` - ``OB s`` after the forward of a stage that mutates buffers;
3. :func:`add_grad_offloads` - ``OG s`` after the backward of a stage sending gradients to a
   group updated on the host;
4. :func:`add_updates_in_backward` - ``U g`` / ``DU g`` as soon as group ``g``'s last
   gradient contribution is in (policies updating during the backward);
5. :func:`add_param_copyback` - ``OP s`` after the device update of a streamed stage's group;
6. :func:`add_prefetch_release` - ``PF`` / ``R`` of the streamed stages through a window of slots;
7. :func:`add_updates_after_backward` - every host update at the end (policies updating after
   the backward);
8. :func:`add_refresh` - ``PF`` of every persistent stage after the host updates (their slots
   are refreshed with the new weights).

With exact gradient clipping (``updates="next-forward"``) steps 4, 7 and 8 are replaced by:

4'. :func:`add_grad_norms` - ``GN g`` where ``U g`` would go: the norms of group ``g``'s
    gradients, as soon as they are on the host;
7'. :func:`add_deferred_updates` - the step's gate ``CK0`` (phase ``"step"``: the total norm,
    the clip coefficient, the finite check), then every ``U g`` (``DU g`` for a group updated on
    the device) at the end, in forward order
    (phase ``"next-forward"``: they run during the next step's forward);
8'. :func:`add_leading_refresh` - ``PF`` of every persistent stage reading a host-updated
    group before the first action (the next forward refreshes it after its update).

With the NVMe tier (``Placement.ssd_groups``), last:

9. :func:`add_ssd_transfers` - ``SR g`` ahead of each ``U g`` of a group whose optimizer
   state lives on the SSD, as early as the host window allows, and ``SW g`` right after it.

With data parallel (:func:`shfx.passes.schedule.data_parallel_program`, any policy's program):

10. :func:`add_collectives` - ``RS g`` right after the ``OG`` of group ``g``'s last gradient
    contributor (the reduction of the rank's local gradient starts as soon as it is complete,
    while the backward of earlier stages runs), ``AG g`` right after each ``U g``; for a group
    updated on the device, ``RS g`` (an all-reduce of its device gradient) right after its last
    contributor's ``B``, before its ``GN g`` and ``DU g``.

Each pass inserts its actions at the end of the *trailer* of the compute action they belong
to: the actions between that ``F``/``B`` and the next compute action. Then
:func:`shfx.passes.program.lower_actions` adds the dependency edges and slots.

>>> from shfx.passes.stages import chain
>>> acts = compute_order(chain(3))
>>> acts = add_grad_offloads(acts, chain(3), frozenset())
>>> " ".join(map(str, add_prefetch_release(acts, chain(3), streamed=(0, 1, 2), slots=2, keep=2)))
'PF0 PF1 F0 R0 PF2 F1 F2 B2 OG2 R2 PF0 B1 OG1 R1 B0 OG0 R0'
"""

from __future__ import annotations

from collections.abc import Sequence

from .actions import AG, B, CK, DU, F, GN, NR, OB, OG, OP, PD, PF, PR, PW, RS, R, SR, SW, U, Action, ActionKind
from .program import ScheduleError
from .stages import StageSpec, backward_stages

__all__ = [
    "add_param_transfers",
    "image_window_needed",
    "check_window",
    "checked_stages",
    "compute_order",
    "add_buffer_offloads",
    "add_grad_offloads",
    "add_updates_in_backward",
    "add_param_copyback",
    "add_prefetch_release",
    "add_updates_after_backward",
    "add_refresh",
    "add_grad_norms",
    "add_deferred_updates",
    "add_leading_refresh",
    "add_ssd_transfers",
    "check_host_window",
    "last_contributors",
    "add_collectives",
]

_COMPUTE = (F, B)


def check_window(window: object, num_stages: int) -> int:
    """Validate a window and clamp it to the number of stages (W > stages means all resident)."""
    if isinstance(window, bool) or not isinstance(window, int):
        raise ValueError(
            f"window must be an int >= 1 (the number of stages resident on the device at once), got {window!r}"
        )
    if window < 1:
        raise ValueError(f"window must be >= 1 (stages resident on the device at once), got {window}")
    return min(window, num_stages)


def checked_stages(stages: Sequence[StageSpec]) -> list[StageSpec]:
    """The stage specs as a list, checked to be indexed ``0..n-1`` in order."""
    stages = list(stages)
    if not stages:
        raise ScheduleError("a program needs at least one stage")
    for i, s in enumerate(stages):
        if s.index != i:
            raise ScheduleError(f"stage specs must be indexed 0..n-1 in order; position {i} holds stage {s.index}")
    return stages


def last_contributors(stages: Sequence[StageSpec], backward_order: Sequence[int]) -> dict[int, list[int]]:
    """Stage index -> the trainable groups whose last gradient contribution (in
    ``backward_order``) comes from that stage's backward."""
    last: dict[int, int] = {}
    for s in backward_order:
        for g in stages[s].grad_groups:
            last[g] = s  # later in backward order overwrites: the last one wins
    owned = {st.update_group for st in stages if st.update_group is not None}
    out: dict[int, list[int]] = {}
    for g, s in last.items():
        if g in owned:
            out.setdefault(s, []).append(g)
    return {s: sorted(gs) for s, gs in out.items()}


def _trailer_end(acts: Sequence[Action], i: int) -> int:
    """The position after the trailer of the compute action at ``i``: the next compute action
    (or the end)."""
    j = i + 1
    while j < len(acts) and acts[j].kind not in _COMPUTE:
        j += 1
    return j


def _insert_after(acts: Sequence[Action], kind: ActionKind, extra: dict[int, list[Action]]) -> list[Action]:
    """Insert ``extra[s]`` at the end of the trailer of ``kind`` on stage ``s``."""
    out: list[Action] = []
    pending: list[Action] = []
    for a in acts:
        if a.kind in _COMPUTE:
            out += pending
            pending = []
        out.append(a)
        if a.kind == kind:
            pending = list(extra.get(a.stage, []))
    return out + pending


def compute_order(stages: Sequence[StageSpec]) -> list[Action]:
    """Given the stages, the compute order of one training step: every forward in stage order,
    then, in reverse, the backward of every stage that has one to run
    (:func:`~shfx.passes.stages.backward_stages`: a stage without trainable parameters below
    which nothing needs a gradient gets no ``B``, hence no prefetch and no slot for one).

    >>> from shfx.passes.stages import StageSpec, chain
    >>> frozen_bottom = [StageSpec(0), StageSpec(1, producers=frozenset({0}))] + chain(3)[2:]
    >>> " ".join(map(str, compute_order(frozen_bottom)))
    'F0 F1 F2 B2'
    """
    stages = checked_stages(stages)
    back = backward_stages(stages)
    n = len(stages)
    return [Action(F, i) for i in range(n)] + [Action(B, i) for i in range(n - 1, -1, -1) if i in back]


def add_buffer_offloads(acts: Sequence[Action], stages: Sequence[StageSpec]) -> list[Action]:
    """Given an action order, add ``OB s`` right after ``F s`` of each stage whose forward
    mutates buffers (BatchNorm statistics go back to the host once per forward)."""
    return _insert_after(acts, F, {s.index: [Action(OB, s.index)] for s in stages if s.mutates_buffers})


def add_grad_offloads(acts: Sequence[Action], stages: Sequence[StageSpec], device_groups: frozenset[int]) -> list[Action]:
    """Given an action order and the groups updated on the device, add ``OG s`` after ``B s``
    of each stage that sends gradients to a group updated on the host."""
    sends = {s.index: [Action(OG, s.index)] for s in stages if s.has_grads and set(s.grad_groups) - device_groups}
    return _insert_after(acts, B, sends)


def add_updates_in_backward(acts: Sequence[Action], stages: Sequence[StageSpec], device_groups: frozenset[int]) -> list[Action]:
    """Given an action order, add each group's update where its gradients are complete: after
    the trailer of its last contributor's ``B`` (its ``OG`` included), ``U g`` for groups
    updated on the host, then ``DU g`` for groups updated on the device."""
    order = [a.stage for a in acts if a.kind == B]
    ups = {
        s: [Action(U, g) for g in gs if g not in device_groups] + [Action(DU, g) for g in gs if g in device_groups]
        for s, gs in last_contributors(stages, order).items()
    }
    return _insert_after(acts, B, ups)


def add_param_copyback(
    acts: Sequence[Action], stages: Sequence[StageSpec], device_groups: frozenset[int], persistent: Sequence[int], policy: str = "policy"
) -> list[Action]:
    """Given an action order with device updates, add ``OP s`` after ``DU g`` when stage ``s``
    owns ``g`` and is streamed (not persistent): its updated parameters go back to the host
    before its slot is released. The update must then run while ``s`` is resident, so ``s``
    must be its group's last gradient contributor."""
    order = [a.stage for a in acts if a.kind == B]
    last = {g: s for s, gs in last_contributors(stages, order).items() for g in gs}
    owner = {st.update_group: st.index for st in stages if st.update_group is not None}
    copy: dict[int, list[Action]] = {}
    for g in sorted(device_groups):
        s = owner.get(g)
        if s is None or s in persistent:
            continue
        if last.get(g) != s:
            raise ScheduleError(
                f"{policy}: stage {s}'s group {g} also gets gradients from an earlier stage, so it cannot be updated "
                f"while the stage is resident; {policy} needs each group's owner to be its last contributor"
            )
        copy[g] = [Action(OP, s)]
    return _insert_after(acts, DU, copy)


def add_prefetch_release(
    acts: Sequence[Action], stages: Sequence[StageSpec], *, streamed: Sequence[int], slots: int, keep: int
) -> list[Action]:
    """Given an action order and the stages that stream through ``slots`` slots, add their
    ``PF`` and ``R``.

    Each compute action on a streamed stage is one *residency*, except that the forward and the
    backward of the last ``keep`` streamed stages of the forward form one: they stay resident for
    the start of the backward, as STRONGHOLD keeps its window (``keep=0``: every stage is
    fetched again for its backward, as ZeRO-Infinity does). Residencies are prefetched in the
    order of their first use, each as soon as a slot is free and its stage is not resident any
    more, the first ones at the very start; a residency is released at the end of the trailer
    of its last use."""
    stream = set(streamed)
    if not stream:
        return list(acts)
    if slots < 1:
        raise ScheduleError(f"{len(stream)} streamed stages need at least one slot, got {slots}")
    uses = [(i, a.stage) for i, a in enumerate(acts) if a.kind in _COMPUTE and a.stage in stream]
    fwd = [s for i, s in uses if acts[i].kind == F]
    kept = set(fwd[len(fwd) - keep :]) if keep > 0 else set()
    res: list[tuple[int, int]] = []  # (stage, position of its last use), in order of first use
    merged_into: dict[int, int] = {}  # kept stage -> its residency
    for i, s in uses:
        if acts[i].kind == B and s in merged_into:
            r = merged_into.pop(s)
            res[r] = (s, i)
            continue
        if acts[i].kind == F and s in kept:
            merged_into[s] = len(res)
        res.append((s, i))
    ends: dict[int, list[int]] = {}  # position of a last use -> residencies ending there
    for r, (_, last) in enumerate(res):
        ends.setdefault(last, []).append(r)
    queue = list(range(len(res)))
    resident: set[int] = set()
    free = slots

    def release(done: list[int]) -> list[Action]:
        nonlocal free
        out = []
        for r in done:
            resident.discard(res[r][0])
            free += 1
            out.append(Action(R, res[r][0]))
        while queue and free and res[queue[0]][0] not in resident:
            s = res[queue.pop(0)][0]
            resident.add(s)
            free -= 1
            out.append(Action(PF, s))
        return out

    out = release([])
    done: list[int] = []
    for i, a in enumerate(acts):
        if a.kind in _COMPUTE and done:
            out += release(done)
            done = []
        out.append(a)
        done += ends.get(i, [])
    return out + release(done)


def add_updates_after_backward(acts: Sequence[Action], stages: Sequence[StageSpec], device_groups: frozenset[int]) -> list[Action]:
    """Given an action order, append ``U g`` for every trainable group updated on the host, in
    group order (policies whose host updates run after the whole backward)."""
    groups = sorted({s.update_group for s in stages if s.update_group is not None} - set(device_groups))
    return list(acts) + [Action(U, g) for g in groups]


def add_refresh(acts: Sequence[Action], persistent: Sequence[int]) -> list[Action]:
    """Given an action order ending with host updates, append ``PF s`` for every persistent
    stage: its slot is refreshed with the weights the host optimizer wrote."""
    return list(acts) + [Action(PF, s) for s in persistent]


def add_grad_norms(
    acts: Sequence[Action], stages: Sequence[StageSpec], device_groups: frozenset[int], persistent: Sequence[int] = ()
) -> list[Action]:
    """Given an action order, add ``GN g`` for each group where its gradients are complete:
    after the trailer of its last contributor's ``B`` (its ``OG`` included), where
    :func:`add_updates_in_backward` would put ``U g`` or ``DU g``. A group updated on the device
    is normed there (its gradient stays in its owner's slot until the update after the gate), so
    its owner must be ``persistent``: a streamed owner's gradient leaves with its slot (L2L), and
    is refused."""
    order = [a.stage for a in acts if a.kind == B]
    owner = {s.update_group: s.index for s in stages if s.update_group is not None}
    streamed = sorted(g for g in device_groups if g in owner and owner[g] not in persistent)
    if streamed:
        raise ScheduleError(
            f"exact gradient clipping defers each update behind the total norm, but groups {streamed} are updated on the "
            "device by streamed stages (L2L), whose gradients leave the device with the slot before the norm is known; "
            "use policy='resident', Stronghold(resident_first=...) or a policy updating on the host"
        )
    return _insert_after(acts, B, {s: [Action(GN, g) for g in gs] for s, gs in last_contributors(stages, order).items()})


def add_deferred_updates(acts: Sequence[Action], stages: Sequence[StageSpec], device_groups: frozenset[int] = frozenset()) -> list[Action]:
    """Given an action order with ``GN`` actions, append the step's gate ``CK0`` (phase
    ``"step"``: the total norm from every ``GN``, the clip coefficient, the finite check) and
    then the update of every group in forward order (the order of the stages owning them):
    ``U g`` on the host, ``DU g`` for a group in ``device_groups`` (its gradient waited in its
    persistent owner's slot): ``step()`` runs the gate, then starts the updates and returns; the
    next forward prefetches stage ``s`` after the updates of the groups it reads
    (:func:`shfx.passes.schedule.steady_state_program`).

    >>> from shfx.passes.stages import chain
    >>> acts = [Action.from_str(a) for a in "F0 F1 B1 OG1 GN1 B0 OG0 GN0".split()]
    >>> " ".join(map(str, add_deferred_updates(acts, chain(2))))
    'F0 F1 B1 OG1 GN1 B0 OG0 GN0 CK0 U0 U1'
    """
    owners = sorted((s.index, s.update_group) for s in stages if s.update_group is not None)
    return list(acts) + [Action(CK, 0)] + [Action(DU if g in device_groups else U, g) for _, g in owners]


def add_leading_refresh(acts: Sequence[Action], stages: Sequence[StageSpec], persistent: Sequence[int], device_groups: frozenset[int]) -> list[Action]:
    """Given an action order whose host updates run in the next forward, prepend ``PF s`` for
    every persistent stage that reads a host-updated group: its slot is refreshed with the
    weights of the previous step's update before its first use in this step."""
    reads = [
        s for s in persistent
        if (set(stages[s].grad_groups) | ({stages[s].update_group} - {None})) - set(device_groups)
    ]  # fmt: skip
    return [Action(PF, s) for s in reads] + list(acts)


def check_host_window(host_window: object, num_groups: int) -> int:
    """Validate a host window (groups whose optimizer states are on the host at once) and clamp
    it to the number of groups on the SSD (more buffers than groups would never be used)."""
    if isinstance(host_window, bool) or not isinstance(host_window, int) or host_window < 1:
        raise ValueError(
            f"host_window must be an int >= 1 (groups whose optimizer states are on the host at once) or 'auto', "
            f"got {host_window!r}"
        )
    return max(1, min(host_window, num_groups))


def add_ssd_transfers(
    acts: Sequence[Action], ssd_groups: frozenset[int] | set[int], host_window: int, at_updates: bool = False
) -> list[Action]:
    """Given an action order with its host updates and the groups whose optimizer states live on
    the SSD, add ``SR g`` (read the state into a host-window buffer) ahead of each ``U g`` and
    ``SW g`` (write it back) right after it, with at most ``host_window`` states on the host.

    Reads go as early as the window allows: numbering the SSD groups' updates in issue order,
    the read for the i-th comes right after the write-back of the (i - host_window)-th (the
    group leaving the window frees the buffer it enters); the first ``host_window`` reads come
    where the step's updates become certain: right after the first ``B`` (the runtime issues
    SSD transfers, like updates, only in the backward that completes a step, so under gradient
    accumulation the other backwards read nothing), or, when the updates are deferred to the
    next forward (``GN`` actions: exact clipping), right before the first deferred ``U`` (the
    previous step's deferred updates still hold the buffers during this step), or, with
    ``at_updates``, right before the first ``U`` too (the updates run in ``step()``: the reads
    are issued with them).

    >>> from shfx.passes.stages import chain
    >>> acts = [Action.from_str(a) for a in "F0 F1 B1 OG1 U1 B0 OG0 U0".split()]
    >>> " ".join(map(str, add_ssd_transfers(acts, {0, 1}, 1)))
    'F0 F1 B1 SR1 OG1 U1 SW1 SR0 B0 OG0 U0 SW0'
    >>> " ".join(map(str, add_ssd_transfers(acts, {0, 1}, 2)))
    'F0 F1 B1 SR1 SR0 OG1 U1 SW1 B0 OG0 U0 SW0'
    """
    if not ssd_groups:
        return list(acts)
    if isinstance(host_window, bool) or not isinstance(host_window, int) or host_window < 1:
        raise ScheduleError(f"the SSD tier needs a host window >= 1, got {host_window!r}")
    order = [a.stage for a in acts if a.kind == U and a.stage in ssd_groups]
    if len(set(order)) != len(order):
        raise ScheduleError(f"each SSD group is updated once per step; the updates are {' '.join(f'U{g}' for g in order)}")
    missing = sorted(set(ssd_groups) - set(order))
    if missing:
        raise ScheduleError(f"groups {missing} are placed on the SSD but the program has no host update (U) for them")
    then_read = {order[i - host_window]: order[i] for i in range(host_window, len(order))}
    first = [Action(SR, g) for g in order[:host_window]]
    deferred = at_updates or any(a.kind == GN for a in acts)
    first_u = next(i for i, a in enumerate(acts) if a.kind == U)
    first_b = next((i for i, a in enumerate(acts) if a.kind == B), None)
    start, before = (first_u, True) if deferred or first_b is None or first_b > first_u else (first_b, False)
    out: list[Action] = []
    for i, a in enumerate(acts):
        if i == start and before:
            out += first
        out.append(a)
        if i == start and not before:
            out += first
        if a.kind == U and a.stage in ssd_groups:
            out.append(Action(SW, a.stage))
            if a.stage in then_read:
                out.append(Action(SR, then_read[a.stage]))
    return out


def _image_holds(acts: Sequence[Action], stages: Sequence[StageSpec], ssd_images: frozenset[int]) -> list[tuple[int, int, int, ActionKind]]:
    """The spans an SSD-held group's image must be on the host: ``(group, first use, last use,
    release kind)`` in order of their first use. A use is a ``PF`` of the stage owning the group
    or a ``U`` of the group. A span ends after a ``U`` (the image was written: ``PW``) or after
    a ``PF`` whose group's next use is not its update, or that is in the forward (``PD``): no
    span crosses into the backward, so the forward alone (inference) and a backward alone (the
    cold backward) each leave every buffer free."""
    first_b = next((i for i, a in enumerate(acts) if a.kind == B), len(acts))
    owner = {st.index: st.update_group for st in stages if st.update_group in ssd_images}
    uses: list[tuple[int, int, ActionKind]] = []  # (position, group, kind)
    for i, a in enumerate(acts):
        if a.kind == PF and a.stage in owner:
            uses.append((i, owner[a.stage], PF))
        elif a.kind == U and a.stage in ssd_images:
            uses.append((i, a.stage, U))
    holds: list[tuple[int, int, int, ActionKind]] = []
    start: dict[int, int] = {}
    for j, (i, g, kind) in enumerate(uses):
        start.setdefault(g, i)
        nxt = next((k for _, h, k in uses[j + 1 :] if h == g), None)
        if kind == U or nxt != U or i < first_b:
            holds.append((g, start.pop(g), i, PW if kind == U else PD))
    return sorted(holds, key=lambda h: h[1])


def image_window_needed(acts: Sequence[Action], stages: Sequence[StageSpec], ssd_images: frozenset[int] | set[int]) -> int:
    """The fewest image buffers :func:`add_param_transfers` needs for ``acts``: the most
    images on the host at once when each is read right before its first use.

    >>> from shfx.passes.stages import chain
    >>> acts = [Action.from_str(a) for a in "PF0 PF1 F0 R0 F1 B1 OG1 U1 R1 PF0 B0 OG0 U0 R0".split()]
    >>> image_window_needed(acts, chain(2), {0, 1})  # (PD0 frees the buffer PR1 takes)
    1
    """
    peak = 0
    ends: list[int] = []
    for g, first, last_use, _ in _image_holds(acts, stages, frozenset(ssd_images)):
        ends = [e for e in ends if e >= first]
        ends.append(last_use)
        peak = max(peak, len(ends))
    return peak


def add_param_transfers(
    acts: Sequence[Action], stages: Sequence[StageSpec], ssd_images: frozenset[int] | set[int], image_window: int
) -> list[Action]:
    """Given an action order with its prefetches and host updates (and the NVMe tier's ``SR``/
    ``SW``), add the parameter tier's transfers for the groups whose image lives on the SSD:
    ``PR g`` (read the image into one of ``image_window`` host buffers) ahead of the prefetch
    or update that first needs it, ``PD g`` right after a prefetch whose group's next use is
    not its update (free the buffer: nothing changed) and ``PW g`` right after ``U g`` (write
    the updated image back). Reads go as early as the buffers allow, in order of need, but not
    across the start of the backward (a forward-only call never runs the backward's reads).

    >>> from shfx.passes.stages import chain
    >>> acts = [Action.from_str(a) for a in "PF0 PF1 F0 R0 F1 B1 OG1 U1 R1 PF0 B0 OG0 U0 R0".split()]
    >>> " ".join(map(str, add_param_transfers(acts, chain(2), {0, 1}, 1)))
    'PR0 PF0 PD0 PR1 PF1 PD1 F0 R0 F1 B1 PR1 OG1 U1 PW1 PR0 R1 PF0 B0 OG0 U0 PW0 R0'
    >>> " ".join(map(str, add_param_transfers(acts, chain(2), {0, 1}, 2)))
    'PR0 PR1 PF0 PD0 PF1 PD1 F0 R0 F1 B1 PR1 PR0 OG1 U1 PW1 R1 PF0 B0 OG0 U0 PW0 R0'
    """
    ssd_images = frozenset(ssd_images)
    if not ssd_images:
        return list(acts)
    need = image_window_needed(acts, stages, ssd_images)
    if isinstance(image_window, bool) or not isinstance(image_window, int) or image_window < need:
        raise ScheduleError(
            f"the parameter tier needs at least {need} image buffers for this order (images on the host at once when each "
            f"is read right before its first use), got image_window={image_window!r}"
        )
    holds = _image_holds(acts, stages, ssd_images)
    first_b = next((i for i, a in enumerate(acts) if a.kind == B), len(acts))
    releases: dict[int, list[Action]] = {}
    for g, _, last_use, kind in holds:
        releases.setdefault(last_use, []).append(Action(kind, g))
    pending = list(holds)
    held: set[int] = set()
    out: list[Action] = []
    for i, a in enumerate(acts):
        # read ahead: the next holds in order of need, while a buffer is free, the group's
        # previous span has ended, and the read does not cross into the backward early
        while pending:
            g, first, _, _ = pending[0]
            if g in held or len(held) >= image_window or (first > first_b >= i):
                break
            out.append(Action(PR, g))
            held.add(g)
            pending.pop(0)
        if pending and pending[0][1] == i:  # (cannot happen when image_window >= need)
            raise ScheduleError(f"PR{pending[0][0]} could not be placed before its first use, action #{i} {a}")
        out.append(a)
        for r in releases.get(i, []):
            out.append(r)
            held.discard(r.stage)
    return out


def add_collectives(acts: Sequence[Action], stages: Sequence[StageSpec]) -> list[Action]:
    """Given an action order, add data parallel's collectives: ``RS g`` right after the ``OG``
    of host group ``g``'s last gradient contributor in issue order (each rank's local gradient
    of ``g`` is then complete: the reduce-scatter runs while the backward of earlier stages
    does), and ``AG g`` right after each ``U g`` (the updated shards are gathered before anything
    reads the group again); ``NR0`` right before the gate ``CK0``: with clipping every rank's
    per-parameter norms combined across ranks, without (the gate of updates in ``step()``) every
    rank's finite check, so all skip or apply the step alike.

    A group updated on the device (``DU g``) is replicated, as DDP replicates every parameter:
    its ``RS g`` comes right after the ``B`` of its last gradient contributor (its gradient is
    complete in its owner's gradient buffer on the device), before its norm ``GN g`` and its
    ``DU g``, and all-reduces that gradient (``* 1/N``, SUM); every rank then runs the same
    ``DU g`` on the same gradient, and nothing is gathered.

    >>> from shfx.passes.stages import chain
    >>> acts = [Action.from_str(a) for a in "F0 F1 B1 OG1 U1 B0 OG0 U0".split()]
    >>> " ".join(map(str, add_collectives(acts, chain(2))))
    'F0 F1 B1 OG1 RS1 U1 AG1 B0 OG0 RS0 U0 AG0'
    >>> acts = [Action.from_str(a) for a in "F0 F1 B1 OG1 U1 B0 DU0".split()]
    >>> " ".join(map(str, add_collectives(acts, chain(2))))
    'F0 F1 B1 OG1 RS1 U1 AG1 B0 RS0 DU0'
    """
    stages = list(stages)
    dev = {a.stage for a in acts if a.kind == DU}
    owned = {st.update_group for st in stages if st.update_group is not None}
    last_at: dict[int, int] = {}  # group -> position of its last contributor's OG (host) or B (device)
    for i, a in enumerate(acts):
        if a.kind in (OG, B) and 0 <= a.stage < len(stages):
            for g in stages[a.stage].grad_groups:
                if g in owned and (a.kind == B) == (g in dev):
                    last_at[g] = i
    after: dict[int, list[Action]] = {}
    for g, i in sorted(last_at.items()):
        after.setdefault(i, []).append(Action(RS, g))
    out: list[Action] = []
    for i, a in enumerate(acts):
        if a.kind == CK:  # every rank's norms (clipping) or finite checks combined before the gate
            out.append(Action(NR, 0))
        out.append(a)
        out += after.get(i, [])
        if a.kind == U:
            out.append(Action(AG, a.stage))
    return out
