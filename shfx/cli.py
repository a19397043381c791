"""The ``shfx`` command line: ``shfx <command> [options]`` (also ``python -m shfx``).

Commands:
    demo    train a GPT that does not fit on the device, on the Python standard library's
            sources (no download, no GPU needed: an emulated device otherwise).
    tune    the window report for a GPT: profiled and measured on a device, or predicted for a
            named hardware profile (--hardware V100-32GB-PCIe3).

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
    from passes.units import parse_bytes

    try:
        return parse_bytes(text, what="device memory")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _bandwidth_arg(text: str) -> str:
    from passes.units import parse_bandwidth

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
    )
    return 0 if result.losses else 1


# ---- tune -------------------------------------------------------------------------------------


def _add_tune(sub: argparse._SubParsersAction) -> None:
    from cost_model.hardware import PROFILES

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
    p.add_argument("--layers", type=_positive_int, default=8)
    p.add_argument("--hidden", type=_positive_int, default=256)
    p.add_argument("--heads", type=_positive_int, default=4)
    p.add_argument("--seq", type=_positive_int, default=128)
    p.add_argument("--batch", type=_positive_int, default=4)
    p.add_argument("--vocab", type=_positive_int, default=256)
    p.add_argument("--hardware", choices=sorted(PROFILES), default=None, help="predict for this profile instead of running")
    p.add_argument("--device", default="auto", help="'auto', 'emulated' or 'cuda' (when not --hardware)")
    p.add_argument("--device-memory", type=_bytes_arg, default=None, help="device budget (emulated default 16GiB)")
    p.add_argument("--h2d", type=_bandwidth_arg, default="12GB/s", help="emulated host->device bandwidth")
    p.add_argument("--d2h", type=_bandwidth_arg, default="12GB/s", help="emulated device->host bandwidth")
    p.add_argument("--steps", type=_positive_int, default=5, help="measured steps (when not --hardware)")
    p.add_argument("--tolerance", type=float, default=0.02, help="a smaller window may be this much slower than the best")
    p.add_argument("--trace", default=None, help="write the chosen window's simulated step as a Chrome trace (JSON)")
    p.add_argument("--plot", default=None, help="write a plot of step time and memory vs window (needs matplotlib)")
    p.add_argument("--json", default=None, help="write the report as JSON")
    p.set_defaults(func=_run_tune)


def _run_tune(args: argparse.Namespace) -> int:
    import torch

    from .commands import tune_gpt
    from .devices import CudaDevice, EmulatedDevice

    device = None
    if args.hardware is None:
        kind = args.device
        if kind == "auto":
            kind = "cuda" if torch.cuda.is_available() else "emulated"
        if kind == "emulated":
            device = EmulatedDevice(memory=args.device_memory or "16GiB", h2d=args.h2d, d2h=args.d2h)
        elif kind.startswith("cuda"):
            device = CudaDevice(index=torch.device(kind).index or 0, memory=args.device_memory)
        else:
            raise ValueError(f"--device must be 'auto', 'emulated' or 'cuda', got {args.device!r}")
    rep = tune_gpt(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        seq=args.seq,
        batch=args.batch,
        vocab=args.vocab,
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


# ---- wiring -----------------------------------------------------------------------------------

_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_demo, _add_tune]


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
