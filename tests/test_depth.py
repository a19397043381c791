"""DepthModel: specs and costs of a GPT at any depth from one capture; programs built from them."""

from __future__ import annotations

import torch

from shfx.cost_model.depth import DepthModel
from shfx.passes.policies import policy_program
from shfx.passes.meta import get_meta
from shfx.passes.program import ActionKind
from shfx.models.gpt import GPT, GPTShape


def small_gpt() -> DepthModel:
    return DepthModel(
        lambda n: GPT(GPTShape(vocab=256, seq=32, layers=n, heads=4, hidden=64)),
        lambda: (torch.zeros(4, 32, dtype=torch.long),) * 2,
        blocks="transformer.h",
        hardware="V100-32GB-PCIe3",
    )


def test_depth_model_repeats_blocks():
    dm = small_gpt()
    specs, costs = dm.at(7)
    assert len(specs) == len(costs.costs) == 7 + dm.extra_stages == 9
    assert [s.index for s in specs] == list(range(9))
    assert costs.costs[1] == costs.costs[7]  # every block costs what the template block costs


def test_every_offload_grad_moves_its_stage_gradients():
    """Each repeated block sends its gradients to its own group (not the template block's), so
    every OFFLOAD_GRAD of a host-updated stage moves its bytes; with the head updated on the
    device (k=1), the tail sends only its own LayerNorm's gradients."""
    specs, _ = small_gpt().at(6)
    for k in (0, 1):
        p = policy_program("stronghold", specs, window=2, resident_first=k)
        og = {get_meta(n).stage: get_meta(n).bytes for n in p.nodes if get_meta(n).kind == ActionKind.OFFLOAD_GRAD}
        for s in specs[k:-1]:
            assert og[s.index] == s.grad_bytes > 0, s.name
        tail = specs[-1]
        assert og[tail.index] == (tail.grad_bytes if k == 0 else tail.grad_bytes_to({tail.update_group})) > 0


def test_simulated_policies_at_depth():
    dm = small_gpt()
    times = {p: dm.simulate(12, p, window=2).step_s for p in ("resident", "l2l", "stronghold")}
    assert all(t > 0 for t in times.values())
    assert times["l2l"] > times["stronghold"]  # one slot: no copy overlaps compute
