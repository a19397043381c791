"""``shfx.DataParallel``: how ``shfx.compile(data_parallel=...)`` runs a model over several
processes (docs/usage.md, "Data parallel").

>>> DataParallel(timeout_s=60)
DataParallel(process_group=None, timeout_s=60)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DataParallel", "DEFAULT_TIMEOUT_S"]

#: seconds a collective of shfx's own queues waits for the other ranks before the step fails
#: (a rank that died, hung, or is this far behind): as long as NCCL's default, a third of gloo's
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class DataParallel:
    """Data parallel over the ranks of ``process_group`` (None: the default group of
    ``torch.distributed.init_process_group``), each with its own batch, as with
    ``DistributedDataParallel``; the host optimizer is sharded across them (ZeRO-2-like).

    Attributes:
        process_group: the ranks to train over (each runs the same model on its own device).
        timeout_s: how long one of shfx's collectives (the gradient reduce-scatter, the weights'
            all-gather) waits for the other ranks before the step fails with an error saying
            data parallel lost a rank.
    """

    process_group: Any = None
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(
                f"DataParallel(timeout_s=...) must be a number of seconds > 0 (how long a collective waits for "
                f"the other ranks), got {t!r}"
            )
