"""The window tuner: simulate every window, pick the smallest that is nearly the fastest and fits.

``tune_window(specs, costs, capacity_bytes=...)`` builds the policy's program for each window
W = 1..N, simulates it with the cost model, and chooses the smallest W whose predicted step time
is within ``tolerance`` (default 2%) of the best among the windows that fit the device budget.
The result explains the choice: what bounds the step at the chosen window (compute, link or
host optimizer), how much slower the next smaller window would be and why, and what a larger
window would cost in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from passes.program import Program
from passes.schedule import schedule_window
from passes.stages import StageSpec
from passes.units import format_bytes, format_seconds

from .costs import CostModel
from .simulate import Timeline, simulate

__all__ = ["WindowRow", "TuneResult", "NoWindowFits", "tune_window"]


class NoWindowFits(ValueError):
    """Not even window 1 fits the device budget; ``.rows`` holds what each window needs."""

    def __init__(self, message: str, rows: list):
        super().__init__(message)
        self.rows = rows


@dataclass(frozen=True)
class WindowRow:
    """Prediction for one window."""

    window: int
    step_s: float
    peak_device_bytes: int
    fits: bool
    bottleneck: str
    by_resource: dict
    timeline: Timeline = field(repr=False, compare=False)


@dataclass
class TuneResult:
    """The tuner's table and its choice.

    Attributes:
        rows: one :class:`WindowRow` per window tried.
        window: the chosen window.
        best_window: the fastest window that fits.
        tolerance: the tolerance used (fraction of the best step time).
        capacity_bytes: the device budget (None: unlimited).
        reason: why ``window`` was chosen, in words.
    """

    rows: list[WindowRow]
    window: int
    best_window: int
    tolerance: float
    capacity_bytes: int | None
    reason: str
    source: str = ""

    def row(self, window: int) -> WindowRow:
        for r in self.rows:
            if r.window == window:
                return r
        raise KeyError(f"window {window} was not simulated (tried {[r.window for r in self.rows]})")

    @property
    def chosen(self) -> WindowRow:
        return self.row(self.window)

    def table(self, max_rows: int = 16) -> str:
        """One row per window; with more than ``max_rows`` windows, runs of windows whose
        prediction no longer changes are folded into one line."""
        lines = [
            f"  {'W':>3}  {'step (pred.)':>13}  {'device memory':>14}  {'fits':>4}  {'critical path: compute/link/host':<33} {'vs best':>8}"
        ]
        best = self.row(self.best_window).step_s if self.best_window else None
        shown = self._shown(max_rows)
        prev_shown = None
        for r in self.rows:
            if r.window not in shown:
                continue
            if prev_shown is not None and r.window > prev_shown + 1:
                skipped = [x for x in self.rows if prev_shown < x.window < r.window]
                lines.append(
                    f"  {'...':>3}  W={skipped[0].window}..{skipped[-1].window}: the same step time; memory grows "
                    f"{format_bytes((skipped[-1].peak_device_bytes - skipped[0].peak_device_bytes) / max(1, len(skipped) - 1))} per window"
                )
            mark = "  <- chosen" if r.window == self.window else ""
            rel = f"{100 * (r.step_s / best - 1):+.1f}%" if best else ""
            lines.append(
                f"  {r.window:>3}  {format_seconds(r.step_s):>13}  {format_bytes(r.peak_device_bytes):>14}  "
                f"{'yes' if r.fits else 'no':>4}  {_shares(r):<33} {rel:>8}{mark}"
            )
            prev_shown = r.window
        return "\n".join(lines)

    def _shown(self, max_rows: int) -> set[int]:
        if len(self.rows) <= max_rows:
            return {r.window for r in self.rows}
        keep = {self.rows[0].window, self.rows[-1].window, self.window, self.best_window}
        for a, b in zip(self.rows, self.rows[1:]):
            if abs(b.step_s - a.step_s) > 1e-3 * a.step_s or a.fits != b.fits:
                keep |= {a.window, b.window}
        return keep

    def __str__(self) -> str:
        return self.table() + "\n" + self.reason


def _shares(r: WindowRow) -> str:
    """How the critical path splits between compute, the link and the host optimizer."""
    tot = sum(v for k, v in r.by_resource.items() if k != "idle") or 1.0
    c = r.by_resource.get("compute", 0.0) / tot
    link = r.by_resource.get("link", 0.0) / tot
    host = r.by_resource.get("host optimizer", 0.0) / tot
    return f"{100 * c:3.0f}% / {100 * link:3.0f}% / {100 * host:3.0f}%  {r.bottleneck}"


def _why(r: WindowRow) -> str:
    tot = sum(v for k, v in r.by_resource.items() if k != "idle") or 1.0
    link = r.by_resource.get("link", 0.0) / tot
    host = r.by_resource.get("host optimizer", 0.0) / tot
    if r.bottleneck == "compute":
        if link < 0.05 and host < 0.05:
            return "compute-bound: transfers and updates are hidden behind compute"
        exposed = []
        if link >= 0.05:
            exposed.append(f"transfers {100 * link:.0f}%")
        if host >= 0.05:
            exposed.append(f"host updates {100 * host:.0f}%")
        return f"mostly compute, but {' and '.join(exposed)} of the critical path are exposed"
    if r.bottleneck == "link":
        return f"link-bound: {100 * link:.0f}% of the critical path waits for transfers"
    return f"host-optimizer-bound: {100 * host:.0f}% of the critical path waits for host updates"


def _explain(rows: list[WindowRow], chosen: WindowRow, best: WindowRow, tolerance: float, capacity: int | None) -> str:
    parts = [
        f"chose window {chosen.window}: predicted {format_seconds(chosen.step_s)} per step, "
        + (
            "the fastest that fits"
            if chosen.window == best.window
            else f"within {100 * tolerance:.0f}% of the fastest that fits (W={best.window}, {format_seconds(best.step_s)})"
        )
        + f"; {_why(chosen)}."
    ]
    smaller = [r for r in rows if r.window < chosen.window and r.fits]
    if smaller:
        s = smaller[-1]
        parts.append(
            f"W={s.window} would be {100 * (s.step_s / chosen.step_s - 1):.0f}% slower ({_why(s)})."
        )
    larger = [r for r in rows if r.window > chosen.window]
    if larger:
        fit_larger = [r for r in larger if r.fits]
        if fit_larger:
            big = fit_larger[-1]
            parts.append(
                f"Larger windows gain at most {100 * (1 - min(r.step_s for r in fit_larger) / chosen.step_s):.1f}% "
                f"for up to {format_bytes(big.peak_device_bytes - chosen.peak_device_bytes)} more device memory."
            )
        unfit = [r for r in larger if not r.fits]
        if unfit and capacity is not None:
            parts.append(
                f"W>={unfit[0].window} does not fit: it needs {format_bytes(unfit[0].peak_device_bytes)} of "
                f"{format_bytes(capacity)}."
            )
    return " ".join(parts)


def tune_window(
    specs: Sequence[StageSpec],
    costs: CostModel,
    *,
    capacity_bytes: int | None = None,
    reserve_bytes: int = 0,
    tolerance: float = 0.02,
    policy: Callable[[Sequence[StageSpec], int], Program] = schedule_window,
    windows: Sequence[int] | None = None,
) -> TuneResult:
    """Pick a window (see the module docstring).

    Args:
        specs: the stages.
        costs: the cost model (profiled or analytic).
        capacity_bytes: device budget; a window fits when its simulated peak plus
            ``reserve_bytes`` (inputs, buffers the model keeps) is at most this.
        tolerance: how much slower than the best a smaller window may be predicted.
        policy: builds the program for a window.
        windows: the windows to try (default 1..number of stages).

    Raises:
        NoWindowFits: when no window fits the budget.
    """
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
    n = len(specs)
    windows = list(windows) if windows is not None else list(range(1, n + 1))
    rows = []
    for w in windows:
        tl = simulate(policy(specs, w), costs)
        need = tl.peak_device_bytes + reserve_bytes
        fits = capacity_bytes is None or need <= capacity_bytes
        rows.append(WindowRow(w, tl.step_s, need, fits, tl.bottleneck, dict(tl.by_resource), tl))
    feasible = [r for r in rows if r.fits]
    if not feasible:
        smallest = min(rows, key=lambda r: r.peak_device_bytes)
        raise NoWindowFits(
            f"no window fits the device budget of {format_bytes(capacity_bytes or 0)}: even W={smallest.window} "
            f"needs {format_bytes(smallest.peak_device_bytes)} (its slot plus the activations kept for backward)",
            rows,
        )
    best = min(feasible, key=lambda r: (r.step_s, r.window))
    chosen = min((r for r in feasible if r.step_s <= best.step_s * (1 + tolerance)), key=lambda r: r.window)
    return TuneResult(
        rows=rows,
        window=chosen.window,
        best_window=best.window,
        tolerance=tolerance,
        capacity_bytes=capacity_bytes,
        reason=_explain(rows, chosen, best, tolerance, capacity_bytes),
        source=getattr(costs, "source", ""),
    )
