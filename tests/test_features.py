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
    with pytest.raises(PassRefused, match=r"exact-clipping .* requires every group updated on the device owned by a "
                                          r"persistent stage .* groups \[0, 1, 2\] .* streamed stages.* Fix: use "
                                          r"policy='resident'"):  # fmt: skip
        EXACT_CLIPPING(L2L().program(chain(3)))
    with pytest.raises(PassRefused, match="updates that finish within the step.*delayed update"):
        EXACT_CLIPPING(ZeroOffload(delayed_update=True).program(chain(3)))
    clipped = EXACT_CLIPPING(Stronghold(window=2).program(chain(3)))
    with pytest.raises(PassRefused, match="does not clip yet"):
        EXACT_CLIPPING(clipped)
    dp = DATA_PARALLEL(Stronghold(window=2).program(chain(3)), ranks=2)
    with pytest.raises(PassRefused, match="run exact-clipping before data-parallel"):
        EXACT_CLIPPING(dp)
    with pytest.raises(PassRefused, match="data-parallel .* requires one rank, but it is data parallel already"):
        DATA_PARALLEL(dp, ranks=2)
    # (a device-updated group runs replicated: its gradient all-reduced by RS before its DU; issue 25)
    dev = DATA_PARALLEL(Stronghold(window=2, resident_first=1).program(chain(3)), ranks=2)
    assert dev.actions()[-3:] == ["B0", "RS0", "DU0"]


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


def test_device_updates_clip_where_their_gradients_stay():
    """issue 25: a group updated on the device by a persistent stage (Resident, resident_first)
    is clipped (its GN on the device, its DU after the gate); L2L's streamed stages are refused
    (their gradients leave the device with the slot)."""
    for pol in (Resident(), Stronghold(window=2, resident_first=1)):
        p = EXACT_CLIPPING(pol.program(chain(3)))
        verify_program(p)
        assert p.actions("step") == ["CK0"] and "DU0" in p.actions("next-forward")
    with pytest.raises(PassRefused, match="streamed stages"):
        EXACT_CLIPPING(L2L().program(chain(3)))


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


def _train_against_eager(policy, steps=3, **kw):
    """shfx and eager AdamW(fused) side by side, one seed at the start only (no reseeding)."""
    import copy
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from zoo import gpt_tied, token_batch

    torch.manual_seed(0)
    model = gpt_tied()
    ref = copy.deepcopy(model)
    cm = shfx.compile(model, device=shfx.EmulatedDevice(memory="256MiB", h2d=None, d2h=None), policy=policy,
                      optimizer=shfx.optim.AdamW(lr=1e-2), **kw)  # fmt: skip
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    clip = kw.get("max_grad_norm")
    for step in range(steps):
        (x, y), _, _ = token_batch(step)
        loss = cm(x, y)
        loss.backward()
        cm.step()
        cm.zero_grad()
        ref_loss = ref(x, y)
        ref_loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad()
        assert torch.equal(loss.detach(), ref_loss.detach()), (step, loss.item(), ref_loss.item())
    cm.sync()
    for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), k
    return cm


@pytest.mark.parametrize(
    "policy, kw",
    [
        # the persistent stages are refreshed after the updates (before the step phase, they were
        # refreshed in the backward, before step() updated: the second step trained on stale weights)
        (ZeroOffload(), {}),
        (ZeroOffload(), {"max_grad_norm": 0.05}),  # clipped in step(): GN in the backward, the gate, then U
        (Stronghold(window=2, resident_first=1), {}),  # a device update (DU) in the step phase
        (Stronghold(window=2), {"max_grad_norm": 0.05}),
    ],
    ids=["zero-offload", "zero-offload-clip", "stronghold-k1", "stronghold-clip"],
)
def test_updates_in_step_train_as_eager(policy, kw):
    """overlap_update=False: the updates-in-step pass puts the gate, every update and the
    refreshes in the step phase, and training equals eager bitwise."""
    cm = _train_against_eager(policy, overlap_update=False, **kw)
    prog = cm.variant.train
    assert prog.updates_in_step and prog.actions("step")[0] == "CK0"
    assert not [a for a in prog.actions("backward") if a[:1] == "U" or a[:2] == "DU"]
    cm.close()


def test_updates_in_step_golden():
    from shfx.passes.features import UPDATES_IN_STEP

    p = UPDATES_IN_STEP(ZeroOffload().program(chain(2)))
    assert " ".join(p.actions()) == "F0 F1 B1 OG1 B0 OG0 CK0 U0 U1 PF0 PF1"
    assert p.actions("step") == ["CK0", "U0", "U1", "PF0", "PF1"]
    assert {d.name for d in p.deps(p.find("PF0", "step"))} >= {"u0"}  # the refresh reads the update
    p = UPDATES_IN_STEP(Stronghold(window=2).program(chain(3)), clip=True)
    assert " ".join(p.actions()).endswith("B0 OG0 GN0 R0 CK0 U2 U1 U0")
    verify_program(p)
    dp = DATA_PARALLEL(UPDATES_IN_STEP(Stronghold(window=2).program(chain(3))), ranks=2)
    # (no norms: NR0 agrees every rank's finite check before the gate; every update waits for it)
    assert dp.actions("step") == ["NR0", "CK0", "U2", "AG2", "U1", "AG1", "U0", "AG0"]
    assert {d.name for d in dp.deps(dp.find("U2"))} == {"og2", "rs2", "ck0"}
    verify_program(dp)
    k1 = UPDATES_IN_STEP(Stronghold(window=2, resident_first=1).program(chain(3)), clip=True)
    assert " ".join(k1.actions()).endswith("B0 GN0 CK0 U2 U1 DU0")  # (GN0 on the device, after B0)
    verify_program(k1)


def test_a_data_parallel_gate_needs_the_reduction_first():
    """Under data parallel every gate reduces across ranks first (NR0: the norms, or without
    them the finite check), also the unclipped gate of updates in step(); NR0 without norms is
    only for that gate, or the verdict after the overlapped updates (rollback: the test below);
    elsewhere it has nothing to combine."""
    from shfx.passes.program import lower_actions

    tail = "F0 F1 B1 OG1 RS1 R1 B0 OG0 RS0 R0"
    lower_actions(f"PF0 PF1 {tail} NR0 CK0 U0 AG0 U1 AG1".split(), chain(2), 2, ranks=2, updates_in_step=True)
    with pytest.raises(ScheduleError, match=r"CK0 .*NR0 \(norm_reduce across the 2 ranks\) first"):
        lower_actions(f"PF0 PF1 {tail} CK0 U0 AG0 U1 AG1".split(), chain(2), 2, ranks=2, updates_in_step=True)
    with pytest.raises(ScheduleError, match="combines the gradient norms"):
        lower_actions(f"PF0 PF1 {tail} NR0 CK0 U0 AG0 U1 AG1".split(), chain(2), 2, ranks=2)


def test_clipping_in_step_with_device_updates_runs():
    """issue 25 (was refused at the first call): Resident with max_grad_norm and
    overlap_update=False clips in step() (tests/test_clipping.py checks it against eager)."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    cm = shfx.compile(model, device=shfx.EmulatedDevice(memory="64MiB", h2d=None, d2h=None), blocks=False, num_stages=2,
                      policy="resident", optimizer=shfx.optim.AdamW(lr=1e-2), max_grad_norm=0.1, overlap_update=False)  # fmt: skip
    cm(torch.randn(3, 4)).sum().backward()
    cm.step()
    assert cm.program.actions("step") == ["CK0", "DU1", "DU0"] and cm.last_grad_norm is not None
    cm.close()


def test_the_simulator_starts_the_step_phase_after_the_backward():
    """step() runs after loss.backward() returned: the simulated step phase (the gate and, with
    the updates in step(), every update) starts once the backward's other actions are done."""
    from shfx.cost_model.costs import CostTable, Links, StageCost
    from shfx.cost_model.simulate import simulate
    from shfx.passes.features import UPDATES_IN_STEP

    costs = CostTable([StageCost(1.0, 3.0, update_s=0.5)] * 4, Links(1e6, 1e6))
    p = Stronghold(window=2).program(chain(4, prefetch_bytes=500_000))
    q = UPDATES_IN_STEP(p)
    over, in_step = simulate(p, costs), simulate(q, costs)
    assert in_step.step_s > over.step_s  # the updates no longer overlap the backward
    backward_end = max(e.end for e in in_step.events if e.phase == "backward")
    assert all(e.start >= backward_end for e in in_step.events if e.phase == "step")


# ---- rollback: the journal's copies as actions ------------------------------------------------------


def test_rollback_golden_and_composition():
    """The rollback pass puts SN g (the journal's copy) right before each host update, in its
    phase, the update waiting for it; it composes with clipping and updates-in-step, and the
    verifier's every rule holds."""
    from shfx.passes.features import ROLLBACK, UPDATES_IN_STEP

    p = ROLLBACK(Stronghold(window=2).program(chain(3)))
    assert " ".join(p.actions()) == "PF0 PF1 F0 R0 PF2 F1 F2 B2 OG2 SN2 U2 R2 PF0 B1 OG1 SN1 U1 R1 B0 OG0 SN0 U0 R0"
    assert [d.name for d in p.deps(p.find("U2"))] == ["og2", "sn2"]
    assert [d.name for d in p.deps(p.find("SN2"))] == ["og2"]
    verify_program(p)
    clipped = ROLLBACK(EXACT_CLIPPING(Stronghold(window=2).program(chain(3))))
    assert clipped.actions("next-forward") == ["SN0", "U0", "SN1", "U1", "SN2", "U2"]
    assert all(clipped.find("CK0") in clipped.deps(clipped.find(f"SN{g}")) for g in range(3))
    verify_program(clipped)
    stepped = ROLLBACK(UPDATES_IN_STEP(ZeroOffload().program(chain(2))))
    assert stepped.actions("step") == ["CK0", "SN0", "U0", "SN1", "U1", "PF0", "PF1"]
    verify_program(stepped)
    # a device update copies its slot region inside its own action: nothing to add
    k1 = Stronghold(window=2, resident_first=1).program(chain(3))
    assert ROLLBACK(k1).actions() == [a if not a.startswith("U") else a for a in ROLLBACK(k1).actions()]
    assert "SN0" not in ROLLBACK(k1).actions() and "DU0" in ROLLBACK(k1).actions()


def test_rollback_refusals_live_with_the_pass():
    from shfx.passes.features import ROLLBACK

    # (issue 25: the NVMe tier rolls back: the states' undo is their previous version on the SSD,
    # SN copies the master and step; the verifier's rules hold on the program)
    ssd = ROLLBACK(Stronghold(window=2, nvme=True, host_window=2).program(chain(3)))
    acts = ssd.actions()
    assert all(acts.index(f"SR{g}") < acts.index(f"SN{g}") < acts.index(f"U{g}") < acts.index(f"SW{g}") for g in range(3))
    verify_program(ssd)
    with pytest.raises(PassRefused, match="does not copy its groups yet"):
        ROLLBACK(ROLLBACK(Stronghold(window=2).program(chain(3))))


def test_rollback_under_data_parallel_ends_the_overlapped_step_with_its_verdict():
    """Data parallel with the updates during the backward (issue 25): the rollback pass ends the
    program with NR0, the step's verdict, waiting for every copy, update and all-gather (each
    rank's outcome agreed before any rank commits); with a gate before the updates (clipping, the
    updates in step()) the finite check is agreed there already: no second NR0. An action after
    the verdict is refused by the lowering."""
    from shfx.passes.features import LOSS_SCALING, ROLLBACK, UPDATES_IN_STEP
    from shfx.passes.program import lower_actions

    p = ROLLBACK(DATA_PARALLEL(Stronghold(window=2).program(chain(3)), ranks=2))
    verify_program(p)
    acts = p.actions()
    assert acts[-1] == "NR0" and acts.count("NR0") == 1 and p.actions("backward")[-1] == "NR0"
    waits = {d.name for d in p.deps(p.find("NR0"))}
    assert {f"{k}{g}" for k in ("sn", "u", "ag") for g in range(3)} <= waits
    fp16 = ROLLBACK(LOSS_SCALING(DATA_PARALLEL(ZeroOffload().program(chain(2)), ranks=2)))
    verify_program(fp16)
    assert fp16.actions()[-1] == "NR0" and {"us0", "us1"} <= {d.name for d in fp16.deps(fp16.find("NR0"))}
    for gated in (
        ROLLBACK(DATA_PARALLEL(EXACT_CLIPPING(Stronghold(window=2).program(chain(3))), ranks=2)),
        ROLLBACK(DATA_PARALLEL(UPDATES_IN_STEP(Stronghold(window=2).program(chain(3))), ranks=2)),
    ):
        verify_program(gated)
        assert gated.actions().count("NR0") == 1 and gated.actions("step")[:2] == ["NR0", "CK0"]
    one = ROLLBACK(Stronghold(window=2).program(chain(2)))
    assert "NR0" not in one.actions()
    with pytest.raises(ScheduleError, match="verdict NR0 .* ends the step"):
        lower_actions(["PF0", "F0", "B0", "OG0", "RS0", "U0", "AG0", "NR0", "SN0"], chain(1), 1, ranks=2)


def test_a_program_without_the_copy_is_refused_by_the_verifier():
    from shfx.passes.program import lower_actions
    from shfx.passes.verify import VerificationError

    specs = chain(2)
    bad = lower_actions(["F0", "F1", "B1", "OG1", "SN1", "U1", "B0", "OG0", "U0"], specs, 2, persistent=(0, 1))
    with pytest.raises(VerificationError, match=r"U0 \(#8\) updates group 0 before the step journal copied it \(SN0\)"):
        verify_program(bad)


def test_compile_with_rollback_runs_the_copies_from_the_program():
    """shfx.compile(rollback=True): the train program has the copies (the pipeline runs the
    pass) and the engine runs each as an action, once per group and step; a step whose update
    fails after others ran is undone exactly, and retried it trains as eager."""
    from tests.faults import FaultInjector
    from tests.test_failures_engine import Pair

    p = Pair(shfx.Stronghold(window=2), rollback=True)
    with FaultInjector(p.cm.backend, "SN", None) as snaps:
        p.step_both()
    prog = p.cm.variant.train
    copies = [a for a in prog.actions("backward") if a.startswith("SN")]
    assert len(copies) == len([a for a in prog.actions("backward") if a.startswith("U")]) == snaps.count > 0
    p.assert_same()
    with FaultInjector(p.cm.backend, "U", 2):  # the second update fails: the first ran (after its copy)
        p.cm(*p.batch()).backward()
        with pytest.raises(shfx.ActionError, match="optimizer update U") as ei:
            p.cm.step()
    assert "were rolled back" in str(ei.value)
    p.assert_same()  # undone from the copies: the state before the step
    p.cm.step()  # the whole step again, once
    p.cm.zero_grad()
    p.eager_step()
    p.assert_same()


# ---- the delayed update: one step stale, in the program ---------------------------------------------


def test_delayed_update_golden():
    """ZeroOffload(delayed_update=True) lowers through the delayed-update pass: the refresh of
    the slots in step() (phase step), then the host updates (phase delayed), which the next
    step's gradient copies wait for in the steady state; the forward does not wait for them."""
    from shfx.passes.features import DELAYED_UPDATE, delayed_update
    from shfx.passes.schedule import steady_state_program

    p = ZeroOffload(delayed_update=True).program(chain(3))
    assert p.updates_delayed and not p.updates_outside
    assert p.actions("step") == ["PF0", "PF1", "PF2"] and p.actions("delayed") == ["U0", "U1", "U2"]
    assert p.actions() == delayed_update(ZeroOffload().program(chain(3))).actions()
    verify_program(p)
    steady = steady_state_program(p)
    assert steady.actions()[:3] == ["U0", "U1", "U2"]  # the previous step's, from time 0
    assert {d.name for d in steady.deps(steady.find("OG1"))} == {"b1", "u1_prev"}
    assert [d.name for d in steady.deps(steady.find("F0"))] == []  # trains on the weights before them
    with pytest.raises(PassRefused, match="delayed-update cannot run .* does not clip"):
        DELAYED_UPDATE(EXACT_CLIPPING(ZeroOffload().program(chain(3))))
    with pytest.raises(PassRefused, match="delayed-update cannot run .* one rank"):
        DELAYED_UPDATE(DATA_PARALLEL(ZeroOffload().program(chain(3)), ranks=2))


def test_the_simulator_overlaps_the_delayed_update_with_the_next_step():
    """The delayed updates are on the timeline: the previous step's run beside this step's
    forward, so the step is shorter than ZeRO-Offload's update after the backward by them."""
    from shfx.cost_model.costs import CostTable, Links, StageCost
    from shfx.cost_model.simulate import simulate

    costs = CostTable([StageCost(1.0, 3.0, update_s=0.5)] * 3, Links(1e6, 1e6))
    plain = simulate(ZeroOffload().program(chain(3)), costs)
    delayed = simulate(ZeroOffload(delayed_update=True).program(chain(3)), costs)
    updates = [e for e in delayed.events if e.action.startswith("U")]
    assert [(e.start, e.end) for e in updates] == [(0.0, 0.5), (0.5, 1.0), (1.0, 1.5)]
    assert delayed.step_s == pytest.approx(plain.step_s - 0.5)  # the updates no longer end the step


def test_the_tuner_prices_the_program_that_will_run():
    """tune_window runs the configuration's feature passes on every candidate before timing it
    (candidate_passes of the train program): with the updates in step() and the journal's
    copies, each window's simulated step has them, and is slower than the plain program's."""
    from shfx.cost_model.costs import CostTable, Links, StageCost
    from shfx.cost_model.tune import tune_window
    from shfx.passes.features import ROLLBACK, UPDATES_IN_STEP
    from shfx.passes.pipeline import candidate_passes

    specs = chain(4, prefetch_bytes=500_000)
    costs = CostTable([StageCost(1.0, 3.0, update_s=0.5)] * 4, Links(1e6, 1e6))
    plain = tune_window(specs, costs, policy=Stronghold(window="auto"))
    features = candidate_passes(ROLLBACK(UPDATES_IN_STEP(Stronghold(window=2).program(specs))))
    assert [p.name for p, _ in features] == ["updates-in-step", "rollback"]
    priced = tune_window(specs, costs, policy=Stronghold(window="auto"), features=features)
    for a, b in zip(plain.rows, priced.rows):
        acts = {e.action for e in b.timeline.events}
        assert {"CK0", "SN0", "U0"} <= acts and not any(e.action.startswith("SN") for e in a.timeline.events)
        assert b.step_s > a.step_s
