"""The state methods of :class:`shfx.api.CompiledModel`: the model's state dict, checkpoints
(saved and loaded by :mod:`shfx.checkpoint`), and ``sync()``, with ``_settle()``, the wait for
the updates a step left running that each of them (and ``report()``, ``retune()``) starts with."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .errors import UsageError

if TYPE_CHECKING:
    import torch.nn as nn

    from .runtime.data_parallel import DataParallelRuntime
    from .runtime.engine import Engine
    from .runtime.host_store import HostStore

__all__ = ["StateMethods"]


class StateMethods:
    """Mixed into :class:`shfx.api.CompiledModel`. What it needs from the compiled model:
    ``module`` (the model), ``_engine`` and ``_store`` (None before the first call), ``_dp``
    (data parallel's runtime, or None) and ``_checkpoint_save`` (the asynchronous save in
    flight, or None), which it sets."""

    module: nn.Module
    _engine: Engine | None
    _store: HostStore | None
    _dp: DataParallelRuntime | None
    _checkpoint_save: Any

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The model's state dict (its own names); the weights are the current host master
        (weights a policy updates on the device are copied back first)."""
        self._settle()
        if self._engine is not None:
            self._engine.sync_to_host()
        return self.module.state_dict(*args, **kwargs)  # (the parameter tier: its hook reads the SSD)

    def _paged_values_hook(self, module: Any, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        """The model's state_dict hook with the parameter tier (``Offload(params="nvme")``): the
        model's own tensors of paged groups are placeholders; their values are read from the SSD
        (one group at a time)."""
        store = self._store
        if store is None or not store.paged_keys or self._engine is None or self._engine.ssd is None:
            return
        keys = [k for k in state_dict if k.startswith(prefix) and k[len(prefix) :] in store.paged_keys]
        mode = getattr(self, "_paged_as", None)
        if keys:  # (mode "meta": what a read would give, as meta tensors: a streaming save's or load's placeholders)
            values = self._engine.ssd.read_paged([k[len(prefix) :] for k in keys], meta=mode == "meta")
            for k in keys:
                state_dict[k] = values[k[len(prefix) :]]

    def _load_targets(self) -> dict[str, Any]:
        """The model's state dict as a checkpoint load checks it: the tensors of the host store
        (the load writes into them in place; before the first call the model's own), and with
        the parameter tier the paged tensors as meta tensors of their shapes and dtypes (nothing
        read or allocated: ``shfx.checkpoint`` reads them one group at a time into the SSD
        window, ``SSDWindow.load_paged``)."""
        return self._state_dict_as("meta")

    def _state_dict_for_save(self) -> dict[str, Any]:
        """The model's state dict as a streaming checkpoint save describes it (after
        :meth:`state_dict`'s settling): with the parameter tier the paged tensors are meta
        tensors of the shapes and dtypes :meth:`state_dict` would read (``shfx.checkpoint``
        reads them one group at a time, ``SSDWindow.paged_group``); the others are the live
        tensors of the host store."""
        self._settle()
        if self._engine is not None:
            self._engine.sync_to_host()
        return self._state_dict_as("meta")

    def _state_dict_as(self, mode: str) -> dict[str, Any]:
        self._paged_as = mode
        try:
            return self.module.state_dict()
        finally:
            self._paged_as = None

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True):
        """Load weights into the host store (through the model's own tensors; with the parameter
        tier, the paged groups' values are written to the SSD one group at a time)."""
        self._settle()
        paged = self._store.paged_keys if self._store is not None else {}
        if paged:
            from torch.nn.modules.module import _IncompatibleKeys

            on_ssd = {k: v for k, v in state_dict.items() if k in paged}
            rest = {k: v for k, v in state_dict.items() if k not in paged}
            result = self.module.load_state_dict(rest, strict=False)
            missing = [k for k in result.missing_keys if k not in on_ssd]
            if strict and (missing or result.unexpected_keys):
                raise RuntimeError(
                    f"Error(s) in loading state_dict for {type(self.module).__name__}: missing keys {missing}, "
                    f"unexpected keys {result.unexpected_keys}"
                )
            self._engine.ssd.write_paged(on_ssd)
            self._engine.invalidate_device_weights()
            return _IncompatibleKeys(missing, result.unexpected_keys)
        result = self.module.load_state_dict(state_dict, strict=strict)
        if self._engine is not None:
            self._engine.invalidate_device_weights()
            if self._dp is not None:  # the model's weights are the image: the master shards from it
                self._store.refresh_working()
                # (bf16: the model's trainable parameters are the 16-bit image; the fp32 values
                # given set the master shards exactly)
                # (a replicated optimizer's store holds the whole masters: refresh_working recast the image)
                if self._store.sharded:
                    self._store.set_master_shards({k: v for k, v in state_dict.items() if torch.is_tensor(v)})
        return result

    def save_checkpoint(self, path: str, extra: Any = None, async_save: bool = False, *, scheduler: Any = None) -> None:
        """Save the whole training state to the directory ``path``, atomically (a save that fails
        or is killed half way leaves the previous checkpoint at ``path`` as it was).

        Saved: the weights (fp32 masters, under the model's ``state_dict`` names), the
        optimizer's state per parameter name (torch's fields: AdamW's step, exp_avg, exp_avg_sq;
        SGD's momentum_buffer; Adafactor's) and each parameter group's hyperparameters, the step
        count, ``scheduler``'s state (anything with ``state_dict``/``load_state_dict``), the fp16
        loss scaler, the RNG states (torch CPU, CUDA, Python ``random``) and ``extra`` (plain
        data: the data position, ...), as a ``torch.distributed.checkpoint`` directory that
        :meth:`load_checkpoint`, ``shfx.checkpoint.load_into`` (eager PyTorch) and
        ``torch.distributed.checkpoint.load`` read. Call it between steps (after ``cm.step()``).

        ``async_save=True`` copies the state into host staging buffers (the weights and two
        AdamW states: 12 bytes per fp32 parameter, kept for the next asynchronous save) and
        writes it in a background thread while training goes on; :meth:`wait_checkpoint`, the
        next save or load and :meth:`close` wait for it (and raise its error, if it failed).
        With the parameter tier (``Offload(params="nvme")``) a save reads the SSD one group at a
        time while it writes, and ``async_save=True`` is refused (it would stage the whole model).

        >>> import tempfile, torch, shfx
        >>> cm = shfx.compile(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), blocks=False,
        ...                   num_stages=2, device=shfx.EmulatedDevice(memory="1MiB"), optimizer=shfx.optim.AdamW())
        >>> cm(torch.randn(2, 4)).sum().backward(); cm.step(); cm.zero_grad()
        >>> d = tempfile.mkdtemp() + "/ckpt"
        >>> cm.save_checkpoint(d, extra={"batch": 1})
        >>> cm.load_checkpoint(d)
        {'batch': 1}
        """
        from . import checkpoint

        self.wait_checkpoint()
        self._checkpoint_save = checkpoint.save(self, path, extra=extra, scheduler=scheduler, async_save=async_save)

    def wait_checkpoint(self) -> None:
        """Wait for the asynchronous save in flight (if any); raise its error if it failed."""
        pending, self._checkpoint_save = self._checkpoint_save, None
        if pending is not None:
            pending.wait()

    def load_checkpoint(
        self, path: str, *, scheduler: Any = None, strict: bool = True, restore_rng: bool = True
    ) -> Any:
        """Load a checkpoint written by :meth:`save_checkpoint` (or ``shfx.checkpoint.save_from``)
        and return its ``extra``: training then goes on exactly as the run that saved it.

        Works before the first call too (in a fresh process: compile, load, train): the weights
        load into the model at once, the optimizer states when the first call has laid out the
        host store. ``scheduler``: loads its saved state. ``strict``: the checkpoint's weights
        must have exactly the model's names. ``restore_rng``: set the RNG states saved (so
        dropout draws the masks the saving run would have drawn next).

        What it holds: the optimizer states are read one stage at a time; with the NVMe and
        parameter tiers (``Offload(optimizer="nvme")``, ``Offload(params="nvme")``) each group on
        the SSD is read from the checkpoint into the SSD window's buffers and written to the SSD
        before the next, so the host holds about one group's optimizer states beyond training.
        Everything it can refuse is checked first (names and shapes from the checkpoint's metadata,
        its steps, each stage's states against the stage): a refused load changes nothing.

        Raises:
            UsageError: a checkpoint of another model, or between a backward and its ``cm.step()``
                (before the first call, what only the store's layout can check is raised at that call).
        """
        from . import checkpoint

        self.wait_checkpoint()
        return checkpoint.load(self, path, scheduler=scheduler, strict=strict, restore_rng=restore_rng)

    def sync(self) -> None:
        """Make the model's own tensors current: copy weights a policy updates on the device (the
        ``resident`` policy, stronghold's first stages) back to the host. ``state_dict`` does it."""
        self._settle()
        if self._engine is not None:
            self._engine.sync_to_host()

    def _settle(self) -> None:
        if self._engine is not None and self._engine.pending_updates:
            raise UsageError("the host update started by backward() is pending; call cm.step() first")
        if self._engine is not None:
            self._engine.await_deferred()  # max_grad_norm: the clipped updates step() started
            self._engine.wait_delayed()  # delayed_update: the host weights include every step()
