"""What a schedule needs to know about each stage, independent of its graph.

A :class:`StageSpec` is the summary that policies, the lowering pass, the verifier and the
simulator read: which stages feed which, how many bytes each transfer moves, which host
parameter groups a stage's gradients land in. :func:`shfx.passes.partition.partition_stages`
produces them from a captured model; tests and the simulator can also build synthetic ones
with :func:`chain`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["StageSpec", "Value", "backward_stages", "boundary_values", "chain", "consumers_of", "offloaded_values"]


@dataclass(frozen=True)
class Value:
    """A tensor that crosses a stage boundary, or a model input or output: what the runtime
    keeps on the device between actions (:mod:`shfx.passes.ledger` replays it).

    Attributes:
        name: unique in the model.
        nbytes: its size.
        producer: the stage whose forward produces it; -1 for a model input.
        consumers: the stages whose forwards read it (the producer excluded).
        differentiable: a gradient flows back through it.
        output: a model output (held until the backward ends; its gradient comes from the caller).
    """

    name: str
    nbytes: int
    producer: int = -1
    consumers: tuple[int, ...] = ()
    differentiable: bool = True
    output: bool = False


@dataclass(frozen=True)
class StageSpec:
    """Schedule-relevant facts about one stage.

    Attributes:
        index: position of the stage in execution order (0 = head).
        name: human name, e.g. ``"head"``, ``"blocks.3"``, ``"tail"``.
        producers: stages whose outputs this stage reads (user inputs are not a stage).
        prefetch_bytes: bytes one PREFETCH of this stage moves host -> device (its slot usage).
        grad_bytes: bytes one OFFLOAD_GRAD of this stage moves device -> host (0: no trainable params).
        buffer_out_bytes: bytes of buffers the forward mutates (BatchNorm stats), copied back by
            OFFLOAD_BUFFERS; 0 when the stage mutates none.
        grad_groups: host parameter groups that receive gradients from this stage (its own and
            the owners of parameters it shares with other stages, e.g. a tied embedding).
        update_group: the host group this stage owns and whose CPU_STEP exists, or None when the
            stage owns no trainable parameters.
        activation_bytes: bytes of the boundary outputs this stage's forward keeps on the device
            for the backward (its checkpoint contribution).
        slot_bytes: bytes of the stage's slot layout (what it occupies on the device).
        update_bytes: bytes of the trainable parameters of the group the stage owns (what its
            optimizer update reads and writes; 0 when it owns none).
        grad_group_bytes: ``(group, bytes)`` of the gradients the stage sends to each group
            (empty: all of ``grad_bytes`` to its own); an OFFLOAD_GRAD moves only those of groups
            updated on the host.
        state_bytes: bytes of one optimizer state (AdamW's m, or v) of the group it updates.
        device_master_bytes: mixed precision: bytes of the fp32 master of the group it updates
            (its ``update_bytes``), which an update on the device (``DU``) keeps on the device
            beside the optimizer states; 0 in fp32 (the slot's parameters are the master).
        ssd_state_bytes: bytes of all the optimizer states of the group it updates, as the NVMe
            tier reads and writes them (SGD's momentum buffer, Adafactor's factored moments:
            the host optimizer's, set by the compile pipeline); None: AdamW's, 2 x ``state_bytes``
            (:func:`shfx.passes.program.ssd_bytes_of`).
        inputs, outputs: the boundary values it reads and produces (empty on a synthetic spec:
            then one output of ``activation_bytes``, read by the stages that list this one as a
            producer).
        model_inputs: stage 0 only: every tensor input of the model (the call puts them all on
            the device, used or not).
        recompute_buffer_bytes: bytes of the buffers its forward mutates, copied before a forward
            whose stage will be recomputed (the recompute must see them as the forward did).
        borrowed_grads: ``(key, group, bytes)`` of each trainable tensor it borrows from another
            group (a tied weight): its gradient waits for the owner's.
        grad_wire_bytes: ``(group, bytes)`` for each group whose 16-bit gradient an OFFLOAD_GRAD
            casts to the host gradient's dtype on the device before copying it (mixed
            precision, one process: :func:`shfx.passes.layout.device_cast_groups`): the bytes it
            moves over the link for that group (the fp32 gradient), instead of its entry in
            ``grad_group_bytes``.
        image_bytes: bytes of the host image of the group it updates (every tensor of the
            group as a PREFETCH sends it: the parameter tier's PARAM_READ and PARAM_WRITE move
            it); 0: unknown (a synthetic spec: its ``prefetch_bytes``).
    """

    index: int
    name: str = ""
    producers: frozenset[int] = field(default_factory=frozenset)
    prefetch_bytes: int = 0
    grad_bytes: int = 0
    buffer_out_bytes: int = 0
    grad_groups: frozenset[int] = field(default_factory=frozenset)
    update_group: int | None = None
    activation_bytes: int = 0
    slot_bytes: int = 0
    update_bytes: int = 0
    grad_group_bytes: tuple[tuple[int, int], ...] = ()
    state_bytes: int = 0
    inputs: tuple[Value, ...] = ()
    outputs: tuple[Value, ...] = ()
    model_inputs: tuple[Value, ...] = ()
    recompute_buffer_bytes: int = 0
    borrowed_grads: tuple[tuple[str, int, int], ...] = ()
    grad_wire_bytes: tuple[tuple[int, int], ...] = ()
    device_master_bytes: int = 0
    ssd_state_bytes: int | None = None
    image_bytes: int = 0

    def __post_init__(self) -> None:
        if self.update_bytes and not self.state_bytes:  # a state as large as the parameters (fp32)
            object.__setattr__(self, "state_bytes", self.update_bytes)
        if any(p >= self.index for p in self.producers):
            raise ValueError(
                f"stage {self.index} ({self.name!r}) reads from stages {sorted(self.producers)}; "
                "a stage may only read from earlier stages"
            )

    @property
    def has_grads(self) -> bool:
        return self.grad_bytes > 0

    @property
    def mutates_buffers(self) -> bool:
        return self.buffer_out_bytes > 0

    def grad_bytes_to(self, groups: frozenset[int] | set[int]) -> int:
        """Gradient bytes this stage sends to ``groups``."""
        if not self.grad_group_bytes:
            return self.grad_bytes if (self.grad_groups & set(groups)) else 0
        return sum(n for g, n in self.grad_group_bytes if g in groups)

    def grad_wire_bytes_to(self, groups: frozenset[int] | set[int]) -> int:
        """Bytes an OFFLOAD_GRAD of this stage moves over the link for ``groups`` in one process:
        :meth:`grad_bytes_to`, with the fp32 size for groups cast on the device
        (``grad_wire_bytes``). Under data parallel the device dtype travels (:meth:`grad_bytes_to`)."""
        if not self.grad_wire_bytes:
            return self.grad_bytes_to(groups)
        wire = dict(self.grad_wire_bytes)
        if not self.grad_group_bytes:
            return sum(wire.values()) if (self.grad_groups & set(groups)) else 0
        return sum(wire.get(g, n) for g, n in self.grad_group_bytes if g in groups)


def chain(
    n: int,
    *,
    prefetch_bytes: int = 1 << 20,
    grad_bytes: int | None = None,
    mutating: tuple[int, ...] = (),
    tied: tuple[int, int] | None = None,
    activation_bytes: int = 0,
) -> list[StageSpec]:
    """``n`` stages in a chain (stage i reads stage i-1), for tests and what-if studies.

    ``tied=(a, b)`` makes stage ``b`` also send gradients to group ``a`` (a shared parameter
    owned by stage ``a``, like a tied embedding and head).

    >>> [s.name for s in chain(3)]
    ['s0', 's1', 's2']
    """
    grad_bytes = prefetch_bytes if grad_bytes is None else grad_bytes
    specs = []
    for i in range(n):
        groups = {i} if grad_bytes else set()
        by_group = ((i, grad_bytes),) if grad_bytes else ()
        if tied is not None and i == tied[1]:
            groups.add(tied[0])
            by_group = ((i, grad_bytes // 2), (tied[0], grad_bytes - grad_bytes // 2))
        update = grad_bytes if not (tied is not None and i == tied[1]) else grad_bytes // 2
        specs.append(
            StageSpec(
                index=i,
                name=f"s{i}",
                producers=frozenset({i - 1}) if i else frozenset(),
                prefetch_bytes=prefetch_bytes,
                grad_bytes=grad_bytes,
                buffer_out_bytes=64 if i in mutating else 0,
                grad_groups=frozenset(groups),
                update_group=i if grad_bytes else None,
                activation_bytes=activation_bytes,
                slot_bytes=prefetch_bytes,
                update_bytes=update if grad_bytes else 0,
                grad_group_bytes=by_group,
                state_bytes=update if grad_bytes else 0,
                recompute_buffer_bytes=64 if i in mutating else 0,
            )
        )
    return specs


def consumers_of(stages: list[StageSpec]) -> dict[int, frozenset[int]]:
    """Stage index -> the stages that read its outputs."""
    out: dict[int, set[int]] = {s.index: set() for s in stages}
    for s in stages:
        for p in s.producers:
            out[p].add(s.index)
    return {k: frozenset(v) for k, v in out.items()}


def backward_stages(stages: list[StageSpec]) -> frozenset[int]:
    """The stages whose BACKWARD has work to do: those with trainable parameters (their own or
    borrowed, ``has_grads``) and those a gradient flows through to an earlier stage (a
    differentiable input; on a synthetic spec without values, a producer in the set).

    A stage outside the set (frozen parameters, and nothing below it needs a gradient: the
    frozen bottom of a fine-tuned model) runs no backward at all, so the lowering gives it no
    ``B`` and no prefetch for one. When no stage needs a backward (every parameter frozen and
    no input requiring a gradient) every stage keeps its ``B``, as before: eager PyTorch
    refuses such a backward anyway.

    >>> sorted(backward_stages(chain(3)))
    [0, 1, 2]
    >>> frozen = [StageSpec(0), StageSpec(1, producers=frozenset({0}))] + chain(3)[2:]
    >>> sorted(backward_stages(frozen))
    [2]
    """
    need: set[int] = set()
    for s in sorted(stages, key=lambda s: s.index):
        if s.has_grads:
            need.add(s.index)
        elif s.inputs or s.outputs:
            if any(v.differentiable for v in s.inputs):
                need.add(s.index)
        elif any(p in need for p in s.producers):
            need.add(s.index)
    return frozenset(need) if need else frozenset(s.index for s in stages)


def boundary_values(stages: Sequence[StageSpec]) -> tuple[list[tuple[Value, ...]], list[tuple[Value, ...]]]:
    """Each stage's input and output values; a synthetic spec (no values listed) has one output
    of ``activation_bytes`` that the stages naming it as a producer read."""
    if any(s.outputs or s.inputs for s in stages):
        return [s.inputs for s in stages], [s.outputs for s in stages]
    cons = consumers_of(list(stages))
    outs = [
        (Value(f"{s.name or s.index}:out", s.activation_bytes, s.index, tuple(sorted(cons[s.index])), True, not cons[s.index]),)
        for s in stages
    ]
    ins = [tuple(outs[p][0] for p in sorted(s.producers)) for s in stages]
    return ins, outs


def offloaded_values(stages: Sequence[StageSpec]) -> dict[int, tuple[Value, ...]]:
    """Stage index -> the boundary values an ``AO`` of that stage copies to the host and frees
    (activation offload, :mod:`shfx.passes.activations`):
    its inputs that are not model outputs, whose last forward reader is the stage (no later
    forward needs them) and which the stage's own backward reads first (it runs one). Stages
    with none are left out.

    >>> from shfx.passes.stages import chain
    >>> {s: [v.name for v in vs] for s, vs in offloaded_values(chain(3, activation_bytes=8)).items()}
    {1: ['s0:out'], 2: ['s1:out']}
    """
    stages = list(stages)
    back = backward_stages(stages)
    out: dict[int, tuple[Value, ...]] = {}
    for s, ins in zip(stages, boundary_values(stages)[0]):
        if s.index not in back:
            continue
        vals = tuple(v for v in ins if not v.output and v.consumers and max(v.consumers) == s.index and v.nbytes)
        if vals:
            out[s.index] = vals
    return out
