"""The window report: the tuner's table and choice, measured vs predicted, trace and plot.

``cm.report()`` returns a :class:`WindowReport`. ``print(report)`` shows, per window, the
predicted step time, device memory and what bounds the step; the chosen window and why; and,
once steps have run, the measured step time against the prediction. ``report.save_trace(path)``
writes the simulated timeline of a window as a Chrome trace (open it in Perfetto);
``report.plot(path)`` draws step time and memory against the window (needs matplotlib).

**Drift.** The costs behind a prediction are profiled once; if the machine was busy then (or is
now) every later step misses the prediction. ``report.drift`` notices it: it is a
:class:`Drift` once the median of the last :data:`DRIFT_STEPS` (10) steps has been off the
prediction by more than :data:`DRIFT_THRESHOLD` (25%: slower than 1.25x or faster than 1/1.25x)
and by more than :data:`DRIFT_MIN_S` (5 ms), for at least :data:`DRIFT_STEPS` steps in a row,
not counting the report's first step (the capture and warm-up); ``print(report)`` then says how
far and since when, and that ``cm.retune()`` re-profiles and re-tunes. The defaults are
conservative: on a quiet machine the emulated device's steps of a real-size model are within
~10% of the prediction (``benchmarks/sim_accuracy.py``); a toy model's millisecond steps miss
it by 20-40%, ~1-2 ms of per-step overhead the simulator leaves out, which the 5 ms floor
ignores; and a short burst of other load moves a 10-step median less than it moves single
steps. A profile taken under other load is off by 1.5x to 15x.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from shfx.passes.units import format_bytes, format_seconds

from .costs import ProfileStats
from .tune import TuneResult

__all__ = ["WindowReport", "Drift", "detect_drift", "DRIFT_STEPS", "DRIFT_THRESHOLD", "DRIFT_MIN_S"]

DRIFT_STEPS = 10
DRIFT_THRESHOLD = 0.25
DRIFT_MIN_S = 0.005


@dataclass(frozen=True)
class Drift:
    """Measured steps that keep missing the prediction.

    Attributes:
        measured_s: median of the last ``window`` steps.
        predicted_s: the prediction they miss.
        since_step: about when it started (1 = the report's first step): the first window
            whose median is off holds k steps off the prediction the same way; it started k
            steps before that window's end.
        steps: steps since then (how long the measured steps have been off).
        window: steps per rolling median.
        threshold: the deviation that counts (0.25: slower than 1.25x or faster than 1/1.25x).
        min_s: ... and by more than this many seconds a step (a toy model's overheads).

    >>> d = detect_drift([1.0] + [0.17] * 30, predicted_s=2.39)
    >>> d.since_step, d.steps, round(d.error, 2)
    (2, 30, -0.93)
    """

    measured_s: float
    predicted_s: float
    since_step: int
    steps: int
    window: int = DRIFT_STEPS
    threshold: float = DRIFT_THRESHOLD
    min_s: float = DRIFT_MIN_S

    @property
    def error(self) -> float:
        """``measured / predicted - 1`` (negative: faster than predicted)."""
        return self.measured_s / self.predicted_s - 1

    def __str__(self) -> str:
        how = f"{100 * self.error:.0f}% slower" if self.error > 0 else f"{100 * -self.error:.0f}% faster"
        return (
            f"drift: the measured steps have run {how} than predicted for the last {self.steps} steps (since about "
            f"step {self.since_step}): median of the last {self.window} {format_seconds(self.measured_s)} vs "
            f"{format_seconds(self.predicted_s)} predicted. The costs were profiled once; if the machine was busy "
            "then, or is now, cm.retune() re-profiles them and re-tunes the window."
        )


def detect_drift(
    measured_s: list[float],
    predicted_s: float,
    *,
    window: int = DRIFT_STEPS,
    threshold: float = DRIFT_THRESHOLD,
    min_s: float = DRIFT_MIN_S,
    skip: int = 1,
) -> Drift | None:
    """A :class:`Drift` when the median of the last ``window`` steps of ``measured_s`` (after
    the first ``skip``) has been off ``predicted_s`` by more than ``threshold`` (slower than
    ``1 + threshold`` times or faster than ``1 / (1 + threshold)``) and by more than ``min_s``
    seconds, for at least ``window`` steps in a row, up to the last step; else None.

    >>> detect_drift([1.0] + [0.11, 0.09] * 15, predicted_s=0.1) is None   # within noise
    True
    >>> detect_drift([1.0] + [0.1] * 12 + [0.2] * 18, predicted_s=0.1).since_step
    14
    """
    if window < 1 or threshold <= 0 or predicted_s <= 0:
        raise ValueError(
            f"need window >= 1, threshold > 0 and a positive prediction, got {window}, {threshold}, {predicted_s}"
        )
    xs = measured_s[skip:]
    hi = max(predicted_s * (1 + threshold), predicted_s + min_s)
    lo = min(predicted_s / (1 + threshold), predicted_s - min_s)
    start = None  # first end index of the trailing run of off medians
    for end in range(len(xs) - 1, window - 2, -1):
        m = statistics.median(xs[end - window + 1 : end + 1])
        if lo <= m <= hi:
            break
        start = end
    if start is None or len(xs) - start < window:
        return None
    # the drift began as many steps before the end of the first off window as it holds off steps
    first = xs[start - window + 1 : start + 1]
    slow = statistics.median(first) > hi
    since = start + 1 - sum(1 for x in first if (x > hi if slow else x < lo))
    return Drift(
        measured_s=statistics.median(xs[-window:]),
        predicted_s=predicted_s,
        since_step=skip + since + 1,
        steps=len(xs) - since,
        window=window,
        threshold=threshold,
        min_s=min_s,
    )


@dataclass
class WindowReport:
    """What the tuner predicted and what the runs measured.

    Attributes:
        tune: the tuner's result.
        window: the window in use (the tuner's choice, or a fixed window the user set).
        device: the device in words.
        measured_s: measured step times (forward start to ``step()`` end), filled as steps run
            (the engine's list: ``first_step`` says where this report's steps start).
        how: ``"auto"`` when the tuner chose the window, ``"fixed"`` when the user set it,
            ``"analytic"`` for a prediction on a hardware profile where nothing runs.
        first_step: index in ``measured_s`` of the first step this report predicts (a report
            made by ``cm.retune()`` starts at the step after it).
        profile: how steady the profile behind the prediction was (None: not profiled).
        window_asked: the fixed window the user set when it is larger than the stages there are
            to stream (``window`` is then all of them); None otherwise.
        drift_window, drift_threshold, drift_min_s: the drift detector's settings (see
            :attr:`drift`).
        pinned: the pinned pool's plan in words (:meth:`shfx.passes.pinned.PinnedPlan.describe`:
            its size, budget and what is left unpinned); "" when nothing is pinned.

    >>> from shfx.cost_model.costs import CostTable, Links, StageCost
    >>> from shfx.cost_model.tune import tune_window
    >>> from shfx.passes.stages import chain
    >>> t = tune_window(chain(4, prefetch_bytes=1000), CostTable([StageCost(0.01, 0.03)] * 4, Links(1e6, 1e6)))
    >>> rep = WindowReport(t, t.window, "synthetic", measured_s=[0.5] + [t.chosen.step_s] * 30)
    >>> rep.drift is None
    True
    >>> rep.measured_s.extend([3 * t.chosen.step_s] * 20)
    >>> rep.drift.steps > 10
    True
    """

    tune: TuneResult
    window: int
    device: str = ""
    how: str = "auto"
    measured_s: list[float] = field(default_factory=list)
    first_step: int = 0
    profile: ProfileStats | None = None
    window_asked: int | None = None
    drift_window: int = DRIFT_STEPS
    drift_threshold: float = DRIFT_THRESHOLD
    drift_min_s: float = DRIFT_MIN_S
    pinned: str = ""

    @property
    def predicted_s(self) -> float:
        return self.tune.row(self.window).step_s

    @property
    def steps_s(self) -> list[float]:
        """This report's measured steps (from ``first_step`` on)."""
        return self.measured_s[self.first_step :]

    @property
    def measured_median_s(self) -> float | None:
        steps = self.steps_s
        xs = steps[1:] if len(steps) > 2 else steps  # skip the capture step
        return statistics.median(xs) if xs else None

    @property
    def drift(self) -> Drift | None:
        """Whether the measured steps keep missing the prediction (:func:`detect_drift` over
        this report's steps, skipping the first); None while they do not or too few ran."""
        if self.how == "analytic":
            return None
        return detect_drift(
            self.steps_s, self.predicted_s, window=self.drift_window, threshold=self.drift_threshold, min_s=self.drift_min_s
        )

    def __str__(self) -> str:
        t = self.tune
        head = {"auto": "window report (window=auto)", "analytic": "window report (analytic: nothing runs)"}.get(
            self.how, f"window report (fixed window={self.window})"
        )
        lines = [head, f"  device: {self.device}" if self.device else "", f"  costs: {t.source}" if t.source else ""]
        if self.profile is not None:
            lines.append(f"  profile: {self.profile.summary()}")
        lines = [x for x in lines if x]
        if t.capacity_bytes is not None:
            lines.append(f"  device budget: {format_bytes(t.capacity_bytes)}; tolerance {100 * t.tolerance:.0f}%")
        if self.pinned:
            lines.append(f"  host memory {self.pinned}")
        lines.append(t.table())
        if self.how in ("auto", "analytic"):
            lines.append(t.reason)
        elif self.window_asked is not None and self.window_asked > self.window:
            lines.append(
                f"window={self.window_asked} was set by the user, more than the {self.window} "
                f"stage{'s' if self.window != 1 else ''} there are to stream: all of them are resident "
                f"(window {self.window}); the tuner would choose {t.window}."
            )
        else:
            lines.append(f"window {self.window} was set by the user; the tuner would choose {t.window}.")
        m = self.measured_median_s
        if m is not None:
            err = 100 * (self.predicted_s / m - 1)
            lines.append(
                f"measured: {format_seconds(m)} per step (median of {len(self.steps_s)} steps) vs predicted "
                f"{format_seconds(self.predicted_s)} at W={self.window}: prediction {err:+.1f}%"
            )
        elif self.how == "analytic":
            lines.append("measured: nothing was run (analytic prediction for hardware profile)")
        else:
            lines.append("measured: no steps yet")
        drift = self.drift
        if drift is not None:
            lines.append(str(drift))
        elif self.profile is not None and not self.profile.steady:
            lines.append(
                "note: the profile was noisy (other load while profiling?); if the measured steps miss the "
                "prediction, cm.retune() re-profiles and re-tunes."
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "window_asked": self.window_asked,
            "how": self.how,
            "device": self.device,
            "source": self.tune.source,
            "capacity_bytes": self.tune.capacity_bytes,
            "tolerance": self.tune.tolerance,
            "chosen": self.tune.window,
            "best": self.tune.best_window,
            "reason": self.tune.reason,
            "rows": [
                {
                    "window": r.window,
                    "step_s": r.step_s,
                    "peak_device_bytes": r.peak_device_bytes,
                    "fits": r.fits,
                    "bottleneck": r.bottleneck,
                    "by_resource": r.by_resource,
                }
                for r in self.tune.rows
            ],
            "measured_s": list(self.steps_s),
            "predicted_s": self.predicted_s,
            "profile": asdict(self.profile) if self.profile is not None else None,
            "drift": asdict(d) if (d := self.drift) is not None else None,
        }

    def save_json(self, path: str | os.PathLike[str]) -> str:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
        return str(path)

    def save_trace(self, path: str | os.PathLike[str], window: int | None = None) -> str:
        """Write the simulated step at ``window`` (default: the one in use) as a Chrome trace."""
        return self.tune.row(window or self.window).timeline.save_chrome_trace(path)

    def plot(self, path: str | os.PathLike[str]) -> str:
        """Step time and device memory against the window (matplotlib, an optional dependency)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("report.plot needs matplotlib: pip install 'shfx[plot]'") from e
        rows = self.tune.rows
        ws = [r.window for r in rows]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
        a1.plot(ws, [r.step_s * 1e3 for r in rows], "o-", label="predicted")
        if self.measured_median_s is not None:
            a1.plot([self.window], [self.measured_median_s * 1e3], "s", color="C3", label="measured")
        a1.axvline(self.window, color="grey", ls=":")
        a1.set_xlabel("window W (stages resident)")
        a1.set_ylabel("step time (ms)")
        a1.legend()
        a2.plot(ws, [r.peak_device_bytes / 2**20 for r in rows], "o-", color="C1")
        if self.tune.capacity_bytes is not None:
            a2.axhline(self.tune.capacity_bytes / 2**20, color="C3", ls="--", label="budget")
            a2.legend()
        a2.axvline(self.window, color="grey", ls=":")
        a2.set_xlabel("window W")
        a2.set_ylabel("device memory (MiB)")
        fig.suptitle(f"window report: W={self.window} ({self.how})")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return str(path)
