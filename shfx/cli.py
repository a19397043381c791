"""The ``shfx`` command line: ``shfx <command> [options]`` (also ``python -m shfx``).

Commands:
    demo    train a GPT that does not fit on the device, on the Python standard library's
            sources (no download, no GPU needed: an emulated device otherwise).
    tune    the window report for a GPT: profiled and measured on a device, or predicted for a
            named hardware profile (--hardware V100-32GB-PCIe3).
    compare the policies side by side for a GPT: predicted (and, on a device, measured) step
            time, bottleneck, device and host memory, bytes moved per step.
    plan    the capacity planner: the largest GPT each policy trains on given hardware (device,
            host and SSD memory), and the term that limits it.

Each command is a module-level ``_add_<name>(subparsers)`` that registers its parser and sets
``func`` to a ``(args) -> int`` handler; add new commands (``tune``, ``plan``, ``compare``) the
same way and list them in ``_COMMANDS``.

>>> main(["demo", "--steps", "2", "--layers", "2", "--hidden", "32", "--heads", "2",
...       "--seq", "16", "--batch", "2"])  # doctest: +SKIP
0
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

__all__ = ["main", "build_parser"]


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return v


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def _bytes_arg(text: str) -> int:
    from shfx.passes.units import parse_bytes

    try:
        return parse_bytes(text, what="device memory")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _precision_arg(text: str) -> str:
    """``fp32|bf16|fp16`` (or ``float32|bfloat16|float16``) -> the long name (one way, everywhere:
    :func:`shfx.cost_model.shapes.normalize_precision`)."""
    from shfx.cost_model.shapes import normalize_precision

    try:
        return normalize_precision(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_PRECISION_HELP = (
    "fp32, or mixed precision bf16/fp16 (16-bit working copy and gradients on the device, fp32 master and AdamW "
    "states on the host; fp16 with loss scaling and the step journal's rollback copies); float32/bfloat16/float16 "
    "also accepted"
)


def _add_precision_arg(p: argparse.ArgumentParser, run_note: str = "") -> None:
    p.add_argument("--precision", type=_precision_arg, default="float32", metavar="{fp32,bf16,fp16}",
                   help=_PRECISION_HELP + run_note)


def _bandwidth_arg(text: str) -> str:
    from shfx.passes.units import parse_bandwidth

    try:
        parse_bandwidth(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


# ---- demo -----------------------------------------------------------------------------------


def _add_demo(sub: argparse._SubParsersAction) -> None:
    from .demo import DemoConfig

    d = DemoConfig()
    p = sub.add_parser(
        "demo",
        help="train a GPT larger than the device's memory on Python's standard library sources",
        description=(
            "Train a byte-level GPT on the .py sources of this Python's standard library (nothing is "
            "downloaded), with shfx streaming a window of the model's stages to the device. Without CUDA "
            "the device is emulated on the CPU, with a memory budget below the model's size."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=_positive_int, default=d.steps, help="optimizer steps")
    p.add_argument("--layers", type=_positive_int, default=d.layers, help="transformer blocks")
    p.add_argument("--hidden", type=_positive_int, default=d.hidden, help="model width (n_embd)")
    p.add_argument("--heads", type=_positive_int, default=d.heads, help="attention heads")
    p.add_argument("--seq", type=_positive_int, default=d.seq, help="tokens (bytes) per sequence")
    p.add_argument("--batch", type=_positive_int, default=d.batch, help="sequences per step")
    p.add_argument("--window", type=_positive_int, default=d.window, help="stages resident on the device at once")
    p.add_argument(
        "--device",
        default=d.device,
        help="'auto' (cuda if available, else emulated), 'emulated', 'cuda' or 'cuda:N'",
    )
    p.add_argument(
        "--device-memory",
        type=_bytes_arg,
        default=None,
        help="device memory budget, e.g. '8MiB' (default: window + 1.5 stages plus the activations, "
        "below the model's size)",
    )
    p.add_argument("--h2d", type=_bandwidth_arg, default=d.h2d, help="emulated host->device bandwidth ('inf': unthrottled)")
    p.add_argument("--d2h", type=_bandwidth_arg, default=d.d2h, help="emulated device->host bandwidth ('inf': unthrottled)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (warmup, then cosine decay)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the initialisation and the batches")
    p.add_argument("--eval-interval", type=_nonneg_int, default=d.eval_interval, help="steps between validation losses (0: at the end only)")
    p.add_argument("--eval-batches", type=_positive_int, default=d.eval_batches, help="batches per validation loss")
    p.add_argument("--log-interval", type=_positive_int, default=None, help="steps between log lines (default: ~15 lines)")
    p.add_argument("--data-bytes", type=_bytes_arg, default=d.max_bytes, help="bytes of standard-library source to read")
    _add_precision_arg(p, " (shfx.compile(precision=...))")
    p.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    result = run_demo(
        steps=args.steps,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        seq=args.seq,
        batch=args.batch,
        window=args.window,
        device=args.device,
        device_memory=args.device_memory,
        h2d=args.h2d,
        d2h=args.d2h,
        lr=args.lr,
        seed=args.seed,
        eval_interval=args.eval_interval,
        eval_batches=args.eval_batches,
        log_interval=args.log_interval,
        max_bytes=args.data_bytes,
        precision=args.precision,
    )
    return 0 if result.losses else 1


# ---- shared options ---------------------------------------------------------------------------


def _shape_from_args(args: argparse.Namespace):
    """The GPT of ``--layers --hidden --heads --seq --batch --vocab`` (and ``--precision``)."""
    from shfx.cost_model.shapes import GPTShape

    extra = {"precision": args.precision} if getattr(args, "precision", None) else {}
    return GPTShape(layers=args.layers or 1, hidden=args.hidden, heads=args.heads, seq=args.seq, batch=args.batch, vocab=args.vocab, **extra)


def _add_gpt_args(p: argparse.ArgumentParser) -> None:
    """The built-in GPT's dimensions (``shfx.models.GPT``, tied embedding)."""
    p.add_argument("--layers", type=_positive_int, default=8)
    p.add_argument("--hidden", type=_positive_int, default=256)
    p.add_argument("--heads", type=_positive_int, default=4)
    p.add_argument("--seq", type=_positive_int, default=128)
    p.add_argument("--batch", type=_positive_int, default=4)
    p.add_argument("--vocab", type=_positive_int, default=256)
    _add_precision_arg(p, "; predicted with --hardware, else run with shfx.compile(precision=...)")


def _add_device_args(p: argparse.ArgumentParser) -> None:
    """The device to run on when not predicting for ``--hardware`` (see :func:`_device_from_args`)."""
    p.add_argument("--device", default="auto", help="'auto', 'emulated' or 'cuda' (when not --hardware)")
    p.add_argument("--device-memory", type=_bytes_arg, default=None, help="device budget (emulated default 16GiB)")
    p.add_argument("--h2d", type=_bandwidth_arg, default="12GB/s", help="emulated host->device bandwidth")
    p.add_argument("--d2h", type=_bandwidth_arg, default="12GB/s", help="emulated device->host bandwidth")


# ---- tune -------------------------------------------------------------------------------------


def _add_tune(sub: argparse._SubParsersAction) -> None:
    from shfx.cost_model.hardware import PROFILES

    p = sub.add_parser(
        "tune",
        help="which window to use, and why: the window report for a GPT",
        description=(
            "Print the window report for a GPT: per window the predicted step time, device memory and "
            "what bounds the step, the window shfx chooses and why. With --hardware the costs come from "
            "the analytic model of a named profile (nothing runs); otherwise they are profiled on the "
            "device and a few steps are measured."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_gpt_args(p)
    p.add_argument("--hardware", choices=sorted(PROFILES), default=None, help="predict for this profile instead of running")
    _add_device_args(p)
    p.add_argument("--steps", type=_positive_int, default=5, help="measured steps (when not --hardware)")
    p.add_argument("--tolerance", type=float, default=0.02, help="a smaller window may be this much slower than the best")
    p.add_argument("--trace", default=None, help="write the chosen window's simulated step as a Chrome trace (JSON)")
    p.add_argument("--plot", default=None, help="write a plot of step time and memory vs window (needs matplotlib)")
    p.add_argument("--json", default=None, help="write the report as JSON")
    p.set_defaults(func=_run_tune)


def _device_from_args(args: argparse.Namespace):
    """``--device auto|emulated|cuda[:i]`` with ``--device-memory``, ``--h2d``, ``--d2h``."""
    import torch

    from .devices import CudaDevice, EmulatedDevice

    kind = args.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "emulated"
    if kind == "emulated":
        return EmulatedDevice(memory=args.device_memory or "16GiB", h2d=args.h2d, d2h=args.d2h)
    if kind.startswith("cuda"):
        return CudaDevice(index=torch.device(kind).index or 0, memory=args.device_memory)
    raise ValueError(f"--device must be 'auto', 'emulated' or 'cuda', got {args.device!r}")


def _run_tune(args: argparse.Namespace) -> int:
    from .commands import tune_gpt

    device = None if args.hardware is not None else _device_from_args(args)
    rep = tune_gpt(
        _shape_from_args(args),
        hardware=args.hardware,
        device=device,
        steps=args.steps,
        tolerance=args.tolerance,
    )
    if args.trace:
        print(f"trace: {rep.save_trace(args.trace)} (open in https://ui.perfetto.dev)")
    if args.plot:
        print(f"plot: {rep.plot(args.plot)}")
    if args.json:
        print(f"json: {rep.save_json(args.json)}")
    return 0


# ---- compare ----------------------------------------------------------------------------------


def _policies_arg(text: str) -> list[str]:
    """A comma-separated list of registered policy names (``shfx.passes.policies.POLICIES``)."""
    from shfx.passes.policies import policy_names

    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in policy_names()]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of policies ({', '.join(policy_names())}), got {text!r}"
        )
    return names


def _k_arg(text: str) -> int | str:
    return "auto" if text == "auto" else _nonneg_int(text)


def _window_arg(text: str) -> int | str:
    return "auto" if text == "auto" else _positive_int(text)


def _add_compare(sub: argparse._SubParsersAction) -> None:
    from shfx.cost_model.hardware import PROFILES
    from shfx.passes.policies import policy_names

    p = sub.add_parser(
        "compare",
        help="the policies side by side for a GPT: predicted and measured step time, memory, traffic",
        description=(
            "Compare the schedule policies (resident, l2l, zero-offload, zero-infinity, stronghold) on one GPT: "
            "per policy the predicted step time, bottleneck, peak device memory, host memory and bytes moved per "
            "step, and, on a device, the same measured over a few real steps. With --hardware the costs come from "
            "the analytic model of a named profile and nothing is built or run (any size); otherwise they are "
            "profiled on the device. A policy that does not fit says why."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_gpt_args(p)
    p.add_argument("--policies", type=_policies_arg, default=",".join(policy_names()), help="comma-separated, in table order")
    p.add_argument("--window", type=_window_arg, default=2, help="stronghold's window: an int, or 'auto' (the tuner's choice)")
    p.add_argument("--resident-first", type=_nonneg_int, default=0, help="stronghold: first k stages resident with their optimizer")
    p.add_argument("--hardware", choices=sorted(PROFILES), default=None, help="predict for this profile; nothing runs")
    _add_device_args(p)
    p.add_argument("--steps", type=_positive_int, default=3, help="measured steps per policy, after the warm-up")
    p.add_argument("--warmup", type=_positive_int, default=1, help="unmeasured steps per policy (the first captures)")
    p.add_argument("--no-measure", action="store_true", help="predict from the profile only; run no training steps")
    p.add_argument("--sequential", action="store_true", help="run the policies one after the other, not interleaved")
    p.add_argument("--json", default=None, help="write the comparison as JSON to this file ('-': stdout, no table)")
    p.add_argument("--csv", default=None, help="write one CSV line per policy to this file ('-': stdout, no table)")
    p.set_defaults(func=_run_compare)


def _run_compare(args: argparse.Namespace) -> int:
    import json

    from .compare import compare

    device = None if args.hardware is not None else _device_from_args(args)
    res = compare(
        _shape_from_args(args),
        policies=args.policies,
        window=args.window,
        resident_first=args.resident_first,
        hardware=args.hardware,
        device=device,
        measure=not args.no_measure,
        steps=args.steps,
        warmup=args.warmup,
        interleave=not args.sequential,
    )
    outputs = [(args.json, lambda: json.dumps(res.to_dict(), indent=2) + "\n"), (args.csv, res.to_csv)]
    if "-" not in (args.json, args.csv):
        print(res.table())
    for path, text in outputs:
        if path == "-":
            sys.stdout.write(text())
        elif path:
            with open(path, "w") as f:
                f.write(text())
            print(f"wrote {path}", file=sys.stderr)
    return 0


# ---- plan -------------------------------------------------------------------------------------


def _fraction_arg(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}") from None
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {v}")
    return v


def _add_plan(sub: argparse._SubParsersAction) -> None:
    from shfx.cost_model.hardware import PROFILES
    from shfx.passes.policies import policy_names

    p = sub.add_parser(
        "plan",
        help="the largest GPT each policy can train on given hardware, and what limits it",
        description=(
            "Capacity planner: for each policy, the largest number of layers of a GPT (the other "
            "dimensions fixed) whose device, host and SSD memory fit, the memory at that size, and the term "
            "that stops one layer more. Defaults: STRONGHOLD's setup (hidden 2048, 16 heads, seq 1024, "
            "batch 4, fp32) on V100-32GB-PCIe3 (32 GiB device, 90 GiB host). Nothing runs."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--layers", type=_positive_int, default=None, help="also show each policy's memory at this many layers")
    p.add_argument("--model", choices=sorted(_PLAN_MODELS), default=None,
                   help="a named GPT: its hidden, heads, seq and vocab (each overridable), and --layers its own; "
                        "gpt3-175b: 96 layers, hidden 12288, 96 heads, seq 2048, vocab 50257 (174.6 B params)")
    p.add_argument("--hidden", type=_positive_int, default=None, help="default 2048 (or --model's)")
    p.add_argument("--heads", type=_positive_int, default=None, help="default 16 (or --model's)")
    p.add_argument("--seq", type=_positive_int, default=None, help="default 1024 (or --model's)")
    p.add_argument("--batch", type=_positive_int, default=4)
    p.add_argument("--vocab", type=_positive_int, default=None, help="default 50304 (or --model's)")
    _add_precision_arg(p)
    p.add_argument("--hardware", choices=sorted(PROFILES), default=None,
                   help="hardware profile (default V100-32GB-PCIe3 unless --device-memory is given)")
    p.add_argument("--device-memory", type=_bytes_arg, default=None, help="device memory, e.g. '32GiB' (overrides the profile's)")
    p.add_argument("--host-memory", "--host", dest="host_memory", type=_bytes_arg, default=None,
                   help="host RAM, e.g. '90GiB' or '256GB' (GiB = 2^30, GB = 10^9 bytes; overrides the profile's)")
    p.add_argument("--ssd", type=_bytes_arg, default=None,
                   help="NVMe capacity: adds stronghold+nvme and zero-infinity+nvme rows (the NVMe tier: optimizer states on "
                        "the SSD, a host window of them in RAM); zero-infinity's own row spills there when host RAM overflows")
    p.add_argument("--host-window", type=_positive_int, default=2,
                   help="the NVMe tier's host window: groups whose optimizer states are in host RAM at once (the tiers "
                        "beyond host RAM: their states, master and gradient)")
    p.add_argument("--nvme-masters", action="store_true",
                   help="the NVMe tier holds the fp32 master weights too (mixed precision only)")
    p.add_argument("--tiers", type=_tiers_arg, default=None,
                   help="the tiers beyond host RAM, as stronghold rows: comma-separated of nvme-all (parameters, gradients "
                        "and optimizer states on the SSD, host windows only), nvme-all+act-host, nvme-all+act-nvme "
                        "(and the checkpointed activations offloaded), or 'none'; default: all three with --ssd when "
                        "--policies is not given, else none")
    p.add_argument("--no-overlap-updates", dest="overlap_updates", action="store_false",
                   help="the tiers beyond host RAM: host updates not overlapped with the backward, so each fp32 gradient is "
                        "written to the SSD and read back (+4 B/param each way in the predicted step)")
    p.add_argument("--emulated", action="store_true",
                   help="the device is shfx's emulated device (exact: no working set, workspace or slack); needs --device-memory")
    p.add_argument("--ranks", type=_positive_int, default=None,
                   help="data parallel over this many ranks (host optimizer sharded; host memory per node is the per-rank "
                        "terms x ranks per node): prints each policy's largest model and its simulated step time")
    p.add_argument("--nodes", type=_positive_int, default=1, help="data parallel: nodes the ranks spread over evenly")
    p.add_argument("--network", choices=("25gbe", "100gbe"), default=None,
                   help="data parallel: the network between nodes (needed with --nodes > 1)")
    p.add_argument("--policies", type=_policies_arg, default=list(policy_names()), help="comma-separated")
    p.add_argument("--window", type=_positive_int, default=2, help="stronghold's window")
    p.add_argument("--resident-first", type=_k_arg, default=0, help="stronghold: first k stages resident with their optimizer, or 'auto' (the k that trains the most)")
    p.add_argument("--workspace", type=_bytes_arg, default=None, help="CUDA context and workspaces (default 512MiB; 0 emulated)")
    p.add_argument("--slack", type=_fraction_arg, default=0.0, help="fraction of device memory lost to allocator fragmentation")
    p.add_argument("--max-layers", type=_positive_int, default=100_000)
    p.add_argument("--csv", default=None, help="write the table as CSV (every term a column)")
    p.add_argument("--json", nargs="?", const="-", default=None, help="write the plan as JSON to this file ('-' or no value: stdout)")
    p.set_defaults(func=_run_plan)


_PLAN_MODELS = {
    # GPT-3 175B (Brown et al. 2020, Table 2.1: 96 layers, d_model 12288, 96 heads, context 2048; GPT-2's
    # 50257-token vocabulary)
    "gpt3-175b": {"layers": 96, "hidden": 12288, "heads": 96, "seq": 2048, "vocab": 50257},
}
_PLAN_DEFAULTS = {"hidden": 2048, "heads": 16, "seq": 1024, "vocab": 50304}  # STRONGHOLD's setup


def _tiers_arg(text: str) -> list[str]:
    from shfx.cost_model.planner import BEYOND_RAM_TIERS

    names = [t.strip() for t in text.split(",") if t.strip()]
    if names == ["none"]:
        return []
    bad = [n for n in names if n not in BEYOND_RAM_TIERS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected 'none' or a comma-separated list of {', '.join(BEYOND_RAM_TIERS)}, got {text!r}")
    return names


def _stronghold_steps(result, family, hw, layers: int | None, overlap_updates: bool = True) -> str:
    """The predicted step of each ``stronghold`` row (:func:`shfx.cost_model.beyond_ram.tier_step`:
    the window schedule's closed form and the SSD's bytes, analytic, nothing runs) at its largest
    size, and at ``layers`` when given (with whether it fits there)."""
    from shfx.cost_model.beyond_ram import tier_step
    from shfx.cost_model.planner import BEYOND_RAM_TIERS, memory_model

    lines = []
    at = [] if layers is None else [layers]
    for n in [None, *at]:
        head = (
            "predicted step of the stronghold rows at their largest size (analytic: the window schedule's closed form and "
            "the SSD's bytes, nothing runs; the other policies: shfx compare --hardware ... --layers N):"
            if n is None
            else f"stronghold rows at {n} layers ({family.with_layers(n).num_params() / 1e9:.1f} B params, "
            f"{family.batch * family.seq} tokens per step):"
        )
        lines.append(head)
        for r in result.rows:
            st = r.breakdown.settings
            if not r.policy.startswith("stronghold") or st.get("resident_first", 0):
                continue
            tier = r.policy.removeprefix("stronghold").removeprefix("+") or None
            size = r.layers if n is None else n
            fits = ""
            if n is not None:
                kw = dict(BEYOND_RAM_TIERS.get(tier or "", {}))
                if st.get("nvme_all"):
                    kw.update(host_window=st["host_window"], image_window=st["image_window"])
                if tier == "nvme":
                    kw.update(nvme=True, host_window=st["host_window"], nvme_masters=st["nvme_masters"])
                bd = memory_model("stronghold", family.with_layers(n), result.hardware, window=st["window"],
                                  workspace_bytes=st["workspace_bytes"], allocator_slack=st["allocator_slack"], **kw)
                ok = bd.fits()
                fits = f"fits (tightest: {bd.binding()}); " if ok else f"does not fit (over: {bd.binding()}); if it did: "
            if size == 0:
                lines.append(f"  {r.policy + ':':<31} -")
                continue
            step = tier_step(family.with_layers(size), hw, tier, window=st["window"], nvme_masters=bool(st.get("nvme_masters")),
                             overlap_updates=overlap_updates)
            what = f"{size:>5} layers: " if n is None else ""
            lines.append(f"  {r.policy + ':':<31} {what}{fits}{step.describe()}, {step.tokens_per_s(family):.1f} tokens/s")
    return "\n".join(lines)


def _data_parallel_steps(result, family, hw) -> str:
    """Each row's simulated step at its largest size on ``hw`` (a data-parallel Hardware): the
    analytic costs of the GPT, the policy's program with the collectives, one step simulated."""
    from shfx.commands import gpt_plan_inputs
    from shfx.cost_model.simulate import simulate
    from shfx.passes.policies import make_policy
    from shfx.passes.schedule import data_parallel_program

    lines = [f"simulated step at the largest size ({hw.ranks} ranks x batch {family.batch} = {hw.ranks * family.batch} samples per step):"]
    for r in result.rows:
        if r.layers == 0:
            lines.append(f"  {r.policy:<16} -")
            continue
        st = r.breakdown.settings
        pol = make_policy(r.policy, **({"window": st["window"]} if r.policy == "stronghold" else {}))
        specs, costs = gpt_plan_inputs(family.with_layers(r.layers), hw)
        tl = simulate(data_parallel_program(pol.program(specs), hw.ranks), costs, rollback=family.rollback_default)
        net = tl.by_resource.get("network", 0.0)
        lines.append(
            f"  {r.policy:<16} {r.layers:>5} layers: step {tl.step_s:.2f} s, {hw.ranks * family.batch / tl.step_s:.2f} samples/s, "
            f"bottleneck {tl.bottleneck} (network {net:.2f} s of the critical path)"
        )
    return "\n".join(lines)


def _run_plan(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from shfx.cost_model.hardware import get_profile
    from shfx.cost_model.planner import Target, memory_model, plan

    if args.emulated:
        if args.device_memory is None:
            raise ValueError("--emulated needs --device-memory (the emulated device's capacity)")
        if args.hardware is not None:
            raise ValueError("--emulated and --hardware exclude each other")
        target = Target("emulated device", args.device_memory, args.host_memory, args.ssd or 0, emulated=True)
    elif args.hardware is not None or args.device_memory is None:
        hw = get_profile(args.hardware or "V100-32GB-PCIe3")
        over = {}
        if args.device_memory is not None:
            over["device_memory_bytes"] = args.device_memory
        if args.host_memory is not None:
            over["host_memory_bytes"] = args.host_memory
        if args.ssd is not None:
            over["ssd_bytes"] = args.ssd
        target = replace(hw, **over) if over else hw
    else:
        target = Target("custom", args.device_memory, args.host_memory, args.ssd or 0)
    preset = _PLAN_MODELS.get(args.model, {})
    for key, default in _PLAN_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, preset.get(key, default))
    if args.layers is None and preset:
        args.layers = preset["layers"]
    family = _shape_from_args(args)
    if args.ranks is None and (args.nodes != 1 or args.network is not None):
        raise ValueError("--nodes and --network describe data parallel: give --ranks too (e.g. --ranks 8 --nodes 8 --network 25gbe)")
    if args.ranks is not None:
        from shfx.cost_model.hardware import Hardware, with_data_parallel

        if not isinstance(target, Hardware):
            raise ValueError("--ranks needs a hardware profile (--hardware), not --emulated or a custom --device-memory alone")
        if args.ssd:
            raise ValueError("--ranks with --ssd: the NVMe tier is not modelled with data parallel; drop one")
        target = with_data_parallel(target, args.ranks, nodes=args.nodes, network=args.network)
    kw = dict(workspace_bytes=args.workspace, allocator_slack=args.slack)
    policies: list = list(args.policies)
    if args.nvme_masters and not args.ssd:
        raise ValueError("--nvme-masters puts master weights on the NVMe tier, which needs --ssd (its capacity)")
    if args.ssd:  # the NVMe tier of the policies that have one, beside their host-only rows
        from shfx.passes.policies import Stronghold, ZeroInfinity

        tier = dict(nvme=True, host_window=args.host_window, nvme_masters=args.nvme_masters)
        if "stronghold" in args.policies:
            policies.append(Stronghold(window=args.window, resident_first=args.resident_first, **tier))
        if "zero-infinity" in args.policies:
            policies.append(ZeroInfinity(**tier))
    from shfx.passes.policies import policy_names

    tiers = args.tiers
    if tiers is None:  # the tiers beyond host RAM: with an SSD, unless the policies were chosen
        tiers = ["nvme-all", "nvme-all+act-host", "nvme-all+act-nvme"] if args.ssd and args.policies == list(policy_names()) else []
    if tiers and not args.ssd:
        raise ValueError("--tiers puts parameters, gradients and optimizer states on the SSD: give --ssd (its capacity)")
    if tiers and args.ranks is not None:
        raise ValueError("--tiers is not modelled with data parallel (--ranks); drop one")
    result = plan(
        family, target, policies=policies, window=args.window, resident_first=args.resident_first,
        max_layers=args.max_layers, tiers=tiers, tier_options={"host_window": args.host_window}, **kw,
    )
    if args.json != "-":
        print(result)
        if args.ranks is not None:
            print()
            print(_data_parallel_steps(result, family, target))
        from shfx.cost_model.hardware import Hardware

        if tiers and isinstance(target, Hardware):
            print()
            print(_stronghold_steps(result, family, target, args.layers, args.overlap_updates))
            if args.model == "gpt3-175b":
                from shfx.cost_model.beyond_ram import LOHAN_175B, tier_step

                for line in LOHAN_175B.lines():
                    print(f"  published: {line}")
                print(f"  {LOHAN_175B.derived()}")
                t = next((t for t in tiers if "+act-" in t), tiers[-1])
                st = tier_step(family.with_layers(args.layers), target, t, window=args.window, overlap_updates=args.overlap_updates)
                print(f"  stronghold+{t}, this setup: {LOHAN_175B.compare(st, family)}")
                for line in LOHAN_175B.at_setup(t, window=args.window, overlap_updates=args.overlap_updates):
                    print(f"  stronghold+{t}, {line}")
    if args.layers is not None:
        print(f"\nat {args.layers} layers ({family.with_layers(args.layers).num_params() / 1e9:.2f} B params):")
        from shfx.cost_model.planner import updates_on_device

        kept = [p for p in policies if not updates_on_device(p)] if args.ranks is not None else policies
        for pol, row in zip(kept + [f"stronghold+{t}" for t in tiers], result.rows):
            k = row.breakdown.settings.get("resident_first", 0)
            if isinstance(pol, str) and pol.startswith("stronghold+"):
                from shfx.cost_model.planner import BEYOND_RAM_TIERS

                bd = memory_model(
                    "stronghold", family.with_layers(args.layers), target, window=args.window, host_window=args.host_window,
                    **BEYOND_RAM_TIERS[pol.removeprefix("stronghold+")], **kw,
                )
            elif isinstance(pol, str):
                bd = memory_model(
                    pol, family.with_layers(args.layers), target, window=args.window,
                    resident_first=(k if pol == "stronghold" else 0), **kw,
                )
            else:
                pol = pol.replace(resident_first=k) if pol.name == "stronghold" else pol
                bd = memory_model(pol, family.with_layers(args.layers), target, **kw)
            print(bd)
    if args.csv:
        print(f"csv: {result.to_csv(args.csv)}")
    if args.json == "-":
        print(result.to_json())
    elif args.json:
        result.to_json(args.json)
        print(f"json: {args.json}")
    return 0


# ---- wiring -----------------------------------------------------------------------------------

_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_demo, _add_tune, _add_compare, _add_plan]


def build_parser() -> argparse.ArgumentParser:
    """The ``shfx`` argument parser, one subcommand per entry of ``_COMMANDS``.

    >>> build_parser().parse_args(["demo", "--steps", "5"]).steps
    5
    """
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="shfx",
        description="shfx: train models larger than accelerator memory by streaming a window of stages.",
    )
    parser.add_argument("--version", action="version", version=f"shfx {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``shfx`` command line with ``argv`` (default ``sys.argv[1:]``); returns the exit code.

    Errors a user can fix (a device budget too small, a bad option value, no CUDA, no source
    files) print one message on stderr and return 1 instead of a traceback.

    >>> main(["--version"])  # doctest: +SKIP
    shfx 0.1.0
    """
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    from .errors import OutOfDeviceMemory

    try:
        return int(args.func(args))
    except (OutOfDeviceMemory, FileNotFoundError, ValueError, FloatingPointError) as e:
        print(f"shfx {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"shfx {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
