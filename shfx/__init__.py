"""shfx: train models larger than accelerator memory on one accelerator.

A re-implementation of STRONGHOLD (SC22) as a compiler over torch.fx::

    import shfx
    cm = shfx.compile(model, device=shfx.EmulatedDevice(memory="512MiB"), policy=shfx.Stronghold(window=2),
                      optimizer=shfx.optim.AdamW(lr=1e-3))
    loss = cm(x, y); loss.backward(); cm.step(); cm.zero_grad()
    print(cm.program)        # the step program
"""

from . import optim
from .amp import LossScaler
from .api import CompiledModel, compile
from .compare import CompareResult, compare
from .devices import CudaDevice, EmulatedDevice
from .offload import Offload
from .parallel import DataParallel
from shfx.cost_model.planner import GPTShape, plan
from shfx.passes.policies import L2L, Policy, Resident, Stronghold, ZeroInfinity, ZeroOffload
from .errors import (
    ActionError,
    CaptureError,
    OutOfDeviceMemory,
    PartitionError,
    ScheduleError,
    ShfxError,
    SSDIOError,
    SSDSpaceError,
    UsageError,
    VerificationError,
)

__version__ = "0.1.0"

__all__ = [
    "compile",
    "CompiledModel",
    "Policy",
    "Stronghold",
    "Resident",
    "L2L",
    "ZeroOffload",
    "ZeroInfinity",
    "compare",
    "CompareResult",
    "optim",
    "LossScaler",
    "EmulatedDevice",
    "CudaDevice",
    "Offload",
    "DataParallel",
    "plan",
    "GPTShape",
    "ShfxError",
    "CaptureError",
    "PartitionError",
    "ScheduleError",
    "VerificationError",
    "OutOfDeviceMemory",
    "ActionError",
    "UsageError",
    "SSDSpaceError",
    "SSDIOError",
]
