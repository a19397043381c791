"""The window tuner: simulate every window, pick the smallest that is nearly the fastest and fits.

``tune_window(specs, costs, capacity_bytes=...)`` builds the policy's program for each window
W = 1..N, simulates it with the cost model, and chooses the smallest W whose predicted step time
is within ``tolerance`` (default 2%) of the best among the windows that fit the device budget.
The result explains the choice: what bounds the step at the chosen window (compute, link or
host optimizer), how much slower the next smaller window would be and why, and what a larger
window would cost in memory.

The policy says what to tune: ``Stronghold(window="auto")`` (the default) tunes the window,
``Stronghold(window="auto", resident_first="auto")`` STRONGHOLD's refinement too: for each k (the
first k stages resident with their optimizer on the device) and each window over the remaining
stages, it simulates the program and chooses, among the pairs that fit and are within
``tolerance`` of the fastest, the one needing the least device memory.

With the NVMe tier (``Stronghold(nvme=True, host_window="auto")``, ``ZeroInfinity(...)`` alike)
the host window H is chosen too, after the window: with (k, W) chosen at the largest H (the
fewest SSD stalls), every H = 1..(groups on the SSD) is simulated and the smallest whose step
time is within ``tolerance`` of the fastest H (and whose host memory fits ``host_capacity_bytes``,
when given) is taken, as W is: host RAM then holds H groups' states instead of every group's.
:attr:`TuneResult.host_rows` has the table and :attr:`TuneResult.reason` says why.

With the parameter tier (``param_tier=True``: images, masters and gradients on the SSD too) each
candidate gets its image reads and write-backs before the features; with ``image_window="auto"``
the image buffers I are chosen with H (from the fewest the chosen window's order needs to three
more): among the (H, I) that fit, the one holding the least host memory within ``tolerance`` of
the fastest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shfx.passes.features import PassRefused, run_passes
from shfx.passes.policies import (
    Policy, Stronghold, ZeroInfinity, add_param_tier, least_image_window, param_tier_groups, resolve_policy,
)
from shfx.passes.program import Program, ScheduleError
from shfx.passes.schedule import data_parallel_program
from shfx.passes.stages import StageSpec
from shfx.passes.units import format_bytes, format_seconds

from .costs import CostModel
from .simulate import Timeline, simulate

__all__ = ["WindowRow", "HostWindowRow", "TuneResult", "NoWindowFits", "tune_window"]


class NoWindowFits(ValueError):
    """Not even window 1 fits the device budget (``what="device"``), or no host window the host
    budget (``what="host"``); ``.rows`` holds what each candidate needs."""

    def __init__(self, message: str, rows: list, what: str = "device"):
        super().__init__(message)
        self.rows = rows
        self.what = what


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
    resident_first: int = 0
    policy: Policy | None = field(default=None, repr=False, compare=False)  # the concrete policy simulated


@dataclass(frozen=True)
class HostWindowRow:
    """Prediction for one host window H of the NVMe tier (at the chosen k and W)."""

    host_window: int
    step_s: float
    host_bytes: int  # the ledger's host memory (setup: masters, gradients, the H window buffers, ...)
    window_bytes: int  # of which the host-window buffers
    ssd_s: float  # the SSD's critical-path seconds
    fits: bool
    bottleneck: str
    timeline: Timeline = field(repr=False, compare=False)
    policy: Policy | None = field(default=None, repr=False, compare=False)
    image_window: int | None = None  # the parameter tier's image buffers (None: without it)


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
    resident_first: int = 0  # the chosen k (stronghold's first stages kept on the device)
    policy: Policy | None = None  # the chosen policy, every "auto" field a number
    host_window: int | None = None  # the chosen host window (the NVMe tier), None without it
    host_rows: list[HostWindowRow] = field(default_factory=list)  # one per host window tried
    image_window: int | None = None  # the parameter tier's image buffers of the chosen program (None: without it)

    def row(self, window: int, resident_first: int | None = None) -> WindowRow:
        k = self.resident_first if resident_first is None else resident_first
        for r in self.rows:
            if r.window == window and r.resident_first == k:
                return r
        raise KeyError(
            f"window {window} with resident_first={k} was not simulated "
            f"(tried {[(r.resident_first, r.window) if self.tunes_k else r.window for r in self.rows]})"
        )

    @property
    def tunes_k(self) -> bool:
        return len({r.resident_first for r in self.rows}) > 1

    @property
    def chosen(self) -> WindowRow:
        return self.row(self.window)

    def table(self, max_rows: int = 16) -> str:
        """One row per window; with more than ``max_rows`` windows, runs of windows whose
        prediction no longer changes are folded into one line."""
        kcol = self.tunes_k
        lines = [
            ("  k" if kcol else "")
            + f"  {'W':>3}  {'step (pred.)':>13}  {'device memory':>14}  {'fits':>4}  {'critical path: compute/link/host':<33} {'vs best':>8}"
        ]
        best = min((r.step_s for r in self.rows if r.fits), default=None)
        shown = self._shown(max_rows)
        prev_shown, prev_k = None, None
        for r in self.rows:
            if (r.resident_first, r.window) not in shown:
                continue
            if prev_shown is not None and r.window > prev_shown + 1 and r.resident_first == prev_k:
                skipped = [x for x in self.rows if prev_shown < x.window < r.window and x.resident_first == prev_k]
                lines.append(
                    ("   " if kcol else "")
                    + f"  {'...':>3}  W={skipped[0].window}{'..' + str(skipped[-1].window) if len(skipped) > 1 else ''}: the same step time; memory grows "
                    f"{format_bytes((skipped[-1].peak_device_bytes - skipped[0].peak_device_bytes) / max(1, len(skipped) - 1))} per window"
                )
            mark = "  <- chosen" if (r.window, r.resident_first) == (self.window, self.resident_first) else ""
            rel = f"{100 * (r.step_s / best - 1):+.1f}%" if best else ""
            lines.append(
                (f"  {r.resident_first}" if kcol else "")
                + f"  {r.window:>3}  {format_seconds(r.step_s):>13}  {format_bytes(r.peak_device_bytes):>14}  "
                f"{'yes' if r.fits else 'no':>4}  {_shares(r):<33} {rel:>8}{mark}"
            )
            prev_shown, prev_k = r.window, r.resident_first
        return "\n".join(lines)

    def _shown(self, max_rows: int) -> set[tuple[int, int]]:
        key = lambda r: (r.resident_first, r.window)  # noqa: E731
        if len(self.rows) <= max_rows:
            return {key(r) for r in self.rows}
        keep = {(self.resident_first, self.window), (self.resident_first, self.best_window)}
        for k in {r.resident_first for r in self.rows}:
            rs = [r for r in self.rows if r.resident_first == k]
            keep |= {key(rs[0]), key(rs[-1])}
            for a, b in zip(rs, rs[1:]):
                if abs(b.step_s - a.step_s) > 1e-3 * a.step_s or a.fits != b.fits:
                    keep |= {key(a), key(b)}
        return keep

    def host_table(self) -> str:
        """One row per host window tried (the NVMe tier); empty without it."""
        if not self.host_rows:
            return ""
        best = min(r.step_s for r in self.host_rows if r.fits) if any(r.fits for r in self.host_rows) else None
        icol = any(r.image_window is not None for r in self.host_rows)  # (the parameter tier: H and I)
        ww, of = (16, "of which windows") if icol else (15, "of which window")
        lines = [f"  {'H':>3}" + (f"  {'I':>3}" if icol else "")
                 + f"  {'step (pred.)':>13}  {'host memory':>12}  {of:>{ww}}  {'fits':>4}  {'SSD on path':>11}  {'vs best':>8}"]  # fmt: skip
        for r in self.host_rows:
            mark = "  <- chosen" if (r.host_window, r.image_window) == (self.host_window, self.image_window) else ""
            rel = f"{100 * (r.step_s / best - 1):+.1f}%" if best else ""
            lines.append(
                f"  {r.host_window:>3}" + (f"  {r.image_window:>3}" if icol else "")
                + f"  {format_seconds(r.step_s):>13}  {format_bytes(r.host_bytes):>12}  "
                f"{format_bytes(r.window_bytes):>{ww}}  {'yes' if r.fits else 'no':>4}  {format_seconds(r.ssd_s):>11}  {rel:>8}{mark}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        host = self.host_table()
        return self.table() + ("\n" + host if host else "") + "\n" + self.reason


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
    if r.bottleneck == "ssd":
        ssd = r.by_resource.get("ssd", 0.0) / tot
        return f"SSD-bound: {100 * ssd:.0f}% of the critical path waits for the NVMe tier's reads and write-backs"
    return f"host-optimizer-bound: {100 * host:.0f}% of the critical path waits for host updates"


def _explain(rows: list[WindowRow], chosen: WindowRow, best: WindowRow, tolerance: float, capacity: int | None) -> str:
    k = chosen.resident_first
    all_rows = rows
    rows = [r for r in rows if r.resident_first == k]
    parts = [
        (f"chose resident_first={k}, window {chosen.window}" if len({r.resident_first for r in all_rows}) > 1 else f"chose window {chosen.window}")
        + f": predicted {format_seconds(chosen.step_s)} per step, "
        + (
            "the fastest that fits"
            if chosen.window == best.window
            else f"within {100 * tolerance:.0f}% of the fastest that fits "
            f"({'k=' + str(best.resident_first) + ', ' if best.resident_first != k else ''}W={best.window}, {format_seconds(best.step_s)})"
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
    ks = sorted({r.resident_first for r in all_rows})
    if len(ks) > 1:
        def best_at(kk: int) -> WindowRow | None:
            fit = [r for r in all_rows if r.resident_first == kk and r.fits]
            return min(fit, key=lambda r: (r.step_s, r.window)) if fit else None

        base = best_at(0)
        if k > 0 and base is not None:
            parts.append(
                f"Keeping the first {k} stage(s) on the device with their optimizer saves "
                f"{100 * (1 - chosen.step_s / base.step_s):.1f}% against the best k=0 (W={base.window}, "
                f"{format_seconds(base.step_s)}): the next forward need not wait for their host updates."
            )
        elif k == 0:
            others = [b for b in (best_at(kk) for kk in ks if kk > 0) if b is not None]
            if others:
                o = min(others, key=lambda r: r.step_s)
                parts.append(
                    f"Keeping first stages on the device (best: k={o.resident_first}, W={o.window}, "
                    f"{format_seconds(o.step_s)}) gains too little for its memory."
                )
            else:
                parts.append("Keeping first stages on the device does not fit the budget.")
    return " ".join(parts)


def tune_window(
    specs: Sequence[StageSpec],
    costs: CostModel,
    *,
    capacity_bytes: int | None = None,
    reserve_bytes: int = 0,
    tolerance: float = 0.02,
    policy: Policy | Callable[[Sequence[StageSpec], int], Program] = Stronghold(window="auto"),
    windows: Sequence[int] | None = None,
    resident_first: Sequence[int] | None = None,
    rollback: bool | float = False,
    host_windows: Sequence[int] | None = None,
    host_capacity_bytes: int | None = None,
    ranks: int = 1,
    features: Sequence[tuple[Any, dict]] = (),
    param_tier: bool = False,
    image_window: int | str | None = None,
    masters: bool = False,
    host_terms: Callable[[Program], dict[str, int]] | None = None,
) -> TuneResult:
    """Pick a window (see the module docstring).

    Args:
        specs: the stages.
        costs: the cost model (profiled or analytic).
        capacity_bytes: device budget; a window fits when its simulated peak (the memory
            ledger's: slots, activations, gradients, the model's inputs) plus ``reserve_bytes``
            (memory to keep free besides, e.g. a GPU's workspace) is at most this.
        tolerance: how much slower than the best a smaller window may be predicted.
        policy: the policy to tune, a windowed :class:`~shfx.passes.policies.Policy`
            (default ``Stronghold(window="auto")``) or a function ``(specs, window) -> Program``.
            Its ``"auto"`` fields are tuned: the window over 1..stages, and STRONGHOLD's
            ``resident_first`` (k) too; a number stays fixed.
        windows: the windows to try (default 1..number of stages, or the policy's window when
            it is a number).
        resident_first: the k to try for :class:`~shfx.passes.policies.Stronghold` (default: all
            when the policy's is ``"auto"``, else its own); windows then run over 1..(stages - k).
        rollback: the host updates also pay the step journal's rollback copies
            (:func:`~shfx.cost_model.simulate.simulate`'s ``rollback``; ``shfx.compile`` keeps
            them in fp16 and with ``rollback=True``).
        host_windows: the host windows to try for a policy with the NVMe tier and
            ``host_window="auto"`` (default 1..groups on the SSD).
        ranks: data parallel: the windows' programs run by this many ranks
            (:func:`~shfx.passes.schedule.data_parallel_program`: the collectives on the
            network, ``costs.links.net_bps`` needed); ``resident_first`` is then 0.
        host_capacity_bytes: host budget for the NVMe tier's host window: an H fits when the
            ledger's host memory (:func:`shfx.passes.ledger.replay`, setup) is at most this.
        features: the configuration's feature passes (one rank:
            :func:`shfx.passes.pipeline.candidate_passes` of the train program), run on every
            candidate before it is timed, so the tuner prices the program that will run
            (updates in ``step()``, the journal's copies ``SN``, fp16's unscales ``US``); a
            candidate a pass refuses is left out.
        param_tier: the parameter tier (``Offload(params="nvme")``): each candidate gets its
            image reads and write-backs (:func:`~shfx.passes.policies.add_param_tier`, ``masters``
            its fp32 masters too) before the features, with ``image_window`` image buffers: an
            int, None (the fewest the candidate's order needs, plus one) or ``"auto"``: chosen
            with the host window H, over the fewest the order needs to three more, by H's rule.
        host_terms: the host terms of a candidate program, ``{term: bytes}`` (default: the
            ledger's static host terms of :func:`shfx.passes.ledger.replay`), whose sum
            ``host_capacity_bytes`` bounds; a compiled model passes its variant's (its groups' real
            masters and working copies).

    Raises:
        NoWindowFits: when no window fits the budget (or no host window the host budget).

    >>> from shfx.passes.stages import chain
    >>> from shfx.cost_model.costs import CostTable, Links, StageCost
    >>> costs = CostTable([StageCost(1.0, 3.0, update_s=0.5)] * 6, Links(1e6, 1e6, ssd_read_bps=1e6, ssd_write_bps=1e6))
    >>> r = tune_window(chain(6, prefetch_bytes=500_000), costs, policy=ZeroInfinity(nvme=True))
    >>> r.host_window, [x.host_window for x in r.host_rows], r.policy.host_window
    (3, [1, 2, 3, 4, 5, 6], 3)
    """
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be an int >= 1 (data-parallel processes), got {ranks!r}")
    n = len(specs)
    pol = resolve_policy(policy, "auto") if not isinstance(policy, Policy) else policy
    tune_i = param_tier and image_window == "auto"
    if image_window is not None and not param_tier:
        raise ValueError("image_window sets the parameter tier's image buffers: it needs param_tier=True")
    if image_window is not None and image_window != "auto" and (isinstance(image_window, bool) or not isinstance(image_window, int) or image_window < 1):
        raise ValueError(f"image_window must be an int >= 1, None or 'auto', got {image_window!r}")
    tune_h = "host_window" in pol.auto
    if not pol.windowed and not tune_h:
        raise ValueError(f"policy {pol.name!r} has no window to tune")
    if (tune_h or param_tier) and ranks > 1:
        raise ValueError(f"data parallel ({ranks} ranks) with the NVMe tier is not modelled; tune without one of them")
    lower = _Lowering(specs, features, param_tier, masters, host_terms)
    hw_fixed = None if tune_h else getattr(pol, "host_window", None)
    if tune_h:
        # NOTE: (k, W) are chosen at the largest host window (no SSD stall the window could
        # hide), then H at the chosen (k, W); H barely moves the device side, W not the host
        pol = pol.replace(host_window=n)
    host_grid = tune_h or tune_i
    iw_first = None if tune_i else image_window  # ((k, W) with the default image buffers when I is tuned)
    if not pol.windowed:
        return _tune_host_window(lower, costs, pol, tolerance, host_windows if tune_h else [hw_fixed], host_capacity_bytes,
                                 rollback, None, image_window)  # fmt: skip
    has_k = "resident_first" in pol.options()
    if resident_first is not None:
        if not has_k:
            raise ValueError(f"resident_first is a refinement of the 'stronghold' policy; {pol.name!r} does not take it")
        ks = sorted(set(resident_first))
        if not ks or ks[0] < 0 or ks[-1] >= n:
            raise ValueError(f"resident_first values must be in 0..{n - 1} (the model has {n} stages), got {list(resident_first)}")
    elif has_k and pol.resident_first == "auto":
        ks = [0] if ranks > 1 else list(range(n))  # (data parallel: every group updated on the host)
    else:
        ks = [int(pol.resident_first) if has_k else 0]
    pairs: list[tuple[int, int]] = []
    for k in ks:
        if windows is not None:
            ws = list(windows)
        elif pol.window == "auto" or len(ks) > 1:
            ws = list(range(1, n - k + 1))
        else:
            ws = [pol.window]
        pairs += [(k, w) for w in ws]

    rows = []
    for k, w in pairs:
        concrete = pol.replace(window=w, **({"resident_first": k} if has_k else {}))
        try:
            prog = lower(concrete, iw_first)
        except PassRefused:
            continue  # (a feature this candidate cannot run: clipping in step() with device updates)
        except ScheduleError:
            if not param_tier:
                raise
            continue  # (a fixed image_window fewer than this window's order needs)
        tl = simulate(data_parallel_program(prog, ranks), costs, rollback=rollback)
        need = tl.peak_device_bytes + reserve_bytes
        fits = capacity_bytes is None or need <= capacity_bytes
        if fits and host_grid and host_capacity_bytes is not None:
            # (a window whose least host memory, one host-window buffer and the fewest image
            # buffers its order needs, is over the host budget cannot be chosen: no H, I fits)
            fits = _least_host_bytes(lower, concrete, image_window) <= host_capacity_bytes
        rows.append(WindowRow(w, tl.step_s, need, fits, tl.bottleneck, dict(tl.by_resource), tl, k, concrete))
    if not rows:
        raise ValueError(f"every candidate of {pol!r} was refused by a feature pass ({', '.join(p.name for p, _ in features)})")
    feasible = [r for r in rows if r.fits]
    if not feasible:
        smallest = min(rows, key=lambda r: r.peak_device_bytes)
        if host_grid and host_capacity_bytes is not None and (capacity_bytes is None or smallest.peak_device_bytes <= capacity_bytes):
            least = min(_least_host_bytes(lower, r.policy, image_window) for r in rows)
            raise NoWindowFits(
                f"no window fits the host budget of {format_bytes(host_capacity_bytes)}: even one host-window buffer and "
                f"the fewest image buffers need {format_bytes(least)} of host memory (masters, gradients and the windows' buffers)",
                rows, what="host",
            )  # fmt: skip
        raise NoWindowFits(
            f"no window fits the device budget of {format_bytes(capacity_bytes or 0)}: even W={smallest.window} "
            f"needs {format_bytes(smallest.peak_device_bytes)} (its slot plus the activations kept for backward)",
            rows,
        )
    best = min(feasible, key=lambda r: (r.step_s, r.window))
    near = [r for r in feasible if r.step_s <= best.step_s * (1 + tolerance)]
    if len(ks) == 1:
        chosen = min(near, key=lambda r: r.window)
    else:
        chosen = min(near, key=lambda r: (r.peak_device_bytes, r.resident_first, r.window))
    result = TuneResult(
        rows=rows,
        window=chosen.window,
        best_window=best.window,
        tolerance=tolerance,
        capacity_bytes=capacity_bytes,
        reason=_explain(rows, chosen, best, tolerance, capacity_bytes),
        source=getattr(costs, "source", ""),
        resident_first=chosen.resident_first,
        policy=chosen.policy,
    )
    if param_tier:
        assert chosen.policy is not None
        result.image_window = lower(chosen.policy, iw_first).image_window
    if host_grid:
        assert chosen.policy is not None
        h = chosen.policy.program(specs).host_window  # (a function policy has no placement: its program says)
        result.reason = f"At the largest host window (H={h}): " + result.reason if tune_h else result.reason
        return _tune_host_window(lower, costs, chosen.policy, tolerance, host_windows if tune_h else [hw_fixed],
                                 host_capacity_bytes, rollback, result, image_window)  # fmt: skip
    return result


def _least_host_bytes(lower: _Lowering, pol: Policy, image_window: int | str | None) -> int:
    """The least host memory ``pol``'s program can hold: one host-window buffer and (the
    parameter tier, ``image_window`` ``"auto"``) the fewest image buffers its order needs."""
    one = pol.replace(host_window=1) if "host_window" in pol.options() else pol
    iw = max(1, lower.least_image_window(one)) if lower.param_tier and image_window == "auto" else image_window
    try:
        return lower.host_terms(lower(one, iw))[0]
    except ScheduleError:  # (a fixed image_window fewer than this order needs: it cannot run)
        return 1 << 62


class _Lowering:
    """A candidate policy's program as the training would run it: the policy's lowering, the
    parameter tier (``param_tier``: with ``image_window`` buffers, None the default), the
    configuration's feature passes; and its host memory (``host_terms``, default the ledger's)."""

    def __init__(self, specs: Sequence[StageSpec], features: Sequence[tuple[Any, dict]], param_tier: bool, masters: bool,
                 host_terms: Callable[[Program], dict[str, int]] | None):  # fmt: skip
        self.specs, self.features, self.param_tier, self.masters = specs, features, param_tier, masters
        self._host_terms = host_terms

    def __call__(self, concrete: Policy, image_window: int | None = None) -> Program:
        prog = concrete.program(self.specs)
        if self.param_tier:
            prog = add_param_tier(prog, image_window, masters=self.masters)
        return run_passes(prog, self.features)

    def least_image_window(self, concrete: Policy) -> int:
        return least_image_window(concrete.program(self.specs))

    def host_terms(self, prog: Program) -> tuple[int, int]:
        """The host bytes of ``prog`` and, of them, its SSD windows' buffers (one replay)."""
        from shfx.passes.ledger import HOST_WINDOW, IMAGE_WINDOW, replay

        host = self._host_terms(prog) if self._host_terms is not None else replay(prog).static("host")
        return sum(host.values()), host.get(HOST_WINDOW, 0) + host.get(IMAGE_WINDOW, 0)


def _tune_host_window(
    lower: _Lowering,
    costs: CostModel,
    pol: Policy,
    tolerance: float,
    host_windows: Sequence[int | None] | None,
    host_capacity_bytes: int | None,
    rollback: bool | float,
    result: TuneResult | None,
    image_window: int | str | None = None,
) -> TuneResult:
    """Choose the host window of ``pol`` (its other fields concrete), and with the parameter
    tier and ``image_window="auto"`` its image buffers too: among the (H, I) whose host memory
    fits ``host_capacity_bytes``, the one holding the least host memory whose step time is within
    ``tolerance`` of the fastest (without the tier: the smallest such H)."""
    specs = lower.specs
    groups = len(pol.replace(host_window=1).program(specs).ssd_groups)
    if not groups:
        raise ValueError(f"{pol!r} puts no optimizer state on the SSD (every group is updated on the device): no host window to tune")
    hs = sorted(set(host_windows)) if host_windows is not None else list(range(1, groups + 1))
    if not hs or hs[0] is None or hs[0] < 1:
        raise ValueError(f"host_windows must be ints >= 1, got {host_windows!r}")
    if image_window == "auto":
        least = max(1, lower.least_image_window(pol.replace(host_window=1)))
        paged = len(param_tier_groups(pol.replace(host_window=1).program(specs)))
        iws: list[int | None] = list(range(least, max(least, min(least + 3, paged)) + 1))
    else:
        iws = [image_window]
    rows: list[HostWindowRow] = []
    for h in hs:
        for iw in iws:
            concrete = pol.replace(host_window=h)
            try:
                prog = lower(concrete, iw)
            except ScheduleError:
                if not lower.param_tier:
                    raise
                continue  # (a fixed image_window fewer than this order needs)
            tl = simulate(prog, costs, rollback=rollback)
            need, window = lower.host_terms(prog)
            fits = host_capacity_bytes is None or need <= host_capacity_bytes
            rows.append(HostWindowRow(h, tl.step_s, need, window, tl.by_resource.get("ssd", 0.0), fits, tl.bottleneck, tl,
                                      concrete, prog.image_window if lower.param_tier else None))  # fmt: skip
    if not rows:
        raise ScheduleError(f"image_window={image_window} is fewer than {pol!r}'s order needs (the least: {lower.least_image_window(pol)})")
    feasible = [r for r in rows if r.fits]
    if not feasible:
        small = min(rows, key=lambda r: r.host_bytes)
        what = f"H={small.host_window}" + (f", I={small.image_window}" if small.image_window is not None else "")
        raise NoWindowFits(
            f"no host window fits the host budget of {format_bytes(host_capacity_bytes or 0)}: even {what} "
            f"needs {format_bytes(small.host_bytes)} of host memory (masters, gradients and the window's buffers)",
            rows, what="host",
        )
    best = min(feasible, key=lambda r: (r.step_s, r.host_bytes))
    chosen = min((r for r in feasible if r.step_s <= best.step_s * (1 + tolerance)), key=lambda r: (r.host_bytes, r.host_window, r.image_window or 0))
    why = _explain_host(rows, chosen, best, tolerance, host_capacity_bytes, groups)
    if result is None:  # the window was not tuned: a one-row window table of the chosen program
        tl = chosen.timeline
        w = getattr(pol, "window", 0) or 0
        row = WindowRow(w, tl.step_s, tl.peak_device_bytes, True, tl.bottleneck, dict(tl.by_resource), tl, 0, chosen.policy)
        result = TuneResult([row], w, w, tolerance, None, "", getattr(costs, "source", ""), 0, chosen.policy)
    result.host_window = chosen.host_window
    result.image_window = chosen.image_window
    result.host_rows = rows
    result.policy = chosen.policy
    result.reason = (result.reason + " " if result.reason else "") + why
    return result


def _explain_host(rows: list[HostWindowRow], chosen: HostWindowRow, best: HostWindowRow, tolerance: float, capacity: int | None, groups: int) -> str:
    def name(r: HostWindowRow) -> str:
        return f"H={r.host_window}" + (f", I={r.image_window}" if r.image_window is not None else "")

    tier = chosen.image_window is not None
    images = f"{chosen.image_window} image" + ("s" if chosen.image_window != 1 else "")
    what = (f"{chosen.host_window} of the {groups} groups' masters, gradients and optimizer states and {images}"
            if tier else f"{chosen.host_window} of the {groups} groups' optimizer states")  # fmt: skip
    parts = [
        (f"Host window {chosen.host_window}, image window {chosen.image_window}" if tier else f"Host window {chosen.host_window}")
        + f" (of {groups} groups on the SSD): predicted {format_seconds(chosen.step_s)} per step, "
        + ("the fastest" if chosen is best else
           f"within {100 * tolerance:.0f}% of the fastest ({name(best)}, {format_seconds(best.step_s)})")
        + f"; host RAM holds {what} at a time ({format_bytes(chosen.window_bytes)} of window buffers)."
    ]  # fmt: skip
    smaller = [r for r in rows if r.host_bytes < chosen.host_bytes and r.fits]
    unfit = [r for r in rows if not r.fits]
    if smaller:
        s = max(smaller, key=lambda r: r.host_bytes)
        parts.append(
            f"{name(s)} would be {100 * (s.step_s / chosen.step_s - 1):.0f}% slower: each read there waits for the "
            f"write-back that frees its buffer (critical path: {format_seconds(s.ssd_s)} on the SSD, bottleneck {s.bottleneck})."
        )
    elif chosen.ssd_s > 0.05 * chosen.step_s:
        larger = "a larger window that fits hides no more of it" if unfit else "a larger window hides no more of it"
        parts.append(f"The SSD is on the critical path for {format_seconds(chosen.ssd_s)}: {larger}.")
    if unfit and capacity is not None:
        u = min(unfit, key=lambda r: r.host_bytes)
        label = name(u) if tier else f"H>={u.host_window}"  # (without the tier host memory grows with H)
        parts.append(f"{label} does not fit: it needs {format_bytes(u.host_bytes)} of {format_bytes(capacity)} host memory.")
    return " ".join(parts)
