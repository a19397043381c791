"""STRONGHOLD experiment 1: the largest model each method can train.

    python examples/paper/largest_model.py                             # REFERENCE GPT on V100-32GB-PCIe3, planned
    python examples/paper/largest_model.py --hardware A100-80GB-PCIe4  # any profile of shfx.cost_model.hardware
    python examples/paper/largest_model.py --real                      # small GPT on the emulated device, by trying

Simulation: :func:`shfx.cost_model.planner.largest_trainable` per policy: the most layers whose
device, host (and SSD) memory fit, and which of them binds; next to it the simulator's device
peak at that size (slots, activations, gradient buffers, device optimizer states: no GPU
workspace) as a cross-check. ``--real``: the largest layer count at which the small GPT trains
on the emulated device (compiled and trained two steps per try; ``shfx.OutOfDeviceMemory`` or
more host bytes than ``--host-memory`` = does not fit), searched from the planner's prediction,
which is printed beside it.

The paper's claim (REFERENCE.md): STRONGHOLD trains 1.9x-6.5x larger models than the other
offloading systems on a 32 GB V100.
"""

from __future__ import annotations

from common import (
    GiB, MiB, PAPER_NAME, POLICIES, Clock, Table, finish, largest_layers, largest_tried, num_params, parse_args,
    run_policy, save_plot,
)

NAME = "largest_model"
SIM_PEAK_MAX_LAYERS = 1000  # simulate the step for the cross-check only up to this size (time)


def main(argv: list[str] | None = None) -> Table:
    setup, _ = parse_args(__doc__, argv)
    clock = Clock()
    print(setup.describe())
    rows: dict[str, dict] = {}
    tried = []
    for policy in POLICIES:
        pred = largest_layers(setup, policy)
        row = {"pred": pred}
        if setup.real:
            print(f"  {setup.label(policy)}: planner says {pred.layers} layers ({pred.binding}); trying...", flush=True)
            layers, above, runs = largest_tried(setup, policy, max(1, pred.layers))
            at = next((r for r in runs if r.layers == layers), None)
            row.update(layers=layers, above=above, at=at)
            tried += runs
        else:
            layers = pred.layers
            at = run_policy(setup, policy, layers, force=True) if 0 < layers <= SIM_PEAK_MAX_LAYERS else None
            row.update(layers=layers, at=at)
            tried += [at] if at else []
        rows[policy] = row

    sh = rows["stronghold"]["layers"]
    sh_params = num_params(setup.family, sh) if sh else 0
    if setup.real:
        table = Table(
            f"Largest trainable model, measured on the emulated device (planner's prediction beside it)",
            ["policy", "method", "measured layers", "params M", "stronghold x", "planner layers", "planner binds",
             "device peak MiB", "host MiB", f"at +1 layer"],
        )
        for policy, r in rows.items():
            n, at, above = r["layers"], r["at"], r["above"]
            p = num_params(setup.family, n) if n else 0
            cap = n >= setup.max_layers
            table.add(
                setup.label(policy), PAPER_NAME[policy], f">={n}" if cap else n, p / 1e6,
                sh_params / p if p else None, r["pred"].layers, r["pred"].binding,
                at.peak_device_bytes / MiB if at and at.peak_device_bytes else None,
                at.host_bytes / MiB if at and at.host_bytes else None,
                "(search cap)" if cap else (above.why if above else "-"),
            )
        table.notes.append("host MiB: what the runtime allocates on the host (weights, gradients, buffers) + host AdamW "
                           "states; the host limit is emulated (--host-memory), the device's is the emulated device's own")
    else:
        table = Table(
            f"Largest trainable model, planned for {setup.hardware.name}",
            ["policy", "method", "layers", "params B", "stronghold x", "binds", "device GiB", "host GiB", "ssd GiB",
             "sim peak GiB"],
        )
        for policy, r in rows.items():
            pred, at = r["pred"], r["at"]
            n = r["layers"]
            p = num_params(setup.family, n) if n else 0
            bd = pred.breakdown
            table.add(
                setup.label(policy), PAPER_NAME[policy], n, p / 1e9, sh_params / p if p else None, pred.binding,
                bd.device_total / GiB, sum(bd.host.values()) / GiB, sum(bd.ssd.values()) / GiB if bd.ssd else 0.0,
                at.peak_device_bytes / GiB if at and at.peak_device_bytes else None,
            )
        table.notes.append("device/host/ssd GiB: the planner's breakdown at that size (device includes GPU workspace); "
                           "sim peak: the simulator's device peak (no workspace)")
    table.notes.append("stronghold x: stronghold's params / the policy's params (the paper: 1.9x-6.5x over offloading systems)")

    def draw(ax):
        names = [setup.label(p) for p in POLICIES]
        if setup.real:
            xs = range(len(names))
            ax.bar([x - 0.2 for x in xs], [rows[p]["layers"] for p in POLICIES], 0.4, label="measured")
            ax.bar([x + 0.2 for x in xs], [rows[p]["pred"].layers for p in POLICIES], 0.4, label="planner")
            ax.set_xticks(list(xs), names, rotation=20, fontsize=8)
            ax.set(ylabel="largest layers", title=f"Largest trainable model (emulated device)")
            ax.legend(fontsize=8)
        else:
            vals = [num_params(setup.family, rows[p]["layers"]) / 1e9 if rows[p]["layers"] else 0 for p in POLICIES]
            bars = ax.bar(names, vals, color=["C0", "C1", "C2", "C3", "C4"])
            for b, p in zip(bars, POLICIES):
                ax.annotate(f"{rows[p]['layers']} layers", (b.get_x() + b.get_width() / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=8)
            ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
            ax.set(ylabel="parameters (billions)", title=f"Largest trainable model ({setup.hardware.name})")

    plot = save_plot(setup, NAME, draw)
    finish(setup, table, NAME, clock, plot, runs=tried)
    return table


if __name__ == "__main__":
    main()
