"""STRONGHOLD experiment 4: iteration time as the model grows (it should grow linearly).

    python examples/paper/time_vs_layers.py                          # REFERENCE GPT on V100-32GB-PCIe3, 8..128 layers
    python examples/paper/time_vs_layers.py --layers 16:257:16
    python examples/paper/time_vs_layers.py --real                   # small GPT on the emulated device, 2..12 layers

Per layer count, one step of every policy that fits (simulation: the planner decides; ``--real``:
a run that raises ``shfx.OutOfDeviceMemory`` or exceeds the host budget does not), and per
policy a least-squares line through its points: seconds per layer, intercept, and the largest
relative residual (how linear it is).
"""

from __future__ import annotations

from common import POLICIES, Clock, Table, finish, int_list, num_params, parse_args, run_policies, save_plot

NAME = "time_vs_layers"


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Slope, intercept, largest |residual| / y of a least-squares line."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    icpt = my - slope * mx
    return slope, icpt, max(abs(y - (icpt + slope * x)) / y for x, y in zip(xs, ys))


def main(argv: list[str] | None = None) -> Table:
    setup, args = parse_args(__doc__, argv, lambda p: p.add_argument(
        "--layers", type=int_list, default=None, help="layer counts: 8:129:8 or 2,4,8 (default: 8:129:8; 2:13:2 --real)"))
    clock = Clock()
    print(setup.describe())
    layers = args.layers or int_list("2:13:2" if setup.real else "8:129:8")
    labels = [setup.label(p) for p in POLICIES]
    table = Table(
        f"Iteration time (s) vs layers ({setup.mode}" + ("" if setup.real else f", {setup.hardware.name}") + ")",
        ["layers", "params M" if setup.real else "params B"] + labels,
    )
    points: dict[str, list[tuple[int, float]]] = {p: [] for p in POLICIES}
    stopped: set[str] = set()
    all_runs: list = []
    for n in layers:
        todo = [p for p in POLICIES if p not in stopped]  # --real: not those that did not fit at a smaller size
        runs = dict(zip(todo, run_policies([(setup, p, n) for p in todo])))
        all_runs += runs.values()
        row = []
        for policy in POLICIES:
            r = runs.get(policy)
            if r is not None and r.step_s is not None:
                points[policy].append((n, r.step_s))
            elif r is not None and setup.real:  # planned sizes are cheap to check; tried ones are not
                stopped.add(policy)
            row.append(r.step_s if r is not None else None)
        params = num_params(setup.family, n) / (1e6 if setup.real else 1e9)
        table.add(n, params, *row)
        print(f"  {n} layers done ({clock})", flush=True)
    for policy in POLICIES:
        pts = points[policy]
        if len(pts) >= 3:
            s, c, res = linear_fit([x for x, _ in pts], [y for _, y in pts])
            table.notes.append(f"{setup.label(policy)}: T = {c:.4f} s + {s * 1e3:.2f} ms x layers over {len(pts)} sizes "
                               f"({pts[0][0]}..{pts[-1][0]}), max residual {100 * res:.1f}%")
        elif pts:
            table.notes.append(f"{setup.label(policy)}: fits at {len(pts)} size(s) only, up to {pts[-1][0]} layers")
        else:
            table.notes.append(f"{setup.label(policy)}: does not fit at any size tried")
    table.notes.append("-: does not fit" + (" (and not tried at larger sizes)" if setup.real else " (planner)"))

    def draw(ax):
        for policy, label in zip(POLICIES, labels):
            pts = points[policy]
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", ms=3, label=label)
        ax.set(xlabel="layers", ylabel="iteration time (s)", title=f"Iteration time vs layers ({setup.mode})")
        ax.legend(fontsize=8)

    plot = save_plot(setup, NAME, draw)
    finish(setup, table, NAME, clock, plot, runs=all_runs)
    return table


if __name__ == "__main__":
    main()
