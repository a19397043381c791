"""A schedule written by hand runs on the runtime and trains like eager."""

from __future__ import annotations

import pytest
from equivalence import assert_trains_like_eager
from zoo import gpt_tied, token_batch

import shfx
from shfx.passes import lower_actions


def just_in_time(specs, window):
    """One slot, each stage prefetched right before it runs (no lookahead)."""
    acts = []
    n = len(specs)
    for i in range(n):
        acts += [f"PF{i}", f"F{i}"] + ([f"OB{i}"] if specs[i].mutates_buffers else []) + ([f"R{i}"] if i < n - 1 else [])
    for i in reversed(range(n)):
        if i < n - 1:
            acts.append(f"PF{i}")
        acts.append(f"B{i}")
        if specs[i].has_grads:
            acts.append(f"OG{i}")
        acts.append(f"R{i}")
    groups = [s.update_group for s in specs if s.update_group is not None]
    acts += [f"U{g}" for g in groups]  # all updates after the backward
    return lower_actions(acts, specs, 1, name="just-in-time")


def test_custom_policy_trains_like_eager():
    _, _, cm, _, _ = assert_trains_like_eager(gpt_tied, token_batch, window=1, steps=3, policy=just_in_time)
    assert cm.program.name == "just-in-time"
    assert cm.program.actions()[-1].startswith("U")
    cm.close()


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown policy .fast.; available: resident, l2l, zero-offload, zero-infinity, stronghold"):
        shfx.compile(gpt_tied(), policy="fast")


def test_policy_must_return_a_program():
    cm = shfx.compile(gpt_tied(), device=shfx.EmulatedDevice(), policy=lambda specs, w: ["PF0"])
    (x, y), _, _ = token_batch(0)
    with pytest.raises(TypeError, match="not a shfx.passes.Program"):
        cm(x, y)
    cm.close()
