"""The memory ledger: one replay of a step program that says, per action, what is allocated
and freed on each tier, term by term.

Everything that needs to know memory reads it: the runtime's own reservations are checked
against it (``tests/test_ledger.py``), the simulator puts its entries on a timeline
(:mod:`shfx.cost_model.simulate`), the planner (:func:`shfx.cost_model.planner.memory_for_model`),
``shfx compare`` and ``shfx.compile``'s capacity check take their peaks from it. The planner's
closed form for GPTs is a fast path tested against it.

What it replays, as the runtime (``shfx.runtime.engine``) does it:

- **setup** (before the first step; the steady state allocates nothing after it): the slot
  pool (each slot sized to the largest stage any of the programs puts into it), the device
  gradient buffers of slots whose stage keeps its parameters through the backward, the device
  optimizer states of the groups updated there; on the host, every group's master copy and, for
  the groups updated on the host, the gradient buffer and optimizer states, the staging buffers
  gradients are added through, and the buffers a borrowed gradient waits in.
- **forward start**: the model's tensor inputs, put on the device.
- **F s**: a copy of the buffers its forward mutates (when the stage will be recomputed, so the
  recompute sees what the forward saw), then its outputs. In an inference program a value is
  freed as soon as every stage reading it has run; in a train program too when none of its
  readers runs a backward (the activations of a frozen bottom are not kept).
- **backward start**: the gradient of every differentiable model output.
- **B s** (only if a gradient reaches one of its outputs): the gradients of its differentiable
  inputs (the first contribution to each); a gradient it computes for a tensor borrowed from a
  group updated on the device waits there (``pending tied gradient``) until the backward of the
  group's owner frees it; then the buffer copy, its outputs' gradients and every value whose
  earliest reader it is are freed.
- **AO s** / **AF s** (activation offload, :mod:`shfx.passes.activations`): an ``AO`` copies
  the stage's offloaded boundary values to the host, and the ``F`` that waits for it frees
  their device copies as it starts; an ``AF`` puts them back on the device. Their host copies
  are setup buffers (``offloaded activations``), reused every step. With activations on the SSD
  (``Program.activation_window``: ``AW``/``AR``) the host term is instead the program's window
  buffers (:func:`shfx.passes.activations.window_buffer_bytes` each), and the SSD holds every
  value an ``AW`` writes or an ``AR`` reads (term ``offloaded activations`` on the ``"ssd"`` tier).
- **end** (of a backward, or of an inference forward): everything still held is freed.

Copies, releases and updates allocate nothing (slots, gradient buffers and states are part of
the setup; so are the NVMe tier's host-window buffers, which SSD reads and writes fill and
empty). The terms are :data:`DEVICE_TERMS`, :data:`HOST_TERMS` and, for a program with the NVMe
tier (``Program.ssd_groups``), :data:`SSD_TERMS`: the SSD then holds those groups' optimizer
states (and master weights, ``Program.ssd_masters``) and the host, instead of them,
``host_window`` buffers each as large as the largest group's (:data:`HOST_WINDOW`). A
data-parallel program (``Program.ranks = N > 1``) has one rank's host terms: the fp32 master,
gradient and optimizer states sharded (``ceil(T / N)`` elements per group rounded up to
:data:`SHARD_ALIGN`, :func:`shard_range`), the image whole (:data:`DP_IMAGE`), the staging buffers at the padded
length and the collectives' buffers (:data:`DP_COLLECTIVE`); see :func:`host_terms`.

>>> from shfx.passes.policies import schedule_window
>>> from shfx.passes.stages import chain
>>> led = replay(schedule_window(chain(3, prefetch_bytes=1000, activation_bytes=100), 2))
>>> led.peak(), led.terms_at_peak()["activations (checkpoints)"]
(2500, 300)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from .actions import AF, AO, AR, AW, SN, B, F
from .layout import STAGING
from .meta import get_meta
from .pinned import PINNED_TERMS, PinnedPlan
from .program import Program
from .sharding import SHARD_ALIGN, shard_chunk, shard_numel, shard_range  # noqa: F401 (re-exported: the one sharding rule)
from .stages import StageSpec, Value, boundary_values, consumers_of, offloaded_values  # noqa: F401 (boundary_values: re-exported)

__all__ = [
    "DEVICE_TERMS",
    "HOST_TERMS",
    "SSD_TERMS",
    "Change",
    "Entry",
    "HostOptimizerStates",
    "Ledger",
    "replay",
    "static_device",
    "pool_sizes",
    "host_terms",
    "boundary_values",
    "STAGING_BUFFERS",
    "HOST_WINDOW",
    "IMAGE_WINDOW",
    "DP_IMAGE",
    "DP_COLLECTIVE",
    "shard_numel",
    "shard_chunk",
    "shard_range",
    "SHARD_ALIGN",
]

DEVICE_TERMS = (
    "parameters (slots)",
    "gradients",
    "optimizer states",
    "activations (checkpoints)",
    "activation gradients",
    "pending tied gradient",
    "working set (one block)",
    "workspace",
    "allocator slack",
)
"""Device memory, term by term (the last three are the planner's for a real GPU: temporaries
of the stage being computed, the CUDA context and workspaces, fragmentation)."""

HOST_TERMS = (
    "master parameters (fp32)",
    "gradients (fp32)",
    "optimizer states (m, v)",
    "working copy (16-bit)",
    "gradient staging (pinned)",
    "pending tied gradient",
    "rollback copies",
    "SSD host window",
    "SSD image window",
    "parameter image (whole)",
    "collective buffers",
    "offloaded activations",
)
SSD_TERMS = ("master parameters (fp32)", "optimizer states (m, v)", "working copy (16-bit)")

IMAGE_WINDOW = "SSD image window"
"""The host term of the parameter tier's image buffers (``Offload(params="nvme")``): ``image_window``
buffers, each as large as the largest paged group's image, that a group's image is read into
before the prefetches and the update that need it (``PR``) and freed (``PD``) or written back
(``PW``) from."""

HOST_WINDOW = "SSD host window"
"""The host term of the NVMe tier's host-window buffers: ``host_window`` buffers, each as large
as the largest SSD group's read (its optimizer states, and its master weights when those are on
the SSD), that a group's state is read into for its update and written back from."""

STAGING_BUFFERS = STAGING  # (passes.layout's: the pinned plan counts them too)
DP_IMAGE = "parameter image (whole)"
"""Data parallel (``ranks > 1``): the host image every rank holds whole (what a PREFETCH sends,
the model's parameters view it), beside the rank's fp32 master *shard*. In fp32 it is the whole
group; in mixed precision the 16-bit working copy stays in ``working copy (16-bit)``."""
DP_COLLECTIVE = "collective buffers"
"""Data parallel: the receive buffers of the collectives, sized for the largest group: the
all-gather's padded output (``ranks x chunk`` elements in the device dtype, the first ``T``
copied into the image) and the reduce-scatter's output chunk (``chunk`` elements)."""


@dataclass(frozen=True)
class Change:
    """Bytes allocated (``nbytes > 0``) or freed (``< 0``) on one tier for one term."""

    tier: Literal["device", "host", "ssd", "pinned"]
    term: str
    what: str
    nbytes: int


@dataclass(frozen=True)
class Entry:
    """The changes of one event: ``"setup"``, ``"forward start"``, ``"backward start"``,
    ``"end"``, or an action (``event`` its string, ``node`` the program node's name)."""

    event: str
    phase: str
    changes: tuple[Change, ...]
    node: str | None = None
    index: int | None = None  # issue position of the action in the program


@dataclass
class Ledger:
    """The replay of one program (:func:`replay`): its entries in issue order."""

    program: str
    entries: list[Entry]
    _levels: dict[str, list[int]] = field(default_factory=dict, repr=False)

    def changes(self, tier: str = "device") -> list[Change]:
        return [c for e in self.entries for c in e.changes if c.tier == tier]

    def levels(self, tier: str = "device") -> list[int]:
        """The running total after each change on ``tier`` (``0`` before the first)."""
        if tier not in self._levels:
            cur, out = 0, []
            for c in self.changes(tier):
                cur += c.nbytes
                out.append(cur)
            self._levels[tier] = out
        return self._levels[tier]

    def peak(self, tier: str = "device") -> int:
        """The most ``tier`` holds at any point of the step."""
        return max(self.levels(tier), default=0)

    def terms_at_peak(self, tier: str = "device") -> dict[str, int]:
        """Bytes per term at the first moment the peak is reached."""
        levels = self.levels(tier)
        terms: dict[str, int] = {t: 0 for t in {"device": DEVICE_TERMS, "host": HOST_TERMS, "ssd": SSD_TERMS, "pinned": PINNED_TERMS}[tier]}
        if not levels:
            return terms
        at = levels.index(max(levels))
        for c in self.changes(tier)[: at + 1]:
            terms[c.term] = terms.get(c.term, 0) + c.nbytes
        return terms

    def static(self, tier: str = "device") -> dict[str, int]:
        """Bytes per term allocated at setup (held for the whole step)."""
        out: dict[str, int] = {}
        for e in self.entries:
            if e.event == "setup":
                for c in e.changes:
                    if c.tier == tier:
                        out[c.term] = out.get(c.term, 0) + c.nbytes
        return out

    def by_node(self) -> dict[str, list[Change]]:
        """The device changes of each action, by program node name."""
        return {e.node: [c for c in e.changes if c.tier == "device"] for e in self.entries if e.node is not None}

    def table(self) -> str:
        from .units import format_bytes

        rows, cur = [f"ledger of {self.program!r}"], 0
        for e in self.entries:
            for c in e.changes:
                if c.tier == "device":
                    cur += c.nbytes
                    rows.append(f"  {e.event:<15} {c.term:<26} {c.nbytes:>+12} = {format_bytes(cur):>10}  {c.what}")
        return "\n".join(rows)


def _borrowed(spec: StageSpec) -> tuple[tuple[str, int, int], ...]:
    if spec.borrowed_grads or not spec.grad_group_bytes:
        return spec.borrowed_grads
    return tuple((f"{spec.index}:{g}", g, nb) for g, nb in spec.grad_group_bytes if g != spec.update_group)


def pool_sizes(programs: Sequence[Program]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Bytes of each slot and of each slot's gradient buffer when ``programs`` (a variant's
    train, eval and cold programs) share one pool: the largest any of them needs."""
    n = max(p.num_slots for p in programs)

    def per_slot(fn) -> tuple[int, ...]:
        return tuple(max((fn(p)[k] if k < p.num_slots else 0) for p in programs) for k in range(n))

    return per_slot(Program.slot_sizes), per_slot(Program.grad_buffer_sizes)


def static_device(
    programs: Sequence[Program], optimizer_states: int = 2, grad_accum_steps: int = 1, optimizer: HostOptimizerStates | None = None
) -> list[Change]:
    """The device memory of the setup for ``programs`` (a variant's train, eval and cold
    programs share one pool): slots, gradient buffers, optimizer states (in mixed precision the
    fp32 master of each group updated on the device too, under the same term; with
    ``grad_accum_steps > 1`` its fp32 gradient accumulator as well, under ``gradients``).
    ``optimizer``: the optimizer's states (:class:`HostOptimizerStates`; default AdamW's
    ``optimizer_states`` per element): the device runner of a group keeps what its host runner
    would (SGD's momentum buffer, Adafactor's factored second moments)."""
    slots, grads = pool_sizes(programs)
    out = [Change("device", "parameters (slots)", f"slot {k}", b) for k, b in enumerate(slots)]
    out += [Change("device", "gradients", f"gradient buffer of slot {k}", b) for k, b in enumerate(grads)]
    owners = {s.update_group: s for s in programs[0].stages if s.update_group is not None}
    if optimizer is not None:  # the device runner keeps the host runner's states (shfx.runtime.device_optim)
        optimizer_states = optimizer.per_element
    for g in sorted(set().union(*(p.device_groups() for p in programs))):
        if g in owners:
            out += [Change("device", "optimizer states", f"optimizer state {i} of group {g}", owners[g].state_bytes) for i in range(optimizer_states)]
            if optimizer is not None:  # Adafactor's factored second moments, one flat device buffer
                out.append(Change("device", "optimizer states", f"factored states of group {g}", optimizer.whole_bytes(g)))
            # mixed precision: the fp32 master the device update steps (shfx.runtime.device_optim)
            out.append(Change("device", "optimizer states", f"master weights (fp32) of group {g}", owners[g].device_master_bytes))
            if grad_accum_steps > 1:  # mixed precision: the micro-steps' 16-bit gradients summed in fp32 (runtime.gradients)
                # (data parallel, fp32 too: the all-reduced micro-step gradients' sum, apart from the next local one)
                acc = owners[g].device_master_bytes or (owners[g].update_bytes if programs[0].ranks > 1 else 0)
                out.append(Change("device", "gradients", f"gradient accumulator (fp32) of group {g}", acc))
    return [c for c in out if c.nbytes]


ROLLBACK = "rollback copies"
STEP_BYTES = 4  # an AdamW step counter (fp32 scalar)


@dataclass(frozen=True)
class HostOptimizerStates:
    """What a host optimizer keeps beside the master weights, as the ledger counts it (the
    default is AdamW's; ``shfx.optim.HostOptimizer.host_states`` gives an optimizer's).

    Attributes:
        per_element: fp32 states per trainable element of a group (AdamW's m and v: 2; SGD's
            momentum buffer: 1; Adafactor: 0).
        group_bytes: per group (by group index; missing: 0), the bytes of states that are not
            per element: Adafactor's factored second moments (a row and a column vector per
            matrix, a full one per vector).
        replicated: under data parallel every rank holds each group whole (master, gradient,
            states) and updates it from the all-reduced gradient, instead of its shard
            (``HostOptimizer.data_parallel == "replicated"``: Adafactor).
        step_counters: per group (by group index; missing: 1), its step counters (fp32 scalars:
            Adafactor keeps one per parameter); the NVMe tier keeps them in RAM beside its window.

    >>> HostOptimizerStates(per_element=1).per_element   # SGD
    1
    """

    per_element: int = 2
    group_bytes: tuple[int, ...] = ()
    replicated: bool = False
    step_counters: tuple[int, ...] = ()

    def whole_bytes(self, g: int) -> int:
        """Group ``g``'s states that are not per element."""
        return self.group_bytes[g] if 0 <= g < len(self.group_bytes) else 0

    def steps_of(self, g: int) -> int:
        """Group ``g``'s step counters."""
        return self.step_counters[g] if 0 <= g < len(self.step_counters) else 1


def _states_of(o: StageSpec, optimizer_states: int, optimizer: HostOptimizerStates | None) -> int:
    """Bytes of the optimizer states of the group ``o`` owns, as the NVMe tier holds them on the
    SSD (and reads into a host-window buffer): the optimizer's when given, else the stage spec's
    (``ssd_state_bytes``, which the compile pipeline sizes by the optimizer), else
    ``optimizer_states`` per-element states."""
    if optimizer is not None:
        return optimizer_states * o.state_bytes + optimizer.whole_bytes(o.update_group)
    return o.ssd_state_bytes if o.ssd_state_bytes is not None else optimizer_states * o.state_bytes


def _step_bytes(g: int, optimizer: HostOptimizerStates | None) -> int:
    return STEP_BYTES * (optimizer.steps_of(g) if optimizer is not None else 1)


def host_terms(
    stages: Sequence[StageSpec],
    device_groups: frozenset[int] | set[int],
    *,
    group_bytes: Sequence[int] | None = None,
    grad_accum_steps: int = 1,
    optimizer_states: int = 2,
    rollback: bool = False,
    working_bytes: Sequence[int] | None = None,
    ssd_groups: frozenset[int] | set[int] = frozenset(),
    host_window: int = 0,
    ssd_masters: bool = False,
    ranks: int = 1,
    rank: int = 0,
    optimizer: HostOptimizerStates | None = None,
    updates_in_step: bool = False,  # (Program.tier: where the updates run holds no host memory of its own)
    updates_delayed: bool = False,  # (likewise)
    ssd_images: frozenset[int] | set[int] = frozenset(),
    image_window: int = 0,
    activation_window: int = 0,  # (activation offload's buffers: the replay counts them, from the program's values)
) -> list[Change]:
    """The host memory of the setup: every group's master copy (``group_bytes``, or the owners'
    trainable bytes for synthetic specs), and for the groups updated on the host their gradient
    buffer, optimizer states, the staging buffers gradients are added through (one for a
    borrowed gradient, two under gradient accumulation; each as large as the largest group's
    gradient) and the buffers a borrowed gradient waits in. With ``rollback``, the step
    journal's copies (:mod:`shfx.runtime.journal`): per group its master weights, step counter
    and optimizer states, and for a group updated on the device its device weights too.

    With the NVMe tier (``ssd_groups``, ``host_window``, ``ssd_masters``: a program's
    :attr:`~shfx.passes.program.Program.tier`), the optimizer states of ``ssd_groups`` (and their
    master weights' trainable bytes with ``ssd_masters``) are on the ``"ssd"`` tier, and the host
    holds ``host_window`` buffers (:data:`HOST_WINDOW`) each as large as the largest of those
    groups' SSD reads instead.

    With the parameter tier (``ssd_images``, ``image_window``: ``Offload(params="nvme")``), those
    groups' images (``working_bytes`` in mixed precision, ``group_bytes`` in fp32, where the
    image is the master) and trainable masters are on the ``"ssd"`` tier too, their gradients
    live in the host-window buffers (each buffer also holds the largest such gradient), and
    the host holds ``image_window`` image buffers (:data:`IMAGE_WINDOW`), each the largest
    such image.

    With ``rollback`` and the tier, an SSD group's rollback copy is its master weights and step
    counter only, and the SSD holds a second version of its optimizer states (a step writes the
    version the last committed step did not: :mod:`shfx.runtime.ssd_window`).

    With data parallel (``ranks = N > 1``), the terms are those
    of rank ``rank`` (default 0, the rank that owns the most): each group's trainable region of
    ``T`` elements (``update_bytes / 4``, padding included) is sharded, ``chunk`` elements per
    rank (:func:`shard_chunk`), rank ``r`` owning ``n = `` :func:`shard_numel` ``(T, N, r)`` of
    them, and

    - ``master parameters (fp32)``: ``4 n`` per group (its own buffer); in mixed precision
      plus the rest of the group's master copy (``group_bytes - 4 T``: frozen parameters,
      buffers), kept whole;
    - ``parameter image (whole)`` (:data:`DP_IMAGE`): in fp32 the whole group (``group_bytes``)
      on every rank; in mixed precision the 16-bit image stays in ``working copy (16-bit)``;
    - ``gradients (fp32)``: ``4 n`` per group; ``optimizer states (m, v)``: ``4 n`` per state
      per group (the runtime's host bytes, ``Engine.host_bytes()``, are these three terms, the
      image and nothing else of the store: the staging, collective and pending buffers are
      the ledger's bounds on what is in flight);
    - ``gradient staging (pinned)``: :data:`STAGING_BUFFERS` buffers, each the largest group's
      local gradient in the device dtype padded to ``N chunk`` elements (the runtime's local
      gradient waits there from its OG until its ``RS``);
    - ``collective buffers`` (:data:`DP_COLLECTIVE`): for the largest group the all-gather's
      padded output (``N chunk`` elements) and send chunk (``chunk``), and the reduce-scatter's
      output chunk (``chunk``), device dtype (one collective of each queue at once);
    - ``pending tied gradient``: as without data parallel; ``rollback copies``: per group its
      master shard, step counter and state shards.

    With an optimizer that data parallel replicates (``optimizer.replicated``: Adafactor) each
    group is held whole on every rank instead: ``n = T`` above, and in fp32 no master term (the
    image is the master, as without data parallel); the staging buffers are the largest group's
    ``T`` elements and there are no collective buffers (the all-reduce runs in place in the
    local gradient, and nothing is gathered).

    ``optimizer`` (:class:`HostOptimizerStates`, default AdamW's): the host optimizer's states;
    when given, its ``per_element`` replaces ``optimizer_states`` on the host, and its
    ``group_bytes`` are added to each host-updated group's states.

    A group updated on the device (``device_groups``) is replicated (:func:`_dp_host_terms`):
    on the host its image whole and (sharded optimizer) its master shard, no gradient or state
    terms, and the all-reduce's host scratch of its gradient (``collective buffers``, a GPU's);
    in 16 bits its image is the working copy, and with rollback the journal's copies of its
    device master, states and 16-bit slot weights are whole."""
    if optimizer is not None:
        optimizer_states = optimizer.per_element
    if ranks > 1:
        return _dp_host_terms(
            stages, device_groups, group_bytes=group_bytes, optimizer_states=optimizer_states, rollback=rollback,
            working_bytes=working_bytes, ssd_groups=ssd_groups, host_window=host_window, ranks=ranks, rank=rank, optimizer=optimizer,
        )  # fmt: skip
    owners = {s.update_group: s for s in stages if s.update_group is not None}
    host = [owners[g] for g in sorted(owners) if g not in device_groups]
    ssd = [o for o in host if o.update_group in ssd_groups]
    if ssd_masters and ssd and group_bytes is not None and not any(working_bytes or ()):
        raise ValueError(
            "the master weights can live on the SSD only in mixed precision (a separate fp32 master); in fp32 the "
            "master is the image every PREFETCH copies: use nvme_masters=False, or precision='bf16'/'fp16'"
        )
    masters = list(group_bytes or [o.update_bytes for o in owners.values()])
    working = list(working_bytes or ())
    paged = [o for o in ssd if o.update_group in ssd_images]
    at = {g: g for g in owners} if group_bytes else {g: i for i, g in enumerate(owners)}
    # the masters on the SSD: every SSD group's with ssd_masters; with the parameter tier
    # (ssd_images) its own groups' only (a tied group's stays in RAM beside its image)
    mastered = [o for o in ssd if not ssd_images or o.update_group in ssd_images] if ssd_masters else []
    if mastered:  # (group_bytes is indexed by group; the synthetic default, by owner in stage order)
        for o in mastered:
            masters[at[o.update_group]] -= o.update_bytes
    image_out = []  # the parameter tier: the images on the SSD
    for o in paged:
        i = at[o.update_group]
        if working and working[i]:
            image_out.append(Change("ssd", "working copy (16-bit)", f"image of group {o.update_group}", working[i]))
            working[i] = 0
        else:  # (fp32: the image is the master)
            image_out.append(Change("ssd", "master parameters (fp32)", f"image of group {o.update_group}", masters[i]))
            masters[i] = 0
    out = [Change("host", "master parameters (fp32)", f"group {i}", b) for i, b in enumerate(masters)]
    out += [Change("host", "working copy (16-bit)", f"working copy of group {i}", b) for i, b in enumerate(working)]
    out += image_out
    out += [Change("host", "gradients (fp32)", f"gradient of group {o.update_group}", o.update_bytes) for o in host if o not in paged]
    out += [
        Change("host", "optimizer states (m, v)", f"optimizer state {i} of group {o.update_group}", o.state_bytes)
        for o in host
        if o not in ssd
        for i in range(optimizer_states)
    ]
    # the NVMe tier: each group's states on the SSD (AdamW's m and v, SGD's momentum, Adafactor's factored moments)
    out += [
        Change("ssd", "optimizer states (m, v)", f"optimizer states of group {o.update_group}", _states_of(o, optimizer_states, optimizer))
        for o in ssd
    ]
    if optimizer is not None:
        out += [
            Change("host", "optimizer states (m, v)", f"factored states of group {o.update_group}", optimizer.whole_bytes(o.update_group))
            for o in host
            if o not in ssd
        ]
    out += [Change("ssd", "master parameters (fp32)", f"master weights of group {o.update_group}", o.update_bytes) for o in mastered]
    if grad_accum_steps > 1:  # (the parameter tier: the gradient summed so far waits on the SSD between micro-steps)
        out += [Change("ssd", "gradients (fp32)", f"accumulated gradient of group {o.update_group}", o.update_bytes) for o in paged]
    if ssd:
        # each buffer holds what one SSD read brings (ssd_bytes_of, with this optimizer's states)
        per = max(_states_of(o, optimizer_states, optimizer) + (o.update_bytes if o in mastered else 0) for o in ssd)
        per += max((o.update_bytes for o in paged), default=0)  # (the parameter tier: the gradient too)
        out += [Change("host", HOST_WINDOW, f"host-window buffer {i}", per) for i in range(host_window)]
        if paged:
            largest_image = max(o.image_bytes or o.prefetch_bytes for o in paged)
            out += [Change("host", IMAGE_WINDOW, f"image buffer {i}", largest_image) for i in range(image_window)]
        steps = sum(_step_bytes(o.update_group, optimizer) for o in ssd)
        out.append(Change("host", HOST_WINDOW, "step counters of the groups on the SSD", steps))
    hg = {o.update_group for o in host}
    pending = [(key, nb) for s in stages for key, g, nb in _borrowed(s) if g in hg]
    trainable = sum(o.update_bytes for o in host)
    # gradients go through staging under accumulation, and in mixed precision those of a group
    # not cast on the device (a tied weight's owner: its 16-bit sum is cast on the host); else
    # only a borrowed one does (the owner's copies go direct, cast on the device or not)
    cast = {g for s in stages for g, _ in s.grad_wire_bytes}
    staged16 = any(working_bytes or ()) and any(o.update_group not in cast for o in host if o.update_bytes)
    staging = 0 if not trainable else STAGING_BUFFERS if grad_accum_steps > 1 or staged16 else int(bool(pending))
    largest = max((o.update_bytes for o in owners.values()), default=0)
    out += [Change("host", "gradient staging (pinned)", f"staging buffer {i}", largest) for i in range(staging)]
    out += [Change("host", "pending tied gradient", f"pending gradient of {key!r}", nb) for key, nb in pending]
    if rollback:
        for g, o in sorted(owners.items()):
            if not o.update_bytes:
                continue
            if o in ssd:  # the states' undo is their previous version on the SSD
                out.append(Change("host", ROLLBACK, f"rollback copy of group {g}", o.update_bytes + _step_bytes(g, optimizer)))
                out.append(Change("ssd", "optimizer states (m, v)", f"previous version of the optimizer states of group {g}",
                                  _states_of(o, optimizer_states, optimizer)))  # fmt: skip
                continue
            n = o.update_bytes + _step_bytes(g, optimizer) + optimizer_states * o.state_bytes  # (Adafactor: a step per parameter)
            if optimizer is not None:
                n += optimizer.whole_bytes(g)
            if g in device_groups:
                # the weights in the slot, beside the master (mixed precision: the 16-bit working
                # copy, and the master copied is the device's)
                n += o.grad_bytes_to({g}) if o.device_master_bytes else o.update_bytes
            out.append(Change("host", ROLLBACK, f"rollback copy of group {g}", n))
    return [c for c in out if c.nbytes]


def _dp_host_terms(
    stages: Sequence[StageSpec],
    device_groups: frozenset[int] | set[int],
    *,
    group_bytes: Sequence[int] | None,
    optimizer_states: int,
    rollback: bool,
    working_bytes: Sequence[int] | None,
    ssd_groups: frozenset[int] | set[int],
    ranks: int,
    rank: int = 0,
    host_window: int = 0,
    optimizer: HostOptimizerStates | None = None,
) -> list[Change]:
    """:func:`host_terms` per rank with data parallel over ``ranks`` ranks.

    A group updated on the device (``device_groups``) is replicated: its optimizer states and
    gradient are on the device, whole on every rank (the device terms, as in one process); on
    the host it keeps its image whole and the rank's fp32 master shard the store lays out for
    every group (unused while the group is updated on the device), no gradient shard and no
    optimizer state; its ``RS g`` all-reduces the device gradient through a host scratch of its
    size on a GPU (``collective buffers``; on the emulated device in place)."""
    owners = {s.update_group: s for s in stages if s.update_group is not None}
    dev = set(device_groups) & set(owners)
    mixed = any(working_bytes or ())
    elt = 2 if mixed else 4  # the device dtype of the local gradient and the working copy
    # (group_bytes is indexed by group; the synthetic default, by owner in stage order)
    whole = list(group_bytes) if group_bytes is not None else [o.update_bytes for o in owners.values()]
    at = {g: g for g in owners} if group_bytes is not None else {g: i for i, g in enumerate(owners)}
    out: list[Change] = []
    replicated = optimizer is not None and optimizer.replicated
    part = "whole" if replicated else "shard"
    padded = 0  # the largest group's padded length, ranks x chunk (replicated: T)
    largest_chunk = 0
    ssd_own = 0  # the largest state shard on the SSD (a host-window buffer holds its m and v)
    device_scratch = 0  # the largest device-updated group's gradient (the all-reduce's host scratch on a GPU)
    for g, o in sorted(owners.items()):
        numel = o.update_bytes // 4
        if g in dev:
            # (replicated: the master whole, in fp32 the image itself)
            own = (numel if mixed else 0) if replicated else shard_numel(numel, ranks, rank)
            device_scratch = max(device_scratch, numel)
            # (16 bits: the image is the working copy, counted below; the fp32 master shard is
            # what the device master is all-gathered from, and what a sync writes back)
            rest = whole[at[g]] - o.update_bytes if mixed else 0
            out.append(Change("host", "master parameters (fp32)", f"master shard of group {g} (updated on the device)", 4 * own + rest))
            if not mixed:
                out.append(Change("host", DP_IMAGE, f"image of group {g}", whole[at[g]]))
            if rollback and numel:
                # the journal's copies, as in one process: the master (16 bits: the device's, whole;
                # fp32: this rank's host master shard), step and optimizer states (whole) and the
                # weights in the slot (16-bit, or fp32)
                n = (o.update_bytes if mixed else 4 * own) + _step_bytes(g, optimizer) + optimizer_states * o.state_bytes
                n += (optimizer.whole_bytes(g) if optimizer is not None else 0) + (o.grad_bytes_to({g}) if mixed else o.update_bytes)
                out.append(Change("host", ROLLBACK, f"rollback copy of group {g}", n))
            continue
        chunk = numel if replicated else shard_chunk(numel, ranks)
        own = numel if replicated else shard_numel(numel, ranks, rank)
        padded, largest_chunk = max(padded, chunk if replicated else ranks * chunk), max(largest_chunk, chunk)
        rest = whole[at[g]] - o.update_bytes if mixed else 0
        # (replicated in fp32: the image is the master, as without data parallel)
        master = 4 * own + rest if mixed or not replicated else 0
        out.append(Change("host", "master parameters (fp32)", f"master {part} of group {g}", master))
        if not mixed:
            out.append(Change("host", DP_IMAGE, f"image of group {g}", whole[at[g]]))
        out.append(Change("host", "gradients (fp32)", f"gradient {part} of group {g}", 4 * own))
        # (the NVMe tier: each rank its shard's states on its SSD file, read through the host window)
        tier = "ssd" if g in ssd_groups else "host"
        out += [Change(tier, "optimizer states (m, v)", f"optimizer state {i} {part} of group {g}", 4 * own) for i in range(optimizer_states)]
        extra = optimizer.whole_bytes(g) if optimizer is not None and numel else 0
        out.append(Change(tier, "optimizer states (m, v)", f"factored states of group {g}", extra))
        if g in ssd_groups:  # (a host-window buffer holds what one SSD read brings)
            ssd_own = max(ssd_own, optimizer_states * 4 * own + extra)
        if rollback and numel and g in ssd_groups:  # master and step; the states' previous version on the SSD
            out.append(Change("host", ROLLBACK, f"rollback copy of group {g}'s {part}", 4 * own + _step_bytes(g, optimizer)))
            out += [Change("ssd", "optimizer states (m, v)", f"previous version of optimizer state {i} {part} of group {g}", 4 * own)
                    for i in range(optimizer_states)]  # fmt: skip
            out.append(Change("ssd", "optimizer states (m, v)", f"previous version of the factored states of group {g}", extra))
        elif rollback and numel:
            out.append(Change("host", ROLLBACK, f"rollback copy of group {g}'s {part}", 4 * own * (1 + optimizer_states) + extra + STEP_BYTES))
    if ssd_own:
        out += [Change("host", HOST_WINDOW, f"host-window buffer {i}", ssd_own) for i in range(host_window)]
        steps = sum(_step_bytes(g, optimizer) for g in owners if g in ssd_groups)
        out.append(Change("host", HOST_WINDOW, "step counters of the groups on the SSD", steps))
    if group_bytes is not None:  # groups nothing updates (frozen parameters, buffers only): whole on every rank
        out += [Change("host", DP_IMAGE, f"image of group {g}", b) for g, b in enumerate(whole) if g not in owners]
    out += [Change("host", "working copy (16-bit)", f"working copy of group {i}", b) for i, b in enumerate(working_bytes or ())]
    if padded:
        out += [Change("host", "gradient staging (pinned)", f"staging buffer {i}", padded * elt) for i in range(STAGING_BUFFERS)]
    if padded and not replicated:  # (replicated: all-reduced in place, nothing gathered)
        out.append(Change("host", DP_COLLECTIVE, "all-gather output (padded)", padded * elt))
        out.append(Change("host", DP_COLLECTIVE, "all-gather send chunk", largest_chunk * elt))
        out.append(Change("host", DP_COLLECTIVE, "reduce-scatter output chunk", largest_chunk * elt))
    if device_scratch:
        out.append(Change("host", DP_COLLECTIVE, "device gradient all-reduce scratch (GPU)", device_scratch * elt))
    hg = set(owners) - dev
    pending = [(key, nb) for s in stages for key, g, nb in _borrowed(s) if g in hg]
    if pending:  # a borrowed (tied) contribution is copied through the store's staging buffer, then summed
        largest = max((o.update_bytes for o in owners.values()), default=0)
        out.append(Change("host", "gradient staging (pinned)", "staging buffer of borrowed gradients", largest))
    out += [Change("host", "pending tied gradient", f"pending gradient of {key!r}", nb) for key, nb in pending]
    return [c for c in out if c.nbytes]


class _Replay:
    """The runtime's device accounting of one step, over a program's actions."""

    def __init__(self, program: Program):
        self.program = program
        self.stages = {s.index: s for s in program.stages}
        self.ins, self.outs = boundary_values(program.stages)
        self.held: dict[tuple[str, str], tuple[str, int]] = {}  # (term, what) -> (term, bytes)
        self.grads: set[str] = set()
        self.pending: dict[str, int] = {}  # borrowed key -> bytes, waiting for its owner's backward
        self.dev_groups = program.device_groups()
        owners = {s.update_group: s.index for s in program.stages if s.update_group is not None}
        self.owner_of = owners
        # the stages this program runs a backward of (a frozen bottom has none)
        self.backward_stages = {get_meta(n).stage for n in program.nodes if get_meta(n).kind == B}
        # activation offload: the values an AO/AF of each stage moves (shfx.passes.activations)
        moved = {get_meta(n).stage for n in program.nodes if get_meta(n).kind in (AO, AF)}
        self.offloaded: dict[int, tuple[Value, ...]] = {}
        if moved:
            self.offloaded = {s: vs for s, vs in offloaded_values(program.stages).items() if s in moved}
        # a value is freed after the backward of its earliest reader that runs one; a value no
        # backward reads, once every reader's forward ran (model outputs: at the end)
        self.free_after: dict[int, list[Value]] = {}
        self.fwd_left: dict[str, int] = {}
        self.forward_only: set[str] = set()
        for v in [v for outs in self.outs for v in outs] + self.model_inputs():
            self.fwd_left[v.name] = len(v.consumers)
            if v.consumers and not v.output:
                readers = [c for c in v.consumers if c in self.backward_stages]
                if readers:
                    self.free_after.setdefault(min(readers), []).append(v)
                else:
                    self.forward_only.add(v.name)

    def model_inputs(self) -> list[Value]:
        first = self.program.stages[0] if self.program.stages else None
        if first is not None and first.model_inputs:
            return list(first.model_inputs)
        seen: dict[str, Value] = {}
        for ins in self.ins:
            for v in ins:
                if v.producer < 0:
                    seen.setdefault(v.name, v)
        return list(seen.values())

    # ---- the runtime's operations ------------------------------------------------------------
    def alloc(self, out: list[Change], term: str, what: str, nbytes: int) -> None:
        if (term, what) in self.held:
            self.free(out, term, what)
        self.held[(term, what)] = (term, nbytes)
        if nbytes:
            out.append(Change("device", term, what, nbytes))

    def free(self, out: list[Change], term: str, what: str) -> None:
        got = self.held.pop((term, what), None)
        if got is not None and got[1]:
            out.append(Change("device", term, what, -got[1]))

    def put(self, out: list[Change], v: Value) -> None:
        self.alloc(out, "activations (checkpoints)", f"activation {v.name!r}", v.nbytes)

    def add_grad(self, out: list[Change], v: Value) -> None:
        if v.name not in self.grads:
            self.grads.add(v.name)
            self.alloc(out, "activation gradients", f"gradient of {v.name!r}", v.nbytes)

    def drop_grad(self, out: list[Change], v: Value) -> None:
        if v.name in self.grads:
            self.grads.discard(v.name)
            self.free(out, "activation gradients", f"gradient of {v.name!r}")

    # ---- events -----------------------------------------------------------------------------
    def forward_start(self) -> list[Change]:
        out: list[Change] = []
        for v in self.model_inputs():
            self.put(out, v)
        return out

    def forward(self, s: int, keep_graph: bool, train: bool) -> list[Change]:
        out: list[Change] = []
        spec = self.stages[s]
        if train and spec.recompute_buffer_bytes and not keep_graph and s in self.backward_stages:
            self.alloc(out, "activations (checkpoints)", f"pre-forward buffers of stage {s}", spec.recompute_buffer_bytes)
        for v in self.outs[s]:
            self.put(out, v)
        for v in self.ins[s]:
            if not train or v.name in self.forward_only:
                self.fwd_left[v.name] -= 1
                if self.fwd_left[v.name] == 0 and not v.output:
                    self.free(out, "activations (checkpoints)", f"activation {v.name!r}")
        return out

    def offload_activations(self, s: int) -> list[Change]:
        """AO s: the stage's offloaded values leave the device (a host buffer holds them:
        ``offloaded activations``, allocated at setup)."""
        out: list[Change] = []
        for v in self.offloaded.get(s, ()):
            self.free(out, "activations (checkpoints)", f"activation {v.name!r}")
        return out

    def fetch_activations(self, s: int) -> list[Change]:
        """AF s: they are back on the device for the stage's backward."""
        out: list[Change] = []
        for v in self.offloaded.get(s, ()):
            self.put(out, v)
        return out

    def backward_start(self) -> list[Change]:
        out: list[Change] = []
        for outs in self.outs:
            for v in outs:
                if v.output and v.differentiable:
                    self.add_grad(out, v)
        for v in self.model_inputs():
            if v.output and v.differentiable:
                self.add_grad(out, v)
        return out

    def backward(self, s: int) -> list[Change]:
        out: list[Change] = []
        spec = self.stages[s]
        if any(v.name in self.grads for v in self.outs[s]):
            for v in self.ins[s]:
                if v.differentiable:
                    self.add_grad(out, v)
            for key, g, nb in _borrowed(spec):
                if g in self.dev_groups and key not in self.pending:
                    self.pending[key] = nb
                    self.alloc(out, "pending tied gradient", f"pending gradient of {key!r}", nb)
            own = spec.update_group
            for key, g, _ in [k for st in self.program.stages for k in _borrowed(st)]:
                if g == own and key in self.pending:
                    del self.pending[key]
                    self.free(out, "pending tied gradient", f"pending gradient of {key!r}")
        self.free(out, "activations (checkpoints)", f"pre-forward buffers of stage {s}")
        for v in self.outs[s]:
            self.drop_grad(out, v)
        for v in self.free_after.get(s, []):
            self.free(out, "activations (checkpoints)", f"activation {v.name!r}")
        return out

    def end(self) -> list[Change]:
        out: list[Change] = []
        for (term, what) in list(self.held):
            self.free(out, term, what)
        self.grads.clear()
        self.pending.clear()
        return out

    def after_forward(self) -> None:
        """The state a forward leaves for a backward that starts cold (no forward in the
        program): its inputs, every output and the buffer copies of mutating stages."""
        self.forward_start()
        for s in sorted(self.stages):
            self.forward(s, keep_graph=False, train=True)


OFFLOADED = "offloaded activations"
"""The term of activation offload's copies: on the host, one buffer per offloaded value
(``"host"``), or the activation window's buffers (``"nvme"``); on the SSD, every value an
``AW`` writes or an ``AR`` reads."""


def _offload_terms(program: Program, offloaded: dict[int, tuple[Value, ...]]) -> list[Change]:
    """Setup changes of activation offload: without a window one host buffer per offloaded value,
    reused every step (pinned on CUDA); with one (``Program.activation_window``, activations on
    the SSD) that many buffers of :func:`~shfx.passes.activations.window_buffer_bytes`, and each
    value the program writes or reads on the SSD."""
    if not program.activation_window:
        return [
            Change("host", OFFLOADED, f"host copy of activation {v.name!r}", v.nbytes)
            for _, vs in sorted(offloaded.items()) for v in vs
        ]  # fmt: skip
    from .activations import window_buffer_bytes

    per = window_buffer_bytes(program.stages, offloaded)
    out = [Change("host", OFFLOADED, f"activation window {i}", per) for i in range(program.activation_window)]
    on_ssd = sorted({get_meta(n).stage for n in program.nodes if get_meta(n).kind in (AW, AR)})
    out += [Change("ssd", OFFLOADED, f"activation {v.name!r}", v.nbytes) for s in on_ssd for v in offloaded.get(s, ())]
    return [c for c in out if c.nbytes]


def replay(
    program: Program,
    *,
    programs: Sequence[Program] | None = None,
    optimizer_states: int = 2,
    group_bytes: Sequence[int] | None = None,
    grad_accum_steps: int = 1,
    rollback: bool = False,
    working_bytes: Sequence[int] | None = None,
    rank: int = 0,
    optimizer: HostOptimizerStates | None = None,
    pinned: PinnedPlan | None = None,
) -> Ledger:
    """The ledger of one step of ``program`` (see the module docstring).

    Args:
        program: a train, inference (no BACKWARD) or cold-backward (no FORWARD) program.
        programs: every program sharing the device pool (a variant's train, eval and cold):
            the setup sizes slots and gradient buffers for all of them (default: ``program``).
        optimizer_states: optimizer states per parameter group (AdamW: 2, m and v).
        group_bytes: bytes of every host group (the master copies; default: the owners'
            trainable bytes).
        working_bytes: mixed precision: bytes of every group's 16-bit working copy on the host
            (the image a PREFETCH sends, beside the fp32 master).
        grad_accum_steps: backward calls per step (gradient staging on the host; in mixed
            precision an fp32 accumulator on the device per group updated there).
        rollback: the step journal keeps copies to undo a step (``shfx.compile(rollback=...)``);
            a program with the journal's copies as actions (``SN``, the rollback pass) keeps
            them whatever this says.
        rank: data parallel (``program.ranks > 1``): whose host terms (default 0, the rank
            owning the largest shards).
        optimizer: the host optimizer's states (:class:`HostOptimizerStates`; default
            AdamW's: ``optimizer_states`` per element, sharded under data parallel).
        pinned: the pinned pool's plan (:class:`shfx.passes.pinned.PinnedPlan`; a compiled
            model's: ``cm.backend.pinned.plan``): the setup then has the ``"pinned"`` tier, the
            page-locked part of the host buffers this program allocates and the bounce buffers
            (``ledger.peak("pinned")``: what ``backend.pinned_bytes`` measures).
    """
    rp = _Replay(program)
    rollback = rollback or any(get_meta(n).kind == SN for n in program.nodes)
    pool = list(programs) if programs is not None else [program]
    setup = static_device(pool, optimizer_states, grad_accum_steps, optimizer)
    setup += host_terms(
        program.stages, set().union(*(p.device_groups() for p in pool)), group_bytes=group_bytes,
        grad_accum_steps=grad_accum_steps, optimizer_states=optimizer_states, rollback=rollback,
        working_bytes=working_bytes, rank=rank, optimizer=optimizer, **program.tier,
    )  # fmt: skip
    setup += _offload_terms(program, rp.offloaded)
    if pinned is not None:
        setup += [Change(*row) for row in pinned.changes([c for c in setup if c.tier == "host"])]
    entries = [Entry("setup", "setup", tuple(setup))]
    nodes = program.nodes
    metas = [get_meta(n) for n in nodes]
    has_f = any(m.kind == F for m in metas)
    has_b = any(m.kind == B for m in metas)
    if has_f:
        entries.append(Entry("forward start", "forward", tuple(rp.forward_start())))
    elif has_b:
        rp.after_forward()  # a cold backward: the forward's values are already there
        for s in rp.offloaded:  # (but those its forward offloaded are on the host)
            rp.offload_activations(s)
        entries.append(Entry("forward start", "forward", tuple(Change("device", t, w, b) for (t, w), (_, b) in rp.held.items() if b)))
    started = False
    for i, (n, m) in enumerate(zip(nodes, metas)):
        if m.kind == B and not started:
            started = True
            entries.append(Entry("backward start", "backward", tuple(rp.backward_start())))
        if m.kind == F:
            # (activation offload: the device copies of the AOs it waits for are freed as it starts)
            ch = [c for d in program.deps(n) if get_meta(d).kind == AO for c in rp.offload_activations(get_meta(d).stage)]
            ch += rp.forward(m.stage, m.keep_graph, train=has_b)
        elif m.kind == B:
            ch = rp.backward(m.stage)
        elif m.kind == AF:
            ch = rp.fetch_activations(m.stage)
        else:
            ch = []
        entries.append(Entry(str(m.action), m.phase, tuple(ch), n.name, i))
    if has_b or has_f and not has_b:
        entries.append(Entry("end", "backward" if has_b else "forward", tuple(rp.end())))
    return Ledger(program.name, entries)
