"""The step program: the IR every schedule is written in.

A step program is a :class:`torch.fx.Graph` whose nodes call a small set of action ops
(:mod:`shfx.passes.ops`). Each node's ``meta["shfx"]`` holds an :class:`ActionMeta`; a node's
arguments after the stage index are the nodes it must wait for (tokens), so the dependency
DAG *is* the FX graph. Node order is issue order.

The compact string form follows torch.distributed.pipelining (``PF3``, ``F3``, ``B3``, ...):
:meth:`Program.actions` gives it and :func:`lower_actions` builds a program back from it,
adding the dependency edges and slot assignments, so a schedule can be written by hand.

>>> from shfx.passes.stages import chain
>>> p = lower_actions(["PF0", "F0", "PF1", "F1", "B1", "OG1", "U1", "R1", "B0", "OG0", "U0", "R0"],
...                   chain(2), num_slots=2)
>>> p.actions()[:4]
['PF0', 'F0', 'PF1', 'F1']
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch.fx as fx

from .actions import AF, AG, AO, AR, AW, B, CK, DU, F, GN, KINDS, NR, OB, OG, OP, PD, PF, PR, PW, RS, R, SN, SR, STREAMS, SW, U, US, Action, ActionKind
from .meta import get_meta, has_meta, set_meta
from .stages import StageSpec, backward_stages, consumers_of, offloaded_values
from .units import format_bytes

__all__ = [
    "ActionKind",
    "Action",
    "ActionMeta",
    "Program",
    "ScheduleError",
    "lower_actions",
    "STREAMS",
    "PF",
    "F",
    "OB",
    "R",
    "B",
    "OG",
    "U",
    "DU",
    "OP",
    "GN",
    "SR",
    "SW",
    "RS",
    "AG",
    "OPTIMIZER_STATES",
    "ssd_bytes_of",
]

OPTIMIZER_STATES = 2
"""Optimizer states per parameter group (AdamW's m and v): what an SSD read or write moves
unless the stage spec says otherwise (``StageSpec.ssd_state_bytes``)."""


def ssd_bytes_of(spec: StageSpec, masters: bool = False) -> int:
    """Bytes one SSD read (or write-back) of the group ``spec`` owns moves: its optimizer states
    (``spec.ssd_state_bytes``, the host optimizer's: SGD's momentum, Adafactor's factored
    moments; by default AdamW's, ``OPTIMIZER_STATES`` x ``state_bytes``, in the state dtype the
    layout gives: fp32 m and v) and, with ``masters``, its master weights (``update_bytes``: fp32).

    >>> import dataclasses
    >>> from shfx.passes.stages import chain
    >>> ssd_bytes_of(chain(1, prefetch_bytes=1000)[0]), ssd_bytes_of(chain(1, prefetch_bytes=1000)[0], masters=True)
    (2000, 3000)
    >>> ssd_bytes_of(dataclasses.replace(chain(1, prefetch_bytes=1000)[0], ssd_state_bytes=1000))  # SGD's momentum
    1000
    """
    states = OPTIMIZER_STATES * spec.state_bytes if spec.ssd_state_bytes is None else spec.ssd_state_bytes
    return states + (spec.update_bytes if masters else 0)


class ScheduleError(ValueError):
    """A step program that cannot be built or that breaks an invariant."""


@dataclass(frozen=True)
class ActionMeta:
    """What ``node.meta["shfx"]`` holds for a step-program node.

    Attributes:
        action: the action.
        phase: ``"forward"`` (runs inside the model call), ``"backward"`` (inside
            ``loss.backward()``; ``U`` nodes may be deferred to ``step()``), ``"step"`` (inside
            ``step()``, which waits for them: the gate ``CK0`` and data parallel's ``NR0``) or
            ``"next-forward"`` (updates after the gate: ``step()`` starts them, the next forward
            waits for each where it prefetches the stage reading its group) or ``"delayed"``
            (ZeRO-Offload's delayed update: ``step()`` starts them and they run during the next
            step, which trains on the weights before them; its gradient copies wait for them).
        slot: the device slot the action uses (PF/F/OB/R/B/OG), None for ``U``.
        bytes: bytes the action moves over the link (PF: h2d, OG/OB: d2h), else 0.
        keep_graph: FORWARD only: keep the stage's autograd graph so its BACKWARD does not
            recompute (set when the stage's backward is the very next compute action).
        grads_to: BACKWARD only: ``"slot"`` (gradients overwrite the parameters in the slot: they
            are not needed there any more) or ``"buffer"`` (a device gradient buffer beside the
            slot: the parameters stay, for a device update or because the stage is persistent).
        refresh: PREFETCH only: the stage is already resident (persistent) and its slot is
            refreshed with the parameters the host optimizer updated.
        cost_s: predicted duration, filled by the cost model (None until annotated).
        buffer: SSD_READ and SSD_WRITE only: the host-window buffer (``0..host_window-1``) the
            group's optimizer state is read into and written back from. PARAM_READ/DROP/WRITE: the
            image buffer. With activations on the SSD (``Program.activation_window``), AO, AW, AR
            and AF: the activation window buffer the stage's activations pass through.
        device: GRAD_NORM only: the group is updated on the device (``DU``), so its norms are
            computed there, on the compute stream, over the gradient in the gradient buffer of
            its (persistent) owner's slot (``slot``), where the ``DU`` after the gate reads it.
            UNSCALE (fp16) likewise: the finite check of a device-updated group's gradient, on
            the compute stream, in its owner's slot (``slot``).
            REDUCE_GRADS: the all-reduce of a device-updated group's gradient in that buffer
            (data parallel: the group is replicated, every rank runs its ``DU``).
    """

    action: Action
    phase: str
    slot: int | None = None
    bytes: int = 0
    keep_graph: bool = False
    cost_s: float | None = None
    grads_to: str | None = None
    refresh: bool = False
    buffer: int | None = None
    device: bool = False

    @property
    def kind(self) -> ActionKind:
        return self.action.kind

    @property
    def stage(self) -> int:
        return self.action.stage

    @property
    def stream(self) -> str:
        # (a device REDUCE_GRADS stays on the reduce queue: its collectives run in program order)
        return "compute" if self.device and self.kind != ActionKind.REDUCE_GRADS else self.action.kind.stream

    @property
    def resource(self) -> str:
        """What the simulator charges its time to (a device GRAD_NORM: the compute stream's)."""
        return "compute" if self.device and self.kind != ActionKind.REDUCE_GRADS else KINDS[self.action.kind].resource


class Program:
    """A step program: an FX graph of actions plus the facts it was built for.

    Attributes:
        graph: the FX graph (node order = issue order; args[1:] = dependencies).
        stages: the :class:`StageSpec` of every stage.
        num_slots: device slots the program may use (the window W, plus persistent stages).
        name: the policy that produced it.
        persistent: stages resident across steps, in slots ``0..len(persistent)-1``.
        updates_outside: the host updates are not in the program: the runtime runs them
            between steps (ZeRO-Offload's delayed update); the verifier does not ask for them.
        ssd_groups: the host-updated groups whose optimizer states (and, with ``ssd_masters``,
            master weights) live on the SSD (the NVMe tier): each update is preceded by an
            SSD_READ into a host-window buffer and followed by an SSD_WRITE; empty: no SSD tier.
        host_window: how many of those groups' states may be on the host at once (the
            host-window buffers); 0 without the SSD tier.
        ssd_masters: the SSD holds those groups' fp32 master weights too.
        ssd_images: the parameter tier (``Offload(params="nvme")``): groups among ``ssd_groups``
            whose image (the copy a PREFETCH sends) lives on the SSD too, read into one of
            ``image_window`` host buffers (PARAM_READ) before each prefetch and update that needs
            it, freed after them (PARAM_DROP, or PARAM_WRITE after an update); their gradients
            land in the group's host-window buffer (the OFFLOAD_GRAD waits for its SSD_READ).
        image_window: host buffers for those images (0 without the parameter tier).
        activation_window: activation offload to the SSD (``Offload(activations="nvme")``): the
            host buffers offloaded activations pass through (an ``AO`` fills one, an ``AW``
            writes it to the SSD, an ``AR`` fills one again, the ``AF`` empties it); 0: the
            activations an ``AO`` offloads wait in host buffers of their own (``"host"``).
        updates_in_step: the updates run in ``step()`` (``overlap_update=False``): everything
            from the gate ``CK0`` on is in phase ``"step"`` (:func:`shfx.passes.features.updates_in_step`).
        updates_delayed: ZeRO-Offload's delayed update (one step stale): the updates and their
            SSD transfers are in phase ``"delayed"`` (``step()`` starts them, they run during
            the next step) and the refresh of the persistent stages after the backward is in
            phase ``"step"`` (:func:`shfx.passes.features.delayed_update`).
        ranks: data parallel: the number of ranks running this program, each with its own
            batch (1: none). Each host-updated group's gradient is then reduced across them
            (REDUCE_GRADS) before its update, and each rank updates its shard and all-gathers
            the updated working copy (GATHER_PARAMS) before the group's next prefetch.
    """

    def __init__(
        self,
        graph: fx.Graph,
        stages: Sequence[StageSpec],
        num_slots: int,
        name: str = "custom",
        persistent: Sequence[int] = (),
        updates_outside: bool = False,
        *,
        ssd_groups: Iterable[int] = (),
        host_window: int = 0,
        ssd_masters: bool = False,
        ranks: int = 1,
        updates_in_step: bool = False,
        updates_delayed: bool = False,
        ssd_images: Iterable[int] = (),
        image_window: int = 0,
        activation_window: int = 0,
    ):
        self.graph = graph
        self.stages = tuple(stages)
        self.num_slots = num_slots
        self.name = name
        #: stages resident before the step and after it, in slots 0..len-1 (loaded once)
        self.persistent = tuple(persistent)
        self.updates_outside = updates_outside
        self.ssd_groups = frozenset(ssd_groups)
        self.host_window = host_window
        self.ssd_masters = ssd_masters
        self.ssd_images = frozenset(ssd_images)
        self.image_window = image_window
        self.activation_window = activation_window
        self.ranks = ranks
        self.updates_in_step = updates_in_step
        self.updates_delayed = updates_delayed

    @property
    def tier(self) -> dict:
        """The NVMe tier's and data parallel's facts, as keyword arguments of :class:`Program`
        and :func:`lower_actions` (for derived programs)."""
        return {
            "ssd_groups": self.ssd_groups, "host_window": self.host_window, "ssd_masters": self.ssd_masters,
            "ranks": self.ranks, "updates_in_step": self.updates_in_step, "updates_delayed": self.updates_delayed,
        } | ({"ssd_images": self.ssd_images, "image_window": self.image_window} if self.ssd_images else {}) | (
            {"activation_window": self.activation_window} if self.activation_window else {}
        )  # fmt: skip

    # ---- reading -------------------------------------------------------------------------
    @property
    def nodes(self) -> list[fx.Node]:
        return [n for n in self.graph.nodes if has_meta(n)]

    def actions(self, phase: str | None = None) -> list[str]:
        """The flat string form in issue order, e.g. ``["PF0", "PF1", "F0", ...]``."""
        return [str(get_meta(n).action) for n in self.nodes if phase is None or get_meta(n).phase == phase]

    def phase_nodes(self, phase: str) -> list[fx.Node]:
        return [n for n in self.nodes if get_meta(n).phase == phase]

    @staticmethod
    def deps(node: fx.Node) -> list[fx.Node]:
        """The nodes ``node`` waits for."""
        return [a for a in node.args[1:] if isinstance(a, fx.Node)]

    def find(self, action: str | Action, phase: str | None = None) -> fx.Node:
        """The first node with this action (optionally in one phase)."""
        action = Action.from_str(action) if isinstance(action, str) else action
        for n in self.nodes:
            m = get_meta(n)
            if m.action == action and (phase is None or m.phase == phase):
                return n
        raise KeyError(f"{action} is not in program {self.name!r}")

    def bytes_moved(self, phase: str | None = None) -> dict[str, int]:
        """Bytes the program moves per direction: ``{"h2d": ..., "d2h": ...}``; a program with
        the NVMe tier or activations on the SSD also ``"ssd_read"`` and ``"ssd_write"``, a
        data-parallel one ``"reduce"`` and ``"gather"`` (the bytes each rank contributes to its
        collectives)."""
        ssd = self.ssd_groups or self.activation_window
        out = {"h2d": 0, "d2h": 0} | ({"ssd_read": 0, "ssd_write": 0} if ssd else {})
        out |= {"reduce": 0, "gather": 0} if self.ranks > 1 else {}
        for n in self.nodes:
            m = get_meta(n)
            if phase is not None and m.phase != phase:
                continue
            moves = KINDS[m.kind].moves
            if moves is not None:
                out[moves] = out.get(moves, 0) + m.bytes
        return out

    def slot_sizes(self) -> list[int]:
        """Bytes each slot needs: the largest stage (``StageSpec.slot_bytes``) the program
        prefetches into it. Slot assignment is static, so a slot that only ever holds blocks is
        block-sized even when the embedding stage is larger."""
        sizes = [0] * self.num_slots
        by_index = {s.index: s for s in self.stages}
        for k, st in enumerate(self.persistent):
            sizes[k] = max(sizes[k], by_index[st].slot_bytes)
        for n in self.nodes:
            m = get_meta(n)
            if m.kind == ActionKind.PREFETCH and m.slot is not None:
                sizes[m.slot] = max(sizes[m.slot], by_index[m.stage].slot_bytes)
        return sizes

    def grad_buffer_sizes(self) -> list[int]:
        """Bytes of the device gradient buffer each slot needs: a slot whose stage's backward
        writes to a buffer (``grads_to == "buffer"``) gets one as large as the slot."""
        sizes = self.slot_sizes()
        need = [0] * self.num_slots
        for n in self.nodes:
            m = get_meta(n)
            if m.kind == ActionKind.BACKWARD and m.grads_to == "buffer" and m.slot is not None:
                need[m.slot] = sizes[m.slot]
        return need

    def device_groups(self) -> set[int]:
        """Parameter groups this program updates on the device (DEVICE_STEP)."""
        return {get_meta(n).stage for n in self.nodes if get_meta(n).kind == ActionKind.DEVICE_STEP}

    def device_state_bytes(self, optimizer_states: int = 2) -> int:
        """Device bytes of optimizer states (AdamW's two: m and v) of the groups updated on the
        device: ``optimizer_states x StageSpec.state_bytes`` of each, plus its fp32 master in
        mixed precision (``StageSpec.device_master_bytes``)."""
        owners = {s.update_group: s for s in self.stages if s.update_group is not None}
        return sum(
            optimizer_states * owners[g].state_bytes + owners[g].device_master_bytes for g in self.device_groups() if g in owners
        )

    def static_device_bytes(self) -> int:
        """Device bytes the program holds for the whole step: the slot pool, the gradient
        buffers and the device optimizer states (activations come on top)."""
        return sum(self.slot_sizes()) + sum(self.grad_buffer_sizes()) + self.device_state_bytes()

    def count(self, kind: ActionKind, phase: str | None = None) -> int:
        return sum(1 for n in self.nodes if get_meta(n).kind == kind and (phase is None or get_meta(n).phase == phase))

    @property
    def window(self) -> int:
        return self.num_slots

    def to_networkx(self):
        """The dependency DAG as a ``networkx.DiGraph`` (edge u -> v: v waits for u)."""
        import networkx as nx

        g = nx.DiGraph()
        for n in self.nodes:
            g.add_node(n.name, node=n, action=str(get_meta(n).action))
            for d in self.deps(n):
                g.add_edge(d.name, n.name)
        return g

    def with_costs(self, cost_of) -> Program:
        """A copy whose nodes carry ``cost_s = cost_of(meta)``."""
        new = self.copy()
        for n in new.nodes:
            m = get_meta(n)
            set_meta(n, replace(m, cost_s=float(cost_of(m))))
        return new

    def copy(self) -> Program:
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for n in self.graph.nodes:
            env[n] = g.node_copy(n, lambda a: env[a])
            env[n].meta = dict(n.meta)
        return Program(g, self.stages, self.num_slots, self.name, self.persistent, self.updates_outside, **self.tier)

    # ---- printing ------------------------------------------------------------------------
    def format(self, mark: fx.Node | None = None) -> str:
        """A table of the program, one action per row; ``mark`` gets an arrow (used on failure)."""
        moved = self.bytes_moved()
        ssd = (
            f"; SSD: {len(self.ssd_groups)} groups' states, host window {self.host_window}, "
            f"{format_bytes(moved['ssd_read'])} read, {format_bytes(moved['ssd_write'])} written per step"
            if self.ssd_groups else ""
        )  # fmt: skip
        if self.activation_window:
            ssd += (
                f"; activations on the SSD through {self.activation_window} host buffers, "
                f"{format_bytes(sum(get_meta(n).bytes for n in self.nodes if get_meta(n).kind == AW))} written per step"
            )
        if self.ranks > 1:
            ssd += (
                f"; data parallel over {self.ranks} ranks: {format_bytes(moved['reduce'])} reduced, "
                f"{format_bytes(moved['gather'])} gathered per rank per step"
            )
        rows = [
            f"program {self.name!r}: {len(self.stages)} stages, {self.num_slots} slots, "
            f"{len(self.nodes)} actions; moves {format_bytes(moved['h2d'])} h2d, "
            f"{format_bytes(moved['d2h'])} d2h per step{ssd}",
            f"  {'#':>4}  {'action':<7} {'phase':<9} {'stream':<8} {'slot':>4} {'bytes':>11}  waits for",
        ]
        for i, n in enumerate(self.nodes):
            m = get_meta(n)
            deps = ", ".join(str(get_meta(d).action) for d in self.deps(n)) or "-"
            slot = f"h{m.buffer}" if m.buffer is not None else "" if m.slot is None else str(m.slot)
            nbytes = format_bytes(m.bytes) if m.bytes else ""
            arrow = "->" if n is mark else "  "
            flag = "  (keeps graph)" if m.keep_graph else ""
            rows.append(f"{arrow}{i:>4}  {str(m.action):<7} {m.phase:<9} {m.stream:<8} {slot:>4} {nbytes:>11}  {deps}{flag}")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.format()

    def __repr__(self) -> str:
        return f"Program({self.name!r}, stages={len(self.stages)}, slots={self.num_slots}, actions={self.actions()})"


def _parse(a: str | Action) -> Action:
    return a if isinstance(a, Action) else Action.from_str(a)


def lower_actions(
    actions: Iterable[str | Action],
    stages: Sequence[StageSpec],
    num_slots: int,
    *,
    name: str = "custom",
    keep_graph: bool = True,
    persistent: Sequence[int] = (),
    ssd_groups: Iterable[int] = (),
    host_window: int = 0,
    ssd_masters: bool = False,
    ranks: int = 1,
    updates_in_step: bool = False,
    updates_delayed: bool = False,
    ssd_images: Iterable[int] = (),
    image_window: int = 0,
    activation_window: int = 0,
) -> Program:
    """Given actions in issue order, add dependency edges and slot assignments.

    Rules (each edge is a wait):
      - ``PF s`` takes the lowest free slot and waits for the ``R`` that last freed it; it also
        waits for earlier ``OB s`` (host buffers written) and ``U g`` of groups the stage reads.
        A ``PF`` of a stage that is already resident and persistent *refreshes* its slot (the
        host optimizer updated it): it waits for every action that read the slot since.
      - ``F s`` waits for its ``PF`` and for ``F p`` of every producer ``p``.
      - ``OB s`` waits for ``F s``; ``OG s`` waits for ``B s``.
      - ``B s`` waits for its ``PF``, for ``F s`` (when in this program) and for ``B c`` of every
        consumer ``c`` (its output gradients).
      - ``R s`` waits for every action that read the slot since its ``PF``; it frees the slot.
      - Activation offload (:mod:`shfx.passes.activations`): ``AO s`` waits for ``F s`` and moves
        the stage's offloadable boundary values (no slot); every ``F`` waits for the ``AO`` actions
        issued before the previous ``F`` and frees their device copies as it starts (the ``AO``
        actions issued since overlap the previous ``F``: the next one waits for them).
        ``AF s`` waits for ``AO s`` (when in this program: a cold backward fetches what its
        forward offloaded) and for the last ``B`` issued before it (whose activations it
        replaces on the device); ``B s`` of a stage whose activations were offloaded waits for
        its ``AF s`` (an ``AO s`` without one is refused). An offloaded stage never keeps its graph.
      - Activations on the SSD (``activation_window``: host buffers for them,
        :func:`shfx.passes.activations.add_activation_spill`): ``AO s`` takes the free window
        buffer freed longest ago and waits for the ``AW``/``AF`` that freed it; ``AW s`` waits
        for ``AO s`` and frees its buffer (the values are on the SSD); ``AR s`` waits for ``AW s``
        (when in this program: a cold backward reads what its forward wrote) and takes a buffer
        as ``AO`` does; ``AF s`` waits for the ``AR s`` (or ``AO s``) that filled a buffer with
        them and frees it. Each ``AW``/``AR`` moves the stage's offloaded bytes.
      - ``U g`` waits for ``OG j`` of every stage ``j`` that sends gradients to group ``g``; when
        the program has ``GN`` actions before it (exact gradient clipping), it waits for every
        one of them instead (the clip coefficient needs the norm of every gradient).
      - ``GN g`` waits for ``OG j`` of every stage ``j`` that sends gradients to group ``g``.
      - ``SN g``, the step journal's copy of group ``g`` (rollback), waits for what ``U g`` waits
        for and is in its phase; ``U g`` waits for it.
      - ``US g`` (fp16: the gradient checked and unscaled) waits for what the action after it
        waits for and is in its phase; ``GN g``, ``SN g`` and ``U g`` after it wait for it.
      - ``CK0``, the step's gate (phase ``"step"``), waits for every ``GN`` before it (and, with
        data parallel, for ``NR0``, which waits for every ``GN`` too); an update after it waits
        for it instead of for each norm.
      - ``DU g`` (on the device, in the slot of the stage that owns ``g``) waits for ``B j`` of
        every stage ``j`` that sends gradients to ``g``; ``OP s`` waits for ``DU`` of the group
        stage ``s`` owns. After ``GN`` actions (exact clipping) it waits for the gate ``CK0``
        too and is deferred like ``U g``.
      - ``GN g`` of a group updated on the device (``DU g`` in the program) runs on the device
        (``meta.device``: the compute stream, in its owner's slot, whose gradient buffer holds the
        gradient) and waits for ``B j`` of every stage ``j`` sending it gradients; its owner must
        be persistent (a streamed owner's gradient leaves with its slot).
      - The NVMe tier (``ssd_groups``: groups whose optimizer states live on the SSD,
        ``host_window``: host buffers for them): ``SR g`` takes the lowest free host-window
        buffer and waits for the ``SW`` that last freed it; ``U g`` of such a group waits for its
        ``SR g`` (the state must be on the host); ``SW g`` waits for ``U g`` and frees the buffer.
        Each moves the group's :func:`ssd_bytes_of` (masters too with ``ssd_masters``). Like the
        updates, SSD actions after the ``GN`` actions are in phase ``"next-forward"``.
      - The parameter tier (``ssd_images``: groups whose image is on the SSD, ``image_window``:
        host buffers for them): ``PR g`` takes the lowest free image buffer and waits for the
        ``PD``/``PW`` that last freed it; a ``PF`` of the stage owning ``g`` and ``U g`` wait for
        it (the image must be on the host); ``PD g`` waits for every ``PF`` that read the image
        since (nothing changed: it moves no bytes) and ``PW g`` also for ``U g`` (it writes the
        updated image back); both free the buffer. The ``OG`` of a stage sending gradients to
        such a group waits for its ``SR g`` (the gradient lands in the group's host-window buffer).
      - Data parallel (``ranks > 1``): ``RS g`` waits for ``OG j`` of every stage ``j`` that sends
        gradients to group ``g`` (the rank's whole local gradient); ``U g`` and ``GN g`` wait for
        ``RS g``; ``AG g`` waits for ``U g``; a ``PF`` waits for the last ``AG`` of each group its
        stage reads (as for ``U``). Both move the group's gradient bytes (its trainable region in
        the device dtype). A group updated on the device (``DU g``) is replicated: its ``RS g``
        (``meta.device``, in its owner's slot, which it reads) all-reduces the gradient in its
        owner's gradient buffer and waits for ``B j`` of every stage ``j`` sending it gradients
        (its ``bytes`` are twice the gradient's: a ring all-reduce moves a reduce-scatter's and an
        all-gather's); ``GN g`` and ``DU g`` wait for it; it has no ``AG g``.
    ``persistent`` stages are resident before the first action, in slots ``0..k-1``, and stay
    resident (they may not be released). The phase is ``"forward"`` up to the first ``B`` and
    ``"backward"`` after it; updates after the ``GN`` actions end the program and are in phase
    ``"next-forward"``: ``step()`` starts them and the next forward's prefetches wait for them
    (exact gradient clipping, ``shfx.compile(max_grad_norm=...)``). With ``updates_delayed``
    (ZeRO-Offload's delayed update) every update kind is in phase ``"delayed"`` and a refreshing
    PREFETCH after the first ``B`` in phase ``"step"``. A ``B`` writes gradients into a device buffer (``grads_to``) when
    its stage is persistent or its group is updated on the device, else over its parameters in
    the slot. With ``keep_graph``, a FORWARD whose stage's BACKWARD is the next compute action
    keeps its autograd graph instead of being recomputed.

    Raises :class:`ScheduleError` naming the action when the sequence cannot be built (a slot
    needed but none free, a stage used while not resident, a dependency that comes later).
    """
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
        raise ScheduleError(f"num_slots must be an int >= 1, got {num_slots!r}")
    by_index = {s.index: s for s in stages}
    consumers = consumers_of(list(stages))
    backward = backward_stages(list(stages))  # a consumer outside it sends no gradient back
    persistent = tuple(persistent)
    if len(set(persistent)) != len(persistent) or any(p not in by_index for p in persistent):
        raise ScheduleError(f"persistent stages {persistent} must be distinct stages of the program")
    if len(persistent) > num_slots:
        raise ScheduleError(f"{len(persistent)} persistent stages need more than the program's {num_slots} slots")
    ssd_groups = frozenset(ssd_groups)
    if isinstance(host_window, bool) or not isinstance(host_window, int) or host_window < 0:
        raise ScheduleError(f"host_window must be an int >= 0 (host buffers for SSD-resident optimizer states), got {host_window!r}")
    if ssd_groups and host_window < 1:
        raise ScheduleError(
            f"groups {sorted(ssd_groups)} keep their optimizer states on the SSD, so the program needs host_window >= 1 "
            "(host buffers to update them in), got 0"
        )
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ScheduleError(f"ranks must be an int >= 1 (data-parallel processes running the program), got {ranks!r}")
    ssd_images = frozenset(ssd_images)
    if ssd_images - ssd_groups:
        raise ScheduleError(
            f"groups {sorted(ssd_images - ssd_groups)} have their image on the SSD but not their optimizer states "
            f"(ssd_groups {sorted(ssd_groups)}): the parameter tier holds a group's image, master, gradient and states there"
        )
    if ssd_images and (isinstance(image_window, bool) or not isinstance(image_window, int) or image_window < 1):
        raise ScheduleError(f"groups {sorted(ssd_images)} keep their image on the SSD, so the program needs image_window >= 1, got {image_window!r}")
    if isinstance(activation_window, bool) or not isinstance(activation_window, int) or activation_window < 0:
        raise ScheduleError(
            f"activation_window must be an int >= 0 (host buffers of activations on the SSD; 0: none), got {activation_window!r}"
        )
    # activation window buffers (activations on the SSD): freed by an AW or AF; NOTE: handed out
    # oldest-freed first, so a forward's AO fills a buffer whose AW is not the one just issued
    # (its d2h copy overlaps the previous stage's write)
    act_buffers = _Pool(range(activation_window), fifo=True)
    act_in: dict[int, tuple[int, fx.Node]] = {}  # stage -> (window buffer, the AO or AR that filled it)
    act_written: dict[int, fx.Node] = {}  # stage -> its AW (activations on the SSD)
    images = _Pool(range(image_window if ssd_images else 0))  # image buffers (freed by a PD or PW)
    image_of: dict[int, tuple[int, fx.Node, list[fx.Node]]] = {}  # group -> (buffer, its PR, the PFs reading it)
    buffers = _Pool(range(host_window))  # host-window buffers (freed by an SW)
    on_host: dict[int, tuple[int, fx.Node]] = {}  # group -> (buffer, its SR)
    updated: set[int] = set()  # groups on the host whose update ran since their SR
    graph = fx.Graph()
    slots = _Pool(range(len(persistent), num_slots))  # slots not held by a persistent stage (freed by an R)
    # stage -> (slot, PF or None when loaded before the step, readers)
    resident: dict[int, tuple[int, fx.Node | None, list[fx.Node]]] = {s: (k, None, []) for k, s in enumerate(persistent)}
    last: dict[Action, fx.Node] = {}  # most recent node of each action
    phase = "forward"
    seq = [_parse(a) for a in actions]
    owner_of = {st.update_group: st.index for st in stages if st.update_group is not None}
    device_groups = {a.stage for a in seq if a.kind == ActionKind.DEVICE_STEP}
    norms: list[fx.Node] = []  # the GRAD_NORMs so far: an update after them waits for all
    gate: fx.Node | None = None  # the step's CHECK: an update after it waits for it (and so for every norm)
    reduced_norms: fx.Node | None = None  # data parallel: the NORM_REDUCE the CHECK waits for
    deferred = False  # an update after the GRAD_NORMs was seen: it runs in the next forward
    verdict: fx.Node | None = None  # data parallel with rollback: the overlapped step's NR0, after every update
    # activation offload (AO/AF): stage -> its AO (activations on the host), stage -> its AF not yet read by its B,
    # the AOs issued since the last F and before it (the F after next waits for them), the offloadable values
    offloaded: dict[int, fx.Node] = {}
    fetched: dict[int, fx.Node] = {}
    recent_offloads: list[fx.Node] = []
    older_offloads: list[fx.Node] = []
    offloadable: dict | None = None
    order: dict[fx.Node, int] = {}  # node -> its position

    def fail(pos: int, act: Action, msg: str) -> ScheduleError:
        around = " ".join(str(a) for a in seq[max(0, pos - 4) : pos]) + f" [{act}] " + " ".join(
            str(a) for a in seq[pos + 1 : pos + 4]
        )
        return ScheduleError(f"cannot lower action #{pos} {act} ({around.strip()}): {msg}")

    def need_stage(pos: int, act: Action) -> StageSpec:
        if act.stage not in by_index:
            raise fail(pos, act, f"there is no stage {act.stage} (stages are 0..{len(stages) - 1})")
        return by_index[act.stage]

    def need_resident(pos: int, act: Action, stage: int | None = None) -> tuple[int, fx.Node | None, list[fx.Node]]:
        s = act.stage if stage is None else stage
        if s not in resident:
            raise fail(pos, act, f"stage {s} is not resident; prefetch it first (PF{s})")
        return resident[s]

    def need(pos: int, act: Action, dep: Action, why: str) -> fx.Node:
        if dep not in last:
            raise fail(pos, act, f"it needs {dep} ({why}) earlier in the program")
        return last[dep]

    def contributors(g: int) -> list[int]:
        return [st.index for st in stages if g in st.grad_groups]

    for pos, act in enumerate(seq):
        k, s = act.kind, act.stage
        deps: list[fx.Node] = []
        slot: int | None = None
        nbytes = 0
        refresh = False
        grads_to = None
        reader_of: int | None = None  # the stage whose slot this action reads
        if k == ActionKind.BACKWARD:
            phase = "backward"
        elif k == ActionKind.FORWARD and phase == "backward":
            raise fail(pos, act, "a FORWARD cannot come after the first BACKWARD of a step")

        buffer: int | None = None
        step_phase = False
        on_device = False
        if deferred and not (k in (ActionKind.CPU_STEP, ActionKind.DEVICE_STEP, SN, US, SR, SW, AG) and norms):
            raise fail(
                pos, act, "the updates after the gradient norms (GN) run in the next step's forward: they (and their SSD "
                "reads and writes, their all-gathers) must end the program"
            )
        if verdict is not None and (KINDS[k].update or k == CK):
            raise fail(
                pos, act, "the overlapped step's verdict NR0 (every rank's outcome of its updates, agreed) ends the step: "
                "every update, copy and all-gather comes before it"
            )
        if k == NR and not norms and not updates_in_step and any(a.kind == ActionKind.CPU_STEP for a in last):
            # the overlapped step's verdict (rollback under data parallel: the rollback pass):
            # after every update of the backward, every rank's outcome of them (a non-finite or
            # overflowing gradient, a failed update) agreed, so all commit or all undo the step
            if ranks < 2:
                raise fail(pos, act, "norm_reduce combines the outcomes of several data-parallel ranks, but the program runs on one (ranks=1)")
            if s != 0:
                raise fail(pos, act, f"{KINDS[k].name} is one action of the whole step: its index is 0 ({k.value}0)")
            if reduced_norms is not None:
                raise fail(pos, act, "the outcomes are combined across ranks once a step (NR0)")
            ups = [n for a, n in last.items() if a.kind in (ActionKind.CPU_STEP, US, SN, AG, SR, SW)]
            deps.extend(sorted(ups, key=lambda n: order[n]))
        elif k in (NR, CK):
            step_phase = True
            if s != 0:
                raise fail(pos, act, f"{KINDS[k].name} is one action of the whole step: its index is 0 ({k.value}0)")
            # (a program whose updates run in step() has its gate without norms: the finite
            # check, which NR0 agrees across ranks)
            if not norms and not updates_in_step:
                raise fail(pos, act, "it combines the gradient norms (GN) of the step; none comes before it")
            if gate is not None:
                raise fail(pos, act, "it comes after the step's gate (CK0): a step has one, after every gradient norm")
            if k == NR:
                if ranks < 2:
                    raise fail(pos, act, "norm_reduce combines the norms of several data-parallel ranks, but the program runs on one (ranks=1)")
                if reduced_norms is not None:
                    raise fail(pos, act, "the norms are combined across ranks once a step (NR0)")
            elif ranks > 1 and reduced_norms is None:
                raise fail(
                    pos, act, f"the gate needs every rank's norms and finite checks: NR0 (norm_reduce across the {ranks} "
                    "ranks) first"
                )
            deps.extend(norms)
            if k == CK and reduced_norms is not None:
                deps.append(reduced_norms)
        elif k in (RS, AG):
            if ranks < 2:
                raise fail(pos, act, f"{KINDS[k].name} is a data-parallel collective, but the program runs on one rank (ranks=1)")
            if s not in owner_of:
                raise fail(pos, act, f"no stage owns trainable parameter group {s}")
            nbytes = by_index[owner_of[s]].grad_bytes_to({s})
            if s in device_groups:
                if k == AG:
                    raise fail(pos, act, f"group {s} is updated on the device (DU{s}) on every rank: there are no shards to gather")
                # (replicated: its device gradient, in its owner's gradient buffer, all-reduced; a
                # ring all-reduce is a reduce-scatter then an all-gather: twice the bytes of one)
                nbytes *= 2
                slot, pf, _ = need_resident(pos, act, owner_of[s])
                for j in contributors(s):
                    deps.append(need(pos, act, Action(ActionKind.BACKWARD, j), f"stage {j} sends gradients to group {s}"))
                reader_of = owner_of[s]
                on_device = True
            elif k == RS:
                for j in contributors(s):
                    deps.append(need(pos, act, Action(ActionKind.OFFLOAD_GRAD, j), f"stage {j} sends gradients to group {s}"))
            else:
                deps.append(need(pos, act, Action(ActionKind.CPU_STEP, s), "the update whose shard it gathers"))
                if norms and not deferred and not updates_in_step:
                    deferred = True
        elif k in (SR, SW):
            if s not in owner_of:
                raise fail(pos, act, f"no stage owns trainable parameter group {s}")
            if s not in ssd_groups:
                where = f"only groups {sorted(ssd_groups)} are" if ssd_groups else "no group is"
                raise fail(pos, act, f"group {s}'s optimizer state is not placed on the SSD ({where}; ssd_groups=...)")
            # (the parameter tier moves only its own groups' masters: a tied group's stays in RAM)
            nbytes = ssd_bytes_of(by_index[owner_of[s]], ssd_masters and (not ssd_images or s in ssd_images))
            if k == SR:
                if s in on_host:
                    raise fail(pos, act, f"group {s}'s state is already on the host in buffer {on_host[s][0]}")
                if not buffers.free:
                    held = ", ".join(f"buffer {b}: group {g}" for g, (b, _) in sorted(on_host.items()))
                    raise fail(pos, act, f"all {host_window} host-window buffers are in use ({held}); write one back first (SW)")
                buffer = buffers.take(deps)
            else:
                if s not in on_host:
                    raise fail(pos, act, f"group {s}'s state is not on the host; read it first (SR{s})")
                buffer = on_host[s][0]
                deps.append(need(pos, act, Action(ActionKind.CPU_STEP, s), "the update whose state it writes back"))
                if s not in updated:
                    raise fail(pos, act, f"it writes back group {s}'s state, but U{s} has not updated it since SR{s}")
            if norms and not deferred and not updates_in_step:
                deferred = True
        elif k in (PR, PD, PW):
            if s not in ssd_images:
                where = f"only groups {sorted(ssd_images)} have" if ssd_images else "no group has"
                raise fail(pos, act, f"group {s}'s image is not on the SSD ({where}; ssd_images=...)")
            own = by_index[owner_of[s]]
            nbytes = own.image_bytes or own.prefetch_bytes
            if k == PR:
                if s in image_of:
                    raise fail(pos, act, f"group {s}'s image is already on the host in image buffer {image_of[s][0]}")
                if not images.free:
                    held = ", ".join(f"buffer {b}: group {g}" for g, (b, _, _) in sorted(image_of.items()))
                    raise fail(pos, act, f"all {image_window} image buffers are in use ({held}); free one first (PD or PW)")
                buffer = images.take(deps)
                for kind in (ActionKind.CPU_STEP, PW):  # (this step's update of it written back first)
                    if Action(kind, s) in last:
                        deps.append(last[Action(kind, s)])
            else:
                if s not in image_of:
                    raise fail(pos, act, f"group {s}'s image is not on the host; read it first (PR{s})")
                buffer, pr, readers = image_of[s]
                deps.extend(readers or [pr])
                if k == PW:
                    u = last.get(Action(ActionKind.CPU_STEP, s))
                    if u is None or order[u] < order[pr]:
                        raise fail(pos, act, f"it writes back group {s}'s image, but U{s} has not updated it since PR{s}")
                    deps.append(u)
                else:
                    nbytes = 0
                    u = last.get(Action(ActionKind.CPU_STEP, s))
                    if u is not None and order[u] > order[pr]:
                        raise fail(pos, act, f"U{s} updated group {s}'s image since PR{s}: write it back (PW{s}), not drop it")
        elif k == US and s in device_groups:
            # fp16, a group updated on the device: its scaled gradient checked on the compute
            # stream where it is (its owner's slot: the gradient buffer), after every backward
            # sending it gradients; after the gate where the update waits for one
            if s not in owner_of:
                raise fail(pos, act, f"no stage owns trainable parameter group {s}")
            own = owner_of[s]
            slot, pf, _ = need_resident(pos, act, own)
            for j in contributors(s):
                deps.append(need(pos, act, Action(ActionKind.BACKWARD, j), f"stage {j} sends gradients to group {s}"))
            if gate is not None:
                deps.append(gate)
                deferred = deferred or (not updates_in_step and bool(norms))
            reader_of = own
            on_device = True
        elif (k in (ActionKind.CPU_STEP, SN) and norms) or (k == US and gate is not None):  # (a US before a GN: below)
            if s not in owner_of:
                raise fail(pos, act, f"no stage owns trainable parameter group {s}")
            deps.extend([gate] if gate is not None else norms)
            if updates_in_step:  # (in step(), after the gate: not deferred)
                for j in contributors(s):
                    deps.append(need(pos, act, Action(ActionKind.OFFLOAD_GRAD, j), f"stage {j} sends gradients to group {s}"))
            if ranks > 1:
                deps.append(need(pos, act, Action(RS, s), f"group {s}'s gradient reduced across the {ranks} ranks"))
            if s in ssd_groups:
                if s not in on_host:
                    raise fail(pos, act, f"group {s}'s optimizer state is on the SSD; read it first (SR{s})")
                deps.append(on_host[s][1])
            for before in (US, SN):  # (the unscale before the copy, the copy before the update)
                if k != before and Action(before, s) in last and (before == US or k == ActionKind.CPU_STEP):
                    deps.append(last[Action(before, s)])
            deferred = not updates_in_step
        elif k == ActionKind.GRAD_NORM and s in device_groups:
            # a group updated on the device: its norms on the device, where its gradient stays
            # (the gradient buffer of its owner's slot) until the DU after the gate reads it
            if s not in owner_of:
                raise fail(pos, act, f"no stage owns trainable parameter group {s}")
            own = owner_of[s]
            if own not in persistent:
                raise fail(
                    pos, act, f"group {s} is updated on the device, and its owner, stage {own}, is streamed (not persistent): "
                    "its gradient leaves the device with the stage's slot, so it cannot wait there for the gate (CK0) and "
                    f"the DU{s} after it"
                )
            slot, pf, _ = need_resident(pos, act, own)
            for j in contributors(s):
                deps.append(need(pos, act, Action(ActionKind.BACKWARD, j), f"stage {j} sends gradients to group {s}"))
            if Action(US, s) in last:  # fp16: after its finite check
                deps.append(last[Action(US, s)])
            if ranks > 1:
                deps.append(need(pos, act, Action(RS, s), f"group {s}'s gradient all-reduced across the {ranks} ranks"))
            reader_of = own
            on_device = True
        elif k in (ActionKind.CPU_STEP, ActionKind.GRAD_NORM, SN, US):
            if s not in owner_of:
                raise fail(pos, act, f"no stage owns trainable parameter group {s}")
            if s in device_groups:
                raise fail(pos, act, f"group {s} is updated on the device (DU{s}) in this program, not on the host")
            for j in contributors(s):
                deps.append(need(pos, act, Action(ActionKind.OFFLOAD_GRAD, j), f"stage {j} sends gradients to group {s}"))
            if ranks > 1:
                deps.append(need(pos, act, Action(RS, s), f"group {s}'s gradient reduced across the {ranks} ranks"))
                if gate is not None and k in (ActionKind.CPU_STEP, SN, US):
                    # NOTE: updates in step() under data parallel: the gate holds every rank's
                    # finite check (NR0 agreed it), which decides whether any update runs
                    deps.append(gate)
            if k in (ActionKind.CPU_STEP, SN) and s in ssd_groups:
                if s not in on_host:
                    raise fail(pos, act, f"group {s}'s optimizer state is on the SSD; read it first (SR{s})")
                deps.append(on_host[s][1])
            if k == ActionKind.CPU_STEP and s in ssd_images:  # (it writes the working copy: the image)
                if s not in image_of:
                    raise fail(pos, act, f"group {s}'s image is on the SSD; read it first (PR{s})")
                deps.append(image_of[s][1])
            for before in (US, SN):
                if k != before and Action(before, s) in last and (before == US or k == ActionKind.CPU_STEP):
                    deps.append(last[Action(before, s)])
        elif k in (AO, AF, AW, AR):
            # activation offload (shfx.passes.activations): no slot; the stage's offloadable values
            spec = need_stage(pos, act)
            if offloadable is None:
                offloadable = offloaded_values(stages)
            if s not in offloadable:
                raise fail(
                    pos, act, f"stage {s} has no boundary activation that waits on the device from its forward to its "
                    "backward (every input is read by a later forward, or it runs no backward)"
                )
            nbytes = sum(v.nbytes for v in offloadable[s])
            if k in (AW, AR) and not activation_window:
                raise fail(pos, act, "the program keeps offloaded activations in host RAM (activation_window=0): nothing goes to the SSD")
            if k == AO:
                if phase == "backward":
                    raise fail(pos, act, "an activation offload follows its stage's forward, before the first BACKWARD")
                if s in offloaded:
                    raise fail(pos, act, f"stage {s}'s activations are on the host already")
                deps.append(need(pos, act, Action(F, s), "the forward whose inputs it copies"))
                if activation_window:
                    if not act_buffers.free:
                        raise fail(pos, act, f"all {activation_window} activation window buffers are in use; write one to the SSD first (AW)")
                    buffer = act_buffers.take(deps)
            elif k == AW:
                if s in act_written:
                    raise fail(pos, act, f"stage {s}'s activations are on the SSD already (AW{s} before it)")
                if s not in offloaded:
                    raise fail(pos, act, f"no AO{s} before it put stage {s}'s activations in a window buffer")
                if s not in act_in:
                    raise fail(pos, act, f"stage {s}'s activations are not in a window buffer any more (AF{s} fetched them)")
                buffer, filled = act_in[s]
                deps.append(filled)
            elif k == AR:
                if s in act_in:
                    raise fail(pos, act, f"stage {s}'s activations are in window buffer {act_in[s][0]} already")
                if s in offloaded and s not in act_written:
                    raise fail(pos, act, f"nothing wrote stage {s}'s activations to the SSD (AW{s}) before it")
                if s not in offloaded and Action(F, s) in last:
                    raise fail(pos, act, f"stage {s}'s activations are on the device: nothing offloaded them (AO{s})")
                if s in act_written:
                    deps.append(act_written[s])
                if not act_buffers.free:
                    raise fail(pos, act, f"all {activation_window} activation window buffers are in use; fetch one first (AF)")
                buffer = act_buffers.take(deps)
            else:
                if s in fetched:
                    raise fail(pos, act, f"stage {s}'s activations were fetched already (AF{s}) and B{s} has not read them")
                if s not in offloaded and Action(F, s) in last:
                    raise fail(pos, act, f"stage {s}'s activations are on the device: nothing offloaded them (AO{s})")
                if activation_window:  # (from the window buffer an AR, or the AO, filled)
                    if s not in act_in:
                        raise fail(pos, act, f"stage {s}'s activations are on the SSD; read them first (AR{s})")
                    buffer, filled = act_in[s]
                    deps.append(filled)
                elif s in offloaded:
                    deps.append(offloaded[s])
                # (its device memory: after the backward issued before it, which freed what it held)
                prev_b = [n for a, n in last.items() if a.kind == B]
                if prev_b:
                    deps.append(max(prev_b, key=lambda n: order[n]))
        elif k == ActionKind.DEVICE_STEP:
            if s not in owner_of:
                raise fail(pos, act, f"no stage owns trainable parameter group {s}")
            own = owner_of[s]
            slot, pf, _ = need_resident(pos, act, own)
            if pf is not None:
                deps.append(pf)
            for j in contributors(s):
                deps.append(need(pos, act, Action(ActionKind.BACKWARD, j), f"stage {j} sends gradients to group {s}"))
            if ranks > 1:  # (every rank updates the group whole, from the all-reduced gradient)
                deps.append(need(pos, act, Action(RS, s), f"group {s}'s gradient all-reduced across the {ranks} ranks"))
            if Action(US, s) in last:  # fp16: after its finite check
                deps.append(last[Action(US, s)])
            if norms:  # (exact clipping) after the gate, which waits for every norm
                if gate is None:
                    raise fail(pos, act, "a device update after the gradient norms (GN) runs after the step's gate: CK0 first")
                deps.append(gate)
                deferred = not updates_in_step
            reader_of = own
        else:
            spec = need_stage(pos, act)
            if k == ActionKind.PREFETCH:
                if s in resident:
                    if s not in persistent:
                        raise fail(pos, act, f"stage {s} is already resident in slot {resident[s][0]}")
                    slot, pf, readers = resident[s]
                    refresh = True
                    deps.extend(readers or ([pf] if pf is not None else []))
                else:
                    if not slots.free:
                        held = ", ".join(f"slot {sl}: stage {st}" for st, (sl, _, _) in sorted(resident.items()))
                        raise fail(pos, act, f"all {num_slots} slots are in use ({held}); release one first")
                    slot = slots.take(deps)
                ob = last.get(Action(ActionKind.OFFLOAD_BUFFERS, s))
                if ob is not None and ob not in deps:
                    deps.append(ob)
                for g in sorted(spec.grad_groups | ({spec.update_group} if spec.update_group is not None else set())):
                    for kind in (ActionKind.CPU_STEP, AG):
                        u = last.get(Action(kind, g))
                        if u is not None:
                            deps.append(u)
                if spec.update_group in ssd_images:  # (its image comes from the SSD through an image buffer)
                    if spec.update_group not in image_of:
                        raise fail(pos, act, f"group {spec.update_group}'s image is on the SSD; read it first (PR{spec.update_group})")
                    deps.append(image_of[spec.update_group][1])
                nbytes = spec.prefetch_bytes
                if s not in persistent:
                    # copies of groups updated on the device in a persistent owner's slot come
                    # from there (device to device), not over the link
                    nbytes -= sum(
                        b
                        for g, b in spec.grad_group_bytes
                        if g in device_groups and g != spec.update_group and owner_of.get(g) in persistent
                    )
            elif k == ActionKind.FORWARD:
                slot, pf, _ = need_resident(pos, act)
                if pf is not None:
                    deps.append(pf)
                for p in sorted(spec.producers):
                    deps.append(need(pos, act, Action(ActionKind.FORWARD, p), f"stage {s} reads stage {p}'s output"))
                # (the device copies of what they copied out are freed as it starts; the AOs issued
                # since the previous F overlap it and are the next F's)
                deps.extend(older_offloads)
                older_offloads, recent_offloads = recent_offloads, []
                reader_of = s
            elif k == ActionKind.OFFLOAD_BUFFERS:
                slot, _, _ = need_resident(pos, act)
                if not spec.mutates_buffers:
                    raise fail(pos, act, f"stage {s} mutates no buffers")
                deps.append(need(pos, act, Action(ActionKind.FORWARD, s), "the buffers it copies"))
                nbytes = spec.buffer_out_bytes
                reader_of = s
            elif k == ActionKind.BACKWARD:
                slot, pf, _ = need_resident(pos, act)
                if pf is not None:
                    deps.append(pf)
                f = last.get(Action(ActionKind.FORWARD, s))
                if f is not None:
                    deps.append(f)
                if s in fetched:
                    deps.append(fetched.pop(s))
                    offloaded.pop(s, None)
                elif s in offloaded:
                    raise fail(pos, act, f"stage {s}'s activations are on the host (AO{s}); fetch them first (AF{s})")
                for c in sorted(consumers[s]):
                    if c in backward:
                        deps.append(need(pos, act, Action(ActionKind.BACKWARD, c), f"the gradient of stage {s}'s output flows back from stage {c}"))
                    elif Action(ActionKind.BACKWARD, c) in last:  # a B the stage does not need (no gradient flows)
                        deps.append(last[Action(ActionKind.BACKWARD, c)])
                grads_to = "buffer" if (s in persistent or spec.update_group in device_groups) else "slot"
                reader_of = s
            elif k == ActionKind.OFFLOAD_GRAD:
                slot, _, _ = need_resident(pos, act)
                if not spec.has_grads:
                    raise fail(pos, act, f"stage {s} has no trainable parameters")
                deps.append(need(pos, act, Action(ActionKind.BACKWARD, s), "the gradients it copies"))
                host_groups = set(spec.grad_groups) - device_groups
                if not host_groups:
                    raise fail(pos, act, f"every group stage {s} sends gradients to is updated on the device")
                # one process: a mixed-precision group's gradient is cast on the device and
                # travels in fp32 (grad_wire_bytes); data parallel sends the device dtype
                nbytes = spec.grad_wire_bytes_to(host_groups) if ranks == 1 else spec.grad_bytes_to(host_groups)
                for g in sorted(host_groups & ssd_images):  # (its gradient lands in the group's host-window buffer)
                    if g not in on_host:
                        raise fail(pos, act, f"group {g}'s gradient goes to its host-window buffer; read the group first (SR{g})")
                    deps.append(on_host[g][1])
                reader_of = s
            elif k == ActionKind.OFFLOAD_PARAMS:
                slot, _, _ = need_resident(pos, act)
                if spec.update_group is None:
                    raise fail(pos, act, f"stage {s} owns no trainable parameters")
                deps.append(need(pos, act, Action(ActionKind.DEVICE_STEP, spec.update_group), "the updated parameters it copies"))
                # (mixed precision: the 16-bit working copy; the fp32 master stays on the device)
                nbytes = spec.grad_bytes_to({spec.update_group}) if spec.device_master_bytes else spec.update_bytes
                reader_of = s
            elif k == ActionKind.RELEASE:
                if s in persistent:
                    raise fail(pos, act, f"stage {s} is persistent: it stays resident across steps")
                slot, pf, readers = need_resident(pos, act)
                deps.extend(readers or [pf])
            else:  # pragma: no cover - enum is closed
                raise fail(pos, act, f"unknown action kind {k}")

        node = graph.create_node("call_function", KINDS[k].op, (s, *_dedupe(deps)), {}, name=str(act).lower())
        if updates_delayed and KINDS[k].update:
            node_phase = "delayed"
        elif updates_delayed and refresh and phase == "backward":
            node_phase = "step"
        else:
            node_phase = "step" if step_phase or (updates_in_step and gate is not None) else "next-forward" if deferred else phase
        set_meta(node, ActionMeta(
            action=act, phase=node_phase,
            slot=slot, bytes=nbytes, grads_to=grads_to,
            refresh=refresh, buffer=buffer, device=on_device,
        ))  # fmt: skip
        last[act] = node
        if k == AO:
            offloaded[s] = node
            recent_offloads.append(node)
            if activation_window:
                act_in[s] = (buffer, node)
        elif k == AF:
            fetched[s] = node
            if activation_window:
                act_buffers.give(act_in.pop(s)[0], node)
                act_written.pop(s, None)
        elif k == AW:
            act_buffers.give(act_in.pop(s)[0], node)
            act_written[s] = node
        elif k == AR:
            act_in[s] = (buffer, node)
        if k == SR:
            on_host[s] = (buffer, node)
            updated.discard(s)
        elif k == ActionKind.CPU_STEP and s in on_host:
            updated.add(s)
        elif k == SW:
            on_host.pop(s)
            updated.discard(s)
            buffers.give(buffer, node)
        if k == PR:
            image_of[s] = (buffer, node, [])
        elif k in (PD, PW):
            image_of.pop(s)
            images.give(buffer, node)
        elif k == ActionKind.PREFETCH and spec.update_group in image_of:
            image_of[spec.update_group][2].append(node)
        if k == ActionKind.GRAD_NORM:
            if gate is not None:
                raise fail(pos, act, "a gradient norm after the step's gate (CK0) is not part of the total it checks")
            norms.append(node)
        elif k == CK:
            gate = node
        elif k == NR:
            reduced_norms = node
            if not step_phase:
                verdict = node
        order[node] = pos
        if k == ActionKind.PREFETCH:
            resident[s] = (slot, node, [])
        elif reader_of is not None:
            resident[reader_of][2].append(node)
        elif k == ActionKind.RELEASE:
            sl = resident.pop(s)[0]
            slots.give(sl, node)

    if keep_graph:
        _mark_keep_graph(graph)
    graph.output(None)
    return Program(
        graph, stages, num_slots, name, persistent, ssd_groups=ssd_groups, host_window=host_window, ssd_masters=ssd_masters,
        ranks=ranks, updates_in_step=updates_in_step, updates_delayed=updates_delayed,
        ssd_images=ssd_images, image_window=image_window if ssd_images else 0, activation_window=activation_window,
    )  # fmt: skip



class _Pool:
    """Numbered buffers a program hands out (slots, host-window and image buffers): :meth:`take`
    gives the lowest free one, adding to ``deps`` the action that last freed it (the new user
    waits for it); :meth:`give` frees one by an action."""

    def __init__(self, numbers: Iterable[int], fifo: bool = False):
        self.free = sorted(numbers)
        self.freed_by: dict[int, fx.Node] = {}
        self.fifo = fifo  # hand out the one freed longest ago instead of the lowest

    def take(self, deps: list[fx.Node]) -> int:
        n = self.free.pop(0)
        if n in self.freed_by:
            deps.append(self.freed_by[n])
        return n

    def give(self, n: int, node: fx.Node) -> None:
        self.freed_by[n] = node
        self.free.append(n)
        if not self.fifo:
            self.free.sort()


def _dedupe(nodes: list[fx.Node]) -> list[fx.Node]:
    seen: set[fx.Node] = set()
    out = []
    for n in nodes:
        if n not in seen:
            seen.add(n)
            out.append(n)
    return out


def _mark_keep_graph(graph: fx.Graph) -> None:
    """Set ``keep_graph`` on a FORWARD whose stage's BACKWARD is the next compute action
    on the same residency: recomputing it would redo work that nothing else can use the
    slot for in between."""
    nodes = [n for n in graph.nodes if has_meta(n)]
    compute = [n for n in nodes if get_meta(n).stream == "compute"]
    # (a stage whose activations go to the host keeps nothing but its inputs: it is recomputed)
    offloaded = {get_meta(n).stage for n in nodes if get_meta(n).kind == AO}
    for a, b in zip(compute, compute[1:]):
        ma, mb = get_meta(a), get_meta(b)
        if ma.kind == ActionKind.FORWARD and mb.kind == ActionKind.BACKWARD and ma.stage == mb.stage and ma.stage not in offloaded:
            # same residency: no RELEASE of the stage between them
            i, j = nodes.index(a), nodes.index(b)
            if not any(get_meta(n).kind == ActionKind.RELEASE and get_meta(n).stage == ma.stage for n in nodes[i:j]):
                set_meta(a, replace(ma, keep_graph=True))
