"""STRONGHOLD experiment 3: every method at the largest size where plain Megatron-LM still fits.

    python examples/paper/all_at_resident_largest.py                  # REFERENCE GPT on V100-32GB-PCIe3, simulated
    python examples/paper/all_at_resident_largest.py --hardware H100-80GB-PCIe5
    python examples/paper/all_at_resident_largest.py --real           # small GPT on the emulated device, measured

The size is the ``resident`` policy's largest trainable layer count (simulation: the planner;
``--real``: by trying). At that size every policy runs one step: step time, tokens/s, samples/s,
model TFLOP/s (6 x params x tokens / step) and throughput relative to ``resident``, with the
simulated bottleneck (or, ``--real``, the measured device peak).
"""

from __future__ import annotations

from common import (
    GiB, MiB, PAPER_NAME, POLICIES, Clock, Table, finish, largest_layers, largest_tried, parse_args, run_policies,
    save_plot, throughput,
)

NAME = "all_at_resident_largest"


def main(argv: list[str] | None = None) -> Table:
    setup, _ = parse_args(__doc__, argv)
    clock = Clock()
    print(setup.describe())
    pred = largest_layers(setup, "resident")
    if setup.real:
        print(f"  resident: planner says {pred.layers} layers; trying...", flush=True)
        layers, _, _ = largest_tried(setup, "resident", max(1, pred.layers))
    else:
        layers = pred.layers
    if layers < 1:
        raise SystemExit("resident does not fit even one layer: nothing to compare")
    mem_unit, mem_scale = ("MiB", MiB) if setup.real else ("GiB", GiB)
    table = Table(
        f"All policies at resident's largest size, {layers} layers ({setup.mode}"
        + ("" if setup.real else f", {setup.hardware.name}") + ")",
        ["policy", "method", "step s", "tok/s", "samples/s", "TFLOP/s", "vs resident", "bound",
         f"device peak {mem_unit}"],
    )
    print(f"  every policy at {layers} layers...", flush=True)
    runs = dict(zip(POLICIES, run_policies([(setup, p, layers) for p in POLICIES])))
    base = throughput(setup, runs["resident"])["tokens_per_s"]
    for policy, r in runs.items():
        t = throughput(setup, r)
        peak = r.peak_device_bytes if setup.real else r.planned_device_bytes
        table.add(
            setup.label(policy), PAPER_NAME[policy], r.step_s, t["tokens_per_s"], t["samples_per_s"], t["tflops"],
            t["tokens_per_s"] / base if base and t["tokens_per_s"] else None,
            r.bottleneck or ("-" if r.fits else r.why), peak / mem_scale if peak else None,
        )
    table.notes.append(f"{layers} layers = {runs['resident'].params / 1e6:.1f} M parameters; "
                       "vs resident = tokens/s relative to resident (Megatron-LM)")
    table.notes.append("device peak: " + ("the emulated device's measured peak" if setup.real
                                          else "the planner's device total (with GPU workspace)"))

    def draw(ax):
        names = [setup.label(p) for p in POLICIES]
        vals = [throughput(setup, runs[p])["tokens_per_s"] or 0 for p in POLICIES]
        ax.bar(names, vals, color=["C0", "C1", "C2", "C3", "C4"])
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
        ax.set(ylabel="tokens/s", title=f"All policies at {layers} layers (resident's largest, {setup.mode})")

    plot = save_plot(setup, NAME, draw)
    finish(setup, table, NAME, clock, plot, runs=list(runs.values()))
    return table


if __name__ == "__main__":
    main()
