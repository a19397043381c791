"""Where the host-updated copies of a model live: host RAM, or an NVMe SSD behind it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from shfx.passes.units import format_bandwidth, parse_bandwidth

__all__ = ["Offload"]

_TIERS = ("host", "nvme")


@dataclass(frozen=True)
class Offload:
    """Which tier holds the optimizer states and the fp32 master weights of the groups the host
    updates.

    ``shfx.compile(model, offload=spec)`` turns the tier on: the spec sets the policy's fields
    (``Stronghold``/``ZeroInfinity`` ``nvme=True``, and ``host_window`` unless ``"auto"``, which
    leaves the policy's own), and the first call makes the SSD store under ``path``
    (docs/usage.md, "NVMe tier"; ``params="nvme"``: "Parameter tier").

    Args:
        optimizer: ``"host"`` (AdamW ``m`` and ``v`` in host RAM, as today) or ``"nvme"`` (on the
            SSD store under ``path``; a window of groups' states is read into host RAM ahead of
            their update and written back after it).
        params: ``"host"`` or ``"nvme"``: where the parameters of host-updated groups live.
            ``"nvme"`` (the parameter tier, with ``optimizer="nvme"`` and ``gradients="nvme"``):
            each group's image (what a PREFETCH sends: fp32, or the 16-bit working copy) and fp32
            master are on the SSD; the host holds only windows: ``image_window`` images, read
            (``PR g``) before the prefetches and the update that need them and freed (``PD g``)
            or written back after the update (``PW g``), and ``host_window`` groups' master,
            gradient and states around their update. The model's own tensors of those groups
            become placeholders (``cm.state_dict()`` reads the values from the SSD).
        gradients: ``"host"`` or ``"nvme"``: with the parameter tier, the gradients of its groups
            pass through the host window only (the ``OG`` lands in the group's window buffer,
            read by ``SR`` before it; the update uses it in the same step, so it never needs the
            SSD's space or bandwidth); ``"nvme"`` goes with ``params="nvme"``.
        path: the directory on the SSD for the store's scratch file (needed with ``"nvme"``).
        nvme_read, nvme_write: bandwidth of an *emulated* SSD (``"3GB/s"``, ``"500MB/s"`` or a
            number of bytes/s): requests are throttled to it so schedules and budgets can be
            tested on any disk. ``None``: the real disk's speed.
        host_window: how many groups' SSD-held copies are in host RAM at a time (an int >= 1), or
            ``"auto"`` (the tuner's choice: the fewest within the tolerance of the fastest that
            fit ``host_budget``).
        image_window: the parameter tier's image buffers: an int >= 1, None (the fewest the
            schedule needs, plus one read ahead) or ``"auto"`` (the tuner's choice, with
            ``host_window``'s rule).
        host_budget: the host memory the training may hold (``"64GiB"``, bytes): the ledger's
            host terms are checked against it before anything is laid out, and the tuner's
            ``"auto"`` windows are chosen among those that fit it.
        activations: where the checkpointed boundary activations wait between a stage's forward
            and its backward: ``"device"`` (as today), ``"host"`` (every stage that can, copied to
            pinned host buffers after its forward and back before its backward: ``AO``/``AF``
            actions, docs/usage.md "Activation offload"; valid without a path), ``"auto"`` (the
            stages whose copies hide behind compute, as many as the device budget needs) or
            ``"nvme"`` (every stage that can, on to the SSD under ``path`` through
            ``activation_window`` host buffers: ``AW``/``AR`` actions; needs a path).
        activation_window: with ``activations="nvme"``, the host buffers the activations pass
            through (an int >= 1; None: :data:`shfx.passes.activations.ACTIVATION_WINDOW`, 2).

    >>> Offload(optimizer="nvme", path="/mnt/nvme/shfx", nvme_read="3GB/s").read_bps
    3000000000.0
    >>> Offload(optimizer="nvme")
    Traceback (most recent call last):
    ValueError: Offload(optimizer='nvme') needs a path: the directory on the SSD for the store's scratch file, e.g. Offload(optimizer='nvme', path='/mnt/nvme/shfx')
    """

    optimizer: Literal["host", "nvme"] = "host"
    params: Literal["host", "nvme"] = "host"
    path: str | os.PathLike | None = None
    nvme_read: float | str | None = None
    nvme_write: float | str | None = None
    host_window: int | Literal["auto"] = "auto"
    activations: Literal["device", "host", "nvme", "auto"] = "device"
    gradients: Literal["host", "nvme"] = "host"
    image_window: int | Literal["auto"] | None = None
    host_budget: int | str | None = None
    activation_window: int | None = None

    def __post_init__(self) -> None:
        if self.activations not in ("device", "host", "nvme", "auto"):
            raise ValueError(f"Offload activations must be 'device', 'host', 'nvme' or 'auto', got {self.activations!r}")
        for name in ("optimizer", "params", "gradients"):
            value = getattr(self, name)
            if value not in _TIERS:
                raise ValueError(f"Offload {name} must be 'host' or 'nvme', got {value!r}")
        tiers = (self.params, self.gradients, self.optimizer)
        if "nvme" in tiers[:2] and tiers != ("nvme", "nvme", "nvme"):
            raise ValueError(
                f"Offload(params={self.params!r}, gradients={self.gradients!r}, optimizer={self.optimizer!r}): the parameter "
                "tier puts a group's image, master, gradient and optimizer states on the SSD together (its host window "
                "holds them for the update): pass params='nvme', gradients='nvme', optimizer='nvme'"
            )
        iw = self.image_window
        if iw is not None and iw != "auto" and (isinstance(iw, bool) or not isinstance(iw, int) or iw < 1):
            raise ValueError(
                f"Offload image_window must be an int >= 1 (images in host RAM at a time), None (the fewest the schedule "
                f"needs, plus one) or 'auto' (the tuner's choice), got {iw!r}"
            )
        if iw is not None and self.params != "nvme":
            raise ValueError("Offload image_window sets the parameter tier's image buffers: it needs params='nvme'")
        aw = self.activation_window
        if aw is not None and (isinstance(aw, bool) or not isinstance(aw, int) or aw < 1):
            raise ValueError(f"Offload activation_window must be an int >= 1 (activation buffers in host RAM at a time) or None (2), got {aw!r}")
        if aw is not None and self.activations != "nvme":
            raise ValueError("Offload activation_window sets the host buffers of activations on the SSD: it needs activations='nvme'")
        if self.host_budget is not None:
            from shfx.passes.units import parse_bytes

            parse_bytes(self.host_budget, what="Offload host_budget", positive=True)
        if self.path is not None and not isinstance(self.path, (str, os.PathLike)):
            raise TypeError(f"Offload path must be a directory path (str or os.PathLike), got {self.path!r}")
        if self.path is not None and not os.fspath(self.path):
            raise ValueError("Offload path is empty: give the directory on the SSD for the store's scratch file")
        rates = {"nvme_read": self.nvme_read, "nvme_write": self.nvme_write}
        for name, value in rates.items():
            parse_bandwidth(value, what=f"Offload {name}")
        hw = self.host_window
        if hw != "auto" and (isinstance(hw, bool) or not isinstance(hw, int) or hw < 1):
            raise ValueError(f"Offload host_window must be an int >= 1 (groups in host RAM at a time) or 'auto', got {hw!r}")
        if not self.uses_nvme and self.activations == "nvme":
            if hw != "auto":
                raise ValueError(
                    f"Offload(host_window={hw!r}) sets the host window of optimizer states on the SSD, but only the activations "
                    "are on it (activations='nvme'): drop host_window, or add optimizer='nvme'"
                )
            if self.path is None:
                raise ValueError(
                    "Offload(activations='nvme') needs a path: the directory on the SSD for the activations' scratch file, "
                    "e.g. Offload(activations='nvme', path='/mnt/nvme/shfx')"
                )
        elif not self.uses_nvme:
            given = [f"{k}={v!r}" for k, v in {**rates, "path": self.path}.items() if v is not None]
            if hw != "auto":
                given.append(f"host_window={hw!r}")
            if given:
                raise ValueError(
                    f"Offload({', '.join(given)}) sets the NVMe tier but nothing is on it (optimizer='host', "
                    f"params='host'): add optimizer='nvme' (and/or params='nvme'), or drop {', '.join(g.split('=')[0] for g in given)}"
                )
        elif self.path is None:
            on = "params='nvme', gradients='nvme', optimizer" if self.params == "nvme" else "optimizer"
            raise ValueError(
                f"Offload({on}='nvme') needs a path: the directory on the SSD for the store's scratch file, "
                f"e.g. Offload({on}='nvme', path='/mnt/nvme/shfx')"
            )

    @property
    def uses_nvme(self) -> bool:
        """Whether any copy lives on the SSD."""
        return self.optimizer == "nvme" or self.params == "nvme"

    @property
    def host_budget_bytes(self) -> int | None:
        """The declared host budget in bytes (None: none declared)."""
        if self.host_budget is None:
            return None
        from shfx.passes.units import parse_bytes

        return int(parse_bytes(self.host_budget))

    @property
    def read_bps(self) -> float | None:
        """The emulated SSD's read bandwidth in bytes/s (None: unthrottled)."""
        return parse_bandwidth(self.nvme_read)

    @property
    def write_bps(self) -> float | None:
        """The emulated SSD's write bandwidth in bytes/s (None: unthrottled)."""
        return parse_bandwidth(self.nvme_write)

    def __str__(self) -> str:
        acts = f", activations on the {self.activations}" if self.activations != "device" else ""
        if self.activations == "nvme":
            from shfx.passes.activations import ACTIVATION_WINDOW

            acts = f", activations on NVMe through {self.activation_window or ACTIVATION_WINDOW} host buffers"
        if not self.uses_nvme and self.activations == "nvme":
            rates = ""
            if self.nvme_read is not None or self.nvme_write is not None:
                rates = f", emulated read {format_bandwidth(self.read_bps)} write {format_bandwidth(self.write_bps)}"
            return f"Offload(host{acts} at {os.fspath(self.path)}{rates})"
        if not self.uses_nvme:
            return f"Offload(host{acts})"
        on = ["parameters, gradients", "optimizer states"] if self.params == "nvme" else ["optimizer states"]
        rates = ""
        if self.nvme_read is not None or self.nvme_write is not None:
            rates = f", emulated read {format_bandwidth(self.read_bps)} write {format_bandwidth(self.write_bps)}"
        return f"Offload({' and '.join(on)} on NVMe at {os.fspath(self.path)}, host window {self.host_window}{rates}{acts})"
