"""The NVMe tier's host window: SSD-resident AdamW states, staged through a few host buffers.

With ``shfx.compile(offload=shfx.Offload(optimizer="nvme", ...))`` the AdamW states (``m`` and
``v``) of every host-updated group live in an :class:`shfx.runtime.ssd.SSDStore`, not in host
RAM. :class:`SSDWindow` owns ``host_window`` *staging buffers*, each an ``(m, v)`` pair sized
for the largest group, and moves one group's states through one of them:

* ``SR g`` (:meth:`SSDWindow.read`, on the window's ``ssd_read`` stream): the program's buffer
  (``ActionMeta.buffer``; the verifier's rule 8 guarantees the ``SW`` that last freed it has
  completed) receives the group's ``m`` and ``v`` (``SSDStore.read_into``, asynchronous; the
  action's token completes when both reads did), and the group's optimizer state becomes the
  staging views (:class:`shfx.runtime.host_optim.HostAdamW` ``state[g]``, the same
  per-parameter views and fused kernel as a resident state: the update is bitwise the same);
* ``U g``: the host update, unchanged, on those views;
* ``SW g`` (:meth:`SSDWindow.write`, on the ``ssd_write`` stream): the buffer goes back to the
  SSD (``SSDStore.write_from``) and returns to the pool when the write completed.

Every update is the program's, after its ``SR`` (in ``step()`` with ``overlap_update=False``,
exact clipping's deferred updates, ZeRO-Offload's delayed update and a retried step too: each
feature pass places the transfers again); an update of an SSD group without its read is a
program error (``ScheduleError``), not read inline.

The step counters (one 0-dim fp32 tensor per group) stay in host RAM. The states start as
zeros: :meth:`SSDWindow.__init__` writes zeros into every extent (or the state
``cm.optimizer.load_state_dict`` put in RAM before the first call; ``cm.load_checkpoint``
before the first call leaves the states to that call, which reads them one group at a time
into the SSD: :meth:`load_group`), so every ``SR`` reads what the program says it reads
(the store's byte counters equal ``Program.bytes_moved()`` from the first step). A failed or interrupted step calls :meth:`SSDWindow.reset` once nothing runs: a group
whose read completed is written back as it is in its buffer (updated or not), every buffer is
freed.

**Rollback** (``rollback=True``: fp16 and ``skip_nonfinite`` with the overlapped update, or asked
for; ``versioned=True`` here): the undo data of a group whose states live on the SSD is kept on
the SSD, not in RAM. Each state has two extents (:func:`shfx.runtime.ssd.group_extents`
``versions=2``); a group's ``SW`` writes the version its last committed step did not write, and
the step's end decides: :meth:`SSDWindow.commit` (the step is applied) makes what the step wrote
the group's state, :meth:`SSDWindow.discard` (the step is undone) keeps the one before, and a
failed step's :meth:`SSDWindow.reset` writes nothing back (the committed version is intact on the
SSD). The journal (:mod:`shfx.runtime.journal`) copies only the group's master weights and step
counter (``SN g``), which live in RAM. Cost: twice the SSD space for the states, no extra SSD
traffic and no host buffer (``benchmarks/nvme.py --tier --rollback`` measures it), where copying the
states out would have been a read and a write of 8 bytes per parameter more each step, or host
RAM for all of them, which the tier exists to avoid.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from .ssd import SSDStore, group_extents, wait_all
from .streams import WorkerStream

__all__ = ["SSDWindow"]


class SSDWindow:
    """``groups``' optimizer states on ``ssd`` (an :class:`SSDStore` with the extents
    :meth:`extents` gives them), ``host_window`` of them in host RAM at a time. ``optimizer``:
    the host runner running their updates (:class:`shfx.runtime.host_optim.HostAdamW`,
    ``HostSGD`` or ``HostAdafactor``; its ``ssd`` is set to this window), which says what its
    states are: ``ssd_states(g)``, the ``(name, numel)`` of group ``g``'s flat state buffers
    (AdamW's ``m`` and ``v``, SGD's ``momentum``, Adafactor's ``factors``: its row and column
    factors and full second moments, one flat buffer), ``ssd_steps(g)`` its step counters,
    ``ssd_state(g, buffers, steps)`` the runner's state over given buffers, ``ssd_buffers(state)``
    and ``ssd_load(g, state, entries)``. Each buffer of the window holds one tensor per state
    name, as large as the largest group's."""

    def __init__(
        self, store: Any, optimizer: Any, groups: Sequence[int], host_window: int, ssd: SSDStore, versioned: bool = False,
        image_window: int = 0,
    ):  # fmt: skip
        if host_window < 1:
            raise ValueError(f"host_window must be >= 1, got {host_window}")
        self.store = store
        self.optimizer = optimizer
        self.groups = frozenset(groups)
        self.ssd = ssd
        grps = [store.groups[g] for g in sorted(self.groups)]
        self.versioned = bool(versioned)
        want = SSDWindow.extents(store, sorted(self.groups), versions=2 if self.versioned else 1, optimizer=optimizer)
        have = {k: e.nbytes for k, e in ssd.extents.items()}
        if any(have.get(k) != n for k, n in want.items()):
            raise ValueError(f"the SSD store's extents {have} do not hold the states of groups {sorted(self.groups)} ({want})")
        # each group's flat states (name, numel), and the names in the order the buffers hold them
        self.layout: dict[int, list[tuple[str, int]]] = {g: list(optimizer.ssd_states(g)) for g in sorted(self.groups)}
        self.names: list[str] = []
        for lay in self.layout.values():
            self.names += [name for name, _ in lay if name not in self.names]
        self.numels = {name: max((n for lay in self.layout.values() for k, n in lay if k == name), default=0) for name in self.names}
        # the parameter tier (Offload(params="nvme"): the store's paged groups): the window's
        # buffers also hold such a group's fp32 master (mixed precision: read and written with
        # the states) and its gradient (the OFFLOAD_GRAD lands there; never on the SSD: the
        # update uses it in the same step), and ``image_window`` image buffers hold their images
        self.paged = frozenset(store.paged) & self.groups
        if store.paged - self.groups:
            raise ValueError(f"paged groups {sorted(store.paged - self.groups)} are not among the window's {sorted(self.groups)}")
        self.extra: dict[int, list[tuple[str, int]]] = {
            g: [("master", store.groups[g].trainable_numel)] if store.groups[g].separate_master else [] for g in self.paged
        }
        for lay in self.extra.values():
            for name, n in lay:
                self.numels[name] = max(self.numels.get(name, 0), n)
        self.grad_numel = max((store.groups[g].trainable_numel for g in self.paged), default=0)
        self.images: list[torch.Tensor] | None = [] if self.paged else None
        self._image_holder: list[int | None] = []
        self.image_at: dict[int, int] = {}  # paged group -> its image buffer
        self._image_dirty: set[int] = set()  # groups whose image an update changed since its read
        self.dtype = grps[0].dtypes.state if grps else torch.float32
        self.steps = {g: optimizer.ssd_steps(g) for g in sorted(self.groups)}
        self._cond = threading.Condition()
        self.buffers: list[dict[str, torch.Tensor]] = []
        self._holder: list[int | None] = []  # buffer -> the group in it
        self._read_ok: list[bool] = []
        self.where: dict[int, int] = {}  # group -> its buffer
        self._views: dict[tuple[int, int], Any] = {}  # (group, buffer) -> the optimizer state over it
        self._snap: tuple[int, Any] | None = None  # the last group read for state_dict()
        self._placeholders: dict[int, list[torch.Tensor]] | None = None  # (within placeholders())
        # (versioned) the extents' version holding each group's committed state, and the one a
        # write of the step in progress went to (committed or discarded at the step's end)
        self._current: dict[int, int] = {g: 0 for g in self.groups}
        self._pending: dict[int, int] = {}
        # (data parallel's checkpoint load) states handed out to be written into, by group:
        # flush_loaded() writes them to the SSD
        self._loading: dict[int, Any] = {}
        self.ensure(host_window)
        self.ensure_images(image_window)
        self.read_stream = WorkerStream("ssd_read")
        self.write_stream = WorkerStream("ssd_write")
        optimizer.ssd = self
        self._write_initial()

    @staticmethod
    def extents(store: Any, groups: Sequence[int], versions: int = 1, optimizer: Any = None) -> dict:
        """The SSD extents the window needs for ``groups`` of the host ``store``: one per state
        of ``optimizer`` (its ``ssd_states``; None: AdamW's ``m`` and ``v``), each as large as
        the elements the store holds of the group (data parallel: this rank's shard,
        :meth:`shfx.runtime.host_store.HostStore.shard_of`, for a sharded optimizer; each rank
        its own file)."""
        grps = [store.groups[g] for g in groups]

        def states(grp: Any) -> list[tuple[str, int]]:
            if optimizer is not None:
                return [(name, n * grp.dtypes.state.itemsize) for name, n in optimizer.ssd_states(grp.index)]
            lo, hi = store.shard_of(grp.index)
            return [(name, (hi - lo) * grp.dtypes.state.itemsize) for name in ("m", "v")]

        return group_extents(grps, states=states, versions=versions)

    def _numel(self, g: int) -> int:
        """Elements of group ``g``'s trainable region here (or this rank's shard)."""
        lo, hi = self.store.shard_of(g)
        return hi - lo

    def step_count(self, g: int) -> int:
        """Group ``g``'s step (its first counter: they move together)."""
        t = self.steps[g]
        return int(t.reshape(-1)[0].item()) if t.numel() else 0

    def loading(self, g: int) -> Any:
        """The copies of group ``g``'s state a load is writing into (:meth:`loadable`), or None."""
        return self._loading.get(g)

    # ---- buffers -------------------------------------------------------------------------------
    def ensure(self, host_window: int) -> None:
        """At least ``host_window`` staging buffers (a program with a larger window)."""
        with self._cond:
            while len(self.buffers) < host_window:
                buf = {name: torch.zeros(n, dtype=self.dtype) for name, n in self.numels.items()}
                if self.grad_numel:
                    grp = self.store.groups[min(self.paged)]
                    nbytes = self.grad_numel * grp.dtypes.grad.itemsize
                    buf["grad"] = self.store.backend.alloc_host(nbytes, self.store.pin, "gradient window").view(grp.dtypes.grad)
                self.buffers.append(buf)
                self._holder.append(None)
                self._read_ok.append(False)
            self._cond.notify_all()

    @property
    def host_window(self) -> int:
        return len(self.buffers)

    @property
    def host_bytes(self) -> int:
        """Host bytes of the staging buffers (and the step counters; the parameter tier's image
        buffers)."""
        bufs = sum(t.numel() * t.element_size() for b in self.buffers for t in b.values())
        bufs += sum(t.numel() for t in self.images or ())
        return bufs + sum(t.numel() * t.element_size() for t in self.steps.values())

    def _claim(self, g: int, b: int | None) -> int:
        """Put group ``g`` in buffer ``b`` (the program's), or the first free one (waiting)."""
        with self._cond:
            if g in self.where:
                raise RuntimeError(f"group {g}'s optimizer state is already in host-window buffer {self.where[g]}")
            if b is None:
                while None not in self._holder:
                    self._cond.wait()
                b = self._holder.index(None)
            elif not 0 <= b < len(self.buffers):
                raise RuntimeError(f"host-window buffer {b} does not exist: the window has {len(self.buffers)} buffers")
            elif self._holder[b] is not None:
                raise RuntimeError(
                    f"host-window buffer {b} still holds group {self._holder[b]}'s state when group {g}'s read needs it "
                    "(the program must write that group back first)"
                )
            self._holder[b] = g
            self._read_ok[b] = False
            self.where[g] = b
            return b

    def _free(self, g: int, keep_grad: bool = False) -> None:
        if g in self.paged:
            self.store.unpage_state(g, keep_grad)
        with self._cond:
            b = self.where.pop(g)
            self._holder[b] = None
            self._read_ok[b] = False
            self.optimizer.state.pop(g, None)
            self._cond.notify_all()

    def ensure_images(self, image_window: int) -> None:
        """At least ``image_window`` image buffers (the parameter tier), each as large as the
        largest paged group's image (pinned from the backend's pool: a PREFETCH copies from it)."""
        if not self.paged:
            return
        nbytes = max(self.store.groups[g].nbytes for g in self.paged)
        with self._cond:
            while len(self.images) < image_window:
                self.images.append(self.store.backend.alloc_host(nbytes, self.store.pin, "image window"))
                self._image_holder.append(None)

    def _io(self, direction: str, g: int, bufs: Sequence[torch.Tensor], version: int = 0, extra: bool = False) -> None:
        """Read (``"read"``) or write group ``g``'s state extents (of ``version``) into / from
        ``bufs`` (in the order of its ``ssd_states``); returns when every request ended,
        raising the first one's error (never leaving one in flight, which would block the next
        request on its key)."""
        io = self.ssd.read_into if direction == "read" else self.ssd.write_from
        names = [name for name, _ in self.layout[g] + (self.extra.get(g, []) if extra else [])]
        keys = [(name, g) if version == 0 else (name, g, version) for name in names]
        errors = []
        reqs = []
        for key, buf in zip(keys, bufs):
            try:
                reqs.append(io(key, buf))
            except BaseException as e:  # noqa: BLE001 - the others still end before raising
                errors.append(e)
        wait_all(reqs, errors)

    def _views_of(self, g: int, b: int) -> list[torch.Tensor]:
        buf = self.buffers[b]
        return [buf[name][:n] for name, n in self.layout[g]]

    def _stage(self, g: int, b: int) -> None:
        """Group ``g``'s optimizer state becomes the views of buffer ``b`` (built once per pair)."""
        st = self._views.get((g, b))
        if st is None:
            st = self._views[(g, b)] = self.optimizer.ssd_state(g, self._views_of(g, b), self.steps[g])
        with self.optimizer._lock:
            self.optimizer.state[g] = st

    def _zeros(self, g: int) -> list[torch.Tensor]:
        return [torch.zeros(n, dtype=self.dtype) for _, n in self.layout[g]]

    # ---- the actions ---------------------------------------------------------------------------
    def read(self, g: int, buffer: int | None = None) -> None:
        """SR g: read ``g``'s states into a host-window buffer and stage them; returns when
        every read completed (raises the store's :class:`shfx.errors.SSDIOError`)."""
        self._loading.pop(g, None)  # (a load's copies not flushed: nothing was written into them)
        b = self._claim(g, buffer)
        paged = g in self.paged  # (the parameter tier: the master too; the update stages the state)
        self._io("read", g, self._views_of(g, b) + self._extra_views(g, b), version=self.latest(g), extra=paged)
        self._read_ok[b] = True
        self._snap = None
        if paged:
            grp = self.store.groups[g]
            master = self.buffers[b]["master"][: grp.trainable_numel] if self.extra[g] else None
            valid = self._accumulated(g, b)  # (gradient accumulation: the earlier micro-steps' sum, the OG adds to it)
            self.store.page_state(g, master, self._grad_view(g, b), valid)
        else:
            self._stage(g, b)

    def write(self, g: int) -> None:
        """SW g: write ``g``'s staged states back; the buffer is free when every write
        completed (a failed write keeps it: :meth:`reset` retries)."""
        b = self.where.get(g)
        if b is None:
            raise RuntimeError(f"group {g}'s optimizer state is not in a host-window buffer: SW{g} has nothing to write")
        if self.versioned:  # the version the last committed step did not write (kept until commit)
            version = 1 - self._current[g]
            self._io("write", g, self._views_of(g, b), version=version)
            with self._cond:
                self._pending[g] = version
        else:
            self._io("write", g, self._views_of(g, b) + self._extra_views(g, b), extra=g in self.paged)
        self._snap = None
        self._free(g)  # (a paged group's master and gradient leave the store with it)

    def release(self, g: int) -> None:
        """Free group ``g``'s host-window buffer without writing it back (a backward that ran no
        update: the profiler's timing steps; nothing in it changed)."""
        if g not in self.where:
            raise RuntimeError(f"group {g}'s optimizer state is not in a host-window buffer: nothing to release")
        self._snap = None
        self._free(g)

    # ---- the parameter tier's gradients between micro-steps (grad_accum_steps > 1) -------------------
    def accumulates(self, g: int) -> bool:
        """Whether paged group ``g``'s gradient has an SSD extent (gradient accumulation)."""
        return ("grad", g) in self.ssd.extents

    def _grad_view(self, g: int, b: int) -> torch.Tensor:
        """Paged group ``g``'s gradient in host-window buffer ``b``."""
        return self.buffers[b]["grad"][: self.store.groups[g].trainable_numel]

    def _accumulated(self, g: int, b: int) -> bool:
        """The gradient accumulated so far into buffer ``b``'s gradient (when there is one)."""
        from .host_store import GRAD_VALID

        if not (self.accumulates(g) and self.store.grad_state[g] == GRAD_VALID):
            return False
        self.ssd.read_into(("grad", g), self._grad_view(g, b)).wait()
        return True

    def stage_gradient(self, g: int, buffer: int | None, accumulated: bool) -> None:
        """``SR g`` of a backward that runs no update of paged group ``g`` (a micro-step before
        the last, the profiler's timing steps): a host-window buffer for its gradient (its ``OG``
        lands there), holding the gradient accumulated so far (read from the SSD) when
        ``accumulated``; master and states are not read."""
        b = self._claim(g, buffer)
        try:
            valid = accumulated and self._accumulated(g, b)
        except BaseException:
            self._free(g, keep_grad=True)  # (the sum so far stays on the SSD)
            raise
        self._snap = None
        self.store.page_state(g, None, self._grad_view(g, b), valid)

    def write_gradient(self, g: int) -> None:
        """``SW g`` of a micro-step before the last: paged group ``g``'s gradient, accumulated so
        far, to its SSD extent; the buffer is free when the write completed."""
        b = self.where.get(g)
        if b is None:
            raise RuntimeError(f"group {g}'s gradient is not in a host-window buffer: SW{g} has nothing to write")
        self.ssd.write_from(("grad", g), self._grad_view(g, b)).wait()
        self._free(g, keep_grad=True)

    def _extra_views(self, g: int, b: int) -> list[torch.Tensor]:
        buf = self.buffers[b]
        return [buf[name][:n] for name, n in self.extra.get(g, ())]

    def _state_copy(self, g: int, bufs: Sequence[torch.Tensor], steps: torch.Tensor) -> Any:
        """The runner's state of group ``g`` over copies of its states (state_dict, loads): for a
        paged group without the views an update needs (its master and gradient are not on the host)."""
        return self.optimizer.ssd_state(g, bufs, steps, bare=g in self.paged)

    def stage_paged(self, g: int) -> None:
        """The update of paged group ``g`` is about to run: its state over the window's views,
        built now (its master, gradient and image are in buffers that change from step to step)."""
        b = self.where.get(g)
        if b is None:
            raise RuntimeError(f"group {g} is not in a host-window buffer: its update has no SR{g} before it")
        st = self.optimizer.ssd_state(g, self._views_of(g, b), self.steps[g])
        with self.optimizer._lock:
            self.optimizer.state[g] = st
        self._image_dirty.add(g)

    # ---- the parameter tier's images (PR, PD, PW) -------------------------------------------------
    def read_image(self, g: int, buffer: int) -> None:
        """PR g: paged group ``g``'s image from the SSD into image buffer ``buffer`` (the program's)."""
        with self._cond:
            if g in self.image_at:
                raise RuntimeError(f"group {g}'s image is already in image buffer {self.image_at[g]}")
            if not 0 <= buffer < len(self.images):
                raise RuntimeError(f"image buffer {buffer} does not exist: the window has {len(self.images)}")
            if self._image_holder[buffer] is not None:
                raise RuntimeError(
                    f"image buffer {buffer} still holds group {self._image_holder[buffer]}'s image when group {g}'s read needs it"
                )
            self._image_holder[buffer] = g
            self.image_at[g] = buffer
        view = self.images[buffer][: self.store.groups[g].nbytes]
        try:
            self.ssd.read_into(("image", g), view).wait()
        except BaseException:
            self._free_image(g)
            raise
        self._image_dirty.discard(g)
        self.store.page_in(g, view)

    def drop_image(self, g: int) -> None:
        """PD g: the image buffer is free (nothing changed the image since its read)."""
        if g in self._image_dirty:
            raise RuntimeError(f"PD{g}: group {g}'s image was updated since its read; it must be written back (PW{g})")
        self._free_image(g)

    def write_image(self, g: int) -> None:
        """PW g: the updated image back to the SSD, then its buffer is free."""
        b = self.image_at.get(g)
        if b is None:
            raise RuntimeError(f"group {g}'s image is not in an image buffer: PW{g} has nothing to write")
        self.ssd.write_from(("image", g), self.images[b][: self.store.groups[g].nbytes]).wait()
        self._image_dirty.discard(g)
        self._free_image(g)

    def _free_image(self, g: int) -> None:
        self.store.page_out(g)
        with self._cond:
            b = self.image_at.pop(g, None)
            if b is not None:
                self._image_holder[b] = None

    # ---- the parameter tier's values (state_dict, load_state_dict, checkpoints) -------------------
    def _paged_copies(self, g: int, meta: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Paged group ``g``'s image and trainable master as uint8 copies (read from the SSD, or
        from its window buffers while a step holds them); ``meta``: meta tensors of their sizes
        (nothing read)."""
        grp = self.store.groups[g]
        if meta:
            master = torch.empty(grp.master_bytes, dtype=torch.uint8, device="meta") if self.extra.get(g) else None
            return torch.empty(grp.nbytes, dtype=torch.uint8, device="meta"), master
        if g in self.image_at:
            image = self.images[self.image_at[g]][: grp.nbytes].clone()
        else:
            image = torch.empty(grp.nbytes, dtype=torch.uint8)
            self.ssd.read_into(("image", g), image).wait()
        master = None
        if self.extra.get(g):
            if g in self.where:
                master = self.buffers[self.where[g]]["master"][: grp.trainable_numel].clone().view(torch.uint8)
            else:
                master = torch.empty(grp.master_bytes, dtype=torch.uint8)
                self.ssd.read_into(("master", g), master).wait()
        return image, master

    def _paged_values(self, g: int, keys: Sequence[str], image: torch.Tensor, master: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Views of paged group ``g``'s ``keys`` over its copies ``image`` and ``master``: a
        trainable parameter's fp32 master (mixed precision), else its image."""
        from .host_store import _host_info, typed_view

        grp = self.store.groups[g]
        out: dict[str, torch.Tensor] = {}
        for k in keys:
            info = grp.info(k)
            if master is not None and k in grp.master_offsets and grp.master_offsets[k] < grp.master_bytes:
                out[k] = typed_view(master, grp.master_offsets[k], _host_info(info))
            else:
                out[k] = typed_view(image, grp.offsets[k], info)
        return out

    def read_paged(self, keys: Sequence[str], meta: bool = False) -> dict[str, torch.Tensor]:
        """The values of the paged groups' ``keys`` (parameters, buffers), read one group at a
        time: a trainable parameter's fp32 master (mixed precision), else its image; each its
        own tensor. ``meta``: meta tensors of those shapes and dtypes (nothing read)."""
        by_group: dict[int, list[str]] = {}
        for k in keys:
            by_group.setdefault(self.store.paged_keys[k], []).append(k)
        out: dict[str, torch.Tensor] = {}
        for g, ks in sorted(by_group.items()):
            values = self._paged_values(g, ks, *self._paged_copies(g, meta))
            out.update(values if meta else {k: v.clone() for k, v in values.items()})
        return out

    def paged_group(self, g: int) -> dict[str, torch.Tensor]:
        """Every value of paged group ``g`` (as :meth:`read_paged`), as views of one copy of the
        group read from the SSD (a streaming checkpoint save holds one group at a time)."""
        keys = [k for k, i in self.store.paged_keys.items() if i == g]
        return self._paged_values(g, keys, *self._paged_copies(g))

    def write_paged(self, values: dict[str, torch.Tensor]) -> None:
        """Set paged tensors' values (``{key: tensor}``) on the SSD, one group at a time: the
        image (and, in mixed precision, the fp32 master, the image's working copy cast from it
        as ``p16.copy_(master)``). Between steps."""

        def fill(views: dict[str, torch.Tensor]) -> None:
            for k, view in views.items():
                view.copy_(values[k].detach().reshape(view.shape))

        self.load_paged(values, fill)

    def load_paged(self, keys: Iterable[str], fill: Callable[[dict[str, torch.Tensor]], None]) -> None:
        """Set paged tensors' values on the SSD one group at a time, as a reader gives them:
        for each group, its image (and master) is read into the window's buffers, free between
        steps, ``fill({key: view})`` writes the values of the group's ``keys`` into their views
        (a trainable parameter's fp32 master in mixed precision, else its image: a checkpoint
        reads them there, nothing else is allocated), the image's working copy of each loaded
        master is cast from it (``p16.copy_(master)``), and both are written back. The group's
        other tensors keep their values. Between steps."""
        from .host_store import _host_info, typed_view

        if self.image_at or self.where:
            raise RuntimeError("a step holds paged groups in the host windows: load between steps")
        by_group: dict[int, list[str]] = {}
        for k in keys:
            by_group.setdefault(self.store.paged_keys[k], []).append(k)
        for g, ks in sorted(by_group.items()):
            grp = self.store.groups[g]
            image, master = self._load_buffers(g)
            views = {}
            cast = []
            for k in ks:
                info = grp.info(k)
                view = typed_view(image, grp.offsets[k], info)
                if master is not None and k in grp.master_offsets and grp.master_offsets[k] < grp.master_bytes:
                    views[k] = typed_view(master, grp.master_offsets[k], _host_info(info))
                    cast.append((view, views[k]))
                else:
                    views[k] = view
            with torch.no_grad():
                fill(views)
                for view, mview in cast:
                    view.copy_(mview)
            reqs = [self.ssd.write_from(("image", g), image)]
            if master is not None:
                reqs.append(self.ssd.write_from(("master", g), master))
            wait_all(reqs)

    def _load_buffers(self, g: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Paged group ``g``'s image and master (uint8) read from the SSD into the first image
        buffer and the first host-window buffer's master (free between steps: a load allocates
        nothing for them); fresh copies where the window has no such buffer."""
        grp = self.store.groups[g]
        if not self.images or (self.extra.get(g) and not self.buffers):
            return self._paged_copies(g)
        image = self.images[0][: grp.nbytes]
        reqs = [self.ssd.read_into(("image", g), image)]
        master = None
        if self.extra.get(g):
            master = self.buffers[0]["master"][: grp.trainable_numel].view(torch.uint8)
            reqs.append(self.ssd.read_into(("master", g), master))
        wait_all(reqs)
        return image, master

    def reset_images(self) -> None:
        """After a failed or abandoned step, or a forward-only call (nothing running): an image an
        update changed is written back, every image buffer is freed."""
        _write_back_or_free(list(self.image_at), lambda g: g in self._image_dirty, self.write_image, self._free_image)

    def is_staged(self, g: int) -> bool:
        return g in self.where

    def latest(self, g: int) -> int:
        """The version of group ``g``'s extents holding its latest state: what this step wrote
        (not committed yet), else the committed one (0 without versions)."""
        with self._cond:
            return self._pending.get(g, self._current[g])

    def commit(self) -> None:
        """The step is applied: every group's write of this step becomes its state (versioned)."""
        with self._cond:
            self._current.update(self._pending)
            self._pending.clear()
        self._snap = None

    def discard(self, g: int) -> None:
        """Group ``g``'s update is undone: its write of this step (if any) is dropped, the
        version before stays its state (versioned; without versions there is nothing to drop)."""
        with self._cond:
            self._pending.pop(g, None)
        self._snap = None

    def reset(self) -> None:
        """After a failed or abandoned step (nothing running): write back every group whose
        read completed (versioned: none, the committed version is on the SSD and the step is
        undone), free every buffer."""
        if self.versioned:
            for g in list(self.where):
                self._free(g)
            return
        _write_back_or_free(list(self.where), lambda g: self._read_ok[self.where[g]], self.write, self._free)

    # ---- reading and loading the states (state_dict, checkpoints) --------------------------------
    def snapshot(self, g: int) -> Any:
        """Group ``g``'s state as copies read from the SSD (the runner's state object over
        them; None before its first update); the last group read is kept, so a state_dict
        reading a group's parameters one after the other reads the group once. A group handed
        out by :meth:`loadable` is that copy."""
        if g in self._loading:
            return self._loading[g]
        if self.step_count(g) == 0:
            return None
        if g in self.where:  # staged (inside a step): its live views
            st = self.optimizer.state.get(g)
            if st is not None:
                return st
        if self._placeholders is not None:
            bufs = self._placeholders.setdefault(g, [torch.empty(n, dtype=self.dtype, device="meta") for _, n in self.layout[g]])
            return self._state_copy(g, bufs, self.steps[g])
        if self._snap is not None and self._snap[0] == g:
            return self._snap[1]
        snap = self._state_copy(g, self.read_state(g), self.steps[g].clone())
        self._snap = (g, snap)
        return snap

    def read_state(self, g: int) -> list[torch.Tensor]:
        """Copies of group ``g``'s flat state buffers (its ``ssd_states``' order), read from the
        SSD (its latest version); not kept (:meth:`snapshot` keeps the last group it read)."""
        bufs = [torch.empty(n, dtype=self.dtype) for _, n in self.layout[g]]
        self._io("read", g, bufs, version=self.latest(g))
        return bufs

    @contextlib.contextmanager
    def placeholders(self) -> Iterator[dict[int, list[torch.Tensor]]]:
        """Within: :meth:`snapshot` gives a group's state over meta tensors (the shapes and
        dtypes of its states, its live step counters; nothing read), so ``cm.optimizer.state``
        describes what a checkpoint holds without reading it. Yields ``{group: its meta flat
        buffers}`` (:meth:`read_state`'s order), filled as groups are described: a streaming save
        maps each placeholder back to its buffer and reads it one group at a time. Between steps."""
        if self.where:
            raise RuntimeError("a step holds groups in the host windows: describe the states between steps")
        self._placeholders = {}
        try:
            yield self._placeholders
        finally:
            self._placeholders = None

    def loadable(self, g: int) -> Any:
        """Group ``g``'s state as copies to be written into (data parallel's checkpoint load:
        :meth:`shfx.runtime.data_parallel.DataParallelRuntime.state_pieces` with ``create``), its
        current values or zeros at step 0; :meth:`flush_loaded` then writes them to the SSD (its
        step too: ``cm.optimizer.state``'s ``step`` of the group is this copy's until then)."""
        if g in self.where:
            raise RuntimeError(f"group {g}'s optimizer state is in a host-window buffer (a step is running): load it between steps")
        snap = self._loading.get(g)
        if snap is None:
            cur = self.snapshot(g)
            if cur is None:
                bufs, steps = self._zeros(g), self.optimizer.ssd_steps(g)
            else:  # (copies: a snapshot's own, or cloned from the live views)
                bufs, steps = self.optimizer.ssd_buffers(cur)
                bufs, steps = [t.clone() for t in bufs], steps.clone()
            snap = self._loading[g] = self._state_copy(g, bufs, steps)
        return snap

    def flush_loaded(self) -> None:
        """Write what a load wrote into :meth:`loadable`'s copies to the SSD (the committed
        version) and the step counters (between steps)."""
        for g, snap in sorted(self._loading.items()):
            with self._cond:
                self._pending.pop(g, None)
                version = self._current[g]
            bufs, steps = self.optimizer.ssd_buffers(snap)
            self._io("write", g, bufs, version=version)
            self.steps[g].copy_(steps)
        self._loading.clear()
        self._snap = None

    def load_group(self, g: int, entries: list) -> None:
        """Set group ``g``'s state from torch-format entries ``[((g, off, n, shape), state)]``
        (empty: fresh, zeros and step 0), written to the SSD through one group-sized buffer
        (the runner's ``ssd_load`` fills it): the first host-window buffer between steps."""
        if g in self.where:
            raise RuntimeError(f"group {g}'s optimizer state is in a host-window buffer (a step is running): load it between steps")
        if self.where or not self.buffers:
            bufs = self._zeros(g)
        else:  # (between steps the window's buffers are free: the first one's views, zeroed, no allocation)
            bufs = [t.zero_() for t in self._views_of(g, 0)]
        steps = self.optimizer.ssd_steps(g)
        if entries:
            self.optimizer.ssd_load(g, self._state_copy(g, bufs, steps), entries)
        with self._cond:
            self._pending.pop(g, None)  # (between steps: nothing pending; a load replaces the state)
            version = self._current[g]
        self._io("write", g, bufs, version=version)
        self.steps[g].copy_(steps)
        self._snap = None

    def _write_initial(self) -> None:
        """Every extent starts as the group's state: zeros (fresh states), or the state the
        optimizer already holds in RAM (``cm.optimizer.load_state_dict`` before the first call;
        data parallel's checkpoint load before it), which then leaves RAM."""
        for g in sorted(self.groups):
            with self.optimizer._lock:
                st = self.optimizer.state.pop(g, None)
            if st is None:
                bufs = self._zeros(g)
            else:
                bufs, steps = self.optimizer.ssd_buffers(st)  # (amsgrad: refused there)
                self.steps[g].copy_(steps)
            self._io("write", g, bufs)

    def close(self) -> None:
        """Stop the streams and delete the store's file (the SSD is scratch for one run)."""
        try:
            self.read_stream.close()
            self.write_stream.close()
        finally:
            self.ssd.close()  # (the optimizer keeps pointing here: reading a state now says the store is closed)


def _write_back_or_free(groups: Sequence[int], changed: Any, write: Any, free: Any) -> None:
    """After a failed step: each of ``groups`` that ``changed`` says holds what the SSD must get
    is written back (``write``, which frees it), the others freed (``free``); every group is
    handled before the first error is raised."""
    errors = []
    for g in groups:
        if changed(g):
            try:
                write(g)
                continue
            except BaseException as e:  # noqa: BLE001 - the others still go back before raising
                errors.append(e)
        free(g)
    if errors:
        raise errors[0]
