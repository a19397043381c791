"""A byte-level text dataset built from the Python standard library's own source files.

Nothing is downloaded: the ``.py`` files of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``) are read in sorted order, up to a byte cap, and
concatenated. Tokens are the raw bytes (0..255), so the vocabulary is 256 and any
``GPTShape(vocab=256)`` model can train on it.

>>> from shfx.data import TextDataset
>>> ds = TextDataset.from_stdlib(max_bytes=200_000)
>>> x, y = ds.get_batch("train", batch=2, seq=16, generator=torch.Generator().manual_seed(0))
>>> x.shape, x.dtype, bool((x[:, 1:] == y[:, :-1]).all())
(torch.Size([2, 16]), torch.int64, True)
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = [
    "DEFAULT_MAX_BYTES",
    "TextDataset",
    "stdlib_root",
    "stdlib_source_files",
    "read_sources",
]

DEFAULT_MAX_BYTES = 8_000_000
"""Default cap on the bytes read from the standard library (a few tenths of a second)."""

# third-party code lives under the stdlib directory on many installs; it differs from machine
# to machine, so it is skipped to keep the dataset the same wherever the same Python runs
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_SEPARATOR = b"\n\n"


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library.

    >>> stdlib_root().is_dir()
    True
    """
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """Every ``.py`` file under ``root`` (default: :func:`stdlib_root`), sorted by relative
    path, skipping ``site-packages``/``dist-packages`` and ``__pycache__``.

    Raises:
        FileNotFoundError: ``root`` does not exist or holds no ``.py`` file.

    >>> files = stdlib_source_files()
    >>> files == sorted(files) and all(f.suffix == ".py" for f in files)
    True
    """
    base = Path(root) if root is not None else stdlib_root()
    if not base.is_dir():
        raise FileNotFoundError(
            f"no Python source files found: the standard library directory {str(base)!r} does not exist "
            f"(sysconfig.get_paths()['stdlib'] on this interpreter). shfx's demo trains on the standard "
            "library's .py files; install a Python that ships its sources, or pass a directory of .py files."
        )
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                p = Path(dirpath) / name
                found.append((p.relative_to(base).as_posix(), p))
    if not found:
        raise FileNotFoundError(
            f"no Python source files (*.py) found under {str(base)!r}. shfx's demo trains on the standard "
            "library's sources (sysconfig.get_paths()['stdlib']); this interpreter seems to ship only "
            "compiled files. Install a Python with its .py sources, or pass a directory of .py files."
        )
    found.sort(key=lambda rp: rp[0])
    return [p for _, p in found]


def read_sources(files: Sequence[str | os.PathLike[str]], max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """Concatenate ``files`` (in the given order, separated by a blank line) up to ``max_bytes``;
    the last file read is cut so the result is exactly ``max_bytes`` long when there is enough.

    >>> len(read_sources(stdlib_source_files(), max_bytes=1000))
    1000
    """
    return _read(files, max_bytes)[0]


def _read(files: Sequence[str | os.PathLike[str]], max_bytes: int) -> tuple[bytes, int]:
    """:func:`read_sources` and the number of files it drew from."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
    parts: list[bytes] = []
    total = 0
    for f in files:
        if total >= max_bytes:
            break
        try:
            data = Path(f).read_bytes()
        except OSError:  # unreadable file: skip it (the listing stays deterministic)
            continue
        if not data:
            continue
        chunk = data + _SEPARATOR
        parts.append(chunk[: max_bytes - total])
        total += len(parts[-1])
    return b"".join(parts), len(parts)


class TextDataset:
    """Byte tokens split into a training and a validation part.

    Args:
        data: the corpus as ``bytes`` or a 1-D ``uint8`` tensor.
        val_fraction: the share of the corpus (its end) held out for validation.
        name: a short description, shown by the demo.

    Attributes:
        train, val: 1-D ``uint8`` tensors of byte tokens.
        vocab_size: 256.

    >>> ds = TextDataset(b"hello world, " * 100, val_fraction=0.1)
    >>> len(ds.train), len(ds.val)
    (1170, 130)
    """

    vocab_size = 256

    def __init__(self, data: bytes | torch.Tensor, val_fraction: float = 0.1, name: str = "bytes"):
        if isinstance(data, (bytes, bytearray, memoryview)):
            tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
        else:
            tokens = data.detach().to(torch.uint8).reshape(-1).cpu()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        n_val = int(len(tokens) * val_fraction)
        self.tokens = tokens
        self.train = tokens[: len(tokens) - n_val]
        self.val = tokens[len(tokens) - n_val :]
        self.name = name

    @classmethod
    def from_stdlib(
        cls,
        max_bytes: int = DEFAULT_MAX_BYTES,
        val_fraction: float = 0.1,
        root: str | os.PathLike[str] | None = None,
    ) -> TextDataset:
        """The standard library's ``.py`` sources (sorted, capped at ``max_bytes``) as a dataset.

        Raises:
            FileNotFoundError: no source file was found (see :func:`stdlib_source_files`).

        >>> ds = TextDataset.from_stdlib(max_bytes=100_000)
        >>> len(ds.tokens)
        100000
        """
        base = Path(root) if root is not None else stdlib_root()
        files = stdlib_source_files(base)
        data, used = _read(files, max_bytes)
        if not data:
            raise FileNotFoundError(f"the .py files under {str(base)!r} are all empty or unreadable")
        return cls(data, val_fraction, name=f"{used} .py files of {base} ({len(data):,} bytes)")

    def split(self, split: str) -> torch.Tensor:
        """The tokens of ``"train"`` or ``"val"``."""
        if split == "train":
            return self.train
        if split in ("val", "validation"):
            return self.val
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")

    def get_batch(
        self, split: str, batch: int, seq: int, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch`` random windows of ``seq`` tokens from ``split``: ``(x, y)``, two ``int64``
        tensors of shape ``(batch, seq)`` with ``y[:, t] == x[:, t + 1]`` (the next byte).
        The same ``generator`` state gives the same batch.

        >>> ds = TextDataset(bytes(range(256)) * 4)
        >>> x, y = ds.get_batch("train", 2, 8, torch.Generator().manual_seed(1))
        >>> bool(((x + 1) % 256 == y).all())
        True
        """
        data = self.split(split)
        if batch < 1 or seq < 1:
            raise ValueError(f"batch and seq must be >= 1, got batch={batch}, seq={seq}")
        if len(data) < seq + 1:
            raise ValueError(
                f"the {split!r} split has {len(data)} tokens, too few for sequences of {seq} (+1 target); "
                "read more bytes or use a shorter sequence"
            )
        starts = torch.randint(0, len(data) - seq, (batch,), generator=generator)
        offsets = torch.arange(seq + 1)
        windows = data[starts[:, None] + offsets[None, :]].to(torch.int64)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"TextDataset({self.name}; train {len(self.train):,} tokens, val {len(self.val):,} tokens)"

