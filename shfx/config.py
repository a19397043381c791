"""One configuration: ``shfx.compile``'s arguments, validated and normalised once.

:meth:`Config.from_args` is the one place ``shfx.compile``'s options are checked, in four steps:

1. each argument on its own: its type and range, with an error that says what was needed, what
   was given and what to change; and normalised (``precision="bfloat16"`` -> ``"bf16"``, the
   policy and its window resolved to one :class:`~shfx.passes.policies.Policy`, the device to an
   :class:`~shfx.EmulatedDevice` or :class:`~shfx.CudaDevice`, ``rollback=None`` to what
   ``skip_nonfinite`` needs, fp16's default loss scaler);
2. the combinations that truly conflict: the rows of :data:`CONFLICTS`, each with its reason and
   its fix (:class:`~shfx.errors.ConfigConflict`);
3. what some pass does not run yet (:func:`check_supported`: data parallel's and the NVMe tier's
   refusals), which may run one day;
4. what one option sets in another: exact clipping (``max_grad_norm`` with ``overlap_update``)
   turns on the policy's ``deferred_update``; an NVMe :class:`~shfx.Offload` spec sets the
   policy's ``nvme``/``host_window``.

The :class:`Config` it returns is final: the compiled model builds its pipeline options, its
backend and its engine from it, and nothing is changed after (``cm.config``).

>>> import shfx
>>> c = Config.from_args(device="emulated", precision="bfloat16", window=3,
...                      optimizer=shfx.optim.AdamW(), max_grad_norm=1.0)
>>> c.precision, c.policy
('bf16', Stronghold(window=3, resident_first=0, deferred_update=True))
>>> Config.from_args(device="emulated", precision="bf16", scaler=shfx.LossScaler())
Traceback (most recent call last):
shfx.errors.ConfigConflict: a loss scaler is for precision='fp16'; precision='bf16' needs none; drop scaler=, or ...
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shfx.passes.layout import dtype_name, precision_dtype
from shfx.passes.pipeline import PipelineOptions
from shfx.passes.policies import Policy

from .amp import LossScaler
from .devices import CudaDevice, EmulatedDevice
from .errors import ConfigConflict, UsageError
from .offload import Offload
from .optim import HostOptimizer
from .parallel import DataParallel

__all__ = ["Config", "Conflict", "CONFLICTS", "check_conflicts", "check_supported"]

_RECOMPUTE = ("auto", "early-stop", "full")
_DYNAMIC_NAMES = {"batch": 0, "seq": 1}  # dimension of every tensor input that a named range covers


@dataclass(frozen=True)
class Config:
    """``shfx.compile``'s options, validated and normalised: make it with :meth:`from_args`
    (``shfx.compile`` does; ``cm.config`` is the compiled model's). The constructor takes
    normalised values and checks them against :data:`CONFLICTS` only.

    Attributes (the arguments of :func:`shfx.compile`, normalised):
        device: an :class:`~shfx.EmulatedDevice` or a :class:`~shfx.CudaDevice` (data parallel:
            this rank's).
        policy: the final policy: window resolved, ``deferred_update`` on for exact clipping,
            ``nvme``/``host_window`` from an NVMe ``offload`` spec; ``"auto"`` fields left to the tuner.
        optimizer: the host optimizer, or None.
        blocks, num_stages: how to partition into stages.
        grad_accum_steps, overlap_update: backward() calls per step(); whether the host updates
            start during the backward.
        rollback: whether a step is undone exactly when it fails or is skipped (resolved:
            ``rollback=None`` means on where ``skip_nonfinite`` with ``overlap_update`` needs it).
        skip_nonfinite: skip a step with an inf or NaN gradient (on with fp16).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``; fp32_norms: LayerNorm/RMSNorm in fp32.
        scaler: fp16's loss scaler (a default :class:`~shfx.LossScaler` for fp16), else None.
        max_grad_norm, norm_type: exact gradient clipping (None: off).
        offload: the :class:`~shfx.Offload` spec, or None.
        data_parallel: the :class:`~shfx.DataParallel` spec, or None (off).
        pinned: the pinned pool's budget in bytes (``pinned=None``/``"auto"`` resolved to
            :func:`shfx.passes.pinned.default_pinned_bytes`, a quarter of the RAM).
        pin_memory, optimizer_workers, verify, verify_each_pass, tune_tolerance, recompute,
        dynamic, max_captures: as given to ``shfx.compile`` (``dynamic``: ``"auto"``, False or a
            dict of ranges).

    Frozen: its fields cannot be set (the objects it holds, the optimizer and the scaler, keep
    their own state).
    """

    device: EmulatedDevice | CudaDevice
    policy: Policy
    optimizer: HostOptimizer | None = None
    blocks: Any = None
    num_stages: int | None = None
    grad_accum_steps: int = 1
    overlap_update: bool = True
    rollback: bool = False
    skip_nonfinite: bool = False
    precision: str = "fp32"
    fp32_norms: bool = False
    scaler: LossScaler | None = None
    max_grad_norm: float | None = None
    norm_type: float = 2.0
    offload: Offload | None = None
    data_parallel: DataParallel | None = None
    pin_memory: bool = True
    pinned: int | None = None  # (from_args always resolves it; None: no budget)
    optimizer_workers: int = 1
    verify: bool = True
    verify_each_pass: bool = False
    tune_tolerance: float = 0.02
    recompute: str = "auto"
    dynamic: str | bool | dict = "auto"
    max_captures: int = 8

    def __post_init__(self) -> None:
        check_conflicts(self)

    # ---- derived -------------------------------------------------------------------------------
    @property
    def delayed_update(self) -> bool:
        """ZeRO-Offload's one-step-stale update (``ZeroOffload(delayed_update=True)``)."""
        return bool(getattr(self.policy, "delayed_update", False))

    @property
    def window(self) -> int | str | None:
        """The policy's window (``"auto"``: the tuner's), None for a policy without one."""
        return getattr(self.policy, "window", None)

    @property
    def working_dtype(self) -> torch.dtype:
        """The device's dtype of the parameters (``torch.bfloat16`` for ``"bf16"``)."""
        return precision_dtype(self.precision)

    @property
    def nvme(self) -> bool:
        """Whether the optimizer states live on the NVMe tier."""
        return self.offload is not None and self.offload.optimizer == "nvme"

    def pipeline_options(self, ranks: int = 1) -> PipelineOptions:
        """The compile pipeline's options (``ranks``: the data-parallel processes running it)."""
        device = f"cuda:{self.device.index}" if isinstance(self.device, CudaDevice) else None
        return PipelineOptions(
            policy=self.policy, blocks=self.blocks, num_stages=self.num_stages, verify=self.verify,
            verify_each_pass=self.verify_each_pass, device=device, precision=self.precision,
            fp32_norms=self.fp32_norms, ranks=ranks, updates_in_step=not self.overlap_update,
            clip_in_step=self.max_grad_norm is not None and not self.overlap_update, rollback=self.rollback,
            loss_scaling=self.precision == "fp16", optimizer=self.optimizer,
            activations=self.offload.activations if self.offload is not None else "device",
            activation_window=self.offload.activation_window if self.offload is not None else None,
            param_tier=self.offload is not None and self.offload.params == "nvme",
            image_window=self.offload.image_window if self.offload is not None else None,
        )  # fmt: skip

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` (checked against :data:`CONFLICTS` again)."""
        return dataclasses.replace(self, **changes)

    # ---- the one maker -------------------------------------------------------------------------
    @classmethod
    def from_args(
        cls,
        *,
        device: Any = None,
        window: int | str | None = None,
        optimizer: HostOptimizer | None = None,
        policy: Any = "stronghold",
        blocks: Any = None,
        num_stages: int | None = None,
        grad_accum_steps: int = 1,
        overlap_update: bool = True,
        pin_memory: bool = True,
        pinned: int | str | None = None,
        optimizer_workers: int = 1,
        verify: bool = True,
        verify_each_pass: bool = False,
        tune_tolerance: float = 0.02,
        recompute: str = "auto",
        rollback: bool | None = None,
        skip_nonfinite: bool = False,
        precision: str = "fp32",
        fp32_norms: bool = False,
        scaler: LossScaler | None = None,
        dynamic: str | bool | dict | None = "auto",
        max_captures: int = 8,
        max_grad_norm: float | None = None,
        norm_type: float = 2.0,
        offload: Offload | None = None,
        data_parallel: bool | DataParallel | None = None,
    ) -> Config:
        """The configuration of ``shfx.compile(model, **options)`` (the arguments are
        :func:`shfx.compile`'s): each argument checked and normalised, the combination checked
        against :data:`CONFLICTS` and :func:`check_supported`, then the policy adjusted for
        clipping and the NVMe tier. Starts nothing (no backend, no process group)."""
        # 1. each argument on its own
        if recompute not in _RECOMPUTE:
            raise ValueError(f"recompute must be 'auto', 'early-stop' or 'full', got {recompute!r}")
        if not 0 <= tune_tolerance < 1:
            raise ValueError(f"tune_tolerance must be in [0, 1), got {tune_tolerance}")
        if isinstance(grad_accum_steps, bool) or not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be an int >= 1, got {grad_accum_steps!r}")
        if optimizer is not None and not isinstance(optimizer, HostOptimizer):
            raise TypeError(
                f"optimizer must be shfx.optim.AdamW(...), SGD(...) or Adafactor(...) (it runs on the host next to the "
                f"master weights), got {type(optimizer).__name__}"
            )
        precision = dtype_name(precision_dtype(precision))
        if precision == "fp16":
            if scaler is None:
                scaler = LossScaler()
            elif not isinstance(scaler, LossScaler):
                raise TypeError(f"scaler must be a shfx.LossScaler, got {type(scaler).__name__}")
            skip_nonfinite = True  # an overflowing step is skipped
        dp = _data_parallel_spec(data_parallel)
        device = _device(_data_parallel_device(device) if dp is not None else device)
        # window, policy (resolved), num_stages, verify flags: the pipeline's own checks
        base = PipelineOptions(
            policy=policy, window=window, blocks=blocks, num_stages=num_stages, verify=verify,
            verify_each_pass=verify_each_pass, precision=precision, fp32_norms=fp32_norms,
        )  # fmt: skip
        if max_grad_norm is not None:
            for name, v in (("max_grad_norm", max_grad_norm), ("norm_type", norm_type)):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v != v:
                    raise ValueError(f"{name} must be a number > 0 (norm_type may be float('inf')), got {v!r}")
            if max_grad_norm == float("inf"):
                raise ValueError("max_grad_norm must be finite (float('inf') never clips: leave max_grad_norm=None)")
        if offload is not None and not isinstance(offload, Offload):
            raise TypeError(f"offload must be a shfx.Offload(...), got {type(offload).__name__}")
        dynamic = _check_dynamic(dynamic)
        if isinstance(max_captures, bool) or not isinstance(max_captures, int) or max_captures < 1:
            raise ValueError(f"max_captures must be an int >= 1 (how many captures shfx keeps), got {max_captures!r}")
        # 2. the conflict table (Config.__post_init__), on the policy as given
        draft = cls(
            device=device, policy=base.policy, optimizer=optimizer, blocks=blocks, num_stages=num_stages,
            grad_accum_steps=grad_accum_steps, overlap_update=overlap_update,
            rollback=bool(skip_nonfinite and overlap_update) if rollback is None else bool(rollback),
            skip_nonfinite=bool(skip_nonfinite), precision=precision, fp32_norms=fp32_norms, scaler=scaler,
            max_grad_norm=max_grad_norm, norm_type=norm_type, offload=offload, data_parallel=dp,
            pin_memory=pin_memory, pinned=_pinned_budget(pinned), optimizer_workers=optimizer_workers, verify=verify,
            verify_each_pass=verify_each_pass, tune_tolerance=tune_tolerance, recompute=recompute,
            dynamic=dynamic, max_captures=max_captures,
        )  # fmt: skip
        # 3. what a pass does not run yet
        check_supported(draft)
        # 4. what one option sets in another
        return draft.replace(policy=_final_policy(draft))


def _pinned_budget(pinned: int | str | None) -> int:
    """``shfx.compile(pinned=...)`` in bytes: an int of bytes or a size string (``"8GiB"``); None
    or ``"auto"``: :func:`~shfx.passes.pinned.default_pinned_bytes` (a quarter of the RAM)."""
    from shfx.passes.pinned import default_pinned_bytes
    from shfx.passes.units import parse_bytes

    if pinned is None or (isinstance(pinned, str) and pinned.strip().lower() == "auto"):
        return default_pinned_bytes()
    if isinstance(pinned, bool) or not isinstance(pinned, (int, str)):
        raise ValueError(
            f"pinned must be the pinned-memory budget: an int of bytes, a size like '8GiB', or None/'auto' (a quarter "
            f"of the RAM), got {pinned!r}"
        )
    try:
        return parse_bytes(pinned, what="pinned")
    except ValueError as e:
        raise ValueError(f"{e} (pinned: the pinned-memory budget, e.g. pinned='8GiB', pinned=2**30, or None/'auto')") from None


# ---- the conflict table ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Conflict:
    """A combination of options that cannot hold together.

    Attributes:
        name: a short name for it.
        applies: whether a configuration has it.
        reason: why the options conflict; ``fix``: what to change. Both are format strings
            over the configuration (``{c.policy!r}``); the error says ``"<reason>; <fix>"``.
            A fix that depends on the other options (one that would run into another row) is
            a function of the configuration instead.
    """

    name: str
    applies: Callable[[Config], bool]
    reason: str
    fix: str | Callable[[Config], str]

    def fix_for(self, c: Config) -> str:
        """What to change in ``c``: every option it names, applied, clears this row and no
        other row of the table takes its place (tests/test_config.py applies each)."""
        return self.fix(c) if callable(self.fix) else self.fix.format(c=c)

    def message(self, c: Config) -> str:
        return f"{self.reason.format(c=c)}; {self.fix_for(c)}"


def _clipping_overlapped(c: Config) -> bool:
    return c.max_grad_norm is not None and c.overlap_update


def _clip_policy_fix(c: Config) -> str:
    """A policy without the deferred-update schedule (a function policy: L2L has its own row):
    the policies that have it, or the updates in step()."""
    return (
        "use policy='stronghold', 'resident', 'zero-offload' or 'zero-infinity' (their deferred-update schedule keeps "
        "the update overlapped), or overlap_update=False (updates in step())"
    )


def _l2l_clip_fix(c: Config) -> str:
    """Clipping with L2L: a policy keeping the stages (and their gradients) on the device; drop
    the clipping only with the overlapped update (L2L cannot update in step() either: the row
    "L2L with updates in step()")."""
    fix = (
        "use policy='resident' or 'stronghold' (Stronghold(resident_first=k) keeps k stages and their optimizer on the "
        "device; max_grad_norm defers their updates behind the norm)"
    )
    return fix + (", or drop max_grad_norm" if c.overlap_update else ", or drop max_grad_norm and use overlap_update=True")


def _rollback_needed_fix(c: Config) -> str:
    """Skipping with overlapped updates needs rollback: keep it, or start the updates in step()."""
    return "keep rollback=True, or use overlap_update=False (updates start in step(), after the check)"


#: The combinations of ``shfx.compile``'s options that truly conflict, in the order they are
#: checked (the first that applies is raised). Not here: what a pass does not run *yet*
#: (:func:`check_supported`). No row applies to a configuration :meth:`Config.from_args`
#: returned.
CONFLICTS: tuple[Conflict, ...] = (
    Conflict(
        "scaler without fp16",
        lambda c: c.scaler is not None and c.precision != "fp16",
        "a loss scaler is for precision='fp16'; precision={c.precision!r} needs none",
        "drop scaler=, or use precision='fp16'",
    ),
    Conflict(
        "fp32_norms in fp32",
        lambda c: c.fp32_norms and c.precision == "fp32",
        "fp32_norms=True keeps LayerNorm/RMSNorm parameters in fp32 in a 16-bit working copy; with "
        "precision={c.precision!r} every parameter is fp32 already",
        "pass precision='bf16' or 'fp16', or drop fp32_norms",
    ),
    Conflict(
        "fp16 overlapped without rollback",
        lambda c: c.precision == "fp16" and c.overlap_update and not c.rollback,
        "precision='fp16' skips a step whose scaled gradients overflow, and with overlap_update=True the updates of "
        "later stages run before that is known: they are rolled back, which needs rollback=True (the default for fp16)",
        _rollback_needed_fix,
    ),
    Conflict(
        "clipping without an optimizer",
        lambda c: c.max_grad_norm is not None and c.optimizer is None,
        "max_grad_norm clips the gradients the optimizer applies, and there is no optimizer",
        "pass optimizer=shfx.optim.AdamW(...), or drop max_grad_norm",
    ),
    Conflict(
        # NOTE: a true conflict (issue 25), overlapped or not: L2L updates each stage on the
        # device while it is the one stage resident and sends it back (OP) before the next;
        # deferring those updates behind the total norm would keep every stage's gradient on the
        # device until the gate (its window is one stage) and fetch every stage again to update it
        "clipping with L2L",
        lambda c: c.max_grad_norm is not None and c.policy.name == "l2l",
        "max_grad_norm with policy 'l2l': L2L updates each stage on the device while it is the one stage resident, and "
        "its gradient leaves the device with the slot before every gradient's norm is known (holding them all until the "
        "step's gate would keep every stage's gradient on the device, which its one-stage window rules out)",
        _l2l_clip_fix,
    ),
    Conflict(
        "L2L with gradient accumulation",
        lambda c: c.policy.name == "l2l" and c.grad_accum_steps > 1,
        "grad_accum_steps={c.grad_accum_steps} with policy 'l2l': L2L updates each stage on the device while it is the "
        "one stage resident during the backward; summing the gradients of several backwards would keep every stage's "
        "gradient until the last, which its one-stage window does not keep on the device",
        "use grad_accum_steps=1 (a larger batch) with policy='l2l', or policy='resident' or 'stronghold' "
        "(Stronghold(resident_first=k) accumulates k stages' gradients on the device)",
    ),
    Conflict(
        "L2L with updates in step()",
        lambda c: c.policy.name == "l2l" and not c.overlap_update,
        "overlap_update=False with policy 'l2l': L2L updates each stage on the device while it is the one stage "
        "resident and copies it back before the next comes in; updates in step() would wait for every stage's "
        "gradient, which its one-stage window does not keep on the device",
        "use overlap_update=True with policy='l2l', or policy='resident' or 'stronghold' (Stronghold(resident_first=k) "
        "keeps k stages and their optimizer on the device, updated in step())",
    ),
    Conflict(
        "clipping with updates during the backward",
        lambda c: _clipping_overlapped(c) and "deferred_update" not in c.policy.options(),
        "max_grad_norm with policy {c.policy.name!r}: its updates run during the backward, before every gradient's "
        "norm is known",
        lambda c: _clip_policy_fix(c),
    ),
    Conflict(
        "clipping with a delayed update",
        # (overlapped or not: the delayed-update program has no gradient norms; issue 25 found
        # max_grad_norm with overlap_update=False silently not applied)
        lambda c: c.max_grad_norm is not None and c.delayed_update,
        "max_grad_norm cannot be combined with ZeroOffload(delayed_update=True) (one-step-stale updates): exact "
        "clipping runs each update after the step's global gradient norm is known (the policy's deferred update), "
        "and a policy runs its updates one way",
        "use ZeroOffload() (max_grad_norm turns on its exact deferred update), or drop max_grad_norm",
    ),
    Conflict(
        "delayed update in step()",
        lambda c: c.delayed_update and not c.overlap_update,
        "ZeroOffload(delayed_update=True) runs a step's updates after step() returned, during the next step, and "
        "overlap_update=False asks for them inside step() (so that code between backward() and step() sees and edits "
        "the gradients they apply)",
        "use ZeroOffload() with overlap_update=False, or keep the delayed update with overlap_update=True",
    ),
    Conflict(
        "skip_nonfinite with a delayed update",
        lambda c: c.skip_nonfinite and c.delayed_update,
        "skip_nonfinite=True (on with precision='fp16') cannot be combined with ZeroOffload(delayed_update=True): the "
        "delayed update of a step runs after step() returned, so it cannot be skipped",
        "use one or the other",
    ),
    Conflict(
        "skip_nonfinite overlapped without rollback",
        lambda c: c.skip_nonfinite and c.overlap_update and not c.rollback,
        "skip_nonfinite=True with overlap_update=True needs rollback=True: the updates of later stages run during "
        "backward, before the first stages' gradients are checked, and are undone when one is not finite",
        _rollback_needed_fix,
    ),
    Conflict(
        "NVMe policy without an Offload spec",
        lambda c: bool(getattr(c.policy, "nvme", False)) and (c.offload is None or not c.offload.uses_nvme),
        "{c.policy!r} keeps the optimizer states on an SSD, but shfx.compile got no offload=... saying where",
        "pass offload=shfx.Offload(optimizer='nvme', path='/mnt/nvme/shfx') (the policy's nvme fields then follow it)",
    ),
    Conflict(
        "NVMe tier without an optimizer",
        lambda c: c.nvme and c.optimizer is None,
        "Offload(optimizer='nvme') puts the optimizer states on the SSD, but there is no optimizer",
        "pass optimizer=shfx.optim.AdamW(...), or drop offload=",
    ),
    Conflict(
        # NOTE: a true conflict (issue 25): the tier stages the states of host updates (SR g
        # before U g, SW g after it); Resident and L2L update every group on the device (DU), so
        # their optimizer states never reach the host and there is nothing for it to hold
        "NVMe tier with device updates",
        lambda c: c.nvme and c.policy.name in ("resident", "l2l"),
        "Offload(optimizer='nvme') keeps the states of the host optimizer's updates on an SSD, and policy "
        "{c.policy.name!r} updates every group on the device (its optimizer states live there): no state would go "
        "to the SSD",
        "use policy='stronghold', 'zero-offload' or 'zero-infinity' (they update on the host), or drop offload=",
    ),
    Conflict(
        "host window given twice",
        lambda c: c.nvme
        and c.offload.host_window != "auto"
        and bool(getattr(c.policy, "nvme", False))
        and getattr(c.policy, "host_window", "auto") not in ("auto", c.offload.host_window),
        "{c.policy!r} asks for host_window={c.policy.host_window} and offload=... for "
        "host_window={c.offload.host_window}",
        "give it in one place (the Offload spec sets the policy's)",
    ),
)


def check_conflicts(c: Config) -> None:
    """Raise :class:`~shfx.errors.ConfigConflict` for the first row of :data:`CONFLICTS` that
    applies to ``c``: its reason and its fix."""
    for row in CONFLICTS:
        if row.applies(c):
            raise ConfigConflict(row.message(c), row)


# ---- not run yet -------------------------------------------------------------------------------
def check_supported(c: Config) -> None:
    """Refuse what some pass does not run yet (not a conflict: it may run one day), each with
    what to use instead: data parallel's refusals, then the NVMe tier's."""
    if c.data_parallel is not None:
        # NOTE: _check_data_parallel's keyword parameters are named after this config's fields,
        # and each gets that field: a refusal that needs another option names it, and no call
        # site changes
        _check_data_parallel(**{name: getattr(c, name) for name in inspect.signature(_check_data_parallel).parameters})
    _check_nvme_supported(c)
    _check_activation_offload(c)


def _check_activation_offload(c: Config) -> None:
    """``Offload(activations="nvme")``: what it does not run with yet (docs/usage.md,
    "Activation offload"): data parallel (each rank's activations on its own SSD file is not
    built or tested)."""
    if c.offload is not None and c.offload.activations == "nvme" and c.data_parallel is not None:
        raise UsageError(
            "Offload(activations='nvme') (boundary activations on the SSD) is not run yet with data_parallel: each rank's "
            "activation store on its SSD is not built; use activations='host' with data parallel"
        )


def _check_data_parallel(
    *, policy: Any, window: Any, optimizer: Any, precision: str, offload: Any, max_grad_norm: Any,
    skip_nonfinite: bool, rollback: bool | None, overlap_update: bool = True, fp32_norms: bool = False,
) -> None:  # fmt: skip
    """Refuse, at compile time, what data parallel does not run (yet): each refusal says what
    was given and what to use instead (docs/usage.md, "Data parallel")."""
    def refuse(what: str, fix: str) -> UsageError:
        return UsageError(f"data_parallel does not support {what}; {fix}")

    # (each optimizer says how it runs under data parallel: HostOptimizer.data_parallel)
    if getattr(optimizer, "data_parallel", None) not in ("sharded", "replicated"):
        got = "no optimizer" if optimizer is None else type(optimizer).__name__
        raise refuse(
            f"{got} as the optimizer (the host optimizer runs sharded or replicated across ranks)",
            "pass optimizer=shfx.optim.AdamW(...), SGD(...) or Adafactor(...)",
        )
    if precision not in ("fp32", "bf16", "fp16"):
        raise refuse(f"precision={precision!r}", "use precision='bf16', 'fp16' or 'fp32'")
    if fp32_norms and precision != "fp32":
        # (also refused at the first call, for any fp32 parameter in a stage's 16-bit trainable
        # region: BatchNorm's affine parameters; shfx.runtime.host_store)
        raise refuse(
            "fp32_norms=True yet: it keeps LayerNorm/RMSNorm parameters fp32 in the 16-bit working copy, so a stage's "
            "trainable region mixes dtypes, and data parallel reduces and gathers it as one tensor of one dtype",
            "drop fp32_norms (precision='bf16' casts the norms too), or use precision='fp32'",
        )
    # (window="auto" and resident_first="auto" run: every rank profiles, rank 0's choice, its
    # policy with the window and k, is broadcast, shfx._tuning; the first k stages' groups are
    # then updated on the device on every rank, replicated)
    # (ZeroOffload(delayed_update=True) runs: its RS in the backward, U and AG in the delayed phase;
    # a policy updating groups on the device runs them replicated: RS all-reduces the device gradient)
    # (in 16 bits a device group's fp32 master on the device is all-gathered once from the ranks'
    # master shards, DeviceAdamW.gather_masters; with grad_accum_steps > 1 its RS sums the
    # all-reduced micro-step gradients in the device dtype, as DDP's recipe does)


def _check_nvme_supported(c: Config) -> None:
    off, pol = c.offload, c.policy
    if off is None or not off.uses_nvme:
        return
    if getattr(pol, "nvme_masters", False):
        raise UsageError(
            "nvme_masters=True (the policy's flag for the fp32 masters on the SSD) is run through the parameter tier: pass "
            "offload=shfx.Offload(params='nvme', gradients='nvme', optimizer='nvme', path=...) and nvme_masters=False"
        )
    if off.params == "nvme":
        _check_param_tier(c)
    from .optim import SGD, AdamW, Adafactor

    # (each host runner says what its states are: shfx.runtime.ssd_window.SSDWindow's protocol)
    if not isinstance(c.optimizer, (AdamW, SGD, Adafactor)):
        raise UsageError(
            f"the NVMe tier holds the optimizer states of shfx.optim.AdamW, SGD and Adafactor; {type(c.optimizer).__name__} "
            "is not supported with it: use one of those, or offload=None"
        )
    if isinstance(c.optimizer, AdamW) and any(g.get("amsgrad") for g in c.optimizer.param_groups):
        raise UsageError("the NVMe tier holds AdamW's m and v, not amsgrad's third state: use amsgrad=False with it")
    if isinstance(c.optimizer, SGD) and not any(g.get("momentum") for g in c.optimizer.param_groups):
        raise UsageError(
            "SGD without momentum keeps no optimizer state, so the NVMe tier would hold nothing: drop offload= (or give "
            "SGD a momentum > 0, whose buffers the tier then holds)"
        )
    if not hasattr(pol, "nvme"):
        raise UsageError(
            f"policy {getattr(pol, 'name', pol)!r} has no NVMe tier (its updates are not host updates the tier can stage): "
            "use policy='stronghold', 'zero-offload' or 'zero-infinity' with offload=shfx.Offload(optimizer='nvme', ...)"
        )


def _check_param_tier(c: Config) -> None:
    """``Offload(params="nvme")``: what the parameter tier runs with (each refusal "not run yet",
    docs/usage.md): one process, the Stronghold policy (``resident_first`` given), updates
    overlapped with the backward (each gradient lands in its group's host window and is used at
    once; with accumulation the micro-steps before the last write it to the SSD), no clipping,
    rollback or delayed update. Its optimizers are the NVMe tier's (AdamW, SGD with momentum,
    Adafactor), checked after this."""
    pol = c.policy
    why = []
    if c.data_parallel is not None:
        why.append(("data_parallel", "each rank's shards of the images and masters on its SSD are not built", "data_parallel=None"))
    if getattr(pol, "name", None) != "stronghold":
        why.append((f"policy={getattr(pol, 'name', pol)!r}", "the gradients wait in the host window for their update, "
                    "which only an update during the backward keeps short", "policy=shfx.Stronghold(window=...)"))
    elif getattr(pol, "resident_first", 0) == "auto":
        why.append(("resident_first='auto'", "the groups whose images live on the SSD are laid out before the tuner runs, "
                    "and they depend on how many first stages stay on the device", "resident_first=<int>"))
    if not c.overlap_update:
        why.append(("overlap_update=False", "the gradients would wait for step() in host RAM", "overlap_update=True"))
    if c.max_grad_norm is not None:
        why.append(("max_grad_norm", "exact clipping holds every gradient until the total norm is known", "max_grad_norm=None"))
    if c.rollback:
        why.append(("rollback (fp16, skip_nonfinite)", "the undo copies of images on the SSD are not built", "precision='bf16' or 'fp32', rollback=False"))
    if why:
        lines = "; ".join(f"{what}: {reason} (use {fix})" for what, reason, fix in why)
        raise UsageError(f"Offload(params='nvme') (the parameter tier) is not run yet with: {lines}")


# ---- what one option sets in another -------------------------------------------------------------
def _final_policy(c: Config) -> Policy:
    """The policy ``c`` runs: exact clipping with overlapped updates turns on its deferred-update
    schedule (norms during the backward, updates in the next forward); an NVMe ``Offload`` spec
    sets ``nvme=True`` and its ``host_window`` unless ``"auto"`` (then the policy's own)."""
    pol = c.policy
    if _clipping_overlapped(c):
        pol = pol.replace(deferred_update=True)
    if c.nvme:
        hw = pol.host_window if pol.nvme else "auto"
        if c.offload.host_window != "auto":
            hw = c.offload.host_window
        pol = pol.replace(nvme=True, host_window=hw)
    return pol


# ---- single arguments ------------------------------------------------------------------------------
def _device(device: Any) -> EmulatedDevice | CudaDevice:
    """``shfx.compile(device=...)`` as a device spec: None is CUDA when available, else an
    emulated device; ``"emulated"``; ``"cuda"``/``"cuda:N"``/a ``torch.device``; a spec as it is."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else EmulatedDevice()
    if isinstance(device, (EmulatedDevice, CudaDevice)):
        return device
    if isinstance(device, str) and device == "emulated":
        return EmulatedDevice()
    if isinstance(device, (str, torch.device)):
        d = torch.device(device)
        if d.type == "cuda":
            return CudaDevice(index=d.index or 0)
        raise ValueError(
            f"device={device!r} is not supported: use 'cuda', 'cuda:N', shfx.CudaDevice(...), "
            "or shfx.EmulatedDevice(memory=..., h2d=..., d2h=...) to emulate an accelerator on the CPU"
        )
    raise TypeError(f"device must be 'cuda', a CudaDevice or an EmulatedDevice, got {device!r}")


def _data_parallel_spec(data_parallel: Any) -> DataParallel | None:
    """``shfx.compile(data_parallel=...)`` as a :class:`DataParallel` (None: off), checking that
    torch.distributed is initialised (as ``DistributedDataParallel`` needs)."""
    if data_parallel is None or data_parallel is False:
        return None
    if data_parallel is True:
        data_parallel = DataParallel()
    if not isinstance(data_parallel, DataParallel):
        raise TypeError(
            f"data_parallel must be True, False or shfx.DataParallel(process_group=..., timeout_s=...), "
            f"got {type(data_parallel).__name__}"
        )
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise UsageError(
            "data_parallel needs torch.distributed initialised, as DistributedDataParallel does, and it is not: call "
            "torch.distributed.init_process_group('gloo') (or 'nccl') in every process first (torchrun sets "
            "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for it), then shfx.compile(..., data_parallel=True)"
        )
    return data_parallel


def _data_parallel_device(device: Any) -> Any:
    """Each rank its own device: ``cuda:<LOCAL_RANK>`` for ``None``/``"cuda"`` when CUDA is
    available (torchrun sets ``LOCAL_RANK``), else the given device (an emulated device is
    per process already)."""
    import os

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None and torch.cuda.is_available():
        return f"cuda:{local}"
    if isinstance(device, str) and device == "cuda":
        return f"cuda:{local}"
    if isinstance(device, torch.device) and device.type == "cuda" and device.index is None:
        return f"cuda:{local}"
    return device


def _check_dynamic(dynamic: Any) -> str | bool | dict:
    """Validate ``shfx.compile(dynamic=...)``: ``"auto"``/None, False, or a dict of ranges."""
    if dynamic is None or dynamic is True:
        return "auto"
    if dynamic is False or dynamic == "auto":
        return dynamic
    if not isinstance(dynamic, dict) or not dynamic:
        raise TypeError(
            f"dynamic must be 'auto' (the default), False, or a dict of ranges such as "
            f"{{'batch': (1, 64), 'seq': (1, 1024)}} or {{0: {{1: (1, 1024)}}}}; got {dynamic!r}"
        )
    for name, rng in dynamic.items():
        ranges = rng.items() if isinstance(name, int) and isinstance(rng, dict) else [(None, rng)]
        if isinstance(name, str) and name not in _DYNAMIC_NAMES or not isinstance(name, (str, int)) or isinstance(name, bool):
            raise ValueError(
                f"dynamic={{{name!r}: ...}}: a range is named 'batch' (dimension 0 of every tensor input) or 'seq' "
                "(dimension 1 of every tensor input with two or more), or keyed by a tensor input's position with "
                f"a dict {{dim: (lo, hi)}}, e.g. {{0: {{1: (1, 1024)}}}}"
            )
        for _, r in ranges:
            ok = isinstance(r, tuple) and len(r) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in r)
            if not ok or not 1 <= r[0] <= r[1]:
                raise ValueError(f"dynamic={{{name!r}: {rng!r}}}: a range is a tuple (lo, hi) of ints with 1 <= lo <= hi")
    return dict(dynamic)
