"""zero-offload with and without ZeRO-Offload's delayed update, side by side (interleaved).

    python benchmarks/delayed_update.py

NOTE: on the emulated device the host update and the "device" compute share the same CPU
cores, so overlapping them gains little (measured 97.3 vs 95.4 ms on 2 cores); on a GPU the
delayed update hides the host update time behind the next step's compute.
"""
import statistics, torch, shfx
from shfx.models.gpt import GPT, GPTShape
torch.set_num_threads(1)
def make(delayed):
    torch.manual_seed(0)
    m = GPT(GPTShape(vocab=256, seq=64, layers=4, heads=4, hidden=256))
    return shfx.compile(m, device=shfx.EmulatedDevice(memory="256MiB", h2d=None, d2h=None), policy=shfx.ZeroOffload(delayed_update=delayed), optimizer=shfx.optim.AdamW())
cms = {"zero-offload": make(False), "zero-offload delayed": make(True)}
x = torch.randint(0, 256, (4, 64))
for step in range(12):
    for cm in cms.values():
        cm(x, x).backward(); cm.step(); cm.zero_grad()
for name, cm in cms.items():
    t = cm.engine.step_times[2:]
    print(f"{name:22s} median {statistics.median(t)*1e3:7.1f} ms over {len(t)} steps")
    cm.close()
