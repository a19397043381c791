"""``Offload(activations="auto")``: which stages' activations to offload, chosen from the costs.

Traffic-aware, as LoHan's activation swapping: a stage's ``AO g`` copy runs while the next
forward computes, and its ``AF g`` copy while the backward before ``B g`` computes
(:mod:`shfx.passes.activations`); the copy is *hidden* when it takes no longer than that
compute. :func:`choose_activation_offload` takes the hidden stages first (earliest forward
first: their activations wait the longest), then, only if the device budget still is not met,
the others by how much of their copy would show; it stops as soon as the memory ledger's peak
fits. With no budget, or one the program fits without offload, it offloads nothing.

What it does not model: the copies share the link with the prefetches and gradient copies
(the simulator does: :func:`shfx.cost_model.simulate.simulate` of the chosen program is the
step time to trust), and the hidden test looks at one neighbouring action each way.

>>> from shfx.passes.stages import chain
>>> from shfx.passes.policies import Resident
>>> from shfx.cost_model.costs import CostTable, Links, StageCost
>>> p = Resident().program(chain(8, prefetch_bytes=100, activation_bytes=10**6))
>>> fast = CostTable([StageCost(0.01, 0.02)] * 8, Links(1e9, 1e9))   # a copy takes 1 ms: hidden
>>> choose_activation_offload(p, fast, budget_bytes=None)
()
>>> from shfx.passes.ledger import replay
>>> peak = replay(p).peak()
>>> choose_activation_offload(p, fast, budget_bytes=peak - 2 * 10**6)   # two stages' activations too many
(1, 2)
"""

from __future__ import annotations

from shfx.passes.activations import eligible_stages, offloaded_bytes
from shfx.passes.features import activation_offload_program
from shfx.passes.ledger import replay
from shfx.passes.meta import get_meta
from shfx.passes.program import Program

from .costs import CostTable

__all__ = ["choose_activation_offload", "exposed_copy_s"]


def exposed_copy_s(program: Program, costs: CostTable, stage: int) -> float:
    """Seconds of ``stage``'s activation copies that no compute hides: its ``AO`` copy beyond
    the next forward, plus its ``AF`` copy beyond the backward just before its own (in the
    program's compute order), at the links' rates (and latency)."""
    acts = [get_meta(n).action for n in program.nodes]
    fwd = [a.stage for a in acts if a.kind.value == "F"]
    back = [a.stage for a in acts if a.kind.value == "B"]
    nbytes = offloaded_bytes(program.stages, stage)
    links = costs.links

    def copy_s(bps: float | None) -> float:
        return links.latency_s + (nbytes / bps if bps else 0.0)

    i = fwd.index(stage)
    fwd_cover = costs.costs[fwd[i + 1]].forward_s if i + 1 < len(fwd) else 0.0
    j = back.index(stage)
    back_cover = costs.costs[back[j - 1]].backward_s if j > 0 else 0.0
    return max(0.0, copy_s(links.d2h_bps) - fwd_cover) + max(0.0, copy_s(links.h2d_bps) - back_cover)


def choose_activation_offload(program: Program, costs: CostTable, budget_bytes: int | None) -> tuple[int, ...]:
    """The stages whose activations ``Offload(activations="auto")`` offloads for ``program``
    (see the module docstring): none when ``budget_bytes`` is None or the program's memory
    ledger peak fits it; else hidden stages first, then the least exposed, until the peak fits
    (every eligible stage when even that does not fit: the capacity check then says so)."""
    if budget_bytes is None or replay(program).peak() <= budget_bytes:
        return ()
    acts = [get_meta(n).action for n in program.nodes]
    order = eligible_stages(acts, program.stages)
    exposed = {s: exposed_copy_s(program, costs, s) for s in order}
    ranked = [s for s in order if exposed[s] == 0.0] + sorted((s for s in order if exposed[s] > 0.0), key=lambda s: exposed[s])
    chosen: list[int] = []
    for s in ranked:
        chosen.append(s)
        if replay(activation_offload_program(program, tuple(chosen))).peak() <= budget_bytes:
            break
    return tuple(sorted(chosen))
