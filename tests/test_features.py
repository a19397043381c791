"""Feature passes (shfx.passes.features): program-to-program, with stated pre- and
postconditions, composing in order; exact clipping is one such pass (the policies' deferred
update lowers through it), data parallel another."""

from __future__ import annotations

import dataclasses

import pytest

import shfx
from shfx.passes.features import DATA_PARALLEL, EXACT_CLIPPING, FeaturePass, PassRefused, clip_program, feature_passes, run_passes
from shfx.passes.meta import get_meta
from shfx.passes.policies import L2L, Resident, Stronghold, ZeroInfinity, ZeroOffload
from shfx.passes.program import ScheduleError
from shfx.passes.stages import chain
from shfx.passes.verify import verify_program

HOST_POLICIES = [
    Stronghold(window=1), Stronghold(window=2), Stronghold(window=4), ZeroOffload(), ZeroInfinity(),
    Stronghold(window=2, nvme=True, host_window=2), ZeroInfinity(nvme=True, host_window=1),
]  # fmt: skip


@pytest.mark.parametrize("policy", HOST_POLICIES, ids=repr)
@pytest.mark.parametrize("n", [1, 3, 5])
def test_clipping_pass_is_the_policies_deferred_update(policy, n):
    """The pass over a policy's program gives the program of the policy's deferred update
    (the policy lowers through it: one description), and it verifies."""
    got = EXACT_CLIPPING(policy.program(chain(n)))
    want = policy.replace(deferred_update=True).program(chain(n))
    assert got.actions() == want.actions()
    assert [get_meta(x).phase for x in got.nodes] == [get_meta(x).phase for x in want.nodes]
    verify_program(got)


@pytest.mark.parametrize("policy", HOST_POLICIES[:5], ids=repr)
def test_clipping_then_data_parallel_compose(policy):
    """Clipping, then data parallel: the norms reduced across ranks (NR0) before the gate, an
    all-gather after every clipped update; the verifier's every rule holds."""
    p = run_passes(policy.program(chain(3)), feature_passes(clip=True, ranks=2), verify=verify_program)
    assert p.actions("step") == ["NR0", "CK0"]
    tail = p.actions("next-forward")
    assert [a for a in tail if a.startswith("U")] == ["U0", "U1", "U2"]
    assert all(tail[tail.index(f"U{g}") + 1] == f"AG{g}" for g in range(3))
    verify_program(p)


def test_requirements_refuse_naming_pass_condition_and_fix():
    with pytest.raises(PassRefused, match=r"exact-clipping .* requires every parameter group updated on the host, but "
                                          r"groups \[0\] .* Fix: use Stronghold\(resident_first=0\)"):  # fmt: skip
        EXACT_CLIPPING(Stronghold(window=2, resident_first=1).program(chain(3)))
    with pytest.raises(PassRefused, match="updates that finish within the step.*delayed update"):
        EXACT_CLIPPING(ZeroOffload(delayed_update=True).program(chain(3)))
    clipped = EXACT_CLIPPING(Stronghold(window=2).program(chain(3)))
    with pytest.raises(PassRefused, match="does not clip yet"):
        EXACT_CLIPPING(clipped)
    dp = DATA_PARALLEL(Stronghold(window=2).program(chain(3)), ranks=2)
    with pytest.raises(PassRefused, match="run exact-clipping before data-parallel"):
        EXACT_CLIPPING(dp)
    with pytest.raises(PassRefused, match="data-parallel .* every parameter group updated on the host"):
        DATA_PARALLEL(Stronghold(window=2, resident_first=1).program(chain(3)), ranks=2)


def test_a_broken_guarantee_names_the_pass():
    """A pass whose output breaks what it ensures (here: the gate dropped) fails naming it."""

    def no_gate(program):
        out = clip_program(program)
        ck = out.find("CK0")
        for n in out.nodes:
            n.args = tuple(a for a in n.args if a is not ck)
        out.graph.erase_node(ck)
        return out

    broken = dataclasses.replace(EXACT_CLIPPING, transform=no_gate)
    with pytest.raises(ScheduleError, match="pass exact-clipping broke its guarantee.*gate CK0"):
        broken(Stronghold(window=2).program(chain(3)))


def test_verify_each_names_the_pass_that_broke_an_invariant():
    def drop_ag(program, ranks):
        out = DATA_PARALLEL.transform(program, ranks=ranks)
        ag = out.find("AG1")
        for n in out.nodes:
            n.args = tuple(a for a in n.args if a is not ag)
        out.graph.erase_node(ag)
        return out

    quiet = FeaturePass("drop-ag", requires=(), ensures=(), transform=drop_ag)
    with pytest.raises(ScheduleError, match="(?s)after pass drop-ag: .*not followed by an AG1"):
        run_passes(Stronghold(window=2).program(chain(3)), [(quiet, {"ranks": 2})], verify=verify_program)


def test_policies_without_host_updates_are_refused_by_the_pass():
    for pol in (Resident(), L2L()):
        prog = pol.program(chain(3))
        if prog.device_groups():
            with pytest.raises(PassRefused, match="updated on the host"):
                EXACT_CLIPPING(prog)
        else:
            verify_program(EXACT_CLIPPING(prog))


def test_compile_time_clipping_prints_the_gate():
    """shfx.compile(max_grad_norm=...) runs the pass's program: the gate in step()."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    cm = shfx.compile(model, device=shfx.EmulatedDevice(memory="64MiB", h2d=None, d2h=None), blocks=False, num_stages=2,
                      optimizer=shfx.optim.AdamW(lr=1e-2), max_grad_norm=0.1)  # fmt: skip
    cm(torch.randn(3, 4)).sum().backward()
    cm.step()
    assert cm.variant.train.actions("step") == ["CK0"]
    assert [a for a in cm.variant.train.actions("next-forward")] == ["U0", "U1"]
    cm.close()


def test_the_worked_example_of_docs_design_runs():
    """docs/design.md, "Adding a feature pass": its code runs as printed and gives the program
    of the exact-clipping pass."""
    import re
    from pathlib import Path

    text = Path(__file__).parent.parent.joinpath("docs", "design.md").read_text()
    section = text.split("## Adding a feature pass", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    ns: dict = {}
    exec(compile(code, "docs/design.md", "exec"), ns)
    base = Stronghold(window=2).program(chain(3))
    p = ns["CLIP"](base)
    assert " ".join(p.actions()).endswith("B0 OG0 GN0 R0 CK0 U0 U1 U2")
    assert p.actions() == EXACT_CLIPPING(base).actions()
    verify_program(p)
