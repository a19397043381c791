"""The step journal: what the optimizer updates of one step have changed, to undo it exactly.

With the overlapped update (``overlap_update=True``) a stage's optimizer update runs as soon
as its gradient is complete, while the backward of the stages before it still runs. A step
can then fail, be interrupted, or be skipped (a non-finite gradient with
``skip_nonfinite=True``; later fp16 overflow) after some groups were updated. The journal
makes such a step all-or-nothing: before a group's first update of a step it copies what the
update overwrites (for a host group, the program's ``SN g`` action: the rollback feature pass,
:data:`shfx.passes.features.ROLLBACK`) (the host master weights and the optimizer's states, each runner's ``tensors()``, or the device copies of a group
updated on the device), and :meth:`StepJournal.rollback` puts them back, bitwise.

The copies cost memory traffic on the thread that runs the update (about 12 bytes read and
written per parameter beside AdamW's ~28; ``benchmarks/rollback.py`` measures it) and one
buffer of the group's weights and states each, allocated at the group's first update and
reused (counted in ``Engine.host_bytes``). ``shfx.compile(rollback=False)`` turns the copies
off: a failed step then says which groups it updated, and a retried ``cm.step()`` applies only
the updates that did not run (``applied``), but a backward that fails after some updates ran
leaves them applied (the error says so; recover by loading a checkpoint).

With the NVMe tier (``ssd``: the :class:`~shfx.runtime.ssd_window.SSDWindow`, versioned) a group
whose optimizer states live on the SSD is copied without them: its ``SN`` copies the master
weights and the step counter (in RAM), and its states' undo is the SSD's previous version, which
the window keeps until :meth:`StepJournal.commit` (``discard`` on :meth:`StepJournal.rollback`).

Under data parallel each rank's journal copies its own shards (master, states, step); the image
is not copied. A step is undone only when every rank agreed it (the overlapped step's verdict
``NR0``: :meth:`shfx.runtime.failures.StepFailures.undo_step`): each rank restores its shards
and recasts its shard of the image from its master shard, then one all-gather per group rebuilds
the rest of the image, which the step's all-gathers had overwritten with the other ranks'
updated shards (:meth:`shfx.runtime.data_parallel.DataParallelRuntime.restore_images`).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .device_optim import DeviceAdamW
    from .host_optim import HostAdamW, HostSGD, HostAdafactor
    from .host_store import HostStore

__all__ = ["StepJournal"]


class _HostCopy:
    """A group's host master weights and AdamW states before the step."""

    __slots__ = ("had_state", "tensors")

    def __init__(self) -> None:
        self.had_state = False
        self.tensors: list[torch.Tensor] = []


class _DeviceCopy:
    """A device-updated group's weights (in its slot), AdamW states and host master before the
    step, copied to the host."""

    __slots__ = ("had_state", "params", "states", "master", "where")

    def __init__(self) -> None:
        self.had_state = False
        self.params: torch.Tensor | None = None
        self.states: list[torch.Tensor] = []
        self.master: torch.Tensor | None = None
        self.where: Any = None  # (slot, byte offset) of the group in its slot, persistent owners only


def _save(bufs: list[torch.Tensor], i: int, src: torch.Tensor) -> None:
    """Copy ``src`` into the ``i``-th reusable host buffer (allocated on first use)."""
    if i == len(bufs):
        bufs.append(torch.empty(src.shape, dtype=src.dtype))
    elif bufs[i].shape != src.shape or bufs[i].dtype != src.dtype:
        bufs[i] = torch.empty(src.shape, dtype=src.dtype)
    bufs[i].copy_(src)


class StepJournal:
    """Undo records of the current step's optimizer updates (see the module docstring).

    ``enabled``: copy before updating (rollback possible). Either way the journal records which
    groups were updated this step (``applied``), so an error can say so and a retried step does
    not update a group twice."""

    def __init__(self, store: HostStore, optimizer: HostAdamW | HostSGD | HostAdafactor | None, device_optimizer: DeviceAdamW | None, enabled: bool):
        self.store = store
        self.optimizer = optimizer
        self.device_optimizer = device_optimizer
        self.enabled = enabled
        self._lock = threading.Lock()
        self._host: dict[int, _HostCopy] = {}  # reusable buffers, per group
        self._device: dict[int, _DeviceCopy] = {}
        self.saved: set[tuple[str, int]] = set()  # ("host"|"device", group) saved this step
        self.started: set[tuple[str, int]] = set()  # updates that started this step (copied first)
        self.applied: set[tuple[str, int]] = set()  # updates that completed this step
        self.ssd: Any = None  # the NVMe tier's window (Engine.attach_ssd): its groups' states are versioned there

    # ---- recording (on the threads running the updates) ------------------------------------------
    def _first(self, where: str, g: int, records: dict, make: type) -> Any:
        """Group ``g``'s reusable record when its copy is still to be made this step, else None
        (rollback off, or already saved)."""
        if not self.enabled:
            return None
        with self._lock:
            if (where, g) in self.saved:
                return None
            return records.setdefault(g, make())

    def before_host_update(self, g: int) -> None:
        """Group ``g``'s host update starts: copy its master and states unless its ``SN g``
        (:meth:`snapshot_host`) did already this step."""
        self.snapshot_host(g)
        with self._lock:
            self.started.add(("host", g))

    def snapshot_host(self, g: int) -> None:
        """``SN g`` (the rollback pass's action, before ``U g``): copy group ``g``'s host master
        and states, once a step. Only an update that started counts as one to undo."""
        rec = self._first("host", g, self._host, _HostCopy)
        if rec is None:
            return
        if self._on_ssd(g):  # its states' undo is the SSD's previous version: the master and step here
            rec.had_state = True
            srcs = [self.store.master(g), self.ssd.steps[g]]
        else:
            st = self.optimizer.state.get(g) if self.optimizer is not None else None
            rec.had_state = st is not None
            srcs = [self.store.master(g)]
            if st is not None:
                srcs += st.tensors()  # the optimizer's states of the group (its step first)
        for i, t in enumerate(srcs):
            _save(rec.tensors, i, t)
        with self._lock:
            self.saved.add(("host", g))

    def before_device_update(self, g: int, params: torch.Tensor, where: Any) -> None:
        """Copy device-updated group ``g``'s weights (``params``, its region in the slot; ``where``
        says where to put them back, None for a transient slot), states and host master."""
        rec = self._first("device", g, self._device, _DeviceCopy)
        if rec is None:
            return
        st = self.device_optimizer.state.get(g) if self.device_optimizer is not None else None
        rec.had_state = st is not None
        rec.where = where
        if rec.params is None or rec.params.shape != params.shape:
            rec.params = torch.empty(params.shape, dtype=params.dtype)
        rec.params.copy_(params)
        if st is not None:
            for i, t in enumerate(st.tensors()):  # (the step first; AdamW's m and v, SGD's momentum, Adafactor's factors)
                _save(rec.states, i, t)
        # mixed precision: the fp32 master the update steps is the device's (the host's is older)
        dev_master = self.device_optimizer.master_of(g) if self.device_optimizer is not None else None
        master = self.store.master(g) if dev_master is None else dev_master
        if rec.master is None or rec.master.shape != master.shape:
            rec.master = torch.empty(master.shape, dtype=master.dtype)
        rec.master.copy_(master)
        with self._lock:
            self.saved.add(("device", g))
            self.started.add(("device", g))

    def _on_ssd(self, g: int) -> bool:
        return self.ssd is not None and g in self.ssd.groups

    def done(self, where: str, g: int) -> None:
        with self._lock:
            self.applied.add((where, g))

    # ---- ending a step ---------------------------------------------------------------------------
    def updated_groups(self) -> list[int]:
        """Groups the step has updated (fully or partly), sorted."""
        with self._lock:
            return sorted({g for _, g in self.applied | self.started})

    def commit(self) -> None:
        """The step is applied: forget its records (the buffers are kept for the next); the NVMe
        tier's writes of the step become the groups' states."""
        with self._lock:
            self.saved.clear()
            self.started.clear()
            self.applied.clear()
        if self.ssd is not None:
            self.ssd.commit()

    def rollback(self, region: Any) -> list[int]:
        """Put back every group whose update started this step; returns them (a copy taken by
        an ``SN`` whose update never started is dropped: nothing changed that group).
        ``region(slot, offset, nbytes)`` gives a slot's bytes, to restore weights of persistent
        device-updated groups there. Call it only when no update task is running."""
        restored = []
        for where, g in sorted(self.saved & self.started):
            if where == "host":
                self._restore_host(g)
            else:
                self._restore_device(g, region)
            restored.append(g)
        self.commit()
        return restored

    def _restore_host(self, g: int) -> None:
        rec = self._host[g]
        self.store.master(g).copy_(rec.tensors[0])
        if self.store.sharded:
            # data parallel: this rank's shard of the image from its master shard (the other
            # ranks' shards, which the all-gather wrote, come back with the undo's all-gather)
            self.store.working_from_master_shards(g)
        else:
            self.store.refresh_working(g)  # mixed precision: the 16-bit copy the update wrote too
        if self._on_ssd(g):  # the step counter; the states: the version before this step's write
            self.ssd.steps[g].copy_(rec.tensors[1])
            self.ssd.discard(g)
            return
        if self.optimizer is None:
            return
        if not rec.had_state:
            self.optimizer.state.pop(g, None)  # the group had never been updated
            return
        st = self.optimizer.state[g]
        for dst, src in zip(st.tensors(), rec.tensors[1:]):
            dst.copy_(src)

    def _restore_device(self, g: int, region: Any) -> None:
        rec = self._device[g]
        dev_master = self.device_optimizer.master_of(g) if self.device_optimizer is not None else None
        if dev_master is None:
            self.store.master(g).copy_(rec.master)
        else:  # mixed precision: the device master; the host's was not written this step
            dev_master.copy_(rec.master)
        if rec.where is not None:
            slot, offset = rec.where
            region(slot, offset, rec.params.numel() * rec.params.element_size()).view(rec.params.dtype).copy_(rec.params)
        elif dev_master is not None:  # a transient slot (L2L) whose OP wrote the 16-bit image: put it back
            image = self.store.group_bytes(g)
            image[: rec.params.numel() * rec.params.element_size()].copy_(rec.params.view(torch.uint8))
        st = self.device_optimizer.state.get(g) if self.device_optimizer is not None else None
        if st is None:
            return
        if not rec.had_state:  # never updated before: start from zero states again
            for t in st.tensors():
                t.zero_()
        else:
            for dst, src in zip(st.tensors(), rec.states):
                dst.copy_(src)
        st.restored()

    @property
    def host_bytes(self) -> int:
        """Host bytes of the undo buffers."""
        n = 0
        for rec in self._host.values():
            n += sum(t.numel() * t.element_size() for t in rec.tensors)
        for rec in self._device.values():
            for t in [rec.params, rec.master, *rec.states]:
                if t is not None:
                    n += t.numel() * t.element_size()
        return n
