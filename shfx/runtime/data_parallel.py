"""Data parallel's runtime side: the process groups, the sharding of every group, and the two
collectives of the step program (docs/usage.md, "Data parallel").

Every rank runs the same program on its own device with its own batch. Two gloo process groups
made from the user's group's ranks carry shfx's collectives, one per queue of the program, each
queue a :class:`~shfx.runtime.streams.WorkerStream` running its collectives in program order (so
they match across ranks by construction):

- ``RS g`` (queue ``reduce``, every backward): the group's complete local gradient (the owner's
  copy plus borrowed contributions, summed on the host in the device dtype) is multiplied by
  ``1/N`` (as DDP does while copying a gradient into its bucket, before its SUM all-reduce),
  zero-padded to ``N * chunk`` elements and reduce-scattered (SUM), all in the device dtype
  (bf16 in mixed precision, as DDP on a bf16 model reduces bf16 gradients); this rank's chunk is
  copied (first micro-step) or added (later ones, ``grad_accum_steps``) into its fp32 gradient
  shard. In bf16 the micro-steps' reduced chunks are summed in bf16 (the shard holds the bf16
  running sum, widened), as summing a bf16 model's reduced ``.grad`` does, then used as fp32
  (``master.grad = p16.grad.float()``).
- ``AG g`` (queue ``gather``, after ``U g``): the updated working-copy shards (fp32, or the
  16-bit cast of the fp32 master shard in mixed precision) are all-gathered (padded) into
  every rank's image, so the next prefetch sends the new weights.

An optimizer whose update reads across elements (Adafactor: a matrix's factored second moment is
the mean of its squared gradient over whole rows and columns, which a flat shard cuts) runs
*replicated* instead (``replicated``, from :attr:`shfx.optim.HostOptimizer.data_parallel`):
every rank holds each group whole (master, gradient, states), ``RS g`` all-reduces the local
gradient (``* 1/N``, SUM, as DDP) into the whole gradient, every rank runs the whole group's
update, as every rank of DDP runs its optimizer, and ``AG g`` has nothing to gather (every
rank's image is already the updated one). The program is the same; only what its collectives
move differs.

A group a policy updates on the device (``Resident``, ``L2L``, the first stages of
``Stronghold(resident_first=k)``: ``DU g``) is replicated likewise, whatever the host
optimizer: its ``RS g`` all-reduces (``* 1/N``, SUM) the gradient waiting in its owner's
device gradient buffer (:meth:`all_reduce_device_grads`), every rank runs the same ``DU g``
over it, and nothing is gathered. Under ``grad_accum_steps`` its ``RS g`` runs in every
backward, as a host group's does: the micro-step's gradient all-reduced in the gradient buffer,
then copied (first micro-step) or added into the group's fp32 accumulator on the device
(:meth:`accumulate_device_grads`: in 16 bits the sum in the device dtype, widened), which the
``DU g`` reads, as DDP's recipe sums the reduced micro-step gradients.

A rank that dies makes the others' collectives fail (gloo: connection closed) or time out
(:attr:`shfx.DataParallel.timeout_s`): the step then fails with :class:`RankLost`, saying which
collective, never a hang.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import ShfxError
from shfx.passes.ledger import STAGING_BUFFERS as LOCAL_BUFFERS
from shfx.passes.sharding import shard_chunk, shard_range

__all__ = ["DataParallelRuntime", "RankLost"]


class RankLost(ShfxError, RuntimeError):
    """A collective of data parallel failed: another rank died, failed its step, or stopped
    answering for longer than ``DataParallel(timeout_s=...)``."""


class DataParallelRuntime:
    """The process groups and the sharding of one compiled model under data parallel.

    Attributes:
        group: the user's process group (``torch.distributed``'s default group when None was given).
        rank, ranks: this process's rank in it, and its size N.
        replicated: every rank holds and updates each group whole (the optimizer's
            ``data_parallel == "replicated"``: Adafactor); else each its shard (AdamW, SGD).
        timeout_s: how long a collective waits for the other ranks.
        reduce_group, gather_group: gloo groups over the same ranks, one per queue.
        control_group: a third one, for what every rank decides alike outside the program
            (:meth:`gather_objects`, :meth:`broadcast_object`: the tuner's choice).
        bytes_moved: bytes of this rank's collectives since compile, by kind: ``"reduce"`` (the
            gradients' reduce-scatters, or all-reduces of a replicated optimizer: the local
            buffer given to the collective, ``N * chunk`` elements of the device dtype),
            ``"gather"`` (the weights' all-gathers: the gathered buffer, ``N * chunk``
            elements of the image's dtype), ``"norm"`` (NR0's all-reduces and all-gathers of
            the norms and finite flags), ``"broadcast"`` (rank 0's weights at the first call).
            Each is the collective's buffer, the convention of the program's ``bytes_moved()``
            (which counts the unpadded group); a ring sends ``(N - 1) / N`` of a reduce-scatter's
            or all-gather's buffer from each rank (twice that for an all-reduce) and receives as
            much.
        collective_calls: how many collectives of each kind ran.
    """

    def __init__(self, process_group: Any, timeout_s: float, replicated: bool = False):
        import torch.distributed as dist

        self._dist = dist
        # (torch 2.13 names it all_gather_single and warns on the old name, still there in older ones)
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.ranks = dist.get_world_size(self.group)
        self.timeout_s = float(timeout_s)
        self.replicated = bool(replicated)
        members = dist.get_process_group_ranks(self.group)
        self._src = members[0]  # global rank of the group's rank 0 (the broadcast's source)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        # NOTE: created collectively by the group's ranks only (use_local_synchronization), in the
        # same order on each: every rank compiles the same way
        self.reduce_group = dist.new_group(members, backend="gloo", timeout=timeout, use_local_synchronization=True)
        self.gather_group = dist.new_group(members, backend="gloo", timeout=timeout, use_local_synchronization=True)
        # (the decisions every rank takes alike, from the user's thread: the tuner's choice)
        self.control_group = dist.new_group(members, backend="gloo", timeout=timeout, use_local_synchronization=True)
        self.store: Any = None
        self.optimizer: Any = None
        # the groups the current program updates on the device (replicated: the engine sets it
        # with the program); they have no host states, gradient shard or local-gradient buffer
        self._device_groups: frozenset[int] = frozenset()
        # NOTE: reused, not allocated per step (pinned allocations are slow on CUDA, and the
        # memory ledger counts them as a constant): local-gradient buffers sized for the largest
        # group's padded length, returned after the reduce-scatter (one in flight per group
        # between its owner's OG and its RS: the owner is a group's last contributor, so a few
        # at most), and one scratch per collective queue (each runs its collectives in order)
        self._local_free: list[torch.Tensor] = []
        self._local_base: dict[int, torch.Tensor] = {}  # data_ptr of a handed-out view -> its buffer
        self._local_count = 0  # buffers allocated (at most LOCAL_BUFFERS)
        self._local_cv = threading.Condition()
        self._scratch: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self.buffer_bytes = 0  # host bytes of those buffers (Engine.host_bytes counts them)
        self.bytes_moved = {"reduce": 0, "gather": 0, "norm": 0, "broadcast": 0}
        self.collective_calls = dict.fromkeys(self.bytes_moved, 0)
        self._count_lock = threading.Lock()  # (the queues' threads count; NR0 and RS share the reduce queue)

    # ---- sharding ------------------------------------------------------------------------------
    def shard(self, group: Any, rank: int | None = None) -> tuple[int, int]:
        """``[lo, hi)`` of ``group``'s trainable elements this rank (or rank ``rank``) owns: all
        of them when the optimizer runs replicated."""
        if self.replicated:
            return 0, group.trainable_numel
        return shard_range(group.trainable_numel, self.rank if rank is None else rank, self.ranks)

    def chunk(self, group: Any) -> int:
        return shard_chunk(group.trainable_numel, self.ranks)

    def padded(self, group: Any) -> int:
        """Elements of ``group``'s local gradient buffer: ``N * chunk`` for the reduce-scatter,
        the trainable region itself for a replicated optimizer's all-reduce."""
        return group.trainable_numel if self.replicated else self.ranks * self.chunk(group)

    # ---- collectives ---------------------------------------------------------------------------
    def _run(self, what: str, fn: Callable[[], None]) -> None:
        """Run a collective; its failure (a peer gone, a timeout) becomes :class:`RankLost`."""
        try:
            fn()
        except RankLost:
            raise
        except Exception as e:  # gloo raises RuntimeError (connection closed, timed out)
            raise RankLost(
                f"data parallel lost a rank: {what} failed on rank {self.rank} of {self.ranks} ({type(e).__name__}: "
                f"{str(e).strip()[:300]}). Another rank died, failed its step, or did not reach this collective within "
                f"DataParallel(timeout_s={self.timeout_s:g}); see that rank's error. The step was not completed on this "
                "rank: restart the job from the last checkpoint."
            ) from e

    def _count(self, kind: str, t: torch.Tensor) -> None:
        """Count a collective of ``kind`` over ``t`` (its buffer) in :attr:`bytes_moved`."""
        with self._count_lock:
            self.bytes_moved[kind] += t.numel() * t.element_size()
            self.collective_calls[kind] += 1

    def broadcast(self, buffers: Sequence[torch.Tensor]) -> None:
        """Every rank's host image from rank 0's (parameters, buffers, constants), at the first
        call (as ``DistributedDataParallel``'s constructor broadcasts the module's state)."""
        dist = self._dist

        def run() -> None:
            for b in buffers:
                if b.numel():
                    self._count("broadcast", b)
                    dist.broadcast(b, src=self._src, group=self.gather_group)

        self._run("the broadcast of rank 0's weights at the first call", run)

    def reduce_grads(self, label: str, g: int, local: torch.Tensor | None, first: bool) -> None:
        """``RS g``: reduce-scatter group ``g``'s local gradient ``local`` (the device dtype,
        ``N * chunk`` elements, the trainable ones first; None: this rank has no gradient for
        it, zeros are sent) and copy (``first``) or add this rank's chunk into its fp32
        gradient shard (in mixed precision the addition is in the device dtype: the shard holds
        the 16-bit running sum, widened)."""
        grp = self.store.groups[g]
        chunk, t = self.chunk(grp), grp.trainable_numel
        if local is None:
            local = torch.zeros(self.padded(grp), dtype=grp.dtypes.device_grad)
        else:
            # as DDP: grad * (1 / world_size) into the bucket, then a SUM all-reduce
            local[:t].mul_(1.0 / self.ranks)
            local[t:].zero_()
        grad = self.store.grad(g)
        if self.replicated:
            self._all_reduce_grads(label, local[:t], grad, first)
            return
        lo, hi = self.shard(grp)
        # the first micro-step's chunk lands in the shard itself (a whole chunk: all ranks but
        # the last when T does not divide); later ones are added from a scratch
        direct = first and hi - lo == chunk and grad.dtype == local.dtype
        out = grad if direct else self._buffer("reduce out", chunk, local.dtype)
        self._count("reduce", local)
        try:
            self._run(f"the gradient reduce-scatter {label}", lambda: self._dist.reduce_scatter_tensor(out, local, group=self.reduce_group))
        finally:
            self.release_local(local)
        if direct:
            return
        self._accumulate(out[: hi - lo], grad, first)

    def _all_reduce_grads(self, label: str, local: torch.Tensor, grad: torch.Tensor, first: bool) -> None:
        """``RS g`` of a replicated optimizer: the whole local gradient all-reduced (SUM) in
        place, then copied or added into the whole gradient as :meth:`reduce_grads` does its chunk.

        NOTE: DDP all-reduces its buckets the same way; with 2 ranks ``a/2 + b/2`` is the same
        sum in gloo's all-reduce as in DDP's (another bucket layout changes the order of the
        additions only with more ranks, as for the reduce-scatter)."""
        self._count("reduce", local)
        try:
            self._run(f"the gradient all-reduce {label}", lambda: self._dist.all_reduce(local, group=self.reduce_group))
            self._accumulate(local, grad, first)
        finally:
            self.release_local(local)

    def all_reduce_device_grads(self, label: str, grads: torch.Tensor) -> None:
        """``RS g`` of a group updated on the device (replicated, as DDP replicates every
        parameter): its gradient ``grads`` (in its owner's gradient buffer, the device dtype)
        multiplied by ``1/N`` and SUM-all-reduced in place, as DDP's bucket, so every rank's
        ``DU g`` reads the same gradient. On the emulated device the gradient is a CPU tensor,
        reduced where it is; on a GPU it goes through a host scratch of the reduce queue and
        back (gloo reduces host tensors)."""
        scale = 1.0 / self.ranks
        if grads.device.type == "cpu":
            grads.mul_(scale)
            self._run(f"the device gradient's all-reduce {label}", lambda: self._dist.all_reduce(grads, group=self.reduce_group))
            return
        host = self._buffer("device reduce", grads.numel(), grads.dtype)
        host.copy_(grads)  # (synchronous: the host reads it next)
        host.mul_(scale)
        self._run(f"the device gradient's all-reduce {label}", lambda: self._dist.all_reduce(host, group=self.reduce_group))
        grads.copy_(host)
        if grads.device.type == "cuda":  # (the DU on the compute stream reads it after this task's token)
            torch.cuda.current_stream(grads.device).synchronize()

    def accumulate_device_grads(self, grp: Any, grads: torch.Tensor, acc: torch.Tensor, first: bool) -> None:
        """Under ``grad_accum_steps``: a device group's all-reduced micro-step gradient ``grads``
        (its bytes in its owner's gradient buffer) into its fp32 accumulator ``acc`` on the
        device, part by part, as :meth:`_accumulate` adds a host group's reduced chunk: copied
        at the first micro-step, added at later ones (fp32: an fp32 sum; 16 bits: the sum in
        the device dtype, widened), as DDP's recipe sums the reduced micro-step gradients."""
        for p in grp.parts:
            self._accumulate(grads[p.offset : p.offset + p.nbytes].view(p.dtype), acc[p.elem : p.elem + p.numel], first)
        if acc.device.type == "cuda":  # (the GN/US/DU on the compute stream read it after this task's token)
            torch.cuda.current_stream(acc.device).synchronize()

    @staticmethod
    def _accumulate(mine: torch.Tensor, grad: torch.Tensor, first: bool) -> None:
        """This rank's reduced gradient ``mine`` (the device dtype) into its fp32 ``grad``:
        copied at the first micro-step, added at later ones."""
        if first:
            grad.copy_(mine)  # (16-bit: widened exactly)
        elif mine.dtype == grad.dtype:
            grad.add_(mine)
        else:
            # mixed precision: the sum in the device dtype, as eager sums a bf16 model's reduced
            # gradients (bf16 + bf16: the float sum rounded to bf16; the shard holds a bf16 value,
            # so adding it as fp32 into the bf16 chunk rounds alike), then widened back
            mine.add_(grad)
            grad.copy_(mine)

    def gather_params(self, label: str, g: int) -> None:
        """``AG g``: all-gather the updated working-copy shards of group ``g`` into the image."""
        if self.replicated:
            return  # (every rank ran the whole update: its image is whole already)
        store = self.store
        grp = store.groups[g]
        chunk, t = self.chunk(grp), grp.trainable_numel
        lo, hi = self.shard(grp)
        image = store.image_trainable(g)
        if hi - lo == chunk:  # a whole chunk is sent from the image as it is
            send = image[lo:hi]
        else:  # (the last rank's short one, zero-padded)
            send = self._buffer("gather in", chunk, image.dtype)
            send[: hi - lo] = image[lo:hi]
            send[hi - lo :].zero_()
        out = self._buffer("gather out", self.ranks * chunk, image.dtype)
        self._count("gather", out)
        self._run(f"the weights' all-gather {label}", lambda: self._all_gather(out, send, group=self.gather_group))
        image.copy_(out[:t])

    def whole_master(self, g: int) -> torch.Tensor:
        """Group ``g``'s whole fp32 master (its trainable region), all-gathered from every rank's
        master shard (mixed precision, a group updated on the device: its device master starts
        from it). Collective, on the control group, from the user's thread at a point every rank
        reaches alike (the setup of a training call); the result is a new host tensor."""
        store = self.store
        grp = store.groups[g]
        chunk, t = self.chunk(grp), grp.trainable_numel
        lo, hi = store.shard_of(g)
        send = torch.zeros(chunk, dtype=grp.dtypes.master)
        send[: hi - lo] = store.master(g)
        out = torch.empty(self.ranks * chunk, dtype=grp.dtypes.master)
        self._count("gather", out)
        self._run(f"the fp32 master's all-gather of group {g} (updated on the device)",
                  lambda: self._all_gather(out, send, group=self.control_group))  # fmt: skip
        return out[:t]

    def restore_images(self, groups: Sequence[int]) -> None:
        """An undone step (rollback, agreed by every rank): the image of each of ``groups``
        (whose ``AG`` ran this step, writing every rank's updated shard into it) rebuilt from
        the restored master shards: this rank's shard recast from its master shard, then one
        all-gather per group, in the order given (the same on every rank; collective, from the
        user's thread once the step's actions have all finished). The image was the gathered
        cast of the masters before the step, so it is again, bitwise. (Replicated: nothing was
        gathered, and the rollback restored each group whole.)"""
        if self.replicated:
            return
        for g in groups:
            self.store.working_from_master_shards(g)
            self.gather_params(f"the all-gather of group {g}'s restored weights (the step undone)", g)

    @property
    def device_groups(self) -> frozenset[int]:
        """The groups the current program updates on the device (replicated)."""
        return self._device_groups

    @device_groups.setter
    def device_groups(self, groups: frozenset[int]) -> None:
        """A program with other device groups (``resident_first="auto"``: the tuner's probes
        update every group on the host, its choice keeps the first k on the device): the idle
        local-gradient buffers and scratches, sized for the largest host group, are dropped and
        sized again for the new program's host groups (as the memory ledger counts them)."""
        groups = frozenset(groups)
        if groups == self._device_groups:
            return
        self._device_groups = groups
        with self._local_cv:
            if self._local_base:  # (some handed out: kept, a setup between steps gives them back first)
                return
            self.buffer_bytes -= sum(b.numel() for b in self._local_free)
            self._local_count -= len(self._local_free)
            self._local_free = []
            self.buffer_bytes -= sum(t.numel() * t.element_size() for t in self._scratch.values())
            self._scratch = {}

    def local_grad_buffer(self, g: int) -> torch.Tensor:
        """A host buffer (uint8) for group ``g``'s local gradient, padded to ``N * chunk``
        elements of the device dtype (fp32, or 16-bit in mixed precision) for :meth:`reduce_grads`."""
        store = self.store
        grp = store.groups[g]
        need = self.padded(grp) * grp.dtypes.device_grad.itemsize
        with self._local_cv:
            # NOTE: at most LOCAL_BUFFERS in flight (the memory ledger's 'gradient staging'): an
            # OG waits for an RS to give one back. No deadlock: a group's buffer is taken at its
            # owner's OG, its last gradient contributor, so the RS it waits for (and every RS
            # before it on the reduce queue) waits only for OGs already done; a reduction stuck on
            # a lost rank would never give one back, hence the timeout
            deadline = time.monotonic() + self.timeout_s
            while not self._local_free and self._local_count >= LOCAL_BUFFERS:
                if not self._local_cv.wait(max(0.0, deadline - time.monotonic())):
                    raise RankLost(
                        f"data parallel: no local gradient buffer came back within DataParallel(timeout_s="
                        f"{self.timeout_s:g}) on rank {self.rank} of {self.ranks}: the gradient reductions (RS) are stuck; "
                        "another rank died or failed its step (see its error). Restart the job from the last checkpoint."
                    )
            if self._local_free:
                base = self._local_free.pop()
            else:
                size = max(self.padded(gr) * gr.dtypes.device_grad.itemsize for gr in store.groups if gr.index not in self.device_groups)
                # (pinned like the store on CUDA: the OG's device-to-host copy lands in it)
                base = store.backend.alloc_host(size, store.pin, "staging")
                self._local_count += 1
                self.buffer_bytes += base.numel()
            view = base[:need]
            self._local_base[view.data_ptr()] = base
        return view

    def release_local(self, local: torch.Tensor) -> None:
        """Give back a buffer :meth:`local_grad_buffer` handed out (any view of it starting at
        its first byte); other tensors are ignored."""
        with self._local_cv:
            base = self._local_base.pop(local.data_ptr(), None)
            if base is not None:
                self._local_free.append(base)
                self._local_cv.notify()

    def reclaim(self) -> None:
        """Every handed-out local buffer back (a step was abandoned: its RS never ran)."""
        with self._local_cv:
            self._local_free += self._local_base.values()
            self._local_base.clear()
            self._local_cv.notify_all()

    def _buffer(self, what: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The scratch tensor ``what`` of one collective queue, ``numel`` elements (grown when
        a larger group needs more; each queue runs one collective at a time)."""
        key = (what, dtype)
        t = self._scratch.get(key)
        if t is None or t.numel() < numel:
            if t is not None:
                self.buffer_bytes -= t.numel() * t.element_size()
            t = self._scratch[key] = torch.empty(numel, dtype=dtype)
            self.buffer_bytes += t.numel() * t.element_size()
        return t[:numel]

    # ---- what checkpoints read and write (shfx.dp_checkpoint's protocol) ----------------------
    def refresh_masters(self) -> None:
        """After a load wrote the weights: in fp32 it wrote the model's parameters (the image,
        whole on every rank), and this rank's fp32 master shards are read from them; in mixed
        precision (bf16) it wrote the fp32 master shards (:meth:`master_pieces`) and frozen
        parameters' masters, and the image is recast from them: each rank its shard, then an
        all-gather per group (collective: every rank calls it, between steps). The NVMe tier's
        states a load wrote (:meth:`state_pieces` with ``create``) go to the SSD first."""
        ssd = getattr(self.optimizer, "ssd", None)
        if ssd is not None:
            ssd.flush_loaded()
        store = self.store
        if self.replicated or not any(g.separate_master for g in store.groups):
            store.refresh_working()  # (replicated: the masters are whole, as without data parallel)
            return
        for grp in store.groups:
            store.working_from_master_shards(grp.index)
            if grp.separate_master and grp.trainable_numel:
                self.gather_params(f"the working copy's all-gather of group {grp.index} after a load", grp.index)

    def state_pieces(self, create: bool = False) -> dict[str, dict[str, tuple[tuple[int, ...], int, int, torch.Tensor]]]:
        """Per trainable parameter (its name in the model) that has sharded optimizer state on
        this rank: ``{field: (global shape, lo, hi, view)}`` for each per-element field (AdamW's
        ``exp_avg`` and ``exp_avg_sq``, SGD's ``momentum_buffer``: the runner's
        ``shard_states``), where ``[lo, hi)`` is the range of the parameter's flattened elements
        this rank holds and ``view`` the 1-D view of the host state over it (writing into it
        changes the state). ``step`` stays in ``cm.optimizer.state`` (every rank's is the
        same). Before the first step there is no state; ``create`` makes it (zeros, step 0) for
        a load to fill (:meth:`states_loaded` after it).

        A replicated optimizer (Adafactor) has none: its states are whole on every rank, in
        ``cm.optimizer.state`` as without data parallel (a checkpoint saves them once)."""
        out: dict[str, dict[str, tuple[tuple[int, ...], int, int, torch.Tensor]]] = {}
        opt = self.optimizer
        if opt is None or self.store is None or self.replicated:
            return out
        args: tuple = ()
        if create:
            hp = opt.config.hyperparams()
            first = hp if isinstance(hp, dict) else hp[0]
            args = (bool(first["amsgrad"]),) if "amsgrad" in first else ()
        ssd = getattr(opt, "ssd", None)  # the NVMe tier: its groups' states are read from (and loaded to) the SSD
        for grp in self.store.groups:
            if grp.index in self.device_groups:  # (its states are on the device, whole: cm.optimizer.state)
                continue
            if ssd is not None and grp.index in ssd.groups:
                self._ssd_pieces(ssd, grp, create, out)
                continue
            if create and grp.trainable_numel and grp.index not in opt.state:
                opt.ensure(grp.index, *args)  # zeros, step 0
            if grp.index not in opt.state:
                continue
            lo, hi = self.store.shard_of(grp.index)
            infos = [i for i in grp.infos if i.kind == "param" and i.trainable]
            for info, (o, n) in zip(infos, grp.trainable_spans()):
                a, b = max(o, lo), min(o + n, hi)
                fields = opt.shard_states(grp.index, o) if a < b else {}
                if fields:
                    out[info.key] = {f: (tuple(info.shape), a - o, b - o, buf[a - lo : b - lo]) for f, buf in fields.items()}
        return out

    def _ssd_pieces(self, ssd: Any, grp: Any, create: bool, out: dict) -> None:
        """:meth:`state_pieces` of a group whose states (this rank's shard) are on the SSD:
        views of copies read from it (``create``: copies a load writes into, which
        :meth:`refresh_masters` writes back; zeros at step 0 before the first update)."""
        st = ssd.loadable(grp.index) if create and grp.trainable_numel else ssd.snapshot(grp.index)
        if st is None:
            return
        lo, hi = self.store.shard_of(grp.index)
        infos = [i for i in grp.infos if i.kind == "param" and i.trainable]
        for info, (o, n) in zip(infos, grp.trainable_spans()):
            a, b = max(o, lo), min(o + n, hi)
            fields = self.optimizer.shard_states(grp.index, o, st) if a < b else {}
            if fields:
                out[info.key] = {f: (tuple(info.shape), a - o, b - o, buf[a - lo : b - lo]) for f, buf in fields.items()}

    def states_loaded(self) -> None:
        """After a load wrote into :meth:`state_pieces` (made with ``create``): the runner marks
        its states as past a first step where that changes the update (SGD: a momentum buffer
        that exists is used, as torch's loaded one is)."""
        mark = getattr(self.optimizer, "loaded", None)
        if mark is not None:
            ssd = getattr(self.optimizer, "ssd", None)  # (the NVMe tier: the copies the load wrote into)
            for g in sorted(set(self.optimizer.state) | (set(ssd._loading) if ssd is not None else set())):
                mark(g)

    def master_pieces(self) -> dict[str, tuple[tuple[int, ...], int, int, torch.Tensor]]:
        """Mixed precision (bf16): per trainable parameter whose fp32 master this rank holds a
        range of, ``(global shape, lo, hi, view)`` as in :meth:`state_pieces` (``view``: the 1-D
        view of the master shard over the flattened elements ``[lo, hi)``; writing into it
        changes the master; :meth:`refresh_masters` then recasts the image from it).
        Empty in fp32, where the model's parameters (the image) are the weights, whole on every
        rank."""
        out: dict[str, tuple[tuple[int, ...], int, int, torch.Tensor]] = {}
        store = self.store
        if store is None or not store.sharded:  # (replicated: the model's parameters are the whole masters)
            return out
        for grp in store.groups:
            if not grp.separate_master or not grp.trainable_numel:
                continue
            lo, hi = store.shard_of(grp.index)
            infos = [i for i in grp.infos if i.kind == "param" and i.trainable]
            for info, (o, n) in zip(infos, grp.trainable_spans()):
                a, b = max(o, lo), min(o + n, hi)
                if a < b:
                    out[info.key] = (tuple(info.shape), a - o, b - o, store.master(grp.index)[a - lo : b - lo])
        return out

    # ---- the step gate's reductions (NR0: the norms of clipping, the finite checks; shfx.runtime.clipping)
    def all_reduce_sum(self, t: torch.Tensor, what: str) -> None:
        """SUM all-reduce of ``t`` in place across the ranks, on the reduce queue's group (NR0
        runs on that queue after every RS of the step, in the same order on every rank)."""
        self._count("norm", t)
        self._run(what, lambda: self._dist.all_reduce(t, group=self.reduce_group))

    def all_reduce_max(self, t: torch.Tensor, what: str) -> None:
        """MAX all-reduce of ``t`` in place across the ranks, on the reduce queue's group (NR0's
        finite checks, agreed so that every rank skips or applies the step alike)."""
        self._count("norm", t)
        self._run(what, lambda: self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self.reduce_group))

    def all_gather_flat(self, send: torch.Tensor, what: str) -> torch.Tensor:
        """Every rank's ``send`` (the same length on each), concatenated in rank order."""
        out = torch.empty(self.ranks * send.numel(), dtype=send.dtype)
        self._count("norm", out)
        self._run(what, lambda: self._all_gather(out, send, group=self.reduce_group))
        return out

    # ---- decisions every rank takes alike (window="auto": shfx._tuning) ------------------------
    # NOTE: on the control group, from the user's thread, at points every rank reaches in the
    # same order (a capture's tuning, cm.retune()); never while the queues' collectives run on it
    def gather_objects(self, mine: Any, what: str) -> list[Any]:
        """Every rank's ``mine`` (a picklable object), in rank order, on every rank."""
        out: list[Any] = [None] * self.ranks
        self._run(what, lambda: self._dist.all_gather_object(out, mine, group=self.control_group))
        return out

    def broadcast_object(self, obj: Any, what: str) -> Any:
        """Rank 0's ``obj`` (picklable) on every rank; the other ranks' ``obj`` is ignored."""
        box = [obj if self.rank == 0 else None]
        self._run(what, lambda: self._dist.broadcast_object_list(box, src=self._src, group=self.control_group))
        return box[0]
