"""The window report: the tuner's table and choice, measured vs predicted, trace and plot.

``cm.report()`` returns a :class:`WindowReport`. ``print(report)`` shows, per window, the
predicted step time, device memory and what bounds the step; the chosen window and why; and,
once steps have run, the measured step time against the prediction. ``report.save_trace(path)``
writes the simulated timeline of a window as a Chrome trace (open it in Perfetto);
``report.plot(path)`` draws step time and memory against the window (needs matplotlib).
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field
from typing import Any

from shfx.passes.units import format_bytes, format_seconds

from .tune import TuneResult

__all__ = ["WindowReport"]


@dataclass
class WindowReport:
    """What the tuner predicted and what the runs measured.

    Attributes:
        tune: the tuner's result.
        window: the window in use (the tuner's choice, or a fixed window the user set).
        device: the device in words.
        measured_s: measured step times (forward start to ``step()`` end), filled as steps run.
        how: ``"auto"`` when the tuner chose the window, ``"fixed"`` when the user set it,
            ``"analytic"`` for a prediction on a hardware profile where nothing runs.
    """

    tune: TuneResult
    window: int
    device: str = ""
    how: str = "auto"
    measured_s: list[float] = field(default_factory=list)

    @property
    def predicted_s(self) -> float:
        return self.tune.row(self.window).step_s

    @property
    def measured_median_s(self) -> float | None:
        xs = self.measured_s[1:] if len(self.measured_s) > 2 else self.measured_s  # skip the capture step
        return statistics.median(xs) if xs else None

    def __str__(self) -> str:
        t = self.tune
        head = {"auto": "window report (window=auto)", "analytic": "window report (analytic: nothing runs)"}.get(
            self.how, f"window report (fixed window={self.window})"
        )
        lines = [head, f"  device: {self.device}" if self.device else "", f"  costs: {t.source}" if t.source else ""]
        lines = [x for x in lines if x]
        if t.capacity_bytes is not None:
            lines.append(f"  device budget: {format_bytes(t.capacity_bytes)}; tolerance {100 * t.tolerance:.0f}%")
        lines.append(t.table())
        lines.append(
            t.reason if self.how in ("auto", "analytic") else f"window {self.window} was set by the user; the tuner would choose {t.window}."
        )
        m = self.measured_median_s
        if m is not None:
            err = 100 * (self.predicted_s / m - 1)
            lines.append(
                f"measured: {format_seconds(m)} per step (median of {len(self.measured_s)} steps) vs predicted "
                f"{format_seconds(self.predicted_s)} at W={self.window}: prediction {err:+.1f}%"
            )
        elif self.how == "analytic":
            lines.append("measured: nothing was run (analytic prediction for hardware profile)")
        else:
            lines.append("measured: no steps yet")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
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
            "measured_s": list(self.measured_s),
            "predicted_s": self.predicted_s,
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
