"""Write a schedule by hand, verify it, run it, and compare it with the window policy.

    python examples/custom_schedule.py

The "just in time" schedule prefetches each stage right before it runs and updates only after
the whole backward: a baseline (like L2L without lookahead). On an emulated device with a slow
link it is slower than the stronghold window, and both train identically to eager PyTorch.
"""

from __future__ import annotations

import time

import torch

import shfx
from shfx.passes import lower_actions
from shfx.passes.verify import VerificationError, verify_program
from shfx.models import GPT, GPTShape


def just_in_time(specs, window):
    """One slot; PF right before F; every update after the backward."""
    n = len(specs)
    acts = []
    for i in range(n):
        acts += [f"PF{i}", f"F{i}"] + ([f"OB{i}"] if specs[i].mutates_buffers else []) + ([f"R{i}"] if i < n - 1 else [])
    for i in reversed(range(n)):
        acts += ([f"PF{i}"] if i < n - 1 else []) + [f"B{i}"] + ([f"OG{i}"] if specs[i].has_grads else []) + [f"R{i}"]
    acts += [f"U{s.update_group}" for s in specs if s.update_group is not None]
    return lower_actions(acts, specs, 1, name="just-in-time")


def time_steps(policy, window, steps=6):
    torch.manual_seed(0)
    model = GPT(GPTShape(layers=6, hidden=192, heads=4, seq=64))
    cm = shfx.compile(model, device=shfx.EmulatedDevice(memory="256MiB", h2d="1GB/s", d2h="1GB/s"),
                      window=window, policy=policy, optimizer=shfx.optim.AdamW(lr=1e-3))
    x = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = cm(x, x)
        loss.backward()
        cm.step()
        cm.zero_grad()
        times.append(time.perf_counter() - t0)
    prog = cm.program
    cm.close()
    return sorted(times[1:])[len(times[1:]) // 2], loss.item(), prog


def main() -> None:
    t_jit, l_jit, p_jit = time_steps(just_in_time, 1)
    t_sh, l_sh, p_sh = time_steps("stronghold", 3)
    print(p_jit, "\n")
    print(f"just-in-time (1 slot):       {t_jit * 1e3:7.1f} ms/step, loss {l_jit:.5f}")
    print(f"stronghold window (3 slots): {t_sh * 1e3:7.1f} ms/step, loss {l_sh:.5f}")

    # break the program on purpose: let a prefetch reuse a slot before it is released
    broken = p_sh.copy()
    pf = [n for n in broken.nodes if str(n.meta["shfx"].action) == "PF3"][0]
    pf.args = (pf.args[0],)
    try:
        verify_program(broken)
    except VerificationError as e:
        print("\nthe verifier rejects a hand-broken program:\n" + str(e).splitlines()[1])


if __name__ == "__main__":
    main()
