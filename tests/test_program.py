"""The step-program IR: action strings, lowering, golden programs of the window policy."""

from __future__ import annotations

import pytest

from shfx.passes.meta import get_meta
from shfx.passes.program import Action, ActionKind, ScheduleError, lower_actions
from shfx.passes.schedule import check_window, cold_backward_program, eval_program, schedule_window, window_actions
from shfx.passes.stages import StageSpec, chain


@pytest.mark.parametrize("s", ["PF0", "F3", "R12", "B7", "OG2", "OB4", "U0", "DU5", "OP1", "GN3", "SR2", "SW10", "RS3", "AG11", "SN4", "US6", "AO3", "AW3", "AR12", "AF1"])
def test_action_round_trip(s):
    a = Action.from_str(s)
    assert str(a) == s
    assert Action.from_str(str(a)) == a


@pytest.mark.parametrize("bad", ["", "P3", "PF", "X1", "F-1", "pf3", "F3x"])
def test_action_from_str_rejects(bad):
    with pytest.raises(ValueError, match="cannot read action"):
        Action.from_str(bad)


def test_streams_of_kinds():
    assert {k: k.stream for k in ActionKind} == {
        ActionKind.PREFETCH: "h2d",
        ActionKind.FORWARD: "compute",
        ActionKind.OFFLOAD_BUFFERS: "d2h",
        ActionKind.RELEASE: "none",
        ActionKind.BACKWARD: "compute",
        ActionKind.OFFLOAD_GRAD: "d2h",
        ActionKind.CPU_STEP: "cpu",
        ActionKind.DEVICE_STEP: "compute",
        ActionKind.OFFLOAD_PARAMS: "d2h",
        ActionKind.GRAD_NORM: "cpu",
        ActionKind.SSD_READ: "ssd_read",
        ActionKind.SSD_WRITE: "ssd_write",
        ActionKind.REDUCE_GRADS: "reduce",
        ActionKind.GATHER_PARAMS: "gather",
        ActionKind.NORM_REDUCE: "reduce",
        ActionKind.CHECK: "cpu",
        ActionKind.SNAPSHOT: "cpu",
        ActionKind.UNSCALE: "cpu",
        ActionKind.OFFLOAD_ACTIVATIONS: "d2h",
        ActionKind.FETCH_ACTIVATIONS: "h2d",
        ActionKind.PARAM_READ: "ssd_read",
        ActionKind.PARAM_DROP: "ssd_write",
        ActionKind.PARAM_WRITE: "ssd_write",
        ActionKind.ACTIVATION_WRITE: "ssd_write",
        ActionKind.ACTIVATION_READ: "ssd_read",
    }


GOLDEN = {
    (4, 1): "PF0 F0 R0 PF1 F1 R1 PF2 F2 R2 PF3 F3 B3 OG3 U3 R3 PF2 B2 OG2 U2 R2 PF1 B1 OG1 U1 R1 PF0 B0 OG0 U0 R0",
    (4, 2): "PF0 PF1 F0 R0 PF2 F1 R1 PF3 F2 F3 B3 OG3 U3 R3 PF1 B2 OG2 U2 R2 PF0 B1 OG1 U1 R1 B0 OG0 U0 R0",
    (4, 3): "PF0 PF1 PF2 F0 R0 PF3 F1 F2 F3 B3 OG3 U3 R3 PF0 B2 OG2 U2 R2 B1 OG1 U1 R1 B0 OG0 U0 R0",
    (4, 4): "PF0 PF1 PF2 PF3 F0 F1 F2 F3 B3 OG3 U3 R3 B2 OG2 U2 R2 B1 OG1 U1 R1 B0 OG0 U0 R0",
    (3, 2): "PF0 PF1 F0 R0 PF2 F1 F2 B2 OG2 U2 R2 PF0 B1 OG1 U1 R1 B0 OG0 U0 R0",
    (1, 1): "PF0 F0 B0 OG0 U0 R0",
}


@pytest.mark.parametrize("n,w", sorted(GOLDEN))
def test_golden_window_programs(n, w):
    assert " ".join(schedule_window(chain(n), w).actions()) == GOLDEN[(n, w)]


def test_window_larger_than_stages_is_all_resident():
    assert schedule_window(chain(4), 10).actions() == schedule_window(chain(4), 4).actions()
    assert schedule_window(chain(4), 10).num_slots == 4


def test_golden_mutating_and_tied():
    """A stage that mutates buffers gets OB after its F; a tied parameter (group 0 used by
    stage 3) makes U0 wait for both OG3 and OG0, and U0 comes last."""
    p = schedule_window(chain(4, mutating=(1,), tied=(0, 3)), 2)
    assert " ".join(p.actions()) == (
        "PF0 PF1 F0 R0 PF2 F1 OB1 R1 PF3 F2 F3 B3 OG3 U3 R3 PF1 B2 OG2 U2 R2 PF0 B1 OG1 U1 R1 B0 OG0 U0 R0"
    )
    u0 = p.find("U0")
    assert sorted(str(get_meta(d).action) for d in p.deps(u0)) == ["OG0", "OG3"]
    # R1 in forward waits for OB1 (the slot is read by the buffer copy)
    r1 = p.find("R1", phase="forward")
    assert {str(get_meta(d).action) for d in p.deps(r1)} == {"F1", "OB1"}


def test_golden_eval_and_cold():
    p = schedule_window(chain(4), 2)
    assert " ".join(eval_program(p).actions()) == "PF0 PF1 F0 R0 PF2 F1 R1 PF3 F2 F3 R2 R3"
    assert " ".join(cold_backward_program(p).actions()) == (
        "PF2 PF3 B3 OG3 U3 R3 PF1 B2 OG2 U2 R2 PF0 B1 OG1 U1 R1 B0 OG0 U0 R0"
    )
    assert all(get_meta(n).phase == "backward" for n in cold_backward_program(p).nodes)


def test_dependencies_and_slots():
    p = schedule_window(chain(4), 2)
    deps = {str(get_meta(n).action) + "@" + get_meta(n).phase[0]: sorted(str(get_meta(d).action) for d in p.deps(n)) for n in p.nodes}
    assert deps["PF2@f"] == ["R0"]  # slot reuse waits for the release
    assert deps["F2@f"] == ["F1", "PF2"]  # its prefetch and its producer
    assert deps["B2@b"] == ["B3", "F2", "PF2"]  # residency, checkpoint, output gradient
    assert deps["R3@b"] == ["B3", "F3", "OG3"]  # every reader of the slot
    assert deps["U1@b"] == ["OG1"]
    slots = [(str(get_meta(n).action), get_meta(n).slot) for n in p.nodes if get_meta(n).kind == ActionKind.PREFETCH]
    assert slots == [("PF0", 0), ("PF1", 1), ("PF2", 0), ("PF3", 1), ("PF1", 1), ("PF0", 0)]


def test_keep_graph_only_for_last_forward():
    p = schedule_window(chain(4), 2)
    kept = [str(get_meta(n).action) for n in p.nodes if get_meta(n).keep_graph]
    assert kept == ["F3"]
    assert not any(get_meta(n).keep_graph for n in eval_program(p).nodes)


def test_bytes_moved_per_step():
    """Params in once per forward and once per backward per streamed stage, grads out once."""
    specs = chain(5, prefetch_bytes=1000, grad_bytes=800)
    for w in range(1, 6):
        p = schedule_window(specs, w)
        assert p.bytes_moved() == {"h2d": 1000 * (5 + 5 - w), "d2h": 800 * 5}
        assert p.count(ActionKind.PREFETCH, "backward") == 5 - w


def test_lowering_errors_name_the_action():
    specs = chain(3)
    with pytest.raises(ScheduleError, match=r"#1 F1 .*stage 1 is not resident"):
        lower_actions(["PF0", "F1"], specs, 2)
    with pytest.raises(ScheduleError, match=r"all 1 slots are in use \(slot 0: stage 0\)"):
        lower_actions(["PF0", "PF1"], specs, 1)
    with pytest.raises(ScheduleError, match="needs F0"):
        lower_actions(["PF1", "F1"], specs, 2)
    with pytest.raises(ScheduleError, match="needs B2"):
        lower_actions(["PF0", "PF1", "PF2", "F0", "F1", "F2", "B1"], specs, 3)
    with pytest.raises(ScheduleError, match="already resident"):
        lower_actions(["PF0", "PF0"], specs, 2)
    with pytest.raises(ScheduleError, match="cannot come after the first BACKWARD"):
        lower_actions(["PF0", "F0", "B0", "F0"], chain(1), 1)
    with pytest.raises(ScheduleError, match="there is no stage 7"):
        lower_actions(["PF7"], specs, 1)
    with pytest.raises(ScheduleError, match="mutates no buffers"):
        lower_actions(["PF0", "F0", "OB0"], specs, 1)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, None])
def test_invalid_window(bad):
    with pytest.raises(ValueError, match="window must be"):
        check_window(bad, 4)


def test_stage_spec_rejects_backward_edges():
    with pytest.raises(ValueError, match="may only read from earlier stages"):
        StageSpec(index=1, producers=frozenset({2}))


def test_program_prints_a_table():
    text = str(schedule_window(chain(3), 2))
    assert "program 'stronghold(W=2)': 3 stages, 2 slots" in text
    assert "PF2" in text and "waits for" in text and "(keeps graph)" in text


def test_window_actions_verifies_over_grid():
    from shfx.passes.verify import verify_program

    for n in range(1, 7):
        for w in range(1, n + 2):
            for tied in (None, (0, n - 1)) if n > 1 else (None,):
                specs = chain(n, mutating=tuple(range(0, n, 2)), tied=tied)
                p = schedule_window(specs, w)
                verify_program(p, "train")
                verify_program(eval_program(p), "eval")
                verify_program(cold_backward_program(p), "backward")
                assert window_actions(specs, w) == [get_meta(x).action for x in p.nodes]


def test_slots_sized_to_the_stages_they_hold():
    """Stage i sits in slot i mod W; a slot holding only blocks is block-sized even when the
    embedding stage is larger."""
    from dataclasses import replace

    specs = chain(6, prefetch_bytes=100)
    specs[0] = replace(specs[0], slot_bytes=500)  # the head (embeddings) is the largest stage
    specs[5] = replace(specs[5], slot_bytes=450)  # the tail borrows it
    p = schedule_window(specs, 3)
    assert p.slot_sizes() == [500, 100, 450]  # head in slot 0, tail (5 mod 3 = 2) in slot 2
    assert cold_backward_program(p).slot_sizes() == [s for s in p.slot_sizes()]
    assert schedule_window(specs, 4).slot_sizes() == [500, 450, 100, 100]  # 5 mod 4 = 1
    assert schedule_window(specs, 5).slot_sizes() == [500, 100, 100, 100, 100]  # 5 mod 5 = 0: the tail shares the head's slot
    assert schedule_window(specs, 6).slot_sizes() == [500, 100, 100, 100, 100, 450]  # all resident
