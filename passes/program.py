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

from .actions import B, DU, F, GN, KINDS, OB, OG, OP, PF, R, STREAMS, U, Action, ActionKind
from .meta import get_meta, has_meta, set_meta
from .stages import StageSpec, backward_stages, consumers_of
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
]


class ScheduleError(ValueError):
    """A step program that cannot be built or that breaks an invariant."""


@dataclass(frozen=True)
class ActionMeta:
    """What ``node.meta["shfx"]`` holds for a step-program node.

    Attributes:
        action: the action.
        phase: ``"forward"`` (runs inside the model call), ``"backward"`` (inside
            ``loss.backward()``; ``U`` nodes may be deferred to ``step()``) or ``"next-forward"``
            (updates after the ``GN`` norms: ``step()`` starts them, the next forward waits for
            each where it prefetches the stage reading its group).
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
    """

    action: Action
    phase: str
    slot: int | None = None
    bytes: int = 0
    keep_graph: bool = False
    cost_s: float | None = None
    grads_to: str | None = None
    refresh: bool = False

    @property
    def kind(self) -> ActionKind:
        return self.action.kind

    @property
    def stage(self) -> int:
        return self.action.stage

    @property
    def stream(self) -> str:
        return self.action.kind.stream


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
    """

    def __init__(
        self,
        graph: fx.Graph,
        stages: Sequence[StageSpec],
        num_slots: int,
        name: str = "custom",
        persistent: Sequence[int] = (),
        updates_outside: bool = False,
    ):
        self.graph = graph
        self.stages = tuple(stages)
        self.num_slots = num_slots
        self.name = name
        #: stages resident before the step and after it, in slots 0..len-1 (loaded once)
        self.persistent = tuple(persistent)
        self.updates_outside = updates_outside

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
        """Bytes the program moves per direction: ``{"h2d": ..., "d2h": ...}``."""
        out = {"h2d": 0, "d2h": 0}
        for n in self.nodes:
            m = get_meta(n)
            if phase is not None and m.phase != phase:
                continue
            moves = KINDS[m.kind].moves
            if moves is not None:
                out[moves] += m.bytes
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
        device: ``optimizer_states x StageSpec.state_bytes`` of each."""
        owners = {s.update_group: s for s in self.stages if s.update_group is not None}
        return sum(optimizer_states * owners[g].state_bytes for g in self.device_groups() if g in owners)

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
        return Program(g, self.stages, self.num_slots, self.name, self.persistent, self.updates_outside)

    # ---- printing ------------------------------------------------------------------------
    def format(self, mark: fx.Node | None = None) -> str:
        """A table of the program, one action per row; ``mark`` gets an arrow (used on failure)."""
        rows = [
            f"program {self.name!r}: {len(self.stages)} stages, {self.num_slots} slots, "
            f"{len(self.nodes)} actions; moves {format_bytes(self.bytes_moved()['h2d'])} h2d, "
            f"{format_bytes(self.bytes_moved()['d2h'])} d2h per step",
            f"  {'#':>4}  {'action':<7} {'phase':<9} {'stream':<8} {'slot':>4} {'bytes':>11}  waits for",
        ]
        for i, n in enumerate(self.nodes):
            m = get_meta(n)
            deps = ", ".join(str(get_meta(d).action) for d in self.deps(n)) or "-"
            slot = "" if m.slot is None else str(m.slot)
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
      - ``U g`` waits for ``OG j`` of every stage ``j`` that sends gradients to group ``g``; when
        the program has ``GN`` actions before it (exact gradient clipping), it waits for every
        one of them instead (the clip coefficient needs the norm of every gradient).
      - ``GN g`` waits for ``OG j`` of every stage ``j`` that sends gradients to group ``g``.
      - ``DU g`` (on the device, in the slot of the stage that owns ``g``) waits for ``B j`` of
        every stage ``j`` that sends gradients to ``g``; ``OP s`` waits for ``DU`` of the group
        stage ``s`` owns.
    ``persistent`` stages are resident before the first action, in slots ``0..k-1``, and stay
    resident (they may not be released). The phase is ``"forward"`` up to the first ``B`` and
    ``"backward"`` after it; updates after the ``GN`` actions end the program and are in phase
    ``"next-forward"``: ``step()`` starts them and the next forward's prefetches wait for them
    (exact gradient clipping, ``shfx.compile(max_grad_norm=...)``). A ``B`` writes gradients into a device buffer (``grads_to``) when
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
    graph = fx.Graph()
    free = list(range(len(persistent), num_slots))  # free slots, lowest first
    last_release: dict[int, fx.Node] = {}  # slot -> R that freed it
    # stage -> (slot, PF or None when loaded before the step, readers)
    resident: dict[int, tuple[int, fx.Node | None, list[fx.Node]]] = {s: (k, None, []) for k, s in enumerate(persistent)}
    last: dict[Action, fx.Node] = {}  # most recent node of each action
    phase = "forward"
    seq = [_parse(a) for a in actions]
    owner_of = {st.update_group: st.index for st in stages if st.update_group is not None}
    device_groups = {a.stage for a in seq if a.kind == ActionKind.DEVICE_STEP}
    norms: list[fx.Node] = []  # the GRAD_NORMs so far: an update after them waits for all
    deferred = False  # an update after the GRAD_NORMs was seen: it runs in the next forward

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

        if deferred and not (k == ActionKind.CPU_STEP and norms):
            raise fail(pos, act, "the updates after the gradient norms (GN) run in the next step's forward: they must end the program")
        if k == ActionKind.CPU_STEP and norms:
            if s not in owner_of:
                raise fail(pos, act, f"no stage owns trainable parameter group {s}")
            deps.extend(norms)
            deferred = True
        elif k in (ActionKind.CPU_STEP, ActionKind.GRAD_NORM):
            if s not in owner_of:
                raise fail(pos, act, f"no stage owns trainable parameter group {s}")
            if s in device_groups:
                raise fail(pos, act, f"group {s} is updated on the device (DU{s}) in this program, not on the host")
            for j in contributors(s):
                deps.append(need(pos, act, Action(ActionKind.OFFLOAD_GRAD, j), f"stage {j} sends gradients to group {s}"))
        elif k == ActionKind.DEVICE_STEP:
            if s not in owner_of:
                raise fail(pos, act, f"no stage owns trainable parameter group {s}")
            own = owner_of[s]
            slot, pf, _ = need_resident(pos, act, own)
            if pf is not None:
                deps.append(pf)
            for j in contributors(s):
                deps.append(need(pos, act, Action(ActionKind.BACKWARD, j), f"stage {j} sends gradients to group {s}"))
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
                    if not free:
                        held = ", ".join(f"slot {sl}: stage {st}" for st, (sl, _, _) in sorted(resident.items()))
                        raise fail(pos, act, f"all {num_slots} slots are in use ({held}); release one first")
                    slot = free.pop(0)
                    if slot in last_release:
                        deps.append(last_release[slot])
                ob = last.get(Action(ActionKind.OFFLOAD_BUFFERS, s))
                if ob is not None and ob not in deps:
                    deps.append(ob)
                for g in sorted(spec.grad_groups | ({spec.update_group} if spec.update_group is not None else set())):
                    u = last.get(Action(ActionKind.CPU_STEP, g))
                    if u is not None:
                        deps.append(u)
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
                nbytes = spec.grad_bytes_to(host_groups)
                reader_of = s
            elif k == ActionKind.OFFLOAD_PARAMS:
                slot, _, _ = need_resident(pos, act)
                if spec.update_group is None:
                    raise fail(pos, act, f"stage {s} owns no trainable parameters")
                deps.append(need(pos, act, Action(ActionKind.DEVICE_STEP, spec.update_group), "the updated parameters it copies"))
                nbytes = spec.update_bytes
                reader_of = s
            elif k == ActionKind.RELEASE:
                if s in persistent:
                    raise fail(pos, act, f"stage {s} is persistent: it stays resident across steps")
                slot, pf, readers = need_resident(pos, act)
                deps.extend(readers or [pf])
            else:  # pragma: no cover - enum is closed
                raise fail(pos, act, f"unknown action kind {k}")

        node = graph.create_node("call_function", KINDS[k].op, (s, *_dedupe(deps)), {}, name=str(act).lower())
        set_meta(node, ActionMeta(
            action=act, phase="next-forward" if deferred else phase, slot=slot, bytes=nbytes, grads_to=grads_to,
            refresh=refresh,
        ))  # fmt: skip
        last[act] = node
        if k == ActionKind.GRAD_NORM:
            norms.append(node)
        if k == ActionKind.PREFETCH:
            resident[s] = (slot, node, [])
        elif reader_of is not None:
            resident[reader_of][2].append(node)
        elif k == ActionKind.RELEASE:
            sl = resident.pop(s)[0]
            last_release[sl] = node
            free.append(sl)
            free.sort()

    if keep_graph:
        _mark_keep_graph(graph)
    graph.output(None)
    return Program(graph, stages, num_slots, name, persistent)


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
    for a, b in zip(compute, compute[1:]):
        ma, mb = get_meta(a), get_meta(b)
        if ma.kind == ActionKind.FORWARD and mb.kind == ActionKind.BACKWARD and ma.stage == mb.stage:
            # same residency: no RELEASE of the stage between them
            i, j = nodes.index(a), nodes.index(b)
            if not any(get_meta(n).kind == ActionKind.RELEASE and get_meta(n).stage == ma.stage for n in nodes[i:j]):
                set_meta(a, replace(ma, keep_graph=True))
