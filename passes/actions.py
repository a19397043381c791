"""The action kinds of a step program and everything known about each kind, in one table.

:data:`KINDS` holds, per :class:`ActionKind`, the facts every reader of a program needs: the
stream it runs on, the resource the simulator charges it to, whether it uses and reads its
stage's slot, which link its bytes cross, which :class:`shfx.cost_model.costs.StageCost` field
gives its duration, and the marker op its FX node calls. :mod:`shfx.passes.program` (lowering,
printing), :mod:`shfx.passes.verify`, :mod:`shfx.cost_model.simulate` and the runtime's
interpreter (``shfx.runtime.engine``, which dispatches on :attr:`KindInfo.name`) all read it.

>>> KINDS[ActionKind.PREFETCH].stream, KINDS[ActionKind.OFFLOAD_GRAD].moves
('h2d', 'd2h')
>>> [k.value for k in ActionKind if KINDS[k].reads_slot]
['F', 'OB', 'B', 'OG', 'DU', 'OP']
>>> KINDS[ActionKind.SSD_READ].stream, KINDS[ActionKind.SSD_WRITE].resource
('ssd_read', 'ssd')
>>> KINDS[ActionKind.REDUCE_GRADS].stream, KINDS[ActionKind.GATHER_PARAMS].update
('reduce', True)
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "ActionKind",
    "Action",
    "KindInfo",
    "KINDS",
    "STREAMS",
    "RESOURCES",
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
    "NR",
    "CK",
    "SN",
    "US",
    "AO",
    "AF",
    "PR",
    "PD",
    "PW",
    "AW",
    "AR",
]


class ActionKind(str, enum.Enum):
    """The kinds of step-program actions; the value is the short string prefix."""

    PREFETCH = "PF"  # copy a stage's params/buffers host -> a device slot
    FORWARD = "F"  # run a stage, keep its boundary outputs
    OFFLOAD_BUFFERS = "OB"  # copy buffers the forward mutated (BatchNorm stats) device -> host
    RELEASE = "R"  # the stage's slot may be reused (a pure join of the slot's readers)
    BACKWARD = "B"  # recompute the stage, then grads of its inputs and params
    OFFLOAD_GRAD = "OG"  # copy a stage's param grads device -> host, accumulate in fp32
    CPU_STEP = "U"  # host optimizer update of one parameter group
    DEVICE_STEP = "DU"  # optimizer update of one parameter group on the device
    OFFLOAD_PARAMS = "OP"  # copy a stage's updated params device -> host
    GRAD_NORM = "GN"  # norms of one group's host gradients (exact global-norm clipping)
    SSD_READ = "SR"  # read one host-updated group's optimizer state SSD -> a host-window buffer
    SSD_WRITE = "SW"  # write it back from the buffer to the SSD after the group's update
    REDUCE_GRADS = "RS"  # data parallel: reduce-scatter one group's local gradient across ranks
    GATHER_PARAMS = "AG"  # data parallel: all-gather one group's updated working-copy shards
    NORM_REDUCE = "NR"  # data parallel: every rank's per-parameter gradient norms (or finite checks), combined
    CHECK = "CK"  # the step's gate: total gradient norm, clip coefficient, finite check
    SNAPSHOT = "SN"  # the step journal's copy of one host-updated group before its update (rollback)
    UNSCALE = "US"  # fp16: one host group's gradient checked finite and divided by the loss scale
    OFFLOAD_ACTIVATIONS = "AO"  # copy a stage's boundary activations device -> host, free the device copy
    FETCH_ACTIVATIONS = "AF"  # copy them back host -> device before the stage's backward
    PARAM_READ = "PR"  # read one SSD-held group's image (working copy) into a host image-window buffer
    PARAM_DROP = "PD"  # free it once the prefetches reading it are done (unchanged: nothing written)
    PARAM_WRITE = "PW"  # write it back to the SSD after the group's update, freeing its buffer
    ACTIVATION_WRITE = "AW"  # write a stage's offloaded activations from a host window buffer to the SSD
    ACTIVATION_READ = "AR"  # read them back from the SSD into a host window buffer, ahead of their fetch

    @property
    def info(self) -> KindInfo:
        return KINDS[self]

    @property
    def stream(self) -> str:
        return KINDS[self].stream


# Short aliases for the kinds, as in the action strings (PF3, F3, ...).
PF = ActionKind.PREFETCH
F = ActionKind.FORWARD
OB = ActionKind.OFFLOAD_BUFFERS
R = ActionKind.RELEASE
B = ActionKind.BACKWARD
OG = ActionKind.OFFLOAD_GRAD
U = ActionKind.CPU_STEP
DU = ActionKind.DEVICE_STEP
OP = ActionKind.OFFLOAD_PARAMS
GN = ActionKind.GRAD_NORM
SR = ActionKind.SSD_READ
SW = ActionKind.SSD_WRITE
RS = ActionKind.REDUCE_GRADS
AG = ActionKind.GATHER_PARAMS
NR = ActionKind.NORM_REDUCE
CK = ActionKind.CHECK
SN = ActionKind.SNAPSHOT
US = ActionKind.UNSCALE
AO = ActionKind.OFFLOAD_ACTIVATIONS
AF = ActionKind.FETCH_ACTIVATIONS
PR = ActionKind.PARAM_READ
PD = ActionKind.PARAM_DROP
PW = ActionKind.PARAM_WRITE
AW = ActionKind.ACTIVATION_WRITE
AR = ActionKind.ACTIVATION_READ

STREAMS = ("compute", "h2d", "d2h", "host", "cpu", "none", "ssd_read", "ssd_write", "reduce", "gather")
"""Where actions run: the device's compute stream and two copy streams, the host FIFO that
accumulates copied gradients (the second part of an OFFLOAD_GRAD), the host optimizer's pool,
``none`` (a RELEASE: a join that takes no time), and the NVMe tier's two queues: reads
(SSD_READ, PARAM_READ, ACTIVATION_READ) and writes (SSD_WRITE, PARAM_DROP, PARAM_WRITE,
ACTIVATION_WRITE).

NOTE: two SSD queues, not one, as the link has two copy streams: an NVMe drive serves reads and
writes from separate submission queues at once, and in the steady state of a host window of
``H >= 2`` groups the read of the group entering the window (it waits only for the write-back
that freed its buffer) must not queue behind the write-back of another group. Both queues share
one resource, ``"ssd"``, and the simulator couples their rates (``Links.ssd_duplex``) as the
drive's bandwidth is shared.

Data parallel adds two communication queues, ``reduce`` (REDUCE_GRADS) and ``gather``
(GATHER_PARAMS). NOTE: two, each running its collectives in program order on a process group of
its own: every rank issues the same program, so the collectives of one queue match across ranks
by construction, and a gradient reduction never waits behind an all-gather that waits for an
update (which waits for an earlier reduction)."""

RESOURCES = ("compute", "link", "host optimizer", "ssd", "network")
"""What the simulator attributes critical-path time to (plus ``"idle"``, for a RELEASE and for
time nothing explains)."""


@dataclass(frozen=True)
class KindInfo:
    """What every reader of a program knows about one kind of action.

    Attributes:
        kind: the kind.
        name: its verb (``"prefetch"``); the marker op's name, and the interpreter's handler.
        stream: the stream it runs on (:data:`STREAMS`); an OFFLOAD_GRAD also runs its
            accumulation on ``host`` (``accumulates``).
        resource: what the simulator charges its time to (:data:`RESOURCES` or ``"idle"``).
        slotted: it names a slot (``ActionMeta.slot``): its stage's, or for a DEVICE_STEP the
            slot of the stage owning its group.
        reads_slot: it reads the slot it names: a RELEASE of the slot, and a PREFETCH that
            refreshes it, wait for it.
        update: an optimizer update (or, GRAD_NORM, the gradient norm one needs); its index is a
            parameter group (the update group of the stage owning it), not a stage, and the
            runtime issues it only in the backward that completes a step (``grad_accum_steps``).
        moves: the link direction ``ActionMeta.bytes`` cross (``"h2d"``, ``"d2h"``; for the
            NVMe tier ``"ssd_read"``, ``"ssd_write"``; for data parallel's collectives
            ``"reduce"``, ``"gather"``: the bytes each rank contributes), or None.
        cost: the :class:`~shfx.cost_model.costs.StageCost` field that gives its duration
            (of the stage, or of the stage owning the group), or None for copies (bytes over
            the link) and RELEASE (no time). A BACKWARD whose forward kept its graph takes
            ``backward_no_recompute_s`` instead.
        accumulates: its copy is followed by an accumulation on the host FIFO, and it is done
            (for an update) only when that ends; a RELEASE waits only for the copy.
        op: the marker op its FX node calls (:mod:`shfx.passes.ops`).
        doc: one line.
    """

    kind: ActionKind
    name: str
    stream: str
    resource: str
    slotted: bool
    reads_slot: bool
    update: bool
    moves: str | None
    cost: str | None
    accumulates: bool
    doc: str

    @property
    def op(self) -> Callable[..., object]:
        return _MARKERS[self.name]


def _info(kind, name, stream, resource, *, slotted=True, reads=True, update=False, moves=None, cost=None, acc=False, doc=""):
    return KindInfo(kind, name, stream, resource, slotted, reads, update, moves, cost, acc, doc)


KINDS: dict[ActionKind, KindInfo] = {
    i.kind: i
    for i in (
        _info(PF, "prefetch", "h2d", "link", reads=False, moves="h2d",
              doc="copy a stage's working params and buffers host -> its device slot"),
        _info(F, "forward", "compute", "compute", cost="forward_s", doc="run a stage; keep only its boundary outputs"),
        _info(OB, "offload_buffers", "d2h", "link", moves="d2h", doc="copy buffers the forward mutated device -> host"),
        _info(R, "release", "none", "idle", reads=False, doc="the stage's slot may be reused once every reader is done"),
        _info(B, "backward", "compute", "compute", cost="backward_s",
              doc="recompute a stage, then grads of its inputs and params"),
        _info(OG, "offload_grad", "d2h", "link", moves="d2h", acc=True,
              doc="copy a stage's param grads device -> host, accumulating"),
        _info(U, "cpu_step", "cpu", "host optimizer", slotted=False, reads=False, update=True, cost="update_s",
              doc="host optimizer update of one parameter group"),
        _info(DU, "device_step", "compute", "compute", update=True, cost="device_update_s",
              doc="optimizer update of one parameter group on the device"),
        _info(OP, "offload_params", "d2h", "link", moves="d2h", doc="copy a stage's updated params device -> host"),
        # NOTE: its duration is a fraction of the group's update_s (GRAD_NORM_RATIO in the
        # simulator): it reads the fp32 gradient once, the update reads and writes 40 B/param
        _info(GN, "grad_norm", "cpu", "host optimizer", slotted=False, reads=False, update=True,
              doc="per-parameter norms of one group's host gradients, as soon as they are complete"),
        # NOTE: the SSD transfers are ``update`` kinds: their index is a parameter group and the
        # runtime issues them only in the backward that completes a step, with the updates
        # they serve (under gradient accumulation the other backwards read nothing from the SSD)
        _info(SR, "ssd_read", "ssd_read", "ssd", slotted=False, reads=False, update=True, moves="ssd_read",
              doc="read one host-updated group's optimizer state (and master) from the SSD into a host-window buffer"),
        _info(SW, "ssd_write", "ssd_write", "ssd", slotted=False, reads=False, update=True, moves="ssd_write",
              doc="write one group's updated optimizer state (and master) back to the SSD, freeing its buffer"),
        # NOTE: a reduction runs in every backward (under gradient accumulation each micro-step's
        # gradient is reduced into the rank's shard, as DDP reduces every backward): not an update
        # kind; the all-gather publishes an update, so it runs only with one
        _info(RS, "reduce_grads", "reduce", "network", slotted=False, reads=False, moves="reduce",
              doc="data parallel: reduce-scatter one group's local gradient across ranks into this rank's host shard"),
        _info(AG, "gather_params", "gather", "network", slotted=False, reads=False, update=True, moves="gather",
              doc="data parallel: all-gather one group's updated working-copy shards into every rank's host image"),
        # NOTE: the step phase (index 0: one per step). NR runs on the reduce queue, after every
        # RS in program order (each GN it waits for waited for its RS), so it matches across
        # ranks as the reductions do; CK is the gate every clipped update waits for
        _info(NR, "norm_reduce", "reduce", "network", slotted=False, reads=False, update=True, moves="reduce",
              doc="data parallel: the norms of the parameters every rank holds part of, and every rank's "
              "per-parameter norms, combined across ranks; without norms, every rank's finite check"),
        _info(CK, "check", "cpu", "host optimizer", slotted=False, reads=False, update=True,
              doc="the step's gate: the total gradient norm from every GN (and NR), the clip coefficient "
              "and the finite check, before the clipped updates"),
        # NOTE: its duration is the journal's copy (StageCost.rollback_copy_s): the group's master,
        # step counter and optimizer states, read once and written once, on the update's pool
        _info(SN, "snapshot", "cpu", "host optimizer", slotted=False, reads=False, update=True,
              doc="the step journal's copy of one host-updated group (master, optimizer states) before its update, "
              "so a failed or skipped step can be undone (rollback)"),
        # NOTE: a pass over the gradient like GRAD_NORM's (GRAD_NORM_RATIO in the simulator); in
        # fp32/bf16 the finite check is part of the update (it reads the gradient anyway)
        _info(US, "unscale", "cpu", "host optimizer", slotted=False, reads=False, update=True,
              doc="fp16: one host group's scaled gradient checked finite, then divided by the loss scale, before "
              "its norm, copy or update reads it"),
        # NOTE: activation offload (Offload(activations=...), shfx.passes.activations): no slot (the
        # values are the step context's, not the stage's parameters); the bytes are the stage's
        # offloaded boundary values
        _info(AO, "offload_activations", "d2h", "link", slotted=False, reads=False, moves="d2h",
              doc="copy a stage's boundary activations device -> a host buffer after its forward, freeing the device copy"),
        _info(AF, "fetch_activations", "h2d", "link", slotted=False, reads=False, moves="h2d",
              doc="copy a stage's offloaded boundary activations host -> device before its backward"),
        # NOTE: the parameter tier (Offload(params="nvme"), passes/lowering.py add_param_transfers):
        # the images of SSD-held groups pass through a few host buffers (ActionMeta.buffer, the
        # program's). Not update kinds: a forward reads them too. PD and PW share the write queue:
        # PD only waits for the prefetches and frees (no bytes), PW writes the updated image back
        _info(PR, "param_read", "ssd_read", "ssd", slotted=False, reads=False, moves="ssd_read",
              doc="read one SSD-held group's image (the copy a PREFETCH sends) into a host image-window buffer"),
        _info(PD, "param_drop", "ssd_write", "idle", slotted=False, reads=False,
              doc="free an image-window buffer once the prefetches reading it are done (the image is unchanged)"),
        _info(PW, "param_write", "ssd_write", "ssd", slotted=False, reads=False, update=True, moves="ssd_write",
              doc="write an SSD-held group's updated image back to the SSD after its update, freeing its buffer"),
        # NOTE: activation offload to the SSD (Offload(activations="nvme"), shfx.passes.activations
        # add_activation_spill): an AO then copies into one of the program's activation window
        # buffers (ActionMeta.buffer), AW empties it onto the SSD, AR fills one again ahead of the
        # AF, which empties it onto the device. Not update kinds: every train step runs them
        _info(AW, "write_activations", "ssd_write", "ssd", slotted=False, reads=False, moves="ssd_write",
              doc="write a stage's offloaded activations from their host window buffer to the SSD, freeing the buffer"),
        _info(AR, "read_activations", "ssd_read", "ssd", slotted=False, reads=False, moves="ssd_read",
              doc="read a stage's offloaded activations from the SSD into a host window buffer, ahead of their fetch"),
    )
}  # fmt: skip


def _marker(name: str, doc: str) -> Callable[..., object]:
    def op(stage: int, *tokens: object) -> object:
        raise RuntimeError(
            f"shfx.passes.ops.{name} is a step-program marker; run a program with the shfx runtime "
            "(shfx.compile) or simulate it with shfx.cost_model.simulate"
        )

    op.__name__ = op.__qualname__ = name
    op.__module__ = "shfx.passes.ops"
    op.__doc__ = doc
    return op


# NOTE: the markers are made here, with the table, and published as the attributes of
# :mod:`shfx.passes.ops` (their ``__module__``: where FX's generated code and pickles name them);
# ops imports this module, never the reverse
_MARKERS: dict[str, Callable[..., object]] = {i.name: _marker(i.name, f"{i.kind.value}: {i.doc}.") for i in KINDS.values()}

# Longest prefixes first so "PF3" is not read as "P" + "F3".
_ACTION_RE = re.compile(r"^(%s)(\d+)$" % "|".join(sorted((k.value for k in ActionKind), key=len, reverse=True)))


@dataclass(frozen=True, order=True)
class Action:
    """One action on one stage (or, for ``U`` and ``DU``, one parameter group).

    >>> str(Action(ActionKind.PREFETCH, 3))
    'PF3'
    >>> Action.from_str("OG12")
    Action(kind=<ActionKind.OFFLOAD_GRAD: 'OG'>, stage=12)
    """

    kind: ActionKind
    stage: int

    def __str__(self) -> str:
        return f"{self.kind.value}{self.stage}"

    @classmethod
    def from_str(cls, s: str) -> Action:
        m = _ACTION_RE.match(s.strip())
        if not m:
            raise ValueError(
                f"cannot read action {s!r}: expected a kind ({', '.join(k.value for k in ActionKind)}) "
                "followed by a stage number, e.g. 'PF3'"
            )
        return cls(ActionKind(m.group(1)), int(m.group(2)))
