"""Parsing and printing sizes, bandwidths and times ("512MiB", "12GB/s", "3.2 ms")."""

from __future__ import annotations

import math
import re

__all__ = ["parse_bytes", "parse_bandwidth", "format_bytes", "format_bandwidth", "format_seconds"]

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_NUM = r"\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"


def _check_size(x: float, value: object, what: str, positive: bool, unit: str = "bytes") -> None:
    """A size or rate must be a finite number, > 0 (``positive``) or >= 0."""
    bound = "> 0" if positive else ">= 0"
    if math.isnan(x) or math.isinf(x):
        raise ValueError(f"{what} must be a finite number of {unit} {bound}, got {value!r}")
    if x < 0 or (positive and x == 0):
        raise ValueError(f"{what} must be {bound} {unit}, got {value!r}")


def parse_bytes(value: int | float | str, *, what: str = "size", positive: bool = False) -> int:
    """``"512MiB"`` -> 536870912. Ints pass through. Decimal (GB) and binary (GiB) units.
    A size is a finite number >= 0 (``positive``: > 0); anything else is a ValueError saying so.

    >>> parse_bytes("1.5 KiB")
    1536
    >>> parse_bytes("-1GiB", what="memory")
    Traceback (most recent call last):
    ValueError: memory must be >= 0 bytes, got '-1GiB'
    """
    if isinstance(value, bool):
        raise TypeError(f"{what} must be a number of bytes or a string like '512MiB', got {value!r}")
    if isinstance(value, (int, float)):
        _check_size(float(value), value, what, positive)
        return int(value)
    m = re.fullmatch(_NUM + r"([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(
            f"cannot read {what} {value!r}: write a number with an optional unit "
            f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '512MiB' or '24GB'"
        )
    n = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    _check_size(n, value, what, positive)
    if positive and int(n) == 0:
        raise ValueError(f"{what} must be > 0 bytes (at least 1), got {value!r}")
    return int(n)


def parse_bandwidth(value: int | float | str | None, *, what: str = "bandwidth") -> float | None:
    """``"12GB/s"`` -> 12e9 bytes/s. ``None``, ``"inf"`` or ``float("inf")`` mean unthrottled
    (returns None); anything else must be a finite number of bytes/s > 0.

    >>> parse_bandwidth("800MiB/s")
    838860800.0
    """
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in {"inf", "infinite", "unlimited", "none"}:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{what} must be bytes per second (a number, or a string like '12GB/s'), got {value!r}")
    if isinstance(value, (int, float)):
        if value == math.inf:
            return None
        _check_size(float(value), value, what, True, "bytes/s")
        return float(value)
    s = str(value).strip()
    if not s.lower().endswith("/s"):
        raise ValueError(
            f"cannot read {what} {value!r}: write bytes per second, e.g. '12GB/s' or '800MiB/s' ('inf' for unthrottled)"
        )
    m = re.fullmatch(_NUM + r"([a-zA-Z]*)\s*", s[:-2])
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(
            f"cannot read {what} {value!r}: write bytes per second, e.g. '12GB/s' or '800MiB/s' ('inf' for unthrottled)"
        )
    bps = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    _check_size(bps, value, what, True, "bytes/s")
    return bps


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_bandwidth(bps: float | None) -> str:
    return "unthrottled" if bps is None else f"{bps / 1e9:.2f} GB/s"


def format_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.0f} us"
