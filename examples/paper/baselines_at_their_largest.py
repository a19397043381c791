"""STRONGHOLD experiment 2: each baseline at its own largest size, against STRONGHOLD at that size.

    python examples/paper/baselines_at_their_largest.py                 # REFERENCE GPT on V100-32GB-PCIe3, simulated
    python examples/paper/baselines_at_their_largest.py --window 2 --resident-first 0
    python examples/paper/baselines_at_their_largest.py --real          # small GPT on the emulated device, measured

For each baseline (``resident`` = Megatron-LM, ``l2l``, ``zero-offload``, ``zero-infinity``): its
largest trainable layer count (simulation: the planner; ``--real``: by trying, from the
planner's prediction), then one step of the baseline and one of ``stronghold`` at that size:
step time, tokens/s and model TFLOP/s (6 x params x tokens / step), and the speedup of
stronghold's throughput over the baseline's.

The paper's claim (REFERENCE.md): 1.2x-3.7x higher throughput than the baselines.
"""

from __future__ import annotations

from common import (
    BASELINES, PAPER_NAME, Clock, Table, finish, largest_layers, largest_tried, parse_args, run_policies, save_plot,
    throughput,
)

NAME = "baselines_at_their_largest"


def main(argv: list[str] | None = None) -> Table:
    setup, _ = parse_args(__doc__, argv)
    clock = Clock()
    print(setup.describe())
    sh = setup.label("stronghold")
    unit = "M" if setup.real else "B"
    scale = 1e6 if setup.real else 1e9
    table = Table(
        f"Each baseline at its largest size vs {sh} at that size ({setup.mode}"
        + ("" if setup.real else f", {setup.hardware.name}") + ")",
        ["baseline", "method", "layers", f"params {unit}", "base step s", "base tok/s", "base TFLOP/s", "sh step s",
         "sh tok/s", "sh TFLOP/s", "speedup", "base bound", "sh bound"],
    )
    results = []
    all_runs = []
    for policy in BASELINES:
        pred = largest_layers(setup, policy)
        if setup.real:
            print(f"  {policy}: planner says {pred.layers} layers; trying...", flush=True)
            layers, _, _ = largest_tried(setup, policy, max(1, pred.layers))
        else:
            layers = pred.layers
        if layers < 1:
            table.add(policy, PAPER_NAME[policy], 0, None, None, None, None, None, None, None, None, "-", "-")
            continue
        print(f"  {policy} and stronghold at {layers} layers...", flush=True)
        base, strong = run_policies([(setup, policy, layers), (setup, "stronghold", layers)])
        tb, ts = throughput(setup, base), throughput(setup, strong)
        speedup = ts["tokens_per_s"] / tb["tokens_per_s"] if tb["tokens_per_s"] and ts["tokens_per_s"] else None
        table.add(
            policy, PAPER_NAME[policy], layers, base.params / scale, base.step_s, tb["tokens_per_s"], tb["tflops"],
            strong.step_s, ts["tokens_per_s"], ts["tflops"], speedup,
            base.bottleneck or ("-" if base.fits else base.why), strong.bottleneck or ("-" if strong.fits else strong.why),
        )
        results.append((policy, layers, tb["tokens_per_s"], ts["tokens_per_s"]))
        all_runs += [base, strong]
    table.notes.append(f"sh = {sh}; speedup = stronghold tokens/s / baseline tokens/s (the paper: 1.2x-3.7x)")
    table.notes.append("TFLOP/s = 6 x params x tokens / step time (model FLOPs, per device)")
    if not setup.real:
        table.notes.append("bound: the resource with most of the simulated critical path")

    def draw(ax):
        xs = range(len(results))
        ax.bar([x - 0.2 for x in xs], [r[2] or 0 for r in results], 0.4, label="baseline")
        ax.bar([x + 0.2 for x in xs], [r[3] or 0 for r in results], 0.4, label=sh)
        ax.set_xticks(list(xs), [f"{r[0]}\n{r[1]} layers" for r in results], fontsize=8)
        ax.set(ylabel="tokens/s", title=f"Baselines at their largest size ({setup.mode})")
        ax.legend(fontsize=8)

    plot = save_plot(setup, NAME, draw)
    finish(setup, table, NAME, clock, plot, runs=all_runs)
    return table


if __name__ == "__main__":
    main()
